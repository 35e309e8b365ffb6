// mp/internal/manager_client.cc: round trips to a manager (see manager_client.h).
#include "forksafe/mp/internal/manager_client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/codec.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/server_auth.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/kept_resources.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::mp::internal {

using runtime::Error;
using runtime::ErrorCode;

const char* ManagedKindName(ManagedKind kind) {
  switch (kind) {
    case ManagedKind::kManager: return "manager";
    case ManagedKind::kDict: return "dict";
    case ManagedKind::kList: return "list";
    case ManagedKind::kNamespace: return "Namespace";
    case ManagedKind::kLock: return "Lock";
    case ManagedKind::kRLock: return "RLock";
    case ManagedKind::kSemaphore: return "Semaphore";
    case ManagedKind::kBoundedSemaphore: return "BoundedSemaphore";
    case ManagedKind::kCondition: return "Condition";
    case ManagedKind::kEvent: return "Event";
    case ManagedKind::kBarrier: return "Barrier";
    case ManagedKind::kQueue: return "Queue";
    case ManagedKind::kValue: return "Value";
    case ManagedKind::kArray: return "Array";
    default: return "unknown kind";
  }
}

namespace {

constexpr size_t kMaxIdlePerManager = 16;

struct Pool {
  runtime::internal::Mutex mu;
  pid_t pid FORKSAFE_GUARDED_BY(mu) = 0;  // the process whose connections `idle` holds
  // by socket name
  std::map<std::string, std::vector<Connection>> idle FORKSAFE_GUARDED_BY(mu);
  std::set<std::string> shut_down FORKSAFE_GUARDED_BY(mu);  // managers shut down by this process

  void CloseAllLocked() FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto& [name, conns] : idle) {
      for (Connection& c : conns) c.close();
    }
    idle.clear();
  }
};

Pool& ThePool() {
  static auto* p = new Pool();
  return *p;
}

// A forked child must not use (or keep) its parent's idle connections: two processes talking on
// one connection would read each other's replies.
const bool g_handlers = [] {
  runtime::HoldAcrossFork(&ThePool().mu, "mp_manager_connections", [] {
    Pool& p = ThePool();
    p.mu.AssertHeld();  // the child's only thread: held, or free after a fork made alone
    // Written only when set: each page the child writes costs it a copy-on-write fault.
    if (!p.idle.empty()) p.CloseAllLocked();
    if (!p.shut_down.empty()) p.shut_down.clear();
    if (p.pid != 0) p.pid = 0;
  });
  runtime::internal::RegisterKeptResources("mp_manager_connections", nullptr, [] {
    Pool& p = ThePool();
    runtime::internal::MutexLock lk(&p.mu);
    p.CloseAllLocked();
  });
  return true;
}();

std::string Who(const ManagerAddress& addr) {
  return absl::StrCat("manager '", addr.name, "' (pid ", addr.pid, ")");
}

[[noreturn]] void ThrowGone(const ManagerAddress& addr, const std::string& what,
                            const std::string& detail) {
  bool shut_down = false;
  {
    Pool& p = ThePool();
    runtime::internal::MutexLock lk(&p.mu);
    shut_down = p.pid == getpid() && p.shut_down.count(addr.socket_name) != 0;
  }
  throw Error(ErrorCode::kClosed,
              absl::StrCat(what, ": ", Who(addr),
                           shut_down ? " was shut down"
                                     : " is gone (it was shut down, or it died: a manager dies "
                                       "with the process that started it)",
                           " (", detail,
                           "); its proxies can no longer be used: start a new "
                           "Manager"));
}

Connection Connect(const ManagerAddress& addr, const std::string& what) {
  FileDescriptor fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) runtime::ThrowSystemError(absl::StrCat(what, ": socket"), errno);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (addr.socket_name.empty() || addr.socket_name.size() + 1 > sizeof(sa.sun_path)) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat(what,
                             ": the proxy holds no valid manager address (a "
                             "default-constructed or corrupted proxy)"));
  }
  std::memcpy(sa.sun_path + 1, addr.socket_name.data(), addr.socket_name.size());
  const socklen_t len =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + addr.socket_name.size());
  // Bounded connect: a blocking AF_UNIX connect waits while the manager's backlog is full (a
  // burst of first calls), and honours SO_SNDTIMEO, so it waits at most kAnswerSlack. (A
  // non-blocking one fails at once with EAGAIN then, and the manager would look gone.)
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(kAnswerSlack.count());
  setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  int rc;
  do {
    rc = connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), len);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    if (err == EAGAIN || err == EINPROGRESS || err == ETIMEDOUT) {
      throw Error(ErrorCode::kDeadlineExceeded,
                  absl::StrCat(what, ": ", Who(addr), " did not accept a connection within ",
                               kAnswerSlack.count(), " s (stopped, or overloaded)"));
    }
    ThrowGone(addr, what, absl::StrCat("connect: ", std::strerror(err)));
  }
  tv = timeval{};
  setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));  // sends are bounded by polls
  Connection c(std::move(fd), true, true);
  try {
    SendServerHello(c, addr.secret);
  } catch (const Error& e) {
    c.close();
    ThrowGone(addr, what, e.message());
  }
  return c;
}

