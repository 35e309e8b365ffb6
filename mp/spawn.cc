#include "mp/spawn.h"

#include <poll.h>
#include <sys/wait.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "mp/internal/shm_sync.h"

namespace forksafe::mp {

using runtime::Error;
using runtime::ErrorCode;

namespace {

std::string RaisedMessage(int index, pid_t pid, const ChildFailure& f) {
  std::string out = absl::StrCat("process ", index, " (pid ", pid, ") terminated with the following error:\n",
                                 f.type, ": ", f.message);
  if (!f.traceback.empty()) absl::StrAppend(&out, "\nTraceback (most recent call first):\n", f.traceback);
  return out;
}

std::string ExitedMessage(int index, pid_t pid, int code) {
  if (code < 0) {
    return absl::StrCat("process ", index, " (pid ", pid, ") terminated with signal ",
                        SignalName(-code));
  }
  return absl::StrCat("process ", index, " (pid ", pid, ") terminated with exit code ", code);
}

}  // namespace

ProcessRaisedException::ProcessRaisedException(int index, pid_t pid, ChildFailure failure)
    : Error(ErrorCode::kProcessFailed, RaisedMessage(index, pid, failure)),
      index_(index),
      pid_(pid),
      failure_(std::move(failure)) {}

ProcessExitedException::ProcessExitedException(int index, pid_t pid, int exit_code)
    : Error(ErrorCode::kProcessFailed, ExitedMessage(index, pid, exit_code)),
      index_(index),
      pid_(pid),
      exit_code_(exit_code),
      signal_name_(exit_code < 0 ? SignalName(-exit_code) : "") {}

ProcessContext::ProcessContext(std::vector<Process> processes,
                               std::chrono::duration<double> grace_period)
    : processes_(std::move(processes)), done_(processes_.size(), false), grace_(grace_period) {}

ProcessContext::~ProcessContext() {
  try {
    TerminateAll();
  } catch (...) {
  }
}

void ProcessContext::StartAll() {
  for (Process& p : processes_) {
    try {
      p.start();
    } catch (...) {
      TerminateAll();
      throw;
    }
  }
}

std::vector<pid_t> ProcessContext::pids() const {
  std::vector<pid_t> out;
  for (const Process& p : processes_) out.push_back(p.pid());
  return out;
}

void ProcessContext::TerminateAll() {
  bool any = false;
  for (Process& p : processes_) {
    if (p.pid() != 0 && p.is_alive()) {
      p.terminate();
      any = true;
    }
  }
  if (!any) return;
  const auto deadline = internal::Clock::now() + std::chrono::duration_cast<internal::Clock::duration>(grace_);
  for (Process& p : processes_) {
    if (p.pid() == 0) continue;
    const auto left = std::chrono::duration<double>(
        std::max(internal::Clock::duration::zero(), deadline - internal::Clock::now()));
    if (!p.join(left)) {
      p.kill();
      p.join();
    }
  }
}

bool ProcessContext::join(Timeout timeout) {
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, "ProcessContext::join");
  auto sleep = std::chrono::microseconds(100);
  for (;;) {
    bool all_done = true;
    for (size_t i = 0; i < processes_.size(); ++i) {
      if (done_[i]) continue;
      Process& p = processes_[i];
      if (p.pid() == 0 || !p.join(std::chrono::duration<double>(0))) {
        all_done = false;
        continue;
      }
      const int code = *p.exitcode();
      if (code == 0) {
        done_[i] = true;
        continue;
      }
      // The first failure: stop the others, then report.
      std::optional<ChildFailure> failure = p.failure();
      TerminateAll();
      for (size_t j = 0; j < done_.size(); ++j) done_[j] = true;
      if (failure.has_value()) throw ProcessRaisedException(static_cast<int>(i), p.pid(), *failure);
      throw ProcessExitedException(static_cast<int>(i), p.pid(), code);
    }
    if (all_done) return true;
    if (deadline.has_value() && internal::Clock::now() >= *deadline) return false;
    // Sleep until one of them exits (or reports), not for a fixed time.
    std::vector<pollfd> fds;
    bool all_pollable = true;
    for (size_t i = 0; i < processes_.size(); ++i) {
      if (done_[i]) continue;
      const int fd = processes_[i].wait_fd();
      if (fd < 0) {
        all_pollable = false;
        continue;
      }
      fds.push_back(pollfd{fd, POLLIN, 0});
    }
    int ms = 100;
    if (deadline.has_value()) {
      ms = std::min<int64_t>(
          ms, std::chrono::ceil<std::chrono::milliseconds>(*deadline - internal::Clock::now()).count());
      ms = std::max(ms, 0);
    }
    if (all_pollable && !fds.empty()) {
      ::poll(fds.data(), fds.size(), ms);
    } else {
      std::this_thread::sleep_for(sleep);
      if (sleep < std::chrono::milliseconds(2)) sleep *= 2;
    }
  }
}

}  // namespace forksafe::mp
