// runtime/at_fork.h: the process-wide at-fork registry (the heart of forksafe).
//
// What it offers
//   One registry per process and one pthread_atfork() registration (also when several copies
//   of forksafe are loaded: see "One registry per process" below), renewed at the end of glibc's
//   list when a library registered handlers after it (runtime/internal/fork_registration.h; one
//   registration acts per fork). Subsystems register
//   a handler (prepare, parent, child) under a handle and unregister it by that handle. Every
//   fork() of the process runs through it, whoever calls fork().
//
// The protocol (see docs/design.md for the full sequence diagram)
//
//   forking thread            registry                         handlers h0..hN (registration order)
//   fork() ──prepare──▶  wait while another thread's fork is in its prepare phase
//                        lock registry (held until parent/child, except during back-off)
//                        attempt k = 1..max, until AtForkOptions::prepare_deadline:
//                          hN.prepare, ..., h0.prepare     (reverse order)
//                          one says "not yet" ─▶ roll back: parent(true) on those already
//                                                prepared, unlock the registry, back off, lock,
//                                                retry (threads may (un)register meanwhile)
//                          last attempt: a refusal is recorded (kPrepareGaveUp) and the fork
//                                        proceeds with that handler marked unprepared
//                        take the framework lock (last)
//          ◀──(kernel fork)──▶
//   parent:              release framework lock (first); h0.parent .. hN.parent; unlock registry
//   child:               reset framework lock (first);  h0.child  .. hN.child;
//                        forget handlers whose handle lived on another thread's stack;
//                        unlock registry
//
// Guarantees
//   - prepare runs in reverse registration order; parent and child in registration order
//     (glibc's rule, as in folly's AtFork and gRPC core).
//   - Register/Unregister are thread-safe. A call made while another thread forks waits while
//     that fork's handlers are prepared (until its parent phase has finished, or until its
//     back-off between two attempts). A call made from inside a handler is an error
//     (kFailedPrecondition), never a deadlock.
//   - Handlers never see exceptions escape: a prepare that throws counts as "not yet"; a parent or
//     child callback that throws is recorded as an event. Handlers report trouble with ReportEvent.
//   - Bounded: at most AtForkOptions::max_prepare_attempts rounds, with exponential back-off, and
//     no new round starts after AtForkOptions::prepare_deadline: the round that starts past it is
//     the last. Between rounds the registry lock is released, so a thread that must register a
//     handler (create a ThreadPool, say) to let a "not yet" subsystem go can do so.
//   - Forks of several threads at once are serialized: a thread whose fork waits for another's
//     is known to the pools, which do not wait for a worker that is itself inside fork().
//   - Objects owned by threads that vanish at the fork are never touched by the child's later
//     forks: a handler whose handle lies on the stack (or static TLS) of the thread that
//     registered it, when that thread is not the forking one, runs its child callback once
//     (its memory is still intact then) and is then forgotten in the child (glibc gives such
//     stacks to the child's next threads). The main thread's stack is not reused that way:
//     handlers registered there stay.
//
// The rule for handlers (what keeps a fork from hanging)
//   A prepare callback never blocks without bound. It may wait until PrepareAttempt::wait_until
//   (use LockForFork() for a mutex); when that passes it returns false ("not yet"): the registry
//   rolls back and retries, which lets a thread that holds the lock while it waits for something
//   a prepared subsystem paused make progress. On the last attempt a refusal is final: the fork
//   proceeds, the handler's parent and child callbacks get prepared == false.
//   A prepare callback starts no thread: such a thread does not exist in the child, and each
//   round counts the process's threads once, as it begins (PrepareAttempt::alone: a fork from a
//   process's only thread, where forksafe's handlers skip their locks and oneTBB's finalize, so
//   that an idle fork writes few pages), and again whenever a handler reports threads it parked
//   for the fork (NoteThreadsParkedForFork: once all other threads are parked so, the fork is
//   "quiet" and the handlers prepared after that point see PrepareAttempt::alone too).
//
// One registry per process, even with several copies of forksafe
//   A process may hold several copies of forksafe: a program that links it statically and loads
//   an extension that links libforksafe.so, or two shared objects that each link it statically,
//   loaded with dlopen. Each copy exports the C symbol `forksafe_process_instance_v1`
//   (runtime/internal/process_instance.h). At load time the first copy becomes the *primary*
//   (role() == kPrimary) and makes the process's one pthread_atfork registration; every later
//   copy *nests* (role() == kNested): it makes none, and its whole registry becomes one handler of
//   the primary's, named "forksafe copy in <its file>". The election is serialized even when two
//   copies load at once on two threads (runtime/internal/process_instance.h). On each fork that
//   handler runs one round of the nested copy's handlers per attempt of the primary (with the
//   primary's attempt number, deadline and wait), so a "not yet" there rolls back and retries the
//   whole fork; the nested copy then holds its registry until its parent/child phase. The
//   framework locks are taken last, after every handler of every copy is prepared: the
//   primary's, then each nested copy's, all within the primary's framework_lock_timeout. When a
//   nested copy cannot be prepared by the primary's last attempt (its registry lock stayed busy),
//   the primary records kPrepareGaveUp for "forksafe copy in ...", and in the child every handler
//   of that copy runs its child callback with prepared == false. Events of the nested copy's
//   handlers appear in its own report and, named "forksafe copy in <its file>: <subsystem>", in
//   the primary's ForkReport (and listener). Both copies pin their objects (RTLD_NODELETE), so
//   dlclose never unmaps code that the other calls; a copy that cannot be pinned does not nest.
//   What a consumer sees: in the primary, HandlerNames() lists "forksafe copy in ..." and
//   LastReport() holds every copy's events; in a nested copy, IsNested() is true,
//   PrimaryObject() names the primary's file, HandlerNames() lists its own handlers, and
//   LastReport()/fork_count()/the listener (called on the forking thread after the primary's
//   registry is released) describe the forks as its own handlers saw them.
//   Limits: each copy keeps its own framework lock, default pool and shm-manager client (all are
//   held or drained across every fork, by the one registry); in a nested copy only
//   AtForkOptions::attempt_wait and framework_lock_timeout apply (the primary's options rule the
//   attempts, the deadline, and cap the framework-lock wait). oneTBB and OpenMP are one shared
//   runtime per process, quiesced by the primary's handlers only ("onetbb", "openmp"; a second
//   oneTBB scheduler handle made every finalize refuse): in a nested copy,
//   TbbUsableInThisProcess(), ReleaseTbbScheduler() and OpenMpUsableInThisProcess() do not speak
//   for the process, and a oneTBB or OpenMP runtime linked statically into a nested copy is not
//   quiesced. At most 16 copies nest in one primary. A copy that cannot nest (a 17th, one whose
//   object cannot be pinned, one refused by the primary) never runs silently: at load, where there
//   is no caller to throw to, it prints one line on stderr naming both copies, why, and what to do,
//   and then runs separately (role() == kSeparate) with its own pthread_atfork registration, as
//   without this mechanism.
//   The rules:
//   - Keep each copy's ELF note (section .note.forksafe): the copies find each other through it
//     (and through the exported symbol `forksafe_process_instance_v1`), so a version script with
//     `local: *;` or -Wl,--exclude-libs,ALL does not hide a copy. A linker script that discards
//     .note.* sections, or a tool that strips that note, does: such a copy runs as a primary with
//     its own registration, a second registry that knows nothing of the others, and nothing
//     says so. A program linked fully statically (no dynamic loader) holds one copy only.
//   - A shared object that links forksafe statically must call its own copy: build that copy with
//     -fvisibility=hidden, or link the object with -Wl,-Bsymbolic-functions (or link it against
//     libforksafe.so instead). Otherwise, when another copy's C++ symbols are in the process's
//     global scope (a program linked with -lforksafe or -rdynamic, an object loaded RTLD_GLOBAL),
//     the object's calls of forksafe functions bind to that copy's by ELF interposition, even
//     when the object itself is loaded RTLD_LOCAL: it never elects, and runs a mix of both
//     copies' code. forksafe detects this at load and says so on stderr; it cannot undo it.
//     Loading such objects RTLD_LOCAL (dlopen's and Python's default) keeps their own symbols out
//     of the global scope, so that they do not interpose the copies loaded after them.
//
// Hazards
//   - Handlers run with the registry lock held: they must not wait for another thread that is
//     itself about to fork or (un)register a handler (other than through LockForFork's bounded
//     wait).
//   - A `prepare` that returns false must have released everything it took in that attempt.
//   - pthread_atfork cannot refuse a fork: when a subsystem cannot be prepared in time, the child
//     must treat it as unusable and rebuild it; its child callback receives prepared == false.
//   - A handle that points into another thread's stack, registered by a thread other than its
//     owner, is not recognized as stack-owned: register from the thread that owns the object.
//   - PrepareAttempt::alone reads the link count of /proc/self/task (Linux: 2 + the number of
//     threads), checked once against a listing of that directory; without /proc, or where the two
//     disagree, every fork counts as not alone (the full protocol, as before issue 19). A
//     component that reports parked threads (NoteThreadsParkedForFork) vouches for them: a
//     thread reported parked that can still run lets later handlers skip their locks wrongly.
#ifndef FORKSAFE_RUNTIME_AT_FORK_H_
#define FORKSAFE_RUNTIME_AT_FORK_H_

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "forksafe/runtime/framework_lock.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::runtime {

