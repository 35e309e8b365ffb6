// fork + exit + wait through the forksafe runtime, against a bare kernel fork measured in the same
// run. Prints the ratios at the end (target: idle runtime / bare <= 1.2).
//
//   bazel run //bench:fork_benchmark
//
// "bare" is glibc's fork() in this same process with forksafe's at-fork callbacks bypassed
// (runtime/internal/at_fork_bypass.h), so it differs from the others only by forksafe's work.
// "raw_clone" is the kernel alone (no glibc fork bookkeeping), for reference. "runtime_idle" is a
// plain fork() with the runtime fully set up and idle: the default pool has run tasks (its workers
// are parked), oneTBB has run a parallel algorithm, and the simulated accelerator is initialized.
// "runtime never used" (run first) pairs a bare fork with one through a runtime that nothing has
// used yet (no pool, no oneTBB algorithm), the process's only thread forking; the paired
// benchmarks also report page faults per fork of each kind (parent + child).
// "runtime_busy" forks while a feeder thread keeps the pool busy with short tasks. The paired
// "busy ParallelFor" benchmark forks while a thread runs ParallelFor on a 1-thread pool (workload
// 6 of bench/peers), against a bare fork in the same loop (target <= 1.5), and the next one times
// a child's first ParallelFor on the inherited pool against one on a pool it creates (target <= 1).
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "forksafe/device/registry.h"
#include "forksafe/runtime/internal/at_fork_bypass.h"
#include "forksafe/runtime/tbb_fork.h"
#include "forksafe/runtime/thread_pool.h"
#include "oneapi/tbb/parallel_for.h"

namespace {

using forksafe::runtime::ThreadPool;

void WaitOrDie(pid_t pid, benchmark::State& state) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    state.SkipWithError("child did not exit cleanly");
  }
}

// Page faults per fork in the parent and in the children (copy-on-write is most of fork's cost).
class FaultCounter {
 public:
  FaultCounter() { Read(&self0_, &kids0_); }
  void Report(benchmark::State& state) {
    long self1, kids1;
    Read(&self1, &kids1);
    const double n = static_cast<double>(state.iterations());
    state.counters["parent_faults"] = (self1 - self0_) / n;
    state.counters["child_faults"] = (kids1 - kids0_) / n;
  }

 private:
  static void Read(long* self, long* kids) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    *self = ru.ru_minflt;
    getrusage(RUSAGE_CHILDREN, &ru);
    *kids = ru.ru_minflt;
  }
  long self0_, kids0_;
};

void SetUpRuntime() {
  static bool done = false;
  if (done) return;
  done = true;
  ThreadPool::Default().Submit([] { return 1; }).get();
  tbb::parallel_for(0, 1000, [](int) {});
  void* p = forksafe::device::Allocate(
      forksafe::device::Device(forksafe::device::DeviceType::kSimAccel, 0), 4096);
  forksafe::device::Free(forksafe::device::Device(forksafe::device::DeviceType::kSimAccel, 0), p);
}

void BM_RawClone(benchmark::State& state) {
  SetUpRuntime();  // same process image for every variant
  FaultCounter faults;
  for (auto _ : state) {
    const long pid = syscall(SYS_clone, SIGCHLD, nullptr, nullptr, nullptr, 0);
    if (pid == 0) syscall(SYS_exit_group, 0);
    WaitOrDie(static_cast<pid_t>(pid), state);
  }
  faults.Report(state);
}

void BM_BareFork(benchmark::State& state) {
  SetUpRuntime();
  forksafe::runtime::internal::SetAtForkBypassForBenchmark(true);
  FaultCounter faults;
  for (auto _ : state) {
    const pid_t pid = fork();
    if (pid == 0) _exit(0);
    WaitOrDie(pid, state);
  }
  faults.Report(state);
  forksafe::runtime::internal::SetAtForkBypassForBenchmark(false);
}

void BM_RuntimeForkIdle(benchmark::State& state) {
  SetUpRuntime();
  FaultCounter faults;
  for (auto _ : state) {
    const pid_t pid = fork();
    if (pid == 0) _exit(0);
    WaitOrDie(pid, state);
  }
  faults.Report(state);
}

