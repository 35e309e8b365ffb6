// The forksafe demo: a busy runtime forks, and the child computes on fresh pools on the CPU after
// its parent used the (simulated) accelerator.
//
//   bash tools/demo.sh        (or: bazel run //examples:runtime_demo)
//
// What it shows, step by step:
//   1. The parent keeps a thread pool and oneTBB busy, and computes on the simulated accelerator
//      (explicit copies, a kernel, its default device set to sim:0).
//   2. It forks in the middle of all that. The at-fork registry drains the pool (in-flight tasks
//      finish, queued ones stay), joins oneTBB's workers and holds the framework lock. The child
//      finds CPU as its default device, is refused the accelerator with an error that names the
//      cure, and computes on a fresh pool and on oneTBB. It forks a grandchild too.
//   3. The parent carries on: its queued tasks run, the accelerator still works.
//   4. The multiprocessing API: spawn() starts fresh processes (the "spawn" start method) that
//      send their results through a Queue.
//   5. A rank that throws is reported in the parent with its index, exception and stack trace,
//      and the other ranks are stopped.
//   6. Pool.map over tensors: 64 tensors of 1 MiB go to 2 worker processes and come back without
//      a single copy: the workers normalize them in place and return views.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/device/registry.h"
#include "forksafe/device/sim_backend.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/mp/spawn.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/tbb_fork.h"
#include "forksafe/runtime/thread_pool.h"
#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/parallel_reduce.h"

namespace fr = forksafe::runtime;
namespace fd = forksafe::device;
using namespace std::chrono_literals;

namespace {

double TbbSumOfSquares(long n) {
  return tbb::parallel_reduce(
      tbb::blocked_range<long>(0, n), 0.0,
      [](const tbb::blocked_range<long>& r, double acc) {
        for (long i = r.begin(); i != r.end(); ++i) acc += double(i) * double(i);
        return acc;
      },
      [](double a, double b) { return a + b; });
}

double PoolSumOfSquares(fr::ThreadPool& pool, long n) {
  std::vector<double> partial(16, 0.0);
  pool.ParallelFor(0, 16, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      double acc = 0;
      for (long i = c * n / 16; i < (c + 1) * n / 16; ++i) acc += double(i) * double(i);
      partial[c] = acc;
    }
  });
  double s = 0;
  for (double p : partial) s += p;
  return s;
}

// Scales a vector on the simulated accelerator: host -> device, kernel, device -> host.
std::vector<float> ScaleOnAccelerator(const std::vector<float>& in, float factor) {
  const fd::Device sim0(fd::DeviceType::kSimAccel, 0);
  auto& sim = static_cast<fd::SimBackend&>(fd::GetBackend(fd::DeviceType::kSimAccel));
  const size_t bytes = in.size() * sizeof(float);
  void* dev = fd::Allocate(sim0, bytes);
  fd::Copy(dev, sim0, in.data(), fd::kCPU, bytes);
  sim.LaunchKernel(0, dev, bytes, [factor](void* view, size_t n) {
    float* f = static_cast<float*>(view);
    for (size_t i = 0; i < n / sizeof(float); ++i) f[i] *= factor;
  });
  std::vector<float> out(in.size());
  fd::Copy(out.data(), fd::kCPU, dev, sim0, bytes);
  fd::Free(sim0, dev);
  return out;
}

// A rank of the spawn() example: sums its slice of 0..n-1 on a fresh pool and reports it.
void SumSlice(int rank, forksafe::mp::Queue results, long n, int world) {
  fr::ThreadPool pool(fr::ThreadPoolOptions{2, "rank", 2000ms});
  const long lo = n * rank / world, hi = n * (rank + 1) / world;
  std::atomic<long long> sum{0};
  pool.ParallelFor(lo, hi, 10000, [&](int64_t a, int64_t b) {
    long long s = 0;
    for (int64_t i = a; i < b; ++i) s += i;
    sum += s;
  });
  results.put(std::make_tuple(rank, static_cast<int>(getpid()), sum.load()));
}
FORKSAFE_ENTRY_POINT(SumSlice);

// A rank that fails, to show error propagation.
void FailingRank(int rank) {
  if (rank == 1) throw std::runtime_error("rank 1 ran out of patience");
  std::this_thread::sleep_for(30s);  // the others are terminated when rank 1 fails
}
FORKSAFE_ENTRY_POINT(FailingRank);

// A Pool task: scales the tensor to unit maximum in place and returns a view of its first row.
forksafe::device::Tensor Normalize(forksafe::device::Tensor t) {
  float* p = static_cast<float*>(t.data_ptr());
  float max = 0;
  for (int64_t i = 0; i < t.numel(); ++i) max = std::max(max, p[i]);
  for (int64_t i = 0; i < t.numel(); ++i) p[i] /= max;
  return t.Select(0, 0);
}
FORKSAFE_ENTRY_POINT(Normalize);