/// Passed to a prepare callback: which attempt this is and whether it is the last one.
struct PrepareAttempt {
  int number = 1;            ///< 1-based attempt number within this fork.
  bool last = false;         ///< On the last attempt a refusal no longer causes a retry.
  uint64_t fork_number = 0;  ///< Identifies the fork (ForkReport::fork_number) across attempts.
  /// The fork's prepare deadline (its start + AtForkOptions::prepare_deadline).
  std::chrono::steady_clock::time_point deadline{};
  /// How long this prepare call may block: a slice (AtForkOptions::attempt_wait) on an attempt
  /// that can still be retried, the deadline on the last one.
  std::chrono::steady_clock::time_point wait_until{};
  /// True when, as this round began, the forking thread was the process's only thread (counted
  /// once per round, from the kernel's thread count), or when the fork turned *quiet* before this
  /// callback: every other thread was reported parked for this fork by the handlers prepared
  /// before it (NoteThreadsParkedForFork: idle pool workers paused for the fork, say). Either
  /// way no other thread can hold or take a lock before the fork, so a handler may skip work
  /// whose only purpose is to exclude or stop other threads (forksafe's own handlers then skip
  /// taking their locks, and oneTBB's finalize: each page written around a fork costs a
  /// copy-on-write fault in the parent and in the child). Stays true for the round only if
  /// prepare callbacks start no thread (they must not: a thread started in prepare is not in the
  /// child and can take locks already prepared). Always false in a copy of forksafe nested in
  /// another's registry.
  bool alone = false;
};

