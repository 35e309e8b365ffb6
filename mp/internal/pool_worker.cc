#include "forksafe/mp/internal/pool_worker.h"

#include <cxxabi.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <typeinfo>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/codec.h"
#include "forksafe/mp/entry_point.h"
#include "forksafe/mp/internal/child.h"
#include "forksafe/mp/internal/pool_messages.h"
#include "forksafe/mp/internal/pool_runners.h"
#include "forksafe/mp/process.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp::internal {

using runtime::Error;
using runtime::ErrorCode;

namespace {

// The exception being handled, as the pool reports it.
ChildFailure CurrentFailure() {
  ChildFailure f;
  try {
    throw;
  } catch (const std::exception& e) {
    f.type = Demangle(typeid(e).name());
    f.message = e.what();
  } catch (...) {
    const std::type_info* t = abi::__cxa_current_exception_type();
    f.type = t != nullptr ? Demangle(t->name()) : "unknown";
    f.message = "(not a std::exception)";
  }
  f.traceback = LastThrowTrace();
  return f;
}

// Worker -> parent: Encode(kind, id, payload bytes), payload fds attached
// (mp/internal/pool_messages.h).
void Reply(Connection& c, const std::string& kind, uint64_t id, Message payload) {
  Message m;
  m.fds = std::move(payload.fds);
  EncodeInto(m, kind, id, payload.bytes);
  c.SendMessage(m);
}

}  // namespace

void AddInherited(std::vector<WorkerSetup::InheritedFd>* out, int fd) {
  struct stat st;
  if (fd >= 0 && fstat(fd, &st) == 0) out->push_back({fd, st.st_dev, st.st_ino});
}

void RunWorker(Connection conn, const WorkerSetup& s) {
  if (s.close_fd >= 0) ::close(s.close_fd);  // so that the parent's exit reads as end-of-file
  for (const WorkerSetup::InheritedFd& f : s.close_inherited) {
    struct stat st;
    if (fstat(f.fd, &st) == 0 && st.st_dev == f.dev && st.st_ino == f.ino) ::close(f.fd);
  }
  EnableThrowTraceCapture(/*on=*/true);
  try {
    if (s.initializer) {
      s.initializer();
    } else if (!s.init_entry.empty()) {
      Message args = conn.RecvMessage(std::chrono::duration<double>(60));
      FindEntryPoint(s.init_entry)(args);
    }
  } catch (...) {
    ChildFailure f = CurrentFailure();
    try {
      Reply(conn, "init_failed", static_cast<uint64_t>(getpid()), Encode(f));
    } catch (...) {
    }
    return;
  }
  try {
    Reply(conn, "ready", static_cast<uint64_t>(getpid()), Message());
  } catch (...) {
    return;  // the parent is gone
  }
  int done = 0;
  for (;;) {
    Message msg;
    try {
      msg = conn.RecvMessage(std::nullopt);
    } catch (const Error&) {
      return;  // end of stream: the pool closed our connection
    }
    PoolTask task;
    try {
      task = DecodePoolTask(std::move(msg));
    } catch (const Error& e) {
      // Not a message of our pool's (a bug, or someone else writing to our socket): the stream
      // cannot be trusted after it, so the worker says so and leaves (exit code 0); the pool
      // fails the chunk it held with that word (RemoteError) and starts a replacement.
      std::fprintf(stderr, "forksafe: pool worker %d: a malformed task message (%s); leaving\n",
                   static_cast<int>(getpid()), e.what());
      try {
        Reply(conn, "malformed", 0,
              Encode(ChildFailure{"forksafe::runtime::Error",
                                  absl::StrCat("the worker received a malformed task message (",
                                               e.what(), ") and left"),
                                  ""}));
      } catch (...) {
      }
      return;
    }
    if (task.kind != "task") return;  // "exit"
    const uint64_t id = task.id;
    const TaskFn& fn = task.fn;
    Message& in = task.payload;
    Message out;
    std::string reply = "done";
    EnableThrowTraceCapture(/*on=*/true);  // forget earlier throws
    try {
      switch (fn.kind) {
        case TaskFn::kLocal: {
          auto it = s.locals.find(fn.local_id);
          if (!s.forked || it == s.locals.end()) {
            throw Error(ErrorCode::kInternal, "pool worker: unknown local task function");
          }
          (*it->second)(in, out);
          break;
        }
        case TaskFn::kAddress: {
          if (!s.forked)
            throw Error(ErrorCode::kInternal,
                        "pool worker: address task in a "
                        "worker that was not forked");
          auto runner = reinterpret_cast<RawRunner>(static_cast<uintptr_t>(fn.runner));
          runner(reinterpret_cast<const void*>(static_cast<uintptr_t>(fn.fn)), in, out);
          break;
        }
        case TaskFn::kEntry: {
          RawRunner runner = FindPoolRunner(fn.runner_key);
          runner(RelocateEntry(fn.entry, fn.fn), in, out);
          break;
        }
        default: throw Error(ErrorCode::kInternal, "pool worker: malformed task");
      }
    } catch (...) {
      reply = "error";
      out = Encode(CurrentFailure());
    }
    try {
      Reply(conn, reply, id, std::move(out));
    } catch (const Error& e) {
      if (reply == "error") return;
      // The results could not be sent (e.g. over the size limit): report that instead.
      try {
        Reply(conn, "error", id, Encode(ChildFailure{"forksafe::runtime::Error", e.what(), ""}));
      } catch (...) {
        return;
      }
    }
    if (s.maxtasks > 0 && ++done >= s.maxtasks) return;
  }
}

void ForksafePoolWorkerMain(Connection conn, int32_t maxtasks, std::string init_entry) {
  WorkerSetup s;
  s.maxtasks = maxtasks;
  s.init_entry = std::move(init_entry);
  RunWorker(std::move(conn), s);
}
FORKSAFE_ENTRY_POINT(ForksafePoolWorkerMain);

}  // namespace forksafe::mp::internal
