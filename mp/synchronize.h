// mp/synchronize.h: Python multiprocessing's synchronization objects, for processes.
//
// What it offers
//   Lock, RLock, Semaphore, BoundedSemaphore, Condition, Event and Barrier, with the API and
//   semantics of Python's multiprocessing.synchronize (method names included). Each object is a
//   small handle to state in its own anonymous shared memory segment (a memfd):
//     - processes created by fork() inherit the mapping and use the handles they inherited;
//     - processes created by spawn receive a handle through the codec (mp/codec.h): Encode() a
//       handle, send the Message, Decode() it on the other side; the memfd travels out of band
//       and is mapped again there.
//   Copies of a handle, in one process or across processes, share the same object (like Python
//   handles): acquiring through one copy is seen by every other.
//
// Guarantees
//   - Robust against dying processes. Every object is built on a robust process-shared mutex
//     (mp/internal/shm_sync.h): when a process dies while holding a Lock or RLock, the next
//     acquire() succeeds instead of hanging and previous_owner_died() tells that owner the data
//     the lock protected may be half-updated. A process that dies inside the short internal
//     critical section of a Semaphore, Event or Condition leaves it usable; one that dies
//     there inside a Barrier breaks that barrier (see Barrier). A process killed while *waiting*
//     leaves nothing behind: waits are futexes on a sequence counter, not pthread_cond_t, whose
//     glibc implementation loses wakeups (and can hang the notifier) once a process-shared
//     waiter is killed mid-wait.
//   - Bounded waits. Every blocking call takes a timeout, a std::optional of seconds as in Python
//     (any std::chrono duration converts, `lock.acquire(true, 250ms)`, and so does mp::Timeout).
//     No timeout means "wait until it happens"; a negative timeout throws
//     Error(kInvalidArgument). Timeouts use CLOCK_MONOTONIC, so wall-clock changes do not
//     affect them.
//   - Errors are forksafe::runtime::Error: kInvalidArgument for bad arguments, kFailedPrecondition
//     for calls the current state does not allow (releasing a lock you do not hold, waiting on a
//     Condition without its lock, over-releasing a BoundedSemaphore, a broken Barrier),
//     kDeadlineExceeded for the Barrier waiter whose own timeout ran out.
//   - Thread safety: every method may be called from any thread of any process. Assigning to a
//     handle while another thread uses the same handle object is a data race (as for any value).
//
// Fork behaviour
//   Nothing to do: the state is MAP_SHARED and needs no at-fork handler. Ownership of a Lock or
//   RLock belongs to the *thread* that acquired it, so a child forked while its parent holds a
//   lock does not hold it: it cannot release() it (kFailedPrecondition), and it can acquire it
//   once the parent releases it, or at once (with previous_owner_died()) if the parent dies.
//
// Hazards
//   - Unlike Python's multiprocessing.Lock (a semaphore), a Lock can only be released by the
//     thread that acquired it, and acquiring a Lock the calling thread already holds throws
//     kFailedPrecondition ("use RLock") instead of deadlocking. acquire(false) in that case
//     returns false, and acquire(true, timeout) returns false when the timeout ends, as in
//     Python.
//   - Like any condition variable, Condition::wait() may return true without a matching notify()
//     (another waiter's notification can wake it too); check the state you wait for, or use
//     wait_for() with a predicate.
//   - A Barrier's action cannot cross processes: a handle decoded from a Message has no action.
//     The action runs in the process whose wait() completes the barrier, so when every party
//     must see it run, create the barrier before forking, or run the action yourself.
//   - A process that dies while waiting on a Barrier never arrives; the other parties block until
//     their timeout, which breaks the barrier. Give Barrier waits a timeout.
#ifndef FORKSAFE_MP_SYNCHRONIZE_H_
#define FORKSAFE_MP_SYNCHRONIZE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/internal/shared_segment.h"
#include "forksafe/mp/internal/shm_sync.h"
#include "forksafe/mp/timeout.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {

class Lock;
class RLock;
class Condition;

