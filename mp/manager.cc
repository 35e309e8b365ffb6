// mp/manager.cc: Manager (the owner's side) and the proxies' out-of-line methods.
#include "forksafe/mp/manager.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/manager_client.h"
#include "forksafe/mp/internal/manager_server.h"
#include "forksafe/mp/internal/server_auth.h"
#include "forksafe/mp/process.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {

using runtime::Error;
using runtime::ErrorCode;

namespace internal {

void ThrowHoldsDescriptors(const char* what) {
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat(what,
                           ": the value holds a file descriptor (a Connection, Queue, "
                           "Lock, tensor, ...), which a manager cannot store; store a "
                           "descriptor-free value instead"));
}

void ThrowNegativeSize(const char* what, int64_t n) {
  throw Error(ErrorCode::kInvalidArgument, absl::StrCat(what, ": the size must be >= 0, got ", n));
}

void ThrowWrongProxy(const std::string& expected, const std::string& got) {
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat("decoding a manager proxy: expected a proxy of type ", expected,
                           " but the bytes hold one of type ", got,
                           "; decode into the proxy type that was encoded"));
}

std::optional<double> WaitSeconds(bool block, const Timeout& timeout, const char* what) {
  const auto wait = CheckedWait(timeout, what);  // validates even without block
  if (!block) return 0.0;
  if (!wait) return std::nullopt;
  return std::chrono::duration<double>(*wait).count();
}

ManagerReply ProxyBase::Call(ManagerOp op, const char* what, std::vector<int64_t> ints,
                             std::vector<std::string> blobs, std::optional<double> wait) const {
  if (addr_ == nullptr) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat(what,
                             ": an empty proxy (default-constructed, not made by a "
                             "Manager nor decoded from one)"));
  }
  ManagerRequest req;
  req.object = id_;
  req.kind = kind_;
  req.op = op;
  req.ints = std::move(ints);
  req.blobs = std::move(blobs);
  return CallManager(*addr_, req, wait, what);
}

}  // namespace internal

namespace {

std::atomic<int> g_manager_counter{0};

bool Flag(const internal::ManagerReply& r) { return r.ints.at(0) != 0; }

}  // namespace

// ---- Manager ------------------------------------------------------------------------------------

struct Manager::Impl {
  std::string name;
  StartMethod method;
  std::shared_ptr<const internal::ManagerAddress> addr;
  std::unique_ptr<Process> proc;
  Connection ctl;
  pid_t owner = 0;
  bool running = false;
};

Manager::Manager(ManagerOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.name = options.name.empty() ? absl::StrCat("Manager-", ++g_manager_counter) : options.name;
  m.method = options.start_method.Resolved();
  const auto start_wait = internal::CheckedWait(options.start_timeout, "Manager: start_timeout");
  auto addr = std::make_shared<internal::ManagerAddress>();
  addr->socket_name = absl::StrCat(
      "forksafe-manager-", absl::BytesToHexString(internal::NewServerSecret().substr(0, 16)));
  addr->secret = internal::NewServerSecret();
  addr->name = m.name;
  auto [mine, theirs] = Pipe(true);
  ProcessOptions po;
  po.name = m.name;
  po.daemon = true;  // never waited for by ~Process: shutdown() stops it
  po.start_method = m.method;
  m.proc = std::make_unique<Process>(po, &internal::ForksafeManagerMain, theirs, addr->secret,
                                     addr->socket_name, m.name);
  try {
    m.proc->start();
  } catch (...) {
    theirs.close();
    mine.close();
    throw;
  }
  theirs.close();  // every copy in this process: the manager's death reads as end-of-file
  m.ctl = mine;
  m.owner = getpid();
  addr->pid = m.proc->pid();
  auto fail = [&](ErrorCode code, const std::string& why) {
    m.ctl.close();
    m.proc->kill();
    m.proc->join(5.0);
    throw Error(code, absl::StrCat("Manager '", m.name, "' (start method ", m.method.name(),
                                   ", pid ", addr->pid, ") did not start: ", why));
  };
  std::string status, detail;
  try {
    Message msg = m.ctl.RecvMessage(start_wait ? Timeout(std::chrono::duration<double>(*start_wait))
                                               : Timeout());
    Decode(msg, status, detail);
  } catch (const Error& e) {
    fail(e.code() == ErrorCode::kDeadlineExceeded ? ErrorCode::kDeadlineExceeded
                                                  : ErrorCode::kProcessFailed,
         absl::StrCat("no word from the manager process (", e.message(), ")"));
  }
  if (status != "ready") fail(ErrorCode::kProcessFailed, detail);
  m.addr = std::move(addr);
  m.running = true;
}

