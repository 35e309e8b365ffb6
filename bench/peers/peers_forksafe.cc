// bench/peers/peers_forksafe.cc: the side-by-side workloads (docs/peers.md) written with forksafe.
// peers_torch.py and peers_mp.py do the same work, check the same results and print the same
// JSON lines (bench/peers/harness.h), under the same iteration plan (bench/peers/plan.txt).
//
//   bazel build //bench/peers:peers_forksafe
//   bazel-bin/bench/peers/peers_forksafe --round 1 --plan bench/peers/plan.txt [--only w1,w6]
//
// Normally run by bench/peers/run.sh, which alternates it with the peers.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/peers/harness.h"
#include "forksafe/device/tensor.h"
#include "forksafe/mp/internal/shared_arena.h"  // stats only, for the breakdown of workload 2
#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/mp/spawn.h"
#include "forksafe/runtime/thread_pool.h"

namespace {

using forksafe::device::DType;
using forksafe::device::Tensor;
using forksafe::mp::Pool;
using forksafe::mp::PoolOptions;
using forksafe::mp::Process;
using forksafe::mp::ProcessOptions;
using forksafe::mp::Queue;
using peers::Clock;
using peers::Us;

const ProcessOptions kFork{"", false, "fork"};

float* F32(const Tensor& t) { return static_cast<float*>(t.data_ptr()); }

Tensor Stop() { return Tensor::Empty({0}, DType::kFloat32, forksafe::device::kCPU); }

// ---- 1. Queue round trip of an already-shared tensor ------------------------------------------

// Gets a tensor, writes t[1] = t[0] + 1 into the shared data, sends the same tensor back.
void TensorEcho(Queue in, Queue out) {
  peers::PinChild();
  for (;;) {
    Tensor t = in.get<Tensor>();
    if (t.numel() == 0) return;
    F32(t)[1] = F32(t)[0] + 1.f;
    out.put(t);
  }
}

void RoundTrip(const peers::Emitter& out, const peers::Plan& plan, int64_t bytes) {
  const int64_t n = bytes / 4;
  Queue to, from;
  Process p(kFork, &TensorEcho, to, from);
  p.start();
  Tensor t = forksafe::mp::SharedEmpty({n});
  std::fill_n(F32(t), n, 0.f);
  auto samples = peers::Measure(plan, [&](int i) {
    F32(t)[0] = static_cast<float>(i);
    const auto t0 = Clock::now();
    to.put(t);
    Tensor r = from.get<Tensor>();
    const double us = Us(Clock::now() - t0);
    if (r.numel() != n || F32(r)[1] != static_cast<float>(i + 1)) {
      throw std::runtime_error("round trip: the child's write is not visible");
    }
    return us;
  });
  to.put(Stop());
  p.join(10.0);
  out.Samples("w1_roundtrip", peers::SizeName(bytes), bytes, plan, samples);
}

// ---- 2. Queue send of fresh tensors -------------------------------------------------------------

// Gets a tensor, acknowledges with t[0] + t[-1].
void TensorAck(Queue in, Queue out) {
  peers::PinChild();
  for (;;) {
    Tensor t = in.get<Tensor>();
    if (t.numel() == 0) return;
    out.put(static_cast<double>(F32(t)[0]) + F32(t)[t.numel() - 1]);
  }
}

// Workload 2: a fresh tensor per iteration, sent to TensorAck. With `timed_creation` false the
// tensor is private and filled untimed, and the timed part is share_memory_() + put + the child's
// ack ("w2_fresh"). With it true, creation and fill are timed too and the tensor is born shared
// (mp::BornSharedScope: allocated in the shared arena, so the send moves no bytes;
// "w2_create_send"): the peers time torch.full / np.full + put the same way, so what born-shared
// moved into creation stays visible.
void FreshSend(const peers::Emitter& out, const peers::Plan& plan, int64_t bytes,
               bool timed_creation) {
  const int64_t n = bytes / 4;
  Queue to, from;
  Process p(kFork, &TensorAck, to, from);
  p.start();
  const auto a0 = forksafe::mp::internal::SharedArena::Get().stats();
  std::vector<double> first_us, put_us, ack_us;  // put() returns once the handle is queued
  auto samples = peers::Measure(plan, [&](int i) {
    Tensor t;
    Clock::time_point t0;
    if (timed_creation) {
      t0 = Clock::now();
      forksafe::mp::BornSharedScope born;
      t = Tensor::Full({n}, static_cast<double>(i));
    } else {
      t = Tensor::Full({n}, static_cast<double>(i));
      t0 = Clock::now();
      // put() would move it into shared memory itself; done explicitly here only to time the two
      // steps apart (the same work either way).
      forksafe::mp::share_memory_(t);
    }
    const auto t1 = Clock::now();
    to.put(t);  // sends the handle
    const auto t2 = Clock::now();
    const double ack = from.get<double>();
    const auto t3 = Clock::now();
    if (ack != 2.0 * i) throw std::runtime_error("fresh send: wrong acknowledgement");
    if (i >= plan.warmup) {
      first_us.push_back(Us(t1 - t0));
      put_us.push_back(Us(t2 - t1));
      ack_us.push_back(Us(t3 - t2));
    }
    return Us(t3 - t0);
  });
  to.put(Stop());
  p.join(10.0);
  // How the sender's shared memory was served, over the warm-ups and the timed iterations.
  const auto a = forksafe::mp::internal::SharedArena::Get().stats();
  char arena[240];
  snprintf(arena, sizeof arena,
           "\"arena\": {\"blocks_allocated\": %llu, \"blocks_reused\": %llu, "
           "\"segments_created\": %llu, \"large_segments_reused\": %llu}",
           static_cast<unsigned long long>(a.blocks_allocated - a0.blocks_allocated),
           static_cast<unsigned long long>(a.blocks_reused - a0.blocks_reused),
           static_cast<unsigned long long>(a.segments_created - a0.segments_created),
           static_cast<unsigned long long>(a.large_segments_reused - a0.large_segments_reused));
  char phases[160];
  snprintf(phases, sizeof phases,
           "\"phases_us\": {\"%s\": %.1f, \"put\": %.1f, \"until_ack\": %.1f}",
           timed_creation ? "create_fill" : "share_memory_", peers::Median(first_us),
           peers::Median(put_us), peers::Median(ack_us));
  out.Samples(timed_creation ? "w2_create_send" : "w2_fresh", peers::SizeName(bytes), bytes, plan,
              samples, {arena, phases});
}

// ---- 3. Pool(2).map of a reduction over tensors ----------------------------------------------

// A vectorized sum (GCC vector extensions, 4 x 4 float lanes; SSE2 is the build's baseline), so
// that the reduction is not slower than torch's and numpy's own kernels. Each lane sums at most
// 2^16 values below 7, so float accumulation is exact here.
double TensorSum(Tensor t) {
  typedef float V4 __attribute__((vector_size(16)));
  const float* p = F32(t);
  const int64_t n = t.numel();
  V4 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    V4 x0, x1, x2, x3;
    memcpy(&x0, p + i, 16);
    memcpy(&x1, p + i + 4, 16);
    memcpy(&x2, p + i + 8, 16);
    memcpy(&x3, p + i + 12, 16);
    a0 += x0;
    a1 += x1;
    a2 += x2;
    a3 += x3;
  }
  const V4 s = (a0 + a1) + (a2 + a3);
  double total = static_cast<double>(s[0]) + s[1] + s[2] + s[3];
  for (; i < n; ++i) total += p[i];
  return total;
}
FORKSAFE_ENTRY_POINT(TensorSum);