// ---------------------------------------------------------------------------------------------
// NOT FOR USERS: the layout of the shared segments and the machinery shared by the classes
// below. It is in this header only because the codec's templates need complete types.
namespace internal {

/// Tags written first in every shared segment, checked when a handle is decoded, so that a
/// message holding one kind of object cannot be decoded as another.
enum SharedKind : uint32_t {
  kLockKind = 0x4B434F4C,       // "LOCK"
  kRLockKind = 0x4B434C52,      // "RLCK"
  kSemaphoreKind = 0x414D4553,  // "SEMA"
  kConditionKind = 0x444E4F43,  // "COND"
  kEventKind = 0x544E5645,      // "EVNT"
  kBarrierKind = 0x52524142,    // "BARR"
};

/// Throws Error(kInvalidArgument) saying that a decoded segment is not a `expected`.
[[noreturn]] void ThrowWrongKind(const char* expected);

/// The shared state of a Lock or RLock. Always at offset 0 of its segment (a Value or Array
/// segment starts with one too, so that its lock can be sent on its own).
struct LockState {
  uint32_t kind;               ///< kLockKind or kRLockKind.
  std::atomic<int32_t> owner;  ///< Thread id (gettid) of the holder; 0 when free.
  std::atomic<int32_t> depth;  ///< Recursion depth of the holder (1 for a Lock).
  RobustMutex mu;
};

/// What Lock and RLock share: a handle to a LockState plus this process's owner-died flag.
class LockCore {
 public:
  LockCore() = default;
  /// A new lock in its own segment.
  static LockCore Create(bool recursive);
  /// Constructs a LockState in place (used by Create and by Value/Array segments).
  static void InitState(LockState* state, bool recursive);
  /// A handle to the LockState at offset 0 of `segment`, which must hold a valid one (checked).
  static LockCore Adopt(std::shared_ptr<SharedSegment> segment);

  bool Acquire(bool block, Timeout timeout, const char* what) const;
  void Release(const char* what) const;
  /// True when the calling thread holds the lock.
  bool HeldByCaller() const;
  bool recursive() const { return state()->kind == kRLockKind; }
  bool previous_owner_died() const { return owner_died_->load(std::memory_order_acquire); }
  LockState* state() const { return static_cast<LockState*>(segment_->data()); }

  /// For Condition::wait: gives the lock up entirely (all recursion levels but the one the
  /// wait releases) and returns the depth to restore.
  int BeginWait() const;
  /// Undoes BeginWait once the wait has re-locked the mutex.
  void EndWait(int depth, bool owner_died) const;

  template <class Archive>
  void save(Archive& ar) const {
    ar(*segment_);
  }
  template <class Archive>
  void load(Archive& ar) {
    auto segment = std::make_shared<SharedSegment>();
    ar(*segment);
    *this = Adopt(std::move(segment));
  }

 private:
  std::shared_ptr<SharedSegment> segment_;
  // Per process (each decoded handle gets its own; copies share it).
  std::shared_ptr<std::atomic<bool>> owner_died_;
};

/// Builds lock handles around existing state (for Value/Array and Condition).
struct LockAccess {
  static Lock MakeLock(LockCore core);
  static const LockCore& CoreOf(const Lock& lock);
  static const LockCore& CoreOf(const RLock& lock);
};

struct SemaphoreState {
  uint32_t kind;               ///< kSemaphoreKind.
  int32_t bounded;             ///< 1 for a BoundedSemaphore.
  int64_t initial;             ///< The bound of a BoundedSemaphore.
  std::atomic<int64_t> value;  ///< Written under mu; read lock-free by get_value().
  RobustMutex mu;
  SharedCond cond;
};

struct ConditionState {
  uint32_t kind;  ///< kConditionKind. The mutex is the Lock's.
  SharedCond cond;
};

struct EventState {
  uint32_t kind;  ///< kEventKind.
  std::atomic<int32_t> flag;
  RobustMutex mu;
  SharedCond cond;
};

struct BarrierState {
  uint32_t kind;  ///< kBarrierKind.
  int32_t parties;
  int32_t has_default_timeout;
  double default_timeout_s;
  RobustMutex mu;
  SharedCond cond;
  // All below are written under mu.
  int32_t count;           ///< Parties arrived in the current cycle.
  int32_t action_running;  ///< The completing party is running the action, mutex released.
  std::atomic<int32_t> broken;
  uint64_t generation;  ///< Bumped whenever a cycle ends, completed or not.
  uint64_t completed;   ///< The last generation that completed (all parties arrived).
};

}  // namespace internal
// ---------------------------------------------------------------------------------------------