Manager::~Manager() {
  try {
    shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forksafe: ~Manager: %s\n", e.what());
  }
}

Manager::Manager(Manager&&) noexcept = default;

Manager& Manager::operator=(Manager&& o) noexcept {
  if (this != &o) {
    try {
      shutdown();
    } catch (...) {
    }
    impl_ = std::move(o.impl_);
  }
  return *this;
}

void Manager::shutdown() {
  if (!impl_ || !impl_->running) return;
  Impl& m = *impl_;
  m.running = false;
  if (getpid() != m.owner) return;  // a forked copy: the owner stops the manager
  internal::ForgetManager(m.addr->socket_name, /*shut_down=*/true);
  try {
    m.ctl.send(std::string("shutdown"));
  } catch (const Error&) {
    // already gone
  }
  m.ctl.close();
  if (!m.proc->join(5.0)) {
    m.proc->kill();
    m.proc->join(5.0);
  }
  m.proc->close();
}

bool Manager::running() const { return impl_ && impl_->running; }

pid_t Manager::pid() const { return impl_ && impl_->proc ? impl_->proc->pid() : 0; }

const std::string& Manager::name() const {
  static const std::string empty;
  return impl_ ? impl_->name : empty;
}

StartMethod Manager::start_method() const { return impl_ ? impl_->method : StartMethod(); }

internal::ProxyBase Manager::Create(internal::ManagedKind kind, std::vector<int64_t> ints,
                                    std::vector<std::string> blobs) {
  const std::string what = absl::StrCat("Manager::", internal::ManagedKindName(kind));
  if (!running()) {
    throw Error(ErrorCode::kClosed,
                absl::StrCat(what, ": manager '", name(),
                             "' was shut down (or moved from); create objects before shutdown()"));
  }
  internal::ProxyBase manager(impl_->addr, 0, kind);
  const internal::ManagerReply r =
      manager.Call(internal::ManagerOp::kCreate, what.c_str(), std::move(ints), std::move(blobs));
  return internal::ProxyBase(impl_->addr, static_cast<uint64_t>(r.ints.at(0)), kind);
}

ConditionProxy Manager::Condition() {
  return ConditionProxy(Create(internal::ManagedKind::kCondition, {0}));
}

namespace {
void CheckSameManager(const internal::ProxyBase& lock, const internal::ProxyBase& mine,
                      const std::string& manager) {
  if (!lock || !mine || lock.address()->socket_name != mine.address()->socket_name) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Manager::Condition: the lock is not a lock of manager '", manager,
                             "' (an empty proxy, or another manager's); create it with this "
                             "manager's Lock() or RLock()"));
  }
}
}  // namespace

ConditionProxy Manager::Condition(const LockProxy& lock) {
  if (running()) CheckSameManager(lock, internal::ProxyBase(impl_->addr, 0, {}), name());
  return ConditionProxy(
      Create(internal::ManagedKind::kCondition, {static_cast<int64_t>(lock.id())}));
}

ConditionProxy Manager::Condition(const RLockProxy& lock) {
  if (running()) CheckSameManager(lock, internal::ProxyBase(impl_->addr, 0, {}), name());
  return ConditionProxy(
      Create(internal::ManagedKind::kCondition, {static_cast<int64_t>(lock.id())}));
}

// ---- proxies ------------------------------------------------------------------------------------

using internal::ManagerOp;
using internal::WaitSeconds;

