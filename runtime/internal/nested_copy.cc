// runtime/internal/nested_copy.cc: the at-fork registry's side of "several copies of forksafe in
// one process" (runtime/at_fork.h, "One registry per process"; runtime/internal/nested_copy.h).
// The primary's side: the copies nested in it and the handler that drives each. The nested
// copy's side: NestedCopy, the entry points the primary calls.
#include "forksafe/runtime/internal/nested_copy.h"

#include <dlfcn.h>
#include <stdio.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/framework_lock.h"
#include "forksafe/version.h"

namespace forksafe::runtime {

using Clock = std::chrono::steady_clock;

namespace {

// ---- The primary's side -------------------------------------------------------------------------

// Slots are claimed with fetch_add (copies may nest concurrently: a constructor of one object that
// starts a thread that dlopens another), filled once, never emptied. The claim counter may pass
// kMaxNestedCopies: every claim past it is refused.
std::atomic<const forksafe_nested_v1*> g_nested[internal::kMaxNestedCopies];
std::atomic<int> g_nested_claimed{0};

template <typename F>
void ForEachNested(F&& f) {
  const int n =
      std::min(g_nested_claimed.load(std::memory_order_acquire), internal::kMaxNestedCopies);
  for (int i = 0; i < n; ++i) {
    if (const forksafe_nested_v1* c = g_nested[i].load(std::memory_order_acquire)) f(c);
  }
}

// ---- The nested copy's side: what lives from the primary's first call to its parent/child ------
// The primary calls every entry point of one fork on the forking thread, so per-fork state is
// thread-local: two forks (on two threads, one after the other) never share it.

thread_local bool t_fork_open = false;     // the primary's fork has started calling this copy
thread_local bool t_held = false;          // this copy's registry is prepared (mu_ held) for it
thread_local bool t_report_fresh = false;  // current_ was reset for this fork
thread_local uint64_t t_fork_number = 0;
thread_local Clock::time_point t_started{};
// The report and listener owed to this copy's listener once the primary released its registry.
struct PendingReport {
  bool pending = false;
  ForkReport report;
  std::function<void(const ForkReport&)> listener;
};
thread_local PendingReport t_pending;

}  // namespace

// Hidden: each copy's primary must call this copy's own entry points, never another copy's
// (runtime/internal/process_instance.h, "Visibility and interposition").
struct __attribute__((visibility("hidden"))) NestedCopy {
  static void Entering() noexcept { internal::RunThisCopysEntering(); }
  static void Entered() noexcept { internal::RunThisCopysEntered(); }

  // One round of this copy's handlers for the primary's attempt. On success mu_ stays held (and
  // InForkHandler() true) until RollBack, Parent or Child; on "not yet" or an exception nothing
  // is held. Not analysed for that reason: it returns holding r.mu_, which a later entry point
  // releases on this thread (t_held says so); the round itself is (PrepareRoundHeld).
  static int Prepare(const forksafe_attempt_v1* c) noexcept FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
    if (c == nullptr || c->struct_size < sizeof(forksafe_attempt_v1)) return 0;
    AtForkRegistry& r = internal::ThisRegistry();
    const auto deadline = internal::FromNs(c->deadline_ns);
    const PrepareAttempt a{c->number, c->last != 0, c->fork_number, deadline, deadline};
    if (!t_fork_open) {  // the primary's first call for this fork
      t_fork_open = true;
      t_report_fresh = false;
      t_fork_number = c->fork_number;
      t_started = Clock::now();
    }
    // The registry lock is held only briefly by this copy's own threads ((un)register, reads);
    // waited for like any lock of a prepare (runtime/at_fork.h, "The rule for handlers").
    PrepareAttempt wait = a;
    wait.wait_until = internal::FromNs(c->wait_until_ns);
    if (!LockForFork(r.mu_, wait)) return 0;
    internal::SetInForkHandler(true);
    if (!PrepareRoundHeld(r, c, a)) {
      internal::SetInForkHandler(false);
      r.mu_.Unlock();
      return 0;
    }
    t_held = true;
    return 1;
  }

  // Prepare's round, with r.mu_ held; false (everything rolled back) on "not yet" or a throw.
  static bool PrepareRoundHeld(AtForkRegistry& r, const forksafe_attempt_v1* c,
                               const PrepareAttempt& a) noexcept
      FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(r.mu_) {
    try {
      if (!t_report_fresh) {
        r.current_ = ForkReport{};
        r.current_.fork_number = c->fork_number;
        t_report_fresh = true;
      }
      r.current_.attempts = c->number;
      r.framework_lock_taken_ = false;
      return r.PrepareRound(a, internal::FromNs(c->wait_until_ns), t_started);
    } catch (...) {
      // Nothing in a round should throw (callbacks' exceptions are caught there); if something
      // did, undo what this round prepared rather than leave the registry locked.
      r.RollBack(0);
      AtForkRegistry::ReportEvent(ForkEventKind::kHandlerThrew, "forksafe copy",
                                  "a prepare round of this copy threw; rolled back");
      return false;
    }
  }

