// mp/internal/shm_sync.h: NOT FOR USERS. Process-shared, robust primitives that live inside a
// shared segment: the building blocks of Lock, Condition, Queue, ...
//
// Guarantees
//   - Mutexes are PTHREAD_PROCESS_SHARED and PTHREAD_MUTEX_ROBUST: when a process dies holding
//     one, the next locker gets it with LockResult::kOwnerDied (the mutex is made consistent) and
//     never hangs.
//   - Condition variables use CLOCK_MONOTONIC, so timeouts ignore wall-clock changes.
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

/// A process-shared condition variable (CLOCK_MONOTONIC).
struct SharedCond {
  pthread_cond_t c;

  void Init();
  /// Waits with `mu` held; returns false on timeout. Reports kOwnerDied through `owner_died`.
  bool Wait(RobustMutex& mu, Deadline deadline, bool* owner_died = nullptr);
  void Signal();
  void Broadcast();
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