/// The callbacks of one subsystem. Any of them may be empty.
struct AtForkHandler {
  /// A name for reports ("thread_pool:io", "device_registry").
  std::string name;
  /// Quiesce before the fork. Return false ("not yet") to have the registry roll back the
  /// handlers already prepared in this attempt and retry after a back-off.
  std::function<bool(const PrepareAttempt&)> prepare;
  /// In the parent after the fork, or to roll back a prepare that succeeded in a failed attempt.
  /// `prepared` is false when this handler's prepare gave up on the last attempt.
  std::function<void(bool prepared)> parent;
  /// In the child after the fork; the child has exactly one thread (the one that forked).
  std::function<void(bool prepared)> child;
};

/// What can go wrong during a fork without stopping it.
/// The values are fixed: copies of forksafe in one process pass them to each other.
enum class ForkEventKind {
  kPrepareRetried = 0,  ///< A prepare said "not yet"; the registry rolled back and retried.
  kPrepareGaveUp = 1,   ///< A prepare still refused on the last attempt; the fork went ahead.
  kDrainDeadlineExceeded = 2,  ///< A pool had tasks still running when its drain deadline passed.
  kFrameworkLockTimeout = 3,   ///< The framework lock could not be taken in time.
  kSubsystemUnusable = 4,      ///< A subsystem is unusable in the child until rebuilt.
  kHandlerThrew = 5,           ///< A callback threw; the exception was swallowed.
};

/// Returns a stable name for `kind` ("prepare_gave_up", ...).
const char* ForkEventKindName(ForkEventKind kind);

