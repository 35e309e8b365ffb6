// Multiprocessing benchmarks, in one run beside a bare AF_UNIX socketpair ping-pong between two
// processes, so every figure reads as a ratio on the same machine at the same time.
//
//   bazel run //bench:mp_benchmark
//
// - BM_BarePingPong: 64 bytes there and back over a socketpair, raw read/write.
// - BM_PipeRoundTrip: the same through mp::Pipe (framing + codec).
// - BM_QueueRoundTrip: the same through two mp::Queues (shared ring, robust lock, spin then
// doorbell).
// - BM_ManagerDictSetGet: d.set(k, i) + d.get(k) of an int on a Manager dict proxy (two proxy
//   round trips); BM_ManagerValueGet: one Value<int>.get(). Python's multiprocessing.Manager()
//   doing the same: bench/peers/manager_python.py.
// - BM_ProcessStartJoin/<method>: Process start + join of a function that returns at once.
// - BM_Spawn2/<method>: spawn(nprocs=2) of a trivial entry point, end to end.
// - BM_SharedTensorRoundTrip/<bytes>: an already-shared CPU tensor there and back through two
//   Queues (a handle crosses, never the data): 4 KiB, 1 MiB, 64 MiB.
// - BM_FreshTensorSend/<bytes>/<cache>: a fresh (not yet shared) tensor put on a Queue each
//   iteration, the child acknowledging; with the caching arena (1) and without it (0), where every
//   tensor gets a new segment, mapping and page faults. At 64 MiB (over 16 MiB: a dedicated
//   segment) the cache is the large-segment cache: `large_reuse` counts its reuses per send.
// - BM_BornSharedSend/<bytes>: the same with the tensor born shared (mp::BornSharedScope around its
//   creation): created in the arena, so the send copies nothing.
// - BM_PoolMapTensors/<count>/<bytes>: Pool(2).map of a reduction (sum) over already-shared CPU
//   tensors: 2,000 of 4 KiB and 500 of 1 MiB. Counters: `per_task_us` (map time / tasks) and
//   `overhead_us`, the per-task cost of the pool itself, measured in the same iteration by a map
//   of a task that returns the tensor's size without touching its data.
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>

#include "benchmark/benchmark.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/shared_arena.h"  // stats only: large-segment reuses
#include "forksafe/mp/manager.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/mp/spawn.h"

namespace {

using namespace forksafe::mp;

constexpr int kMsg = 64;

void Nothing(int) {}
FORKSAFE_ENTRY_POINT(Nothing);

void NothingAtAll() {}
FORKSAFE_ENTRY_POINT(NothingAtAll);

void QueueEcho(Queue in, Queue out) {
  for (;;) {
    std::string s = in.get<std::string>();
    if (s.empty()) return;
    out.put(s);
  }
}
FORKSAFE_ENTRY_POINT(QueueEcho);

void PipeEcho(Connection c) {
  for (;;) {
    std::string s = c.recv_bytes();
    if (s.empty()) return;
    c.send_bytes(s);
  }
}
FORKSAFE_ENTRY_POINT(PipeEcho);

// Reads exactly kMsg bytes; false at end-of-stream or on error.
bool ReadMsg(int fd, char* buf) {
  for (size_t got = 0; got < kMsg;) {
    const ssize_t n = read(fd, buf + got, kMsg - got);
    if (n <= 0) return false;
    got += static_cast<size_t>(n);
  }
  return true;
}

// Forks a raw echo process on a socketpair (no forksafe code on its path); *sock is our end.
pid_t StartBareEcho(int* sock) {
  int sv[2];
  socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
  const pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    char buf[kMsg];
    while (ReadMsg(sv[1], buf)) {
      if (write(sv[1], buf, kMsg) != kMsg) _exit(1);
    }
    _exit(0);
  }
  close(sv[1]);
  *sock = sv[0];
  return pid;
}

// One bare ping-pong of kMsg bytes.
bool BarePing(int sock, char* buf) { return write(sock, buf, kMsg) == kMsg && ReadMsg(sock, buf); }

void BM_BarePingPong(benchmark::State& state) {
  int sock = -1;
  const pid_t pid = StartBareEcho(&sock);
  char buf[kMsg] = {};
  for (auto _ : state) {
    if (!BarePing(sock, buf)) state.SkipWithError("bare ping-pong failed");
  }
  close(sock);
  waitpid(pid, nullptr, 0);
}
BENCHMARK(BM_BarePingPong)->UseRealTime()->MinTime(0.5)->Repetitions(3);

