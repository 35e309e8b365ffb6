#include "forksafe/runtime/at_fork.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
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
#include "forksafe/runtime/internal/fork_registration.h"
#include "forksafe/runtime/internal/nested_copy.h"
#include "forksafe/runtime/internal/process_instance.h"
#include "forksafe/runtime/internal/thread_count.h"

namespace forksafe::runtime {
namespace {

thread_local bool t_in_handler = false;
thread_local bool t_rolling_back = false;     // parent callbacks run to undo a prepare
std::atomic<bool> g_bypass{false};            // see runtime/internal/at_fork_bypass.h
std::atomic<void (*)()> g_entering{nullptr};  // see runtime/internal/fork_entry.h
std::atomic<void (*)()> g_entered{nullptr};

void RunHook(const std::atomic<void (*)()>& hook) {
  if (void (*fn)() = hook.load(std::memory_order_acquire)) fn();
}

AtForkRegistry* g_this_registry = nullptr;  // this copy's registry, set by its constructor

using Clock = std::chrono::steady_clock;

// Records an event whose detail is built by `detail()`; building it may throw (out of memory), the
// event is then dropped: nothing between the registry's lock and its unlock may throw.
template <typename F>
void Report(ForkEventKind kind, const std::string& subsystem, F&& detail) noexcept {
  try {
    AtForkRegistry::ReportEvent(kind, subsystem, detail());
  } catch (...) {
  }
}

// The process's initial stack (the kernel's "[stack]" mapping), read once; empty when it cannot
// be read. glibc never gives that stack to another thread. Not "the thread whose tid is the
// pid": in a child forked from a worker thread, that thread has tid == pid and runs on a stack
// glibc allocated, which the child's next fork gives back to glibc's cache.
struct StackRange {
  uintptr_t lo = 0, hi = 0;
};

StackRange InitialStack() {
  static const StackRange initial = [] {
    StackRange r;
    FILE* f = fopen("/proc/self/maps", "re");
    if (f == nullptr) return r;
    char line[512];
    while (fgets(line, sizeof(line), f) != nullptr) {
      if (strstr(line, "[stack]") == nullptr) continue;
      unsigned long lo = 0, hi = 0;
      if (sscanf(line, "%lx-%lx", &lo, &hi) == 2) r = StackRange{lo, hi};
      break;
    }
    fclose(f);
    return r;
  }();
  return initial;
}

// The calling thread's stack mapping (static TLS included for threads glibc created), found once
// per thread. Empty for the thread on the initial stack (objects on it stay intact in a child),
// and when it cannot be told.
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
    // The main thread's range (pthread_getattr_np) overlaps the "[stack]" mapping; it need not
    // contain the mapping's top: glibc ends it at __libc_stack_end rounded up to a page, which
    // can be a page below the mapping's end (then every handle on the main thread's stack was
    // taken for a vanishing thread's, and forgotten in children forked from other threads).
    const StackRange initial = InitialStack();
    if (initial.hi == 0 || (r.lo < initial.hi && initial.lo < r.hi)) return StackRange{};
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
    Report(ForkEventKind::kHandlerThrew, name,
           [&] { return absl::StrCat(phase, " callback threw: ", e.what()); });
  } catch (...) {
    Report(ForkEventKind::kHandlerThrew, name,
           [&] { return absl::StrCat(phase, " callback threw a non-std exception"); });
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
  (void)InitialStack();  // read now, in the parent, not first in a child
  g_this_registry = this;
  // Another copy of forksafe in the process already runs the forks: nest in it (at_fork.h, "One
  // registry per process").
  if (const forksafe_instance_v1* primary = internal::ElectProcessInstance()) {
    if (internal::NestInPrimary(*primary)) return;
  }
  // pthread_atfork, through internal/fork_registration.h (which can renew it later).
  int rc = internal::RegisterForkCallbacks(&AtForkRegistry::OnPrepare, &AtForkRegistry::OnParent,
                                           &AtForkRegistry::OnChild);
  if (rc != 0) ThrowSystemError("pthread_atfork", rc);
}

RegistryRole AtForkRegistry::role() const {
  // The constructor decides the role before Get() returns; deciding here too (a no-op then)
  // keeps role() from ever reading an undecided one.
  (void)internal::ElectProcessInstance();
  switch (__atomic_load_n(&internal::ThisInstance().role, __ATOMIC_ACQUIRE)) {
    case FORKSAFE_ROLE_NESTED: return RegistryRole::kNested;
    case FORKSAFE_ROLE_SEPARATE: return RegistryRole::kSeparate;
    default: return RegistryRole::kPrimary;  // FORKSAFE_ROLE_PRIMARY, the only one left
  }
}

std::string AtForkRegistry::PrimaryObject() const {
  const forksafe_instance_v1* primary = internal::PrimaryInstance();
  return primary != nullptr ? primary->object : internal::ThisInstance().object;
}

void AtForkRegistry::CheckNotInHandler(const char* what) const {
  if (t_in_handler) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat(what,
                             " was called from inside an at-fork handler, while the registry "
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
  internal::MutexLock lk(&mu_);
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
  internal::MutexLock lk(&mu_);
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
  internal::MutexLock lk(&mu_);
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const Entry& e) { return e.handle == handle; });
}

