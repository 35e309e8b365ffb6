// Tests of mp/synchronize.h and mp/shared_value.h across real processes.
//
// Children are forked with RunInChild (bounded, exit code = result). When the parent must act
// while a child runs, the child is forked from a helper thread (StartChild) and the test's main
// thread plays the parent's part; every wait on either side has a timeout.
#include "forksafe/mp/synchronize.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/shared_value.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"
#include "tests/support/leak_check.h"

namespace forksafe::mp {
namespace {

using forksafe::runtime::Error;
using forksafe::runtime::ErrorCode;
using forksafe::testing::ChildResult;
using forksafe::testing::RunInChild;
using namespace std::chrono_literals;
using Seconds = std::chrono::duration<double>;
using SteadyClock = std::chrono::steady_clock;

constexpr auto kChildTimeout = 20s;

// Runs `body` in a forked child from a helper thread, so that the caller can act meanwhile.
std::future<ChildResult> StartChild(std::function<int()> body) {
  return std::async(std::launch::async,
                    [body = std::move(body)] { return RunInChild(body, kChildTimeout, 30); });
}

using forksafe::testing::WaitUntil;

// Runs `fn` and returns the code of the Error it throws (fails the test if it does not throw).
template <class Fn>
ErrorCode CodeOf(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_FALSE(e.message().empty());
    return e.code();
  }
  ADD_FAILURE() << "expected an Error";
  return ErrorCode::kInternal;
}

// Runs `fn` on another thread of this process and returns its result.
template <class Fn>
auto OnOtherThread(Fn fn) {
  return std::async(std::launch::async, std::move(fn)).get();
}

double SecondsSince(SteadyClock::time_point start) {
  return Seconds(SteadyClock::now() - start).count();
}

// ---- Lock -------------------------------------------------------------------------------------

TEST(LockTest, HeldByParentBlocksChildUntilReleased) {
  Lock lock;
  Value<int> stage(0, /*lock=*/false);  // 1: child about to acquire; 2: parent about to release
  ASSERT_TRUE(lock.acquire());
  auto child = StartChild([&] {
    stage.set(1);
    if (!lock.acquire(true, 10s)) return 2;
    const int seen = stage.get();  // must be 2: the parent released only after writing it
    lock.release();
    return seen == 2 ? 0 : 3;
  });
  ASSERT_TRUE(WaitUntil([&] { return stage.get() == 1; }));
  std::this_thread::sleep_for(100ms);  // the child is now blocked in acquire()
  stage.set(2);
  lock.release();
  const ChildResult r = child.get();
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_TRUE(lock.acquire(false)) << "the child released it";
  lock.release();
}

TEST(LockTest, AcquireWithTimeoutReturnsFalseInTime) {
  Lock lock;
  ASSERT_TRUE(lock.acquire());
  const ChildResult r = RunInChild(
      [&] {
        if (lock.acquire(false)) return 1;
        const auto start = SteadyClock::now();
        if (lock.acquire(true, 200ms)) return 2;
        const double waited = SecondsSince(start);
        return waited >= 0.19 && waited < 3.0 ? 0 : 3;
      },
      kChildTimeout);
  EXPECT_TRUE(r.ok()) << r.Describe();
  lock.release();
}

// A Lock (or RLock) whose last handle goes while this thread holds it: the holder's robust-futex
// list still links through its mutex, so its pages must stay mapped; the next robust mutex the
// thread takes (another lock, a Value's, a Semaphore's inner one) used to write into the unmapped
// page and crash. In a child: a crash there is a failed exit code, not a dead test binary.
TEST(LockTest, DroppingAHeldLockLeavesTheThreadsOtherLocksWorking) {
  const ChildResult r = RunInChild(
      [] {
        forksafe::testing::ExpectLeak(
            "a lock dropped while held keeps its page mapped (mp/synchronize.cc)");
        // Where a dropped lock's page was unmapped, the next mapping of a page takes its
        // address: an inaccessible page there turns the old bug into a certain crash.
        std::vector<void*> fences;
        auto fence = [&fences] {
          fences.push_back(mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
        };
        for (int i = 0; i < 3; ++i) {
          auto held = std::make_unique<Lock>();
          if (!held->acquire()) return 1;
          held.reset();  // dropped while held
          fence();
          auto rheld = std::make_unique<RLock>();
          if (!rheld->acquire() || !rheld->acquire()) return 2;
          rheld.reset();
          fence();
        }
        Lock other;
        Semaphore sem(1);
        for (int i = 0; i < 100; ++i) {
          if (!other.acquire(true, 1s)) return 3;
          other.release();
          if (!sem.acquire(true, 1s)) return 4;
          sem.release();
        }
        for (void* f : fences) munmap(f, 4096);
        return 0;
      },
      kChildTimeout);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

TEST(LockTest, WorksWithStdLockGuardAndUniqueLock) {
  Lock lock;
  {
    std::lock_guard<Lock> guard(lock);
    EXPECT_FALSE(OnOtherThread([lock]() mutable { return lock.try_lock(); }));
  }
  std::unique_lock<Lock> ul(lock, std::try_to_lock);
  EXPECT_TRUE(ul.owns_lock());
  ul.unlock();
  EXPECT_TRUE(OnOtherThread([lock]() mutable {
    const bool got = lock.try_lock();
    if (got) lock.unlock();
    return got;
  }));
}

TEST(LockTest, OwnerExitingWhileHoldingIsRecoveredByBlockedWaiter) {
  Lock lock;
  Value<int> held(0, /*lock=*/false);
  auto child = StartChild([&] {
    if (!lock.acquire(true, 10s)) return 1;
    held.set(1);
    std::this_thread::sleep_for(200ms);
    return 0;  // RunInChild _exits with the lock still held
  });
  ASSERT_TRUE(WaitUntil([&] { return held.get() == 1; }));
  const auto start = SteadyClock::now();
  ASSERT_TRUE(lock.acquire(true, 10s)) << "the parent must get the lock of a dead owner";
  EXPECT_LT(SecondsSince(start), 5.0);
  EXPECT_TRUE(lock.previous_owner_died());
  lock.release();
  const ChildResult r = child.get();
  EXPECT_TRUE(r.ok()) << r.Describe();
  ASSERT_TRUE(lock.acquire(true, 1s));
  EXPECT_FALSE(lock.previous_owner_died()) << "cleared by the next normal acquire";
  lock.release();
}

TEST(LockTest, OwnerKilledWhileHoldingIsRecovered) {
  Lock lock;
  RLock rlock;
  const ChildResult r = RunInChild(
      [&] {
        if (!lock.acquire(true, 10s) || !rlock.acquire(true, 10s) || !rlock.acquire(true, 10s)) {
          return 1;
        }
        raise(SIGKILL);
        return 2;
      },
      kChildTimeout);
  ASSERT_EQ(r.signal, SIGKILL) << r.Describe();
  ASSERT_TRUE(lock.acquire(true, 5s));
  EXPECT_TRUE(lock.previous_owner_died());
  lock.release();
  ASSERT_TRUE(rlock.acquire(true, 5s));
  EXPECT_TRUE(rlock.previous_owner_died());
  rlock.release();  // depth restarted at 1 on recovery: one release frees it
  EXPECT_TRUE(OnOtherThread([rlock]() mutable {
    const bool got = rlock.acquire(false);
    if (got) rlock.release();
    return got;
  }));
}

TEST(LockTest, ReleaseByNonOwnerAndUntimedReacquireAreFailedPrecondition) {
  Lock lock;
  EXPECT_EQ(CodeOf([&] { lock.release(); }), ErrorCode::kFailedPrecondition);
  ASSERT_TRUE(lock.acquire());
  EXPECT_FALSE(lock.acquire(false)) << "non-blocking re-acquire by the owner returns false";
  // A timed re-acquire by the owner ends at its timeout, false (as Python's); an untimed one
  // would never end: it is the error instead of a deadlock.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(lock.acquire(true, 200ms));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 200ms);
  EXPECT_EQ(CodeOf([&] { lock.acquire(); }), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(OnOtherThread([lock]() mutable { return CodeOf([&] { lock.release(); }); }),
            ErrorCode::kFailedPrecondition);
  const ChildResult r = RunInChild(
      [&] {
        try {
          lock.release();  // the parent's thread holds it, not the child's
        } catch (const Error& e) {
          return e.code() == ErrorCode::kFailedPrecondition ? 0 : 1;
        }
        return 2;
      },
      kChildTimeout);
  EXPECT_TRUE(r.ok()) << r.Describe();
  lock.release();
}

TEST(LockTest, NegativeTimeoutsAreInvalidArgument) {
  Lock lock;
  RLock rlock;
  Semaphore sem(0);
  Event event;
  Condition cond;
  Barrier barrier(2);
  EXPECT_EQ(CodeOf([&] { lock.acquire(true, -1s); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { rlock.acquire(true, -1ms); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { sem.acquire(true, Seconds(-0.5)); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { event.wait(-1s); }), ErrorCode::kInvalidArgument);
  ASSERT_TRUE(cond.acquire());
  EXPECT_EQ(CodeOf([&] { cond.wait(-1s); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { cond.wait_for([] { return false; }, -1s); }), ErrorCode::kInvalidArgument);
  cond.release();
  EXPECT_EQ(CodeOf([&] { barrier.wait(-1s); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([&] { Barrier(2, nullptr, -1s); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(barrier.n_waiting(), 0) << "a rejected wait must not count as an arrival";
}

// ---- RLock ------------------------------------------------------------------------------------

TEST(RLockTest, RecursionAcrossProcesses) {
  RLock rlock;
  ASSERT_TRUE(rlock.acquire());
  ASSERT_TRUE(rlock.acquire());
  ASSERT_TRUE(rlock.acquire(false));
  rlock.release();
  rlock.release();  // depth 1: still held
  ChildResult r = RunInChild([&] { return rlock.acquire(true, 100ms) ? 1 : 0; }, kChildTimeout);
  EXPECT_TRUE(r.ok()) << "the child must not get an RLock held once: " << r.Describe();
  rlock.release();
  EXPECT_EQ(CodeOf([&] { rlock.release(); }), ErrorCode::kFailedPrecondition);
  r = RunInChild(
      [&] {
        if (!rlock.acquire(true, 5s) || !rlock.acquire(false)) return 1;
        rlock.release();
        rlock.release();
        return 0;
      },
      kChildTimeout);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

// ---- Semaphore --------------------------------------------------------------------------------

TEST(SemaphoreTest, CountsAcrossThreeChildren) {
  Semaphore sem(2);
  Value<int> inside(0);
  Value<int> most_inside(0);
  auto body = [&] {
    for (int round = 0; round < 3; ++round) {
      if (!sem.acquire(true, 10s)) return 1;
      const int now = inside.update([](int v) { return v + 1; });
      most_inside.update([now](int& m) {
        if (now > m) m = now;
      });
      std::this_thread::sleep_for(30ms);
      inside.update([](int v) { return v - 1; });
      sem.release();
    }
    return 0;
  };
  std::vector<std::future<ChildResult>> children;
  for (int i = 0; i < 3; ++i) children.push_back(StartChild(body));
  for (auto& c : children) {
    const ChildResult r = c.get();
    EXPECT_TRUE(r.ok()) << r.Describe();
  }
  EXPECT_LE(most_inside.get(), 2) << "a Semaphore(2) let more than 2 processes in";
  EXPECT_GE(most_inside.get(), 1);
  EXPECT_EQ(inside.get(), 0);
  EXPECT_EQ(sem.get_value(), 2);
}

TEST(SemaphoreTest, NonBlockingTimeoutAndArguments) {
  EXPECT_EQ(CodeOf([] { Semaphore(-1); }), ErrorCode::kInvalidArgument);
  Semaphore sem(0);
  EXPECT_FALSE(sem.acquire(false));
  const auto start = SteadyClock::now();
  EXPECT_FALSE(sem.acquire(true, 100ms));
  EXPECT_GE(SecondsSince(start), 0.09);
  EXPECT_EQ(CodeOf([&] { sem.release(0); }), ErrorCode::kInvalidArgument);
  sem.release(2);
  EXPECT_EQ(sem.get_value(), 2);
  // A child blocked on the semaphore is woken by the parent's release.
  ASSERT_TRUE(sem.acquire(false));
  ASSERT_TRUE(sem.acquire(false));
  auto child = StartChild([&] { return sem.acquire(true, 10s) ? 0 : 1; });
  std::this_thread::sleep_for(50ms);
  sem.release();
  const ChildResult r = child.get();
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_EQ(sem.get_value(), 0);
}

TEST(SemaphoreTest, BoundedSemaphoreRejectsOverRelease) {
  EXPECT_EQ(CodeOf([] { BoundedSemaphore(-1); }), ErrorCode::kInvalidArgument);
  BoundedSemaphore sem(2);
  EXPECT_EQ(CodeOf([&] { sem.release(); }), ErrorCode::kFailedPrecondition);
  ASSERT_TRUE(sem.acquire(false));
  EXPECT_EQ(CodeOf([&] { sem.release(2); }), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(sem.get_value(), 1) << "a rejected release changes nothing";
  const ChildResult r = RunInChild(
      [&] {
        sem.release();  // back to 2: allowed
        try {
          sem.release();
        } catch (const Error& e) {
          return e.code() == ErrorCode::kFailedPrecondition ? 0 : 1;
        }
        return 2;
      },
      kChildTimeout);
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_EQ(sem.get_value(), 2);
}

// glibc's process-shared pthread_cond_t loses wakeups (and can hang the notifier) once a waiter
// is killed mid-wait; these objects must not inherit that.
TEST(SemaphoreTest, WaiterKilledMidWaitLeavesItUsable) {
  Semaphore sem(0);
  Value<int> waiting(0, /*lock=*/false);
  const ChildResult killed = RunInChild(
      [&] {
        std::thread killer([] {
          std::this_thread::sleep_for(200ms);
          raise(SIGKILL);
        });
        killer.detach();
        sem.acquire(true, 20s);
        return 1;
      },
      kChildTimeout);
  ASSERT_EQ(killed.signal, SIGKILL) << killed.Describe();
  for (int round = 1; round <= 3; ++round) {
    auto child = StartChild([&, round] {
      waiting.set(round);
      return sem.acquire(true, 10s) ? 0 : 1;
    });
    ASSERT_TRUE(WaitUntil([&] { return waiting.get() == round; }));
    std::this_thread::sleep_for(30ms);
    sem.release();
    const ChildResult r = child.get();
    EXPECT_TRUE(r.ok()) << "round " << round << ": " << r.Describe();
  }
  EXPECT_EQ(sem.get_value(), 0);
}

// ---- Condition --------------------------------------------------------------------------------

TEST(ConditionTest, NotifyWakesAWaitingChild) {
  Condition cond;
  Value<int> waiting(0, /*lock=*/false);
  Value<int> ready(0, /*lock=*/false);
  auto child = StartChild([&] {
    if (!cond.acquire(true, 10s)) return 1;
    waiting.set(1);
    const bool ok = cond.wait_for([&] { return ready.get() == 1; }, 10s);
    cond.release();
    return ok ? 0 : 2;
  });
  ASSERT_TRUE(WaitUntil([&] { return waiting.get() == 1; }));
  ASSERT_TRUE(cond.acquire(true, 10s)) << "the waiting child must have released the lock";
  ready.set(1);
  cond.notify();
  cond.release();
  const ChildResult r = child.get();
  EXPECT_TRUE(r.ok()) << r.Describe();
}

TEST(ConditionTest, WaitTimesOutAndKeepsTheLock) {
  Lock lock;
  Condition cond(lock);
  std::unique_lock<Condition> guard(cond);
  const auto start = SteadyClock::now();
  EXPECT_FALSE(cond.wait(100ms));
  EXPECT_GE(SecondsSince(start), 0.09);
  EXPECT_FALSE(cond.wait_for([] { return false; }, 50ms));
  EXPECT_TRUE(cond.wait_for([] { return true; }, 0s));
  // The condition's lock is the Lock we gave it: another thread cannot take it now.
  EXPECT_FALSE(OnOtherThread([lock]() mutable { return lock.acquire(false); }));
}

TEST(ConditionTest, MisuseIsFailedPrecondition) {
  Condition cond;
  EXPECT_EQ(CodeOf([&] { cond.wait(10ms); }), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(CodeOf([&] { cond.wait_for([] { return false; }, 10ms); }),
            ErrorCode::kFailedPrecondition);
  EXPECT_EQ(CodeOf([&] { cond.notify(); }), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(CodeOf([&] { cond.notify_all(); }), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(CodeOf([&] { cond.release(); }), ErrorCode::kFailedPrecondition);
  std::lock_guard<Condition> guard(cond);
  EXPECT_EQ(CodeOf([&] { cond.notify(-1); }), ErrorCode::kInvalidArgument);
  cond.notify(0);
}

TEST(ConditionTest, WithRLockReleasesEveryLevelWhileWaiting) {
  RLock rlock;
  Condition cond(rlock);
  ASSERT_TRUE(cond.acquire());
  ASSERT_TRUE(rlock.acquire());  // depth 2
  auto child = StartChild([&] {
    if (!rlock.acquire(true, 10s)) return 1;  // possible only while the parent waits
    cond.notify();
    rlock.release();
    return 0;
  });
  EXPECT_TRUE(cond.wait(10s));
  const ChildResult r = child.get();
  EXPECT_TRUE(r.ok()) << r.Describe();
  rlock.release();
  cond.release();  // both levels were restored
  EXPECT_EQ(CodeOf([&] { rlock.release(); }), ErrorCode::kFailedPrecondition);
}

// ---- Event ------------------------------------------------------------------------------------

TEST(EventTest, SetInChildIsSeenByParent) {
  Event event;
  EXPECT_FALSE(event.is_set());
  auto child = StartChild([&] {
    std::this_thread::sleep_for(50ms);
    event.set();
    return 0;
  });
  EXPECT_TRUE(event.wait(10s));
  EXPECT_TRUE(event.is_set());
  const ChildResult r = child.get();
  EXPECT_TRUE(r.ok()) << r.Describe();
  event.clear();
  EXPECT_FALSE(event.is_set());
  const auto start = SteadyClock::now();
  EXPECT_FALSE(event.wait(100ms));
  EXPECT_GE(SecondsSince(start), 0.09);
  // And the other way round: a child waiting for the parent.
  auto waiter = StartChild([&] { return event.wait(10s) ? 0 : 1; });
  std::this_thread::sleep_for(50ms);
  event.set();
  const ChildResult w = waiter.get();
  EXPECT_TRUE(w.ok()) << w.Describe();
}

// ---- Barrier ----------------------------------------------------------------------------------

TEST(BarrierTest, ThreeProcessesReleaseTogetherAndReuseIt) {
  constexpr int kRounds = 3;
  Value<int> actions(0);
  Value<int> arrived(0);
  Array<int> index_hits(3 * kRounds, 0);  // [round * 3 + index]
  Barrier barrier(3, [&] { actions.update([](int& a) { ++a; }); });
  auto party = [&] {
    for (int round = 0; round < kRounds; ++round) {
      arrived.update([](int& a) { ++a; });
      const int index = barrier.wait(10s);
      if (index < 0 || index >= 3) return 1;
      if (arrived.get() < 3 * (round + 1)) return 2;  // released before everyone arrived
      if (actions.get() < round + 1) return 3;        // released before the action ran
      std::lock_guard<Lock> guard(index_hits.get_lock());
      ++index_hits[round * 3 + index];
    }
    return 0;
  };
  auto c1 = StartChild(party);
  auto c2 = StartChild(party);
  EXPECT_EQ(party(), 0);
  for (auto* c : {&c1, &c2}) {
    const ChildResult r = c->get();
    EXPECT_TRUE(r.ok()) << r.Describe();
  }
  EXPECT_EQ(actions.get(), kRounds) << "the action runs once per cycle";
  for (int i = 0; i < 3 * kRounds; ++i) {
    EXPECT_EQ(index_hits[i], 1) << "each index is returned once per cycle (slot " << i << ")";
  }
  EXPECT_FALSE(barrier.broken());
  EXPECT_EQ(barrier.n_waiting(), 0);
}

TEST(BarrierTest, TimeoutBreaksItForEveryWaiter) {
  Barrier barrier(3);
  auto child = StartChild([&] {
    try {
      barrier.wait(10s);
    } catch (const Error& e) {
      return e.code() == ErrorCode::kFailedPrecondition ? 0 : 1;
    }
    return 2;
  });
  ASSERT_TRUE(WaitUntil([&] { return barrier.n_waiting() == 1; }));
  const auto start = SteadyClock::now();
  EXPECT_EQ(CodeOf([&] { barrier.wait(100ms); }), ErrorCode::kDeadlineExceeded);
  EXPECT_LT(SecondsSince(start), 5.0);
  const ChildResult r = child.get();
  EXPECT_TRUE(r.ok()) << "the other waiter must see a broken barrier: " << r.Describe();
  EXPECT_TRUE(barrier.broken());
  EXPECT_EQ(CodeOf([&] { barrier.wait(1s); }), ErrorCode::kFailedPrecondition);
  barrier.reset();
  EXPECT_FALSE(barrier.broken());
  EXPECT_EQ(barrier.n_waiting(), 0);
  barrier.abort();
  EXPECT_TRUE(barrier.broken());
  EXPECT_EQ(CodeOf([&] { barrier.wait(1s); }), ErrorCode::kFailedPrecondition);
}

TEST(BarrierTest, ArgumentsDefaultTimeoutAndSingleParty) {
  EXPECT_EQ(CodeOf([] { Barrier(0); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([] { Barrier(-3); }), ErrorCode::kInvalidArgument);
  int ran = 0;
  Barrier one(1, [&] { ++ran; });
  EXPECT_EQ(one.parties(), 1);
  EXPECT_EQ(one.wait(), 0);
  EXPECT_EQ(one.wait(), 0);
  EXPECT_EQ(ran, 2);
  Barrier two(2, nullptr, 100ms);
  const auto start = SteadyClock::now();
  EXPECT_EQ(CodeOf([&] { two.wait(); }), ErrorCode::kDeadlineExceeded) << "default timeout";
  EXPECT_GE(SecondsSince(start), 0.09);
  EXPECT_TRUE(two.broken());
}

TEST(BarrierTest, ADecodedBarrierRunsOnlyTheActionItIsGiven) {
  int original = 0;
  Barrier barrier(1, [&] { ++original; });
  Message msg = Encode(barrier);
  Barrier decoded(1);
  Decode(msg, decoded);
  EXPECT_EQ(decoded.wait(), 0);  // actions do not travel
  EXPECT_EQ(original, 0);
  int local = 0;
  decoded.set_action([&] { ++local; });
  EXPECT_EQ(decoded.wait(), 0);
  EXPECT_EQ(local, 1);
  decoded.set_action(nullptr);
  EXPECT_EQ(decoded.wait(), 0);
  EXPECT_EQ(local, 1);
  EXPECT_EQ(barrier.wait(), 0);  // the original keeps its own
  EXPECT_EQ(original, 1);
}

TEST(BarrierTest, ThrowingActionBreaksItAndReachesTheLastParty) {
  Barrier barrier(2, [] { throw Error(ErrorCode::kInternal, "action failed"); });
  auto child = StartChild([&] {
    try {
      barrier.wait(10s);
    } catch (const Error& e) {
      // Either this process ran the action (kInternal) or it saw the barrier break.
      return e.code() == ErrorCode::kInternal || e.code() == ErrorCode::kFailedPrecondition ? 0 : 1;
    }
    return 2;
  });
  EXPECT_THROW(barrier.wait(10s), Error);
  const ChildResult r = child.get();
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_TRUE(barrier.broken());
}

// ---- Value / Array ----------------------------------------------------------------------------

TEST(ValueTest, IncrementsFromFourChildrenUnderTheLockSumUp) {
  Value<int64_t> guarded(0);
  Value<int64_t> updated(0);
  std::vector<std::future<ChildResult>> children;
  for (int i = 0; i < 4; ++i) {
    children.push_back(StartChild([&] {
      for (int k = 0; k < 1000; ++k) {
        {
          std::lock_guard<Lock> hold(guarded.get_lock());
          guarded.set(guarded.get() + 1);  // get/set see the lock is held and do not retake it
        }
        updated.update([](int64_t v) { return v + 1; });
      }
      return 0;
    }));
  }
  for (auto& c : children) {
    const ChildResult r = c.get();
    EXPECT_TRUE(r.ok()) << r.Describe();
  }
  EXPECT_EQ(guarded.get(), 4000);
  EXPECT_EQ(updated.get(), 4000);
}

TEST(ValueTest, WithoutLockAndStructs) {
  struct Point {
    int32_t x;
    double y;
  };
  Value<Point> p(Point{1, 2.5});
  EXPECT_EQ(p.get().x, 1);
  const ChildResult r = RunInChild(
      [&] {
        p.update([](Point& q) {
          q.x += 41;
          q.y *= 2;
        });
        return 0;
      },
      kChildTimeout);
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_EQ(p.get().x, 42);
  EXPECT_DOUBLE_EQ(p.get().y, 5.0);

  Value<int> raw(7, /*lock=*/false);
  EXPECT_FALSE(raw.has_lock());
  EXPECT_EQ(CodeOf([&] { raw.get_lock(); }), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(CodeOf([&] { raw.update([](int v) { return v; }); }), ErrorCode::kFailedPrecondition);
  EXPECT_TRUE(RunInChild(
                  [&] {
                    raw.set(8);
                    return 0;
                  },
                  kChildTimeout)
                  .ok());
  EXPECT_EQ(raw.get(), 8);
}

TEST(ArrayTest, WrittenByChildIsSeenByParent) {
  Array<double> a(100, -1.0);
  EXPECT_EQ(a.size(), 100u);
  const ChildResult r = RunInChild(
      [&] {
        std::lock_guard<Lock> guard(a.get_lock());
        for (size_t i = 0; i < a.size(); ++i) a[i] = 1.5 * static_cast<double>(i);
        return 0;
      },
      kChildTimeout);
  EXPECT_TRUE(r.ok()) << r.Describe();
  const std::vector<double> v = a.to_vector();
  ASSERT_EQ(v.size(), 100u);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_DOUBLE_EQ(v[i], 1.5 * static_cast<double>(i));
  EXPECT_DOUBLE_EQ(a.at(99), 148.5);

  Array<int> init(std::vector<int>{3, 1, 4}, /*lock=*/false);
  EXPECT_EQ(init.to_vector(), (std::vector<int>{3, 1, 4}));
  EXPECT_EQ(CodeOf([&] { init.get_lock(); }), ErrorCode::kFailedPrecondition);
}

TEST(ArrayTest, IndexOutOfRangeIsInvalidArgument) {
  Array<int> a(3);
  EXPECT_EQ(CodeOf([&] { a.at(3); }), ErrorCode::kInvalidArgument);
  try {
    a.at(7);
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("index 7"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("size 3"), std::string::npos) << e.message();
  }
  Array<int> empty(0);
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_TRUE(empty.to_vector().empty());
  EXPECT_EQ(CodeOf([&] { empty.at(0); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CodeOf([] { Array<int64_t>(SIZE_MAX / 2); }), ErrorCode::kInvalidArgument);
}

// ---- codec ------------------------------------------------------------------------------------

TEST(CodecTest, DecodedLockSharesStateWithTheOriginal) {
  Lock lock;
  Message msg = Encode(lock);
  ASSERT_EQ(msg.fds.size(), 1u) << "the memfd travels out of band";
  Lock decoded;
  Decode(msg, decoded);
  ASSERT_TRUE(lock.acquire());
  EXPECT_FALSE(OnOtherThread([decoded]() mutable { return decoded.acquire(false); }))
      << "acquired through the original, the decoded handle must see it held";
  decoded.release();  // same thread, same lock
  EXPECT_TRUE(OnOtherThread([decoded]() mutable {
    const bool got = decoded.acquire(false);
    if (got) decoded.release();
    return got;
  }));
}

TEST(CodecTest, DecodedInAChildMapsTheSameMemory) {
  // What a spawned process does: build every handle from the message alone.
  Value<int> counter(0);
  Array<int> cells(4, 0);
  Semaphore sem(0);
  Event event;
  Message msg = Encode(counter, cells, sem, event, counter.get_lock());
  const ChildResult r = RunInChild(
      [&] {
        Value<int> c;
        Array<int> a(1);
        Semaphore s;
        Event e;
        Lock l;
        Decode(msg, c, a, s, e, l);
        if (a.size() != 4) return 1;
        {
          std::lock_guard<Lock> guard(l);  // the Value's own lock, sent on its own
          c.set(c.get() + 5);
        }
        for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<int>(i) * 10;
        s.release(3);
        e.set();
        return 0;
      },
      kChildTimeout);
  ASSERT_TRUE(r.ok()) << r.Describe();
  EXPECT_EQ(counter.get(), 5);
  EXPECT_EQ(cells.to_vector(), (std::vector<int>{0, 10, 20, 30}));
  EXPECT_EQ(sem.get_value(), 3);
  EXPECT_TRUE(event.is_set());
}

TEST(CodecTest, ConditionAndBarrierWorkAcrossTwoMappings) {
  Condition cond;
  Barrier barrier(2, [] {});
  Message msg = Encode(cond, barrier);
  Condition cond2;
  Barrier barrier2(5);
  Decode(msg, cond2, barrier2);
  EXPECT_EQ(barrier2.parties(), 2);
  // A waiter on one mapping is woken by a notify through the other.
  std::atomic<int> phase{0};
  std::thread waiter([&] {
    std::unique_lock<Condition> guard(cond2);
    phase = 1;
    phase = cond2.wait_for([&] { return phase.load() == 2; }, 10s) ? 3 : 4;
  });
  ASSERT_TRUE(WaitUntil([&] { return phase.load() == 1; }));
  {
    std::lock_guard<Condition> guard(cond);
    phase = 2;
    cond.notify_all();
  }
  waiter.join();
  EXPECT_EQ(phase.load(), 3);
  std::thread other([&] { EXPECT_GE(barrier2.wait(10s), 0); });
  EXPECT_GE(barrier.wait(10s), 0);
  other.join();
}

TEST(CodecTest, DecodingIntoTheWrongTypeIsInvalidArgument) {
  Lock lock;
  RLock rlock;
  Barrier barrier(2);
  Value<int64_t> v64(1);
  Array<int> ints(3);
  Value<int> plain(1, /*lock=*/false);
  auto decode_code = [](auto source, auto target) {
    Message msg = Encode(source);
    return CodeOf([&] { Decode(msg, target); });
  };
  EXPECT_EQ(decode_code(lock, RLock()), ErrorCode::kInvalidArgument);
  EXPECT_EQ(decode_code(rlock, Lock()), ErrorCode::kInvalidArgument);
  EXPECT_EQ(decode_code(barrier, Lock()), ErrorCode::kInvalidArgument);
  EXPECT_EQ(decode_code(barrier, Event()), ErrorCode::kInvalidArgument);
  EXPECT_EQ(decode_code(Semaphore(1), BoundedSemaphore(1)), ErrorCode::kInvalidArgument);
  EXPECT_EQ(decode_code(v64, Value<int32_t>()), ErrorCode::kInvalidArgument);
  EXPECT_EQ(decode_code(ints, Value<int>()), ErrorCode::kInvalidArgument);
  EXPECT_EQ(decode_code(v64, Array<int64_t>(1)), ErrorCode::kInvalidArgument);
  EXPECT_EQ(decode_code(plain, Lock()), ErrorCode::kInvalidArgument) << "it has no lock";
  EXPECT_EQ(decode_code(int32_t{5}, Lock()), ErrorCode::kInvalidArgument);
  // The right types decode fine, including a lock-less Value and a BoundedSemaphore.
  Message ok = Encode(plain, BoundedSemaphore(2));
  Value<int> plain2;
  BoundedSemaphore bounded(1);
  Decode(ok, plain2, bounded);
  EXPECT_FALSE(plain2.has_lock());
  EXPECT_EQ(bounded.get_value(), 2);
  EXPECT_EQ(CodeOf([&] { bounded.release(); }), ErrorCode::kFailedPrecondition);
}

}  // namespace
}  // namespace forksafe::mp
