// runtime/internal/cgroup.h: NOT FOR USERS. Where this process's cgroups are, and the CPU quota
// they put on it (for runtime/cpu_budget.h).
//
// What it offers
//   - ParseCgroupMounts: the cgroup hierarchies mounted in this mount namespace, from
//     /proc/self/mountinfo (v2 "cgroup2" mounts; v1 "cgroup" mounts with their controllers).
//     Hybrid machines mount v2 at /sys/fs/cgroup/unified and v1's cpu at /sys/fs/cgroup/cpu;
//     containers mount a hierarchy whose root is their own cgroup: mountinfo says both, so no
//     path is guessed (only when mountinfo lists no cgroup mount at all are the usual places,
//     /sys/fs/cgroup and /sys/fs/cgroup/cpu, tried).
//   - ParseProcCgroup: the lines of /proc/self/cgroup ("0::/path", "4:cpu,cpuacct:/path").
//   - CgroupDirChain: the directories of a cgroup and of every ancestor up to the mount's root,
//     innermost first (a quota on any ancestor limits the process too).
//   - LocateCgroups: the one locator of this process's cgroups for a controller ("cpu",
//     "memory"), built on the three above: every reader of cgroup files (ReadCpuQuota here, the
//     memory room of runtime/internal/memory_bounds.cc, the tests' cgroup fixture in
//     tests/support/test_cgroup.h) goes through it, so that containers, hybrid mounts and
//     ancestors are handled alike everywhere.
//   - CpusFromCpuMax / CpusFromCfs: a CPU quota as whole CPUs, rounded up (1.5 CPUs -> 2).
//   - ReadCpuQuota: the most restrictive quota over all of the above.
//
// Guarantees
//   - A file that is missing, unreadable or malformed is skipped, never guessed: the quota is
//     then "none" (as runtime/internal/memory_bounds.cc does for memory limits).
//   - Every path is prefixed with `root` ("" in production): tests point it at a fake tree.
//   - Nothing is cached; a few small reads per call. Thread-safe.
#ifndef FORKSAFE_RUNTIME_INTERNAL_CGROUP_H_
#define FORKSAFE_RUNTIME_INTERNAL_CGROUP_H_

#include <string>
#include <string_view>
#include <vector>

namespace forksafe::runtime::internal {

/// One mounted cgroup hierarchy (a line of /proc/self/mountinfo).
struct CgroupMount {
  bool v2 = false;
  std::string root;                      ///< The mount's root within the hierarchy ("/" usually).
  std::string mount_point;               ///< Where it is mounted ("/sys/fs/cgroup").
  std::vector<std::string> controllers;  ///< v1: the controllers named in its super options.
};

/// The cgroup mounts listed in `mountinfo` (the text of /proc/self/mountinfo), in order.
/// Octal escapes of mountinfo ("\040" for a space) are decoded. Malformed lines are skipped.
std::vector<CgroupMount> ParseCgroupMounts(std::string_view mountinfo);

/// One line of /proc/self/cgroup.
struct CgroupMembership {
  bool v2 = false;                       ///< "0::/path"
  std::vector<std::string> controllers;  ///< v1: "cpu,cpuacct" split.
  std::string path;                      ///< "/path", relative to the hierarchy's root.
};

/// The lines of `text` (the text of /proc/self/cgroup). Malformed lines are skipped.
std::vector<CgroupMembership> ParseProcCgroup(std::string_view text);

/// The directories of the cgroup `path` of `mount`'s hierarchy and of its ancestors, innermost
/// first, ending with the mount point; each prefixed with `root`. Empty when `path` lies outside
/// the mount's root (another cgroup namespace: nothing of it can be read from here).
std::vector<std::string> CgroupDirChain(const std::string& root, const CgroupMount& mount,
                                        const std::string& path);

/// Where this process's cgroup for one controller is, in one hierarchy.
struct CgroupPlace {
  bool v2 = false;
  std::string mount_point;        ///< The hierarchy's mount point, prefixed with `root`.
  std::vector<std::string> dirs;  ///< CgroupDirChain: the process's cgroup first, mount_point last.
};

/// This process's cgroups that `controller` ("cpu", "memory", ...) may govern, one per hierarchy:
/// its v2 cgroup (whether or not the controller is enabled there: its files are then absent, and
/// readers skip them) and its cgroup in a v1 hierarchy that has `controller`. The mounts come from
/// `root`/proc/self/mountinfo; only when it lists none are the usual places used (v2 at
/// /sys/fs/cgroup, v1 at /sys/fs/cgroup/<controller>). A hierarchy whose mount shows another
/// part of the tree (another cgroup namespace) is left out.
std::vector<CgroupPlace> LocateCgroups(std::string_view controller, const std::string& root = "");

/// The CPUs that a cgroup v2 cpu.max ("$MAX $PERIOD", "max $PERIOD" or "max") allows, rounded
/// up; 0 for no quota; -1 when the text is malformed.
int CpusFromCpuMax(std::string_view text);

/// The CPUs that cgroup v1 cpu.cfs_quota_us / cpu.cfs_period_us allow, rounded up; 0 for no quota
/// (a quota of -1); -1 when either text is malformed.
int CpusFromCfs(std::string_view quota_text, std::string_view period_text);

/// A quota over this process's cgroups.
struct CpuQuota {
  int cpus = 0;      ///< Whole CPUs, rounded up; 0 when no cgroup puts a quota on the process.
  std::string file;  ///< The file that set it (without `root`), for messages.
};

/// The most restrictive CPU quota over this process's cgroups and their ancestors: v2 cpu.max
/// and v1 cpu.cfs_quota_us/cpu.cfs_period_us. `root` prefixes every path read ("" = the real
/// /proc and /sys).
CpuQuota ReadCpuQuota(const std::string& root = "");

/// The whole (small) file at `path`; "" when it cannot be read.
std::string ReadSmallFile(const std::string& path);

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_CGROUP_H_