std::vector<std::string> AtForkRegistry::HandlerNames() const {
  CheckNotInHandler("AtForkRegistry::HandlerNames");  // the registry lock is held there
  internal::MutexLock lk(&mu_);
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
  internal::MutexLock lk(&mu_);
  options_ = options;
}

AtForkOptions AtForkRegistry::options() const {
  CheckNotInHandler("AtForkRegistry::options");  // the registry lock is held there
  internal::MutexLock lk(&mu_);
  return options_;
}

ForkReport AtForkRegistry::LastReport() const {
  CheckNotInHandler("AtForkRegistry::LastReport");  // the registry lock is held there
  internal::MutexLock lk(&mu_);
  return last_;
}

uint64_t AtForkRegistry::fork_count() const {
  CheckNotInHandler("AtForkRegistry::fork_count");  // the registry lock is held there
  internal::MutexLock lk(&mu_);
  return fork_count_;
}

void AtForkRegistry::SetEventListener(std::function<void(const ForkReport&)> listener) {
  CheckNotInHandler("AtForkRegistry::SetEventListener");
  internal::MutexLock lk(&mu_);
  listener_ = std::move(listener);
}

void AtForkRegistry::ReportEvent(ForkEventKind kind, const std::string& subsystem,
                                 const std::string& detail) noexcept {
  if (!t_in_handler) return;
  try {
    // Safe without further locking: the forking thread holds mu_ while handlers run.
    AtForkRegistry& r = Get();
    r.mu_.AssertHeld();
    r.current_.events.push_back(ForkEvent{kind, subsystem, detail});
  } catch (...) {
    // Out of memory while reporting: drop the event rather than disturb the fork.
  }
  // A nested copy's events also go to the primary's report (and listener), under a name that
  // says which copy they come from.
  if (const forksafe_instance_v1* primary = internal::PrimaryInstance()) {
    try {
      const std::string named =
          absl::StrCat("forksafe copy in ", internal::ThisInstance().object, ": ", subsystem);
      primary->report_event(static_cast<int32_t>(kind), named.c_str(), detail.c_str());
    } catch (...) {
      primary->report_event(static_cast<int32_t>(kind), subsystem.c_str(), detail.c_str());
    }
  }
}

// Not analysed: Prepare returns holding the registry lock, which Parent or Child (the next
// pthread_atfork callback on this thread) releases; the analysis sees one function at a time.
void AtForkRegistry::OnPrepare() FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  if (!g_bypass.load(std::memory_order_relaxed)) Get().Prepare();
}
void AtForkRegistry::OnParent() FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  if (!g_bypass.load(std::memory_order_relaxed)) Get().Parent();
}
void AtForkRegistry::OnChild() FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  if (!g_bypass.load(std::memory_order_relaxed)) Get().Child();
}

namespace {

// A framework lock that the forking thread holds may let go of it for the prepare
// (FrameworkLock::SuspendForPrepare: the GIL does), so that tasks being drained can take it;
// TakeFrameworkLock takes it back last. Before this thread waits for anything: a fork that
// another thread is making may be waiting for that lock.
void SuspendHeldFrameworkLock() noexcept {
  try {
    FrameworkLock& fl = GetFrameworkLock();
    if (fl.HeldByCurrentThread()) fl.SuspendForPrepare();
  } catch (...) {
    // A custom lock that throws keeps its holding; TakeFrameworkLock reports what follows.
  }
}

}  // namespace

