#include "forksafe/runtime/internal/memory_bounds.h"

#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/sysinfo.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/cgroup.h"

namespace forksafe::runtime::internal {
namespace {

constexpr uint64_t kNoLimit = std::numeric_limits<uint64_t>::max();

// A number read from the first line of a small file (cgroup files); kNoLimit for "max" or when it
// cannot be read.
uint64_t ReadLimitFile(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return kNoLimit;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(word.c_str(), &end, 10);
  return end != nullptr && *end == '\0' ? v : kNoLimit;
}

// /proc/meminfo's field `key` ("MemAvailable:") in bytes, or kNoLimit.
uint64_t MeminfoBytes(const std::string& text, const char* key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return kNoLimit;
  unsigned long long kib = 0;
  if (std::sscanf(text.c_str() + at + std::strlen(key), " %llu", &kib) != 1) return kNoLimit;
  return kib * 1024ull;
}

void AddRlimit(std::vector<MemoryLimit>* out, int resource, const char* name, const char* flag) {
  struct rlimit rl;
  if (getrlimit(resource, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return;
  out->push_back({static_cast<uint64_t>(rl.rlim_cur), name,
                  std::string("raise the limit (ulimit ") + flag + ") or ask for less"});
}

// Whether `bytes` exceeds the soft limit of `resource` (a limit that cannot be read: no).
bool ExceedsRlimit(uint64_t bytes, int resource) {
  struct rlimit rl;
  return getrlimit(resource, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
         bytes > static_cast<uint64_t>(rl.rlim_cur);
}

}  // namespace

MemoryCgroupRoom ReadMemoryCgroupRoom(const std::string& root) {
  MemoryCgroupRoom best;
  for (const CgroupPlace& place : LocateCgroups("memory", root)) {
    const char* max_name = place.v2 ? "/memory.max" : "/memory.limit_in_bytes";
    const char* cur_name = place.v2 ? "/memory.current" : "/memory.usage_in_bytes";
    for (const std::string& dir : place.dirs) {
      const uint64_t max = ReadLimitFile(dir + max_name);
      if (max == kNoLimit || max >= (uint64_t{1} << 62)) continue;  // v1 says "no limit" so
      const uint64_t cur = ReadLimitFile(dir + cur_name);
      if (cur == kNoLimit) continue;
      const uint64_t room = max > cur ? max - cur : 0;
      if (room < best.bytes) {
        best.bytes = room;
        best.file = (dir + max_name).substr(root.size());
      }
    }
  }
  return best;
}

bool CheckedRoundUp(size_t n, size_t align, size_t* out) noexcept {
  if (align == 0) return false;
  const size_t rem = n % align;
  if (rem == 0) {
    *out = n;
    return true;
  }
  size_t r = 0;
  if (__builtin_add_overflow(n, align - rem, &r)) return false;
  *out = r;
  return true;
}

size_t RoundUpOrThrow(size_t n, size_t align, const char* what) {
  size_t out = 0;
  if (!CheckedRoundUp(n, align, &out)) {
    throw Error(ErrorCode::kResourceExhausted,
                std::string(what) + ": " + std::to_string(n) +
                    " bytes rounded up to a multiple of " + std::to_string(align) +
                    " do not fit in the address space (more than any machine can provide); "
                    "ask for less");
  }
  return out;
}

std::vector<MemoryLimit> MemoryLimits(MemoryUse use) {
  std::vector<MemoryLimit> out;
  const bool shared = use != MemoryUse::kPrivate;
  if (shared) {
    std::ifstream in("/proc/meminfo");
    std::stringstream text;
    text << in.rdbuf();
    const uint64_t avail = MeminfoBytes(text.str(), "MemAvailable:");
    const uint64_t swap = MeminfoBytes(text.str(), "SwapFree:");
    if (avail != kNoLimit) {
      out.push_back({avail + (swap == kNoLimit ? 0 : swap),
                     "the memory available now (MemAvailable + SwapFree)",
                     "free memory (shared tensors, caches, other processes) or ask for less"});
    }
    AddRlimit(&out, RLIMIT_FSIZE, "RLIMIT_FSIZE", "-f");
  } else {
    struct sysinfo si;
    if (sysinfo(&si) == 0) {
      const uint64_t unit = si.mem_unit == 0 ? 1 : si.mem_unit;
      out.push_back({(static_cast<uint64_t>(si.totalram) + si.totalswap) * unit,
                     "physical memory + swap", "ask for less"});
    }
    AddRlimit(&out, RLIMIT_DATA, "RLIMIT_DATA", "-d");
  }
  AddRlimit(&out, RLIMIT_AS, "RLIMIT_AS", "-v");
  if (const MemoryCgroupRoom room = ReadMemoryCgroupRoom(); room.bytes != kNoLimit) {
    out.push_back({room.bytes,
                   "the room left under this process's memory cgroup limit (" + room.file + ")",
                   "free memory in the container or raise its memory limit"});
  }
  if (use == MemoryUse::kSharedNamed) {
    struct statvfs vfs;
    if (statvfs("/dev/shm", &vfs) == 0) {
      out.push_back({static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize,
                     "the free space of /dev/shm",
                     "free shared tensors, enlarge /dev/shm (mount -o remount,size=...), or use "
                     "the file_descriptor sharing strategy"});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const MemoryLimit& a, const MemoryLimit& b) { return a.bytes < b.bytes; });
  return out;
}

void CheckMemoryAgainst(uint64_t bytes, const std::vector<MemoryLimit>& limits,
                        const std::string& what) {
  // Every limit exceeded is named, tightest first, each with what to do about it.
  std::vector<const MemoryLimit*> exceeded;
  for (const MemoryLimit& l : limits) {
    if (bytes > l.bytes) exceeded.push_back(&l);
  }
  if (exceeded.empty()) return;
  std::stable_sort(exceeded.begin(), exceeded.end(),
                   [](const MemoryLimit* a, const MemoryLimit* b) { return a->bytes < b->bytes; });
  std::string msg =
      what + ": " + std::to_string(bytes) + " bytes is more than this system can provide: ";
  for (size_t i = 0; i < exceeded.size(); ++i) {
    if (i > 0) msg += "; ";
    msg += exceeded[i]->name + " is " + std::to_string(exceeded[i]->bytes) + " bytes (" +
           exceeded[i]->advice + ")";
  }
  throw Error(ErrorCode::kResourceExhausted, msg);
}

void CheckMemoryAvailable(uint64_t bytes, MemoryUse use, std::string_view what) {
  if (bytes < kFullCheckFrom) {
    // Small requests are on hot paths (a tensor per Queue message): only the process limits,
    // which cost one system call each and which ftruncate turns into SIGXFSZ; nothing is
    // allocated unless one of them is exceeded.
    const bool shared = use != MemoryUse::kPrivate;
    if (!ExceedsRlimit(bytes, RLIMIT_AS) && !(shared && ExceedsRlimit(bytes, RLIMIT_FSIZE))) return;
    std::vector<MemoryLimit> limits;
    if (shared) AddRlimit(&limits, RLIMIT_FSIZE, "RLIMIT_FSIZE", "-f");
    AddRlimit(&limits, RLIMIT_AS, "RLIMIT_AS", "-v");
    CheckMemoryAgainst(bytes, limits, std::string(what));
    return;
  }
  CheckMemoryAgainst(bytes, MemoryLimits(use), std::string(what));
}

}  // namespace forksafe::runtime::internal