bool NamespaceProxy::has(const std::string& name) const {
  return Flag(Call(ManagerOp::kNsHas, "Namespace.has", {}, {name}));
}
bool NamespaceProxy::erase(const std::string& name) {
  return Flag(Call(ManagerOp::kNsErase, "Namespace.erase", {}, {name}));
}
std::vector<std::string> NamespaceProxy::names() const {
  return Call(ManagerOp::kNsNames, "Namespace.names").blobs;
}

// The reply of a Lock/RLock acquire: 0 not taken, 1 taken, 2 taken over from a dead owner.
bool TakenLock(const internal::ManagerReply& r, bool* owner_died) {
  const int64_t v = r.ints.at(0);
  if (v != 0) *owner_died = v == 2;
  return v != 0;
}

bool LockProxy::acquire(bool block, Timeout timeout) {
  return TakenLock(Call(ManagerOp::kAcquire, "Lock.acquire", {}, {},
                        WaitSeconds(block, timeout, "Lock.acquire")),
                   &owner_died_);
}
void LockProxy::release() { Call(ManagerOp::kRelease, "Lock.release"); }

bool RLockProxy::acquire(bool block, Timeout timeout) {
  return TakenLock(Call(ManagerOp::kAcquire, "RLock.acquire", {}, {},
                        WaitSeconds(block, timeout, "RLock.acquire")),
                   &owner_died_);
}
void RLockProxy::release() { Call(ManagerOp::kRelease, "RLock.release"); }

bool SemaphoreProxy::acquire(bool block, Timeout timeout) {
  return Flag(Call(ManagerOp::kAcquire, "Semaphore.acquire", {}, {},
                   WaitSeconds(block, timeout, "Semaphore.acquire")));
}
void SemaphoreProxy::release(int n) { Call(ManagerOp::kRelease, "Semaphore.release", {n}); }
int SemaphoreProxy::get_value() const {
  return static_cast<int>(Call(ManagerOp::kSemValue, "Semaphore.get_value").ints.at(0));
}

bool ConditionProxy::acquire(bool block, Timeout timeout) {
  return Flag(Call(ManagerOp::kAcquire, "Condition.acquire", {}, {},
                   WaitSeconds(block, timeout, "Condition.acquire")));
}
void ConditionProxy::release() { Call(ManagerOp::kRelease, "Condition.release"); }
bool ConditionProxy::wait(Timeout timeout) {
  return Flag(Call(ManagerOp::kCondWait, "Condition.wait", {}, {},
                   WaitSeconds(true, timeout, "Condition.wait")));
}
void ConditionProxy::notify(int n) {
  if (n < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Condition.notify: n must be >= 0, got ", n));
  }
  Call(ManagerOp::kCondNotify, "Condition.notify", {n});
}
void ConditionProxy::notify_all() { Call(ManagerOp::kCondNotify, "Condition.notify_all", {-1}); }

bool EventProxy::is_set() const { return Flag(Call(ManagerOp::kEventIsSet, "Event.is_set")); }
void EventProxy::set() { Call(ManagerOp::kEventSet, "Event.set"); }
void EventProxy::clear() { Call(ManagerOp::kEventClear, "Event.clear"); }
bool EventProxy::wait(Timeout timeout) {
  return Flag(
      Call(ManagerOp::kEventWait, "Event.wait", {}, {}, WaitSeconds(true, timeout, "Event.wait")));
}

int64_t BarrierProxy::wait(Timeout timeout) {
  return Call(ManagerOp::kBarrierWait, "Barrier.wait", {}, {},
              WaitSeconds(true, timeout, "Barrier.wait"))
      .ints.at(0);
}
void BarrierProxy::abort() { Call(ManagerOp::kBarrierAbort, "Barrier.abort"); }
void BarrierProxy::reset() { Call(ManagerOp::kBarrierReset, "Barrier.reset"); }
int64_t BarrierProxy::parties() const {
  return Call(ManagerOp::kBarrierInfo, "Barrier.parties").ints.at(0);
}
int64_t BarrierProxy::n_waiting() const {
  return Call(ManagerOp::kBarrierInfo, "Barrier.n_waiting").ints.at(1);
}
bool BarrierProxy::broken() const {
  return Call(ManagerOp::kBarrierInfo, "Barrier.broken").ints.at(2) != 0;
}

}  // namespace forksafe::mp