void PoolMap(const peers::Emitter& out, const peers::Plan& plan, int count, int64_t bytes) {
  const int64_t n = bytes / 4;
  std::vector<Tensor> inputs;
  std::vector<double> expected;
  for (int i = 0; i < count; ++i) {
    inputs.push_back(forksafe::mp::SharedEmpty({n}));
    std::fill_n(F32(inputs.back()), n, static_cast<float>(i % 7));
    expected.push_back(static_cast<double>(n) * (i % 7));
  }
  PoolOptions o;
  o.processes = 2;
  o.start_method = "fork";
  Pool pool(o);
  auto samples = peers::Measure(plan, [&](int) {
    const auto t0 = Clock::now();
    std::vector<double> sums = pool.map(&TensorSum, inputs);
    const double us = Us(Clock::now() - t0);
    if (sums != expected) throw std::runtime_error("pool map: wrong sums");
    return us;
  });
  pool.close();
  pool.join(10.0);
  out.Samples("w3_poolmap", std::to_string(count) + " x " + peers::SizeName(bytes), bytes, plan,
              samples, {"\"tasks\": " + std::to_string(count)});
}

// ---- 4. spawn(nprocs=2), and a child's failure to the parent's error ---------------------------

void Trivial(int) {}
FORKSAFE_ENTRY_POINT(Trivial);