void BM_PipeRoundTrip(benchmark::State& state) {
  auto [a, b] = Pipe();
  Process p(ProcessOptions{"", false, "fork"}, &PipeEcho, b);
  p.start();
  b.close();
  const std::string msg(kMsg, 'x');
  for (auto _ : state) {
    a.send_bytes(msg);
    benchmark::DoNotOptimize(a.recv_bytes());
  }
  a.send_bytes("");
  p.join(10.0);
}
BENCHMARK(BM_PipeRoundTrip)->UseRealTime()->MinTime(0.5)->Repetitions(3);

void BM_QueueRoundTrip(benchmark::State& state) {
  Queue to, from;
  Process p(ProcessOptions{"", false, "fork"}, &QueueEcho, to, from);
  p.start();
  const std::string msg(kMsg, 'x');
  for (auto _ : state) {
    to.put(msg);
    benchmark::DoNotOptimize(from.get<std::string>());
  }
  to.put(std::string());
  p.join(10.0);
}
BENCHMARK(BM_QueueRoundTrip)->UseRealTime()->MinTime(0.5)->Repetitions(3);

void BM_ManagerDictSetGet(benchmark::State& state) {
  Manager manager(ManagerOptions{"", "fork"});
  auto d = manager.dict<int, int>();
  int i = 0;
  for (auto _ : state) {
    d.set(1, ++i);
    benchmark::DoNotOptimize(d.get(1));
  }
}
BENCHMARK(BM_ManagerDictSetGet)->UseRealTime()->MinTime(0.5)->Repetitions(3);

void BM_ManagerValueGet(benchmark::State& state) {
  Manager manager(ManagerOptions{"", "fork"});
  auto v = manager.Value<int>(7);
  for (auto _ : state) benchmark::DoNotOptimize(v.get());
}
BENCHMARK(BM_ManagerValueGet)->UseRealTime()->MinTime(0.5)->Repetitions(3);

void TensorEcho(Queue in, Queue out) {
  for (;;) {
    forksafe::device::Tensor t = in.get<forksafe::device::Tensor>();
    if (t.numel() == 0) return;
    out.put(t);
  }
}
FORKSAFE_ENTRY_POINT(TensorEcho);

void TensorAck(Queue in, Queue out) {
  for (;;) {
    forksafe::device::Tensor t = in.get<forksafe::device::Tensor>();
    if (t.numel() == 0) return;
    out.put(static_cast<int>(t.numel()));
  }
}
FORKSAFE_ENTRY_POINT(TensorAck);

