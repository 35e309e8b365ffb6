#include "forksafe/mp/synchronize.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <ctime>
#include <new>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace forksafe::mp {
namespace internal {
namespace {

using runtime::Error;
using runtime::ErrorCode;

int32_t CurrentThreadId() { return static_cast<int32_t>(gettid()); }

// Locks one of the objects' own (internal) mutexes for a scope. Those are held only for a few
// stores, so a dead holder is the only way to find them inconsistent; owner_died() reports it.
class StateGuard {
 public:
  StateGuard(RobustMutex& mu, Deadline deadline) : mu_(mu) {
    const LockResult r = mu_.Lock(deadline);
    held_ = r != LockResult::kTimedOut;
    owner_died_ = r == LockResult::kOwnerDied;
  }
  ~StateGuard() {
    if (!held_) return;
    try {
      mu_.Unlock();
    } catch (...) {
      // Unlock only fails when the mutex was corrupted; nothing sensible to do in a destructor.
    }
  }
  StateGuard(const StateGuard&) = delete;
  StateGuard& operator=(const StateGuard&) = delete;

  bool held() const { return held_; }
  bool owner_died() const { return owner_died_; }
  /// Lets go for a while (the barrier's action runs unlocked) ...
  void Unlock() {
    held_ = false;
    mu_.Unlock();
  }
  /// ... and takes it back. Returns true when the mutex was recovered from a dead owner.
  bool Relock() {
    const bool died = mu_.Lock() == LockResult::kOwnerDied;
    held_ = true;
    return died;
  }

 private:
  RobustMutex& mu_;
  bool held_ = false;
  bool owner_died_ = false;
};

// The state behind a handle. Handles are never empty (they have no move), so this only throws
// for a handle that was never constructed properly; the check also tells the compiler so.
template <class State>
State* Get(const SharedObject<State>& object) {
  State* state = object.get();
  if (state == nullptr) {
    throw Error(ErrorCode::kFailedPrecondition,
                "use of an empty synchronization handle; construct or decode it first");
  }
  return state;
}

// Shared objects are created in fresh zero-filled segments: construct the state in place.
template <class State>
SharedObject<State> CreateState(const char* name, uint32_t kind) {
  return SharedObject<State>::Create(name, [kind](State* s) {
    new (s) State();
    s->kind = kind;
  });
}

}  // namespace

void ThrowWrongKind(const char* expected) {
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat("malformed message: the shared segment it carries does not hold a ",
                           expected, "; decode a message into the type that was encoded"));
}

// ---- SharedCond ------------------------------------------------------------------------------

// ---- LockCore -------------------------------------------------------------------------------

void LockCore::InitState(LockState* state, bool recursive) {
  new (state) LockState();
  state->kind = recursive ? kRLockKind : kLockKind;
  state->owner.store(0, std::memory_order_relaxed);
  state->depth.store(0, std::memory_order_relaxed);
  state->mu.Init(recursive);
}

// Whether thread `tid` is a live thread of this process.
bool IsThreadOfThisProcess(int32_t tid) {
  return tid > 0 && syscall(SYS_tgkill, getpid(), tid, 0) == 0;
}

// The lock's segment as its LockCore copies share it. When the last of them goes while a thread
// of this process holds the lock (a Python program's `del lock` inside `with lock:`, a handle
// dropped before release()), the pages stay mapped: the holder's robust-futex list still links
// through the mutex in them, and the next robust mutex that thread locks or unlocks would write
// into the unmapped page (a crash far from the cause). Other processes holding the lock keep it
// held, as with multiprocessing's Lock. The leak is one page per such lock.
std::shared_ptr<SharedSegment> GuardAgainstUnmapWhileHeld(std::shared_ptr<SharedSegment> segment) {
  SharedSegment* raw = segment.get();
  return std::shared_ptr<SharedSegment>(raw, [segment =
                                                  std::move(segment)](SharedSegment* p) mutable {
    const auto* state = static_cast<const LockState*>(p->data());
    if (state != nullptr && IsThreadOfThisProcess(state->owner.load(std::memory_order_acquire))) {
      p->NeverUnmap();
    }
    segment.reset();
  });
}