void Spawn2(const peers::Emitter& out, const peers::Plan& plan, const std::string& method) {
  forksafe::mp::SpawnOptions o;
  o.nprocs = 2;
  o.start_method = method;
  auto samples = peers::Measure(plan, [&](int) {
    const auto t0 = Clock::now();
    auto ctx = forksafe::mp::spawn(&Trivial, std::make_tuple(), o);
    const double us = Us(Clock::now() - t0);
    for (auto& p : ctx->processes()) {
      if (p.exitcode() != 0) throw std::runtime_error("spawn: a child failed");
    }
    return us;
  });
  out.Samples(method == "spawn" ? "w4_spawn" : "w4_spawn_fork", "start=" + method, 0, plan,
              samples);
}

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// Process 1 records the time and throws; process 0 would sleep for 30 s (it is terminated).
void FailOne(int i, std::string path) {
  if (i == 1) {
    std::ofstream(path) << MonotonicNs();
    throw std::runtime_error("boom");
  }
  std::this_thread::sleep_for(std::chrono::seconds(30));
}
FORKSAFE_ENTRY_POINT(FailOne);

void FailureLatency(const peers::Emitter& out, const peers::Plan& plan) {
  const std::string path = "/dev/shm/peers_fail_" + std::to_string(getpid());
  forksafe::mp::SpawnOptions o;
  o.nprocs = 2;
  o.start_method = "fork";
  auto samples = peers::Measure(plan, [&](int) {
    unlink(path.c_str());
    try {
      forksafe::mp::spawn(&FailOne, std::make_tuple(path), o);
    } catch (const forksafe::mp::ProcessRaisedException& e) {
      const int64_t caught = MonotonicNs();
      int64_t failed = 0;
      std::ifstream(path) >> failed;
      if (e.error_index() != 1 || e.failure().message != "boom" || failed == 0) {
        throw std::runtime_error("failure: wrong exception");
      }
      return static_cast<double>(caught - failed) / 1e3;
    }
    throw std::runtime_error("failure: spawn did not throw");
  });
  unlink(path.c_str());
  out.Samples("w4_failure", "start=fork", 0, plan, samples);
}

// ---- 5. Pool start + first result + close -------------------------------------------------------

int Square(int x) { return x * x; }
FORKSAFE_ENTRY_POINT(Square);

// Also records the three phases (pool built, first result, closed + joined) of each timed run.
void PoolLifecycle(const peers::Emitter& out, const peers::Plan& plan) {
  std::vector<double> start, first, close;
  auto samples = peers::Measure(plan, [&](int i) {
    const auto t0 = Clock::now();
    PoolOptions o;
    o.processes = 2;
    o.start_method = "fork";
    Pool pool(o);
    const auto t1 = Clock::now();
    const int r = pool.apply(&Square, i);
    const auto t2 = Clock::now();
    pool.close();
    pool.join();
    const auto t3 = Clock::now();
    if (r != i * i) throw std::runtime_error("pool: wrong result");
    if (i >= plan.warmup) {
      start.push_back(Us(t1 - t0));
      first.push_back(Us(t2 - t1));
      close.push_back(Us(t3 - t2));
    }
    return Us(t3 - t0);
  });
  char phases[160];
  snprintf(phases, sizeof phases,
           "\"phases_us\": {\"start\": %.1f, \"first_result\": %.1f, \"close_join\": %.1f}",
           peers::Median(start), peers::Median(first), peers::Median(close));
  out.Samples("w5_pool", "start=fork", 0, plan, samples, {phases});
}