/// A non-recursive lock shared between processes (multiprocessing.Lock).
///
/// Owned by the thread that acquired it. Usable with std::lock_guard and std::unique_lock.
/// When the owning process dies, the next acquire() succeeds and previous_owner_died() returns
/// true for it: the next owner learns it, and never hangs.
class Lock {
 public:
  /// A new, unlocked lock.
  Lock();
  /// Copies share the lock. There is no move: a "moved-from" handle is a copy, never empty.
  Lock(const Lock&) = default;
  Lock& operator=(const Lock&) = default;

  /// Acquires the lock. With block=false, returns at once (false when it is held). Otherwise
  /// waits at most `timeout` (forever when absent) and returns false if it ran out.
  /// Throws kInvalidArgument for a negative timeout and kFailedPrecondition when this thread
  /// already holds the lock and block is true.
  bool acquire(bool block = true, Timeout timeout = std::nullopt);
  /// Releases the lock. Throws kFailedPrecondition when the calling thread does not hold it.
  void release();

  /// True when the last successful acquire in this process took the lock over from a process
  /// (or thread) that died holding it; the data it guards may be inconsistent.
  bool previous_owner_died() const;

  /// std::lock_guard / std::unique_lock support: acquire(), acquire(false), release().
  void lock() { acquire(); }
  bool try_lock() { return acquire(false); }
  void unlock() { release(); }

  /// codec: the lock's memfd travels out of band; the receiver shares this lock.
  template <class Archive>
  void save(Archive& ar) const {
    ar(core_);
  }
  template <class Archive>
  void load(Archive& ar) {
    internal::LockCore core;
    ar(core);
    if (core.recursive()) internal::ThrowWrongKind("Lock (it holds an RLock)");
    core_ = std::move(core);
  }

 private:
  friend struct internal::LockAccess;
  explicit Lock(internal::LockCore core) : core_(std::move(core)) {}
  internal::LockCore core_;
};

/// A recursive lock shared between processes (multiprocessing.RLock): the owning thread may
/// acquire it again, and must release it as many times. Same API and guarantees as Lock.
class RLock {
 public:
  /// A new, unlocked recursive lock.
  RLock();
  RLock(const RLock&) = default;
  RLock& operator=(const RLock&) = default;

  /// Acquires the lock (again, when this thread holds it). See Lock::acquire.
  bool acquire(bool block = true, Timeout timeout = std::nullopt);
  /// Releases one level. Throws kFailedPrecondition when the calling thread does not hold it.
  void release();
  /// See Lock::previous_owner_died. On recovery the recursion depth restarts at 1.
  bool previous_owner_died() const;

  /// std::lock_guard / std::unique_lock support: acquire(), acquire(false), release().
  void lock() { acquire(); }
  bool try_lock() { return acquire(false); }
  void unlock() { release(); }

  /// codec: the memfd travels out of band; the receiver shares this lock (an RLock only).
  template <class Archive>
  void save(Archive& ar) const {
    ar(core_);
  }
  template <class Archive>
  void load(Archive& ar) {
    internal::LockCore core;
    ar(core);
    if (!core.recursive()) internal::ThrowWrongKind("RLock (it holds a Lock)");
    core_ = std::move(core);
  }

 private:
  friend struct internal::LockAccess;
  internal::LockCore core_;
};

/// A counting semaphore shared between processes (multiprocessing.Semaphore), built on a robust
/// mutex and a counter, never on sem_t: a process that dies mid-call cannot leave it wedged.
/// (A process that dies while holding a unit does not give it back, as with any semaphore.)
class Semaphore {
 public:
  /// A semaphore holding `value` units. Throws kInvalidArgument when value < 0.
  explicit Semaphore(int value = 1);
  Semaphore(const Semaphore&) = default;
  Semaphore& operator=(const Semaphore&) = default;

