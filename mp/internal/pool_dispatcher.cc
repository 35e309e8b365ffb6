#include "forksafe/mp/internal/pool_dispatcher.h"

#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/codec.h"
#include "forksafe/mp/entry_point.h"
#include "forksafe/mp/internal/pool_runners.h"
#include "forksafe/mp/internal/pool_worker.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp::internal {

using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::MutexLock;

namespace {

std::atomic<int> g_worker_counter{0};

constexpr int kMaxStartupFailures = 3;
constexpr auto kStartupDeadline = std::chrono::seconds(60);  // start to "ready"
constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);
constexpr auto kIdlePoll = std::chrono::milliseconds(500);

std::string DescribeExit(int code) {
  if (code < 0) return absl::StrCat("was killed by signal ", SignalName(-code));
  return absl::StrCat("exited with code ", code);
}

std::exception_ptr Cancelled(const std::string& why) {
  return std::make_exception_ptr(Error(ErrorCode::kCancelled, why));
}

Message ExitMessage() { return Encode(std::string("exit"), uint64_t{0}, TaskFn(), std::string()); }

}  // namespace

std::string PoolChunk::Describe() const {
  const size_t n = job->chunk_size(index);
  const size_t s = job->chunk_start(index);
  return absl::StrCat(
      job->what(), " chunk ", index + 1, " of ", job->num_chunks(), " (",
      n == 1 ? absl::StrCat("item ", s) : absl::StrCat("items ", s, "..", s + n - 1), ")");
}

// ---- usable from any thread ---------------------------------------------------------------------

void PoolDispatcher::Start() {
  const int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd < 0) runtime::ThrowSystemError("Pool: eventfd", errno);
  wake_fd_.reset(efd);
  try {
    for (int i = 0; i < nproc; ++i) StartWorker();
  } catch (...) {
    for (PoolWorker& w : workers_) KillAndReap(w, std::chrono::seconds(0), SIGKILL);
    throw;
  }
  MutexLock lk(&join_mu_);
  dispatcher_ = std::thread([this] { Loop(); });
}

void PoolDispatcher::CheckOwner(const char* call) const {
  if (getpid() != owner) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat(call, ": this Pool was created by process ", owner,
                             ", not by this one (pid ", getpid(),
                             "); a forked child cannot use its parent's pool, create a new "
                             "Pool there"));
  }
}

void PoolDispatcher::Wake() {
  const uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
}

void PoolDispatcher::CheckIntakeLocked(const char* what) const {
  if (phase != Phase::kRunning || dispatcher_done) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat("Pool::", what, ": pool ", name,
                             " is not running (close() or "
                             "terminate() was called, or it is broken); create a new Pool"));
  }
}

PoolTaskSpec PoolDispatcher::PrepareTaskLocked(FnSpec& fn, JobState& job) {
  auto task = std::make_shared<TaskFn>();
  uint64_t min_generation = 0;
  if (fn.local) {
    const uint64_t id = next_local_id++;
    job.local_id = id;
    locals.emplace(id, fn.local);
    task->kind = TaskFn::kLocal;
    task->local_id = id;
    min_generation = id + 1;
  } else if (method == StartMethod::kFork) {
    task->kind = TaskFn::kAddress;
    task->fn = reinterpret_cast<uintptr_t>(fn.fn);
    task->runner = reinterpret_cast<uintptr_t>(fn.runner);
  } else {
    task->kind = TaskFn::kEntry;
    task->entry = EntryPointName(fn.fn);
    task->fn = ModuleOffset(fn.fn);
    task->runner_key = fn.runner_key;
  }
  return PoolTaskSpec{std::move(task), min_generation};
}

void PoolDispatcher::TrackJobLocked(const std::shared_ptr<JobState>& job) {
  if (method != StartMethod::kFork) return;
  live_jobs_.push_back(job);
  if (live_jobs_.size() < prune_jobs_at_) return;
  PruneJobsLocked();
  prune_jobs_at_ = std::max<size_t>(64, 2 * live_jobs_.size());
}

void PoolDispatcher::PruneJobsLocked() {
  auto dead = std::remove_if(live_jobs_.begin(), live_jobs_.end(),
                             [](const std::weak_ptr<JobState>& j) { return j.expired(); });
  live_jobs_.erase(dead, live_jobs_.end());
}

void PoolDispatcher::Finish(const std::shared_ptr<JobState>& job, bool last) {
  if (last && job->local_id) {
    MutexLock lk(&mu);
    locals.erase(*job->local_id);
  }
  PostCallbackIfFinished(job);
}

void PoolDispatcher::PostCallbackIfFinished(const std::shared_ptr<JobState>& job) {
  if (job->has_callback() && job->TakeFinishedEvent()) callbacks->Post(job);
}