void AtForkRegistry::Prepare() {
  SuspendHeldFrameworkLock();
  // A worker of a pool (of this copy or of a copy nested in it) that waits here for another
  // thread's fork must not be waited for by that fork's drain (runtime/internal/fork_entry.h).
  // The same copies get `entered` as got `entering`, even if one nests meanwhile.
  const internal::NestedCopies nested = internal::CurrentNestedCopies();
  RunHook(g_entering);
  internal::RunNestedEntering(nested);
  mu_.Lock();  // stays locked until Parent() or Child(), except during back-off below
  {
    // The wait takes a std::unique_lock: one that adopts mu_ and lets go of it without unlocking.
    std::unique_lock<std::mutex> lk(mu_.native(), std::adopt_lock);
    if (forking_) {
      ++fork_waiters_;  // the child rebuilds fork_done_ only when a thread waited on it
      while (forking_) fork_done_.native().wait(lk);
      --fork_waiters_;
    }
    lk.release();
  }
  forking_ = true;
  RunHook(g_entered);
  internal::RunNestedEntered(nested);
  t_in_handler = true;
  current_ = ForkReport{};
  current_.fork_number = fork_count_ + 1;

  const int max_attempts = options_.max_prepare_attempts;
  const auto started = Clock::now();
  const auto deadline = started + options_.prepare_deadline;
  auto backoff = options_.initial_backoff;
  for (int attempt = 1; attempt <= max_attempts; ++attempt) {
    const bool last = attempt == max_attempts || Clock::now() >= deadline;
    current_.attempts = attempt;
    PrepareAttempt a{attempt, last, current_.fork_number, deadline, deadline};
    a.alone = internal::ThreadCountIs(1);
    if (PrepareRound(a, deadline, started)) {
      break;
    }
    // Nothing is prepared now. Let other threads (un)register meanwhile: the thread that holds
    // what a handler refused on may need to (it creates a pool while holding a lock, say).
    // Other forks still wait: forking_ stays true.
    mu_.Unlock();
    std::this_thread::sleep_for(std::min<Clock::duration>(
        backoff, std::max<Clock::duration>(deadline - Clock::now(), std::chrono::microseconds(0))));
    mu_.Lock();
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  // The framework locks, last: this copy's, then each nested copy's, all within this copy's
  // framework_lock_timeout.
  const auto lock_until = Clock::now() + options_.framework_lock_timeout;
  TakeFrameworkLock(lock_until);
  internal::LockNestedFrameworks(lock_until);
}

// One round of prepare callbacks, in reverse registration order: the standalone loop above runs
// it once per attempt, and a nested copy runs it once per call of the primary (NestedCopy).
// Returns true when every handler is prepared, or on the last attempt (refusals are then
// recorded as kPrepareGaveUp and the rest is prepared anyway); false, with everything this round
// prepared rolled back, on a "not yet". A handler may block until min(`cap`, now +
// attempt_wait), or until the deadline on the last attempt.
bool AtForkRegistry::PrepareRound(PrepareAttempt attempt, Clock::time_point cap,
                                  Clock::time_point started) {
  // The quiet rule (PrepareAttempt::alone): threads that prepare callbacks report parked this
  // round (NoteThreadsParkedForFork), and whether they are now all but the forking thread.
  // Written only when they change, as everything on the registry's page.
  if (parked_ != 0) parked_ = 0;
  if (quiet_) quiet_ = false;
  const bool may_quiet = !attempt.alone && !IsNested();
  if (may_quiet_ != may_quiet) may_quiet_ = may_quiet;
  // Each entry's `prepared` is set as the round reaches it, and written only when it changes:
  // the entries' page is then not written on a fork like the last one (each page written
  // around a fork costs a copy-on-write fault).
  auto set_prepared = [](Entry& e, bool v) {
    if (e.prepared != v) e.prepared = v;
  };
  for (size_t i = entries_.size(); i-- > 0;) {
    Entry& e = entries_[i];
    if (e.retired) {  // never called again (AtForkRegistration)
      set_prepared(e, false);
      continue;
    }
    bool ok = true;
    // What this handler sees as PrepareAttempt::alone, and ForkingThreadAlone() in its
    // callbacks until the fork ends.
    const bool alone = attempt.alone || quiet_;
    if (e.saw_alone != alone) e.saw_alone = alone;
    SeeAloneAs(e);
    if (e.handler.prepare) {
      attempt.wait_until =
          attempt.last ? attempt.deadline : std::min(cap, Clock::now() + options_.attempt_wait);
      PrepareAttempt here = attempt;
      here.alone = alone;
      try {
        ok = e.handler.prepare(here);
      } catch (const std::exception& ex) {
        ok = false;
        Report(ForkEventKind::kHandlerThrew, e.handler.name,
               [&] { return absl::StrCat("prepare threw: ", ex.what()); });
      } catch (...) {
        ok = false;
        ReportEvent(ForkEventKind::kHandlerThrew, e.handler.name, "prepare threw");
      }
    }
    set_prepared(e, ok);
    if (ok) continue;
    if (attempt.last) {
      Report(ForkEventKind::kPrepareGaveUp, e.handler.name, [&] {
        return absl::StrCat(
            "could not be prepared after ", attempt.number, " attempt(s) in ",
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started).count(),
            " ms; the fork proceeds and the child must treat this subsystem as unusable until it "
            "is rebuilt");
      });
      continue;  // prepare the rest anyway
    }
    Report(ForkEventKind::kPrepareRetried, e.handler.name, [&] {
      return absl::StrCat("not ready on attempt ", attempt.number, "; rolled back and retried");
    });
    for (size_t k = 0; k < i; ++k) set_prepared(entries_[k], false);  // not reached this round
    RollBack(i + 1);
    return false;
  }
  return true;
}

