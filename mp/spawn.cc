#include "forksafe/mp/spawn.h"

#include <poll.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/internal/shm_sync.h"

namespace forksafe::mp {

using runtime::Error;
using runtime::ErrorCode;

namespace {

std::string RaisedMessage(int index, pid_t pid, const ChildFailure& f) {
  std::string out =
      absl::StrCat("process ", index, " (pid ", pid, ") terminated with the following error:\n",
                   f.type, ": ", f.message);
  if (!f.traceback.empty())
    absl::StrAppend(&out, "\nTraceback (most recent call first):\n", f.traceback);
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

void ProcessContext::TerminateAll(int spare) {
  bool any = false;
  for (size_t i = 0; i < processes_.size(); ++i) {
    Process& p = processes_[i];
    if (p.pid() != 0 && p.is_alive()) {
      if (static_cast<int>(i) != spare) p.terminate();
      any = true;
    }
  }
  if (!any) return;
  // grace_ was checked by spawn() (mp/timeout.h's rules); +infinity waits for them forever.
  const std::optional<internal::Clock::duration> wait =
      internal::CheckedWait(grace_, "SpawnOptions::grace_period");
  const auto deadline = wait ? internal::Clock::now() + *wait : internal::Clock::time_point::max();
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
  try {
    return JoinOnce(timeout);
  } catch (const ProcessRaisedException& e) {
    // The message holds the child's exception and its stack: torchrun prints the callstack.
    RecordFailureForLauncher("ProcessRaisedException", e.message(),
                             absl::StrCat("ProcessRaisedException: ", e.message()));
    throw;
  } catch (const ProcessExitedException& e) {
    RecordFailureForLauncher("ProcessExitedException", e.message(), "");
    throw;
  }
}

bool ProcessContext::JoinOnce(Timeout timeout) {
  const internal::Deadline deadline = internal::DeadlineAfter(timeout, "ProcessContext::join");
  // Event-driven: each round looks only at the processes whose descriptor woke the poll (all of
  // them in the first round), then sleeps in one poll() on the descriptors of those still
  // running (their pidfds and report channels), so the join wakes as soon as any of them exits
  // or reports a failure, and costs nothing while they run.
  std::vector<size_t> check;
  for (size_t i = 0; i < processes_.size(); ++i) {
    if (!done_[i]) check.push_back(i);
  }
  std::vector<size_t> running;
  std::vector<pollfd> fds;
  auto sleep = std::chrono::microseconds(100);  // only where a process has no descriptor
  for (;;) {
    for (const size_t i : check) {
      Process& p = processes_[i];
      if (done_[i] || p.pid() == 0) continue;
      if (!p.join(std::chrono::duration<double>(0))) {
        if (!p.reported_failure()) continue;
        // The target threw and the process is about to exit with code 1: stop the others now,
        // while it exits, rather than after.
        const ChildFailure failure = *p.failure();
        TerminateAll(static_cast<int>(i));
        for (size_t j = 0; j < done_.size(); ++j) done_[j] = true;
        throw ProcessRaisedException(static_cast<int>(i), p.pid(), failure);
      }
      int code = 0;
      try {
        code = *p.exitcode();
      } catch (const Error&) {
        // Its status is lost (another waiter of this program reaped it, see mp/process.h): a
        // failure whose cause the error names. Stop the others first, as for any failure.
        TerminateAll();
        for (size_t j = 0; j < done_.size(); ++j) done_[j] = true;
        throw;
      }
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
    running.clear();
    fds.clear();
    bool all_pollable = true;
    bool any_running = false;
    for (size_t i = 0; i < processes_.size(); ++i) {
      if (done_[i]) continue;
      any_running = true;
      const int fd = processes_[i].wait_fd();
      if (fd < 0) all_pollable = false;
      running.push_back(i);
      fds.push_back(pollfd{fd, POLLIN, 0});
      const int report = processes_[i].report_fd();
      if (report >= 0 && report != fd) {
        running.push_back(i);
        fds.push_back(pollfd{report, POLLIN, 0});
      }
    }
    if (!any_running) return true;
    int ms = -1;
    if (deadline.has_value()) {
      const auto left = *deadline - internal::Clock::now();
      if (left <= internal::Clock::duration::zero()) return false;
      ms = static_cast<int>(std::min<int64_t>(
          std::chrono::ceil<std::chrono::milliseconds>(left).count(), 24 * 3600 * 1000));
    }
    if (!all_pollable) {
      // No pidfds (old kernels): look at every process again after a short, growing sleep.
      auto nap = std::chrono::duration_cast<internal::Clock::duration>(sleep);
      if (deadline.has_value()) nap = std::min(nap, *deadline - internal::Clock::now());
      std::this_thread::sleep_for(nap);
      if (sleep < std::chrono::milliseconds(2)) sleep *= 2;
      check.clear();
      for (size_t i = 0; i < processes_.size(); ++i) {
        if (!done_[i]) check.push_back(i);
      }
      continue;
    }
    const int n = ::poll(fds.data(), fds.size(), ms);
    check.clear();
    if (n > 0) {
      for (size_t k = 0; k < fds.size(); ++k) {
        if (fds[k].revents != 0 && (check.empty() || check.back() != running[k])) {
          check.push_back(running[k]);
        }
      }
    } else if (n < 0 && errno != EINTR) {
      runtime::ThrowSystemError("poll in ProcessContext::join", errno);
    }
    // n == 0 (the timeout) or EINTR: the next round returns false at the deadline or polls again.
  }
}

}  // namespace forksafe::mp
