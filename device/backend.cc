#include "forksafe/device/backend.h"

#include <unistd.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::device {

namespace internal {
// A backend's initialization lock, and what it guards.
struct BackendInitLock {
  runtime::internal::Mutex mu;
  std::atomic<int> users{0};  // threads inside mu (so a forked child knows to rebuild it)
  bool initializing FORKSAFE_GUARDED_BY(mu) = false;
};
}  // namespace internal

using runtime::Error;
using runtime::ErrorCode;

Backend::Backend() : init_(std::make_unique<internal::BackendInitLock>()) {}

Backend::~Backend() = default;

void Backend::CheckIndex(int index, const char* what) const {
  const int count = DeviceCount();
  if (count == 0) {
    const std::string why = UnavailableReason();
    if (!why.empty()) {
      throw Error(ErrorCode::kUnavailable,
                  absl::StrCat(what, " on ", name(), ":", index, ": ", why));
    }
  }
  if (index < 0 || index >= count) {
    throw Error(
        ErrorCode::kInvalidArgument,
        absl::StrCat(what, ": device index ", index, " is out of range for backend \"", name(),
                     "\", which has ", count, " device(s) (valid: 0..", count - 1, ")"));
  }
}

void Backend::EnsureUsable(const char* what) {
  BackendState st = state_.load(std::memory_order_acquire);
  if (st == BackendState::kReady) return;
  if (st == BackendState::kPoisoned) {
    throw Error(ErrorCode::kForkPoisoned,
                absl::StrCat(what, ": the \"", name(), "\" backend was initialized in process ",
                             initialized_by_, ", and this process (pid ", getpid(),
                             ") was forked from it afterwards; its device context and threads did "
                             "not survive fork(), so it cannot be used here. Start this process "
                             "with the \"spawn\" or \"forkserver\" start method (forksafe::mp), or "
                             "initialize the backend only after forking. (A forked child's "
                             "default device is cpu.)"));
  }
  struct Users {  // counts this thread as a user of the lock for the whole critical section
    std::atomic<int>& n;
    explicit Users(std::atomic<int>& c) : n(c) { n.fetch_add(1); }
    ~Users() { n.fetch_sub(1); }
  } users(init_->users);
  runtime::internal::MutexLock lk(&init_->mu);
  if (state_.load(std::memory_order_acquire) == BackendState::kReady) return;
  init_->initializing = true;
  try {
    DoInitialize();
  } catch (...) {
    init_->initializing = false;
    throw;
  }
  init_->initializing = false;
  initialized_by_ = getpid();
  state_.store(BackendState::kReady, std::memory_order_release);
}

void Backend::Initialize() { EnsureUsable("Backend::Initialize"); }

void* Backend::Allocate(int index, size_t bytes) {
  CheckIndex(index, "Allocate");
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, absl::StrCat("Allocate on ", name(), ":", index,
                                                          " of 0 bytes; ask for at least 1"));
  }
  EnsureUsable("Allocate");
  return DoAllocate(index, bytes);
}

void Backend::Free(int index, void* ptr) {
  if (ptr == nullptr) return;
  CheckIndex(index, "Free");
  EnsureUsable("Free");
  DoFree(index, ptr);
}

void Backend::Copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  auto ours = [&](Device d) { return d.type == type() || d.type == DeviceType::kCPU; };
  if (!ours(dst_device) || !ours(src_device)) {
    throw Error(
        ErrorCode::kInvalidArgument,
        absl::StrCat("the \"", name(), "\" backend cannot copy from ", src_device.ToString(),
                     " to ", dst_device.ToString(), "; stage the copy through the host (cpu)"));
  }
  if (dst_device.type == type()) CheckIndex(dst_device.index, "Copy (destination)");
  if (src_device.type == type()) CheckIndex(src_device.index, "Copy (source)");
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, "Copy was given a null pointer with a non-zero size");
  }
  EnsureUsable("Copy");
  DoCopy(dst, dst_device, src, src_device, bytes);
}

void Backend::Memset(int index, void* ptr, int value, size_t bytes) {
  CheckIndex(index, "Memset");
  if (bytes == 0) return;
  if (ptr == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                "Memset was given a null pointer with a non-zero size");
  }
  EnsureUsable("Memset");
  DoMemset(index, ptr, value, bytes);
}

void Backend::Synchronize(int index) {
  CheckIndex(index, "Synchronize");
  EnsureUsable("Synchronize");
  DoSynchronize(index);
}

void Backend::OnForkPrepare() {
  const bool now = initialized();
  if (fork_prepared_ != now) fork_prepared_ = now;
  if (now) DoForkPrepare();
}

void Backend::OnForkParent() {
  if (fork_prepared_) DoForkParent();
}

// Runs in a forked child, which has one thread: `initializing` is read without the lock, which
// may be held by a thread that does not exist here (the lock is rebuilt instead).
void Backend::OnForkChild() FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  // Another thread may have been initializing at the instant of the fork: rebuild the mutex and
  // count a half-done initialization as done (its context is no more usable than a full one).
  // Nothing is written when no thread was near the mutex: every page written after a fork is a
  // copy-on-write fault.
  const bool was_initializing = init_->users.load() > 0;
  if (was_initializing) {
    init_->mu.ResetAfterFork();
    init_->users.store(0);
  }
  const bool was_live =
      state_.load() == BackendState::kReady || (was_initializing && init_->initializing);
  if (was_initializing) init_->initializing = false;
  if (was_live && fork_behavior() == ForkBehavior::kPoisonInChild) {
    if (initialized_by_ == 0) initialized_by_ = getppid();
    state_.store(BackendState::kPoisoned, std::memory_order_release);
  }
  // A backend that was never set up has nothing of its own to reset (and the child does not run
  // its code: each code page a forked child runs costs it a page fault).
  if (was_live || was_initializing) DoForkChild();
}

}  // namespace forksafe::device
