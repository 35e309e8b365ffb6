// mp/internal/manager_server.cc: the manager process (see manager_server.h).
#include "forksafe/mp/internal/manager_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/codec.h"
#include "forksafe/mp/entry_point.h"
#include "forksafe/mp/internal/manager_protocol.h"
#include "forksafe/mp/internal/server_auth.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/internal/process_liveness.h"

namespace forksafe::mp::internal {
namespace {

using runtime::Error;
using runtime::ErrorCode;
using Clock = std::chrono::steady_clock;

constexpr auto kWaitSlice = std::chrono::milliseconds(100);  // how often a waiter checks its client
constexpr std::chrono::seconds kServerHelloTimeout{10};

// The client of a blocked call hung up: abandon the call (and the connection).
struct ClientGone {};

[[noreturn]] void Fail(ErrorCode code, const std::string& msg) { throw Error(code, msg); }

struct Object {
  ManagedKind kind = ManagedKind::kManager;
  // dict: encoded key -> (insertion number, encoded value)
  std::map<std::string, std::pair<uint64_t, std::string>> dict;
  uint64_t next_seq = 0;
  // list, array, queue
  std::vector<std::string> seq;
  std::deque<std::string> queue;
  int64_t maxsize = 0;
  // namespace: attribute -> encoded value
  std::map<std::string, std::string> attrs;
  // value
  std::string value;
  // lock, rlock
  int32_t owner_pid = 0;  // as the owner reported it (with owner_tid: who may release)
  int64_t owner_tid = 0;
  pid_t owner_process = 0;  // the owner's connection's peer, in this process's pid namespace
  int64_t depth = 0;
  // semaphores
  int64_t units = 0;
  int64_t bound = 0;
  // condition
  uint64_t lock_id = 0;
  std::deque<uint64_t> waiters;
  std::vector<uint64_t> notified;
  // event
  bool flag = false;
  // barrier
  int64_t parties = 0;
  int64_t arrived = 0;
  uint64_t generation = 0;
  uint64_t epoch = 0;  // changed by reset(): the waiters of the old epoch fail
  bool broken = false;
};

struct Call {
  const ManagerRequest& req;
  int fd;
  pid_t peer;  // the connection's peer process (PeerProcess), read once per connection
  std::optional<Clock::time_point> deadline;
  runtime::internal::MutexLock* lk;  // the Server's, held for the whole call
  bool Owns(const Object& o) const {
    return o.depth > 0 && o.owner_pid == req.pid && o.owner_tid == req.tid;
  }
};

// The process at the other end of a client connection, as the kernel names it here (the pid a
// client reports may be from another pid namespace); 0 when unknown.
pid_t PeerProcess(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return 0;
  return cred.pid;
}

// A held lock whose owning process has exited (died, or _exit without releasing): the next
// acquirer takes it over and learns it (the reply's 2). Never for an unknown owner (0).
bool OwnerExited(const Object& l) {
  return l.depth > 0 && runtime::internal::ProcessExited(l.owner_process);
}

bool ClientGoneNow(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  // A client sends nothing while its call runs: anything readable is end-of-stream or garbage.
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLIN)) != 0;
}

class Server {
 public:
  explicit Server(std::string name) : name_(std::move(name)) {}