/// One reported event.
struct ForkEvent {
  ForkEventKind kind;
  std::string subsystem;  ///< The handler's name.
  std::string detail;     ///< What happened and what it means, for a person.
};

/// What happened during one fork.
struct ForkReport {
  uint64_t fork_number = 0;  ///< 1 for the first fork this process made, and so on.
  int attempts = 0;          ///< Prepare rounds it took.
  std::vector<ForkEvent> events;
  /// True when every subsystem was prepared on time and nothing was reported.
  bool clean() const { return events.empty(); }
  /// A multi-line summary for logs.
  std::string ToString() const;
};

/// Tunables of the registry.
struct AtForkOptions {
  int max_prepare_attempts = 8;                    ///< >= 1.
  std::chrono::microseconds initial_backoff{100};  ///< First sleep after a roll-back.
  std::chrono::microseconds max_backoff{20000};    ///< Cap of the doubling back-off.
  std::chrono::milliseconds framework_lock_timeout{2000};
  /// No prepare round starts after the fork's start + this; the round that starts past it is the
  /// last, and handlers that wait (LockForFork) wait at most until it.
  std::chrono::milliseconds prepare_deadline{3000};
  /// How long one handler may block in a round that can still be retried (see wait_until).
  std::chrono::milliseconds attempt_wait{50};
};

/// How this copy of forksafe's registry takes part in the process's forks. Decided at load time,
/// before Get() first returns.
enum class RegistryRole {
  kPrimary,   ///< It makes the process's pthread_atfork registration.
  kNested,    ///< It runs as one handler inside another copy's (the primary's) registry.
  kSeparate,  ///< It could not nest (it said why on stderr) and runs its own registration.
};

struct __attribute__((visibility("hidden"))) NestedCopy;  // not for users (internal/nested_copy.cc)

/// The process-wide registry. Obtain it with AtForkRegistry::Get(); it is never destroyed.
/// Aligned so that its state, which is written after every fork, sits on one memory page: each
/// page written after fork() costs a copy-on-write fault in the parent and in the child.
class alignas(1024) AtForkRegistry {
 public:
  /// The registry; the first call installs the single pthread_atfork registration.
  static AtForkRegistry& Get();

  /// Adds `handler` under `handle` (any unique address, usually the owning object).
  /// Throws kInvalidArgument for a null handle, kAlreadyExists for a handle already registered,
  /// kFailedPrecondition when called from inside a fork handler.
  void Register(const void* handle, AtForkHandler handler);

  /// Removes the handler registered under `handle`. Throws kNotFound for an unknown handle and
  /// kFailedPrecondition when called from inside a fork handler.
  void Unregister(const void* handle);

  /// True when `handle` is registered.
  bool IsRegistered(const void* handle) const;

  /// Names of the registered handlers, in registration order.
  std::vector<std::string> HandlerNames() const;

  /// Replaces the options. Throws kInvalidArgument for max_prepare_attempts < 1.
  void SetOptions(const AtForkOptions& options);
  AtForkOptions options() const;

  /// The report of the last fork this process made (in a child: of the fork that created it).
  ForkReport LastReport() const;

  /// Number of forks this process has made through the registry.
  uint64_t fork_count() const;

  /// This copy's role in the process (see "One registry per process" above).
  RegistryRole role() const;
  /// True when this copy's registry is nested in another copy's.
  bool IsNested() const { return role() == RegistryRole::kNested; }
  /// The file of the object (shared library, or the program) whose copy of forksafe holds the
  /// registry that runs this process's forks: this copy's own unless it is nested.
  std::string PrimaryObject() const;

  /// Called in the parent, after the registry lock is released, for each fork whose report is
  /// not clean. Replaces any previous listener; pass an empty function to remove it.
  void SetEventListener(std::function<void(const ForkReport&)> listener);

  /// Records an event on the fork in progress. Only meaningful from inside a handler; ignored
  /// elsewhere. Never throws.
  static void ReportEvent(ForkEventKind kind, const std::string& subsystem,
                          const std::string& detail) noexcept;

  AtForkRegistry(const AtForkRegistry&) = delete;
  AtForkRegistry& operator=(const AtForkRegistry&) = delete;