// ---- 6. Fork while the runtime's thread pools are busy ------------------------------------------

// The pool is the analogue of torch's intra-op pool after torch.set_num_threads(2): ParallelFor
// runs on the calling thread plus the pool's one worker, a team of two as OpenMP's. A busy thread
// runs parallel element-wise adds on it in a loop, as a thread calling torch.add would, and the
// forking (main) thread has used it before.
void BusyFork(const peers::Emitter& out, const peers::Plan& plan, bool child_uses_pool,
              const std::string& param, const std::string& workload) {
  using forksafe::runtime::ThreadPool;
  ThreadPool pool(
      forksafe::runtime::ThreadPoolOptions{1, "intra-op", std::chrono::milliseconds(2000)});
  constexpr int64_t kN = int64_t{1} << 20;
  std::vector<float> x(kN, 1.f), y(kN, 2.f), z(kN);
  auto add = [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) z[k] = x[k] + y[k];
  };
  pool.ParallelFor(0, kN, kN / 16, add);  // the forking thread has used the pool
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> rounds{0};
  std::thread busy([&] {
    while (!stop) {
      pool.ParallelFor(0, kN, kN / 16, add);
      rounds.fetch_add(1, std::memory_order_relaxed);
    }
  });
  while (rounds.load() < 20) std::this_thread::yield();

  const peers::ForkTrials t = peers::MeasureForkTrials(plan, [&]() -> int {
    if (!child_uses_pool) return 0;
    // The child uses the inherited pool: a parallel sum of 2^20 ones, and a submitted task.
    std::atomic<int64_t> sum{0};
    pool.ParallelFor(0, kN, kN / 16, [&](int64_t lo, int64_t hi) {
      int64_t s = 0;
      for (int64_t k = lo; k < hi; ++k) s += static_cast<int64_t>(x[k]);
      sum += s;
    });
    const int v = pool.Submit([] { return 42; }).get();
    return sum == kN && v == 42 ? 0 : 1;
  });
  stop = true;
  busy.join();
  out.Samples(workload, param, 0, plan, t.samples, t.extra);
}

// ---- Breakdowns: where the time goes (docs/peers.md), measured with the same loop -------------

void StringEcho(Queue in, Queue out) {
  peers::PinChild();
  for (;;) {
    std::string s = in.get<std::string>();
    if (s.empty()) return;
    out.put(s);
  }
}

// Workload 1 without the tensor: the same two Queues and echo child, a 64-byte string.
void QueueString(const peers::Emitter& out, const peers::Plan& plan) {
  Queue to, from;
  Process p(kFork, &StringEcho, to, from);
  p.start();
  std::string msg(64, 'x');
  auto samples = peers::Measure(plan, [&](int i) {
    msg[0] = static_cast<char>('a' + i % 26);
    const auto t0 = Clock::now();
    to.put(msg);
    const std::string r = from.get<std::string>();
    const double us = Us(Clock::now() - t0);
    if (r != msg) throw std::runtime_error("queue: wrong echo");
    return us;
  });
  to.put(std::string());
  p.join(10.0);
  out.Samples("bd_queue_string", "64 B", 64, plan, samples);
}

// What a shared tensor's handle costs in the codec, without any IPC: Encode + Decode in-process.
void HandleCodec(const peers::Emitter& out, const peers::Plan& plan) {
  Tensor t = forksafe::mp::SharedEmpty({1024});
  auto samples = peers::Measure(plan, [&](int) {
    const auto t0 = Clock::now();
    forksafe::mp::Message m = forksafe::mp::Encode(t);
    Tensor r = forksafe::mp::DecodeAs<Tensor>(m);
    const double us = Us(Clock::now() - t0);
    if (r.numel() != 1024 || r.data_ptr() == nullptr) throw std::runtime_error("codec");
    return us;
  });
  out.Samples("bd_tensor_codec", "encode+decode", 4096, plan, samples);
}