  /// Takes one unit. With block=false returns at once; otherwise waits at most `timeout`.
  /// Returns false when no unit could be taken. Negative timeout: kInvalidArgument.
  bool acquire(bool block = true, Timeout timeout = std::nullopt);
  /// Gives back `n` (>= 1) units and wakes up to `n` waiters. Throws kInvalidArgument for
  /// n < 1 or an overflow, and (BoundedSemaphore) kFailedPrecondition above the initial value.
  void release(int n = 1);
  /// The number of units available now (a snapshot).
  int get_value() const;

  /// std::lock_guard / std::unique_lock support: acquire(), acquire(false), release().
  void lock() { acquire(); }
  bool try_lock() { return acquire(false); }
  void unlock() { release(); }

  /// codec: the memfd travels out of band; the receiver shares this semaphore.
  template <class Archive>
  void save(Archive& ar) const {
    ar(state_);
  }
  template <class Archive>
  void load(Archive& ar) {
    internal::SharedObject<internal::SemaphoreState> state;
    ar(state);
    if (state->kind != internal::kSemaphoreKind) internal::ThrowWrongKind("Semaphore");
    state_ = std::move(state);
  }

 protected:
  Semaphore(int value, bool bounded);
  internal::SharedObject<internal::SemaphoreState> state_;
};

/// A Semaphore whose value may never exceed its initial value
/// (multiprocessing.BoundedSemaphore): release() beyond it throws kFailedPrecondition.
class BoundedSemaphore : public Semaphore {
 public:
  /// A bounded semaphore holding (and capped at) `value` units. value < 0: kInvalidArgument.
  explicit BoundedSemaphore(int value = 1);

  /// codec: decodes only a BoundedSemaphore; save() is Semaphore's.
  template <class Archive>
  void load(Archive& ar) {
    internal::SharedObject<internal::SemaphoreState> state;
    ar(state);
    if (state->kind != internal::kSemaphoreKind || !state->bounded) {
      internal::ThrowWrongKind("BoundedSemaphore");
    }
    state_ = std::move(state);
  }
  using Semaphore::save;
};

/// A condition variable shared between processes (multiprocessing.Condition). It waits on the
/// very mutex of the Lock or RLock it is given, so code holding that lock elsewhere is
/// serialized with it. With an RLock, wait() releases every recursion level and restores them.
class Condition {
 public:
  /// A condition over `lock` (a new Lock by default).
  explicit Condition(Lock lock = Lock());
  /// A condition over a recursive lock.
  explicit Condition(RLock lock);
  Condition(const Condition&) = default;
  Condition& operator=(const Condition&) = default;

  /// Acquires the underlying lock (see Lock::acquire).
  bool acquire(bool block = true, Timeout timeout = std::nullopt);
  /// Releases the underlying lock; kFailedPrecondition when this thread does not hold it.
  void release();
  /// std::lock_guard / std::unique_lock support (on the underlying lock).
  void lock() { acquire(); }
  bool try_lock() { return acquire(false); }
  void unlock() { release(); }

  /// Releases the lock, waits for a notify (at most `timeout`), re-acquires the lock, and returns
  /// false when the timeout ran out. The lock must be held: kFailedPrecondition otherwise.
  /// May return true spuriously (see Hazards).
  bool wait(Timeout timeout = std::nullopt);
  /// Waits until `predicate()` is true or `timeout` runs out, checking it under the lock first;
  /// returns the last value of the predicate. The lock must be held.
  template <class Predicate>
  bool wait_for(Predicate predicate, Timeout timeout = std::nullopt);
  /// Wakes up to `n` (>= 0) waiters. The lock must be held: kFailedPrecondition otherwise.
  void notify(int n = 1);
  /// Wakes every waiter. The lock must be held.
  void notify_all();

  /// codec: the lock and the condition travel together; the receiver shares both.
  template <class Archive>
  void save(Archive& ar) const {
    ar(lock_, state_);
  }
  template <class Archive>
  void load(Archive& ar) {
    internal::LockCore lock;
    internal::SharedObject<internal::ConditionState> state;
    ar(lock, state);
    if (state->kind != internal::kConditionKind) internal::ThrowWrongKind("Condition");
    lock_ = std::move(lock);
    state_ = std::move(state);
  }

 private:
  void RequireHeld(const char* what) const;
  internal::LockCore lock_;
  internal::SharedObject<internal::ConditionState> state_;
};