// Runs, in registration order, the parent callback of each handler from `from` on that is
// prepared, to undo its prepare.
void AtForkRegistry::RollBack(size_t from) {
  t_rolling_back = true;
  for (size_t j = from; j < entries_.size(); ++j) {
    Entry& done = entries_[j];
    if (!done.prepared || done.retired) continue;
    done.prepared = false;
    SeeAloneAs(done);
    RunQuietly(done.handler.parent, true, done.handler.name, "roll-back (parent)");
  }
  t_rolling_back = false;
}

// The framework lock: taken last, after every subsystem is quiet, waiting at most until `until`.
// A custom lock (SetFrameworkLock) that throws counts as not taken.
void AtForkRegistry::TakeFrameworkLock(Clock::time_point until) noexcept {
  framework_lock_taken_ = false;
  const auto started = Clock::now();
  try {
    const Clock::duration left =
        std::max<Clock::duration>(until - started, Clock::duration::zero());
    framework_lock_taken_ = GetFrameworkLock().TryLockFor(left);
  } catch (const std::exception& ex) {
    Report(ForkEventKind::kHandlerThrew, "framework_lock",
           [&] { return absl::StrCat("the framework lock's TryLockFor threw: ", ex.what()); });
    return;
  } catch (...) {
    Report(ForkEventKind::kHandlerThrew, "framework_lock",
           [] { return std::string("the framework lock's TryLockFor threw"); });
    return;
  }
  if (!framework_lock_taken_) {
    Report(ForkEventKind::kFrameworkLockTimeout, "framework_lock", [&] {
      return absl::StrCat(
          "another thread held the framework lock for ",
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started).count(),
          " ms, until the fork's framework-lock deadline; the fork proceeds and the child gets a "
          "fresh lock");
    });
  }
}

// The parent phase, up to (not including) the release of mu_.
// Throws nothing: the registry lock is released after it.
void AtForkRegistry::FinishParent() noexcept {
  if (framework_lock_taken_) {
    try {
      GetFrameworkLock().Unlock();
    } catch (...) {
      // A custom lock that throws on unlock: nothing better to do here.
    }
  }
  framework_lock_taken_ = false;
  for (Entry& e : entries_) {
    if (e.retired) continue;
    SeeAloneAs(e);
    RunQuietly(e.handler.parent, e.prepared, e.handler.name, "parent");
  }
  DropRetired();
  ++fork_count_;
  last_ = std::move(current_);  // no allocation: cannot throw
  t_in_handler = false;
  forking_ = false;
  fork_done_.NotifyAll();
}

void AtForkRegistry::Parent() {
  ForkReport report;
  std::function<void(const ForkReport&)> listener;
  FinishParent();
  try {
    if (listener_ && !last_.clean()) {
      report = last_;
      listener = listener_;
    }
  } catch (...) {
    listener = nullptr;  // out of memory copying the report: no notification
  }
  mu_.Unlock();  // nothing above throws (FinishParent is noexcept, the rest is caught)
  internal::RunNestedParentDone();
  internal::CallListener(listener, report);
}