 private:
  struct Entry {
    const void* handle;
    AtForkHandler handler;
    bool prepared = false;
    bool on_owner_stack = false;  // handle lies on the registering thread's stack or static TLS
    pthread_t owner{};            // the registering thread (meaningful with on_owner_stack)
    // Its AtForkRegistration was destroyed inside a fork callback, where the registry cannot
    // unregister it: never called again, and removed when that fork ends.
    bool retired = false;
    bool saw_alone = false;  // the PrepareAttempt::alone its last prepare saw
  };

  AtForkRegistry();
  // pthread_atfork's callbacks: mu_ is taken in the prepare and released in the parent or child
  // callback, across functions (see Prepare, Parent, Child).
  static void OnPrepare();
  static void OnParent();
  static void OnChild();
  // Returns with mu_ held (for the whole fork); Parent() or Child() releases it.
  void Prepare() FORKSAFE_EXCLUSIVE_LOCK_FUNCTION(mu_);
  bool PrepareRound(PrepareAttempt attempt, std::chrono::steady_clock::time_point cap,
                    std::chrono::steady_clock::time_point started)
      FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RollBack(size_t from) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TakeFrameworkLock(std::chrono::steady_clock::time_point until) noexcept
      FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishParent() noexcept FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Parent() FORKSAFE_UNLOCK_FUNCTION(mu_);
  void Child() noexcept FORKSAFE_UNLOCK_FUNCTION(mu_);
  void CheckNotInHandler(const char* what) const;
  void RetireInsideFork(const void* handle) noexcept FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropRetired() noexcept FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ForkingThreadAlone() answers for `e` while its callbacks run (written on a change only).
  void SeeAloneAs(const Entry& e) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (alone_ != e.saw_alone) alone_ = e.saw_alone;
  }
  friend class AtForkRegistration;
  friend struct NestedCopy;  // a copy nested in another's registry (internal/nested_copy.cc)

  // Guards everything below; held from prepare to parent/child. Same size as std::mutex, and
  // fork_done_ as std::condition_variable: the registry still fits its page.
  mutable internal::Mutex mu_;
  internal::CondVar fork_done_;  // a fork's parent phase ended (forking_ went false)
  bool forking_ FORKSAFE_GUARDED_BY(mu_) =
      false;  // a fork is between its prepare and parent phases
  std::vector<Entry> entries_ FORKSAFE_GUARDED_BY(mu_);
  AtForkOptions options_ FORKSAFE_GUARDED_BY(mu_);
  ForkReport current_ FORKSAFE_GUARDED_BY(mu_);
  ForkReport last_ FORKSAFE_GUARDED_BY(mu_);
  uint64_t fork_count_ FORKSAFE_GUARDED_BY(mu_) = 0;
  bool framework_lock_taken_ FORKSAFE_GUARDED_BY(mu_) = false;
  bool alone_ FORKSAFE_GUARDED_BY(mu_) = false;  // ForkingThreadAlone() for the running callback
  // The quiet rule, per round: threads reported parked (NoteThreadsParkedForFork), whether all
  // other threads are among them, and whether this round may turn quiet at all.
  int parked_ FORKSAFE_GUARDED_BY(mu_) = 0;
  bool quiet_ FORKSAFE_GUARDED_BY(mu_) = false;
  bool may_quiet_ FORKSAFE_GUARDED_BY(mu_) = false;
  int fork_waiters_ FORKSAFE_GUARDED_BY(mu_) = 0;  // threads waiting on fork_done_
  // ForkGeneration(): here rather than in a global, so that the child writes no other page.
  std::atomic<uint64_t> generation_{0};
  std::function<void(const ForkReport&)> listener_ FORKSAFE_GUARDED_BY(mu_);
  DefaultFrameworkLock default_framework_lock_;  // on the same page as mu_ (see above)

  friend DefaultFrameworkLock& internal_default_framework_lock();
  friend bool ForkingThreadAlone();
  friend void NoteThreadsParkedForFork(int n);
  friend bool ParkingWouldQuietFork(int n);
  friend uint64_t ForkGeneration();
};