LockCore LockCore::Create(bool recursive) {
  auto segment = std::make_shared<SharedSegment>(
      SharedSegment::Create(sizeof(LockState), recursive ? "rlock" : "lock"));
  InitState(static_cast<LockState*>(segment->data()), recursive);
  LockCore core;
  core.segment_ = GuardAgainstUnmapWhileHeld(std::move(segment));
  core.owner_died_ = std::make_shared<std::atomic<bool>>(false);
  return core;
}

LockCore LockCore::Adopt(std::shared_ptr<SharedSegment> segment) {
  if (!segment || segment->size() < sizeof(LockState)) {
    throw Error(ErrorCode::kInvalidArgument,
                "malformed message: the shared segment is too small to hold a lock");
  }
  const uint32_t kind = static_cast<const LockState*>(segment->data())->kind;
  if (kind != kLockKind && kind != kRLockKind) ThrowWrongKind("Lock or RLock");
  LockCore core;
  core.segment_ = GuardAgainstUnmapWhileHeld(std::move(segment));
  core.owner_died_ = std::make_shared<std::atomic<bool>>(false);
  return core;
}

bool LockCore::HeldByCaller() const {
  return state()->owner.load(std::memory_order_acquire) == CurrentThreadId();
}

bool LockCore::Acquire(bool block, Timeout timeout, const char* what) const {
  const Deadline deadline = DeadlineAfter(timeout, what);
  LockState* s = state();
  if (block && deadline.has_value() && s->kind == kLockKind &&
      s->owner.load(std::memory_order_acquire) == CurrentThreadId()) {
    // The caller holds this Lock: nobody else can release it (only its holder may), so a timed
    // acquire ends at its deadline, false, as Python's does; an untimed one is the mutex's
    // kFailedPrecondition below, not a deadlock.
    std::this_thread::sleep_until(*deadline);
    return false;
  }
  const LockResult r = block ? s->mu.Lock(deadline) : s->mu.TryLock();
  if (r == LockResult::kTimedOut) return false;
  const int32_t me = CurrentThreadId();
  // Only this thread can have stored its own id, so owner == me means a recursive acquire
  // (for a Lock, the mutex itself refuses that). After a recovery the old depth is void.
  if (r == LockResult::kOwnerDied || s->owner.load(std::memory_order_relaxed) != me) {
    s->depth.store(1, std::memory_order_relaxed);
    s->owner.store(me, std::memory_order_release);
  } else {
    s->depth.fetch_add(1, std::memory_order_relaxed);
  }
  owner_died_->store(r == LockResult::kOwnerDied, std::memory_order_release);
  return true;
}

void LockCore::Release(const char* what) const {
  LockState* s = state();
  if (!HeldByCaller()) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat(what,
                             ": the calling thread does not hold this lock; only the thread "
                             "that acquired it may release it, once per acquire"));
  }
  // Clear ownership before unlocking, so the next owner's stores cannot be overwritten.
  if (s->depth.fetch_sub(1, std::memory_order_relaxed) == 1) {
    s->owner.store(0, std::memory_order_release);
  }
  s->mu.Unlock();
}

int LockCore::BeginWait() const {
  LockState* s = state();
  const int depth = s->depth.load(std::memory_order_relaxed);
  s->depth.store(0, std::memory_order_relaxed);
  s->owner.store(0, std::memory_order_release);
  // A recursive pthread mutex would stay locked through a wait at depth > 1: drop the extra
  // levels first; the wait itself releases the last one.
  for (int i = 1; i < depth; ++i) s->mu.Unlock();
  return depth;
}

void LockCore::EndWait(int depth, bool owner_died) const {
  LockState* s = state();
  for (int i = 1; i < depth; ++i) s->mu.Lock();  // recursive and held: never blocks
  s->depth.store(depth, std::memory_order_relaxed);
  s->owner.store(CurrentThreadId(), std::memory_order_release);
  if (owner_died) owner_died_->store(true, std::memory_order_release);
}

Lock LockAccess::MakeLock(LockCore core) { return Lock(std::move(core)); }
const LockCore& LockAccess::CoreOf(const Lock& lock) { return lock.core_; }
const LockCore& LockAccess::CoreOf(const RLock& lock) { return lock.core_; }

}  // namespace internal