// The headline: each iteration makes one bare fork and one fork through the idle runtime, back
// to back, timing each, so machine drift and noise hit both alike. Reports both means and their
// ratio (target: <= 1.2).
// Each iteration: one bare fork (forksafe's callbacks bypassed) and one fork through the runtime,
// back to back, children exiting at once. Reports both means and their ratio as `ratio_name`.
// Also counts page faults (parent + child, outside the timed spans) per fork of each kind.
void TimePairedForks(benchmark::State& state, const char* ratio_name) {
  using Clock = std::chrono::steady_clock;
  Clock::duration bare{}, runtime{};
  long bare_faults = 0, runtime_faults = 0;
  auto faults = [] {
    struct rusage self, kids;
    getrusage(RUSAGE_SELF, &self);
    getrusage(RUSAGE_CHILDREN, &kids);
    return self.ru_minflt + kids.ru_minflt;
  };
  for (auto _ : state) {
    forksafe::runtime::internal::SetAtForkBypassForBenchmark(true);
    const long f0 = faults();
    auto t0 = Clock::now();
    pid_t pid = fork();
    if (pid == 0) _exit(0);
    WaitOrDie(pid, state);
    auto t1 = Clock::now();
    forksafe::runtime::internal::SetAtForkBypassForBenchmark(false);
    const long f1 = faults();
    auto t1b = Clock::now();
    pid = fork();
    if (pid == 0) _exit(0);
    WaitOrDie(pid, state);
    auto t2 = Clock::now();
    const long f2 = faults();
    bare += t1 - t0;
    runtime += t2 - t1b;
    bare_faults += f1 - f0;
    runtime_faults += f2 - f1;
  }
  const double n = static_cast<double>(state.iterations());
  const double bare_us = std::chrono::duration<double, std::micro>(bare).count() / n;
  const double runtime_us = std::chrono::duration<double, std::micro>(runtime).count() / n;
  state.counters["bare_us"] = bare_us;
  state.counters["runtime_us"] = runtime_us;
  state.counters["bare_faults"] = bare_faults / n;
  state.counters["runtime_faults"] = runtime_faults / n;
  state.counters[ratio_name] = runtime_us / bare_us;
}

// The same pairing in a process that links the runtime but has not used it yet (no pool, no
// oneTBB algorithm, no device): the case of issue 19's "idle runtime fork within 1.2x a bare
// fork". Registered first, so that it runs before SetUpRuntime() starts anything.
void BM_PairedBareVsUnusedRuntime(benchmark::State& state) {
  TimePairedForks(state, "unused_ratio");
}
BENCHMARK(BM_PairedBareVsUnusedRuntime)->UseRealTime()->MinTime(1.0)->Repetitions(5);

void BM_PairedBareVsRuntime(benchmark::State& state) {
  SetUpRuntime();
  // The process's other threads are the default pool's parked workers and the simulated
  // accelerator's idle device thread: its forks are quiet (runtime/at_fork.h), and oneTBB is not
  // finalized on them (`tbb_finalized` per runtime fork: 0 when quiet, 1 with the full protocol).
  const uint64_t finalized = forksafe::runtime::GetTbbForkStats().finalized;
  TimePairedForks(state, "ratio");
  state.counters["tbb_finalized"] =
      static_cast<double>(forksafe::runtime::GetTbbForkStats().finalized - finalized) /
      static_cast<double>(state.iterations());
}
BENCHMARK(BM_PairedBareVsRuntime)->UseRealTime()->MinTime(1.0)->Repetitions(5);

BENCHMARK(BM_BareFork)->UseRealTime()->MinTime(0.5)->Repetitions(3);
BENCHMARK(BM_RuntimeForkIdle)->UseRealTime()->MinTime(0.5)->Repetitions(3);
BENCHMARK(BM_RawClone)->UseRealTime()->MinTime(0.5)->Repetitions(3);

