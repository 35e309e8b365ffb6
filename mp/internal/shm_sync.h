// mp/internal/shm_sync.h: NOT FOR USERS. Process-shared, robust primitives that live inside a
// shared segment: the building blocks of Lock, Condition, Queue, ...
//
// Guarantees
//   - Mutexes are PTHREAD_PROCESS_SHARED and PTHREAD_MUTEX_ROBUST: when a process dies holding
//     one, the next locker gets it with LockResult::kOwnerDied (the mutex is made consistent) and
//     never hangs.
//   - Condition variables are our own, on a futex sequence counter, not pthread_cond_t: glibc's
//     process-shared condition variable keeps per-waiter bookkeeping, and a waiter that dies
//     inside pthread_cond_wait can make every later signal block forever (seen in
//     tests/mp/queue_test: a producer SIGKILLed while waiting for room wedged the queue). A
//     sequence counter keeps no per-waiter state, so a dead waiter costs at most a spurious
//     wake-up. Timeouts use CLOCK_MONOTONIC.
//   - All waits take an optional deadline; none is unbounded unless asked to be.
#ifndef FORKSAFE_MP_INTERNAL_SHM_SYNC_H_
#define FORKSAFE_MP_INTERNAL_SHM_SYNC_H_

#include <pthread.h>

#include <chrono>
#include <optional>

namespace forksafe::mp::internal {

using Clock = std::chrono::steady_clock;
using Deadline = std::optional<Clock::time_point>;

/// nullopt for a negative or absent timeout means "wait forever"; a timeout must be >= 0.
/// Throws kInvalidArgument for a negative timeout, naming `what`.
Deadline DeadlineAfter(std::optional<std::chrono::duration<double>> timeout, const char* what);

enum class LockResult { kAcquired, kOwnerDied, kTimedOut };

/// A robust, process-shared mutex placed in shared memory. Init() once, by the creator.
struct RobustMutex {
  pthread_mutex_t m;

  void Init(bool recursive = false);
  /// Locks, waiting until `deadline` (forever when nullopt).
  LockResult Lock(Deadline deadline = std::nullopt);
  /// Locks if free right now.
  LockResult TryLock();
  /// Unlocks; throws kFailedPrecondition when the caller does not hold it.
  void Unlock();
};

/// A process-shared condition variable on a futex (robust to waiters that die; may wake
/// spuriously, so callers wait in a loop on their predicate).
struct SharedCond {
  uint32_t seq;      // bumped by every signal
  uint32_t waiters;  // an upper bound on sleepers (a dead waiter only inflates it)

  void Init();
  /// Waits with `mu` held; returns false on timeout. Reports kOwnerDied through `owner_died`.
  bool Wait(RobustMutex& mu, Deadline deadline, bool* owner_died = nullptr);
  void Signal();
  void Broadcast();
  /// Wakes up to `n` waiters.
  void Notify(int n);
  void NotifyAll() { Broadcast(); }
};

/// Holds a RobustMutex for a scope (waits forever).
class RobustLockGuard {
 public:
  explicit RobustLockGuard(RobustMutex& mu) : mu_(mu) { result_ = mu_.Lock(); }
  ~RobustLockGuard() { mu_.Unlock(); }
  RobustLockGuard(const RobustLockGuard&) = delete;
  RobustLockGuard& operator=(const RobustLockGuard&) = delete;
  bool owner_died() const { return result_ == LockResult::kOwnerDied; }

 private:
  RobustMutex& mu_;
  LockResult result_;
};

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_SHM_SYNC_H_