  void Handle(const ManagerRequest& req, ManagerReply& out, int fd, pid_t peer)
      FORKSAFE_LOCKS_EXCLUDED(mu_) {
    runtime::internal::MutexLock lk(&mu_);
    Call c{req, fd, peer, std::nullopt, &lk};
    if (req.timeout >= 0) {
      if (req.timeout < 1e9) {
        c.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(req.timeout));
      }
    } else if (req.timeout != -1) {
      Fail(ErrorCode::kInvalidArgument,
           absl::StrCat("timeout must be >= 0 seconds (or none), got ", req.timeout));
    }
    if (req.op == ManagerOp::kPing) return;
    if (req.op == ManagerOp::kCreate) {
      out.ints.push_back(static_cast<int64_t>(Create(req)));
      return;
    }
    auto it = objects_.find(req.object);
    if (it == objects_.end()) {
      Fail(ErrorCode::kInvalidArgument,
           absl::StrCat("manager ", name_, " holds no object with id ", req.object,
                        " (a proxy of another manager, or a forged or corrupted one)"));
    }
    Object& o = *it->second;
    if (o.kind != req.kind) {
      Fail(ErrorCode::kInvalidArgument,
           absl::StrCat("object ", req.object, " of manager ", name_, " is a ",
                        ManagedKindName(o.kind), ", not a ", ManagedKindName(req.kind),
                        ": the proxy was decoded as the wrong proxy type"));
    }
    struct NotifyAll {  // also when the operation throws (a barrier broken by a timeout)
      runtime::internal::CondVar& cv;
      ~NotifyAll() { cv.NotifyAll(); }
    } notify{cv_};
    Dispatch(c, o, out);
  }

 private:
  uint64_t Create(const ManagerRequest& req) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto o = std::make_unique<Object>();
    o->kind = req.kind;
    auto arg = [&](size_t i) -> int64_t {
      if (i >= req.ints.size()) Fail(ErrorCode::kInvalidArgument, "create: missing parameter");
      return req.ints[i];
    };
    switch (req.kind) {
      case ManagedKind::kDict:
        if (req.blobs.size() % 2 != 0) Fail(ErrorCode::kInvalidArgument, "dict: odd contents");
        for (size_t i = 0; i + 1 < req.blobs.size(); i += 2) {
          auto [pos, fresh] = o->dict.try_emplace(req.blobs[i], o->next_seq, req.blobs[i + 1]);
          if (fresh) {
            ++o->next_seq;
          } else {
            pos->second.second = req.blobs[i + 1];
          }
        }
        break;
      case ManagedKind::kList:
      case ManagedKind::kArray: o->seq = req.blobs; break;
      case ManagedKind::kNamespace:
      case ManagedKind::kLock:
      case ManagedKind::kRLock:
      case ManagedKind::kEvent: break;
      case ManagedKind::kSemaphore:
      case ManagedKind::kBoundedSemaphore:
        o->units = o->bound = arg(0);
        if (o->units < 0) {
          Fail(ErrorCode::kInvalidArgument,
               absl::StrCat(ManagedKindName(req.kind), ": the initial value must be >= 0, got ",
                            o->units));
        }
        break;
      case ManagedKind::kCondition: {
        const uint64_t lock = static_cast<uint64_t>(arg(0));
        if (lock == 0) {
          auto l = std::make_unique<Object>();
          l->kind = ManagedKind::kRLock;  // as Python: a Condition's own lock is an RLock
          o->lock_id = ++next_id_;
          objects_.emplace(o->lock_id, std::move(l));
        } else {
          auto it = objects_.find(lock);
          if (it == objects_.end() ||
              (it->second->kind != ManagedKind::kLock && it->second->kind != ManagedKind::kRLock)) {
            Fail(ErrorCode::kInvalidArgument,
                 absl::StrCat("Condition: object ", lock, " is not a Lock or RLock of manager ",
                              name_));
          }
          o->lock_id = lock;
        }
        break;
      }
      case ManagedKind::kBarrier:
        o->parties = arg(0);
        if (o->parties < 1) {
          Fail(ErrorCode::kInvalidArgument,
               absl::StrCat("Barrier: parties must be >= 1, got ", o->parties));
        }
        break;
      case ManagedKind::kQueue: o->maxsize = arg(0); break;
      case ManagedKind::kValue:
        if (req.blobs.size() != 1) Fail(ErrorCode::kInvalidArgument, "Value: no initial value");
        o->value = req.blobs[0];
        break;
      default:
        Fail(ErrorCode::kInvalidArgument,
             absl::StrCat("manager ", name_, ": cannot create an object of kind ",
                          static_cast<int>(req.kind)));
    }
    const uint64_t id = ++next_id_;
    objects_.emplace(id, std::move(o));
    return id;
  }

  // Waits (releasing mu_) until pred() holds or the call's deadline passes; returns pred().
  template <class Pred>
  bool WaitFor(runtime::internal::MutexLock& lk, const Call& c, Pred pred)
      FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (!pred()) {
      const auto now = Clock::now();
      if (c.deadline && now >= *c.deadline) return pred();
      auto until = now + kWaitSlice;
      if (c.deadline && *c.deadline < until) until = *c.deadline;
      cv_.WaitUntil(&lk, until);
      if (!pred() && ClientGoneNow(c.fd)) throw ClientGone{};
    }
    return true;
  }

  static size_t Index(int64_t i, size_t size, const char* what, bool clamp = false) {
    const int64_t n = static_cast<int64_t>(size);
    int64_t j = i < 0 ? i + n : i;
    if (clamp) return static_cast<size_t>(std::clamp<int64_t>(j, 0, n));
    if (j < 0 || j >= n) {
      Fail(ErrorCode::kInvalidArgument,
           absl::StrCat(
               what, ": index ", i, " is out of range for size ", n,
               n == 0 ? " (it is empty)" : absl::StrCat(" (valid: ", -n, "..", n - 1, ")")));
    }
    return static_cast<size_t>(j);
  }

  static void Need(const ManagerRequest& r, size_t ints, size_t blobs, const char* what) {
    if (r.ints.size() < ints || r.blobs.size() < blobs) {
      Fail(ErrorCode::kInvalidArgument, absl::StrCat(what, ": request lacks arguments"));
    }
  }

  // 0: not taken (no block, or the deadline passed); 1: taken; 2: taken over from an owner
  // process that exited holding it (its data may be half-updated: previous_owner_died()).
  int LockAcquire(Call& c, Object& l, const char* what) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool recursive = l.kind == ManagedKind::kRLock;
    if (c.Owns(l)) {
      if (recursive) {
        ++l.depth;
        return 1;
      }
      if (!c.deadline || *c.deadline > Clock::now()) {
        Fail(ErrorCode::kFailedPrecondition,
             absl::StrCat(what, ": this thread (pid ", c.req.pid, ", tid ", c.req.tid,
                          ") already holds this non-recursive lock; waiting would deadlock "
                          "(use an RLock, or acquire(false))"));
      }
      return 0;
    }
    if (!WaitFor(*c.lk, c, [&] { return l.depth == 0 || OwnerExited(l); })) return 0;
    const bool taken_over = l.depth > 0;
    TakeLock(c, l, 1);
    return taken_over ? 2 : 1;
  }

  static void TakeLock(const Call& c, Object& l, int64_t depth) {
    l.owner_pid = c.req.pid;
    l.owner_tid = c.req.tid;
    l.owner_process = c.peer;
    l.depth = depth;
  }

  void LockRelease(Call& c, Object& l, const char* what) {
    if (!c.Owns(l)) {
      Fail(ErrorCode::kFailedPrecondition,
           l.depth == 0 ? absl::StrCat(what, ": release of an unlocked lock")
                        : absl::StrCat(what, ": the lock is held by pid ", l.owner_pid, " tid ",
                                       l.owner_tid, ", not by the caller (pid ", c.req.pid, " tid ",
                                       c.req.tid, "); only the owner may release it"));
    }
    if (--l.depth == 0) l.owner_pid = 0, l.owner_tid = 0, l.owner_process = 0;
  }

  void Dispatch(Call& c, Object& o, ManagerReply& out) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const ManagerRequest& r = c.req;
    auto bad_op = [&] {
      Fail(ErrorCode::kInvalidArgument,
           absl::StrCat("operation ", static_cast<int>(r.op), " does not apply to a ",
                        ManagedKindName(o.kind)));
    };
    const bool is_seq = o.kind == ManagedKind::kList || o.kind == ManagedKind::kArray;
    switch (r.op) {
      // ---- dict
      case ManagerOp::kDictGet:
      case ManagerOp::kDictGetOpt:
      case ManagerOp::kDictPop: {
        if (o.kind != ManagedKind::kDict) bad_op();
        Need(r, 0, 1, "dict");
        auto it = o.dict.find(r.blobs[0]);
        if (it == o.dict.end()) {
          if (r.op == ManagerOp::kDictGet) Fail(ErrorCode::kNotFound, "key not in the dict");
          return;
        }
        out.blobs.push_back(it->second.second);
        if (r.op == ManagerOp::kDictPop) o.dict.erase(it);
        return;
      }
      case ManagerOp::kDictSet:
      case ManagerOp::kDictUpdate:
        if (o.kind != ManagedKind::kDict || r.blobs.size() % 2 != 0) bad_op();
        for (size_t i = 0; i + 1 < r.blobs.size(); i += 2) {
          auto [pos, fresh] = o.dict.try_emplace(r.blobs[i], o.next_seq, r.blobs[i + 1]);
          if (fresh) {
            ++o.next_seq;
          } else {
            pos->second.second = r.blobs[i + 1];
          }
        }
        return;
      case ManagerOp::kDictSetDefault: {
        if (o.kind != ManagedKind::kDict) bad_op();
        Need(r, 0, 2, "dict.setdefault");
        auto [pos, fresh] = o.dict.try_emplace(r.blobs[0], o.next_seq, r.blobs[1]);
        if (fresh) ++o.next_seq;
        out.blobs.push_back(pos->second.second);
        return;
      }
      case ManagerOp::kDictContains:
        if (o.kind != ManagedKind::kDict) bad_op();
        Need(r, 0, 1, "dict.contains");
        out.ints.push_back(o.dict.count(r.blobs[0]));
        return;
      case ManagerOp::kDictSize:
        if (o.kind != ManagedKind::kDict) bad_op();
        out.ints.push_back(static_cast<int64_t>(o.dict.size()));
        return;
      case ManagerOp::kDictKeys:
      case ManagerOp::kDictValues:
      case ManagerOp::kDictItems: {
        if (o.kind != ManagedKind::kDict) bad_op();
        std::vector<const std::pair<const std::string, std::pair<uint64_t, std::string>>*> v;
        v.reserve(o.dict.size());
        for (const auto& e : o.dict) v.push_back(&e);
        std::sort(v.begin(), v.end(),
                  [](auto* a, auto* b) { return a->second.first < b->second.first; });
        for (auto* e : v) {
          if (r.op != ManagerOp::kDictValues) out.blobs.push_back(e->first);
          if (r.op != ManagerOp::kDictKeys) out.blobs.push_back(e->second.second);
        }
        return;
      }
      case ManagerOp::kDictClear:
        if (o.kind != ManagedKind::kDict) bad_op();
        o.dict.clear();
        return;
      // ---- list and array
      case ManagerOp::kSeqGet:
        if (!is_seq) bad_op();
        Need(r, 1, 0, "get");
        out.blobs.push_back(o.seq[Index(r.ints[0], o.seq.size(), ManagedKindName(o.kind))]);
        return;
      case ManagerOp::kSeqSet:
        if (!is_seq) bad_op();
        Need(r, 1, 1, "set");
        o.seq[Index(r.ints[0], o.seq.size(), ManagedKindName(o.kind))] = r.blobs[0];
        return;
      case ManagerOp::kSeqSize:
        if (!is_seq) bad_op();
        out.ints.push_back(static_cast<int64_t>(o.seq.size()));
        return;
      case ManagerOp::kSeqCopy:
        if (!is_seq) bad_op();
        out.blobs = o.seq;
        return;
      case ManagerOp::kListAppend:
      case ManagerOp::kListExtend:
        if (o.kind != ManagedKind::kList) bad_op();
        o.seq.insert(o.seq.end(), r.blobs.begin(), r.blobs.end());
        return;
      case ManagerOp::kListPop: {
        if (o.kind != ManagedKind::kList) bad_op();
        Need(r, 1, 0, "list.pop");
        if (o.seq.empty()) Fail(ErrorCode::kInvalidArgument, "list.pop: the list is empty");
        const size_t i = Index(r.ints[0], o.seq.size(), "list.pop");
        out.blobs.push_back(std::move(o.seq[i]));
        o.seq.erase(o.seq.begin() + static_cast<ptrdiff_t>(i));
        return;
      }
      case ManagerOp::kListInsert: {
        if (o.kind != ManagedKind::kList) bad_op();
        Need(r, 1, 1, "list.insert");
        const size_t i = Index(r.ints[0], o.seq.size(), "list.insert", /*clamp=*/true);
        o.seq.insert(o.seq.begin() + static_cast<ptrdiff_t>(i), r.blobs[0]);
        return;
      }
      case ManagerOp::kListReverse:
        if (o.kind != ManagedKind::kList) bad_op();
        std::reverse(o.seq.begin(), o.seq.end());
        return;
      case ManagerOp::kListClear:
        if (o.kind != ManagedKind::kList) bad_op();
        o.seq.clear();
        return;
      // ---- namespace
      case ManagerOp::kNsGet: {
        if (o.kind != ManagedKind::kNamespace) bad_op();
        Need(r, 0, 1, "Namespace.get");
        auto it = o.attrs.find(r.blobs[0]);
        if (it == o.attrs.end()) {
          Fail(ErrorCode::kNotFound,
               absl::StrCat("the Namespace has no attribute '", r.blobs[0], "'"));
        }
        out.blobs.push_back(it->second);
        return;
      }
      case ManagerOp::kNsSet:
        if (o.kind != ManagedKind::kNamespace) bad_op();
        Need(r, 0, 2, "Namespace.set");
        o.attrs[r.blobs[0]] = r.blobs[1];
        return;
      case ManagerOp::kNsHas:
      case ManagerOp::kNsErase:
        if (o.kind != ManagedKind::kNamespace) bad_op();
        Need(r, 0, 1, "Namespace");
        out.ints.push_back(r.op == ManagerOp::kNsHas ? o.attrs.count(r.blobs[0])
                                                     : o.attrs.erase(r.blobs[0]));
        return;
      case ManagerOp::kNsNames:
        if (o.kind != ManagedKind::kNamespace) bad_op();
        for (const auto& e : o.attrs) out.blobs.push_back(e.first);
        return;
      // ---- locks, semaphores, condition's lock
      case ManagerOp::kAcquire:
      case ManagerOp::kRelease: Sync(c, o, out); return;
      case ManagerOp::kSemValue:
        if (o.kind != ManagedKind::kSemaphore && o.kind != ManagedKind::kBoundedSemaphore) bad_op();
        out.ints.push_back(o.units);
        return;
      // ---- condition
      case ManagerOp::kCondWait:
      case ManagerOp::kCondNotify:
        if (o.kind != ManagedKind::kCondition) bad_op();
        Condition(c, o, out);
        return;
      // ---- event
      case ManagerOp::kEventSet:
      case ManagerOp::kEventClear:
      case ManagerOp::kEventIsSet:
      case ManagerOp::kEventWait:
        if (o.kind != ManagedKind::kEvent) bad_op();
        if (r.op == ManagerOp::kEventSet) o.flag = true;
        if (r.op == ManagerOp::kEventClear) o.flag = false;
        if (r.op == ManagerOp::kEventWait) WaitFor(*c.lk, c, [&] { return o.flag; });
        out.ints.push_back(o.flag ? 1 : 0);
        return;
      // ---- barrier
      case ManagerOp::kBarrierWait:
      case ManagerOp::kBarrierAbort:
      case ManagerOp::kBarrierReset:
      case ManagerOp::kBarrierInfo:
        if (o.kind != ManagedKind::kBarrier) bad_op();
        Barrier(c, o, out);
        return;
      // ---- queue
      case ManagerOp::kQueuePut:
        if (o.kind != ManagedKind::kQueue) bad_op();
        Need(r, 0, 1, "Queue.put");
        if (o.maxsize > 0 &&
            !WaitFor(*c.lk, c, [&] { return static_cast<int64_t>(o.queue.size()) < o.maxsize; })) {
          Fail(ErrorCode::kDeadlineExceeded,
               absl::StrCat("Queue.put: the queue is full (maxsize ", o.maxsize,
                            ") and stayed full for the timeout; get items, or wait longer"));
        }
        o.queue.push_back(r.blobs[0]);
        return;
      case ManagerOp::kQueueGet:
        if (o.kind != ManagedKind::kQueue) bad_op();
        if (!WaitFor(*c.lk, c, [&] { return !o.queue.empty(); })) {
          Fail(ErrorCode::kDeadlineExceeded,
               "Queue.get: the queue is empty and stayed empty for the timeout");
        }
        out.blobs.push_back(std::move(o.queue.front()));
        o.queue.pop_front();
        return;
      case ManagerOp::kQueueSize:
        if (o.kind != ManagedKind::kQueue) bad_op();
        out.ints = {static_cast<int64_t>(o.queue.size()), o.maxsize};
        return;
      // ---- value
      case ManagerOp::kValueGet:
        if (o.kind != ManagedKind::kValue) bad_op();
        out.blobs.push_back(o.value);
        return;
      case ManagerOp::kValueSet:
        if (o.kind != ManagedKind::kValue) bad_op();
        Need(r, 0, 1, "Value.set");
        o.value = r.blobs[0];
        return;
      default: bad_op();
    }
  }

  void Sync(Call& c, Object& o, ManagerReply& out) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool acquire = c.req.op == ManagerOp::kAcquire;
    switch (o.kind) {
      case ManagedKind::kLock:
      case ManagedKind::kRLock:
      case ManagedKind::kCondition: {
        Object& l = o.kind == ManagedKind::kCondition ? *objects_.at(o.lock_id) : o;
        const char* what = ManagedKindName(o.kind);
        if (acquire) {
          out.ints.push_back(LockAcquire(c, l, what));
        } else {
          LockRelease(c, l, what);
        }
        return;
      }
      case ManagedKind::kSemaphore:
      case ManagedKind::kBoundedSemaphore: {
        const char* what = ManagedKindName(o.kind);
        if (acquire) {
          const bool ok = WaitFor(*c.lk, c, [&] { return o.units > 0; });
          if (ok) --o.units;
          out.ints.push_back(ok ? 1 : 0);
          return;
        }
        const int64_t n = c.req.ints.empty() ? 1 : c.req.ints[0];
        if (n < 1 || n > (int64_t{1} << 40)) {
          Fail(ErrorCode::kInvalidArgument,
               absl::StrCat(what, ".release: n must be >= 1, got ", n));
        }
        if (o.kind == ManagedKind::kBoundedSemaphore && o.units + n > o.bound) {
          Fail(ErrorCode::kFailedPrecondition,
               absl::StrCat("BoundedSemaphore.release: released too many times (value ", o.units,
                            " + ", n, " would exceed the initial value ", o.bound, ")"));
        }
        o.units += n;
        return;
      }
      default:
        Fail(ErrorCode::kInvalidArgument,
             absl::StrCat("acquire/release do not apply to a ", ManagedKindName(o.kind)));
    }
  }

  void Condition(Call& c, Object& o, ManagerReply& out) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Object& l = *objects_.at(o.lock_id);
    if (!c.Owns(l)) {
      Fail(ErrorCode::kFailedPrecondition,
           absl::StrCat("Condition.", c.req.op == ManagerOp::kCondWait ? "wait" : "notify",
                        ": the caller (pid ", c.req.pid, " tid ", c.req.tid,
                        ") does not hold the condition's lock; acquire() it first"));
    }
    if (c.req.op == ManagerOp::kCondNotify) {
      int64_t n = c.req.ints.empty() ? 1 : c.req.ints[0];
      if (n < -1) Fail(ErrorCode::kInvalidArgument, absl::StrCat("Condition.notify: n = ", n));
      while (!o.waiters.empty() && (n == -1 || n-- > 0)) {
        o.notified.push_back(o.waiters.front());
        o.waiters.pop_front();
      }
      return;
    }
    const int64_t depth = l.depth;
    l.depth = 0, l.owner_pid = 0, l.owner_tid = 0, l.owner_process = 0;
    const uint64_t ticket = ++next_ticket_;
    o.waiters.push_back(ticket);
    cv_.NotifyAll();
    auto was_notified = [&] {
      return std::find(o.notified.begin(), o.notified.end(), ticket) != o.notified.end();
    };
    bool notified = false;
    try {
      notified = WaitFor(*c.lk, c, was_notified);
    } catch (const ClientGone&) {
      o.waiters.erase(std::remove(o.waiters.begin(), o.waiters.end(), ticket), o.waiters.end());
      o.notified.erase(std::remove(o.notified.begin(), o.notified.end(), ticket), o.notified.end());
      throw;
    }
    o.waiters.erase(std::remove(o.waiters.begin(), o.waiters.end(), ticket), o.waiters.end());
    o.notified.erase(std::remove(o.notified.begin(), o.notified.end(), ticket), o.notified.end());
    Call forever{c.req, c.fd, c.peer, std::nullopt, c.lk};
    WaitFor(*c.lk, forever, [&] { return l.depth == 0 || OwnerExited(l); });
    TakeLock(c, l, depth);
    out.ints.push_back(notified ? 1 : 0);
  }

  void Barrier(Call& c, Object& o, ManagerReply& out) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    switch (c.req.op) {
      case ManagerOp::kBarrierAbort: o.broken = true; return;
      case ManagerOp::kBarrierReset:
        if (o.arrived > 0) ++o.epoch;
        o.arrived = 0;
        o.broken = false;
        return;
      case ManagerOp::kBarrierInfo: out.ints = {o.parties, o.arrived, o.broken ? 1 : 0}; return;
      default: break;
    }
    auto broken = [] {
      Fail(ErrorCode::kFailedPrecondition,
           "Barrier.wait: the barrier is broken (a party timed out, hung up or called abort(), "
           "or reset() ran while this party waited); reset() it to use it again");
    };
    if (o.broken) broken();
    const int64_t index = o.arrived++;
    if (o.arrived == o.parties) {
      o.arrived = 0;
      ++o.generation;
      out.ints.push_back(index);
      return;
    }
    const uint64_t gen = o.generation, epoch = o.epoch;
    bool passed = false;
    try {
      passed =
          WaitFor(*c.lk, c, [&] { return o.generation != gen || o.broken || o.epoch != epoch; });
    } catch (const ClientGone&) {
      o.broken = true;
      throw;
    }
    if (o.generation != gen) {
      out.ints.push_back(index);
      return;
    }
    if (!passed) {
      o.broken = true;
      Fail(ErrorCode::kDeadlineExceeded,
           absl::StrCat("Barrier.wait: the timeout ran out with ", o.arrived, " of ", o.parties,
                        " parties arrived; the barrier is now broken (reset() it)"));
    }
    broken();
  }

 private:
  // Every call runs under mu_ (waits release it); the Objects are reached only through objects_.
  runtime::internal::Mutex mu_;
  const std::string name_;
  runtime::internal::CondVar cv_;  // any object changed: waiters re-check their condition
  std::unordered_map<uint64_t, std::unique_ptr<Object>> objects_ FORKSAFE_GUARDED_BY(mu_);
  uint64_t next_id_ FORKSAFE_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ FORKSAFE_GUARDED_BY(mu_) = 0;
};