/// A flag that processes can wait for (multiprocessing.Event).
class Event {
 public:
  /// A new, cleared event.
  Event();
  Event(const Event&) = default;
  Event& operator=(const Event&) = default;

  /// True when the flag is set.
  bool is_set() const;
  /// Sets the flag and wakes every waiter.
  void set();
  /// Clears the flag.
  void clear();
  /// Waits until the flag is set, at most `timeout`; returns the flag (false on timeout).
  bool wait(Timeout timeout = std::nullopt);

  /// codec: the memfd travels out of band; the receiver shares this event.
  template <class Archive>
  void save(Archive& ar) const {
    ar(state_);
  }
  template <class Archive>
  void load(Archive& ar) {
    internal::SharedObject<internal::EventState> state;
    ar(state);
    if (state->kind != internal::kEventKind) internal::ThrowWrongKind("Event");
    state_ = std::move(state);
  }

 private:
  internal::SharedObject<internal::EventState> state_;
};

/// A reusable barrier for a fixed number of processes (multiprocessing.Barrier).
///
/// Each cycle, wait() blocks until `parties` callers have arrived, then releases them all and
/// starts the next cycle (a generation counter tells the cycles apart). The barrier *breaks*
/// when a waiter's timeout runs out, when abort() is called, when the action throws, or when a
/// process dies inside its internal critical section. Then:
///   - the waiter whose own timeout ran out throws Error(kDeadlineExceeded);
///   - every other waiter of that cycle, and every later wait(), throws
///     Error(kFailedPrecondition, "barrier is broken ...") until reset();
///   - the party that ran a throwing action gets the action's exception.
/// reset() repairs it; parties still waiting in the cycle it ends throw kFailedPrecondition.
class Barrier {
 public:
  /// A barrier for `parties` (>= 1) processes. `action`, if given, runs once per cycle in the
  /// process that arrives last, before anyone is released. `timeout` is the default for wait().
  /// Throws kInvalidArgument for parties < 1 or a negative timeout.
  explicit Barrier(int parties, std::function<void()> action = nullptr,
                   Timeout timeout = std::nullopt);
  Barrier(const Barrier&) = default;
  Barrier& operator=(const Barrier&) = default;

  /// Waits for the other parties, at most `timeout` (the barrier's default when absent).
  /// Returns this caller's arrival index in the cycle: unique, in [0, parties). Throws as
  /// described above.
  int wait(Timeout timeout = std::nullopt);
  /// Returns the barrier to its empty, unbroken state; current waiters throw kFailedPrecondition.
  void reset();
  /// Breaks the barrier: current and future waiters throw kFailedPrecondition until reset().
  void abort();
  /// Sets the action this handle runs when its process arrives last (nullptr: none). Actions
  /// are per process and do not travel: a decoded Barrier has none until it is given one.
  void set_action(std::function<void()> action) { action_ = std::move(action); }
  /// The number of parties needed to complete a cycle.
  int parties() const;
  /// The number of parties waiting in the current cycle.
  int n_waiting() const;
  /// True when the barrier is broken.
  bool broken() const;

  /// codec: the action does not travel (see Hazards); the decoded handle has none.
  template <class Archive>
  void save(Archive& ar) const {
    ar(state_);
  }
  template <class Archive>
  void load(Archive& ar) {
    internal::SharedObject<internal::BarrierState> state;
    ar(state);
    if (state->kind != internal::kBarrierKind || state->parties < 1) {
      internal::ThrowWrongKind("Barrier");
    }
    state_ = std::move(state);
    action_ = nullptr;
  }

 private:
  internal::SharedObject<internal::BarrierState> state_;
  std::function<void()> action_;
};

// ---------------------------------------------------------------------------------------------
// Implementation details.

template <class Predicate>
bool Condition::wait_for(Predicate predicate, Timeout timeout) {
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, "Condition.wait_for");
  RequireHeld("Condition.wait_for");
  bool result = predicate();
  while (!result) {
    Timeout remaining;
    if (deadline.has_value()) {
      const auto left = *deadline - internal::Clock::now();
      if (left <= internal::Clock::duration::zero()) break;
      remaining = std::chrono::duration<double>(left);
    }
    wait(remaining);
    result = predicate();
  }
  return result;
}

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_SYNCHRONIZE_H_
