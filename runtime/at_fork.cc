#include "runtime/at_fork.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/error.h"
#include "runtime/framework_lock.h"
#include "runtime/internal/at_fork_bypass.h"

namespace forksafe::runtime {
namespace {

thread_local bool t_in_handler = false;
std::atomic<uint64_t> g_fork_generation{0};
std::atomic<bool> g_bypass{false};  // see runtime/internal/at_fork_bypass.h

// Runs a parent/child callback; an exception becomes an event.
void RunQuietly(const std::function<void(bool)>& fn, bool prepared, const std::string& name,
                const char* phase) {
  if (!fn) return;
  try {
    fn(prepared);
  } catch (const std::exception& e) {
    AtForkRegistry::ReportEvent(ForkEventKind::kHandlerThrew, name,
                                absl::StrCat(phase, " callback threw: ", e.what()));
  } catch (...) {
    AtForkRegistry::ReportEvent(ForkEventKind::kHandlerThrew, name,
                                absl::StrCat(phase, " callback threw a non-std exception"));
  }
}

}  // namespace

const char* ForkEventKindName(ForkEventKind kind) {
  switch (kind) {
    case ForkEventKind::kPrepareRetried: return "prepare_retried";
    case ForkEventKind::kPrepareGaveUp: return "prepare_gave_up";
    case ForkEventKind::kDrainDeadlineExceeded: return "drain_deadline_exceeded";
    case ForkEventKind::kFrameworkLockTimeout: return "framework_lock_timeout";
    case ForkEventKind::kSubsystemUnusable: return "subsystem_unusable";
    case ForkEventKind::kHandlerThrew: return "handler_threw";
  }
  return "unknown";
}

std::string ForkReport::ToString() const {
  std::string out = absl::StrCat("fork #", fork_number, ": ", attempts, " prepare attempt(s), ",
                                 events.size(), " event(s)");
  for (const ForkEvent& e : events) {
    absl::StrAppend(&out, "\n  [", ForkEventKindName(e.kind), "] ", e.subsystem, ": ", e.detail);
  }
  return out;
}

AtForkRegistry& AtForkRegistry::Get() {
  // Leaked on purpose (as folly's AtFork does): handlers may run during static destruction.
  // Over-aligned new keeps the object on one page.
  static AtForkRegistry* registry = new AtForkRegistry();
  static_assert(sizeof(AtForkRegistry) <= alignof(AtForkRegistry),
                "AtForkRegistry must fit its alignment so that it never straddles a page");
  return *registry;
}

AtForkRegistry::AtForkRegistry() {
  int rc = pthread_atfork(&AtForkRegistry::OnPrepare, &AtForkRegistry::OnParent,
                          &AtForkRegistry::OnChild);
  if (rc != 0) ThrowSystemError("pthread_atfork", rc);
}

void AtForkRegistry::CheckNotInHandler(const char* what) const {
  if (t_in_handler) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat(what, " was called from inside an at-fork handler, while the registry "
                                   "is locked for a fork; register or unregister handlers before "
                                   "or after fork(), never from a prepare/parent/child callback"));
  }
}

void AtForkRegistry::Register(const void* handle, AtForkHandler handler) {
  CheckNotInHandler("AtForkRegistry::Register");
  if (handle == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                "AtForkRegistry::Register needs a non-null handle (use the owning object's "
                "address)");
  }
  std::lock_guard<std::mutex> lk(mu_);
  for (const Entry& e : entries_) {
    if (e.handle == handle) {
      throw Error(ErrorCode::kAlreadyExists,
                  absl::StrCat("an at-fork handler is already registered under this handle (\"",
                               e.handler.name, "\"); unregister it first or use another handle"));
    }
  }
  entries_.push_back(Entry{handle, std::move(handler), false});
}