void BM_RuntimeForkBusyPool(benchmark::State& state) {
  SetUpRuntime();
  ThreadPool pool(
      forksafe::runtime::ThreadPoolOptions{2, "bench", std::chrono::milliseconds(2000)});
  std::atomic<bool> stop{false};
  std::thread feeder([&] {
    while (!stop) {
      pool.Post([] {
        volatile int x = 0;
        for (int i = 0; i < 20000; ++i) x += i;  // ~10-20 us of work
      });
      if (pool.queued() > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  for (auto _ : state) {
    const pid_t pid = fork();
    if (pid == 0) _exit(0);
    WaitOrDie(pid, state);
  }
  stop = true;
  feeder.join();
  pool.Wait();
}
BENCHMARK(BM_RuntimeForkBusyPool)->UseRealTime()->MinTime(0.5)->Repetitions(5);

// Workload 6 of the peers run (bench/peers/peers_forksafe.cc BusyFork): a 1-thread pool on which
// another thread runs ParallelFor(0, 2^20, 2^16, add) in a loop, as a thread calling torch.add
// with torch.set_num_threads(2) would; forks come from the main thread.
class BusyParallelFor {
 public:
  static constexpr int64_t kN = int64_t{1} << 20;
  BusyParallelFor()
      : pool_(forksafe::runtime::ThreadPoolOptions{1, "intra-op", std::chrono::milliseconds(2000)}),
        x_(kN, 1.f),
        y_(kN, 2.f),
        z_(kN) {
    Add(pool_);  // the forking thread has used the pool
    busy_ = std::thread([this] {
      while (!stop_) {
        Add(pool_);
        rounds_.fetch_add(1, std::memory_order_relaxed);
      }
    });
    while (rounds_.load() < 20) std::this_thread::yield();
  }
  ~BusyParallelFor() {
    stop_ = true;
    busy_.join();
  }
  // z = x + y on `pool`.
  void Add(ThreadPool& pool) {
    pool.ParallelFor(0, kN, kN / 16, [this](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; ++k) z_[k] = x_[k] + y_[k];
    });
  }
  ThreadPool& pool() { return pool_; }

 private:
  ThreadPool pool_;
  std::vector<float> x_, y_, z_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> rounds_{0};
  std::thread busy_;
};

// The issue-19 headline: each iteration makes one bare fork (forksafe's callbacks bypassed) and
// one fork through the runtime, both while the pool runs ParallelFor, children exiting at once.
// Target: ratio <= 1.5.
void BM_PairedBareVsBusyParallelFor(benchmark::State& state) {
  SetUpRuntime();
  BusyParallelFor busy;
  TimePairedForks(state, "busy_ratio");
}
BENCHMARK(BM_PairedBareVsBusyParallelFor)->UseRealTime()->MinTime(1.0)->Repetitions(3);

// The child's first parallel region after such a fork: each iteration forks twice through the
// runtime while the pool is busy; one child times its first ParallelFor on the inherited pool
// (rebuilt on first use), the other on a pool it creates itself; each sends its time back over a
// pipe. Target: ratio (inherited / fresh) <= 1.
void BM_ChildFirstParallelForAfterBusyFork(benchmark::State& state) {
  SetUpRuntime();
  BusyParallelFor busy;
  using Clock = std::chrono::steady_clock;
  double inherited_us = 0, fresh_us = 0;
  auto child_time = [&](bool fresh) -> double {
    int fds[2];
    if (pipe(fds) != 0) {
      state.SkipWithError("pipe");
      return 0;
    }
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      double us = 0;
      if (fresh) {
        ThreadPool pool(
            forksafe::runtime::ThreadPoolOptions{1, "fresh", std::chrono::milliseconds(2000)});
        const auto t0 = Clock::now();
        busy.Add(pool);
        us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      } else {
        const auto t0 = Clock::now();
        busy.Add(busy.pool());
        us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      }
      _exit(write(fds[1], &us, sizeof us) == sizeof us ? 0 : 1);
    }
    close(fds[1]);
    double us = 0;
    if (read(fds[0], &us, sizeof us) != sizeof us) state.SkipWithError("child sent no time");
    close(fds[0]);
    WaitOrDie(pid, state);
    return us;
  };
  for (auto _ : state) {
    inherited_us += child_time(false);
    fresh_us += child_time(true);
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["inherited_us"] = inherited_us / n;
  state.counters["fresh_us"] = fresh_us / n;
  state.counters["first_pf_ratio"] = inherited_us / fresh_us;
}
BENCHMARK(BM_ChildFirstParallelForAfterBusyFork)->UseRealTime()->MinTime(1.0)->Repetitions(3);

// Collects per-iteration real times so main() can print ratios from this one run.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      // Keep the median aggregate of each benchmark's repetitions.
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name == "median") {
        ns_[r.run_name.function_name] = r.GetAdjustedRealTime();  // ns
        auto it = r.counters.find("ratio");
        if (it != r.counters.end()) paired_ratio_ = it->second.value;
        for (const char* name : {"busy_ratio", "first_pf_ratio", "unused_ratio"}) {
          auto c = r.counters.find(name);
          if (c != r.counters.end()) other_ratios_[name] = c->second.value;
        }
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
  double paired_ratio() const { return paired_ratio_; }
  double other_ratio(const std::string& name) const {
    auto it = other_ratios_.find(name);
    return it == other_ratios_.end() ? 0 : it->second;
  }
  double Get(const std::string& name) const {
    auto it = ns_.find(name);
    return it == ns_.end() ? 0 : it->second;
  }

 private:
  std::map<std::string, double> ns_;
  double paired_ratio_ = 0;
  std::map<std::string, double> other_ratios_;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  const double bare = reporter.Get("BM_BareFork");
  const double idle = reporter.Get("BM_RuntimeForkIdle");
  const double busy = reporter.Get("BM_RuntimeForkBusyPool");
  const double raw = reporter.Get("BM_RawClone");
  printf(
      "\nmedians: bare fork() %.1f us, runtime idle %.1f us, runtime busy pool %.1f us, "
      "raw clone %.1f us\n",
      bare / 1e3, idle / 1e3, busy / 1e3, raw / 1e3);
  printf("paired ratio runtime_idle / bare (median of 5) = %.2f  (target <= 1.20)\n",
         reporter.paired_ratio());
  if (bare > 0 && idle > 0) {
    printf("unpaired ratio runtime_idle / bare = %.2f\n", idle / bare);
  }
  if (reporter.other_ratio("unused_ratio") > 0) {
    printf("paired ratio runtime never used / bare (median of 5) = %.2f  (target <= 1.20)\n",
           reporter.other_ratio("unused_ratio"));
  }
  if (bare > 0 && busy > 0) printf("ratio runtime_busy / bare = %.2f\n", busy / bare);
  if (reporter.other_ratio("busy_ratio") > 0) {
    printf(
        "paired ratio fork with a busy ParallelFor / bare (median of 3) = %.2f  (target <= 1.50)\n",
        reporter.other_ratio("busy_ratio"));
  }
  if (reporter.other_ratio("first_pf_ratio") > 0) {
    printf(
        "child's first ParallelFor, inherited / fresh pool (median of 3) = %.2f  (target <= 1)\n",
        reporter.other_ratio("first_pf_ratio"));
  }
  benchmark::Shutdown();
  return 0;
}
