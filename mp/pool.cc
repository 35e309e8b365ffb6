#include "forksafe/mp/pool.h"

#include <cxxabi.h>
#include <link.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/entry_point.h"
#include "forksafe/mp/internal/child.h"
#include "forksafe/mp/internal/pool_messages.h"
#include "forksafe/mp/internal/shm_sync.h"
#include "forksafe/runtime/cpu_budget.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/loaded_objects.h"

namespace forksafe::mp {

using runtime::Error;
using runtime::ErrorCode;
using internal::Demangle;

// ---- errors -------------------------------------------------------------------------------------

namespace {

std::string RemoteMessage(const ChildFailure& f, pid_t pid, const std::string& context) {
  std::string out = absl::StrCat(context, " failed in pool worker (pid ", pid, "): ", f.type, ": ",
                                 f.message);
  if (!f.traceback.empty()) {
    absl::StrAppend(&out, "\nTraceback (most recent call first):\n", f.traceback);
  }
  return out;
}

std::string DescribeExit(int code) {
  if (code < 0) return absl::StrCat("was killed by signal ", SignalName(-code));
  return absl::StrCat("exited with code ", code);
}

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
  f.traceback = internal::LastThrowTrace();
  return f;
}

std::exception_ptr Cancelled(const std::string& why) {
  return std::make_exception_ptr(Error(ErrorCode::kCancelled, why));
}

}  // namespace

RemoteError::RemoteError(ChildFailure failure, pid_t worker_pid, const std::string& context)
    : Error(ErrorCode::kProcessFailed, RemoteMessage(failure, worker_pid, context)),
      failure_(std::move(failure)),
      pid_(worker_pid) {}

WorkerLostError::WorkerLostError(pid_t worker_pid, int exit_code, const std::string& message)
    : Error(ErrorCode::kProcessFailed, message),
      pid_(worker_pid),
      exit_code_(exit_code),
      signal_name_(exit_code < 0 ? SignalName(-exit_code) : "") {}

// ---- JobState -----------------------------------------------------------------------------------

namespace internal {

// ---- runners and entry points, found by name in spawned workers --------------------------------

namespace {

struct RunnerRegistry {
  std::mutex mu;
  std::map<std::string, RawRunner> by_key;
};

RunnerRegistry& Runners() {
  static auto* r = new RunnerRegistry();  // leaked: used until the process exits
  return *r;
}

RawRunner FindPoolRunner(const std::string& key) {
  RunnerRegistry& r = Runners();
  std::lock_guard<std::mutex> lk(r.mu);
  auto it = r.by_key.find(key);
  if (it == r.by_key.end()) {
    throw Error(ErrorCode::kNotFound,
                absl::StrCat("pool worker: no task runner for the types ", Demangle(key.c_str()),
                             "; the worker must run the same program as the pool's parent"));
  }
  return it->second;
}

// The offset of `addr` in its loaded module (relative to the module's load bias). Loaded modules
// of a spawned copy of this program differ from ours only by their bias (ASLR).
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

// The address, in this process, of the entry point registered as `name`, given its module
// offset in the parent. Every candidate is checked against the registry, so only a registered
// function of that name is ever called.
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

}  // namespace

bool RegisterPoolRunner(const char* key, RawRunner runner) {
  RunnerRegistry& r = Runners();
  std::lock_guard<std::mutex> lk(r.mu);
  r.by_key.emplace(key, runner);
  return true;
}

// ---- the worker side ----------------------------------------------------------------------------

namespace {

// Parent -> worker: Encode(kind "task"|"exit", id, TaskFn, payload bytes), payload fds attached.
// Worker -> parent: Encode(kind, id, payload bytes), payload fds attached. Kinds: "ready" (id =
// pid), "init_failed" (payload ChildFailure), "done" (payload: encoded results), "error"
// (payload ChildFailure).
void Reply(Connection& c, const std::string& kind, uint64_t id, Message payload) {
  Message m;
  m.fds = std::move(payload.fds);
  EncodeInto(m, kind, id, payload.bytes);
  c.SendMessage(m);
}

struct WorkerSetup {
  bool forked = false;
  int maxtasks = 0;
  std::function<void()> initializer;  // fork
  std::string init_entry;             // spawn/forkserver: args arrive on the connection
  std::map<uint64_t, std::shared_ptr<const LocalRunner>> locals;  // fork
  int close_fd = -1;                  // fork: the parent's end, inherited
  // fork: descriptors of other tasks' inputs that were waiting in the parent at the fork; the
  // worker closes each one that is still the same file (device and inode), so that it does not
  // keep a task's Connection open (its reader would never see end-of-file).
  struct InheritedFd {
    int fd;
    dev_t dev;
    ino_t ino;
  };
  std::vector<InheritedFd> close_inherited;
};

// Records `fd` (and the file it is) to be closed in a forked worker.
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
  EnableThrowTraceCapture(true);
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
    EnableThrowTraceCapture(true);  // forget earlier throws
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
          if (!s.forked) throw Error(ErrorCode::kInternal, "pool worker: address task in a "
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
        default:
          throw Error(ErrorCode::kInternal, "pool worker: malformed task");
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
        Reply(conn, "error", id,
              Encode(ChildFailure{"forksafe::runtime::Error", e.what(), ""}));
      } catch (...) {
        return;
      }
    }
    if (s.maxtasks > 0 && ++done >= s.maxtasks) return;
  }
}

}  // namespace