  // The primary rolls back a round in which this copy was prepared.
  static void RollBack() noexcept {
    if (!t_held) return;
    t_held = false;
    AtForkRegistry& r = internal::ThisRegistry();
    r.mu_.AssertHeld();  // t_held: this thread took it in Prepare
    if (r.framework_lock_taken_) {
      r.framework_lock_taken_ = false;
      try {
        GetFrameworkLock().Unlock();
      } catch (...) {
      }
    }
    r.RollBack(0);  // noexcept callbacks aside, nothing here throws (and this function is noexcept)
    internal::SetInForkHandler(false);
    r.mu_.Unlock();
  }

  // After the primary took its own framework lock, every copy prepared: this copy's, waiting at
  // most until `deadline_ns` (the primary's framework-lock deadline) or this copy's own
  // framework_lock_timeout, whichever comes first.
  static void LockFramework(int64_t deadline_ns) noexcept {
    if (!t_held) return;
    AtForkRegistry& r = internal::ThisRegistry();
    r.mu_.AssertHeld();  // t_held: this thread took it in Prepare
    r.TakeFrameworkLock(
        std::min(internal::FromNs(deadline_ns), Clock::now() + r.options_.framework_lock_timeout));
  }

  static void Parent() noexcept {
    t_fork_open = false;
    if (!t_held) return;  // not prepared on the last attempt: its handlers did not run
    t_held = false;
    AtForkRegistry& r = internal::ThisRegistry();
    r.mu_.AssertHeld();  // t_held: this thread took it in Prepare
    r.FinishParent();
    try {
      if (!r.last_.clean() && r.listener_) {
        t_pending.report = r.last_;
        t_pending.listener = r.listener_;
        t_pending.pending = true;
      }
    } catch (...) {
      t_pending = PendingReport{};  // out of memory copying the report: no notification
    }
    internal::SetInForkHandler(false);
    r.mu_.Unlock();
  }

  static void Child() noexcept {
    t_fork_open = false;
    t_pending = PendingReport{};
    AtForkRegistry& r = internal::ThisRegistry();
    if (!t_held) {
      // The primary gave up on this copy on its last attempt: its registry lock could not be
      // had, or its round failed. This is the child's only thread; whoever held the lock does
      // not exist here. Run the child phase with every handler unprepared, so that each rebuilds
      // its subsystem (the registry's contract for a prepare that gave up).
      if (!r.mu_.TryLock()) {
        r.mu_.ResetAfterFork();
        r.mu_.Lock();
      }
      for (auto& e : r.entries_) e.prepared = false;
      r.framework_lock_taken_ = false;
      r.current_ = ForkReport{};
      r.current_.fork_number = t_fork_number;
      internal::SetInForkHandler(true);
    } else {
      r.mu_.AssertHeld();  // t_held: this thread took it in Prepare
    }
    t_held = false;
    r.Child();  // unlocks mu_
  }

  // In the parent, after the primary released its registry: this copy's listener, with what
  // Parent stashed on this thread. No lock: another fork's Parent cannot touch this thread's copy.
  static void ParentDone() noexcept {
    if (!t_pending.pending) return;
    PendingReport p = std::move(t_pending);
    t_pending = PendingReport{};
    internal::CallListener(p.listener, p.report);
  }

  static bool Nest(const forksafe_instance_v1& primary) noexcept;
};

namespace {
const forksafe_nested_v1 kThisNestedCopy = {
    sizeof(forksafe_nested_v1), nullptr,
    &NestedCopy::Entering,      &NestedCopy::Entered,
    &NestedCopy::Prepare,       &NestedCopy::RollBack,
    &NestedCopy::Parent,        &NestedCopy::Child,
    &NestedCopy::ParentDone,    &NestedCopy::LockFramework,
};

void SayRunsSeparately(const forksafe_instance_v1& primary, const char* why) {
  // At load time there is no caller to throw to: say it where a person will see it.
  fprintf(stderr,
          "forksafe: the copy of forksafe %s in %s could not nest in the copy of forksafe %s in "
          "%s (%s); it makes its own pthread_atfork registration, so forks are not coordinated "
          "between the two copies. Link forksafe once per process (libforksafe.so); see "
          "forksafe/runtime/at_fork.h, \"One registry per process\"\n",
          FORKSAFE_VERSION_STRING, internal::ThisInstance().object, primary.version, primary.object,
          why);
}
}  // namespace

