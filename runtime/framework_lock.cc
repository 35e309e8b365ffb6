#include "forksafe/runtime/framework_lock.h"

#include <new>

#include "forksafe/runtime/error.h"

namespace forksafe::runtime {

void DefaultFrameworkLock::Lock() {
  const auto self = std::this_thread::get_id();
  internal::MutexLock lk(&mu_);
  if (owner_.load(std::memory_order_relaxed) == self) {
    ++depth_;
    return;
  }
  if (depth_ != 0) {
    ++waiters_;
    while (depth_ != 0) cv_.Wait(&lk);
    --waiters_;
  }
  owner_.store(self, std::memory_order_relaxed);
  depth_ = 1;
}

bool DefaultFrameworkLock::TryLockFor(std::chrono::nanoseconds timeout) {
  const auto self = std::this_thread::get_id();
  internal::MutexLock lk(&mu_);
  if (owner_.load(std::memory_order_relaxed) == self) {
    ++depth_;
    return true;
  }
  // As std::condition_variable::wait_for with a predicate: one deadline on the steady clock.
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::ceil<std::chrono::steady_clock::duration>(timeout);
  if (depth_ != 0) {
    ++waiters_;
    while (depth_ != 0) {
      if (!cv_.WaitUntil(&lk, until)) break;
    }
    --waiters_;
    if (depth_ != 0) return false;
  }
  owner_.store(self, std::memory_order_relaxed);
  depth_ = 1;
  return true;
}

void DefaultFrameworkLock::Unlock() {
  internal::MutexLock lk(&mu_);
  if (owner_.load(std::memory_order_relaxed) != std::this_thread::get_id() || depth_ == 0) {
    throw Error(ErrorCode::kFailedPrecondition,
                "FrameworkLock::Unlock called by a thread that does not hold the framework lock; "
                "pair every Lock() with one Unlock() on the same thread (use FrameworkLockGuard)");
  }
  if (--depth_ != 0) return;
  owner_.store(std::thread::id(), std::memory_order_relaxed);
  const bool wake = waiters_ != 0;  // a thread that waits later sees depth_ == 0 first
  lk.Unlock();
  if (wake) cv_.NotifyOne();
}

bool DefaultFrameworkLock::HeldByCurrentThread() const {
  return owner_.load(std::memory_order_relaxed) == std::this_thread::get_id();
}

// Not analysed: depth_ is written without mu_ on the forked child's only thread, where no other
// thread can take it.
void DefaultFrameworkLock::ResetInChild() FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  // Another thread may have held mu_ at the instant of the fork and does not exist here: rebuild
  // the internals in place (the old ones are abandoned, never destroyed).
  mu_.ResetAfterFork();
  // Always rebuilt: Unlock notifies after releasing mu_, so another thread's signal may be in
  // flight at the fork (its condvar-internal lock held) although waiters_ is already 0.
  waiters_ = 0;
  cv_.ResetAfterFork();
  if (owner_.load(std::memory_order_relaxed) != std::this_thread::get_id()) {
    owner_.store(std::thread::id(), std::memory_order_relaxed);
    depth_ = 0;
  }
}

void DefaultFrameworkLock::ReleaseInChild(bool taken_by_fork) {
  mu_.ResetAfterFork();
  waiters_ = 0;  // as in ResetInChild: always
  cv_.ResetAfterFork();
  if (!taken_by_fork) {
    // Another thread held it at the fork, or nobody did (the forking thread never gives up its
    // own holding without the fork taking it back: SuspendForPrepare is false here).
    if (depth_ != 0 || owner_.load(std::memory_order_relaxed) != std::thread::id()) {
      owner_.store(std::thread::id(), std::memory_order_relaxed);
      depth_ = 0;
    }
    return;
  }
  if (--depth_ == 0) owner_.store(std::thread::id(), std::memory_order_relaxed);
}

namespace {
std::atomic<FrameworkLock*> g_custom_lock{nullptr};

}  // namespace

// Defined in at_fork.cc: the default lock lives inside the registry, on the registry's page.
DefaultFrameworkLock& internal_default_framework_lock();

namespace {
DefaultFrameworkLock& DefaultLock() { return internal_default_framework_lock(); }
}  // namespace

FrameworkLock& GetFrameworkLock() {
  FrameworkLock* custom = g_custom_lock.load(std::memory_order_acquire);
  return custom != nullptr ? *custom : DefaultLock();
}

void SetFrameworkLock(FrameworkLock* lock) { g_custom_lock.store(lock, std::memory_order_release); }

}  // namespace forksafe::runtime
