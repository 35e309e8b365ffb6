// Fork soak (issue 7, "Load"): ten thousand forks, from two threads, while a runtime ThreadPool
// is kept busy by a feeder thread and oneTBB is kept busy from a pool worker, with the simulated
// accelerator initialized in the parent. Every child runs a ParallelFor on the inherited pool, a
// fresh pool, a oneTBB reduction and a Tensor op, under an alarm() watchdog; the parent waits for
// each child at most 60 s. A hang becomes a failure naming the fork. Size: FORKSAFE_SOAK_SCALE.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "forksafe/device/registry.h"
#include "forksafe/device/sim_backend.h"
#include "forksafe/device/tensor.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/tbb_fork.h"
#include "forksafe/runtime/thread_pool.h"
#include "gtest/gtest.h"
#include "tests/soak/soak_scale.h"
#include "tests/support/child_process.h"
#include "tests/support/workloads.h"

namespace forksafe {
namespace {

using forksafe::testing::BusyParent;
using forksafe::testing::ChildResult;
using forksafe::testing::PoolSum;
using forksafe::testing::RunInChild;
using forksafe::testing::TbbSum;
using namespace std::chrono_literals;

// What every child checks; 0 when all is well, else a code naming the failed check. `step`
// (shared with the parent) says how far it got, so that a hang names the check that hung.
int ChildWork(runtime::ThreadPool& pool, std::atomic<int>* step) {
  step->store(1);
  if (device::DefaultDevice() != device::kCPU) return 10;
  if (!device::GetBackend(device::DeviceType::kSimAccel).poisoned()) return 11;
  step->store(2);
  if (PoolSum(pool, 5000) != 12497500) return 12;
  step->store(3);
  runtime::ThreadPool fresh(runtime::ThreadPoolOptions{2, "child", 1000ms});
  if (fresh.Submit([] { return 9; }).get() != 9) return 13;
  step->store(4);
  if (runtime::TbbUsableInThisProcess() && TbbSum(20000) != 199990000L) return 14;
  step->store(5);
  // A Tensor op: fill, clone, read back.
  const device::Tensor t = device::Tensor::Full({16, 16}, 2.0).Clone();
  float sum = 0;
  for (float v : t.ToVector<float>()) sum += v;
  if (sum != 512.0f) return 15;
  step->store(6);
  return 0;
}

const char* StepName(int step) {
  switch (step) {
    case 0: return "before the child body (fork or at-fork child handlers)";
    case 1: return "device checks";
    case 2: return "ParallelFor on the inherited pool";
    case 3: return "a fresh ThreadPool";
    case 4: return "oneTBB parallel_reduce";
    case 5: return "the Tensor op";
    default: return "after the checks (exit)";
  }
}

TEST(ForkSoakTest, TenThousandForksUnderBusyPools) {
  const int total_forks = static_cast<int>(forksafe::testing::Scaled(10000, 2));
  const int per_thread = total_forks / 2;
  runtime::ThreadPool pool(runtime::ThreadPoolOptions{2, "soak", 5000ms});
  const device::Device sim0(device::DeviceType::kSimAccel, 0);
  void* dev = device::Allocate(sim0, 1 << 16);

  BusyParent busy(pool);  // a feeder on `pool`, oneTBB from a pool worker

  const auto start = std::chrono::steady_clock::now();
  std::atomic<int> failures{0}, done{0}, hung{0};
  std::atomic<long long> slowest_us{0};
  // One progress slot per forker thread, shared with its children.
  void* shared = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(shared, MAP_FAILED);
  auto* steps = static_cast<std::atomic<int>*>(shared);
  auto forker = [&](int id) {
    for (int i = 0; i < per_thread; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      steps[id].store(0);
      ChildResult r = RunInChild([&] { return ChildWork(pool, &steps[id]); }, 60s, 60);
      const long long us = std::chrono::duration_cast<std::chrono::microseconds>(
                               std::chrono::steady_clock::now() - t0)
                               .count();
      long long prev = slowest_us.load();
      while (us > prev && !slowest_us.compare_exchange_weak(prev, us)) {
      }
      ++done;
      if (!r.ok()) {
        ++failures;
        if (r.timed_out) ++hung;
        if (failures <= 20) {
          fprintf(stderr, "forker %d fork %d: child %s; it got as far as: %s\n", id, i,
                  r.Describe().c_str(), StepName(steps[id].load()));
        }
      }
    }
  };
  std::thread second(forker, 1);
  forker(0);
  second.join();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  busy.Stop();
  pool.Wait();

  const runtime::TbbForkStats tbb = runtime::GetTbbForkStats();
  const runtime::ThreadPoolStats ps = pool.stats();
  printf(
      "soak: forks: %d forks in %.1f s (%.0f forks/s, slowest fork+child %.1f ms), %d failed, "
      "%d hung; parent ran %ld pool tasks and %ld oneTBB rounds meanwhile; oneTBB finalized "
      "%llu, gave up %llu; pool drain deadline hits %llu; prepares that waited for a "
      "worker's thread to end %llu\n",
      done.load(), secs, done.load() / secs, slowest_us.load() / 1000.0, failures.load(),
      hung.load(), busy.completed.load(), busy.tbb_rounds.load(),
      static_cast<unsigned long long>(tbb.finalized), static_cast<unsigned long long>(tbb.gave_up),
      static_cast<unsigned long long>(ps.drain_timeouts),
      static_cast<unsigned long long>(ps.exit_waits + busy.tbb_pool_stats().exit_waits));
  RecordProperty("forks", done.load());
  EXPECT_EQ(done.load(), 2 * per_thread);
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(hung.load(), 0);
  EXPECT_FALSE(busy.tbb_wrong.load()) << "a oneTBB reduction in the parent gave a wrong sum";
  EXPECT_EQ(busy.completed.load(), busy.submitted.load())
      << "every task submitted in the parent ran once";
  EXPECT_GT(busy.tbb_rounds.load(), 0);
  EXPECT_EQ(tbb.gave_up, 0u);
  device::Free(sim0, dev);
  munmap(shared, 4096);
}

}  // namespace
}  // namespace forksafe