// The entry point of spawn/forkserver workers.
void ForksafePoolWorkerMain(Connection conn, int32_t maxtasks, std::string init_entry) {
  WorkerSetup s;
  s.maxtasks = maxtasks;
  s.init_entry = std::move(init_entry);
  RunWorker(std::move(conn), s);
}
FORKSAFE_ENTRY_POINT(ForksafePoolWorkerMain);

}  // namespace internal

// ---- the parent side ----------------------------------------------------------------------------

namespace {

using internal::Clock;
using internal::JobState;
using internal::TaskFn;

std::atomic<int> g_pool_counter{0};
std::atomic<int> g_worker_counter{0};

constexpr int kMaxStartupFailures = 3;
constexpr auto kStartupDeadline = std::chrono::seconds(60);  // start to "ready"
constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);
constexpr auto kIdlePoll = std::chrono::milliseconds(500);

struct Chunk {
  std::shared_ptr<JobState> job;
  size_t index = 0;
  Message payload;
  std::shared_ptr<const TaskFn> fn;
  uint64_t min_generation = 0;  // fork: workers forked before this local callable cannot run it
  uint64_t task_id = 0;
  bool delivered = false;

  std::string Describe() const {
    const size_t n = job->chunk_size(index);
    const size_t s = job->chunk_start(index);
    return absl::StrCat(job->what(), " chunk ", index + 1, " of ", job->num_chunks(), " (",
                        n == 1 ? absl::StrCat("item ", s)
                               : absl::StrCat("items ", s, "..", s + n - 1),
                        ")");
  }
};

struct Worker {
  enum class State { kStarting, kIdle, kBusy, kRetiring };
  std::string name;
  std::unique_ptr<Process> proc;
  Connection conn;
  pid_t pid = 0;
  uint64_t generation = 0;
  State state = State::kStarting;
  std::optional<Chunk> held;
  int tasks_done = 0;
  bool eof = false;
  bool init_failed = false;
  Clock::time_point retire_deadline{};
  Clock::time_point ready_deadline{};
};

}  // namespace

struct Pool::Impl {
  enum class Phase { kRunning, kClosed, kTerminating };

  PoolOptions options;
  std::string method;
  std::string name;
  int nproc = 1;
  pid_t owner = 0;
  std::string init_entry;  // spawn/forkserver initializer

  // Shared with the callers' threads, under mu.
  mutable std::mutex mu;
  std::condition_variable done_cv;
  Phase phase = Phase::kRunning;
  bool dispatcher_done = false;
  std::deque<Chunk> pending;
  std::map<uint64_t, std::shared_ptr<const internal::LocalRunner>> locals;
  uint64_t next_local_id = 0;
  uint64_t next_task_id = 0;
  std::exception_ptr broken;  // set once: queued and later work fails with it
  std::vector<pid_t> pid_snapshot;
  // Jobs whose results may hold descriptors a forked worker must not inherit (pruned as they go).
  std::vector<std::weak_ptr<JobState>> live_jobs;  // "fork" only
  size_t prune_jobs_at = 64;

  // Remembers a job for StartWorker (fork: what its results hold). Call under mu.
  void TrackJobLocked(const std::shared_ptr<JobState>& job) {
    if (method != "fork") return;
    live_jobs.push_back(job);
    if (live_jobs.size() < prune_jobs_at) return;
    PruneJobsLocked();
    prune_jobs_at = std::max<size_t>(64, 2 * live_jobs.size());
  }
  void PruneJobsLocked() {
    auto dead = std::remove_if(live_jobs.begin(), live_jobs.end(),
                               [](const std::weak_ptr<JobState>& j) { return j.expired(); });
    live_jobs.erase(dead, live_jobs.end());
  }

  // Runs the jobs' callbacks (mp/internal/pool_job.h); shared with its thread.
  std::shared_ptr<internal::CallbackRunner> callbacks;
  // What open imap jobs submit through; cleared (under its mutex) when the Pool is destroyed.
  struct Intake {
    std::mutex mu;
    Impl* impl = nullptr;
  };
  std::shared_ptr<Intake> intake = std::make_shared<Intake>();

  std::mutex join_mu;  // serializes joining the dispatcher thread
  std::thread dispatcher;
  FileDescriptor wake_fd;

  // The dispatcher's own (and the constructor's, before the dispatcher starts).
  std::list<Worker> workers;
  int startup_failures = 0;
  int start_errors = 0;
  Clock::time_point next_start_attempt{};
  Clock::time_point next_liveness{};

  // ---- helpers usable from any thread ----

