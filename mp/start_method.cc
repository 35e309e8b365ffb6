#include "forksafe/mp/start_method.h"

#include "absl/strings/str_cat.h"
#include "forksafe/mp/process.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {

StartMethod::StartMethod(std::string_view name) {
  if (name.empty()) {
    kind_ = kDefault;
  } else if (name == "fork") {
    kind_ = kFork;
  } else if (name == "spawn") {
    kind_ = kSpawn;
  } else if (name == "forkserver") {
    kind_ = kForkServer;
  } else {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                         absl::StrCat("unknown start method \"", std::string(name),
                                      "\"; valid start methods are: fork, spawn, forkserver"));
  }
}

const char* StartMethod::name() const {
  switch (kind_) {
    case kFork: return "fork";
    case kSpawn: return "spawn";
    case kForkServer: return "forkserver";
    case kDefault: break;
  }
  return "";
}

StartMethod StartMethod::Resolved() const {
  return is_default() ? StartMethod(get_start_method()) : *this;
}

}  // namespace forksafe::mp
