#include "forksafe/runtime/openmp_fork.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/internal/loaded_objects.h"
#include "forksafe/runtime/internal/openmp_fork_bypass.h"

namespace forksafe::runtime {
namespace {

using internal::LoadedObject;

constexpr int kOmpPauseHard = 2;  // omp_pause_hard, of OpenMP 5's omp_pause_resource_t
constexpr int kMaxRuntimes = 4;   // more OpenMP runtimes than this in one process are ignored

// One OpenMP runtime found among the loaded objects. The entry points are used for libgomp
// only (see "LLVM libomp and Intel libiomp5" in the header for why the others are left alone).
struct Runtime {
  OpenMpRuntimeKind kind = OpenMpRuntimeKind::kGnu;
  const char* path = "";  // the loader's copy of the name: valid while the object is loaded
  int (*pause_all)(int) = nullptr;
  int (*get_level)() = nullptr;
  int (*in_parallel)() = nullptr;
};

struct Found {
  Runtime runtimes[kMaxRuntimes];
  int count = 0;
};

struct OpenMpForkState {
  std::atomic<bool> usable{true};
  std::atomic<bool> bypass{false};
  // Set by prepare when the child cannot be made safe although prepare let the fork go (the
  // forking thread is inside a region); read by the child callback, cleared by the parent's.
  // Only the forking thread touches it, under the registry's lock.
  bool child_unusable = false;
  // What the last walk found, and the loader's stamp it was made at (0: never, or unknown).
  Found found;
  uint64_t stamp = 0;
  std::atomic<uint64_t> paused{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> gave_up{0};
  std::atomic<uint64_t> in_region{0};
  std::atomic<uint64_t> left_to_runtime{0};
};

OpenMpForkState& StateRef() {
  static auto* state = new OpenMpForkState();  // leaked: used by at-fork handlers
  return *state;
}

// Runs under the loader's dl_load_write_lock: reads symbol tables only.
bool VisitObject(const LoadedObject& object, void* context) {
  auto* found = static_cast<Found*>(context);
  Runtime r;
  if (object.Find("__kmpc_fork_call") != nullptr) {
    // LLVM's libomp or Intel's libiomp5 (which also carry libgomp's GOMP_ entry points).
    r.kind = std::strstr(object.path(), "iomp5") != nullptr ? OpenMpRuntimeKind::kIntel
                                                            : OpenMpRuntimeKind::kLlvm;
  } else if (object.Find("GOMP_parallel") != nullptr) {
    r.kind = OpenMpRuntimeKind::kGnu;
    r.pause_all = reinterpret_cast<int (*)(int)>(object.Find("omp_pause_resource_all"));
    r.get_level = reinterpret_cast<int (*)()>(object.Find("omp_get_level"));
    r.in_parallel = reinterpret_cast<int (*)()>(object.Find("omp_in_parallel"));
  } else {
    return true;
  }
  r.path = object.path();
  found->runtimes[found->count++] = r;
  return found->count < kMaxRuntimes;
}

Found FindRuntimes() {
  Found found;
  internal::ForEachLoadedObject(VisitObject, &found);
  return found;
}

// The runtimes loaded now: the last walk's result while no object was loaded or unloaded since.
const Found& CurrentRuntimes(OpenMpForkState& st) {
  const uint64_t stamp = internal::LoadedObjectsStamp();
  if (stamp == 0 || stamp != st.stamp) {
    st.found = FindRuntimes();
    st.stamp = stamp;
  }
  return st.found;
}

bool Prepare(const PrepareAttempt& attempt) {
  OpenMpForkState& st = StateRef();
  st.child_unusable = false;
  // A process whose OpenMP an earlier fork left unusable keeps it so (and so do its children).
  if (!st.usable.load() || st.bypass.load()) return true;
  const Found& found = CurrentRuntimes(st);
  bool left = false;
  for (int i = 0; i < found.count; ++i) {
    const Runtime& r = found.runtimes[i];
    if (r.kind != OpenMpRuntimeKind::kGnu) {
      left = true;
      continue;
    }
    // Inside a region (active or not; a task in it counts) the team cannot be paused: its other
    // threads are running our caller's region. Retrying would not change that.
    const int level = r.get_level != nullptr ? r.get_level() : 0;
    if (level > 0 || (r.in_parallel != nullptr && r.in_parallel() != 0)) {
      st.child_unusable = true;
      st.in_region.fetch_add(1, std::memory_order_relaxed);
      AtForkRegistry::ReportEvent(
          ForkEventKind::kSubsystemUnusable, "openmp",
          std::string("fork() was called from inside an OpenMP parallel region (nesting level ") +
              std::to_string(level) + ") of " + r.path +
              "; its team cannot be quiesced from inside it. The child must not use OpenMP "
              "(OpenMpUsableInThisProcess() is false there) and must _exit before the region "
              "would end; fork from outside parallel regions to keep OpenMP in the child");
      continue;
    }
    if (r.pause_all == nullptr) {
      st.child_unusable = true;
      AtForkRegistry::ReportEvent(
          ForkEventKind::kSubsystemUnusable, "openmp",
          std::string("the OpenMP runtime ") + r.path +
              " has no omp_pause_resource_all (libgomp older than GCC 9), so its threads cannot "
              "be quiesced; the child must not use OpenMP: use GCC 9 or newer");
      continue;
    }
    if (r.pause_all(kOmpPauseHard) == 0) {
      st.paused.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    st.refused.fetch_add(1, std::memory_order_relaxed);
    if (!attempt.last) return false;
    st.gave_up.fetch_add(1, std::memory_order_relaxed);
    AtForkRegistry::ReportEvent(
        ForkEventKind::kSubsystemUnusable, "openmp",
        std::string("omp_pause_resource_all(omp_pause_hard) of ") + r.path +
            " failed until the fork's deadline; the child must not use OpenMP "
            "(OpenMpUsableInThisProcess() is false there)");
    return false;
  }
  if (left) st.left_to_runtime.fetch_add(1, std::memory_order_relaxed);
  return true;
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
    h.parent = [](bool) { StateRef().child_unusable = false; };
    h.child = [](bool prepared) {
      OpenMpForkState& st = StateRef();
      if (!prepared || st.child_unusable) st.usable.store(false);
      st.child_unusable = false;
    };
    static int tag;
    AtForkRegistry::Get().Register(&tag, std::move(h));
  });
}

bool OpenMpUsableInThisProcess() { return StateRef().usable.load(); }

std::vector<OpenMpRuntime> LoadedOpenMpRuntimes() {
  const Found found = FindRuntimes();
  std::vector<OpenMpRuntime> out;
  for (int i = 0; i < found.count; ++i) {
    out.push_back(OpenMpRuntime{found.runtimes[i].kind, found.runtimes[i].path});
  }
  return out;
}

OpenMpForkStats GetOpenMpForkStats() {
  OpenMpForkState& st = StateRef();
  return OpenMpForkStats{st.paused.load(), st.refused.load(), st.gave_up.load(),
                         st.in_region.load(), st.left_to_runtime.load()};
}

namespace internal {
void SetOpenMpForkBypassForTest(bool bypass) { StateRef().bypass.store(bypass); }
}  // namespace internal

// Installed at load time, so that any fork of a program that uses OpenMP is covered.
namespace {
const bool g_installed = (InstallOpenMpForkHandler(), true);
}  // namespace

}  // namespace forksafe::runtime