void BM_SharedTensorRoundTrip(benchmark::State& state) {
  const int64_t n = state.range(0) / 4;
  Queue to, from;
  Process p(ProcessOptions{"", false, "fork"}, &TensorEcho, to, from);
  p.start();
  auto t = forksafe::mp::SharedEmpty({n});
  for (auto _ : state) {
    to.put(t);
    benchmark::DoNotOptimize(from.get<forksafe::device::Tensor>());
  }
  to.put(forksafe::device::Tensor::Empty({0}, forksafe::device::DType::kFloat32,
                                         forksafe::device::kCPU));
  p.join(10.0);
  state.SetLabel(std::to_string(state.range(0) / 1024) + " KiB");
}
BENCHMARK(BM_SharedTensorRoundTrip)
    ->Arg(4 << 10)
    ->Arg(1 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->MinTime(0.5)
    ->Repetitions(3);

void BM_FreshTensorSend(benchmark::State& state) {
  const int64_t n = state.range(0) / 4;
  forksafe::mp::set_sharing_cache_enabled(state.range(1) != 0);
  Queue to, from;
  Process p(ProcessOptions{"", false, "fork"}, &TensorAck, to, from);
  p.start();
  auto send = [&] {
    auto t = forksafe::device::Tensor::Empty({n}, forksafe::device::DType::kFloat32,
                                             forksafe::device::kCPU);
    to.put(t);  // moves it to shared memory, sends the handle
    benchmark::DoNotOptimize(from.get<int>());
  };
  // Untimed warm-up: the first sends of a new receiver create and map the segments (a 64 MiB one
  // takes a whole repetition on a VM with slow page faults, which would then time one cold send).
  for (int i = 0; i < 3; ++i) send();
  const auto a0 = forksafe::mp::internal::SharedArena::Get().stats();
  for (auto _ : state) send();
  const auto a1 = forksafe::mp::internal::SharedArena::Get().stats();
  state.counters["large_reuse"] =
      benchmark::Counter(static_cast<double>(a1.large_segments_reused - a0.large_segments_reused),
                         benchmark::Counter::kAvgIterations);
  to.put(forksafe::device::Tensor::Empty({0}, forksafe::device::DType::kFloat32,
                                         forksafe::device::kCPU));
  p.join(10.0);
  forksafe::mp::set_sharing_cache_enabled(true);
  state.SetLabel(std::to_string(state.range(0) / 1024) + " KiB " +
                 (state.range(1) ? "arena" : "no-arena"));
}
BENCHMARK(BM_FreshTensorSend)
    ->Args({4 << 10, 1})
    ->Args({4 << 10, 0})
    ->Args({1 << 20, 1})
    ->Args({1 << 20, 0})
    ->Args({64 << 20, 1})
    ->Args({64 << 20, 0})
    ->UseRealTime()
    ->MinTime(0.5)
    ->Repetitions(3);

void BM_BornSharedSend(benchmark::State& state) {
  const int64_t n = state.range(0) / 4;
  Queue to, from;
  Process p(ProcessOptions{"", false, "fork"}, &TensorAck, to, from);
  p.start();
  auto send = [&] {
    forksafe::device::Tensor t;
    {
      BornSharedScope born;
      t = forksafe::device::Tensor::Empty({n}, forksafe::device::DType::kFloat32,
                                          forksafe::device::kCPU);
    }
    to.put(t);  // already shared: sends the handle
    benchmark::DoNotOptimize(from.get<int>());
  };
  for (int i = 0; i < 3; ++i) send();  // untimed warm-up, as in BM_FreshTensorSend
  for (auto _ : state) send();
  to.put(forksafe::device::Tensor::Empty({0}, forksafe::device::DType::kFloat32,
                                         forksafe::device::kCPU));
  p.join(10.0);
  state.SetLabel(std::to_string(state.range(0) / 1024) + " KiB born shared");
}
BENCHMARK(BM_BornSharedSend)
    ->Arg(4 << 10)
    ->Arg(1 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->MinTime(0.5)
    ->Repetitions(3);

double TensorNumel(forksafe::device::Tensor t) { return static_cast<double>(t.numel()); }
FORKSAFE_ENTRY_POINT(TensorNumel);

double TensorSum(forksafe::device::Tensor t) {
  const float* p = static_cast<const float*>(t.data_ptr());
  double s = 0;
  for (int64_t i = 0; i < t.numel(); ++i) s += p[i];
  return s;
}
FORKSAFE_ENTRY_POINT(TensorSum);

void BM_PoolMapTensors(benchmark::State& state) {
  const int count = static_cast<int>(state.range(0));
  const int64_t n = state.range(1) / 4;
  std::vector<forksafe::device::Tensor> inputs;
  for (int i = 0; i < count; ++i) {
    inputs.push_back(forksafe::mp::SharedEmpty({n}));
    std::fill_n(static_cast<float*>(inputs.back().data_ptr()), n, 1.f);
  }
  double check = 0;
  double serial_us = 0;
  PoolOptions o;
  o.processes = 2;
  o.start_method = "fork";
  Pool pool(o);
  pool.map(&TensorSum, std::vector<forksafe::device::Tensor>(inputs.begin(), inputs.begin() + 2));
  double total_us = 0;
  for (auto _ : state) {
    // The pool's own cost, in every iteration (so that drift hits both alike): the same tensors
    // through the same pool, with a task that does not touch the data.
    const auto s0 = std::chrono::steady_clock::now();
    check += pool.map(&TensorNumel, inputs)[0];
    serial_us +=
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s0).count();
    const auto a = std::chrono::steady_clock::now();
    std::vector<double> sums = pool.map(&TensorSum, inputs);
    total_us +=
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count();
    if (sums.size() != inputs.size() || sums[0] != static_cast<double>(n)) {
      state.SkipWithError("wrong result");
    }
  }
  benchmark::DoNotOptimize(check);
  const double per_map = total_us / static_cast<double>(state.iterations());
  state.counters["per_task_us"] = per_map / count;
  state.counters["overhead_us"] = serial_us / static_cast<double>(state.iterations()) / count;
  state.SetLabel(std::to_string(count) + " x " + std::to_string(state.range(1) / 1024) + " KiB");
}
BENCHMARK(BM_PoolMapTensors)
    ->Args({2000, 4 << 10})
    ->Args({500, 1 << 20})
    ->UseRealTime()
    ->MinTime(1.0)
    ->Repetitions(3);

// The echo of a peer that takes a turn before it replies: it works (spinning on the clock) for
// kTurnUs after each get, as a Python peer or a producer filling a large tensor does.
constexpr double kTurnUs = 150;
void QueueEchoAfterATurn(Queue in, Queue out) {
  for (;;) {
    std::string s = in.get<std::string>();
    if (s.empty()) return;
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(kTurnUs);
    while (std::chrono::steady_clock::now() < until) {
    }
    out.put(s);
  }
}
FORKSAFE_ENTRY_POINT(QueueEchoAfterATurn);

// Times this thread went to sleep (voluntary context switches) so far.
long VoluntarySwitches() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return ru.ru_nvcsw;
}

