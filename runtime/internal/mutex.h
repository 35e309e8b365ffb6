// runtime/internal/mutex.h: NOT FOR USERS. The library's mutex, condition variable and lock
// guards, annotated for Clang's thread-safety analysis.
//
// What it offers
//   - Mutex: a std::mutex that Clang's -Wthread-safety understands (a "capability"). Members it
//     protects are declared `T x FORKSAFE_GUARDED_BY(mu_);`, functions that expect it held
//     `FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_)`, so that an access without the lock fails the
//     thread-safety build (tools/thread_safety.sh, run by CI).
//   - MutexLock: the scoped guard (std::unique_lock underneath): locks in its constructor,
//     unlocks in its destructor, may Unlock()/Lock() in between.
//   - CondVar: a std::condition_variable that waits on a MutexLock. Write waits as loops,
//     `while (!ready_) cv_.Wait(&lock);`, so that the analysis sees the guarded reads under the
//     lock (a predicate lambda is a separate function to it).
//
// Guarantees
//   - Same behaviour and cost as std::mutex / std::unique_lock / std::condition_variable: the
//     wrappers are inline and hold nothing else.
//   - Fork: nothing is done at fork. A mutex that another thread may have held when the process
//     forked is re-created in the child with ResetAfterFork(), by the component that owns it
//     (runtime/at_fork.h's child handlers), before the child's first use.
//
// Hazards
//   - ResetAfterFork() and CondVar::ResetAfterFork() are for a forked child's handlers only: on a
//     mutex with waiters or an owner in this process they corrupt it.
//   - The analysis is static and local: it does not follow a lock taken through a pointer it cannot
//     name, and `FORKSAFE_NO_THREAD_SAFETY_ANALYSIS` turns it off for a function. Use the latter
//     only where a comment says why the access is safe (a forked child with one thread, a
//     constructor).
#ifndef FORKSAFE_RUNTIME_INTERNAL_MUTEX_H_
#define FORKSAFE_RUNTIME_INTERNAL_MUTEX_H_

#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <new>

#include "forksafe/runtime/internal/thread_annotations.h"

namespace forksafe::runtime::internal {

/// A std::mutex that Clang's thread-safety analysis can check (see the banner).
class FORKSAFE_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  /// Blocks until this thread holds the mutex.
  void Lock() FORKSAFE_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  /// Releases the mutex, which this thread holds.
  void Unlock() FORKSAFE_UNLOCK_FUNCTION() { mu_.unlock(); }
  /// Takes the mutex if it is free and returns true; returns false at once otherwise.
  bool TryLock() FORKSAFE_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  /// Tells the analysis that the caller holds the mutex (no run-time check).
  void AssertHeld() const FORKSAFE_ASSERT_EXCLUSIVE_LOCK() {}

  /// Re-creates the mutex, unlocked, in a forked child (see Hazards).
  void ResetAfterFork() FORKSAFE_NO_THREAD_SAFETY_ANALYSIS { new (&mu_) std::mutex(); }

  /// The std::mutex underneath, for code that must hand it to the standard library.
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

/// Holds a Mutex for its scope; Unlock() and Lock() release and take it again in between.
class FORKSAFE_SCOPED_LOCKABLE MutexLock {
 public:
  /// Locks `*mu` (blocking).
  explicit MutexLock(Mutex* mu) FORKSAFE_EXCLUSIVE_LOCK_FUNCTION(mu) : lock_(mu->native()) {}
  /// Unlocks the mutex if this guard still holds it.
  ~MutexLock() FORKSAFE_UNLOCK_FUNCTION() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  /// Releases the mutex before the end of the scope.
  void Unlock() FORKSAFE_UNLOCK_FUNCTION() { lock_.unlock(); }
  /// Takes the mutex again after Unlock().
  void Lock() FORKSAFE_EXCLUSIVE_LOCK_FUNCTION() { lock_.lock(); }

  /// The std::unique_lock underneath (for CondVar and the standard library).
  std::unique_lock<std::mutex>& native() { return lock_; }

 private:
  std::unique_lock<std::mutex> lock_;
};

/// A condition variable whose waits take a MutexLock (see the banner for the loop form).
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  /// Releases the lock, sleeps until notified (or spuriously), takes the lock again.
  void Wait(MutexLock* lock) { cv_.wait(lock->native()); }
  /// As Wait, but returns false once `deadline` has passed (true when woken before it).
  template <typename Clock, typename Duration>
  bool WaitUntil(MutexLock* lock, const std::chrono::time_point<Clock, Duration>& deadline) {
    return cv_.wait_until(lock->native(), deadline) == std::cv_status::no_timeout;
  }
  /// Wakes one waiter.
  void NotifyOne() noexcept { cv_.notify_one(); }
  /// Wakes every waiter.
  void NotifyAll() noexcept { cv_.notify_all(); }

  /// Re-creates the condition variable with no waiters, in a forked child (see Hazards). With
  /// libstdc++, whose std::condition_variable is one pthread_cond_t, in inline stores: its
  /// constructor is out of line, and each code page a forked child runs costs it a page fault.
  void ResetAfterFork() {
#if defined(__GLIBCXX__)
    static_assert(sizeof(std::condition_variable) == sizeof(pthread_cond_t),
                  "libstdc++'s std::condition_variable is expected to hold one pthread_cond_t");
    const pthread_cond_t fresh = PTHREAD_COND_INITIALIZER;
    std::memcpy(static_cast<void*>(&cv_), &fresh, sizeof fresh);
#else
    new (&cv_) std::condition_variable();
#endif
  }

  /// The std::condition_variable underneath.
  std::condition_variable& native() { return cv_; }

 private:
  std::condition_variable cv_;
};

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_MUTEX_H_