bool NestedCopy::Nest(const forksafe_instance_v1& primary) noexcept {
  char error[512] = "";
  if (!internal::PinThisCopy()) {
    const char* dl = dlerror();
    snprintf(error, sizeof error,
             "its object could not be pinned with dlopen(RTLD_NOLOAD | RTLD_NODELETE)%s%s, so a "
             "dlclose could unmap code that the other copy would call",
             dl != nullptr ? ": " : "", dl != nullptr ? dl : "");
  } else {
    try {
      // Leaked: the primary keeps pointers to both for the life of the process.
      static auto* name =
          new std::string(absl::StrCat("forksafe copy in ", internal::ThisInstance().object));
      static auto* table = new forksafe_nested_v1(kThisNestedCopy);
      table->name = name->c_str();
      if (primary.nest(table, error, sizeof error) == 0) return true;
    } catch (...) {
      snprintf(error, sizeof error, "out of memory while nesting");
    }
  }
  internal::MarkSeparate();
  SayRunsSeparately(primary, error);
  return false;
}

namespace internal {

bool NestInPrimary(const forksafe_instance_v1& primary) noexcept {
  return NestedCopy::Nest(primary);
}

NestedCopies CurrentNestedCopies() noexcept {
  NestedCopies n;
  ForEachNested([&n](const forksafe_nested_v1* c) { n.copies[n.count++] = c; });
  return n;
}

void RunNestedEntering(const NestedCopies& nested) noexcept {
  for (int i = 0; i < nested.count; ++i) nested.copies[i]->entering();
}

void RunNestedEntered(const NestedCopies& nested) noexcept {
  for (int i = 0; i < nested.count; ++i) nested.copies[i]->entered();
}

void LockNestedFrameworks(Clock::time_point deadline) noexcept {
  const int64_t ns = ToNs(deadline);
  ForEachNested([ns](const forksafe_nested_v1* c) { c->lock_framework(ns); });
}

void RunNestedParentDone() noexcept {
  ForEachNested([](const forksafe_nested_v1* c) { c->parent_done(); });
}

// The primary's side of `nest`: a nested copy becomes one handler of this registry.
int NestInThisCopy(const forksafe_nested_v1* nested, char* error, size_t error_size) noexcept {
  auto refuse = [&](const char* why) {
    snprintf(error, error_size, "%s", why);
    return 1;
  };
  try {
    if (const char* why = NestingRefusedForTest()) return refuse(why);
    if (nested == nullptr || nested->struct_size < sizeof(forksafe_nested_v1)) {
      return refuse("its nesting table is smaller than this copy's ABI expects");
    }
    if (!PinThisCopy()) {
      return refuse(
          "the primary's object could not be pinned with dlopen(RTLD_NOLOAD | "
          "RTLD_NODELETE), so a dlclose could unmap code that the nested copy calls");
    }
    const int slot = g_nested_claimed.fetch_add(1, std::memory_order_acq_rel);
    if (slot >= kMaxNestedCopies) {
      return refuse(absl::StrCat("this process already has ", kMaxNestedCopies,
                                 " copies of forksafe nested in one registry, the most supported")
                        .c_str());
    }
    AtForkHandler h;
    h.name = nested->name != nullptr ? nested->name : "forksafe copy";
    h.prepare = [nested](const PrepareAttempt& a) {
      const forksafe_attempt_v1 c{
          sizeof(forksafe_attempt_v1), a.number, a.last ? 1 : 0, a.fork_number, ToNs(a.deadline),
          ToNs(a.wait_until)};
      return nested->prepare(&c) != 0;
    };
    h.parent = [nested](bool) {
      if (RollingBack()) {
        nested->roll_back();
      } else {
        nested->parent();
      }
    };
    h.child = [nested](bool) { nested->child(); };
    ThisRegistry().Register(nested, std::move(h));  // a throw leaves the slot empty (skipped)
    g_nested[slot].store(nested, std::memory_order_release);
    return 0;
  } catch (const std::exception& e) {
    return refuse(e.what());
  } catch (...) {
    return refuse("registering its handler failed");
  }
}

void ReportEventFromNestedCopy(int32_t kind, const char* subsystem, const char* detail) noexcept {
  const bool known = kind >= 0 && kind <= static_cast<int32_t>(ForkEventKind::kHandlerThrew);
  try {
    std::string d = detail != nullptr ? detail : "";
    if (!known) {
      // A newer copy's kind: recorded as the conservative kSubsystemUnusable
      // (runtime/internal/process_instance.h), and said so.
      d = absl::StrCat("(event kind ", kind, ", unknown to this copy of forksafe ",
                       FORKSAFE_VERSION_STRING, ", recorded as subsystem_unusable) ", d);
    }
    AtForkRegistry::ReportEvent(
        known ? static_cast<ForkEventKind>(kind) : ForkEventKind::kSubsystemUnusable,
        subsystem != nullptr ? subsystem : "", d);
  } catch (...) {
    // Out of memory building the strings: drop the event.
  }
}

}  // namespace internal
}  // namespace forksafe::runtime
