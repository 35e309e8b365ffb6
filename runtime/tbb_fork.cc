#include "runtime/tbb_fork.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

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

// Threads of this process: entries of /proc/self/task, read with getdents64 into a stack buffer
// (no allocation). -1 when /proc cannot be read.
int ThreadCount() {
  const int fd = open("/proc/self/task", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  alignas(8) char buf[4096];
  int n = 0;
  for (;;) {
    const long got = syscall(SYS_getdents64, fd, buf, sizeof buf);
    if (got <= 0) break;
    for (long off = 0; off < got;) {
      const auto* len = reinterpret_cast<const unsigned short*>(buf + off + 16);  // d_reclen
      const char* name = buf + off + 19;                                           // d_name
      if (name[0] != '.') ++n;
      off += *len;
    }
  }
  close(fd);
  return n;
}

// finalize() joins the workers that were running, but a worker that was still starting (or
// leaving) when it was called exits on its own a moment later, and on its way out it returns its
// caches to tbbmalloc under tbbmalloc's locks. A fork in that moment can hand the child a held
// tbbmalloc lock: its first parallel algorithm spins forever in scalable_aligned_malloc (seen
// with gdb in tests/soak/fork_soak_test). So when the number of threads changed across finalize
// (oneTBB had workers), wait until it has been still for 0.3 ms, at most 20 ms. This makes the
// hang rarer (runs of 1,000 forks that hung: 2 of 9 before, 3 of 131 with this wait) but does
// not remove it: the cause is not fully understood (docs/reliability.md). The two counts cost a
// fork about 10 us.
void LetExitingWorkersFinish(int before) {
  int last = ThreadCount();
  if (before < 0 || last < 0 || last == before) return;
  const auto limit = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  int still = 0;
  while (still < 3 && std::chrono::steady_clock::now() < limit) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    const int now = ThreadCount();
    still = now == last ? still + 1 : 0;
    last = now;
  }
}

bool Prepare(const PrepareAttempt& attempt) {
  TbbForkState& st = StateRef();
  // A process whose oneTBB was left inconsistent by an earlier fork must not touch it again;
  // its children inherit the "unusable" flag.
  if (!st.usable.load()) return true;
  if (!st.handle) st.handle = tbb::task_scheduler_handle(tbb::attach{});
  const int threads_before = ThreadCount();
  if (tbb::finalize(st.handle, std::nothrow)) {
    st.finalized.fetch_add(1, std::memory_order_relaxed);
    LetExitingWorkersFinish(threads_before);
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