void AtForkRegistry::Unregister(const void* handle) {
  CheckNotInHandler("AtForkRegistry::Unregister");
  std::lock_guard<std::mutex> lk(mu_);
  auto it = std::find_if(entries_.begin(), entries_.end(),
                         [&](const Entry& e) { return e.handle == handle; });
  if (it == entries_.end()) {
    throw Error(ErrorCode::kNotFound,
                "no at-fork handler is registered under this handle; it was never registered or "
                "was already unregistered");
  }
  entries_.erase(it);
}

bool AtForkRegistry::IsRegistered(const void* handle) const {
  std::lock_guard<std::mutex> lk(mu_);
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const Entry& e) { return e.handle == handle; });
}

std::vector<std::string> AtForkRegistry::HandlerNames() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::string> names;
  for (const Entry& e : entries_) names.push_back(e.handler.name);
  return names;
}

void AtForkRegistry::SetOptions(const AtForkOptions& options) {
  if (options.max_prepare_attempts < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("AtForkOptions::max_prepare_attempts must be >= 1, got ",
                             options.max_prepare_attempts));
  }
  if (options.initial_backoff.count() < 0 || options.max_backoff.count() < 0 ||
      options.framework_lock_timeout.count() < 0) {
    throw Error(ErrorCode::kInvalidArgument, "AtForkOptions durations must not be negative");
  }
  CheckNotInHandler("AtForkRegistry::SetOptions");
  std::lock_guard<std::mutex> lk(mu_);
  options_ = options;
}

AtForkOptions AtForkRegistry::options() const {
  std::lock_guard<std::mutex> lk(mu_);
  return options_;
}

ForkReport AtForkRegistry::LastReport() const {
  std::lock_guard<std::mutex> lk(mu_);
  return last_;
}

uint64_t AtForkRegistry::fork_count() const {
  std::lock_guard<std::mutex> lk(mu_);
  return fork_count_;
}

void AtForkRegistry::SetEventListener(std::function<void(const ForkReport&)> listener) {
  CheckNotInHandler("AtForkRegistry::SetEventListener");
  std::lock_guard<std::mutex> lk(mu_);
  listener_ = std::move(listener);
}

void AtForkRegistry::ReportEvent(ForkEventKind kind, const std::string& subsystem,
                                 const std::string& detail) noexcept {
  if (!t_in_handler) return;
  try {
    // Safe without further locking: the forking thread holds mu_ while handlers run.
    Get().current_.events.push_back(ForkEvent{kind, subsystem, detail});
  } catch (...) {
    // Out of memory while reporting: drop the event rather than disturb the fork.
  }
}

void AtForkRegistry::OnPrepare() {
  if (!g_bypass.load(std::memory_order_relaxed)) Get().Prepare();
}
void AtForkRegistry::OnParent() {
  if (!g_bypass.load(std::memory_order_relaxed)) Get().Parent();
}
void AtForkRegistry::OnChild() {
  if (!g_bypass.load(std::memory_order_relaxed)) Get().Child();
}