// Workload 2's first step alone, in-process: share_memory_() of a fresh, filled tensor.
void ShareFresh(const peers::Emitter& out, const peers::Plan& plan, int64_t bytes) {
  const int64_t n = bytes / 4;
  auto samples = peers::Measure(plan, [&](int i) {
    Tensor t = Tensor::Full({n}, static_cast<double>(i));
    const auto t0 = Clock::now();
    forksafe::mp::share_memory_(t);
    const double us = Us(Clock::now() - t0);
    if (!t.is_shared() || F32(t)[n - 1] != static_cast<float>(i)) throw std::runtime_error("share");
    return us;
  });
  out.Samples("bd_share_fresh", peers::SizeName(bytes), bytes, plan, samples);
}

// The system calls behind a dedicated (uncached) segment, one step at a time: what sending a
// fresh 64 MiB tensor costs below any library. create = memfd_create + ftruncate + fallocate;
// map = mmap in the sender; copy = memcpy of the data into it (first touch: page faults);
// import = mmap(MAP_POPULATE) in a receiver; unmap = munmap of both + close.
void RawSegment(const peers::Emitter& out, const peers::Plan& plan, int64_t bytes) {
  const size_t n = static_cast<size_t>(bytes);
  std::vector<char> src(n, 1);
  std::vector<double> create, map, copy, import, unmap;
  auto samples = peers::Measure(plan, [&](int i) {
    src[0] = static_cast<char>(i);
    const auto t0 = Clock::now();
    const int fd = memfd_create("peers-raw", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(n)) != 0 ||
        posix_fallocate(fd, 0, static_cast<off_t>(n)) != 0) {
      throw std::runtime_error("memfd");
    }
    const auto t1 = Clock::now();
    void* a = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const auto t2 = Clock::now();
    memcpy(a, src.data(), n);
    const auto t3 = Clock::now();
    void* b = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    const auto t4 = Clock::now();
    if (a == MAP_FAILED || b == MAP_FAILED || static_cast<char*>(b)[0] != static_cast<char>(i)) {
      throw std::runtime_error("raw segment");
    }
    munmap(a, n);
    munmap(b, n);
    close(fd);
    const auto t5 = Clock::now();
    if (i >= plan.warmup) {
      create.push_back(Us(t1 - t0));
      map.push_back(Us(t2 - t1));
      copy.push_back(Us(t3 - t2));
      import.push_back(Us(t4 - t3));
      unmap.push_back(Us(t5 - t4));
    }
    return Us(t5 - t0);
  });
  char steps[200];
  snprintf(steps, sizeof steps,
           "\"steps_us\": {\"create\": %.1f, \"map\": %.1f, \"copy\": %.1f, \"import\": %.1f, "
           "\"unmap\": %.1f}",
           peers::Median(create), peers::Median(map), peers::Median(copy), peers::Median(import),
           peers::Median(unmap));
  out.Samples("bd_raw_segment", peers::SizeName(bytes), bytes, plan, samples, {steps});
}

// Workload 4 (fork) with the two processes joined by blocking Process::join (pidfd) instead of
// spawn()'s ProcessContext::join (which polls all the pidfds and report channels at once).
void Spawn2BlockingJoin(const peers::Emitter& out, const peers::Plan& plan) {
  forksafe::mp::SpawnOptions o;
  o.nprocs = 2;
  o.start_method = "fork";
  o.join = false;
  std::vector<double> start, join;
  auto samples = peers::Measure(plan, [&](int i) {
    const auto t0 = Clock::now();
    auto ctx = forksafe::mp::spawn(&Trivial, std::make_tuple(), o);
    const auto t1 = Clock::now();
    for (auto& p : ctx->processes()) p.join();
    const auto t2 = Clock::now();
    for (auto& p : ctx->processes()) {
      if (p.exitcode() != 0) throw std::runtime_error("spawn: a child failed");
    }
    if (i >= plan.warmup) {
      start.push_back(Us(t1 - t0));
      join.push_back(Us(t2 - t1));
    }
    return Us(t2 - t0);
  });
  char steps[120];
  snprintf(steps, sizeof steps, "\"steps_us\": {\"start both\": %.1f, \"join both\": %.1f}",
           peers::Median(start), peers::Median(join));
  out.Samples("bd_spawn_fork_blocking_join", "start=fork", 0, plan, samples, {steps});
}