using internal::Deadline;
using internal::DeadlineAfter;
using internal::StateGuard;
using runtime::Error;
using runtime::ErrorCode;

// ---- Lock / RLock ---------------------------------------------------------------------------

Lock::Lock() : core_(internal::LockCore::Create(/*recursive=*/false)) {}

bool Lock::acquire(bool block, Timeout timeout) {
  return core_.Acquire(block, timeout, "Lock.acquire");
}
void Lock::release() { core_.Release("Lock.release"); }
bool Lock::previous_owner_died() const { return core_.previous_owner_died(); }

RLock::RLock() : core_(internal::LockCore::Create(/*recursive=*/true)) {}

bool RLock::acquire(bool block, Timeout timeout) {
  return core_.Acquire(block, timeout, "RLock.acquire");
}
void RLock::release() { core_.Release("RLock.release"); }
bool RLock::previous_owner_died() const { return core_.previous_owner_died(); }

// ---- Semaphore ------------------------------------------------------------------------------

Semaphore::Semaphore(int value) : Semaphore(value, /*bounded=*/false) {}

Semaphore::Semaphore(int value, bool bounded) {
  if (value < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat(bounded ? "BoundedSemaphore" : "Semaphore",
                             ": initial value must be >= 0, got ", value));
  }
  state_ = internal::CreateState<internal::SemaphoreState>(bounded ? "bsemaphore" : "semaphore",
                                                           internal::kSemaphoreKind);
  internal::SemaphoreState* s = internal::Get(state_);
  s->bounded = bounded ? 1 : 0;
  s->initial = value;
  s->value.store(value, std::memory_order_relaxed);
  s->mu.Init();
}

bool Semaphore::acquire(bool block, Timeout timeout) {
  const Deadline deadline = DeadlineAfter(timeout, "Semaphore.acquire");
  internal::SemaphoreState* s = internal::Get(state_);
  // The internal mutex is only held for a few stores: a non-blocking acquire may wait for it.
  StateGuard guard(s->mu, block ? deadline : std::nullopt);
  if (!guard.held()) return false;
  while (s->value.load(std::memory_order_relaxed) == 0) {
    if (!block) return false;
    if (!s->cond.Wait(s->mu, deadline)) {
      if (s->value.load(std::memory_order_relaxed) > 0) break;
      return false;
    }
  }
  s->value.fetch_sub(1, std::memory_order_relaxed);
  return true;
}

void Semaphore::release(int n) {
  internal::SemaphoreState* s = internal::Get(state_);
  const char* name = s->bounded ? "BoundedSemaphore.release" : "Semaphore.release";
  if (n < 1) {
    throw Error(ErrorCode::kInvalidArgument, absl::StrCat(name, ": n must be >= 1, got ", n));
  }
  StateGuard guard(s->mu, std::nullopt);
  const int64_t now = s->value.load(std::memory_order_relaxed);
  if (s->bounded && now + n > s->initial) {
    throw Error(
        ErrorCode::kFailedPrecondition,
        absl::StrCat(name, ": releasing ", n, " would raise the value to ", now + n,
                     ", above its initial value ", s->initial, "; release only what was acquired"));
  }
  if (now + n > INT_MAX) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat(name, ": releasing ", n, " would overflow the value ", now));
  }
  s->value.store(now + n, std::memory_order_relaxed);
  s->cond.Notify(n);
}

int Semaphore::get_value() const {
  return static_cast<int>(internal::Get(state_)->value.load(std::memory_order_acquire));
}

BoundedSemaphore::BoundedSemaphore(int value) : Semaphore(value, /*bounded=*/true) {}

// ---- Condition ------------------------------------------------------------------------------

namespace {
internal::SharedObject<internal::ConditionState> NewConditionState() {
  return internal::CreateState<internal::ConditionState>("condition", internal::kConditionKind);
}
}  // namespace

Condition::Condition(Lock lock)
    : lock_(internal::LockAccess::CoreOf(lock)), state_(NewConditionState()) {}

