#include "forksafe/mp/internal/shm_sync.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/timeout.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp::internal {
namespace {

timespec ToMonotonic(Clock::time_point t) {
  // steady_clock is CLOCK_MONOTONIC on Linux/glibc.
  const auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  timespec ts;
  ts.tv_sec = static_cast<time_t>(ns / 1000000000);
  ts.tv_nsec = static_cast<long>(ns % 1000000000);
  return ts;
}

void Check(int rc, const char* what) {
  if (rc != 0) runtime::ThrowSystemError(what, rc);
}

}  // namespace

Deadline DeadlineAfter(std::optional<std::chrono::duration<double>> timeout, const char* what) {
  // The one conversion of mp/timeout.h: NaN and negative throw, +infinity is forever.
  const std::optional<Clock::duration> wait = CheckedWait(timeout, what);
  if (!wait.has_value()) return std::nullopt;
  return Clock::now() + *wait;
}

void RobustMutex::Init(bool recursive) {
  pthread_mutexattr_t a;
  Check(pthread_mutexattr_init(&a), "pthread_mutexattr_init");
  pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  pthread_mutexattr_settype(&a, recursive ? PTHREAD_MUTEX_RECURSIVE : PTHREAD_MUTEX_ERRORCHECK);
  const int rc = pthread_mutex_init(&m, &a);
  pthread_mutexattr_destroy(&a);
  Check(rc, "pthread_mutex_init");
}

LockResult RobustMutex::Lock(Deadline deadline) {
  int rc;
  if (deadline.has_value()) {
#if defined(__SANITIZE_THREAD__)
    // ThreadSanitizer (gcc 12) does not intercept pthread_mutex_clocklock, so a lock taken with
    // it would be invisible to tsan and its unlock reported as a bug. Under tsan only, wait on
    // the realtime clock instead (a wall-clock jump can stretch or shorten this one wait).
    const auto left = *deadline - Clock::now();
    timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    const long long ns =
        ts.tv_nsec +
        std::max<long long>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(left).count());
    ts.tv_sec += static_cast<time_t>(ns / 1000000000);
    ts.tv_nsec = static_cast<long>(ns % 1000000000);
    do {
      rc = pthread_mutex_timedlock(&m, &ts);
    } while (rc == EINTR);
#else
    const timespec ts = ToMonotonic(*deadline);
    do {
      rc = pthread_mutex_clocklock(&m, CLOCK_MONOTONIC, &ts);
    } while (rc == EINTR);
#endif
  } else {
    rc = pthread_mutex_lock(&m);
  }
  if (rc == 0) return LockResult::kAcquired;
  if (rc == ETIMEDOUT) return LockResult::kTimedOut;
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(&m);
    return LockResult::kOwnerDied;
  }
  if (rc == EDEADLK) {
    throw runtime::Error(runtime::ErrorCode::kFailedPrecondition,
                         "this thread already holds the lock (it is not recursive: use RLock)");
  }
  runtime::ThrowSystemError("pthread_mutex_lock on a shared mutex", rc);
}

LockResult RobustMutex::TryLock() {
  const int rc = pthread_mutex_trylock(&m);
  if (rc == 0) return LockResult::kAcquired;
  if (rc == EBUSY) return LockResult::kTimedOut;
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(&m);
    return LockResult::kOwnerDied;
  }
  if (rc == EDEADLK) return LockResult::kTimedOut;
  runtime::ThrowSystemError("pthread_mutex_trylock on a shared mutex", rc);
}

void RobustMutex::Unlock() {
  const int rc = pthread_mutex_unlock(&m);
  if (rc == EPERM) {
    throw runtime::Error(runtime::ErrorCode::kFailedPrecondition,
                         "release of a lock that this thread does not hold");
  }
  Check(rc, "pthread_mutex_unlock on a shared mutex");
}

void SharedCond::Init() {
  seq = 0;
  waiters = 0;
}

bool SharedCond::Wait(RobustMutex& mu, Deadline deadline, bool* owner_died) {
  const uint32_t seen = __atomic_load_n(&seq, __ATOMIC_ACQUIRE);
  __atomic_add_fetch(&waiters, 1, __ATOMIC_ACQ_REL);
  mu.Unlock();
  timespec ts;
  timespec* abs = nullptr;
  if (deadline.has_value()) {
    ts = ToMonotonic(*deadline);
    abs = &ts;
  }
  // FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC deadline. Not FUTEX_PRIVATE: the word is
  // shared between processes.
  const long rc =
      syscall(SYS_futex, &seq, FUTEX_WAIT_BITSET, seen, abs, nullptr, FUTEX_BITSET_MATCH_ANY);
  const bool timed_out = rc == -1 && errno == ETIMEDOUT;
  __atomic_sub_fetch(&waiters, 1, __ATOMIC_ACQ_REL);
  if (mu.Lock() == LockResult::kOwnerDied && owner_died != nullptr) *owner_died = true;
  return !timed_out;
}

void SharedCond::Signal() {
  __atomic_add_fetch(&seq, 1, __ATOMIC_ACQ_REL);
  if (__atomic_load_n(&waiters, __ATOMIC_ACQUIRE) > 0) {
    syscall(SYS_futex, &seq, FUTEX_WAKE, 1, nullptr, nullptr, 0);
  }
}

void SharedCond::Notify(int n) {
  if (n <= 0) return;
  __atomic_add_fetch(&seq, 1, __ATOMIC_ACQ_REL);
  if (__atomic_load_n(&waiters, __ATOMIC_ACQUIRE) > 0) {
    syscall(SYS_futex, &seq, FUTEX_WAKE, n, nullptr, nullptr, 0);
  }
}

void SharedCond::Broadcast() {
  __atomic_add_fetch(&seq, 1, __ATOMIC_ACQ_REL);
  if (__atomic_load_n(&waiters, __ATOMIC_ACQUIRE) > 0) {
    syscall(SYS_futex, &seq, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  }
}

}  // namespace forksafe::mp::internal
