// mp/pool.cc: the public side of Pool (mp/pool.h): its errors, construction and the checks of
// every call, the submission of chunks (Enqueue, the lazy imap's feed), close / terminate / join.
// The dispatcher and the workers it owns are mp/internal/pool_dispatcher.cc; the worker loop is
// mp/internal/pool_worker.cc; the runner registry is mp/internal/pool_runners.cc.
#include "forksafe/mp/pool.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/entry_point.h"
#include "forksafe/mp/internal/pool_dispatcher.h"
#include "forksafe/runtime/cpu_budget.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::mp {

using internal::JobState;
using internal::PoolChunk;
using internal::PoolDispatcher;
using internal::PoolTaskSpec;
using internal::TaskFn;
using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::MutexLock;

// ---- errors -------------------------------------------------------------------------------------

namespace {

std::string RemoteMessage(const ChildFailure& f, pid_t pid, const std::string& context) {
  std::string out =
      absl::StrCat(context, " failed in pool worker (pid ", pid, "): ", f.type, ": ", f.message);
  if (!f.traceback.empty()) {
    absl::StrAppend(&out, "\nTraceback (most recent call first):\n", f.traceback);
  }
  return out;
}

std::exception_ptr Cancelled(const std::string& why) {
  return std::make_exception_ptr(Error(ErrorCode::kCancelled, why));
}

std::atomic<int> g_pool_counter{0};

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

// ---- Pool ---------------------------------------------------------------------------------------

Pool::Pool(int processes)
    : Pool([processes] {
        PoolOptions o;
        o.processes = processes;
        return o;
      }()) {}

Pool::Pool(PoolOptions options) : impl_(std::make_unique<PoolDispatcher>()) {
  PoolDispatcher& p = *impl_;
  if (options.processes < 0) {
    throw Error(
        ErrorCode::kInvalidArgument,
        absl::StrCat(
            "Pool: processes must be >= 1 (or 0 for one per CPU this process may use), got ",
            options.processes));
  }
  if (options.maxtasksperchild < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Pool: maxtasksperchild must be >= 1 (or 0 for no limit), got ",
                             options.maxtasksperchild));
  }
  p.method = options.start_method.Resolved();  // an unknown name threw where it was converted
  p.name = options.name.empty() ? absl::StrCat("Pool-", ++g_pool_counter) : options.name;
  // 0: the CPUs this process may use (runtime/cpu_budget.h), not the machine's.
  p.nproc = options.processes > 0 ? options.processes : runtime::DefaultThreadCount();
  if (p.method != StartMethod::kFork) {
    if (options.initializer_fn != nullptr) {
      p.init_entry = internal::EntryPointName(options.initializer_fn);
      if (p.init_entry.empty()) {
        throw Error(ErrorCode::kNotFound,
                    absl::StrCat("Pool \"", p.name,
                                 "\": the initializer function is not "
                                 "registered; add FORKSAFE_ENTRY_POINT(<function name>) at "
                                 "namespace scope so that the \"",
                                 p.method.name(), "\" start method can find it by name"));
      }
      if (!options.initializer_args) {
        throw Error(
            ErrorCode::kInvalidArgument,
            absl::StrCat("Pool \"", p.name, "\": an argument of the initializer ", p.init_entry,
                         " cannot be encoded; give it a cereal serialize() "
                         "function, or use the \"fork\" start method"));
      }
    } else if (options.initializer) {
      throw Error(ErrorCode::kInvalidArgument,
                  absl::StrCat("Pool \"", p.name,
                               "\": PoolOptions::initializer (any callable) "
                               "works only with the \"fork\" start method; under \"",
                               p.method.name(),
                               "\" use set_initializer(&fn, args...) with a "
                               "function registered with FORKSAFE_ENTRY_POINT"));
    }
  }
  p.options = std::move(options);
  p.owner = getpid();
  p.callbacks = std::make_shared<internal::CallbackRunner>(p.name);
  {
    MutexLock lk(&p.intake->mu);
    p.intake->impl = &p;
  }
  p.Start();
}

Pool::~Pool() {
  if (!impl_) return;
  if (getpid() != impl_->owner) {
    // An inherited copy in a forked child: its thread and workers are the parent's.
    (void)impl_.release();
    return;
  }
  {
    MutexLock lk(&impl_->intake->mu);
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
    MutexLock lk(&impl_->mu);
    if (impl_->phase == PoolDispatcher::Phase::kRunning) {
      impl_->phase = PoolDispatcher::Phase::kClosed;
    }
  }
  impl_->Wake();
}

void Pool::terminate() {
  PoolDispatcher& p = *impl_;
  p.CheckOwner("Pool::terminate");
  std::deque<PoolChunk> dropped;
  {
    MutexLock lk(&p.mu);
    p.phase = PoolDispatcher::Phase::kTerminating;
    dropped.swap(p.pending);
  }
  p.Wake();
  for (PoolChunk& c : dropped) {
    p.FailChunk(c, Cancelled(absl::StrCat(c.Describe(),
                                          ": the pool was terminated before this "
                                          "task ran")));
  }
  p.WaitDone(std::nullopt);
  p.callbacks->Stop();  // the callbacks of what finished or failed run before terminate() returns
}