Condition::Condition(RLock lock)
    : lock_(internal::LockAccess::CoreOf(lock)), state_(NewConditionState()) {}

bool Condition::acquire(bool block, Timeout timeout) {
  return lock_.Acquire(block, timeout, "Condition.acquire");
}

void Condition::release() { lock_.Release("Condition.release"); }

void Condition::RequireHeld(const char* what) const {
  if (!lock_.HeldByCaller()) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat(what,
                             ": the calling thread must hold the condition's lock; "
                             "acquire() it first (or use std::unique_lock)"));
  }
}

bool Condition::wait(Timeout timeout) {
  const Deadline deadline = DeadlineAfter(timeout, "Condition.wait");
  RequireHeld("Condition.wait");
  const int depth = lock_.BeginWait();
  bool owner_died = false;
  bool notified = false;
  try {
    notified = internal::Get(state_)->cond.Wait(lock_.state()->mu, deadline, &owner_died);
  } catch (...) {
    lock_.EndWait(depth, owner_died);  // Wait re-locked the mutex before throwing
    throw;
  }
  lock_.EndWait(depth, owner_died);
  return notified;
}

void Condition::notify(int n) {
  if (n < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Condition.notify: n must be >= 0, got ", n));
  }
  RequireHeld("Condition.notify");
  internal::Get(state_)->cond.Notify(n);
}

void Condition::notify_all() {
  RequireHeld("Condition.notify_all");
  internal::Get(state_)->cond.NotifyAll();
}

// ---- Event ----------------------------------------------------------------------------------

Event::Event()
    : state_(internal::CreateState<internal::EventState>("event", internal::kEventKind)) {
  internal::EventState* s = internal::Get(state_);
  s->flag.store(0, std::memory_order_relaxed);
  s->mu.Init();
}

bool Event::is_set() const {
  return internal::Get(state_)->flag.load(std::memory_order_acquire) != 0;
}

void Event::set() {
  internal::EventState* s = internal::Get(state_);
  StateGuard guard(s->mu, std::nullopt);
  s->flag.store(1, std::memory_order_release);
  s->cond.NotifyAll();
}

void Event::clear() {
  internal::EventState* s = internal::Get(state_);
  StateGuard guard(s->mu, std::nullopt);
  s->flag.store(0, std::memory_order_release);
}

bool Event::wait(Timeout timeout) {
  const Deadline deadline = DeadlineAfter(timeout, "Event.wait");
  internal::EventState* s = internal::Get(state_);
  if (s->flag.load(std::memory_order_acquire) != 0) return true;
  StateGuard guard(s->mu, deadline);
  if (!guard.held()) return is_set();
  while (s->flag.load(std::memory_order_relaxed) == 0) {
    if (!s->cond.Wait(s->mu, deadline)) break;
  }
  return s->flag.load(std::memory_order_relaxed) != 0;
}

// ---- Barrier --------------------------------------------------------------------------------

namespace {

[[noreturn]] void ThrowBroken() {
  throw Error(ErrorCode::kFailedPrecondition,
              "Barrier.wait: barrier is broken (a waiter timed out, abort() was called, the action "
              "threw, or reset() ended the cycle); call reset() before using it again");
}

// Breaks the barrier; the caller holds the mutex. Ends the current cycle so its waiters leave.
void BreakLocked(internal::BarrierState* s) {
  s->broken.store(1, std::memory_order_release);
  if (s->count > 0) {
    ++s->generation;
    s->count = 0;
  }
  s->cond.NotifyAll();
}

}  // namespace

Barrier::Barrier(int parties, std::function<void()> action, Timeout timeout)
    : action_(std::move(action)) {
  if (parties < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Barrier: parties must be >= 1, got ", parties));
  }
  internal::CheckedWait(timeout, "Barrier: default timeout");  // NaN, < 0: kInvalidArgument
  state_ = internal::CreateState<internal::BarrierState>("barrier", internal::kBarrierKind);
  internal::BarrierState* s = internal::Get(state_);
  s->parties = parties;
  s->has_default_timeout = timeout.has_value() ? 1 : 0;
  s->default_timeout_s = timeout.has_value() ? timeout->count() : 0.0;
  s->count = 0;
  s->action_running = 0;
  s->broken.store(0, std::memory_order_relaxed);
  s->generation = 0;
  s->completed = UINT64_MAX;  // no cycle has completed yet
  s->mu.Init();
}

