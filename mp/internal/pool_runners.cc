#include "forksafe/mp/internal/pool_runners.h"

#include <link.h>

#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/entry_point.h"
#include "forksafe/mp/internal/child.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/loaded_objects.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/internal/thread_annotations.h"

namespace forksafe::mp::internal {

using runtime::Error;
using runtime::ErrorCode;

namespace {

struct RunnerRegistry {
  runtime::internal::Mutex mu;
  std::map<std::string, RawRunner> by_key FORKSAFE_GUARDED_BY(mu);
};

RunnerRegistry& Runners() {
  static auto* r = new RunnerRegistry();  // leaked: used until the process exits
  return *r;
}

}  // namespace

bool RegisterPoolRunner(const char* key, RawRunner runner) {
  RunnerRegistry& r = Runners();
  runtime::internal::MutexLock lk(&r.mu);
  r.by_key.emplace(key, runner);
  return true;
}

RawRunner FindPoolRunner(const std::string& key) {
  RunnerRegistry& r = Runners();
  runtime::internal::MutexLock lk(&r.mu);
  auto it = r.by_key.find(key);
  if (it == r.by_key.end()) {
    throw Error(ErrorCode::kNotFound,
                absl::StrCat("pool worker: no task runner for the types ", Demangle(key.c_str()),
                             "; the worker must run the same program as the pool's parent"));
  }
  return it->second;
}

uint64_t ModuleOffset(const void* addr) {
  struct Search {
    uintptr_t addr;
    uintptr_t bias = 0;
    bool found = false;
  } s{reinterpret_cast<uintptr_t>(addr)};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        auto* s = static_cast<Search*>(data);
        if (!runtime::internal::SegmentsHold(*info, s->addr, 1)) return 0;
        s->bias = info->dlpi_addr;
        s->found = true;
        return 1;
      },
      &s);
  return s.found ? s.addr - s.bias : s.addr;
}

// Every candidate is checked against the registry, so only a registered function of that name is
// ever called.
const void* RelocateEntry(const std::string& name, uint64_t offset) {
  static auto* cache = new std::map<std::string, const void*>();  // workers are one thread
  auto it = cache->find(name);
  if (it != cache->end()) return it->second;
  std::vector<uintptr_t> biases;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        static_cast<std::vector<uintptr_t>*>(data)->push_back(info->dlpi_addr);
        return 0;
      },
      &biases);
  biases.push_back(0);
  for (uintptr_t b : biases) {
    const void* cand = reinterpret_cast<const void*>(b + offset);
    if (EntryPointName(cand) == name) {
      cache->emplace(name, cand);
      return cand;
    }
  }
  // Report the registry's own error when the name is unknown here.
  FindEntryPoint(name);
  throw Error(ErrorCode::kNotFound,
              absl::StrCat("pool worker: the entry point ", name,
                           " is registered but was not found at the parent's address; the "
                           "worker must run the same program as the pool's parent"));
}

}  // namespace forksafe::mp::internal
