#include "forksafe/mp/entry_point.h"

#include <cstdio>
#include <map>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::mp::internal {
namespace {

struct Registry {
  runtime::internal::Mutex mu;
  // Entries are only ever added: a reference to one stays valid without the lock.
  std::map<std::string, EntryInvoker> by_name FORKSAFE_GUARDED_BY(mu);
  std::map<const void*, std::string> by_fn FORKSAFE_GUARDED_BY(mu);
};

Registry& Reg() {
  static auto* r = [] {
    auto* reg = new Registry();  // leaked: used until the process exits
    // Held across fork, so that a child never inherits it locked by another thread.
    runtime::HoldAcrossFork(&reg->mu, "mp_entry_points");
    return reg;
  }();
  return *r;
}

}  // namespace

bool RegisterEntryPoint(const char* name, const void* fn, EntryInvoker invoker) {
  Registry& r = Reg();
  runtime::internal::MutexLock lk(&r.mu);
  auto it = r.by_name.find(name);
  if (it != r.by_name.end()) {
    if (r.by_fn.count(fn) && r.by_fn[fn] == name) return true;  // same function, twice
    fprintf(stderr,
            "forksafe: FORKSAFE_ENTRY_POINT(%s) names two different functions; the second "
            "registration is ignored. Give one of them another name.\n",
            name);
    return false;
  }
  r.by_name.emplace(name, std::move(invoker));
  r.by_fn.emplace(fn, name);
  return true;
}

const EntryInvoker& FindEntryPoint(const std::string& name) {
  Registry& r = Reg();
  runtime::internal::MutexLock lk(&r.mu);
  auto it = r.by_name.find(name);
  if (it == r.by_name.end()) {
    throw runtime::Error(runtime::ErrorCode::kNotFound,
                         absl::StrCat("no entry point named \"", name,
                                      "\" is registered in this program; add FORKSAFE_ENTRY_POINT(",
                                      name, ") at namespace scope next to the function"));
  }
  return it->second;
}

std::string EntryPointName(const void* fn) {
  Registry& r = Reg();
  runtime::internal::MutexLock lk(&r.mu);
  auto it = r.by_fn.find(fn);
  return it == r.by_fn.end() ? std::string() : it->second;
}

}  // namespace forksafe::mp::internal