  void CheckOwner(const char* call) const {
    if (getpid() != owner) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat(call, ": this Pool was created by process ", owner,
                               ", not by this one (pid ", getpid(),
                               "); a forked child cannot use its parent's pool, create a new "
                               "Pool there"));
    }
  }

  void Wake() {
    const uint64_t one = 1;
    (void)!::write(wake_fd.get(), &one, sizeof(one));
  }

  void UpdatePids() {
    std::vector<pid_t> p;
    for (const Worker& w : workers) p.push_back(w.pid);
    std::lock_guard<std::mutex> lk(mu);
    pid_snapshot = std::move(p);
  }

  // Records a chunk's outcome and forgets the job's local callable once the job is finished.
  // Call without mu.
  // Posts the job's callback once it is finished. Call without mu.
  void Finish(const std::shared_ptr<JobState>& job, bool last) {
    if (last && job->local_id) {
      std::lock_guard<std::mutex> lk(mu);
      locals.erase(*job->local_id);
    }
    if (job->has_callback() && job->TakeFinishedEvent()) callbacks->Post(job);
  }
  void FailChunk(Chunk& c, std::exception_ptr e) { Finish(c.job, c.job->Fail(c.index, e)); }
  void CompleteChunk(Chunk& c, Message m) { Finish(c.job, c.job->Complete(c.index, std::move(m))); }

  // Marks the pool broken (first error wins) and fails everything queued.
  void Break(std::exception_ptr e) {
    std::deque<Chunk> dropped;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (!broken) broken = e;
      e = broken;
      dropped.swap(pending);
    }
    for (Chunk& c : dropped) FailChunk(c, e);
  }

  // ---- workers ----

  void StartWorker() {
    Worker w;
    w.name = absl::StrCat(name, "-worker-", ++g_worker_counter);
    auto [parent_end, child_end] = Pipe(true);
    ProcessOptions po{w.name, /*daemon=*/true, method};
    if (method == "fork") {
      internal::WorkerSetup s;
      s.forked = true;
      s.maxtasks = options.maxtasksperchild;
      s.initializer = options.initializer;
      {
        std::lock_guard<std::mutex> lk(mu);  // copied here; nothing is held across the fork
        s.locals = locals;
        w.generation = next_local_id;
        for (const Chunk& c : pending) {
          for (const FileDescriptor& f : c.payload.fds) {
            internal::AddInherited(&s.close_inherited, f.get());
          }
        }
        // Results not collected yet: a worker holding a result's Connection would keep its peer
        // from ever reading end-of-file.
        PruneJobsLocked();
        for (const std::weak_ptr<JobState>& j : live_jobs) {
          std::shared_ptr<JobState> job = j.lock();
          if (!job) continue;
          // Under the job's lock: a result cannot be taken (and its descriptor closed, and the
          // number reused) while its file is identified.
          job->ForEachResultFd([&s](int fd) { internal::AddInherited(&s.close_inherited, fd); });
        }
      }
      for (const Worker& o : workers) {
        // The other workers' channels: a worker holding them would keep them open after the
        // pool closed its end (and after that worker died).
        internal::AddInherited(&s.close_inherited, o.conn.closed() ? -1 : o.conn.fileno());
        if (o.proc) internal::AddInherited(&s.close_inherited, o.proc->report_fd());
        if (!o.held) continue;  // a chunk that could not be delivered waits there
        for (const FileDescriptor& f : o.held->payload.fds) {
          internal::AddInherited(&s.close_inherited, f.get());
        }
      }
      internal::AddInherited(&s.close_inherited, wake_fd.get());
      s.close_fd = parent_end.fileno();
      w.proc = std::make_unique<Process>(
          po, [s = std::move(s)](Connection c) { internal::RunWorker(std::move(c), s); },
          child_end);
    } else {
      w.proc = std::make_unique<Process>(po, &internal::ForksafePoolWorkerMain, child_end,
                                         static_cast<int32_t>(options.maxtasksperchild),
                                         init_entry);
    }
    w.proc->start();
    child_end.close();  // every copy in this process: the worker's death reads as end-of-file
    w.pid = w.proc->pid();
    w.conn = parent_end;
    w.ready_deadline = Clock::now() + kStartupDeadline;
    if (!init_entry.empty() && method != "fork") {
      try {
        w.conn.SendMessage(options.initializer_args());
      } catch (...) {
        w.proc->kill();
        w.proc->join(5.0);
        throw;
      }
    }
    workers.push_back(std::move(w));
    UpdatePids();
  }

  static void KillAndReap(Worker& w, std::chrono::duration<double> grace, int sig) {
    try {
      if (sig == SIGTERM) w.proc->terminate();
      if (!w.proc->join(grace.count())) {
        w.proc->kill();
        w.proc->join(10.0);
      }
    } catch (...) {
    }
  }

  // Reads whatever the worker sent (it may have sent results right before it exited).
  void Drain(Worker& w) {
    while (!w.conn.closed()) {
      bool readable = false;
      try {
        readable = w.conn.poll(0.0);
      } catch (...) {
        break;
      }
      if (!readable) break;
      try {
        Message m = w.conn.RecvMessage(std::nullopt);
        Handle(w, m);
      } catch (const Error&) {
        w.eof = true;
        w.conn.close();
        break;
      }
    }
  }

  void Handle(Worker& w, Message& m) {
    internal::PoolReply reply = internal::DecodePoolReply(std::move(m));
    const std::string& kind = reply.kind;
    const uint64_t id = reply.id;
    Message& p = reply.payload;
    if (kind == "ready") {
      if (w.state == Worker::State::kStarting) w.state = Worker::State::kIdle;
      startup_failures = 0;
      return;
    }
    if (kind == "init_failed") {
      w.init_failed = true;
      ChildFailure f = DecodeAs<ChildFailure>(p);
      Break(std::make_exception_ptr(RemoteError(
          f, w.pid,
          absl::StrCat("the initializer of pool ", name,
                       " (the pool is broken: queued and later work fails with this error)"))));
      return;
    }
    if (kind == "malformed") {  // it leaves: what it held fails with its word
      w.state = Worker::State::kRetiring;
      w.retire_deadline = Clock::now() + std::chrono::seconds(10);
      if (w.held) {
        Chunk c = std::move(*w.held);
        w.held.reset();
        ChildFailure f = DecodeAs<ChildFailure>(p);
        FailChunk(c, std::make_exception_ptr(RemoteError(std::move(f), w.pid, c.Describe())));
      }
      return;
    }
    if ((kind != "done" && kind != "error") || !w.held || w.held->task_id != id) return;
    Chunk c = std::move(*w.held);
    w.held.reset();
    ++w.tasks_done;
    w.state = (options.maxtasksperchild > 0 && w.tasks_done >= options.maxtasksperchild)
                  ? Worker::State::kRetiring  // it exits by itself
                  : Worker::State::kIdle;
    if (w.state == Worker::State::kRetiring) {
      w.retire_deadline = Clock::now() + std::chrono::seconds(10);
    }
    if (kind == "done") {
      CompleteChunk(c, std::move(p));
    } else {
      ChildFailure f = DecodeAs<ChildFailure>(p);
      FailChunk(c, std::make_exception_ptr(RemoteError(std::move(f), w.pid, c.Describe())));
    }
  }

  // The worker is gone (reaped, drained, out of `workers`): settle what it held.
  void Settle(Worker& w) {
    std::optional<int> code;
    std::optional<ChildFailure> report;
    std::string lost;  // why its exit status is unknown (the program reaped it: mp/process.h)
    try {
      report = w.proc->failure();
      code = w.proc->exitcode();
    } catch (const Error& e) {
      lost = e.message();
    } catch (...) {
    }
    // A lost status is not invented: exit code 0 and the process's own words for why (mp/pool.h).
    const int exit_code = code.value_or(0);
    const std::string how =
        lost.empty() ? DescribeExit(exit_code) : absl::StrCat("died (", lost, ")");
    if (w.held) {
      Chunk c = std::move(*w.held);
      w.held.reset();
      if (!c.delivered) {
        std::lock_guard<std::mutex> lk(mu);
        pending.push_front(std::move(c));  // it never reached the worker
      } else {
        std::string msg = absl::StrCat("pool worker ", w.name, " (pid ", w.pid, ") ", how,
                                       " while running ", c.Describe());
        if (report) absl::StrAppend(&msg, " [", report->type, ": ", report->message, "]");
        absl::StrAppend(&msg, "; the task is not retried, and the pool starts a replacement "
                              "worker");
        FailChunk(c, std::make_exception_ptr(WorkerLostError(w.pid, exit_code, msg)));
      }
    }
    if (w.state == Worker::State::kStarting && !w.init_failed) {
      if (++startup_failures >= kMaxStartupFailures) {
        std::string msg = absl::StrCat(
            "pool ", name, " is broken: ", kMaxStartupFailures,
            " workers in a row died before they were ready; the last one (pid ", w.pid, ") ", how);
        if (report) absl::StrAppend(&msg, " [", report->type, ": ", report->message, "]");
        Break(std::make_exception_ptr(WorkerLostError(w.pid, exit_code, msg)));
      }
    }
    w.conn.close();
  }

  void CheckWorkers() {
    const auto now = Clock::now();
    const bool periodic = now >= next_liveness;
    if (periodic) next_liveness = now + kLivenessPeriod;
    for (auto it = workers.begin(); it != workers.end();) {
      Worker& w = *it;
      bool gone = false;
      try {
        if (w.eof) {
          // Its end closed: it is exiting (or dead). Reap it, by force if it lingers.
          if (!w.proc->join(2.0)) KillAndReap(w, std::chrono::seconds(0), SIGKILL);
          gone = true;
        } else if (periodic || w.state == Worker::State::kRetiring) {
          gone = !w.proc->is_alive();
          const bool stuck =
              (w.state == Worker::State::kRetiring && now > w.retire_deadline) ||
              (w.state == Worker::State::kStarting && now > w.ready_deadline);
          if (!gone && stuck) {
            KillAndReap(w, std::chrono::seconds(0), SIGKILL);
            gone = true;
          }
        }
      } catch (...) {
        KillAndReap(w, std::chrono::seconds(0), SIGKILL);
        gone = true;
      }
      if (!gone) {
        ++it;
        continue;
      }
      Drain(w);  // results it sent before it died still count
      Worker dead = std::move(w);
      it = workers.erase(it);
      UpdatePids();  // so that whoever sees its task fail no longer sees its pid
      Settle(dead);
    }
  }

  bool HasPending() {
    std::lock_guard<std::mutex> lk(mu);
    return !pending.empty();
  }

  void StartWorkers(Phase ph) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (broken) return;
    }
    if (!(ph == Phase::kRunning || (ph == Phase::kClosed && HasPending()))) return;
    if (Clock::now() < next_start_attempt) return;
    while (static_cast<int>(workers.size()) < nproc) {
      try {
        StartWorker();
        start_errors = 0;
      } catch (...) {
        if (++start_errors >= kMaxStartupFailures) {
          Break(std::current_exception());
        } else {
          next_start_attempt = Clock::now() + std::chrono::milliseconds(200);
        }
        return;
      }
    }
  }

  void AssignWork() {
    std::vector<Worker*> idle;
    for (Worker& w : workers) {
      if (w.state == Worker::State::kIdle && !w.held) idle.push_back(&w);
    }
    std::vector<Worker*> assigned;
    std::vector<Chunk> dropped;
    std::vector<Worker*> stale;
    {
      std::lock_guard<std::mutex> lk(mu);
      for (auto it = pending.begin(); it != pending.end() && !idle.empty();) {
        if (it->job->fail_fast() && it->job->failed()) {
          dropped.push_back(std::move(*it));
          it = pending.erase(it);
          continue;
        }
        auto w = std::find_if(idle.begin(), idle.end(), [&](Worker* x) {
          return x->generation >= it->min_generation;
        });
        if (w == idle.end()) {
          ++it;
          continue;
        }
        it->task_id = ++next_task_id;
        (*w)->held = std::move(*it);
        it = pending.erase(it);
        assigned.push_back(*w);
        idle.erase(w);
      }
      if (!pending.empty()) stale = idle;  // none of them can run what is left (fork only)
    }
    for (Chunk& c : dropped) {
      FailChunk(c, Cancelled(absl::StrCat(c.Describe(),
                                          " was dropped: another chunk of the same call failed")));
    }
    for (Worker* w : assigned) {
      Chunk& c = *w->held;
      w->state = Worker::State::kBusy;
      Message m;
      m.fds = std::move(c.payload.fds);
      EncodeInto(m, std::string("task"), c.task_id, *c.fn, c.payload.bytes);
      try {
        w->conn.SendMessage(m);
        c.delivered = true;
        c.payload = Message();
      } catch (const Error&) {
        c.payload.fds = std::move(m.fds);  // not delivered: requeued when the worker is settled
        w->eof = true;
      }
    }
    for (Worker* w : stale) {
      try {
        Message m = Encode(std::string("exit"), uint64_t{0}, TaskFn(), std::string());
        w->conn.SendMessage(m);
      } catch (const Error&) {
        w->eof = true;
      }
      w->state = Worker::State::kRetiring;
      w->retire_deadline = Clock::now() + std::chrono::seconds(10);
    }
  }

  bool Drained() {
    for (const Worker& w : workers) {
      if (w.held) return false;
    }
    return !HasPending();
  }

  void Poll() {
    std::vector<pollfd> fds;
    std::vector<Worker*> who;
    fds.push_back({wake_fd.get(), POLLIN, 0});
    who.push_back(nullptr);
    bool active = false;
    for (Worker& w : workers) {
      if (w.state != Worker::State::kIdle) active = true;
      if (w.eof || w.conn.closed()) {
        active = true;
        continue;
      }
      fds.push_back({w.conn.fileno(), POLLIN, 0});
      who.push_back(&w);
    }
    const auto timeout = active ? kLivenessPeriod : kIdlePoll;
    const int rc = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
    if (rc <= 0) return;
    if (fds[0].revents != 0) {
      uint64_t v;
      (void)!::read(wake_fd.get(), &v, sizeof(v));
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) Drain(*who[i]);
    }
  }

  // Kills every worker, failing what they held with `why`.
  void KillAll(const std::string& why) {
    for (Worker& w : workers) {
      try {
        w.proc->terminate();
      } catch (...) {
      }
    }
    const auto deadline = Clock::now() + std::chrono::seconds(1);
    for (Worker& w : workers) {
      const double left = std::max(
          0.0, std::chrono::duration<double>(deadline - Clock::now()).count());
      KillAndReap(w, std::chrono::duration<double>(left), 0);
      if (w.held) {
        Chunk c = std::move(*w.held);
        w.held.reset();
        FailChunk(c, Cancelled(absl::StrCat(c.Describe(), ": ", why)));
      }
      w.conn.close();
    }
    workers.clear();
    UpdatePids();
  }

  // After close(), with nothing left to run: ask the workers to exit, then reap them.
  void StopAll() {
    for (Worker& w : workers) {
      try {
        w.conn.SendMessage(Encode(std::string("exit"), uint64_t{0}, TaskFn(), std::string()));
      } catch (...) {
      }
    }
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    for (Worker& w : workers) {
      const double left = std::max(
          0.0, std::chrono::duration<double>(deadline - Clock::now()).count());
      try {
        if (!w.proc->join(left)) KillAndReap(w, std::chrono::seconds(1), SIGTERM);
      } catch (...) {
      }
      w.conn.close();
    }
    workers.clear();
    UpdatePids();
  }

  void Loop() {
    try {
      for (;;) {
        Phase ph;
        {
          std::lock_guard<std::mutex> lk(mu);
          ph = phase;
        }
        if (ph == Phase::kTerminating) break;
        CheckWorkers();
        StartWorkers(ph);
        FailQueuedIfBroken();  // work queued after the pool broke
        AssignWork();
        if (ph == Phase::kClosed && Drained()) {
          StopAll();
          break;
        }
        Poll();
      }
    } catch (...) {
      Break(std::current_exception());
    }
    KillAll("the pool was terminated before this task finished");
    std::deque<Chunk> left;
    {
      std::lock_guard<std::mutex> lk(mu);
      left.swap(pending);
      dispatcher_done = true;  // with the sweep: Enqueue() refuses from now on
    }
    for (Chunk& c : left) {
      FailChunk(c, Cancelled(absl::StrCat(c.Describe(), ": the pool was terminated before this "
                                                        "task ran")));
    }
    done_cv.notify_all();
  }

  void FailQueuedIfBroken() {
    std::exception_ptr e;
    std::deque<Chunk> dropped;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (!broken) return;
      e = broken;
      dropped.swap(pending);
    }
    for (Chunk& c : dropped) FailChunk(c, e);
  }

  bool WaitDone(internal::Deadline deadline) {
    {
      std::unique_lock<std::mutex> lk(mu);
      if (!deadline) {
        done_cv.wait(lk, [&] { return dispatcher_done; });
      } else if (!done_cv.wait_until(lk, *deadline, [&] { return dispatcher_done; })) {
        return false;
      }
    }
    std::lock_guard<std::mutex> lk(join_mu);
    if (dispatcher.joinable()) dispatcher.join();
    return true;
  }
};