// Workload 4's failure with the parent blocked on the failing child (Process::join, pidfd), then
// doing what spawn() does on a failure: read the report, terminate and reap the other.
void FailureBlockingJoin(const peers::Emitter& out, const peers::Plan& plan) {
  const std::string path = "/dev/shm/peers_fail_bd_" + std::to_string(getpid());
  forksafe::mp::SpawnOptions o;
  o.nprocs = 2;
  o.start_method = "fork";
  o.join = false;
  auto samples = peers::Measure(plan, [&](int) {
    unlink(path.c_str());
    auto ctx = forksafe::mp::spawn(&FailOne, std::make_tuple(path), o);
    auto& ps = ctx->processes();
    ps[1].join();
    const auto failure = ps[1].failure();
    ps[0].terminate();
    ps[0].join();
    const int64_t caught = MonotonicNs();
    int64_t failed = 0;
    std::ifstream(path) >> failed;
    if (!failure || failure->message != "boom" || failed == 0) {
      throw std::runtime_error("failure: no report");
    }
    return static_cast<double>(caught - failed) / 1e3;
  });
  unlink(path.c_str());
  out.Samples("bd_failure_blocking_join", "start=fork", 0, plan, samples);
}

// Workload 3's reductions alone, serially in this process: the compute a map cannot go below
// (divided by the 2 workers).
void SerialSum(const peers::Emitter& out, const peers::Plan& plan, int count, int64_t bytes) {
  const int64_t n = bytes / 4;
  std::vector<Tensor> inputs;
  for (int i = 0; i < count; ++i) {
    inputs.push_back(forksafe::mp::SharedEmpty({n}));
    std::fill_n(F32(inputs.back()), n, static_cast<float>(i % 7));
  }
  auto samples = peers::Measure(plan, [&](int) {
    const auto t0 = Clock::now();
    double total = 0;
    for (const Tensor& t : inputs) total += TensorSum(t);
    const double us = Us(Clock::now() - t0);
    if (total <= 0) throw std::runtime_error("sum");
    return us;
  });
  out.Samples("bd_sum_serial", std::to_string(count) + " x " + peers::SizeName(bytes), bytes, plan,
              samples);
}

// Workload 3's sums on two threads of one process (each takes the next tensor from a shared
// counter): the compute floor with the machine's real memory bandwidth for two CPUs, which
// bd_sum_serial / 2 assumes to double.
void ParallelSum(const peers::Emitter& out, const peers::Plan& plan, int count, int64_t bytes) {
  const int64_t n = bytes / 4;
  std::vector<Tensor> inputs;
  for (int i = 0; i < count; ++i) {
    inputs.push_back(forksafe::mp::SharedEmpty({n}));
    std::fill_n(F32(inputs.back()), n, static_cast<float>(i % 7));
  }
  auto samples = peers::Measure(plan, [&](int) {
    std::atomic<int> next{0};
    std::vector<double> totals(2, 0.0);
    auto work = [&](int k) {
      double total = 0;
      for (int i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
        total += TensorSum(inputs[i]);
      }
      totals[k] = total;
    };
    const auto t0 = Clock::now();
    std::thread other(work, 1);
    work(0);
    other.join();
    const double us = Us(Clock::now() - t0);
    if (totals[0] + totals[1] <= 0) throw std::runtime_error("sum");
    return us;
  });
  out.Samples("bd_sum_parallel", std::to_string(count) + " x " + peers::SizeName(bytes), bytes,
              plan, samples);
}

