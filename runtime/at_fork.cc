#include "forksafe/runtime/at_fork.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/framework_lock.h"
#include "forksafe/runtime/internal/at_fork_bypass.h"
#include "forksafe/runtime/internal/fork_entry.h"

namespace forksafe::runtime {
namespace {

thread_local bool t_in_handler = false;
std::atomic<uint64_t> g_fork_generation{0};
std::atomic<bool> g_bypass{false};  // see runtime/internal/at_fork_bypass.h
std::atomic<void (*)()> g_entering{nullptr};  // see runtime/internal/fork_entry.h
std::atomic<void (*)()> g_entered{nullptr};

void RunHook(const std::atomic<void (*)()>& hook) {
  if (void (*fn)() = hook.load(std::memory_order_acquire)) fn();
}

// The top of the process's initial stack (the kernel's "[stack]" mapping), read once; 0 when it
// cannot be read. glibc never gives that stack to another thread. Not "the thread whose tid is
// the pid": in a child forked from a worker thread, that thread has tid == pid and runs on a
// stack glibc allocated, which the child's next fork gives back to glibc's cache.
uintptr_t InitialStackTop() {
  static const uintptr_t top = [] {
    uintptr_t t = 0;
    FILE* f = fopen("/proc/self/maps", "re");
    if (f == nullptr) return t;
    char line[512];
    while (fgets(line, sizeof(line), f) != nullptr) {
      if (strstr(line, "[stack]") == nullptr) continue;
      unsigned long lo = 0, hi = 0;
      if (sscanf(line, "%lx-%lx", &lo, &hi) == 2) t = hi;
      break;
    }
    fclose(f);
    return t;
  }();
  return top;
}

// The calling thread's stack mapping (static TLS included for threads glibc created), found once
// per thread. Empty for the thread on the initial stack (objects on it stay intact in a child),
// and when it cannot be told.
struct StackRange {
  uintptr_t lo = 0, hi = 0;
};

StackRange ThisThreadsStack() {
  thread_local StackRange range = [] {
    StackRange r;
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) != 0) return r;
    void* addr = nullptr;
    size_t size = 0;
    if (pthread_attr_getstack(&attr, &addr, &size) == 0) {
      r.lo = reinterpret_cast<uintptr_t>(addr);
      r.hi = r.lo + size;
    }
    pthread_attr_destroy(&attr);
    const uintptr_t initial = InitialStackTop();
    if (initial == 0 || (r.lo < initial && initial <= r.hi)) return StackRange{};
    return r;
  }();
  return range;
}

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
  (void)InitialStackTop();  // read now, in the parent, not first in a child
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
  const StackRange stack = ThisThreadsStack();
  const auto where = reinterpret_cast<uintptr_t>(handle);
  const bool on_stack = where >= stack.lo && where < stack.hi;
  entries_.push_back(Entry{handle, std::move(handler), false, on_stack, pthread_self()});
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
  CheckNotInHandler("AtForkRegistry::IsRegistered");  // the registry lock is held there
  std::lock_guard<std::mutex> lk(mu_);
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const Entry& e) { return e.handle == handle; });
}

std::vector<std::string> AtForkRegistry::HandlerNames() const {
  CheckNotInHandler("AtForkRegistry::HandlerNames");  // the registry lock is held there
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
      options.framework_lock_timeout.count() < 0 || options.prepare_deadline.count() < 0 ||
      options.attempt_wait.count() < 0) {
    throw Error(ErrorCode::kInvalidArgument, "AtForkOptions durations must not be negative");
  }
  // Deadlines are added to clock readings: keep them far from overflowing the clock's range.
  constexpr std::chrono::hours kLongest{24};
  if (options.initial_backoff > kLongest || options.max_backoff > kLongest ||
      options.framework_lock_timeout > kLongest || options.prepare_deadline > kLongest ||
      options.attempt_wait > kLongest) {
    throw Error(ErrorCode::kInvalidArgument,
                "AtForkOptions durations must be at most 24 hours (a fork that waits longer is a "
                "hang); use shorter deadlines");
  }
  CheckNotInHandler("AtForkRegistry::SetOptions");
  std::lock_guard<std::mutex> lk(mu_);
  options_ = options;
}

AtForkOptions AtForkRegistry::options() const {
  CheckNotInHandler("AtForkRegistry::options");  // the registry lock is held there
  std::lock_guard<std::mutex> lk(mu_);
  return options_;
}

ForkReport AtForkRegistry::LastReport() const {
  CheckNotInHandler("AtForkRegistry::LastReport");  // the registry lock is held there
  std::lock_guard<std::mutex> lk(mu_);
  return last_;
}

