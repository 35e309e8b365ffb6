#include "forksafe/mp/internal/pool_job.h"

#include <unistd.h>

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/internal/shm_sync.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp::internal {

using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::MutexLock;

namespace {
// The job whose callback this thread is running (its own waits do not wait for it).
thread_local const JobState* t_in_callback = nullptr;
}  // namespace

PoolDeadline ToPoolDeadline(const Timeout& timeout, const char* what) {
  return DeadlineAfter(timeout, what);
}

// Constructors are not analysed: no other thread sees the job yet.
JobState::JobState(std::string what, std::vector<size_t> chunk_sizes, FailRule fail_rule)
    : what_(std::move(what)), fail_fast_(fail_rule == FailRule::kFailFast), owner_(getpid()) {
  for (size_t n : chunk_sizes) {
    Record& r = records_[next_chunk_++];
    r.size = n;
    r.start = next_start_;
    next_start_ += n;
  }
  outstanding_ = records_.size();
}

JobState::JobState(std::string what, FailRule fail_rule)
    : what_(std::move(what)),
      fail_fast_(fail_rule == FailRule::kFailFast),
      owner_(getpid()),
      open_(true) {}

void JobState::CheckOwner(const char* call) const {
  if (getpid() != owner_) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat(call, ": this result belongs to a pool of process ", owner_,
                             "; a forked child (pid ", getpid(), ") cannot wait for it"));
  }
}

JobState::Record* JobState::Find(size_t chunk) {
  auto it = records_.find(chunk);
  return it == records_.end() ? nullptr : &it->second;
}

const JobState::Record* JobState::Find(size_t chunk) const {
  auto it = records_.find(chunk);
  return it == records_.end() ? nullptr : &it->second;
}

size_t JobState::num_chunks() const {
  MutexLock lk(&mu_);
  return next_chunk_;
}

size_t JobState::chunk_size(size_t chunk) const {
  MutexLock lk(&mu_);
  const Record* r = Find(chunk);
  return r ? r->size : 0;
}

size_t JobState::chunk_start(size_t chunk) const {
  MutexLock lk(&mu_);
  const Record* r = Find(chunk);
  return r ? r->start : 0;
}

size_t JobState::AddChunk(size_t size) {
  MutexLock lk(&mu_);
  if (!open_) {
    throw Error(ErrorCode::kFailedPrecondition,
                absl::StrCat(what_, ": no more input can be added to a sealed call"));
  }
  const size_t chunk = next_chunk_++;
  Record& r = records_[chunk];
  r.size = size;
  r.start = next_start_;
  next_start_ += size;
  ++outstanding_;
  return chunk;
}

bool JobState::Seal() {
  MutexLock lk(&mu_);
  if (!open_) return false;
  open_ = false;
  cv_.NotifyAll();
  return outstanding_ == 0;
}

void JobState::Release(size_t chunk) {
  MutexLock lk(&mu_);
  Record* r = Find(chunk);
  if (r == nullptr || !r->done) return;
  records_.erase(chunk);
}

bool JobState::FinishedLocked() const {
  return (!open_ && outstanding_ == 0) || (fail_fast_ && first_error_ != nullptr);
}

bool JobState::ReadyLocked() const {
  if (!FinishedLocked()) return false;
  // On a callback thread, other callbacks run after the current one: waiting for them there would
  // wait for ever.
  return !has_callback_ || callback_done_ || t_in_callback != nullptr;
}

bool JobState::Settle(size_t chunk, Message* result, std::exception_ptr error) {
  MutexLock lk(&mu_);
  Record* r = Find(chunk);
  if (r == nullptr || r->done) return false;
  r->done = true;
  if (result != nullptr) {
    r->result = std::move(*result);
  } else {
    r->error = error;
    if (!first_error_) first_error_ = error;
  }
  completion_order_.push_back(chunk);
  --outstanding_;
  cv_.NotifyAll();
  return outstanding_ == 0 && !open_;
}

bool JobState::Complete(size_t chunk, Message result) { return Settle(chunk, &result, nullptr); }

bool JobState::Fail(size_t chunk, std::exception_ptr error) {
  return Settle(chunk, nullptr, std::move(error));
}

bool JobState::TakeFinishedEvent() {
  MutexLock lk(&mu_);
  if (finished_event_taken_ || !FinishedLocked()) return false;
  finished_event_taken_ = true;
  return true;
}

bool JobState::failed() const {
  MutexLock lk(&mu_);
  return first_error_ != nullptr;
}

bool JobState::ready() const {
  CheckOwner("AsyncResult::ready");
  MutexLock lk(&mu_);
  return ReadyLocked();
}

bool JobState::WaitReady(PoolDeadline deadline) const {
  CheckOwner("AsyncResult::wait");
  MutexLock lk(&mu_);
  while (!ReadyLocked()) {
    if (!deadline) {
      cv_.Wait(&lk);
    } else if (!cv_.WaitUntil(&lk, *deadline)) {
      return ReadyLocked();
    }
  }
  return true;
}

bool JobState::WaitChunk(size_t chunk, PoolDeadline deadline) const {
  CheckOwner("ResultIterator::next");
  MutexLock lk(&mu_);
  for (;;) {
    const Record* r = Find(chunk);
    if (r == nullptr || r->done) return true;
    if (!deadline) {
      cv_.Wait(&lk);
    } else if (!cv_.WaitUntil(&lk, *deadline)) {
      r = Find(chunk);
      return r == nullptr || r->done;
    }
  }
}