/// RAII registration: registers in the constructor, unregisters in the destructor. Destroyed
/// inside a fork callback (where the registry is locked and cannot unregister), it retires its
/// handler instead: the handler is not called again, is removed when that fork ends, and the
/// fork's report carries ForkEventKind::kHandlerThrew saying so (a misuse: destroy registrations
/// before fork() or after it returns).
class AtForkRegistration {
 public:
  AtForkRegistration(const void* handle, AtForkHandler handler);
  ~AtForkRegistration();
  AtForkRegistration(const AtForkRegistration&) = delete;
  AtForkRegistration& operator=(const AtForkRegistration&) = delete;

 private:
  const void* handle_;
};

/// Holds `mu` across every fork: locked in prepare, unlocked in the parent, and unlocked in the
/// child after `in_child` ran (with the lock still held, on the child's only thread). When the
/// forking thread is the process's only thread (PrepareAttempt::alone) no other thread can hold
/// or take `mu`, and it is neither locked nor unlocked (no write to its page around the fork);
/// `in_child` still runs, on the child's only thread, with `mu` free. The common
/// case of a subsystem whose state is guarded by one mutex: no thread is half-way through it at
/// the fork, and the child can reset it safely. `mu` is the registration handle: it must
/// outlive its registration. Before a mutex that does not live for the rest of the process goes
/// (a member, a local), call AtForkRegistry::Get().Unregister(mu); a registration left behind
/// would make the next fork lock freed memory. (Only a forked child forgets, by itself, a mutex
/// on the stack of a thread that does not exist there: see Guarantees.)
/// Throws as AtForkRegistry::Register.
/// The lock is taken with LockForFork: a thread that holds `mu` while it waits for a subsystem
/// prepared before it (a paused pool, a registration, the framework lock) makes the prepare say
/// "not yet", never hang. When `mu` could not be taken by the last attempt the fork proceeds
/// without it (kPrepareGaveUp); the child then rebuilds `mu` unlocked (its holder does not exist
/// there) and runs `in_child` on it: the state it guards may be half-updated, and `in_child` is
/// where to reset it.
void HoldAcrossFork(std::mutex* mu, std::string name, std::function<void()> in_child = nullptr);
/// The same for forksafe's annotated mutex (runtime/internal/mutex.h); `mu` is the handle.
void HoldAcrossFork(internal::Mutex* mu, std::string name,
                    std::function<void()> in_child = nullptr);

/// Locks `mu` for a prepare callback: waits at most until attempt.wait_until and returns whether
/// it holds the lock. The one way a prepare should take a mutex (see "The rule for handlers").
bool LockForFork(std::mutex& mu, const PrepareAttempt& attempt);
/// The same for forksafe's annotated mutex: true means the caller holds `mu`.
bool LockForFork(internal::Mutex& mu, const PrepareAttempt& attempt)
    FORKSAFE_EXCLUSIVE_TRYLOCK_FUNCTION(true, mu);

/// True on the thread that is running at-fork handlers, while it runs them.
bool InForkHandler();

/// On the forking thread inside a fork's callbacks (prepare, parent, child, roll-back): the
/// PrepareAttempt::alone that the running handler's own prepare saw in this fork's latest round.
/// False elsewhere. A handler whose prepare skipped taking a lock because it was alone reads it
/// in parent and child to skip the unlock.
bool ForkingThreadAlone();

/// For the prepare callback of a component that owns threads (a pool): `n` of its threads are
/// parked for this fork. Each holds no lock, runs nothing (neither the component's code nor its
/// users'), holds no oneTBB thread state, and stays so until this component's parent or child
/// callback, or a roll-back of its prepare, lets it go. When the threads so reported are all the
/// process's threads but the forking one, the fork is quiet: the handlers that prepare after
/// this one see PrepareAttempt::alone. Ignored outside a prepare callback and in a copy of
/// forksafe nested in another's registry. Costs one stat() of /proc/self/task.
void NoteThreadsParkedForFork(int n);

/// In a prepare callback: whether parking `n` more threads (and reporting them) would make this
/// fork quiet. For a component that parks a thread only when that pays off. One stat().
bool ParkingWouldQuietFork(int n);

/// 0 in a process that was not created by fork() since the program started (or exec'd);
/// incremented in each forked child, so a child compares it to detect inherited state.
uint64_t ForkGeneration();

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_AT_FORK_H_
