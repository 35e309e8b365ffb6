#include "forksafe/runtime/foreign_pool.h"

#include <string>
#include <utility>

#include "forksafe/runtime/error.h"

namespace forksafe::runtime {

ForeignPoolGuard::ForeignPoolGuard(ForeignPoolCallbacks callbacks)
    : callbacks_(std::move(callbacks)), handler_name_("foreign_pool:" + callbacks_.name) {
  const char* missing = callbacks_.name.empty()       ? "a name"
                        : !callbacks_.park             ? "a park callback"
                        : !callbacks_.rebuild_in_child ? "a rebuild_in_child callback"
                                                       : nullptr;
  if (missing != nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string("ForeignPoolGuard needs ") + missing +
                    ": a pool whose threads are neither parked before a fork nor rebuilt in "
                    "the child is what the guard exists to prevent (see runtime/foreign_pool.h)");
  }
  AtForkHandler h;
  h.name = handler_name_;
  h.prepare = [this](const PrepareAttempt& attempt) {
    bool ok = false;
    try {
      ok = callbacks_.park(attempt);
    } catch (...) {
      ok = false;
    }
    (ok ? parked_ : refused_).fetch_add(1, std::memory_order_relaxed);
    return ok;
  };
  h.parent = [this](bool prepared) {
    if (!prepared) {
      gave_up_.fetch_add(1, std::memory_order_relaxed);
      return;  // park refused: nothing was parked, nothing to resume
    }
    resumed_.fetch_add(1, std::memory_order_relaxed);
    if (callbacks_.resume) callbacks_.resume();
  };
  h.child = [this](bool prepared) {
    if (!prepared) gave_up_.fetch_add(1, std::memory_order_relaxed);
    rebuilt_.fetch_add(1, std::memory_order_relaxed);
    callbacks_.rebuild_in_child(prepared);
  };
  AtForkRegistry::Get().Register(this, std::move(h));
}

ForeignPoolGuard::~ForeignPoolGuard() {
  try {
    AtForkRegistry::Get().Unregister(this);
  } catch (...) {
    // Unknown handle (a child forgot it) or called from a handler: nothing left to undo.
  }
}

ForeignPoolStats ForeignPoolGuard::stats() const {
  ForeignPoolStats s;
  s.parked = parked_.load(std::memory_order_relaxed);
  s.refused = refused_.load(std::memory_order_relaxed);
  s.resumed = resumed_.load(std::memory_order_relaxed);
  s.gave_up = gave_up_.load(std::memory_order_relaxed);
  s.rebuilt = rebuilt_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace forksafe::runtime