// ---- Pool ---------------------------------------------------------------------------------------

Pool::Pool(int processes) : Pool([processes] {
  PoolOptions o;
  o.processes = processes;
  return o;
}()) {}

Pool::Pool(PoolOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& p = *impl_;
  if (options.processes < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Pool: processes must be >= 1 (or 0 for one per CPU this process may use), got ",
                             options.processes));
  }
  if (options.maxtasksperchild < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Pool: maxtasksperchild must be >= 1 (or 0 for no limit), got ",
                             options.maxtasksperchild));
  }
  p.method = get_context(options.start_method).start_method();  // kInvalidArgument if unknown
  p.name = options.name.empty() ? absl::StrCat("Pool-", ++g_pool_counter) : options.name;
  // 0: the CPUs this process may use (runtime/cpu_budget.h), not the machine's.
  p.nproc = options.processes > 0 ? options.processes : runtime::DefaultThreadCount();
  if (p.method != "fork") {
    if (options.initializer_fn != nullptr) {
      p.init_entry = internal::EntryPointName(options.initializer_fn);
      if (p.init_entry.empty()) {
        throw Error(ErrorCode::kNotFound,
                    absl::StrCat("Pool \"", p.name, "\": the initializer function is not "
                                 "registered; add FORKSAFE_ENTRY_POINT(<function name>) at "
                                 "namespace scope so that the \"", p.method,
                                 "\" start method can find it by name"));
      }
      if (!options.initializer_args) {
        throw Error(ErrorCode::kInvalidArgument,
                    absl::StrCat("Pool \"", p.name, "\": an argument of the initializer ",
                                 p.init_entry, " cannot be encoded; give it a cereal serialize() "
                                 "function, or use the \"fork\" start method"));
      }
    } else if (options.initializer) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("Pool \"", p.name, "\": PoolOptions::initializer (any callable) "
                               "works only with the \"fork\" start method; under \"", p.method,
                               "\" use set_initializer(&fn, args...) with a function registered "
                               "with FORKSAFE_ENTRY_POINT"));
    }
  }
  p.options = std::move(options);
  p.owner = getpid();
  p.callbacks = std::make_shared<internal::CallbackRunner>(p.name);
  p.intake->impl = &p;
  const int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd < 0) runtime::ThrowSystemError("Pool: eventfd", errno);
  p.wake_fd.reset(efd);
  try {
    for (int i = 0; i < p.nproc; ++i) p.StartWorker();
  } catch (...) {
    for (Worker& w : p.workers) {
      Impl::KillAndReap(w, std::chrono::seconds(0), SIGKILL);
    }
    throw;
  }
  p.dispatcher = std::thread([&p] { p.Loop(); });
}