int Barrier::wait(Timeout timeout) {
  internal::BarrierState* s = internal::Get(state_);
  if (!timeout.has_value() && s->has_default_timeout) {
    timeout = std::chrono::duration<double>(s->default_timeout_s);
  }
  const Deadline deadline = DeadlineAfter(timeout, "Barrier.wait");
  StateGuard guard(s->mu, deadline);
  if (!guard.held()) {
    throw Error(ErrorCode::kDeadlineExceeded,
                "Barrier.wait: timed out before it could even enter the barrier");
  }
  bool owner_died = guard.owner_died();
  if (owner_died) BreakLocked(s);  // a process died mid-update: the counts cannot be trusted

  // The previous cycle's action may still be running (with the mutex released).
  while (s->action_running && !s->broken.load(std::memory_order_relaxed)) {
    if (!s->cond.Wait(s->mu, deadline, &owner_died) && s->action_running) {
      BreakLocked(s);
      throw Error(ErrorCode::kDeadlineExceeded,
                  "Barrier.wait: timed out waiting for the previous cycle's action to finish; "
                  "the barrier is now broken");
    }
    if (owner_died) BreakLocked(s);
  }
  if (s->broken.load(std::memory_order_relaxed)) ThrowBroken();

  const uint64_t generation = s->generation;
  const int index = s->count++;
  if (s->count == s->parties) {
    // Last to arrive: run the action (without the mutex, so it cannot stall the others'
    // timeouts), then release everybody.
    if (action_) {
      s->action_running = 1;
      guard.Unlock();
      try {
        action_();
      } catch (...) {
        guard.Relock();
        s->action_running = 0;
        BreakLocked(s);
        throw;
      }
      owner_died = guard.Relock();
      s->action_running = 0;
      if (owner_died) BreakLocked(s);
      if (s->generation != generation || s->broken.load(std::memory_order_relaxed)) {
        s->cond.NotifyAll();  // wake arrivals that waited for the action
        ThrowBroken();
      }
    }
    s->completed = generation;
    s->generation = generation + 1;
    s->count = 0;
    s->cond.NotifyAll();
    return index;
  }

  while (s->generation == generation && !s->broken.load(std::memory_order_relaxed)) {
    const bool notified = s->cond.Wait(s->mu, deadline, &owner_died);
    if (owner_died) {
      BreakLocked(s);
      break;
    }
    if (!notified && s->generation == generation && !s->broken.load(std::memory_order_relaxed)) {
      BreakLocked(s);
      throw Error(ErrorCode::kDeadlineExceeded,
                  absl::StrCat("Barrier.wait: timed out with ", index + 1, " of ", s->parties,
                               " parties arrived; the barrier is now broken (reset() repairs it)"));
    }
  }
  if (s->completed == generation) return index;  // the cycle completed, even if broken since
  ThrowBroken();
}

void Barrier::reset() {
  internal::BarrierState* s = internal::Get(state_);
  StateGuard guard(s->mu, std::nullopt);
  if (s->count > 0) {  // waiters of the cycle being cut short leave with "broken"
    ++s->generation;
    s->count = 0;
  }
  s->broken.store(0, std::memory_order_release);
  s->cond.NotifyAll();
}

void Barrier::abort() {
  internal::BarrierState* s = internal::Get(state_);
  StateGuard guard(s->mu, std::nullopt);
  BreakLocked(s);
}

int Barrier::parties() const { return internal::Get(state_)->parties; }

int Barrier::n_waiting() const {
  internal::BarrierState* s = internal::Get(state_);
  StateGuard guard(s->mu, std::nullopt);
  // While the last party runs the action it is not waiting (and reset() may have zeroed count).
  return std::max(0, s->count - (s->action_running ? 1 : 0));
}

bool Barrier::broken() const {
  return internal::Get(state_)->broken.load(std::memory_order_acquire) != 0;
}

}  // namespace forksafe::mp
