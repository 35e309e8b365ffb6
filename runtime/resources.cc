#include "forksafe/runtime/resources.h"

#include <map>
#include <mutex>

#include "forksafe/runtime/internal/kept_resources.h"

namespace forksafe::runtime {
namespace internal {
namespace {

struct Source {
  std::function<void(KeptResources&)> report;
  std::function<void()> release;
};

struct Registry {
  std::recursive_mutex mu;  // a releaser may query (or register) again
  std::map<std::string, Source> sources;
};

Registry& TheRegistry() {
  static auto* r = new Registry();  // leaked: used by static initializers and late leak checks
  return *r;
}

}  // namespace

void RegisterKeptResources(const std::string& owner, std::function<void(KeptResources&)> report,
                           std::function<void()> release) {
  Registry& r = TheRegistry();
  std::lock_guard<std::recursive_mutex> lk(r.mu);
  r.sources[owner] = Source{std::move(report), std::move(release)};
}

void UnregisterKeptResources(const std::string& owner) {
  Registry& r = TheRegistry();
  std::lock_guard<std::recursive_mutex> lk(r.mu);
  r.sources.erase(owner);
}

KeptResources QueryKeptResources() {
  Registry& r = TheRegistry();
  std::lock_guard<std::recursive_mutex> lk(r.mu);
  KeptResources out;
  for (auto& [owner, s] : r.sources) {
    if (!s.report) continue;
    try {
      s.report(out);
    } catch (...) {
    }
  }
  return out;
}

}  // namespace internal

void ReleaseCachedResources() {
  internal::Registry& r = internal::TheRegistry();
  std::lock_guard<std::recursive_mutex> lk(r.mu);
  for (auto& [owner, s] : r.sources) {
    if (!s.release) continue;
    try {
      s.release();
    } catch (...) {
    }
  }
}

}  // namespace forksafe::runtime