void PoolDispatcher::FailChunk(PoolChunk& c, std::exception_ptr e) {
  Finish(c.job, c.job->Fail(c.index, e));
}

void PoolDispatcher::CompleteChunk(PoolChunk& c, Message m) {
  Finish(c.job, c.job->Complete(c.index, std::move(m)));
}

bool PoolDispatcher::WaitDone(Deadline deadline) {
  {
    MutexLock lk(&mu);
    if (!deadline) {
      while (!dispatcher_done) done_cv_.Wait(&lk);
    } else {
      while (!dispatcher_done) {
        if (!done_cv_.WaitUntil(&lk, *deadline) && !dispatcher_done) return false;
      }
    }
  }
  MutexLock lk(&join_mu_);
  if (dispatcher_.joinable()) dispatcher_.join();
  return true;
}

void PoolDispatcher::Break(std::exception_ptr e) {
  std::deque<PoolChunk> dropped;
  {
    MutexLock lk(&mu);
    if (!broken) broken = e;
    e = broken;
    dropped.swap(pending);
  }
  for (PoolChunk& c : dropped) FailChunk(c, e);
}

bool PoolDispatcher::HasPending() {
  MutexLock lk(&mu);
  return !pending.empty();
}

void PoolDispatcher::UpdatePids() {
  std::vector<pid_t> p;
  for (const PoolWorker& w : workers_) p.push_back(w.pid);
  MutexLock lk(&mu);
  pid_snapshot = std::move(p);
}

// ---- workers ------------------------------------------------------------------------------------

void PoolDispatcher::StartWorker() {
  PoolWorker w;
  w.name = absl::StrCat(name, "-worker-", ++g_worker_counter);
  auto [parent_end, child_end] = Pipe(/*duplex=*/true);
  ProcessOptions po{w.name, /*daemon=*/true, method};
  if (method == StartMethod::kFork) {
    WorkerSetup s;
    s.forked = true;
    s.maxtasks = options.maxtasksperchild;
    s.initializer = options.initializer;
    {
      MutexLock lk(&mu);  // copied here; nothing is held across the fork
      s.locals = locals;
      w.generation = next_local_id;
      for (const PoolChunk& c : pending) {
        for (const FileDescriptor& f : c.payload.fds) AddInherited(&s.close_inherited, f.get());
      }
      // Results not collected yet: a worker holding a result's Connection would keep its peer
      // from ever reading end-of-file.
      PruneJobsLocked();
      for (const std::weak_ptr<JobState>& j : live_jobs_) {
        std::shared_ptr<JobState> job = j.lock();
        if (!job) continue;
        // Under the job's lock: a result cannot be taken (and its descriptor closed, and the
        // number reused) while its file is identified.
        job->ForEachResultFd([&s](int fd) { AddInherited(&s.close_inherited, fd); });
      }
    }
    for (const PoolWorker& o : workers_) {
      // The other workers' channels: a worker holding them would keep them open after the
      // pool closed its end (and after that worker died).
      AddInherited(&s.close_inherited, o.conn.closed() ? -1 : o.conn.fileno());
      if (o.proc) AddInherited(&s.close_inherited, o.proc->report_fd());
      if (!o.held) continue;  // a chunk that could not be delivered waits there
      for (const FileDescriptor& f : o.held->payload.fds) {
        AddInherited(&s.close_inherited, f.get());
      }
    }
    AddInherited(&s.close_inherited, wake_fd_.get());
    s.close_fd = parent_end.fileno();
    w.proc = std::make_unique<Process>(
        po, [s = std::move(s)](Connection c) { RunWorker(std::move(c), s); }, child_end);
  } else {
    w.proc = std::make_unique<Process>(po, &ForksafePoolWorkerMain, child_end,
                                       static_cast<int32_t>(options.maxtasksperchild), init_entry);
  }
  w.proc->start();
  child_end.close();  // every copy in this process: the worker's death reads as end-of-file
  w.pid = w.proc->pid();
  w.conn = parent_end;
  w.ready_deadline = Clock::now() + kStartupDeadline;
  if (!init_entry.empty() && method != StartMethod::kFork) {
    try {
      w.conn.SendMessage(options.initializer_args());
    } catch (...) {
      w.proc->kill();
      w.proc->join(5.0);
      throw;
    }
  }
  workers_.push_back(std::move(w));
  UpdatePids();
}

