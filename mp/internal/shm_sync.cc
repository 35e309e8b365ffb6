#include "mp/internal/shm_sync.h"

#include <cerrno>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "runtime/error.h"

namespace forksafe::mp::internal {
namespace {

timespec ToMonotonic(Clock::time_point t) {
  // steady_clock is CLOCK_MONOTONIC on Linux/glibc.
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
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
  if (!timeout.has_value()) return std::nullopt;
  if (timeout->count() < 0) {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                         absl::StrCat(what, ": timeout must be >= 0 seconds, got ",
                                      timeout->count(), "; pass no timeout to wait forever"));
  }
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(*timeout);
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
    const timespec ts = ToMonotonic(*deadline);
    do {
      rc = pthread_mutex_clocklock(&m, CLOCK_MONOTONIC, &ts);
    } while (rc == EINTR);
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
  pthread_condattr_t a;
  Check(pthread_condattr_init(&a), "pthread_condattr_init");
  pthread_condattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  const int rc = pthread_cond_init(&c, &a);
  pthread_condattr_destroy(&a);
  Check(rc, "pthread_cond_init");
}

bool SharedCond::Wait(RobustMutex& mu, Deadline deadline, bool* owner_died) {
  int rc;
  if (deadline.has_value()) {
    const timespec ts = ToMonotonic(*deadline);
    rc = pthread_cond_timedwait(&c, &mu.m, &ts);
  } else {
    rc = pthread_cond_wait(&c, &mu.m);
  }
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(&mu.m);
    if (owner_died != nullptr) *owner_died = true;
    return true;
  }
  if (rc == ETIMEDOUT) return false;
  Check(rc, "pthread_cond_wait on a shared condition");
  return true;
}

void SharedCond::Signal() { pthread_cond_signal(&c); }
void SharedCond::Broadcast() { pthread_cond_broadcast(&c); }

}  // namespace forksafe::mp::internal