// Receives `n` tensors on the simulated accelerator and sends back each one's sum. The device
// memory it reads is the producer's; the producer dropped each tensor right after sending it.
void SumDeviceTensors(forksafe::mp::Queue in, forksafe::mp::Queue sums, int n) {
  for (int i = 0; i < n; ++i) {
    forksafe::device::Tensor t = in.get<forksafe::device::Tensor>(true, 30.0);
    double s = 0;
    for (float f : t.ToVector<float>()) s += f;
    sums.put(std::make_pair(t.device().ToString(), s));
  }
}
FORKSAFE_ENTRY_POINT(SumDeviceTensors);

int Child(fr::ThreadPool& pool) {
  printf("  [child %d] default device: %s (the parent's was sim:0)\n", getpid(),
         fd::DefaultDevice().ToString().c_str());
  try {
    ScaleOnAccelerator({1.f, 2.f}, 2.f);
    printf("  [child] ERROR: the accelerator should be refused here\n");
    return 1;
  } catch (const fr::Error& e) {
    printf("  [child] the accelerator is refused, as it should be:\n    %s\n", e.what());
  }
  const long n = 2'000'000;
  const double want = (double(n) - 1) * n * (2.0 * n - 1) / 6;
  const double by_pool = PoolSumOfSquares(pool, n);
  printf("  [child] fresh pool: sum of squares below %ld = %.6e (%s)\n", n, by_pool,
         std::fabs(by_pool - want) / want < 1e-9 ? "correct" : "WRONG");
  if (!fr::TbbUsableInThisProcess()) {
    printf("  [child] ERROR: oneTBB was not quiesced before the fork\n");
    return 1;
  }
  const double by_tbb = TbbSumOfSquares(n);
  printf("  [child] oneTBB:     sum of squares below %ld = %.6e (%s)\n", n, by_tbb,
         std::fabs(by_tbb - want) / want < 1e-9 ? "correct" : "WRONG");
  // A grandchild works the same way.
  fflush(stdout);
  const pid_t gc = fork();
  if (gc == 0) {
    const double v = PoolSumOfSquares(pool, 1000);
    printf("    [grandchild %d] pool works: %.0f\n", getpid(), v);
    fflush(stdout);
    _exit(v == 332833500.0 ? 0 : 1);
  }
  int st = 0;
  waitpid(gc, &st, 0);
  const bool ok = std::fabs(by_pool - want) / want < 1e-9 &&
                  std::fabs(by_tbb - want) / want < 1e-9 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  return ok ? 0 : 1;
}

}  // namespace

bool MultiprocessingDemo() {
  namespace mp = forksafe::mp;
  printf("\n4. spawn(): 3 fresh processes sum 0..9999999 in slices and put results on a Queue.\n");
  mp::Queue results;
  mp::SpawnOptions opts;
  opts.nprocs = 3;
  opts.start_method = "spawn";
  const long n = 10'000'000;
  mp::spawn(&SumSlice, std::make_tuple(results, n, 3), opts);
  long long total = 0;
  for (int i = 0; i < 3; ++i) {
    auto [rank, pid, sum] = results.get<std::tuple<int, int, long long>>(true, 10.0);
    printf("   rank %d (pid %d): %lld\n", rank, pid, sum);
    total += sum;
  }
  const bool sum_ok = total == static_cast<long long>(n) * (n - 1) / 2;
  printf("   total %lld (%s)\n", total, sum_ok ? "correct" : "WRONG");

  printf("\n5. A rank that throws: the parent gets its index, exception and stack trace.\n");
  opts.grace_period = 1s;
  bool reported = false;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    mp::spawn(&FailingRank, std::make_tuple(), opts);
  } catch (const mp::ProcessRaisedException& e) {
    reported = e.error_index() == 1;
    printf("   caught ProcessRaisedException after %.0f ms:\n%s\n",
           std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
           e.what());
  }
  if (!sum_ok || !reported) return false;

  printf("\n6. Pool(2).map over 64 tensors of 1 MiB: they cross as handles, not bytes.\n");
  namespace fdv = forksafe::device;
  std::vector<fdv::Tensor> batch;
  for (int i = 0; i < 64; ++i) {
    batch.push_back(fdv::Tensor::Full({256, 1024}, 1.0 + i, fdv::DType::kFloat32, fdv::kCPU));
  }
  const void* first_before = batch[0].data_ptr();
  mp::PoolOptions po;
  po.processes = 2;
  po.start_method = "forkserver";
  mp::Pool pool(po);
  const auto a = std::chrono::steady_clock::now();
  std::vector<fdv::Tensor> rows = pool.map(&Normalize, batch);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
  bool in_place = true;
  for (size_t i = 0; i < batch.size(); ++i) {
    in_place &= batch[i].is_shared() && batch[i].item<float>({255, 1023}) == 1.0f &&
                rows[i].storage() == batch[i].storage();
  }
  printf(
      "   map took %.1f ms; inputs now in shared memory: %s; the workers' in-place writes are "
      "visible here and each result is a view of its input: %s\n",
      ms, batch[0].is_shared() ? "yes" : "no", in_place ? "yes" : "NO");
  printf("   (the first tensor moved to shared memory once: %p -> %p; strategy %s)\n", first_before,
         batch[0].data_ptr(), mp::get_sharing_strategy().c_str());
  pool.close();
  pool.join(10.0);
  if (!in_place) return false;

  printf(
      "\n7. Tensors on sim:0 cross to a spawned process without leaving the device; the\n"
      "   producer drops each one right after put().\n");
  const fdv::Device sim0(fdv::DeviceType::kSimAccel, 0);
  mp::Queue to_consumer, sums;
  mp::Process consumer(mp::ProcessOptions{"consumer", false, "spawn"}, &SumDeviceTensors,
                       to_consumer, sums, 4);
  consumer.start();
  for (int i = 1; i <= 4; ++i) {
    to_consumer.put(fdv::Tensor::Full({1 << 18}, i, fdv::DType::kFloat32, sim0));  // a temporary
  }
  bool sums_ok = true;
  for (int i = 1; i <= 4; ++i) {
    const auto [where, s] = sums.get<std::pair<std::string, double>>(true, 30.0);
    sums_ok &= where == "sim:0" && s == static_cast<double>(i) * (1 << 18);
    printf("   consumer read a %s tensor of 1 MiB, sum %.0f (expected %.0f)\n", where.c_str(), s,
           static_cast<double>(i) * (1 << 18));
  }
  consumer.join(10.0);
  return sums_ok && consumer.exitcode() == 0;
}