// Workload 3 with a given chunksize (workload 3 itself lets map pick: about 4 chunks per
// worker): chunksize 1 shows what per-task dispatch costs against the tail imbalance of large
// chunks.
void PoolMapChunked(const peers::Emitter& out, const peers::Plan& plan, int count, int64_t bytes,
                    int chunksize) {
  const int64_t n = bytes / 4;
  std::vector<Tensor> inputs;
  std::vector<double> expected;
  for (int i = 0; i < count; ++i) {
    inputs.push_back(forksafe::mp::SharedEmpty({n}));
    std::fill_n(F32(inputs.back()), n, static_cast<float>(i % 7));
    expected.push_back(static_cast<double>(n) * (i % 7));
  }
  PoolOptions o;
  o.processes = 2;
  o.start_method = "fork";
  Pool pool(o);
  auto samples = peers::Measure(plan, [&](int) {
    const auto t0 = Clock::now();
    std::vector<double> sums = pool.map(&TensorSum, inputs, chunksize);
    const double us = Us(Clock::now() - t0);
    if (sums != expected) throw std::runtime_error("pool map: wrong sums");
    return us;
  });
  pool.close();
  pool.join(10.0);
  out.Samples("bd_poolmap_chunksize",
              std::to_string(count) + " x " + peers::SizeName(bytes) + ", chunksize " +
                  std::to_string(chunksize),
              bytes, plan, samples);
}

// A throw caught in-process: what a failing child pays before it reports (forksafe's throw hook
// records the stack at every throw).
void ThrowCatch(const peers::Emitter& out, const peers::Plan& plan) {
  auto samples = peers::Measure(plan, [&](int i) {
    const auto t0 = Clock::now();
    std::string what;
    try {
      throw std::runtime_error("boom " + std::to_string(i));
    } catch (const std::exception& e) {
      what = e.what();
    }
    const double us = Us(Clock::now() - t0);
    if (what.empty()) throw std::runtime_error("throw");
    return us;
  });
  out.Samples("bd_throw", "", 0, plan, samples);
}

void SleepLong() { std::this_thread::sleep_for(std::chrono::seconds(30)); }

// What spawn() does to the other process after a failure: terminate() (SIGTERM) + join().
void TerminateJoin(const peers::Emitter& out, const peers::Plan& plan, const std::string& param) {
  auto samples = peers::Measure(plan, [&](int) {
    Process p(kFork, &SleepLong);
    p.start();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let it reach its sleep
    const auto t0 = Clock::now();
    p.terminate();
    p.join();
    const double us = Us(Clock::now() - t0);
    if (p.exitcode() != -SIGTERM) throw std::runtime_error("terminate");
    return us;
  });
  out.Samples("bd_terminate_join", param, 0, plan, samples);
}

// fork + _exit + waitpid through the runtime with its pools idle (never used in this process).
void IdleFork(const peers::Emitter& out, const peers::Plan& plan, const std::string& param) {
  auto samples = peers::Measure(plan, [&](int) {
    const auto t0 = Clock::now();
    const pid_t pid = fork();
    if (pid == 0) _exit(0);
    if (pid < 0 || peers::WaitBounded(pid, 2000) != 0) throw std::runtime_error("fork");
    return Us(Clock::now() - t0);
  });
  out.Samples("bd_fork_idle", param, 0, plan, samples);
}

}  // namespace