uint64_t AtForkRegistry::fork_count() const {
  CheckNotInHandler("AtForkRegistry::fork_count");  // the registry lock is held there
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
  // A worker of a pool that waits here for another thread's fork must not be waited for by that
  // fork's drain (runtime/internal/fork_entry.h).
  RunHook(g_entering);
  std::unique_lock<std::mutex> lk(mu_);
  fork_done_.wait(lk, [this] { return !forking_; });
  forking_ = true;
  lk.release();  // mu_ stays locked until Parent() or Child(), except during back-off below
  RunHook(g_entered);
  t_in_handler = true;
  current_ = ForkReport{};
  current_.fork_number = fork_count_ + 1;
  for (Entry& e : entries_) e.prepared = false;

  const int max_attempts = options_.max_prepare_attempts;
  const auto started = std::chrono::steady_clock::now();
  const auto deadline = started + options_.prepare_deadline;
  auto backoff = options_.initial_backoff;
  for (int attempt = 1; attempt <= max_attempts; ++attempt) {
    const bool last = attempt == max_attempts || std::chrono::steady_clock::now() >= deadline;
    current_.attempts = attempt;
    bool retry = false;
    for (size_t i = entries_.size(); i-- > 0;) {
      Entry& e = entries_[i];
      bool ok = true;
      if (e.handler.prepare) {
        PrepareAttempt a{attempt, last, current_.fork_number, deadline, deadline};
        if (!last) a.wait_until = std::min(deadline, std::chrono::steady_clock::now() +
                                                         options_.attempt_wait);
        try {
          ok = e.handler.prepare(a);
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
                    absl::StrCat("could not be prepared after ", attempt, " attempt(s) in ",
                                 std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::steady_clock::now() - started)
                                     .count(),
                                 " ms; the fork proceeds and the child must treat this "
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
    // Nothing is prepared now. Let other threads (un)register meanwhile: the thread that holds
    // what a handler refused on may need to (it creates a pool while holding a lock, say).
    // Other forks still wait: forking_ stays true.
    mu_.unlock();
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
        backoff, std::max<std::chrono::steady_clock::duration>(
                     deadline - std::chrono::steady_clock::now(), std::chrono::microseconds(0))));
    mu_.lock();
    for (Entry& e : entries_) e.prepared = false;
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
  forking_ = false;
  fork_done_.notify_all();
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
  // Objects on the stacks of threads that do not exist here: glibc hands those stacks to the
  // child's next threads, so the objects' memory is about to be reused. Their child callbacks
  // just ran on intact memory; no later fork of this process may touch them again.
  const pthread_t self = pthread_self();
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const Entry& e) {
                                  return e.on_owner_stack && !pthread_equal(e.owner, self);
                                }),
                 entries_.end());
  fork_count_ = 0;  // the child has made no fork of its own yet
  last_ = current_;
  t_in_handler = false;
  forking_ = false;
  // Threads of the parent may have waited on it; none of them exists here.
  new (&fork_done_) std::condition_variable();
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

bool LockForFork(std::mutex& mu, const PrepareAttempt& attempt) {
  if (mu.try_lock()) return true;
  const auto left = attempt.wait_until - std::chrono::steady_clock::now();
  if (left <= std::chrono::steady_clock::duration::zero()) return false;
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer intercepts neither pthread_mutex_clocklock nor a wait it could bound on the
  // monotonic clock (timedlock takes the realtime clock, which a step back would stretch without
  // bound): poll with try_lock, which it sees, until the steady deadline.
  while (std::chrono::steady_clock::now() < attempt.wait_until) {
    std::this_thread::sleep_for(std::chrono::microseconds(500));
    if (mu.try_lock()) return true;
  }
  return false;
#else
  // A timed wait on the mutex itself, on the monotonic clock (std::chrono::steady_clock's): a
  // step of the wall clock neither shortens nor lengthens it.
  timespec until{};
  clock_gettime(CLOCK_MONOTONIC, &until);
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
  until.tv_sec += static_cast<time_t>(ns / 1000000000);
  until.tv_nsec += static_cast<long>(ns % 1000000000);
  if (until.tv_nsec >= 1000000000) {
    until.tv_nsec -= 1000000000;
    ++until.tv_sec;
  }
  for (;;) {
    const int rc = pthread_mutex_clocklock(mu.native_handle(), CLOCK_MONOTONIC, &until);
    if (rc == 0) return true;
    if (rc != EINTR) return false;  // ETIMEDOUT (or an error: treated as "not yet")
  }
#endif
}

void HoldAcrossFork(std::mutex* mu, std::string name, std::function<void()> in_child) {
  AtForkHandler h;
  h.name = std::move(name);
  h.prepare = [mu](const PrepareAttempt& attempt) { return LockForFork(*mu, attempt); };
  h.parent = [mu](bool prepared) {
    if (prepared) mu->unlock();
  };
  h.child = [mu, in_child = std::move(in_child)](bool prepared) {
    if (!prepared) {
      // Another thread held it at the fork and does not exist here: a fresh, unlocked mutex.
      new (mu) std::mutex();
      mu->lock();
    }
    if (in_child) in_child();
    mu->unlock();
  };
  AtForkRegistry::Get().Register(mu, std::move(h));
}

bool InForkHandler() { return t_in_handler; }

namespace internal {
void SetAtForkBypassForBenchmark(bool bypass) { g_bypass.store(bypass); }
void SetForkEntryHooks(void (*entering)(), void (*entered)()) {
  g_entering.store(entering, std::memory_order_release);
  g_entered.store(entered, std::memory_order_release);
}
}  // namespace internal

uint64_t ForkGeneration() { return g_fork_generation.load(std::memory_order_relaxed); }

}  // namespace forksafe::runtime