// The headline, paired: every iteration makes one bare ping-pong, one Queue round trip of 64 bytes
// and one round trip of an already-shared tensor of each size, back to back, each timed on its
// own. On a shared, noisy machine the cost of waking the other process swings by 10x from one
// second to the next (measured here: 6 us to 80 us for the same bare ping-pong), so only ratios
// taken in the same iteration mean anything. Counters: mean microseconds of each, and the ratios
// to the bare ping-pong. Then a Queue round trip with a peer that takes a kTurnUs turn before it
// replies: `turn_extra_us` (its time beyond the turn) and `turn_sleeps` (how often this getter
// went to sleep per round trip: its spin, mp/internal/queue_spin.h, learns to outlast the turn).
void BM_PairedRoundTrips(benchmark::State& state) {
  int sock = -1;
  const pid_t bare_pid = StartBareEcho(&sock);
  Queue q_to, q_from, t_to, t_from;
  Process qecho(ProcessOptions{"", false, "fork"}, &QueueEcho, q_to, q_from);
  Process techo(ProcessOptions{"", false, "fork"}, &TensorEcho, t_to, t_from);
  Queue turn_to, turn_from;
  Process turn_echo(ProcessOptions{"", false, "fork"}, &QueueEchoAfterATurn, turn_to, turn_from);
  qecho.start();
  techo.start();
  turn_echo.start();
  std::vector<forksafe::device::Tensor> tensors = {forksafe::mp::SharedEmpty({1024}),
                                                   forksafe::mp::SharedEmpty({256 * 1024}),
                                                   forksafe::mp::SharedEmpty({16 * 1024 * 1024})};
  const std::string msg(kMsg, 'x');
  using Clock = std::chrono::steady_clock;
  double t_bare = 0, t_queue = 0, t_tensor[3] = {0, 0, 0}, t_turn = 0;
  long turn_sleeps = 0;
  char buf[kMsg] = {};
  for (auto _ : state) {
    auto a = Clock::now();
    if (!BarePing(sock, buf)) state.SkipWithError("bare ping-pong failed");
    auto b = Clock::now();
    t_bare += std::chrono::duration<double, std::micro>(b - a).count();
    q_to.put(msg);
    benchmark::DoNotOptimize(q_from.get<std::string>());
    a = Clock::now();
    t_queue += std::chrono::duration<double, std::micro>(a - b).count();
    for (int k = 0; k < 3; ++k) {
      b = Clock::now();
      t_to.put(tensors[k]);
      benchmark::DoNotOptimize(t_from.get<forksafe::device::Tensor>());
      t_tensor[k] += std::chrono::duration<double, std::micro>(Clock::now() - b).count();
    }
    const long sw = VoluntarySwitches();
    b = Clock::now();
    turn_to.put(msg);
    benchmark::DoNotOptimize(turn_from.get<std::string>());
    t_turn += std::chrono::duration<double, std::micro>(Clock::now() - b).count() - kTurnUs;
    turn_sleeps += VoluntarySwitches() - sw;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["bare_us"] = t_bare / n;
  state.counters["queue_ratio"] = t_queue / t_bare;
  state.counters["t4K_ratio"] = t_tensor[0] / t_bare;
  state.counters["t1M_ratio"] = t_tensor[1] / t_bare;
  state.counters["t64M_ratio"] = t_tensor[2] / t_bare;
  state.counters["t4K_us"] = t_tensor[0] / n;
  state.counters["t64M_us"] = t_tensor[2] / n;
  state.counters["turn_extra_us"] = t_turn / n;
  state.counters["turn_sleeps"] = static_cast<double>(turn_sleeps) / n;
  q_to.put(std::string());
  turn_to.put(std::string());
  t_to.put(forksafe::device::Tensor::Empty({0}, forksafe::device::DType::kFloat32,
                                           forksafe::device::kCPU));
  qecho.join(10.0);
  techo.join(10.0);
  turn_echo.join(10.0);
  close(sock);
  waitpid(bare_pid, nullptr, 0);
}
BENCHMARK(BM_PairedRoundTrips)->UseRealTime()->MinTime(1.0)->Repetitions(5);

const char* kMethods[] = {"fork", "spawn", "forkserver"};

void BM_ProcessStartJoin(benchmark::State& state) {
  const std::string method = kMethods[state.range(0)];
  state.SetLabel(method);
  for (auto _ : state) {
    Process p(ProcessOptions{"", false, method}, &NothingAtAll);
    p.start();
    p.join();
    if (p.exitcode() != 0) state.SkipWithError("child failed");
  }
}
BENCHMARK(BM_ProcessStartJoin)->DenseRange(0, 2)->UseRealTime()->MinTime(0.5)->Repetitions(3);

void BM_Spawn2(benchmark::State& state) {
  const std::string method = kMethods[state.range(0)];
  state.SetLabel(method);
  SpawnOptions o;
  o.nprocs = 2;
  o.start_method = method;
  for (auto _ : state) spawn(&Nothing, std::make_tuple(), o);
}
BENCHMARK(BM_Spawn2)->DenseRange(0, 2)->UseRealTime()->MinTime(0.5)->Repetitions(3);

class MedianReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name == "median") {
        std::string key = r.run_name.function_name;
        if (!r.run_name.args.empty()) key += "/" + r.report_label;
        us_[key] = r.GetAdjustedRealTime() / 1e3;
        for (const auto& [name, c] : r.counters) counters_[key + " " + name] = c.value;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
  std::map<std::string, double> us_;
  std::map<std::string, double> counters_;
};

}  // namespace