bool Pool::join(Timeout timeout) {
  PoolDispatcher& p = *impl_;
  p.CheckOwner("Pool::join");
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, "Pool::join");
  {
    MutexLock lk(&p.mu);
    if (p.phase == PoolDispatcher::Phase::kRunning) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("Pool::join: pool ", p.name,
                               " is still running; call close() to "
                               "let queued work finish (or terminate() to drop it) before join()"));
    }
  }
  if (!p.WaitDone(deadline)) return false;
  p.callbacks->Stop();  // as Python's join(): every callback has run
  return true;
}

int Pool::processes() const { return impl_->nproc; }
StartMethod Pool::start_method() const { return impl_->method; }

std::vector<pid_t> Pool::pids() const {
  MutexLock lk(&impl_->mu);
  return impl_->pid_snapshot;
}

uint64_t Pool::callback_failures() const { return impl_->callbacks->failures(); }

size_t Pool::LazyWindow() const { return static_cast<size_t>(std::max(1, impl_->nproc)) * 2; }

void Pool::CheckSubmit(const char* what, const internal::FnSpec& fn) const {
  const PoolDispatcher& p = *impl_;
  p.CheckOwner(absl::StrCat("Pool::", what).c_str());
  {
    MutexLock lk(&p.mu);
    if (p.phase != PoolDispatcher::Phase::kRunning) {
      throw Error(ErrorCode::kFailedPrecondition,
                  absl::StrCat("Pool::", what, ": pool ", p.name,
                               " is not running (close() or "
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
  if (p.method == StartMethod::kFork) return;
  if (fn.fn == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Pool::", what,
                             ": only free functions registered with "
                             "FORKSAFE_ENTRY_POINT can run under the \"",
                             p.method.name(),
                             "\" start method (lambdas and functors work only with \"fork\")"));
  }
  if (internal::EntryPointName(fn.fn).empty()) {
    throw Error(ErrorCode::kNotFound,
                absl::StrCat("Pool::", what,
                             ": the function is not registered; add "
                             "FORKSAFE_ENTRY_POINT(<function name>) at namespace scope so that the "
                             "\"",
                             p.method.name(), "\" start method can find it by name"));
  }
}

size_t Pool::ChunkSize(const char* what, size_t n, int chunksize, internal::ChunkRule rule) const {
  const bool pick = rule == internal::ChunkRule::kPickWhenZero;
  if (chunksize < 0 || (chunksize == 0 && !pick)) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("Pool::", what, ": chunksize must be >= 1",
                             pick ? " (or 0 to pick one)" : "", ", got ", chunksize));
  }
  if (chunksize > 0) return static_cast<size_t>(chunksize);
  // Python's rule: about four chunks per worker.
  const size_t per = static_cast<size_t>(impl_->nproc) * 4;
  size_t cs = n / per;
  if (n % per != 0) ++cs;
  return std::max<size_t>(cs, 1);
}

std::shared_ptr<internal::JobState> Pool::Enqueue(const char* what, internal::FnSpec fn,
                                                  std::vector<Message> chunks,
                                                  std::vector<size_t> sizes,
                                                  internal::FailRule fail_rule,
                                                  const Attach& attach) {
  PoolDispatcher& p = *impl_;
  auto job = std::make_shared<JobState>(what, std::move(sizes), fail_rule);
  {
    MutexLock lk(&p.mu);
    p.CheckIntakeLocked(what);
    PoolTaskSpec spec = p.PrepareTaskLocked(fn, *job);
    std::deque<PoolChunk> queued;
    try {
      p.TrackJobLocked(job);
      for (size_t i = 0; i < chunks.size(); ++i) {
        PoolChunk c;
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
    for (PoolChunk& c : queued) p.pending.push_back(std::move(c));
  }
  // Nothing to run: finished now (its callback runs); its local callable was forgotten above.
  if (chunks.empty()) p.PostCallbackIfFinished(job);
  p.Wake();
  return job;
}

// ---- lazy imap ----------------------------------------------------------------------------------

namespace {

// Where an open imap job's chunks go: its pool's queue, while the pool takes work.
class PoolFeed : public internal::LazyFeed {
 public:
  PoolFeed(std::shared_ptr<PoolDispatcher::Intake> intake, std::shared_ptr<JobState> job,
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
    MutexLock ik(&intake_->mu);
    PoolDispatcher* p = intake_->impl;
    const char* why = p == nullptr ? "it was destroyed" : nullptr;
    if (p != nullptr) {
      MutexLock lk(&p->mu);
      if (p->broken) {
        why = "it is broken";
      } else if (p->phase == PoolDispatcher::Phase::kClosed) {
        why = "close() was called";
      } else if (p->phase != PoolDispatcher::Phase::kRunning || p->dispatcher_done) {
        why = "terminate() was called";
      } else {
        PoolChunk c;
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
                               inputs_, " inputs were submitted; the next ", size,
                               " read and "
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
    MutexLock ik(&intake_->mu);
    if (intake_->impl != nullptr) intake_->impl->Finish(job_, last);
  }

 private:
  std::shared_ptr<PoolDispatcher::Intake> intake_;
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
  PoolDispatcher& p = *impl_;
  PoolTaskSpec spec;
  {
    MutexLock lk(&p.mu);
    p.CheckIntakeLocked(what);
    spec = p.PrepareTaskLocked(fn, *job);
    p.TrackJobLocked(job);
  }
  return std::make_unique<PoolFeed>(p.intake, std::move(job), std::move(spec.task),
                                    spec.min_generation);
}

}  // namespace forksafe::mp
