// runtime/internal/memory_bounds.h: NOT FOR USERS. The one place where sizes are rounded and
// bounded before memory is committed.
//
// What it offers
//   - CheckedRoundUp / RoundUpOrThrow: `n` rounded up to a multiple of `align`, without wrapping.
//     Every rounding of a size in forksafe goes through them (device backends, the shared-memory
//     arena, Value/Array, Queue): `(n + a - 1) / a * a` wraps to 0 for n near SIZE_MAX, and the
//     caller then hands out a block far smaller than asked for.
//   - CheckMemoryAvailable: refuses, at once, an allocation larger than what the system can give
//     for that kind of memory, BEFORE anything is reserved, mapped or touched:
//       kPrivate      process memory (malloc): physical memory + swap, RLIMIT_AS, RLIMIT_DATA,
//                     the room under the memory cgroups (the process's and its ancestors');
//       kShared       a memory file that is reserved (fallocate) or filled at once: the memory
//                     available now (MemAvailable + SwapFree), RLIMIT_AS, RLIMIT_FSIZE (beyond it
//                     ftruncate raises SIGXFSZ, which kills the process), the cgroup's room;
//       kSharedNamed  kShared, plus the free space of /dev/shm.
//     Without it, a request of a terabyte reserves memory page by page until the machine's OOM
//     killer fires (it is not the caller that gets killed, usually), long before the clear error
//     the kernel would give at the end.
//
// Guarantees
//   - Errors: Error(kResourceExhausted) naming what was asked for, the size, each limit that is
//     exceeded (its name and value, tightest first) and what to do. Rounding that would not fit in
//     size_t is kResourceExhausted too (no machine has that much memory).
//   - The limits are read anew on every call (a few small reads of /proc and /sys; no allocation
//     of the size asked for); requests under kFullCheckFrom (64 MiB) look at the RLIMIT_* bounds
//     only (a system call each). A limit that cannot be read is skipped, never guessed.
//   - Thread safety: every function may be called from any thread; nothing is cached.
//
// Hazards
//   - The check is a snapshot: memory that another process takes right after it can still make
//     the reservation fail. That failure stays an error of the caller (fallocate/mmap fail
//     cleanly); the check only removes the case where the request could never succeed.
#ifndef FORKSAFE_RUNTIME_INTERNAL_MEMORY_BOUNDS_H_
#define FORKSAFE_RUNTIME_INTERNAL_MEMORY_BOUNDS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace forksafe::runtime::internal {

/// `n` rounded up to a multiple of `align` (> 0) in `*out`; false (and `*out` untouched) when the
/// result does not fit in size_t.
[[nodiscard]] bool CheckedRoundUp(size_t n, size_t align, size_t* out) noexcept;

/// `n` rounded up to a multiple of `align` (> 0); throws Error(kResourceExhausted) naming `what`
/// when the result does not fit in size_t.
size_t RoundUpOrThrow(size_t n, size_t align, const char* what);

/// What kind of memory an allocation takes (see the banner).
enum class MemoryUse { kPrivate, kShared, kSharedNamed };

/// One bound the system puts on an allocation.
struct MemoryLimit {
  uint64_t bytes = 0;
  std::string name;    ///< e.g. "RLIMIT_FSIZE", "available memory (MemAvailable + SwapFree)".
  std::string advice;  ///< What to do when a request exceeds it.
};

/// The bounds that apply to `use` now (those that could be read), tightest first.
std::vector<MemoryLimit> MemoryLimits(MemoryUse use);

/// Throws Error(kResourceExhausted) when `bytes` exceeds any of `limits`, naming `what`, the size,
/// and every limit exceeded (tightest first) with what to do. Pure: for tests with made-up limits.
void CheckMemoryAgainst(uint64_t bytes, const std::vector<MemoryLimit>& limits,
                        const std::string& what);

/// The room left under this process's memory cgroups.
struct MemoryCgroupRoom {
  uint64_t bytes = UINT64_MAX;  ///< UINT64_MAX: no cgroup limits the process (or none is readable).
  std::string file;             ///< The limit file that leaves the least room (without `root`).
};

/// The smallest room (limit - usage) over this process's memory cgroup and every ancestor: v2
/// memory.max - memory.current, v1 memory.limit_in_bytes - memory.usage_in_bytes. The cgroups are
/// located by runtime/internal/cgroup.h (LocateCgroups: mountinfo, container roots, hybrid
/// mounts). `root` prefixes every path read ("" = the real /proc and /sys; tests use a fake tree).
MemoryCgroupRoom ReadMemoryCgroupRoom(const std::string& root = "");

/// Requests below this size are checked against the process limits only (RLIMIT_*): they are on
/// hot paths, and cannot take a machine down.
constexpr uint64_t kFullCheckFrom = uint64_t{64} << 20;

/// CheckMemoryAgainst(bytes, MemoryLimits(use), what); below kFullCheckFrom, the RLIMIT_* bounds
/// only.
void CheckMemoryAvailable(uint64_t bytes, MemoryUse use, std::string_view what);

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_MEMORY_BOUNDS_H_