Connection TakeConnection(const ManagerAddress& addr, const std::string& what) {
  {
    Pool& p = ThePool();
    runtime::internal::MutexLock lk(&p.mu);
    if (p.pid != getpid()) {  // inherited without the at-fork handler: never use the parent's
      for (auto& [name, conns] : p.idle) {
        for (Connection& c : conns) c.close();
      }
      p.idle.clear();
      p.shut_down.clear();
      p.pid = getpid();
    }
    auto it = p.idle.find(addr.socket_name);
    if (it != p.idle.end() && !it->second.empty()) {
      Connection c = std::move(it->second.back());
      it->second.pop_back();
      return c;
    }
  }
  return Connect(addr, what);
}

void GiveBack(const ManagerAddress& addr, Connection c) {
  Pool& p = ThePool();
  runtime::internal::MutexLock lk(&p.mu);
  if (p.pid != getpid() || p.shut_down.count(addr.socket_name) != 0) {
    c.close();
    return;
  }
  std::vector<Connection>& v = p.idle[addr.socket_name];
  if (v.size() >= kMaxIdlePerManager) {
    c.close();
    return;
  }
  v.push_back(std::move(c));
}

}  // namespace

int64_t CallerTid() {
  // A forked child's thread has a tid of its own: recompute when the pid changed.
  thread_local pid_t pid = 0;
  thread_local int64_t tid = 0;
  const pid_t now = getpid();
  if (pid != now) {
    pid = now;
    tid = static_cast<int64_t>(syscall(SYS_gettid));
  }
  return tid;
}

ManagerReply CallManager(const ManagerAddress& addr, ManagerRequest& req,
                         std::optional<double> wait_s, const std::string& what) {
  req.pid = static_cast<int32_t>(getpid());
  req.tid = CallerTid();
  req.timeout = wait_s ? *wait_s : -1.0;
  Connection c = TakeConnection(addr, what);
  Message answer;
  try {
    c.SendMessage(Encode(req));
    Timeout limit = std::nullopt;
    if (wait_s) limit = *wait_s + static_cast<double>(kAnswerSlack.count());
    answer = c.RecvMessage(limit);
  } catch (const Error& e) {
    c.close();
    if (e.code() == ErrorCode::kDeadlineExceeded) {
      throw Error(ErrorCode::kDeadlineExceeded,
                  absl::StrCat(what, ": ", Who(addr), " did not answer within ",
                               wait_s ? *wait_s : 0.0, " s + ", kAnswerSlack.count(),
                               " s (stopped, or overloaded); the connection was dropped"));
    }
    if (e.code() == ErrorCode::kInvalidArgument || e.code() == ErrorCode::kResourceExhausted) {
      throw;  // a message over the size limit (the connection is dropped, the manager lives)
    }
    ThrowGone(addr, what, e.message());
  }
  ManagerReply reply;
  try {
    Decode(answer, reply);
  } catch (const Error& e) {
    c.close();
    throw Error(ErrorCode::kInternal,
                absl::StrCat(what, ": malformed reply from ", Who(addr), ": ", e.message()));
  }
  GiveBack(addr, std::move(c));
  if (reply.code >= 0) {
    const auto code = static_cast<ErrorCode>(reply.code);
    if (reply.code > static_cast<int32_t>(ErrorCode::kInternal)) {
      throw Error(ErrorCode::kInternal, absl::StrCat(what, ": ", reply.message));
    }
    throw Error(code, absl::StrCat(what, ": ", reply.message, " [", Who(addr), "]"));
  }
  return reply;
}

void ForgetManager(const std::string& socket_name, bool shut_down) {
  Pool& p = ThePool();
  runtime::internal::MutexLock lk(&p.mu);
  if (p.pid != getpid()) {
    p.CloseAllLocked();
    p.shut_down.clear();
    p.pid = getpid();
  }
  auto it = p.idle.find(socket_name);
  if (it != p.idle.end()) {
    for (Connection& c : it->second) c.close();
    p.idle.erase(it);
  }
  if (shut_down) p.shut_down.insert(socket_name);
}

size_t IdleManagerConnections() {
  Pool& p = ThePool();
  runtime::internal::MutexLock lk(&p.mu);
  size_t n = 0;
  for (const auto& [name, conns] : p.idle) n += conns.size();
  return n;
}

}  // namespace forksafe::mp::internal