// Not analysed: it ends by re-creating mu_ unlocked (the release the declaration announces).
void AtForkRegistry::Child() noexcept FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  generation_.fetch_add(1, std::memory_order_relaxed);
  try {
    FrameworkLock& fl = GetFrameworkLock();
    if (&fl == &default_framework_lock_) {
      default_framework_lock_.ReleaseInChild(framework_lock_taken_);  // the same, in one step
    } else {
      fl.ResetInChild();
      if (framework_lock_taken_) fl.Unlock();
    }
  } catch (...) {
    // A custom lock that throws in the child: the registry must still be unlocked below.
  }
  framework_lock_taken_ = false;
  for (Entry& e : entries_) {
    if (e.retired) continue;
    SeeAloneAs(e);
    RunQuietly(e.handler.child, e.prepared, e.handler.name, "child");
  }
  DropRetired();
  // Objects on the stacks of threads that do not exist here: glibc hands those stacks to the
  // child's next threads, so the objects' memory is about to be reused. Their child callbacks
  // just ran on intact memory; no later fork of this process may touch them again. (Only looked
  // for when there is one: each code page the child runs costs it a page fault.)
  if (std::any_of(entries_.begin(), entries_.end(),
                  [](const Entry& e) { return e.on_owner_stack; })) {
    const pthread_t self = pthread_self();
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                  [&](const Entry& e) {
                                    return e.on_owner_stack && !pthread_equal(e.owner, self);
                                  }),
                   entries_.end());
  }
  fork_count_ = 0;              // the child has made no fork of its own yet
  last_ = std::move(current_);  // no allocation: cannot throw
  t_in_handler = false;
  forking_ = false;
  // Threads of the parent that waited on it do not exist here: rebuild it when there were any
  // (a condition variable nobody waited on is consistent as it is).
  if (fork_waiters_ != 0) {
    fork_waiters_ = 0;
    fork_done_.ResetAfterFork();
  }
  // This thread locked mu_ in Prepare() and is the child's only thread: re-creating the mutex
  // unlocked releases it as unlocking would, in inline stores on the registry's page (written
  // above anyway), where unlocking would run glibc's unlock code, a page fault in the child.
  // ThreadSanitizer, which would take the next lock for a double lock, sees a plain unlock.
#if defined(__SANITIZE_THREAD__)
  mu_.Unlock();
#else
  mu_.ResetAfterFork();
#endif
}

namespace internal {
const forksafe_instance_v1* InterposableCopyIdentity() { return &ThisInstance(); }
AtForkRegistry& ThisRegistry() noexcept { return *g_this_registry; }
void SetInForkHandler(bool in) noexcept { t_in_handler = in; }
bool RollingBack() noexcept { return t_rolling_back; }
void RunThisCopysEntering() noexcept { RunHook(g_entering); }
void RunThisCopysEntered() noexcept { RunHook(g_entered); }
void CallListener(const std::function<void(const ForkReport&)>& listener,
                  const ForkReport& report) noexcept {
  if (!listener || report.clean()) return;
  try {
    listener(report);
  } catch (...) {
    // A listener must not break the caller of fork().
  }
}
}  // namespace internal

AtForkRegistration::AtForkRegistration(const void* handle, AtForkHandler handler)
    : handle_(handle) {
  AtForkRegistry::Get().Register(handle, std::move(handler));
}

AtForkRegistration::~AtForkRegistration() {
  try {
    AtForkRegistry& registry = AtForkRegistry::Get();
    if (t_in_handler) {
      // Inside a fork callback this thread holds the registry: retire the handler instead.
      registry.mu_.AssertHeld();
      registry.RetireInsideFork(handle_);
      return;
    }
    registry.Unregister(handle_);
  } catch (...) {
    // Already unregistered (kNotFound; a forked child forgets some handles by itself).
  }
}

// On the forking thread, inside a callback: it holds mu_, and the registry is iterating
// entries_, so the entry is only marked (DropRetired removes it when the fork's phase ends).
void AtForkRegistry::RetireInsideFork(const void* handle) noexcept {
  for (Entry& e : entries_) {
    if (e.handle != handle || e.retired) continue;
    e.retired = true;
    ReportEvent(ForkEventKind::kHandlerThrew, e.handler.name,
                "its AtForkRegistration was destroyed inside a fork callback, where the registry "
                "cannot unregister it: the handler is not called again and is removed when this "
                "fork ends. Destroy registrations before fork() or after it returns");
    return;
  }
}

