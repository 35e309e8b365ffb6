#include "runtime/tbb_fork.h"

#include <atomic>
#include <mutex>

#include "oneapi/tbb/global_control.h"
#include "runtime/at_fork.h"

namespace forksafe::runtime {
namespace {

struct TbbForkState {
  tbb::task_scheduler_handle handle;  // attached between forks
  std::atomic<bool> usable{true};
  std::atomic<uint64_t> finalized{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> gave_up{0};
};

TbbForkState& StateRef() {
  static auto* state = new TbbForkState();  // leaked: used by at-fork handlers
  return *state;
}

bool Prepare(const PrepareAttempt& attempt) {
  TbbForkState& st = StateRef();
  // A process whose oneTBB was left inconsistent by an earlier fork must not touch it again;
  // its children inherit the "unusable" flag.
  if (!st.usable.load()) return true;
  if (!st.handle) st.handle = tbb::task_scheduler_handle(tbb::attach{});
  if (tbb::finalize(st.handle, std::nothrow)) {
    st.finalized.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
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
    StateRef();
    AtForkHandler h;
    h.name = "onetbb";
    h.prepare = Prepare;
    // No re-attach after the fork: the handle is attached again at the next prepare. Attaching
    // right after the fork would allocate, and every page written after a fork is a
    // copy-on-write fault in the parent and in the child (see docs/performance.md).
    h.child = [](bool prepared) {
      // When prepare gave up, the scheduler's threads are gone; oneTBB's state cannot be trusted.
      if (!prepared) StateRef().usable.store(false);
    };
    static int tag;
    AtForkRegistry::Get().Register(&tag, std::move(h));
  });
}

bool TbbUsableInThisProcess() { return StateRef().usable.load(); }

TbbForkStats GetTbbForkStats() {
  TbbForkState& st = StateRef();
  return TbbForkStats{st.finalized.load(), st.refused.load(), st.gave_up.load()};
}

// Installed at load time too, so that programs using oneTBB without any ThreadPool are covered.
namespace {
const bool g_installed = (InstallTbbForkHandler(), true);
}  // namespace

}  // namespace forksafe::runtime