void AtForkRegistry::Prepare() {
  mu_.lock();  // released in Parent() or Child()
  t_in_handler = true;
  current_ = ForkReport{};
  current_.fork_number = fork_count_ + 1;
  for (Entry& e : entries_) e.prepared = false;

  const int max_attempts = options_.max_prepare_attempts;
  auto backoff = options_.initial_backoff;
  for (int attempt = 1; attempt <= max_attempts; ++attempt) {
    const bool last = attempt == max_attempts;
    current_.attempts = attempt;
    bool retry = false;
    for (size_t i = entries_.size(); i-- > 0;) {
      Entry& e = entries_[i];
      bool ok = true;
      if (e.handler.prepare) {
        try {
          ok = e.handler.prepare(PrepareAttempt{attempt, last, current_.fork_number});
        } catch (const std::exception& ex) {
          ok = false;
          ReportEvent(ForkEventKind::kHandlerThrew, e.handler.name,
                      absl::StrCat("prepare threw: ", ex.what()));
        } catch (...) {
          ok = false;
          ReportEvent(ForkEventKind::kHandlerThrew, e.handler.name, "prepare threw");
        }
      }
      if (ok) {
        e.prepared = true;
        continue;
      }
      if (last) {
        ReportEvent(ForkEventKind::kPrepareGaveUp, e.handler.name,
                    absl::StrCat("could not be prepared after ", attempt,
                                 " attempts; the fork proceeds and the child must treat this "
                                 "subsystem as unusable until it is rebuilt"));
        continue;  // prepare the rest anyway
      }
      ReportEvent(ForkEventKind::kPrepareRetried, e.handler.name,
                  absl::StrCat("not ready on attempt ", attempt, "; rolled back and retried"));
      // Roll back, in registration order, the handlers prepared in this attempt.
      for (size_t j = i + 1; j < entries_.size(); ++j) {
        Entry& done = entries_[j];
        if (!done.prepared) continue;
        done.prepared = false;
        RunQuietly(done.handler.parent, true, done.handler.name, "roll-back (parent)");
      }
      retry = true;
      break;
    }
    if (!retry) break;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }

  // The framework lock: taken last, after every subsystem is quiet.
  FrameworkLock& fl = GetFrameworkLock();
  framework_lock_taken_ = false;
  if (fl.TryLockFor(options_.framework_lock_timeout)) {
    framework_lock_taken_ = true;
  } else {
    ReportEvent(ForkEventKind::kFrameworkLockTimeout, "framework_lock",
                absl::StrCat("another thread held the framework lock for more than ",
                             options_.framework_lock_timeout.count(),
                             " ms; the fork proceeds and the child gets a fresh lock"));
  }
}

void AtForkRegistry::Parent() {
  if (framework_lock_taken_) GetFrameworkLock().Unlock();
  for (Entry& e : entries_) RunQuietly(e.handler.parent, e.prepared, e.handler.name, "parent");
  ++fork_count_;
  last_ = current_;
  ForkReport report = current_;
  std::function<void(const ForkReport&)> listener = listener_;
  t_in_handler = false;
  mu_.unlock();
  if (listener && !report.clean()) {
    try {
      listener(report);
    } catch (...) {
      // A listener must not break the caller of fork().
    }
  }
}

void AtForkRegistry::Child() {
  g_fork_generation.fetch_add(1, std::memory_order_relaxed);
  FrameworkLock& fl = GetFrameworkLock();
  fl.ResetInChild();
  if (framework_lock_taken_) fl.Unlock();
  for (Entry& e : entries_) RunQuietly(e.handler.child, e.prepared, e.handler.name, "child");
  fork_count_ = 0;  // the child has made no fork of its own yet
  last_ = current_;
  t_in_handler = false;
  // This thread locked mu_ in Prepare() and is the same thread here: unlocking is well defined.
  mu_.unlock();
}

AtForkRegistration::AtForkRegistration(const void* handle, AtForkHandler handler)
    : handle_(handle) {
  AtForkRegistry::Get().Register(handle, std::move(handler));
}

AtForkRegistration::~AtForkRegistration() {
  try {
    AtForkRegistry::Get().Unregister(handle_);
  } catch (...) {
    // Unregistering from inside a handler: nothing sensible to do in a destructor.
  }
}

DefaultFrameworkLock& internal_default_framework_lock() {
  return AtForkRegistry::Get().default_framework_lock_;
}

void HoldAcrossFork(std::mutex* mu, std::string name, std::function<void()> in_child) {
  AtForkHandler h;
  h.name = std::move(name);
  h.prepare = [mu](const PrepareAttempt&) {
    mu->lock();
    return true;
  };
  h.parent = [mu](bool) { mu->unlock(); };
  h.child = [mu, in_child = std::move(in_child)](bool) {
    if (in_child) in_child();
    mu->unlock();
  };
  AtForkRegistry::Get().Register(mu, std::move(h));
}

bool InForkHandler() { return t_in_handler; }

namespace internal {
void SetAtForkBypassForBenchmark(bool bypass) { g_bypass.store(bypass); }
}  // namespace internal

uint64_t ForkGeneration() { return g_fork_generation.load(std::memory_order_relaxed); }

}  // namespace forksafe::runtime
