// runtime/launch_info.cc: the launchers' variables read into one LaunchInfo.
#include "forksafe/runtime/launch_info.h"

#include <charconv>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"

namespace forksafe::runtime {

const char* LauncherName(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone: return "none";
    case Launcher::kSpawn: return "spawn";
    case Launcher::kTorchrun: return "torchrun";
    case Launcher::kEnv: return "env";
    case Launcher::kOpenMpi: return "openmpi";
    case Launcher::kMpich: return "mpich";
    case Launcher::kSlurm: return "slurm";
  }
  return "unknown";
}

std::string LaunchInfo::ToString() const {
  std::string s =
      absl::StrCat("rank ", rank, " of ", world_size, " (local ", local_rank, " of ",
                   local_world_size, ", node ", node_rank, "; ", LauncherName(launcher));
  if (!master_addr.empty()) absl::StrAppend(&s, "; rendezvous ", master_addr, ":", master_port);
  return s + ")";
}

namespace internal {
namespace {

using GetEnv = std::function<const char*(const char*)>;

[[noreturn]] void Bad(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat("forksafe: the launcher's variables are wrong: ", what,
                           ". Fix the launch command (or unset the variables when no launcher "
                           "started this process)"));
}

// The variable's value, or nullopt when it is unset or empty.
std::optional<std::string_view> Value(const GetEnv& getenv, const char* name) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string_view(v);
}

// A whole decimal number (digits only) of at most 9 digits; -1 when `text` is not one.
int ParseWhole(std::string_view text) {
  if (text.empty() || text.size() > 9) return -1;
  int v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.front() == '-' ||
      text.front() == '+') {
    return -1;
  }
  return v;
}

// The number in variable `name`, or `fallback` when it is unset; throws when it is malformed.
int Number(const GetEnv& getenv, const char* name, int fallback) {
  const std::optional<std::string_view> v = Value(getenv, name);
  if (!v) return fallback;
  const int n = ParseWhole(*v);
  if (n < 0)
    Bad(absl::StrCat(name, "=\"", std::string(*v), "\" is not a whole number (digits only)"));
  return n;
}

bool Has(const GetEnv& getenv, const char* name) { return Value(getenv, name).has_value(); }

// Both or neither of a required pair; true when both are set.
bool Pair(const GetEnv& getenv, const char* a, const char* b, const char* launcher) {
  const bool ha = Has(getenv, a), hb = Has(getenv, b);
  if (ha != hb) {
    Bad(absl::StrCat(ha ? a : b, " is set but ", ha ? b : a, " is not (", launcher,
                     " sets both; a process must know its rank and the world size together)"));
  }
  return ha;
}

// Names for messages: the variables each field came from.
struct Names {
  const char* rank;
  const char* world;
  const char* local_rank;
  const char* local_world;
  const char* node;  // may be null: derived
};

std::string Show(const GetEnv& getenv, const char* name) {
  const std::optional<std::string_view> v = Value(getenv, name);
  return v ? absl::StrCat(name, "=", std::string(*v)) : absl::StrCat(name, " (unset)");
}

void Check(const LaunchInfo& info, const GetEnv& getenv, const Names& n) {
  if (info.world_size < 1) Bad(absl::StrCat(Show(getenv, n.world), " must be at least 1"));
  if (info.rank >= info.world_size) {
    Bad(absl::StrCat(Show(getenv, n.rank), " is not below ", Show(getenv, n.world)));
  }
  if (info.local_world_size < 1) {
    Bad(absl::StrCat(Show(getenv, n.local_world), " must be at least 1"));
  }
  if (info.local_world_size > info.world_size) {
    Bad(absl::StrCat(Show(getenv, n.local_world), " is larger than ", Show(getenv, n.world)));
  }
  if (info.local_rank >= info.local_world_size) {
    Bad(absl::StrCat(Show(getenv, n.local_rank), " is not below ", Show(getenv, n.local_world)));
  }
  if (info.local_rank > info.rank) {
    Bad(absl::StrCat(Show(getenv, n.local_rank), " is larger than ", Show(getenv, n.rank),
                     " (a local rank counts the ranks of one node, a subset of all)"));
  }
  if (n.node != nullptr && info.node_rank >= info.world_size) {
    Bad(absl::StrCat(Show(getenv, n.node), " is not below ", Show(getenv, n.world)));
  }
}