// Serves one client connection until it closes, sends garbage or fails the handshake.
void ServeClient(Server* server, Connection conn, std::string secret) {
  if (!CheckServerHello(conn, secret, "manager", kServerHelloTimeout)) {
    conn.close();
    return;
  }
  const pid_t peer = PeerProcess(conn.fileno());  // a connection's peer never changes
  for (;;) {
    ManagerRequest req;
    try {
      Message m = conn.RecvMessage(std::nullopt);
      Decode(m, req);
      if (req.kind >= ManagedKind::kEnd || req.op >= ManagerOp::kEnd) {
        throw Error(ErrorCode::kInvalidArgument, "unknown kind or operation");
      }
    } catch (const Error&) {
      break;  // end-of-stream, or malformed bytes: drop this connection only
    }
    ManagerReply reply;
    try {
      server->Handle(req, reply, conn.fileno(), peer);
    } catch (const Error& e) {
      reply = ManagerReply{};
      reply.code = static_cast<int32_t>(e.code());
      reply.message = e.message();
    } catch (const ClientGone&) {
      break;
    } catch (const std::exception& e) {  // bad_alloc and the like: report, keep serving
      reply = ManagerReply{};
      reply.code = static_cast<int32_t>(ErrorCode::kInternal);
      reply.message = absl::StrCat("manager: ", e.what());
    }
    try {
      conn.send(reply);
    } catch (const Error&) {
      break;
    }
  }
  conn.close();
}

