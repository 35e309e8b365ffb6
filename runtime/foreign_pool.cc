#include "forksafe/runtime/foreign_pool.h"

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "forksafe/runtime/error.h"

namespace forksafe::runtime {

struct ForeignPoolGuard::Core {
  explicit Core(ForeignPoolCallbacks c) : callbacks(std::move(c)) {}
  ForeignPoolCallbacks callbacks;
  // Set when the guard was destroyed inside an at-fork callback: its pool is gone, so its
  // callbacks must never run again, although the registration stays until it can be removed.
  std::atomic<bool> gone{false};
  std::atomic<uint64_t> parked{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> resumed{0};
  std::atomic<uint64_t> gave_up{0};
  std::atomic<uint64_t> rebuilt{0};
};

namespace {

// A registration whose guard was destroyed inside an at-fork callback, where the registry
// could not remove it. A lock-free list (pushed to inside fork callbacks, also in a child),
// emptied by the next guard made or destroyed outside one.
struct Orphan {
  const void* handle;
  std::weak_ptr<const void> core;  // expired once the registry dropped the entry by itself
  Orphan* next;
};
std::atomic<Orphan*> g_orphans{nullptr};
std::atomic<bool> g_misuse_said{false};  // the first misuse of the process went to stderr

void AddOrphan(const void* handle, const std::shared_ptr<const void>& core) {
  auto* o = new Orphan{handle, core, g_orphans.load(std::memory_order_relaxed)};
  while (!g_orphans.compare_exchange_weak(o->next, o, std::memory_order_release,
                                          std::memory_order_relaxed)) {
  }
}

void RemoveOrphans() noexcept {
  if (InForkHandler()) return;  // still locked for the fork: the next guard will
  Orphan* o = g_orphans.exchange(nullptr, std::memory_order_acquire);
  while (o != nullptr) {
    // Alive: its entry is still registered under its handle (handles are unique, so nothing
    // else is). Expired: a forked child forgot it (it lived on a vanished thread's stack).
    if (std::shared_ptr<const void> alive = o->core.lock()) {
      try {
        AtForkRegistry::Get().Unregister(o->handle);
      } catch (...) {
        // Gone meanwhile: nothing left to remove.
      }
    }
    Orphan* next = o->next;
    delete o;
    o = next;
  }
}

}  // namespace

ForeignPoolGuard::ForeignPoolGuard(ForeignPoolCallbacks callbacks)
    : core_(std::make_shared<Core>(std::move(callbacks))),
      handler_name_("foreign_pool:" + core_->callbacks.name) {
  const ForeignPoolCallbacks& c = core_->callbacks;
  const char* missing = c.name.empty()        ? "a name"
                        : !c.park             ? "a park callback"
                        : !c.rebuild_in_child ? "a rebuild_in_child callback"
                                              : nullptr;
  if (missing != nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string("ForeignPoolGuard needs ") + missing +
                    ": a pool whose threads are neither parked before a fork nor rebuilt in "
                    "the child is what the guard exists to prevent (see runtime/foreign_pool.h)");
  }
  RemoveOrphans();  // an orphan may hold this very address as its handle
  // The handler shares the core, not the guard: a guard destroyed where it cannot unregister
  // leaves a handler that still has valid (inert) state to look at.
  AtForkHandler h;
  h.name = handler_name_;
  h.prepare = [core = core_](const PrepareAttempt& attempt) {
    if (core->gone.load(std::memory_order_acquire)) return true;  // nothing left to park
    bool ok = false;
    try {
      ok = core->callbacks.park(attempt);
    } catch (...) {
      ok = false;
    }
    (ok ? core->parked : core->refused).fetch_add(1, std::memory_order_relaxed);
    return ok;
  };
  h.parent = [core = core_](bool prepared) {
    if (core->gone.load(std::memory_order_acquire)) return;
    if (!prepared) {
      core->gave_up.fetch_add(1, std::memory_order_relaxed);
      return;  // park refused: nothing was parked, nothing to resume
    }
    core->resumed.fetch_add(1, std::memory_order_relaxed);
    if (core->callbacks.resume) core->callbacks.resume();
  };
  h.child = [core = core_](bool prepared) {
    if (core->gone.load(std::memory_order_acquire)) return;
    if (!prepared) core->gave_up.fetch_add(1, std::memory_order_relaxed);
    core->rebuilt.fetch_add(1, std::memory_order_relaxed);
    core->callbacks.rebuild_in_child(prepared);
  };
  AtForkRegistry::Get().Register(this, std::move(h));
}

ForeignPoolGuard::~ForeignPoolGuard() {
  try {
    AtForkRegistry::Get().Unregister(this);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kFailedPrecondition) {
      // Destroyed inside an at-fork callback (see the last hazard of the header): the registry
      // is locked for this fork. Make the handler inert, leave it for the next guard to
      // remove, and say so where the user looks: the fork's report, and stderr once.
      core_->gone.store(true, std::memory_order_release);
      try {
        AddOrphan(this, core_);
        const std::string detail =
            "the ForeignPoolGuard was destroyed inside an at-fork callback, where the registry "
            "is locked for the fork and cannot unregister it (kFailedPrecondition); its "
            "callbacks are no longer called, and its registration stays, inert, until the next "
            "ForeignPoolGuard is made or destroyed outside a fork callback. Destroy the pool "
            "before fork() or after it returns (runtime/foreign_pool.h, Hazards)";
        AtForkRegistry::ReportEvent(ForkEventKind::kHandlerThrew, handler_name_, detail);
        if (!g_misuse_said.exchange(true)) {
          std::fprintf(stderr, "forksafe: %s: %s\n", handler_name_.c_str(), detail.c_str());
        }
      } catch (...) {
        // Out of memory: the handler is inert all the same.
      }
    }
    // kNotFound: a forked child forgot the registration (the guard lived on the stack of a
    // thread that does not exist there): nothing left to undo.
  } catch (...) {
  }
  RemoveOrphans();
}

ForeignPoolStats ForeignPoolGuard::stats() const {
  ForeignPoolStats s;
  s.parked = core_->parked.load(std::memory_order_relaxed);
  s.refused = core_->refused.load(std::memory_order_relaxed);
  s.resumed = core_->resumed.load(std::memory_order_relaxed);
  s.gave_up = core_->gave_up.load(std::memory_order_relaxed);
  s.rebuilt = core_->rebuilt.load(std::memory_order_relaxed);
  return s;
}

}  // namespace forksafe::runtime