bool ReadTorch(const GetEnv& getenv, LaunchInfo& info) {
  // LOCAL_RANK alone (some launch scripts set only it) says nothing about the world: without
  // RANK and WORLD_SIZE another launcher's variables may still answer.
  if (!Pair(getenv, "RANK", "WORLD_SIZE", "torchrun")) return false;
  const std::optional<std::string_view> tag = Value(getenv, "FORKSAFE_LAUNCHER");
  info.launcher = tag && *tag == "spawn"               ? Launcher::kSpawn
                  : Has(getenv, "TORCHELASTIC_RUN_ID") ? Launcher::kTorchrun
                                                       : Launcher::kEnv;
  info.rank = Number(getenv, "RANK", 0);
  info.world_size = Number(getenv, "WORLD_SIZE", 0);
  const bool has_local = Has(getenv, "LOCAL_RANK");
  info.local_rank = Number(getenv, "LOCAL_RANK", info.rank);
  info.local_world_size = Number(getenv, "LOCAL_WORLD_SIZE", info.world_size);
  if (!has_local && Has(getenv, "LOCAL_WORLD_SIZE")) {
    Bad(absl::StrCat(Show(getenv, "LOCAL_WORLD_SIZE"),
                     " is set but LOCAL_RANK is not (set both, or neither for one node)"));
  }
  info.node_rank = Number(getenv, "GROUP_RANK", 0);
  Check(info, getenv, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"});
  return true;
}

bool ReadSlurm(const GetEnv& getenv, LaunchInfo& info);

// MPI launchers: rank, size, local rank, local size; the node index derived (or, without local
// ranks, taken from a Slurm step of the same rank).
bool ReadMpi(const GetEnv& getenv, LaunchInfo& info, Launcher launcher, const Names& n,
             const char* name) {
  if (!Pair(getenv, n.rank, n.world, name)) return false;
  info.launcher = launcher;
  info.rank = Number(getenv, n.rank, 0);
  info.world_size = Number(getenv, n.world, 0);
  info.local_rank = Number(getenv, n.local_rank, info.rank);
  info.local_world_size = Number(getenv, n.local_world, info.world_size);
  Check(info, getenv, n);
  info.node_rank = info.rank / info.local_world_size;
  if (!Has(getenv, n.local_rank) && !Has(getenv, n.local_world)) {
    // srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE but no local ranks: the Slurm step (the same
    // rank and world) knows them.
    LaunchInfo slurm;
    if (ReadSlurm(getenv, slurm) && slurm.rank == info.rank &&
        slurm.world_size == info.world_size) {
      info.local_rank = slurm.local_rank;
      info.local_world_size = slurm.local_world_size;
      info.node_rank = slurm.node_rank;
    }
  }
  return true;
}

// Slurm's "2(x3),1": tasks per node, run-length encoded; the count of node `index`, or -1.
int TasksOnNode(std::string_view spec, int index) {
  long long node = 0;
  while (!spec.empty()) {
    const size_t comma = spec.find(',');
    std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
    int repeat = 1;
    const size_t paren = item.find("(x");
    if (paren != std::string_view::npos) {
      if (item.back() != ')') return -1;
      repeat = ParseWhole(item.substr(paren + 2, item.size() - paren - 3));
      item = item.substr(0, paren);
      if (repeat < 1) return -1;
    }
    const int tasks = ParseWhole(item);
    if (tasks < 0) return -1;
    if (index < node + repeat) return tasks;
    node += repeat;  // at most 9 digits each: no overflow in a long long
  }
  return -1;
}

bool ReadSlurm(const GetEnv& getenv, LaunchInfo& info) {
  if (!Has(getenv, "SLURM_PROCID")) return false;
  if (!Has(getenv, "SLURM_STEP_ID") && !Has(getenv, "SLURM_STEPID")) return false;
  const char* world = Has(getenv, "SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  if (!Has(getenv, world)) {
    Bad("SLURM_PROCID is set but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is (srun sets "
        "them)");
  }
  info.launcher = Launcher::kSlurm;
  info.rank = Number(getenv, "SLURM_PROCID", 0);
  info.world_size = Number(getenv, world, 0);
  info.local_rank = Number(getenv, "SLURM_LOCALID", info.rank);
  info.node_rank = Number(getenv, "SLURM_NODEID", 0);
  const char* per_node = Has(getenv, "SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE"
                                                                  : "SLURM_TASKS_PER_NODE";
  info.local_world_size = info.world_size;
  if (const std::optional<std::string_view> spec = Value(getenv, per_node)) {
    const int tasks = TasksOnNode(*spec, info.node_rank);
    if (tasks < 1) {
      Bad(absl::StrCat(Show(getenv, per_node), " has no task count for ",
                       Show(getenv, "SLURM_NODEID"), " (the form is \"2(x3),1\")"));
    }
    info.local_world_size = tasks;
  }
  Check(info, getenv, {"SLURM_PROCID", world, "SLURM_LOCALID", per_node, "SLURM_NODEID"});
  return true;
}

}  // namespace

LaunchInfo ParseLaunchInfo(const GetEnv& getenv) {
  LaunchInfo info;
  const bool found =
      ReadTorch(getenv, info) ||
      ReadMpi(getenv, info, Launcher::kOpenMpi,
              {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE", nullptr},
              "Open MPI") ||
      ReadMpi(getenv, info, Launcher::kMpich,
              {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", nullptr}, "MPICH") ||
      ReadSlurm(getenv, info);
  if (!found) info = LaunchInfo();
  if (const std::optional<std::string_view> addr = Value(getenv, "MASTER_ADDR")) {
    info.master_addr = std::string(*addr);
  }
  if (const std::optional<std::string_view> port = Value(getenv, "MASTER_PORT")) {
    const int p = ParseWhole(*port);
    if (p < 1 || p > 65535) {
      Bad(absl::StrCat("MASTER_PORT=", std::string(*port), " is not a port number (1..65535)"));
    }
    info.master_port = p;
  }
  return info;
}

}  // namespace internal

LaunchInfo GetLaunchInfo() {
  return internal::ParseLaunchInfo([](const char* name) { return std::getenv(name); });
}

}  // namespace forksafe::runtime