Pool::~Pool() {
  if (!impl_) return;
  if (getpid() != impl_->owner) {
    // An inherited copy in a forked child: its thread and workers are the parent's.
    (void)impl_.release();
    return;
  }
  {
    std::lock_guard<std::mutex> lk(impl_->intake->mu);
    impl_->intake->impl = nullptr;  // open imaps outliving the pool submit nothing more
  }
  try {
    terminate();
  } catch (...) {
  }
}

void Pool::close() {
  impl_->CheckOwner("Pool::close");
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (impl_->phase == Impl::Phase::kRunning) impl_->phase = Impl::Phase::kClosed;
  }
  impl_->Wake();
}

void Pool::terminate() {
  Impl& p = *impl_;
  p.CheckOwner("Pool::terminate");
  std::deque<Chunk> dropped;
  {
    std::lock_guard<std::mutex> lk(p.mu);
    p.phase = Impl::Phase::kTerminating;
    dropped.swap(p.pending);
  }
  p.Wake();
  for (Chunk& c : dropped) {
    p.FailChunk(c, Cancelled(absl::StrCat(c.Describe(), ": the pool was terminated before this "
                                                        "task ran")));
  }
  p.WaitDone(std::nullopt);
  p.callbacks->Stop();  // the callbacks of what finished or failed run before terminate() returns
}

