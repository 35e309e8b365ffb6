#include "forksafe/runtime/tbb_fork.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <new>
#include <thread>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/internal/thread_count.h"
#include "forksafe/runtime/openmp_fork.h"
#include "oneapi/tbb/global_control.h"
#include "oneapi/tbb/task_arena.h"

namespace forksafe::runtime {
namespace {

struct TbbForkState {
  // Guards `handle` against ReleaseTbbScheduler. Prepare takes it and keeps it across the fork
  // (released in parent and child, or before prepare returns false), so that no thread can hold
  // it when the child is made.
  internal::Mutex mu;
  // A lifetime handle, held at all times except for a moment inside prepare (see HoldScheduler).
  tbb::task_scheduler_handle handle FORKSAFE_GUARDED_BY(mu);
  std::atomic<bool> usable{true};
  // Whether the last successful prepare left `mu` locked (false: it returned early, alone). Only
  // the forking thread touches it, under the registry's lock.
  bool took_lock = false;
  std::atomic<uint64_t> finalized{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> gave_up{0};
};

TbbForkState& StateRef() {
  static auto* state = new TbbForkState();  // leaked: used by at-fork handlers
  return *state;
}

// Why forksafe holds a task_scheduler_handle between forks, not only during prepare.
// oneTBB joins its worker threads only when the last reference to its scheduler is dropped by a
// blocking finalize. When the last reference goes away otherwise (a thread that ran a oneTBB
// algorithm exits, for example a pool worker that the pool's drain ends just before oneTBB's
// prepare), oneTBB shuts its workers down *detached*: they exit on their own a moment later, and
// on the way out they return their caches to tbbmalloc under tbbmalloc's locks. A fork in that
// moment handed the child a held tbbmalloc lock, and its first parallel algorithm spun forever in
// scalable_aligned_malloc (tests/soak/fork_soak_test, about 1 fork in 40,000). Holding a handle
// keeps a reference that only our blocking finalize drops, so every worker is joined before the
// fork. Measured with bench/onetbb_worker_linger (docs/reliability.md): a oneTBB thread was still
// running 200 us after finalize returned in 18 of 6,000 forks when the handle was attached only
// in prepare, in 0 of 6,000 with the handle held. Never throws (at-fork handlers must not).
void HoldScheduler(TbbForkState& st) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu) {
  if (st.handle) return;
  try {
    st.handle = tbb::task_scheduler_handle(tbb::attach{});
  } catch (...) {
    // Out of memory: the next prepare tries again and waits for stray workers (below).
  }
}

// Only when prepare found no handle held (the program called ReleaseTbbScheduler, or attaching
// failed): oneTBB may have shut workers down detached in the meantime. Wait until the number of
// threads has been still for 0.3 ms, at most 20 ms.
void LetDetachedWorkersFinish() {
  int last = internal::ListedThreads();
  if (last < 0) return;
  const auto limit = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  int still = 0;
  while (still < 3 && std::chrono::steady_clock::now() < limit) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    const int now = internal::ListedThreads();
    still = now == last ? still + 1 : 0;
    last = now;
  }
}

// With st.mu held: finalizes oneTBB (joining its workers) and holds the scheduler again; true
// when the workers were joined.
bool FinalizeScheduler(TbbForkState& st) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(st.mu) {
  const bool was_held = static_cast<bool>(st.handle);
  HoldScheduler(st);
  const bool joined = tbb::finalize(st.handle, std::nothrow);  // releases the handle either way
  // Hold the scheduler again at once: after a success, so that parent and child both start with
  // it held (attaching here, before the kernel's fork, writes no page that the child shares; an
  // attach after the fork would cost a copy-on-write fault or two in each process); after a
  // refusal, so that the thread finalize waited for cannot drop the last reference meanwhile.
  HoldScheduler(st);
  if (!joined) return false;
  st.finalized.fetch_add(1, std::memory_order_relaxed);
  if (!was_held) LetDetachedWorkersFinish();
  return true;
}

// Not analysed: on true it returns holding st.mu, which the parent or child handler releases
// (held across the fork, on this thread); the analysis sees one function at a time.
bool Prepare(const PrepareAttempt& attempt) FORKSAFE_NO_THREAD_SAFETY_ANALYSIS {
  TbbForkState& st = StateRef();
  // A process whose oneTBB was left inconsistent by an earlier fork must not touch it again;
  // its children inherit the "unusable" flag.
  if (!st.usable.load()) return true;
  // The forking thread is the process's only thread and has not entered oneTBB since the last
  // finalize: oneTBB has no worker to join, no thread is inside oneTBB or ReleaseTbbScheduler,
  // and the fork does not come from inside a oneTBB task, so there is nothing to finalize or
  // lock. Finalizing and attaching again would write half a dozen pages (oneTBB's and
  // tbbmalloc's), each a copy-on-write fault per fork (tbb_fork.h, "Skipped when idle"). Only
  // while the handle is held: after ReleaseTbbScheduler the next fork holds it again, as always.
  // Reading it without st.mu is safe here: no other thread exists.
  if (attempt.alone && st.handle &&
      tbb::this_task_arena::current_thread_index() == tbb::task_arena::not_initialized) {
    if (st.took_lock) st.took_lock = false;  // written on a change only (a page per write)
    return true;
  }
  // Unlocked in the parent and child handlers, or below when returning false. Held elsewhere
  // only for an instant (ReleaseTbbScheduler), but a prepare never waits without bound.
  if (!LockForFork(st.mu, attempt)) {
    if (attempt.last) {
      AtForkRegistry::ReportEvent(ForkEventKind::kSubsystemUnusable, "onetbb",
                                  "oneTBB's fork lock was held by another thread until the "
                                  "deadline; the child must not use oneTBB");
    }
    return false;
  }
  if (FinalizeScheduler(st)) {
    if (!st.took_lock) st.took_lock = true;
    return true;  // st.mu stays held until parent/child
  }
  st.mu.Unlock();
  st.refused.fetch_add(1, std::memory_order_relaxed);
  if (!attempt.last) return false;
  st.gave_up.fetch_add(1, std::memory_order_relaxed);
  AtForkRegistry::ReportEvent(
      ForkEventKind::kSubsystemUnusable, "onetbb",
      "oneTBB's worker threads could not be joined (a parallel algorithm was still running, or "
      "the fork came from inside a oneTBB task); the child must not use oneTBB");
  return false;
}

}  // namespace

void InstallTbbForkHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Registered before oneTBB's handler, so prepared after it (runtime/openmp_fork.h).
    InstallOpenMpForkHandler();
    // The process has one oneTBB (the shared libtbb.so.12) and one handler for it: a copy of
    // forksafe nested in another's registry leaves it to the primary's, since a second lifetime
    // handle would make every finalize refuse (runtime/at_fork.h, "One registry per process").
    if (AtForkRegistry::Get().IsNested()) return;
    // Held from load time on, before any thread can run a oneTBB algorithm (see HoldScheduler).
    {
      TbbForkState& st = StateRef();
      internal::MutexLock lk(&st.mu);
      HoldScheduler(st);
    }
    AtForkHandler h;
    h.name = "onetbb";
    h.prepare = Prepare;
    // Prepare left the scheduler held, for both processes; only its lock is left to release.
    // `prepared` is false when prepare gave up (it released the lock itself) and also in a
    // process where oneTBB is unusable (prepare took nothing).
    // After a prepare that returned early (the forking thread was alone) nothing is released.
    h.parent = [](bool prepared) {
      TbbForkState& st = StateRef();
      if (prepared && st.usable.load() && st.took_lock) {
        st.mu.AssertHeld();  // this thread took it in prepare
        st.mu.Unlock();
      }
    };
    h.child = [](bool prepared) {
      TbbForkState& st = StateRef();
      // When prepare gave up, the scheduler's threads are gone; oneTBB's state cannot be trusted.
      if (!prepared) {
        st.usable.store(false);
        // If the lock was what could not be had, its holder does not exist here: rebuild it
        // unlocked, so that ReleaseTbbScheduler() in this child does not wait for ever.
        st.mu.ResetAfterFork();
        return;
      }
      if (st.usable.load() && st.took_lock) {
        st.mu.AssertHeld();  // this thread locked it in prepare
        st.mu.Unlock();
      }
    };
    static int tag;
    AtForkRegistry::Get().Register(&tag, std::move(h));
  });
}

void ReleaseTbbScheduler() {
  TbbForkState& st = StateRef();
  internal::MutexLock lk(&st.mu);
  if (st.handle) st.handle.release();
}

bool TbbUsableInThisProcess() { return StateRef().usable.load(); }

bool ThreadHoldsTbbState() {
  return TbbUsableInThisProcess() && tbb::this_task_arena::current_thread_index() >= 0;
}

// tbb::finalize ends the calling thread's state before it checks for other references; those
// remain (forksafe's own handle, at least), so it returns false at once and never waits.
void ReleaseTbbThreadState() {
  if (!ThreadHoldsTbbState()) return;
  try {
    tbb::task_scheduler_handle handle(tbb::attach{});
    (void)tbb::finalize(handle, std::nothrow);
  } catch (...) {
    // Out of memory for the handle: the state stays, and a fork's finalize of oneTBB refuses
    // (the registry retries).
  }
}

TbbForkStats GetTbbForkStats() {
  TbbForkState& st = StateRef();
  return TbbForkStats{st.finalized.load(), st.refused.load(), st.gave_up.load()};
}

// Installed at load time too, so that programs using oneTBB without any ThreadPool are covered.
namespace {
const bool g_installed = (InstallTbbForkHandler(), true);
}  // namespace

}  // namespace forksafe::runtime
