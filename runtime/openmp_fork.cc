#include "forksafe/runtime/openmp_fork.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/internal/fork_registration.h"
#include "forksafe/runtime/internal/loaded_objects.h"
#include "forksafe/runtime/internal/openmp_fork_bypass.h"
#include "forksafe/runtime/internal/openmp_order.h"

// glibc >= 2.35 (<dlfcn.h>); weak, so that an older C library loads this code too (then no
// libgomp is ever called: see Ready()).
#pragma weak _dl_find_object

namespace forksafe::runtime {
namespace {

using internal::LoadedObject;

constexpr int kOmpPauseHard = 2;  // omp_pause_hard, of OpenMP 5's omp_pause_resource_t
constexpr int kMaxRuntimes = 4;   // more OpenMP runtimes than this in one process are ignored
constexpr size_t kPathMax = 256;  // longer paths are cut in reports

using LevelFn = int (*)();

// One OpenMP runtime, as one walk of the loaded objects saw it. The path is a copy: the loader's
// goes away with the object, which another thread may dlclose right after the walk.
struct Runtime {
  OpenMpRuntimeKind kind = OpenMpRuntimeKind::kGnu;
  char path[kPathMax] = {};
  LevelFn get_level = nullptr;  // also the identity of this loaded instance
  // libgomp only, filled inside the walk (see GnuInWalk):
  bool ready = false;      // relocated by the loader: safe to call
  bool has_pause = false;  // defines omp_pause_resource_all (GCC >= 9)
  int level = 0;           // the forking thread's omp_get_level()
  bool in_parallel = false;
  int pause_rc = -1;  // omp_pause_resource_all's result, when it was called
  // A libgomp linked -z nodelete (as GCC builds it) is paused after the walk, outside the
  // loader's lock (see GnuInWalk); these are its entry points for that.
  bool pause_after_walk = false;
  int (*in_parallel_fn)() = nullptr;
  int (*pause_fn)(int) = nullptr;
};

struct Found {
  Runtime runtimes[kMaxRuntimes];
  int count = 0;
  bool pause = false;  // prepare's walk: pause each ready libgomp (false: only list them)
  // The loader's copies of the runtimes' paths (identities while nothing is unloaded), and, when
  // `known` is set, the objects to look at: the others are skipped without a symbol lookup.
  const char* loader_paths[kMaxRuntimes] = {};
  const char* const* known = nullptr;
  int known_count = 0;
};

// Where forksafe's at-fork registration stands relative to one runtime with its own handlers:
// `at` is the number of the first registration (internal/fork_registration.h) made after the
// runtime had started, so after it registered its handlers; 0: none yet.
struct Ordering {
  std::atomic<LevelFn> key{nullptr};
  std::atomic<int> at{0};
  std::atomic<bool> renewed_in_fork{false};
};

// Per-fork counting (each counter moves at most once per fork, whatever the attempts).
enum CountBit : unsigned {
  kCountPaused = 1,
  kCountGaveUp = 2,
  kCountInRegion = 4,
  kCountLeft = 8,
  kCountNotAsked = 16,
};

struct OpenMpForkState {
  std::atomic<bool> usable{true};
  std::atomic<bool> bypass{false};
  // Set by prepare when the child cannot be made safe although prepare let the fork go (the
  // forking thread is inside a region); read by the child callback, cleared by the parent's.
  // Only the forking thread touches it, under the registry's lock.
  bool child_unusable = false;
  // The fork whose attempts `counted` describes (PrepareAttempt::fork_number), and what was
  // already counted or reported in it. Forking thread only, under the registry's lock.
  uint64_t counted_fork = 0;
  uint64_t counted_generation = 0;  // ForkGeneration() then: a child's fork 1 is not its parent's
  unsigned counted = 0;
  // The last walk's runtimes (the loader's copies of their paths) and the loader's stamp it was
  // made at (0: none, or unknown): while the stamp stays, the same objects are loaded, and
  // prepare looks up symbols in those only (none at all when there were none).
  uint64_t walk_stamp = 0;
  const char* walk_paths[kMaxRuntimes] = {};
  int walk_count = 0;
  Ordering ordering[kMaxRuntimes];
  std::atomic<uint64_t> ordered_stamp{0};  // objects as of the last full ordering pass
  std::atomic<bool> ordering_busy{false};
  std::atomic<uint64_t> paused{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> gave_up{0};
  std::atomic<uint64_t> in_region{0};
  std::atomic<uint64_t> left_to_runtime{0};
  std::atomic<uint64_t> not_asked{0};
  std::atomic<uint64_t> not_ready{0};
};

OpenMpForkState& StateRef() {
  static auto* state = new OpenMpForkState();  // leaked: used by at-fork handlers
  return *state;
}

// True when the loader has finished relocating the object that holds `fn`: _dl_find_object
// learns of an object only after its relocation (and TLS set-up), and needs no lock. An object
// that dl_iterate_phdr already lists may still be mid-dlopen on another thread (mapped, not
// relocated): calling it then would jump through unrelocated tables.
bool Ready(void* fn) {
  if (_dl_find_object == nullptr || fn == nullptr) return false;
  dl_find_object found;
  return _dl_find_object(fn, &found) == 0;
}

// Asks a ready libgomp where the forking thread stands, and pauses it when outside any region.
// The pause ends this thread's idle team: it joins those threads.
void CallGnu(Runtime* r) {
  r->level = r->get_level();
  r->in_parallel = r->in_parallel_fn() != 0;
  if (r->level > 0 || r->in_parallel || r->pause_fn == nullptr) return;
  r->pause_rc = r->pause_fn(kOmpPauseHard);
}

// libgomp, found by the walk. Where it is called matters. The pause joins the team's threads, and
// a thread that ends may need the loader's lock (an unwinder without _dl_find_object walks the
// loaded objects at pthread_exit; the first unwinding pthread_exit of a process dlopens
// libgcc_s): under the walk's lock that is a deadlock. So a libgomp that dlclose can never unmap
// (-z nodelete, which GCC's libgomp is) is called after the walk, outside the lock. Only one that
// dlclose could unmap is called inside the walk, where no dlclose can unmap it meanwhile.
void GnuInWalk(const LoadedObject& object, Runtime* r, bool pause) {
  r->pause_fn = reinterpret_cast<int (*)(int)>(object.Find("omp_pause_resource_all"));
  r->in_parallel_fn = reinterpret_cast<int (*)()>(object.Find("omp_in_parallel"));
  r->has_pause = r->pause_fn != nullptr;
  r->ready = Ready(reinterpret_cast<void*>(r->get_level)) && r->in_parallel_fn != nullptr;
  if (!pause || !r->ready) return;
  if (object.no_delete()) {
    r->pause_after_walk = true;
    return;
  }
  CallGnu(r);
}

// Runs under the loader's dl_load_write_lock: reads symbol tables, and calls a ready libgomp.
bool VisitObject(const LoadedObject& object, void* context) {
  auto* found = static_cast<Found*>(context);
  if (found->known != nullptr && std::find(found->known, found->known + found->known_count,
                                           object.path()) == found->known + found->known_count) {
    return true;  // nothing was loaded or unloaded since the walk that found no runtime here
  }
  Runtime& r = found->runtimes[found->count];
  r = Runtime();
  if (object.Find("__kmpc_fork_call") != nullptr) {
    // LLVM's libomp or Intel's libiomp5 (which also carry libgomp's GOMP_ entry points).
    r.kind = std::strstr(object.path(), "iomp5") != nullptr ? OpenMpRuntimeKind::kIntel
                                                            : OpenMpRuntimeKind::kLlvm;
    r.get_level = reinterpret_cast<LevelFn>(object.Find("omp_get_level"));
  } else if (object.Find("GOMP_parallel") != nullptr) {
    r.kind = OpenMpRuntimeKind::kGnu;
    r.get_level = reinterpret_cast<LevelFn>(object.Find("omp_get_level"));
    if (r.get_level != nullptr) GnuInWalk(object, &r, found->pause);
  } else {
    return true;
  }
  std::strncpy(r.path, object.path(), kPathMax - 1);
  found->loader_paths[found->count] = object.path();
  ++found->count;
  return found->count < kMaxRuntimes;
}

Found Walk(bool pause, const char* const* known = nullptr, int known_count = 0) {
  Found found;
  found.pause = pause;
  found.known = known;
  found.known_count = known_count;
  internal::ForEachLoadedObject(VisitObject, &found);
  return found;
}

Ordering* OrderingOf(OpenMpForkState& st, LevelFn key, bool add) {
  for (Ordering& o : st.ordering) {
    if (o.key.load(std::memory_order_acquire) == key) return &o;
  }
  if (!add) return nullptr;
  for (Ordering& o : st.ordering) {
    LevelFn none = nullptr;
    if (o.key.compare_exchange_strong(none, key)) return &o;
  }
  return nullptr;
}

// Counts `bit` once per fork; true the first time in this fork (report its event then too).
bool FirstInFork(OpenMpForkState& st, unsigned bit, std::atomic<uint64_t>& counter) {
  if ((st.counted & bit) != 0) return false;
  st.counted |= bit;
  counter.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void ReportInRegion(OpenMpForkState& st, const Runtime& r, int level) {
  st.child_unusable = true;
  if (!FirstInFork(st, kCountInRegion, st.in_region)) return;
  AtForkRegistry::ReportEvent(
      ForkEventKind::kSubsystemUnusable, "openmp",
      std::string("fork() was called from inside an OpenMP parallel region (nesting level ") +
          std::to_string(level) + ") of " + r.path +
          "; its team cannot be quiesced from inside it. The child must not use OpenMP "
          "(OpenMpUsableInThisProcess() is false there) and must _exit before the region "
          "would end; fork from outside parallel regions to keep OpenMP in the child");
}

// An LLVM or Intel runtime, after the walk. Its own prepare takes its locks; when it ran before
// this one (forksafe's registration is older than the runtime's), asking it anything on this
// thread can wait for those locks for ever. Ask only when this fork runs on a registration made
// after the runtime started.
void OtherRuntime(OpenMpForkState& st, const Runtime& r) {
  FirstInFork(st, kCountLeft, st.left_to_runtime);
  Ordering* o = OrderingOf(st, r.get_level, true);
  const int at = o != nullptr ? o->at.load(std::memory_order_acquire) : 0;
  if (at > 0 && internal::ActingForkRegistration() >= at && r.get_level != nullptr) {
    const int level = r.get_level();
    if (level > 0) ReportInRegion(st, r, level);
    return;
  }
  FirstInFork(st, kCountNotAsked, st.not_asked);
  // Move forksafe's registration behind the runtime's from the next fork on (if it has started
  // by now; the pool hook and OrderForkHandlersAfterOpenMp() make sure of it). Once per runtime
  // when it succeeds; a refused renewal (another thread renewing, no slot left) is tried again
  // at the next fork.
  if (o != nullptr && !o->renewed_in_fork.load(std::memory_order_acquire) &&
      internal::RenewForkRegistration() > 0) {
    o->renewed_in_fork.store(true, std::memory_order_release);
  }
}

// What prepare does for one libgomp the walk saw; false: "not yet".
bool GnuRuntime(OpenMpForkState& st, const Runtime& r, const PrepareAttempt& attempt) {
  if (!r.ready) {
    // Mid-dlopen on another thread: nobody has used it yet, so it has no threads to end.
    st.not_ready.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  // Inside a region (active or not; a task in it counts) the team cannot be paused: its other
  // threads are running our caller's region. Retrying would not change that.
  if (r.level > 0 || r.in_parallel) {
    ReportInRegion(st, r, r.level);
    return true;
  }
  if (!r.has_pause) {
    st.child_unusable = true;
    if (FirstInFork(st, kCountGaveUp, st.gave_up)) {
      AtForkRegistry::ReportEvent(
          ForkEventKind::kSubsystemUnusable, "openmp",
          std::string("the OpenMP runtime ") + r.path +
              " has no omp_pause_resource_all (libgomp older than GCC 9), so its threads cannot "
              "be quiesced; the child must not use OpenMP: use GCC 9 or newer");
    }
    return true;
  }
  if (r.pause_rc == 0) {
    FirstInFork(st, kCountPaused, st.paused);
    return true;
  }
  st.refused.fetch_add(1, std::memory_order_relaxed);  // per attempt, by definition
  if (!attempt.last) return false;
  if (FirstInFork(st, kCountGaveUp, st.gave_up)) {
    AtForkRegistry::ReportEvent(
        ForkEventKind::kSubsystemUnusable, "openmp",
        std::string("omp_pause_resource_all(omp_pause_hard) of ") + r.path +
            " failed until the fork's deadline; the child must not use OpenMP "
            "(OpenMpUsableInThisProcess() is false there)");
  }
  return false;
}

bool PrepareRuntimes(OpenMpForkState& st, const PrepareAttempt& attempt, uint64_t stamp, bool same);

bool Prepare(const PrepareAttempt& attempt) {
  OpenMpForkState& st = StateRef();
  // Fields are written only when they change, and the per-fork counting only once a runtime is
  // there: in a process without OpenMP, prepare, parent and child write nothing (each page
  // written around a fork costs a copy-on-write fault in the parent and in the child).
  if (st.child_unusable) st.child_unusable = false;
  // A process whose OpenMP an earlier fork left unusable keeps it so (and so do its children).
  if (!st.usable.load() || st.bypass.load()) return true;
  const uint64_t stamp = internal::LoadedObjectsStamp();
  const bool same = stamp != 0 && stamp == st.walk_stamp;
  if (same && st.walk_count == 0) return true;  // no runtime, nothing loaded since
  return PrepareRuntimes(st, attempt, stamp, same);
}

// Prepare's work once an OpenMP runtime may be loaded. Not inlined: its frame holds a Found
// (over a kilobyte), which an idle fork's prepare then does not reach into (a stack page the
// fork touches is a page fault in each process).
__attribute__((noinline)) bool PrepareRuntimes(OpenMpForkState& st, const PrepareAttempt& attempt,
                                               uint64_t stamp, bool same) {
  if (attempt.fork_number != st.counted_fork || ForkGeneration() != st.counted_generation) {
    st.counted_fork = attempt.fork_number;
    st.counted_generation = ForkGeneration();
    st.counted = 0;
  }
  Found found = same ? Walk(/*pause=*/true, st.walk_paths, st.walk_count) : Walk(/*pause=*/true);
  for (int i = 0; i < found.count; ++i) {
    if (found.runtimes[i].pause_after_walk) CallGnu(&found.runtimes[i]);  // see GnuInWalk
  }
  st.walk_stamp = stamp;
  st.walk_count = found.count;
  std::copy(found.loader_paths, found.loader_paths + found.count, st.walk_paths);
  bool ok = true;
  for (int i = 0; i < found.count; ++i) {
    const Runtime& r = found.runtimes[i];
    if (r.kind == OpenMpRuntimeKind::kGnu) {
      ok = GnuRuntime(st, r, attempt) && ok;
    } else {
      OtherRuntime(st, r);
    }
  }
  return ok;
}

}  // namespace

void InstallOpenMpForkHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    // The process has one OpenMP runtime (a shared libgomp), paused by the primary copy of
    // forksafe's handler: a copy nested in another's registry registers none (runtime/at_fork.h,
    // "One registry per process").
    if (AtForkRegistry::Get().IsNested()) return;
    AtForkHandler h;
    h.name = "openmp";
    h.prepare = Prepare;
    // Both write only what changed (see Prepare).
    h.parent = [](bool) {
      OpenMpForkState& st = StateRef();
      if (st.child_unusable) st.child_unusable = false;
    };
    h.child = [](bool prepared) {
      OpenMpForkState& st = StateRef();
      if ((!prepared || st.child_unusable) && st.usable.load()) st.usable.store(false);
      if (st.child_unusable) st.child_unusable = false;
      // counted_fork and counted stay: the child numbers its forks from 1 again, but in another
      // ForkGeneration(), so its first prepare starts counting afresh.
      // An ordering pass another thread was making is gone.
      if (st.ordering_busy.load()) st.ordering_busy.store(false);
    };
    static int tag;
    AtForkRegistry::Get().Register(&tag, std::move(h));
  });
}

namespace {

// One ordering pass (OrderForkHandlersAfterOpenMp, and the pool hook with `automatic`). Returns
// false when something is left to do (a runtime not yet relocated, a renewal refused).
bool OrderPass(bool automatic) {
  OpenMpForkState& st = StateRef();
  bool nested = true;
  try {
    nested = AtForkRegistry::Get().IsNested();
  } catch (...) {
    // The registry could not be made (pthread_atfork failed): there is nothing to order.
  }
  if (nested || InForkHandler()) return true;
  const uint64_t stamp = internal::LoadedObjectsStamp();
  if (stamp != 0 && stamp == st.ordered_stamp.load(std::memory_order_acquire)) return true;
  if (st.ordering_busy.exchange(true, std::memory_order_acquire)) return true;  // another thread is
  const Found found = Walk(/*pause=*/false);
  // Forget the runtimes that are gone: a runtime loaded again (perhaps at the same address) has
  // not registered after any of our registrations yet. (One unloaded and loaded again between
  // two passes keeps its entry: call OrderForkHandlersAfterOpenMp() after loading it again.)
  for (Ordering& o : st.ordering) {
    const LevelFn key = o.key.load(std::memory_order_acquire);
    if (key == nullptr) continue;
    bool present = false;
    for (int i = 0; i < found.count; ++i) present = present || found.runtimes[i].get_level == key;
    if (present) continue;
    o.at.store(0, std::memory_order_release);
    o.renewed_in_fork.store(false, std::memory_order_release);
    o.key.store(nullptr, std::memory_order_release);
  }
  int llvm_family = 0;
  for (int i = 0; i < found.count; ++i) {
    llvm_family += found.runtimes[i].kind != OpenMpRuntimeKind::kGnu;
  }
  bool done = true;
  for (int i = 0; i < found.count; ++i) {
    const Runtime& r = found.runtimes[i];
    if (r.kind == OpenMpRuntimeKind::kGnu || r.get_level == nullptr) continue;
    // Starting one of several LLVM-family runtimes (libomp next to libiomp5) makes it look for
    // the others, and it aborts the process ("OMP: Error #15") unless KMP_DUPLICATE_LIB_OK is
    // set: the automatic pass never starts a runtime then; the program's own call does.
    if (automatic && llvm_family > 1) continue;
    Ordering* o = OrderingOf(st, r.get_level, true);
    if (o == nullptr || o->at.load(std::memory_order_acquire) > 0) continue;
    // Mid-dlopen on another thread (mapped, not relocated): not callable yet.
    if (!Ready(reinterpret_cast<void*>(r.get_level))) {
      done = false;
      continue;
    }
    // Starts the runtime if it has not started (it registers its at-fork handlers then), so that
    // the registration made next comes after them.
    (void)r.get_level();
    const int at = internal::RenewForkRegistration();
    if (at > 0) {
      o->at.store(at, std::memory_order_release);
    } else {
      done = false;  // try again at the next call
    }
  }
  if (done) st.ordered_stamp.store(stamp, std::memory_order_release);
  st.ordering_busy.store(false, std::memory_order_release);
  return done;
}

}  // namespace

void OrderForkHandlersAfterOpenMp() { (void)OrderPass(/*automatic=*/false); }

namespace internal {
void OrderForkHandlersAfterOpenMpFromPool() noexcept {
  // Once a millisecond per worker at most; a pass that leaves something to do (renewals refused:
  // no slot left, say) backs off, up to about a second.
  thread_local std::chrono::steady_clock::time_point next{};
  thread_local int backoff = 0;
  const auto now = std::chrono::steady_clock::now();
  if (now < next) return;
  backoff = OrderPass(/*automatic=*/true) ? 0 : std::min(backoff + 1, 10);
  next = now + std::chrono::milliseconds(1 << backoff);
}
}  // namespace internal

bool OpenMpUsableInThisProcess() { return StateRef().usable.load(); }

std::vector<OpenMpRuntime> LoadedOpenMpRuntimes() {
  const Found found = Walk(/*pause=*/false);
  std::vector<OpenMpRuntime> out;
  for (int i = 0; i < found.count; ++i) {
    out.push_back(OpenMpRuntime{found.runtimes[i].kind, found.runtimes[i].path});
  }
  return out;
}

OpenMpForkStats GetOpenMpForkStats() {
  OpenMpForkState& st = StateRef();
  OpenMpForkStats s;
  s.paused = st.paused.load();
  s.pause_refused = st.refused.load();
  s.gave_up = st.gave_up.load();
  s.in_region = st.in_region.load();
  s.left_to_runtime = st.left_to_runtime.load();
  s.not_asked = st.not_asked.load();
  s.not_ready = st.not_ready.load();
  return s;
}

namespace internal {
void SetOpenMpForkBypassForTest(bool bypass) { StateRef().bypass.store(bypass); }
}  // namespace internal

// Installed at load time, so that any fork of a program that uses OpenMP is covered.
namespace {
const bool g_installed = (InstallOpenMpForkHandler(), true);
}  // namespace

}  // namespace forksafe::runtime