FileDescriptor Listen(const std::string& socket_name) {
  FileDescriptor fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) runtime::ThrowSystemError("manager: socket", errno);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_name.empty() || socket_name.size() + 1 > sizeof(addr.sun_path)) {
    throw Error(ErrorCode::kInvalidArgument, "manager: bad socket name");
  }
  std::memcpy(addr.sun_path + 1, socket_name.data(), socket_name.size());  // abstract: leading NUL
  const socklen_t len =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + socket_name.size());
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    runtime::ThrowSystemError("manager: bind of its abstract socket", errno);
  }
  if (listen(fd.get(), 128) != 0) runtime::ThrowSystemError("manager: listen", errno);
  return fd;
}

}  // namespace

void ForksafeManagerMain(Connection ctl, std::string secret, std::string socket_name,
                         std::string name) {
  FileDescriptor listener;
  try {
    listener = Listen(socket_name);
  } catch (const Error& e) {
    try {
      ctl.send(std::string("error"), std::string(e.what()));
    } catch (...) {
    }
    return;
  }
  ctl.send(std::string("ready"), std::string());
  auto* server = new Server(name);  // leaked on purpose: client threads use it until _exit
  const uid_t uid = geteuid();
  for (;;) {
    pollfd fds[2] = {{listener.get(), POLLIN, 0}, {ctl.fileno(), POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents != 0) break;  // "shutdown", or end-of-file: the owner is gone
    if ((fds[0].revents & POLLIN) == 0) continue;
    FileDescriptor client(accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!client) continue;
    ucred cred{};
    socklen_t cred_len = sizeof(cred);
    if (getsockopt(client.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0 ||
        cred.uid != uid) {
      std::fprintf(stderr, "forksafe manager %s: refused a connection from uid %d\n", name.c_str(),
                   static_cast<int>(cred.uid));
      continue;
    }
    try {
      std::thread(ServeClient, server, Connection(std::move(client), true, true), secret).detach();
    } catch (const std::system_error&) {
      // out of threads: the client sees end-of-file and reports the manager unreachable
    }
  }
  // Returning exits the process (_exit): serving threads end with it, and so do their clients'
  // connections (end-of-file on their side).
}
FORKSAFE_ENTRY_POINT(ForksafeManagerMain);

}  // namespace forksafe::mp::internal