bool Pool::join(Timeout timeout) {
  Impl& p = *impl_;
  p.CheckOwner("Pool::join");
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, "Pool::join");
  {
    std::lock_guard<std::mutex> lk(p.mu);
    if (p.phase == Impl::Phase::kRunning) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("Pool::join: pool ", p.name, " is still running; call close() to "
                               "let queued work finish (or terminate() to drop it) before join()"));
    }
  }
  if (!p.WaitDone(deadline)) return false;
  p.callbacks->Stop();  // as Python's join(): every callback has run
  return true;
}

int Pool::processes() const { return impl_->nproc; }
const std::string& Pool::start_method() const { return impl_->method; }

std::vector<pid_t> Pool::pids() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->pid_snapshot;
}

uint64_t Pool::callback_failures() const { return impl_->callbacks->failures(); }

size_t Pool::LazyWindow() const { return static_cast<size_t>(std::max(1, impl_->nproc)) * 2; }

void Pool::ThrowBadResultCount(const internal::JobState& job, size_t got) {
  throw Error(ErrorCode::kInternal,
              absl::StrCat(job.what(), ": a worker returned ", got,
                           " results for a chunk; the worker and the parent disagree"));
}

void Pool::CheckSubmit(const char* what, const internal::FnSpec& fn) const {
  const Impl& p = *impl_;
  p.CheckOwner(absl::StrCat("Pool::", what).c_str());
  {
    std::lock_guard<std::mutex> lk(p.mu);
    if (p.phase != Impl::Phase::kRunning) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("Pool::", what, ": pool ", p.name, " is not running (close() or "
                               "terminate() was called); create a new Pool"));
    }
    if (p.broken) {
      std::string why;
      try {
        std::rethrow_exception(p.broken);
      } catch (const std::exception& e) {
        why = e.what();
      }
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("Pool::", what, ": pool ", p.name, " is broken: ", why));
    }
  }
  if (p.method == "fork") return;
  if (fn.fn == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Pool::", what, ": only free functions registered with "
                             "FORKSAFE_ENTRY_POINT can run under the \"", p.method,
                             "\" start method (lambdas and functors work only with \"fork\")"));
  }
  if (internal::EntryPointName(fn.fn).empty()) {
    throw Error(ErrorCode::kNotFound,
                absl::StrCat("Pool::", what, ": the function is not registered; add "
                             "FORKSAFE_ENTRY_POINT(<function name>) at namespace scope so that the "
                             "\"", p.method, "\" start method can find it by name"));
  }
}

