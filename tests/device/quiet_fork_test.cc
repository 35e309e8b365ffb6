// The quiet fork (runtime/at_fork.h, NoteThreadsParkedForFork): when the only threads besides
// the forking one are pool workers parked for the fork and the simulated accelerator's idle
// device thread, the handlers that prepare after the pools (oneTBB's, forksafe's held locks) see
// PrepareAttempt::alone and skip their locks and oneTBB's finalize, as for a process's only
// thread. Any other thread, or a device thread with work in flight, brings the full protocol
// back. Each case runs in a forked child (one thread, so that the test controls every thread),
// which forks grandchildren.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "forksafe/device/device.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/sim_backend.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/tbb_fork.h"
#include "forksafe/runtime/thread_pool.h"
#include "gtest/gtest.h"
#include "oneapi/tbb/parallel_for.h"
#include "tests/support/child_process.h"

namespace forksafe {
namespace {

using forksafe::testing::RunInChild;
using forksafe::testing::ThreadsOfThisProcess;
using forksafe::testing::WaitUntil;
using runtime::AtForkHandler;
using runtime::AtForkRegistry;
using runtime::ForkingThreadAlone;
using runtime::GetTbbForkStats;
using runtime::PrepareAttempt;
using runtime::ThreadPool;
using runtime::ThreadPoolOptions;
using namespace std::chrono_literals;

constexpr int kNotAlone = 77;  // a sanitizer's helper thread runs in the child too

// What a probe handler saw in the latest fork: 1 alone, 2 not, 0 not called.
struct Seen {
  int prepare = 0;
  int parent = 0;
};

// Registers a handler named `name` that records PrepareAttempt::alone and ForkingThreadAlone()
// (in a child, when `report_child`, in the environment). Handlers prepare in the reverse order
// of registration: one registered before a pool prepares after that pool has drained.
void RegisterProbe(const void* tag, const char* name, Seen* seen, bool report_child) {
  AtForkHandler h;
  h.name = name;
  h.prepare = [seen](const PrepareAttempt& a) {
    seen->prepare = a.alone ? 1 : 2;
    return true;
  };
  h.parent = [seen](bool) { seen->parent = ForkingThreadAlone() ? 1 : 2; };
  h.child = [report_child](bool) {
    // The grandchild's exit code says what its child callback saw (ForkAndCheckChild).
    if (report_child && !ForkingThreadAlone()) {
      setenv("FORKSAFE_TEST_PROBE_CHILD", "not alone", 1);
    }
  };
  AtForkRegistry::Get().Register(tag, std::move(h));
}

// A grandchild that exits 0 when the probe's child callback saw what the parent side saw.
int ForkAndCheckChild(bool expect_alone) {
  auto grandchild = RunInChild(
      [expect_alone] {
        const bool alone = getenv("FORKSAFE_TEST_PROBE_CHILD") == nullptr;
        return alone == expect_alone ? 0 : 1;
      },
      20s, 20);
  if (grandchild.ok()) return 0;
  fprintf(stderr, "grandchild (expecting %s): %s\n", expect_alone ? "alone" : "not alone",
          grandchild.Describe().c_str());
  return 1;
}

// ForkAndCheckChild(false) while one more thread of this process, parked by nobody, is alive:
// the fork takes the full protocol.
int ForkWithAnotherThreadAndCheckChild() {
  std::atomic<bool> stop{false};
  std::thread other([&stop] {
    while (!stop.load()) std::this_thread::sleep_for(1ms);
  });
  const int rc = ForkAndCheckChild(false);
  stop = true;
  other.join();
  return rc;
}

// The verdict on a test's forked child: skipped where a child of this process is never alone,
// otherwise its exit code must be 0 (`codes` says what the others mean).
void ExpectChildOk(const forksafe::testing::ChildResult& child, const char* codes) {
  if (child.exited && child.exit_code == kNotAlone) {
    GTEST_SKIP() << "a forked child of this process has more than one thread here";
  }
  EXPECT_TRUE(child.ok()) << child.Describe() << " (" << codes << ")";
}

// Starts both workers of `pool` and waits until they are parked, idle (`threads` in all).
bool StartWorkersAndLetThemPark(ThreadPool& pool, int threads) {
  std::atomic<int> running{0};
  for (int i = 0; i < 2; ++i) {
    pool.Post([&running] {
      running.fetch_add(1);
      const auto until = std::chrono::steady_clock::now() + 5s;
      while (running.load() < 2 && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
    });
  }
  pool.Wait();
  return running.load() == 2 &&
         WaitUntil([threads] { return ThreadsOfThisProcess() == threads; }, 5s);
}

TEST(QuietForkTest, ParkedPoolWorkersMakeTheForkQuietForTheHandlersPreparedAfterThem) {
  auto child = RunInChild(
      [] {
        if (ThreadsOfThisProcess() != 1) return kNotAlone;
        unsetenv("FORKSAFE_TEST_PROBE_CHILD");
        static Seen after_pool, before_pool;
        static int tag_after, tag_before;
        RegisterProbe(&tag_after, "probe_prepared_after_the_pool", &after_pool, true);
        ThreadPool pool(ThreadPoolOptions{2, "quiet", 2000ms});
        RegisterProbe(&tag_before, "probe_prepared_before_the_pool", &before_pool, false);
        if (!StartWorkersAndLetThemPark(pool, 3)) return 10;
        // This thread runs oneTBB, then forks with one more thread of its own alive: the full
        // protocol, which finalizes oneTBB (joining any workers it started).
        tbb::parallel_for(0, 100, [](int) {});
        if (ForkWithAnotherThreadAndCheckChild() != 0) return 11;
        if (!WaitUntil([] { return ThreadsOfThisProcess() == 3; }, 5s)) return 12;
        const uint64_t finalized = GetTbbForkStats().finalized;
        const int quiet_child = ForkAndCheckChild(true);  // its child callback saw alone too
        if (after_pool.prepare != 1 || after_pool.parent != 1) {
          fprintf(stderr, "probe after the pool: prepare %d, parent %d\n", after_pool.prepare,
                  after_pool.parent);
          return 14;
        }
        if (quiet_child != 0) return 13;
        if (before_pool.prepare != 2 || before_pool.parent != 2) return 15;
        if (GetTbbForkStats().finalized != finalized) return 16;    // oneTBB skipped, quiet
        if (pool.Submit([] { return 42; }).get() != 42) return 17;  // the workers went on
        // Another thread, parked by nobody: the full protocol again.
        if (!WaitUntil([] { return ThreadsOfThisProcess() == 3; }, 5s)) return 18;
        if (ForkWithAnotherThreadAndCheckChild() != 0) return 19;
        if (after_pool.prepare != 2 || after_pool.parent != 2) return 20;
        if (GetTbbForkStats().finalized != finalized + 1) return 21;  // finalized again
        AtForkRegistry::Get().Unregister(&tag_after);
        AtForkRegistry::Get().Unregister(&tag_before);
        return 0;
      },
      60s, 60);
  ExpectChildOk(child,
                "10/12/18 workers did not start or park, 11/13/19 a grandchild "
                "failed or its child callback saw the wrong thing, 14 not quiet "
                "after the pool, 15 quiet before the pool drained, 16 oneTBB "
                "finalized in a quiet fork, 17 the pool stalled after it, 20/21 "
                "quiet with another thread");
}

// The simulated accelerator's device thread, idle, is parked for the fork and the fork stays
// quiet; it runs what the parent queues afterwards. With a kernel in flight it is not parked and
// the fork takes the full protocol (oneTBB finalized).
TEST(QuietForkTest, AnIdleDeviceThreadIsParkedAndABusyOneKeepsTheFullProtocol) {
  auto child = RunInChild(
      [] {
        if (ThreadsOfThisProcess() != 1) return kNotAlone;
        const device::Device sim(device::DeviceType::kSimAccel, 0);
        void* p = device::Allocate(sim, 4096);  // starts the device thread
        device::Synchronize(sim);
        ThreadPool pool(ThreadPoolOptions{2, "quiet", 2000ms});
        // Two workers and the device thread besides this one.
        if (!StartWorkersAndLetThemPark(pool, 4)) return 10;
        if (!RunInChild([] { return 0; }, 20s, 20).ok()) return 11;
        const uint64_t finalized = GetTbbForkStats().finalized;
        if (!RunInChild([] { return 0; }, 20s, 20).ok()) return 12;
        if (GetTbbForkStats().finalized != finalized) return 13;  // quiet: oneTBB skipped
        // The device thread runs again after the fork.
        auto& backend =
            static_cast<device::SimBackend&>(device::GetBackend(device::DeviceType::kSimAccel));
        std::atomic<int> ran{0};
        backend.LaunchKernel(0, p, 4096, [&ran](void*, size_t) { ran.fetch_add(1); });
        device::Synchronize(sim);
        if (ran.load() != 1) return 14;
        // A kernel in flight: the device thread is busy, the fork is not quiet.
        std::atomic<bool> release{false};
        backend.LaunchKernel(0, p, 4096, [&](void*, size_t) {
          ran.fetch_add(1);
          const auto until = std::chrono::steady_clock::now() + 10s;
          while (!release.load() && std::chrono::steady_clock::now() < until) {
            std::this_thread::sleep_for(1ms);
          }
        });
        if (!WaitUntil([&ran] { return ran.load() == 2; }, 5s)) return 15;
        const bool forked = RunInChild([] { return 0; }, 20s, 20).ok();
        release = true;
        device::Synchronize(sim);
        if (!forked) return 16;
        if (GetTbbForkStats().finalized != finalized + 1) return 17;  // the full protocol
        device::Free(sim, p);
        return 0;
      },
      60s, 60);
  ExpectChildOk(child,
                "10 workers did not start, 11/12/16 a grandchild failed, 13 "
                "oneTBB finalized although quiet, 14 the device thread did not run "
                "after the fork, 15 the kernel did not start, 17 quiet with a busy "
                "device thread");
}

}  // namespace
}  // namespace forksafe
