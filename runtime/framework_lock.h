// runtime/framework_lock.h: the global framework lock, held across every fork.
//
// What it offers
//   One process-wide lock that an embedding framework takes around work that must never be
//   observed half-done by a forked child (the analogue of Python's GIL, which MindSpore holds
//   across fork). The at-fork registry takes it *last* in prepare, after every subsystem has
//   quiesced, and releases it *first* in the parent and the child, before any subsystem resumes.
//   A framework that already has such a lock plugs it in with SetFrameworkLock().
//
// Guarantees
//   - The default lock is recursive and tracks its owner, so a thread that already holds it may
//     call fork(): prepare sees that the forking thread owns it and does not take it again.
//   - prepare waits for the lock for at most AtForkOptions::framework_lock_timeout; if another
//     thread holds it longer, the fork proceeds, the event is reported (ForkEventKind::
//     kFrameworkLockTimeout) and the child gets a fresh, unlocked lock.
//   - In the child, ResetInChild() runs before any handler (for the default lock: the same reset,
//     and the fork's release, in one step that calls into glibc for none of it), so the child
//     never waits on a lock whose owner did not survive the fork.
//
// Hazards
//   - A pool task that waits for this lock while the forking thread holds it cannot finish before
//     the fork (unless the lock lets go of it for the prepare: SuspendForPrepare): the pool's
//     drain then runs into its deadline. Do not hold the framework lock while waiting for pool
//     tasks that need it.
//   - SetFrameworkLock() must be called before other threads use the lock, and the supplied lock
//     must outlive every fork of the process.
#ifndef FORKSAFE_RUNTIME_FRAMEWORK_LOCK_H_
#define FORKSAFE_RUNTIME_FRAMEWORK_LOCK_H_

#include <atomic>
#include <chrono>
#include <thread>

#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::runtime {

class AtForkRegistry;

/// Interface of a lock that can be held across fork(). Implementations must be usable from any
/// thread; TryLockFor and Unlock are called by the at-fork registry on the forking thread.
class FrameworkLock {
 public:
  virtual ~FrameworkLock() = default;
  /// Blocks until the calling thread holds the lock. Recursive locking is implementation-defined.
  virtual void Lock() = 0;
  /// Takes the lock if it can within `timeout`; returns whether it did.
  virtual bool TryLockFor(std::chrono::nanoseconds timeout) = 0;
  /// Releases one level of the lock held by the calling thread.
  virtual void Unlock() = 0;
  /// True when the calling thread holds the lock.
  virtual bool HeldByCurrentThread() const = 0;
  /// Called first thing in a forked child, on its only thread (the one that called fork()).
  /// Rebuild any internal mutex another thread may have held at the fork; keep the lock held if
  /// the calling thread holds it, and make it free if a thread that does not exist here held it.
  virtual void ResetInChild() = 0;
  /// Called by the registry on the forking thread when that thread holds the lock as the fork
  /// begins, before any subsystem is prepared (and before waiting for another thread's fork).
  /// A lock that tasks being drained may need lets go of it here and returns true; TryLockFor
  /// then takes it back, last, after every subsystem is quiet, and must restore exactly the
  /// holding the thread had (the fork returns to a caller that still holds it). The default
  /// keeps holding it (false): a critical section of the forking thread is never opened to
  /// other threads mid-way. Python's GIL lets go (python/gil_lock.h): a pool task that waits for
  /// the GIL while os.fork() holds it then finishes instead of running into the drain deadline.
  virtual bool SuspendForPrepare() { return false; }
};

/// The default framework lock: recursive, owner-tracking, timed.
class DefaultFrameworkLock final : public FrameworkLock {
 public:
  DefaultFrameworkLock() = default;
  void Lock() override;
  bool TryLockFor(std::chrono::nanoseconds timeout) override;
  void Unlock() override;
  bool HeldByCurrentThread() const override;
  void ResetInChild() override;

 private:
  friend class AtForkRegistry;
  // ResetInChild() followed, when the fork took the lock (`taken_by_fork`), by Unlock(), as the
  // registry does for any lock, without asking the thread's id: the forking thread took it, so
  // it is the owner exactly when `taken_by_fork` (a forked child runs no code it can skip: each
  // code page it runs costs it a page fault). Not analysed: the child's only thread.
  void ReleaseInChild(bool taken_by_fork) FORKSAFE_NO_THREAD_SAFETY_ANALYSIS;

  internal::Mutex mu_;
  internal::CondVar cv_;
  std::atomic<std::thread::id> owner_{};
  int depth_ FORKSAFE_GUARDED_BY(mu_) = 0;
  // Threads inside cv_'s waits: Unlock wakes one only when there is one, and a child rebuilds cv_
  // only when one waited at the fork (a forked child runs no code it can skip: each code page it
  // runs costs it a page fault).
  int waiters_ FORKSAFE_GUARDED_BY(mu_) = 0;
};

/// The lock the runtime holds across fork (the default one unless replaced).
FrameworkLock& GetFrameworkLock();

/// Replaces the framework lock. `lock` is not owned and must outlive all forks; pass nullptr to go
/// back to the default lock. Not thread-safe with concurrent forks: call it at start-up.
void SetFrameworkLock(FrameworkLock* lock);

/// RAII holder of the framework lock.
class FrameworkLockGuard {
 public:
  FrameworkLockGuard() : lock_(GetFrameworkLock()) { lock_.Lock(); }
  ~FrameworkLockGuard() { lock_.Unlock(); }
  FrameworkLockGuard(const FrameworkLockGuard&) = delete;
  FrameworkLockGuard& operator=(const FrameworkLockGuard&) = delete;

 private:
  FrameworkLock& lock_;
};

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_FRAMEWORK_LOCK_H_