std::optional<size_t> JobState::WaitCompletion(size_t n, PoolDeadline deadline) const {
  CheckOwner("ResultIterator::next");
  MutexLock lk(&mu_);
  while (completion_base_ + completion_order_.size() <= n) {
    if (!deadline) {
      cv_.Wait(&lk);
    } else if (!cv_.WaitUntil(&lk, *deadline) && completion_base_ + completion_order_.size() <= n) {
      return std::nullopt;
    }
  }
  const size_t chunk = n >= completion_base_ ? completion_order_[n - completion_base_] : 0;
  // The iterator reads completions in order, once each: what is before n is consumed.
  while (completion_base_ < n && !completion_order_.empty()) {
    completion_order_.pop_front();
    ++completion_base_;
  }
  return chunk;
}

std::exception_ptr JobState::error(size_t chunk) const {
  MutexLock lk(&mu_);
  const Record* r = Find(chunk);
  return r ? r->error : nullptr;
}

std::exception_ptr JobState::first_error() const {
  MutexLock lk(&mu_);
  return first_error_;
}

Message JobState::TakeResult(size_t chunk) {
  MutexLock lk(&mu_);
  Record* r = Find(chunk);
  return r ? std::move(r->result) : Message();
}

void JobState::ForEachResultFd(const std::function<void(int)>& fn) const {
  MutexLock lk(&mu_);
  for (const auto& [chunk, r] : records_) {
    for (const FileDescriptor& f : r.result.fds) fn(f.get());
  }
}

void JobState::ThrowTimeout(const char* call, const Timeout& timeout) const {
  size_t done = 0;
  size_t total = 0;
  {
    MutexLock lk(&mu_);
    total = next_chunk_;
    done = total - outstanding_;
  }
  throw Error(
      ErrorCode::kDeadlineExceeded,
      absl::StrCat(call, ": the result of ", what_, " was not ready within ",
                   timeout.has_value() ? timeout->count() : 0.0, " s (", done, " of ", total,
                   " chunks done); wait longer, or check that the tasks can "
                   "finish"));
}

void JobState::SetCallback(std::function<void()> callback) {
  MutexLock lk(&mu_);
  callback_ = std::move(callback);
  has_callback_ = static_cast<bool>(callback_);
}

bool JobState::has_callback() const {
  MutexLock lk(&mu_);
  return has_callback_;
}

void JobState::RunCallback() {
  std::function<void()> cb;
  {
    MutexLock lk(&mu_);
    cb = std::move(callback_);  // run once; what it captured is freed after it ran
    callback_ = nullptr;
  }
  struct Done {
    JobState* job;
    ~Done() {
      t_in_callback = nullptr;
      MutexLock lk(&job->mu_);
      job->callback_done_ = true;
      job->cv_.NotifyAll();
    }
  } done{this};
  t_in_callback = this;
  if (cb) cb();
}

// ---- CallbackRunner ----------------------------------------------------------------------------

CallbackRunner::CallbackRunner(std::string pool_name) : pool_name_(std::move(pool_name)) {}

CallbackRunner::~CallbackRunner() {
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the last reference went with the thread's own frame
    } else {
      thread_.join();
    }
  }
}

// Runs one job's callback; what it throws is reported on stderr, then counted.
void CallbackRunner::Run(JobState& job) {
  try {
    job.RunCallback();
  } catch (...) {
    std::string why = "an exception that is not a std::exception";
    try {
      throw;
    } catch (const std::exception& e) {
      why = e.what();
    } catch (...) {
    }
    uint64_t n;
    {
      MutexLock lk(&mu_);
      n = failures_ + 1;  // reported first, then counted (a test that sees the count sees it)
    }
    std::fprintf(stderr,
                 "forksafe: pool %s: a callback of %s threw (%s); the pool goes on "
                 "(Pool::callback_failures() = %llu)\n",
                 pool_name_.c_str(), job.what().c_str(), why.c_str(),
                 static_cast<unsigned long long>(n));
    std::fflush(stderr);
    MutexLock lk(&mu_);
    ++failures_;
  }
}

void CallbackRunner::Post(std::shared_ptr<JobState> job) {
  std::thread finished;  // a thread whose loop ended (after Stop) but was not joined yet
  bool run_here = false;
  {
    MutexLock lk(&mu_);
    queue_.push_back(job);
    cv_.NotifyAll();
    if (running_) return;
    // Also after Stop(): a late job (one failed by terminate()) still gets its callback, from a
    // thread that drains the queue and ends.
    finished = std::move(thread_);
    try {
      thread_ = std::thread([self = shared_from_this()] { self->Loop(); });
      running_ = true;
    } catch (...) {
      queue_.pop_back();  // no thread can be started: run it here, rather than never
      run_here = true;
    }
  }
  if (finished.joinable()) {
    if (finished.get_id() == std::this_thread::get_id()) {
      finished.detach();
    } else {
      finished.join();
    }
  }
  if (run_here) Run(*job);
}

void CallbackRunner::Loop() {
  for (;;) {
    std::shared_ptr<JobState> job;
    {
      MutexLock lk(&mu_);
      while (!stopping_ && queue_.empty()) cv_.Wait(&lk);
      if (queue_.empty()) {  // stopping, and nothing left
        running_ = false;
        return;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    Run(*job);
  }
}

void CallbackRunner::Stop() {
  std::thread t;
  {
    MutexLock lk(&mu_);
    stopping_ = true;
    cv_.NotifyAll();
    // From a callback (one that terminates its pool): the thread ends after that callback, and
    // is joined by the next Stop() from another thread (the Pool's destructor) or its runner.
    if (!thread_.joinable() || thread_.get_id() == std::this_thread::get_id()) return;
    t = std::move(thread_);
  }
  t.join();
}

uint64_t CallbackRunner::failures() const {
  MutexLock lk(&mu_);
  return failures_;
}

}  // namespace forksafe::mp::internal