int main(int argc, char** argv) {
  forksafe::mp::InitMain(argc, argv);  // spawned children take over here
  alarm(60);                           // a demo must never hang
  setvbuf(stdout, nullptr, _IOLBF, 0);
  printf("forksafe runtime demo (pid %d)\n\n", getpid());

  printf("1. The parent uses the simulated accelerator and keeps pools busy.\n");
  fd::SetDefaultDevice(fd::Device(fd::DeviceType::kSimAccel, 0));
  std::vector<float> scaled = ScaleOnAccelerator({1.f, 2.f, 3.f, 4.f}, 10.f);
  printf("   sim:0 scaled [1 2 3 4] by 10 -> [%g %g %g %g]; default device is %s\n", scaled[0],
         scaled[1], scaled[2], scaled[3], fd::DefaultDevice().ToString().c_str());

  fr::ThreadPool pool(fr::ThreadPoolOptions{2, "demo", 2000ms});
  std::atomic<long> done{0};
  std::atomic<bool> stop{false};
  std::thread feeder([&] {
    while (!stop) {
      pool.Post([&] {
        std::this_thread::sleep_for(1ms);
        ++done;
      });
      std::this_thread::sleep_for(300us);
    }
  });
  // oneTBB kept busy from a pool worker (see runtime/tbb_fork.h for why).
  fr::ThreadPool tbb_pool(fr::ThreadPoolOptions{1, "tbb", 2000ms});
  std::thread tbb_user([&] {
    while (!stop) tbb_pool.Submit([] { return TbbSumOfSquares(200000); }).get();
  });
  std::this_thread::sleep_for(50ms);
  printf("   pool has run %ld tasks, %zu queued; oneTBB is running parallel_reduce\n\n",
         done.load(), pool.queued());

  printf("2. fork() in the middle of it.\n");
  fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(30);
    _exit(Child(pool));
  }
  const auto forked_in = std::chrono::steady_clock::now() - t0;
  fr::ForkReport report = fr::AtForkRegistry::Get().LastReport();
  printf("   parent: fork returned in %.2f ms; %s\n",
         std::chrono::duration<double, std::milli>(forked_in).count(), report.ToString().c_str());

  int status = 0;
  waitpid(pid, &status, 0);
  const bool child_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;

  stop = true;
  feeder.join();
  tbb_user.join();
  pool.Wait();
  printf("\n3. The parent carries on: %ld tasks done in total, nothing queued was lost.\n",
         done.load());
  scaled = ScaleOnAccelerator({5.f}, 2.f);
  printf("   sim:0 still works in the parent: 5 * 2 = %g\n", scaled[0]);
  bool mp_ok = false;
  try {
    mp_ok = MultiprocessingDemo();
  } catch (const std::exception& e) {
    printf("the multiprocessing demo failed: %s\n", e.what());
  }
  const bool ok = child_ok && mp_ok;
  printf("\n%s\n", ok ? "demo OK" : "demo FAILED: see the output above");
  return ok ? 0 : 1;
}