void PoolDispatcher::KillAndReap(PoolWorker& w, std::chrono::duration<double> grace, int sig) {
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
void PoolDispatcher::Drain(PoolWorker& w) {
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

void PoolDispatcher::Handle(PoolWorker& w, Message& m) {
  PoolReply reply = DecodePoolReply(std::move(m));
  const std::string& kind = reply.kind;
  const uint64_t id = reply.id;
  Message& p = reply.payload;
  if (kind == "ready") {
    if (w.state == PoolWorker::State::kStarting) w.state = PoolWorker::State::kIdle;
    startup_failures_ = 0;
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
    w.state = PoolWorker::State::kRetiring;
    w.retire_deadline = Clock::now() + std::chrono::seconds(10);
    if (w.held) {
      PoolChunk c = std::move(*w.held);
      w.held.reset();
      ChildFailure f = DecodeAs<ChildFailure>(p);
      FailChunk(c, std::make_exception_ptr(RemoteError(std::move(f), w.pid, c.Describe())));
    }
    return;
  }
  if ((kind != "done" && kind != "error") || !w.held || w.held->task_id != id) return;
  PoolChunk c = std::move(*w.held);
  w.held.reset();
  ++w.tasks_done;
  w.state = (options.maxtasksperchild > 0 && w.tasks_done >= options.maxtasksperchild)
                ? PoolWorker::State::kRetiring  // it exits by itself
                : PoolWorker::State::kIdle;
  if (w.state == PoolWorker::State::kRetiring) {
    w.retire_deadline = Clock::now() + std::chrono::seconds(10);
  }
  if (kind == "done") {
    CompleteChunk(c, std::move(p));
  } else {
    ChildFailure f = DecodeAs<ChildFailure>(p);
    FailChunk(c, std::make_exception_ptr(RemoteError(std::move(f), w.pid, c.Describe())));
  }
}

// The worker is gone (reaped, drained, out of `workers_`): settle what it held.
void PoolDispatcher::Settle(PoolWorker& w) {
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
    PoolChunk c = std::move(*w.held);
    w.held.reset();
    if (!c.delivered) {
      MutexLock lk(&mu);
      pending.push_front(std::move(c));  // it never reached the worker
    } else {
      std::string msg = absl::StrCat("pool worker ", w.name, " (pid ", w.pid, ") ", how,
                                     " while running ", c.Describe());
      if (report) absl::StrAppend(&msg, " [", report->type, ": ", report->message, "]");
      absl::StrAppend(&msg,
                      "; the task is not retried, and the pool starts a replacement "
                      "worker");
      FailChunk(c, std::make_exception_ptr(WorkerLostError(w.pid, exit_code, msg)));
    }
  }
  if (w.state == PoolWorker::State::kStarting && !w.init_failed) {
    if (++startup_failures_ >= kMaxStartupFailures) {
      std::string msg = absl::StrCat(
          "pool ", name, " is broken: ", kMaxStartupFailures,
          " workers in a row died before they were ready; the last one (pid ", w.pid, ") ", how);
      if (report) absl::StrAppend(&msg, " [", report->type, ": ", report->message, "]");
      Break(std::make_exception_ptr(WorkerLostError(w.pid, exit_code, msg)));
    }
  }
  w.conn.close();
}

void PoolDispatcher::CheckWorkers() {
  const auto now = Clock::now();
  const bool periodic = now >= next_liveness_;
  if (periodic) next_liveness_ = now + kLivenessPeriod;
  for (auto it = workers_.begin(); it != workers_.end();) {
    PoolWorker& w = *it;
    bool gone = false;
    try {
      if (w.eof) {
        // Its end closed: it is exiting (or dead). Reap it, by force if it lingers.
        if (!w.proc->join(2.0)) KillAndReap(w, std::chrono::seconds(0), SIGKILL);
        gone = true;
      } else if (periodic || w.state == PoolWorker::State::kRetiring) {
        gone = !w.proc->is_alive();
        const bool stuck = (w.state == PoolWorker::State::kRetiring && now > w.retire_deadline) ||
                           (w.state == PoolWorker::State::kStarting && now > w.ready_deadline);
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
    PoolWorker dead = std::move(w);
    it = workers_.erase(it);
    UpdatePids();  // so that whoever sees its task fail no longer sees its pid
    Settle(dead);
  }
}

void PoolDispatcher::StartWorkers(Phase ph) {
  {
    MutexLock lk(&mu);
    if (broken) return;
  }
  if (!(ph == Phase::kRunning || (ph == Phase::kClosed && HasPending()))) return;
  if (Clock::now() < next_start_attempt_) return;
  while (static_cast<int>(workers_.size()) < nproc) {
    try {
      StartWorker();
      start_errors_ = 0;
    } catch (...) {
      if (++start_errors_ >= kMaxStartupFailures) {
        Break(std::current_exception());
      } else {
        next_start_attempt_ = Clock::now() + std::chrono::milliseconds(200);
      }
      return;
    }
  }
}

void PoolDispatcher::AssignWork() {
  std::vector<PoolWorker*> idle;
  for (PoolWorker& w : workers_) {
    if (w.state == PoolWorker::State::kIdle && !w.held) idle.push_back(&w);
  }
  std::vector<PoolWorker*> assigned;
  std::vector<PoolChunk> dropped;
  std::vector<PoolWorker*> stale;
  {
    MutexLock lk(&mu);
    for (auto it = pending.begin(); it != pending.end() && !idle.empty();) {
      if (it->job->fail_fast() && it->job->failed()) {
        dropped.push_back(std::move(*it));
        it = pending.erase(it);
        continue;
      }
      const uint64_t min_generation = it->min_generation;
      auto w = std::find_if(idle.begin(), idle.end(), [min_generation](PoolWorker* x) {
        return x->generation >= min_generation;
      });
      if (w == idle.end()) {
        ++it;
        continue;
      }
      it->task_id = ++next_task_id_;
      (*w)->held = std::move(*it);
      it = pending.erase(it);
      assigned.push_back(*w);
      idle.erase(w);
    }
    if (!pending.empty()) stale = idle;  // none of them can run what is left (fork only)
  }
  for (PoolChunk& c : dropped) {
    FailChunk(c, Cancelled(absl::StrCat(c.Describe(),
                                        " was dropped: another chunk of the same call failed")));
  }
  for (PoolWorker* w : assigned) {
    PoolChunk& c = *w->held;
    w->state = PoolWorker::State::kBusy;
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
  for (PoolWorker* w : stale) {
    try {
      Message m = ExitMessage();
      w->conn.SendMessage(m);
    } catch (const Error&) {
      w->eof = true;
    }
    w->state = PoolWorker::State::kRetiring;
    w->retire_deadline = Clock::now() + std::chrono::seconds(10);
  }
}

bool PoolDispatcher::Drained() {
  for (const PoolWorker& w : workers_) {
    if (w.held) return false;
  }
  return !HasPending();
}

void PoolDispatcher::Poll() {
  std::vector<pollfd> fds;
  std::vector<PoolWorker*> who;
  fds.push_back({wake_fd_.get(), POLLIN, 0});
  who.push_back(nullptr);
  bool active = false;
  for (PoolWorker& w : workers_) {
    if (w.state != PoolWorker::State::kIdle) active = true;
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
    (void)!::read(wake_fd_.get(), &v, sizeof(v));
  }
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents != 0) Drain(*who[i]);
  }
}

// Kills every worker, failing what they held with `why`.
void PoolDispatcher::KillAll(const std::string& why) {
  for (PoolWorker& w : workers_) {
    try {
      w.proc->terminate();
    } catch (...) {
    }
  }
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  for (PoolWorker& w : workers_) {
    const double left =
        std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count());
    KillAndReap(w, std::chrono::duration<double>(left), 0);
    if (w.held) {
      PoolChunk c = std::move(*w.held);
      w.held.reset();
      FailChunk(c, Cancelled(absl::StrCat(c.Describe(), ": ", why)));
    }
    w.conn.close();
  }
  workers_.clear();
  UpdatePids();
}

// After close(), with nothing left to run: ask the workers to exit, then reap them.
void PoolDispatcher::StopAll() {
  for (PoolWorker& w : workers_) {
    try {
      w.conn.SendMessage(ExitMessage());
    } catch (...) {
    }
  }
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  for (PoolWorker& w : workers_) {
    const double left =
        std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count());
    try {
      if (!w.proc->join(left)) KillAndReap(w, std::chrono::seconds(1), SIGTERM);
    } catch (...) {
    }
    w.conn.close();
  }
  workers_.clear();
  UpdatePids();
}

void PoolDispatcher::FailQueuedIfBroken() {
  std::exception_ptr e;
  std::deque<PoolChunk> dropped;
  {
    MutexLock lk(&mu);
    if (!broken) return;
    e = broken;
    dropped.swap(pending);
  }
  for (PoolChunk& c : dropped) FailChunk(c, e);
}

void PoolDispatcher::Loop() {
  try {
    for (;;) {
      Phase ph;
      {
        MutexLock lk(&mu);
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
  std::deque<PoolChunk> left;
  {
    MutexLock lk(&mu);
    left.swap(pending);
    dispatcher_done = true;  // with the sweep: Enqueue() refuses from now on
  }
  for (PoolChunk& c : left) {
    FailChunk(c, Cancelled(absl::StrCat(c.Describe(),
                                        ": the pool was terminated before this "
                                        "task ran")));
  }
  done_cv_.NotifyAll();
}

}  // namespace forksafe::mp::internal