// Removes retired entries; mu_ held, no callback running.
void AtForkRegistry::DropRetired() noexcept {
  entries_.erase(
      std::remove_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.retired; }),
      entries_.end());
}

DefaultFrameworkLock& internal_default_framework_lock() {
  return AtForkRegistry::Get().default_framework_lock_;
}

namespace {

bool LockNativeForFork(std::mutex& mu, const PrepareAttempt& attempt) {
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

// HoldAcrossFork for the std::mutex `mu` (the one inside an internal::Mutex too), registered
// under `handle`.
void HoldNativeAcrossFork(std::mutex* mu, const void* handle, std::string name,
                          std::function<void()> in_child) {
  AtForkHandler h;
  h.name = std::move(name);
  h.prepare = [mu](const PrepareAttempt& attempt) {
    return attempt.alone || LockNativeForFork(*mu, attempt);
  };
  h.parent = [mu](bool prepared) {
    if (prepared && !ForkingThreadAlone()) mu->unlock();
  };
  h.child = [mu, in_child = std::move(in_child)](bool prepared) {
    // Alone: prepare took nothing (no other thread existed to exclude) and nothing is unlocked,
    // so the mutex's page is not written in the child for it.
    const bool held = !ForkingThreadAlone();
    if (!prepared && held) {
      // Another thread held it at the fork and does not exist here: a fresh, unlocked mutex.
      new (mu) std::mutex();
      mu->lock();
    }
    if (in_child) in_child();
    if (held) mu->unlock();
  };
  AtForkRegistry::Get().Register(handle, std::move(h));
}

}  // namespace

bool LockForFork(std::mutex& mu, const PrepareAttempt& attempt) {
  return LockNativeForFork(mu, attempt);
}

// Takes the mutex underneath, which the analysis does not see: the annotation on the declaration
// tells callers that true means held.
bool LockForFork(internal::Mutex& mu,
                 const PrepareAttempt& attempt) FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  return LockNativeForFork(mu.native(), attempt);
}

void HoldAcrossFork(std::mutex* mu, std::string name, std::function<void()> in_child) {
  HoldNativeAcrossFork(mu, mu, std::move(name), std::move(in_child));
}

void HoldAcrossFork(internal::Mutex* mu, std::string name, std::function<void()> in_child) {
  HoldNativeAcrossFork(&mu->native(), mu, std::move(name), std::move(in_child));
}

bool InForkHandler() { return t_in_handler; }

// Not analysed: read on the forking thread, which holds the registry's lock while t_in_handler.
bool ForkingThreadAlone() FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  return t_in_handler && g_this_registry != nullptr && g_this_registry->alone_;
}

// Not analysed: called by prepare callbacks on the forking thread, which holds the registry's
// lock while t_in_handler.
void NoteThreadsParkedForFork(int n) FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  if (n <= 0 || !t_in_handler || g_this_registry == nullptr) return;
  AtForkRegistry& r = *g_this_registry;
  if (!r.may_quiet_ || !r.forking_) return;
  r.parked_ += n;
  if (!r.quiet_ && internal::ThreadCountIs(1 + r.parked_)) r.quiet_ = true;
}

bool ParkingWouldQuietFork(int n) FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  if (n <= 0 || !t_in_handler || g_this_registry == nullptr) return false;
  const AtForkRegistry& r = *g_this_registry;
  return r.may_quiet_ && r.forking_ && !r.quiet_ && internal::ThreadCountIs(1 + r.parked_ + n);
}

namespace internal {
void SetAtForkBypassForBenchmark(bool bypass) { g_bypass.store(bypass); }
void SetForkEntryHooks(void (*entering)(), void (*entered)()) {
  g_entering.store(entering, std::memory_order_release);
  g_entered.store(entered, std::memory_order_release);
}
}  // namespace internal

uint64_t ForkGeneration() {
  return g_this_registry != nullptr ? g_this_registry->generation_.load(std::memory_order_relaxed)
                                    : 0;
}

namespace {
// The registry is made, and this copy's role decided, at load time: constructors run one at a
// time under the dynamic loader's lock, which is what makes the election safe
// (runtime/internal/process_instance.h).
const bool g_registry_at_load = (AtForkRegistry::Get(), true);
}  // namespace

}  // namespace forksafe::runtime