size_t Pool::ChunkSize(const char* what, size_t n, int chunksize, bool is_map) const {
  if (chunksize < 0 || (chunksize == 0 && !is_map)) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Pool::", what, ": chunksize must be >= 1",
                             is_map ? " (or 0 to pick one)" : "", ", got ", chunksize));
  }
  if (chunksize > 0) return static_cast<size_t>(chunksize);
  // Python's rule: about four chunks per worker.
  const size_t per = static_cast<size_t>(impl_->nproc) * 4;
  size_t cs = n / per;
  if (n % per != 0) ++cs;
  return std::max<size_t>(cs, 1);
}

// What a job's chunks run: its TaskFn, and the worker generation that can run it (fork: workers
// forked before a local callable was registered cannot). Registers the job's local callable.
// Call under p.mu.
struct Pool::TaskSpec {
  std::shared_ptr<const TaskFn> task;
  uint64_t min_generation = 0;
};

Pool::TaskSpec Pool::PrepareTaskLocked(internal::FnSpec& fn, JobState& job) {
  Impl& p = *impl_;
  auto task = std::make_shared<TaskFn>();
  uint64_t min_generation = 0;
  if (fn.local) {
    const uint64_t id = p.next_local_id++;
    job.local_id = id;
    p.locals.emplace(id, fn.local);
    task->kind = TaskFn::kLocal;
    task->local_id = id;
    min_generation = id + 1;
  } else if (p.method == "fork") {
    task->kind = TaskFn::kAddress;
    task->fn = reinterpret_cast<uintptr_t>(fn.fn);
    task->runner = reinterpret_cast<uintptr_t>(fn.runner);
  } else {
    task->kind = TaskFn::kEntry;
    task->entry = internal::EntryPointName(fn.fn);
    task->fn = internal::ModuleOffset(fn.fn);
    task->runner_key = fn.runner_key;
  }
  return TaskSpec{std::move(task), min_generation};
}

namespace {
// Throws kFailedPrecondition when the pool takes no new work. Call under p.mu.
void CheckIntakeLocked(const char* what, const std::string& name, bool running, bool done) {
  if (!running || done) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("Pool::", what, ": pool ", name, " is not running (close() or "
                             "terminate() was called, or it is broken); create a new Pool"));
  }
}
}  // namespace