int main(int argc, char** argv) {
  forksafe::mp::InitMain(argc, argv);
  const peers::Args args = peers::ParseArgs(argc, argv);
  const auto plans = peers::LoadPlan(args.plan);
  peers::Emitter out("forksafe", args.round, args.suffix);
  out.set_only(args.only);
  auto plan = [&](const char* name) { return peers::PlanFor(plans, name); };

  if (args.Wants("w1")) {
    for (int64_t b : peers::kSizes) {
      if (!args.WantsSize(b)) continue;
      out.Guard("w1_roundtrip", peers::SizeName(b),
                [&] { RoundTrip(out, plan("w1_roundtrip"), b); });
    }
  }
  if (args.Wants("w2")) {
    for (int64_t b : peers::kSizes) {
      if (!args.WantsSize(b)) continue;
      out.Guard("w2_fresh", peers::SizeName(b),
                [&] { FreshSend(out, plan("w2_fresh"), b, false); });
    }
    for (int64_t b : peers::kSizes) {
      if (!args.WantsSize(b)) continue;
      out.Guard("w2_create_send", peers::SizeName(b),
                [&] { FreshSend(out, plan("w2_fresh"), b, true); });
    }
  }
  if (args.Wants("w3")) {
    out.Guard("w3_poolmap", "2000 x 4 KiB",
              [&] { PoolMap(out, plan("w3_poolmap"), 2000, 4 << 10); });
    out.Guard("w3_poolmap", "500 x 1 MiB", [&] { PoolMap(out, plan("w3_poolmap"), 500, 1 << 20); });
  }
  if (args.Wants("w4")) {
    out.Guard("w4_spawn", "start=spawn", [&] { Spawn2(out, plan("w4_spawn"), "spawn"); });
    out.Guard("w4_spawn_fork", "start=fork", [&] { Spawn2(out, plan("w4_spawn_fork"), "fork"); });
    out.Guard("w4_failure", "start=fork", [&] { FailureLatency(out, plan("w4_failure")); });
  }
  if (args.Wants("w5")) {
    out.Guard("w5_pool", "start=fork", [&] { PoolLifecycle(out, plan("w5_pool")); });
  }
  if (args.Wants("w6")) {
    out.Guard("w6_busy_fork", "",
              [&] { BusyFork(out, plan("w6_busy_fork"), true, "", "w6_busy_fork"); });
  }
  if (args.Wants("bd")) {
    out.Guard("bd_queue_string", "64 B", [&] { QueueString(out, plan("w1_roundtrip")); });
    out.Guard("bd_tensor_codec", "encode+decode", [&] { HandleCodec(out, plan("w1_roundtrip")); });
    for (int64_t b : peers::kSizes) {
      out.Guard("bd_share_fresh", peers::SizeName(b),
                [&] { ShareFresh(out, plan("w2_fresh"), b); });
    }
    out.Guard("bd_raw_segment", "64 MiB",
              [&] { RawSegment(out, plan("w2_fresh"), int64_t{64} << 20); });
    out.Guard("bd_sum_serial", "2000 x 4 KiB",
              [&] { SerialSum(out, plan("w3_poolmap"), 2000, 4 << 10); });
    out.Guard("bd_sum_serial", "500 x 1 MiB",
              [&] { SerialSum(out, plan("w3_poolmap"), 500, 1 << 20); });
    out.Guard("bd_sum_parallel", "500 x 1 MiB",
              [&] { ParallelSum(out, plan("w3_poolmap"), 500, 1 << 20); });
    for (int cs : {1, 16}) {
      out.Guard("bd_poolmap_chunksize", "500 x 1 MiB, chunksize " + std::to_string(cs),
                [&] { PoolMapChunked(out, plan("w3_poolmap"), 500, 1 << 20, cs); });
    }
    out.Guard("bd_spawn_fork_blocking_join", "start=fork",
              [&] { Spawn2BlockingJoin(out, plan("w4_spawn_fork")); });
    out.Guard("bd_failure_blocking_join", "start=fork",
              [&] { FailureBlockingJoin(out, plan("w4_failure")); });
    out.Guard("bd_throw", "", [&] { ThrowCatch(out, plan("floor_fork")); });
    out.Guard("bd_terminate_join", "", [&] { TerminateJoin(out, plan("w4_failure"), ""); });
    out.Guard("bd_fork_idle", "", [&] { IdleFork(out, plan("floor_fork"), ""); });
    out.Guard("bd_busy_fork_child_exits", "",
              [&] { BusyFork(out, plan("w6_busy_fork"), false, "", "bd_busy_fork_child_exits"); });
  }
  return 0;
}