int main(int argc, char** argv) {
  forksafe::mp::InitMain(argc, argv);
  benchmark::Initialize(&argc, argv);
  MedianReporter r;
  benchmark::RunSpecifiedBenchmarks(&r);
  printf("\npaired (median of 5 repetitions; each ratio measured within the same iterations):\n");
  for (const char* c : {"bare_us", "queue_ratio", "t4K_ratio", "t1M_ratio", "t64M_ratio",
                        "turn_extra_us", "turn_sleeps"}) {
    printf("  %-12s %8.2f\n", c, r.counters_[std::string("BM_PairedRoundTrips ") + c]);
  }
  printf("  targets: queue_ratio <= 2; tensor ratios <= 3 and within 2x of each other\n");
  const double bare = r.us_["BM_BarePingPong"];
  printf("\nmedians (us):\n");
  for (const auto& [k, v] : r.us_) printf("  %-32s %10.1f\n", k.c_str(), v);
  if (bare > 0) {
    printf("ratio queue round trip / bare ping-pong = %.2f (target <= 2)\n",
           r.us_["BM_QueueRoundTrip"] / bare);
    printf("ratio pipe round trip / bare ping-pong  = %.2f\n", r.us_["BM_PipeRoundTrip"] / bare);
    if (r.us_.count("BM_ManagerValueGet") != 0) {
      printf("ratio manager Value.get / bare ping-pong = %.2f\n",
             r.us_["BM_ManagerValueGet"] / bare);
    }
    for (const char* k : {"BM_PoolMapTensors/2000 x 4 KiB", "BM_PoolMapTensors/500 x 1024 KiB"}) {
      const double over = r.counters_[std::string(k) + " overhead_us"];
      printf("%s: per-task %.1f us, overhead %.1f us = %.2f x bare ping-pong (target <= 3)\n", k,
             r.counters_[std::string(k) + " per_task_us"], over, over / bare);
    }
    for (const char* k : {"BM_SharedTensorRoundTrip/4 KiB", "BM_SharedTensorRoundTrip/1024 KiB",
                          "BM_SharedTensorRoundTrip/65536 KiB"}) {
      printf("ratio %s / bare ping-pong = %.2f (target <= 3)\n", k, r.us_[k] / bare);
    }
  }
  benchmark::Shutdown();
  return 0;
}