std::shared_ptr<internal::JobState> Pool::Enqueue(const char* what, internal::FnSpec fn,
                                                  std::vector<Message> chunks,
                                                  std::vector<size_t> sizes, bool fail_fast,
                                                  const Attach& attach) {
  Impl& p = *impl_;
  auto job = std::make_shared<JobState>(what, std::move(sizes), fail_fast);
  {
    std::lock_guard<std::mutex> lk(p.mu);
    CheckIntakeLocked(what, p.name, p.phase == Impl::Phase::kRunning, p.dispatcher_done);
    TaskSpec spec = PrepareTaskLocked(fn, *job);
    std::deque<Chunk> queued;
    try {
      p.TrackJobLocked(job);
      for (size_t i = 0; i < chunks.size(); ++i) {
        Chunk c;
        c.job = job;
        c.index = i;
        c.payload = std::move(chunks[i]);
        c.fn = spec.task;
        c.min_generation = spec.min_generation;
        queued.push_back(std::move(c));
      }
      // The callback holds the job's result (a cycle, broken when it runs): set only once
      // nothing can fail before the job is queued.
      if (attach) attach(job);
    } catch (...) {
      if (job->local_id) p.locals.erase(*job->local_id);
      job->SetCallback(nullptr);
      throw;
    }
    if (chunks.empty() && job->local_id) p.locals.erase(*job->local_id);
    for (Chunk& c : queued) p.pending.push_back(std::move(c));
  }
  if (chunks.empty()) p.Finish(job, true);  // nothing to run: finished now (its callback runs)
  p.Wake();
  return job;
}

// ---- lazy imap --------------------------------------------------------------------------------

namespace {

class PoolFeed : public internal::LazyFeed {
 public:
  PoolFeed(std::shared_ptr<Pool::Impl::Intake> intake, std::shared_ptr<JobState> job,
           std::shared_ptr<const TaskFn> task, uint64_t min_generation)
      : intake_(std::move(intake)),
        job_(std::move(job)),
        task_(std::move(task)),
        min_generation_(min_generation),
        owner_(getpid()) {}
  ~PoolFeed() override { Seal(); }

  void Submit(Message chunk, size_t size) override {
    if (getpid() != owner_) {  // an iterator inherited by a forked child: nothing is the child's
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat(job_->what(), ": this imap belongs to a pool of process ", owner_,
                               "; a forked child (pid ", getpid(), ") cannot feed it"));
    }
    std::lock_guard<std::mutex> ik(intake_->mu);
    Pool::Impl* p = intake_->impl;
    const char* why = p == nullptr ? "it was destroyed" : nullptr;
    if (p != nullptr) {
      std::lock_guard<std::mutex> lk(p->mu);
      if (p->broken) {
        why = "it is broken";
      } else if (p->phase == Pool::Impl::Phase::kClosed) {
        why = "close() was called";
      } else if (p->phase != Pool::Impl::Phase::kRunning || p->dispatcher_done) {
        why = "terminate() was called";
      } else {
        Chunk c;
        c.job = job_;
        c.index = job_->AddChunk(size);
        c.payload = std::move(chunk);
        c.fn = task_;
        c.min_generation = min_generation_;
        p->pending.push_back(std::move(c));
      }
    }
    if (why != nullptr) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat(job_->what(), ": the pool stopped taking work (", why, ") after ",
                               inputs_, " inputs were submitted; the next ", size, " read and "
                               "the rest of the input did not run. Consume an imap over a "
                               "generator or a range before closing its pool"));
    }
    inputs_ += size;
    p->Wake();
  }

  void Seal() override {
    if (sealed_) return;
    sealed_ = true;
    if (getpid() != owner_) return;  // the locks may have been held at the fork: touch nothing
    const bool last = job_->Seal();
    std::lock_guard<std::mutex> ik(intake_->mu);
    if (intake_->impl != nullptr) intake_->impl->Finish(job_, last);
  }

 private:
  std::shared_ptr<Pool::Impl::Intake> intake_;
  std::shared_ptr<JobState> job_;
  std::shared_ptr<const TaskFn> task_;
  uint64_t min_generation_;
  const pid_t owner_;
  size_t inputs_ = 0;  // inputs submitted so far
  bool sealed_ = false;
};

}  // namespace

std::unique_ptr<internal::LazyFeed> Pool::OpenFeed(const char* what, internal::FnSpec fn,
                                                   std::shared_ptr<internal::JobState> job) {
  CheckSubmit(what, fn);
  Impl& p = *impl_;
  TaskSpec spec;
  {
    std::lock_guard<std::mutex> lk(p.mu);
    CheckIntakeLocked(what, p.name, p.phase == Impl::Phase::kRunning, p.dispatcher_done);
    spec = PrepareTaskLocked(fn, *job);
    p.TrackJobLocked(job);
  }
  return std::make_unique<PoolFeed>(p.intake, std::move(job), std::move(spec.task),
                                    spec.min_generation);
}

}  // namespace forksafe::mp
