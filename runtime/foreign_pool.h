// runtime/foreign_pool.h: makes a thread pool that forksafe does not own fork-safe in a few lines.
//
// What it offers
//   A framework's own thread pool, or its background threads (a prefetcher, a logger, a
//   watchdog), do not exist in a forked child, and whatever lock one of them held at the fork
//   stays held there for ever. ForeignPoolGuard registers three callbacks of that pool with the
//   at-fork registry (runtime/at_fork.h), under the name "foreign_pool:<name>":
//     park     before the fork: stop the pool's threads or park them where they hold nothing (no
//              task running, no lock of the pool held). Bounded like every prepare: it waits at
//              most until PrepareAttempt::wait_until, and returns false ("not yet", after undoing
//              what it did) when the threads are not parked by then; the registry rolls back the
//              handlers prepared before it and retries with back-off.
//     resume   in the parent after the fork, or when a later handler of the same attempt said
//              "not yet" (a roll-back): let the threads go on. Called only after park said yes.
//     rebuild_in_child
//              in the child, on its only thread: the pool's threads are gone; start fresh ones
//              (or mark the pool for a lazy rebuild). Receives `parked`: false when park still
//              said "not yet" on the registry's last attempt and the fork went ahead regardless
//              (ForkEventKind::kPrepareGaveUp in the parent's report). Then a thread of the pool
//              may have been inside the pool's mutex or condition variable at the fork: the child
//              must not touch them (abandon them, never destroy them) and build new ones.
//   See docs/guide.md, "Other thread pools", and examples/tiny_pool.h for a complete pool.
//
// Guarantees
//   - Registered in the constructor, unregistered in the destructor (which waits for a fork in
//     progress to finish, as AtForkRegistry::Unregister does). Its place in the prepare order is
//     that of any handler: prepare runs in reverse registration order, so a foreign pool created
//     after forksafe's ThreadPools is parked before they drain, and resumed after they resume.
//   - An exception thrown by park counts as "not yet"; one thrown by resume or rebuild_in_child
//     is recorded in the fork report (ForkEventKind::kHandlerThrew) and goes no further.
//   - stats() counts what the callbacks did, in this process; a child inherits its parent's
//     counts and adds its rebuild.
//
// Hazards
//   - park must not wait for the thread that forks: a fork issued from one of the pool's own
//     threads would wait for itself until the registry's deadline and then go ahead unparked.
//     Tell the pool's threads apart (a thread_local flag) and skip the calling one.
//   - Hold the pool's lock from park's yes to resume / rebuild_in_child (all three run on the
//     forking thread): a lock released at the end of park can be taken by another thread (one
//     that submits work) in the moment before the fork, and the child then inherits it locked.
//     resume unlocks it in the parent, rebuild_in_child in the child. (AtForkRegistry's
//     LockForFork takes it within the attempt's bound.)
//   - Park, do not merely pause: a thread blocked in a std::condition_variable at the fork does
//     not exist in the child, and glibc's condition variables may wait for such phantom waiters
//     (a notify in the child can hang). Either join the threads in park (then the child may
//     reuse the pool's state, as examples/tiny_pool.h does) or have rebuild_in_child abandon the
//     state they waited on.
//   - The guard must be destroyed before the state its callbacks use (make it the pool's last
//     member, so it is destroyed first).
//   - Destroy the guard (and its pool) before fork() or after it returns, never inside an
//     at-fork callback (its own park/resume/rebuild_in_child, or another handler's): the
//     registry is locked for the fork there and cannot unregister it (AtForkRegistry::Unregister
//     throws kFailedPrecondition, which a destructor cannot pass on). What happens then: the
//     guard's callbacks are never called again (its pool is gone), the fork's report gets a
//     kHandlerThrew event for "foreign_pool:<name>" saying so (LastReport(), the event
//     listener; in a child, the report of the fork that made it), the first such misuse in a
//     process prints one line on stderr, and the inert registration stays in the registry
//     (HandlerNames() still lists it, and its address cannot be registered again) until the next
//     ForeignPoolGuard is made or destroyed outside a fork callback, which removes it. A guard
//     that a forked child no longer knows (it lived on the stack of a thread that does not exist
//     there) is simply forgotten; nothing is reported.
#ifndef FORKSAFE_RUNTIME_FOREIGN_POOL_H_
#define FORKSAFE_RUNTIME_FOREIGN_POOL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "forksafe/runtime/at_fork.h"

namespace forksafe::runtime {

/// The callbacks of a foreign pool (see the banner).
struct ForeignPoolCallbacks {
  /// For fork reports: the handler is named "foreign_pool:<name>". Required.
  std::string name;
  /// Before the fork: park or stop the threads by attempt.wait_until, or return false having
  /// undone what it did. Required.
  std::function<bool(const PrepareAttempt& attempt)> park;
  /// In the parent (and on roll-back) after park returned true. May be empty.
  std::function<void()> resume;
  /// In the child. `parked` is false when the fork went ahead without park's yes. Required.
  std::function<void(bool parked)> rebuild_in_child;
};

/// What the callbacks did, in this process.
struct ForeignPoolStats {
  uint64_t parked = 0;   ///< park said yes (counted per attempt).
  uint64_t refused = 0;  ///< park said "not yet" (or threw).
  uint64_t resumed = 0;  ///< resume ran (after a fork, or on a roll-back).
  uint64_t gave_up = 0;  ///< Forks that went ahead without the pool parked.
  uint64_t rebuilt = 0;  ///< rebuild_in_child ran (here or in the processes forked before).
};

/// Registers a foreign pool's callbacks for as long as it lives (see the banner).
class ForeignPoolGuard {
 public:
  /// Throws Error(kInvalidArgument) when name, park or rebuild_in_child is empty; as
  /// AtForkRegistry::Register otherwise (kFailedPrecondition from inside a fork handler).
  explicit ForeignPoolGuard(ForeignPoolCallbacks callbacks);
  /// Unregisters (never throws). Inside an at-fork callback it cannot: see the last hazard.
  ~ForeignPoolGuard();
  ForeignPoolGuard(const ForeignPoolGuard&) = delete;
  ForeignPoolGuard& operator=(const ForeignPoolGuard&) = delete;

  /// "foreign_pool:<name>", the handler's name in fork reports.
  const std::string& handler_name() const { return handler_name_; }
  ForeignPoolStats stats() const;

 private:
  struct Core;  // the callbacks and counts, shared with the registered handler (.cc)
  std::shared_ptr<Core> core_;
  std::string handler_name_;
};

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_FOREIGN_POOL_H_
