// mp/spawn.h: spawn() — run fn(i, args...) in nprocs processes, with error propagation.
//
// What it offers
//   The C++ form of torch.multiprocessing.spawn. spawn(fn, args, options) starts nprocs
//   processes; process i runs fn(i, args...). With options.join (the default) it waits for all of
//   them; otherwise it returns a ProcessContext whose join(timeout) returns true once all finished
//   and false while some still run.
//
// Error propagation
//   On the first failure the others are terminated (SIGTERM, then SIGKILL after
//   options.grace_period) and the parent throws:
//   - ProcessRaisedException when a child's fn threw: it carries the child's index, pid, the
//     exception's type and message, and the child's stack trace at the throw;
//   - ProcessExitedException when a child exited with a non-zero code or died by a signal: it
//     carries the index, pid, exit code and the signal's name ("SIGSEGV (Segmentation fault)").
//   Both derive from runtime::Error, so a caller that only wants a message catches that.
//
//   - Error(kFailedPrecondition) naming the cause when a child ended without a report and its
//     exit status is lost: the program around us took it (SIGCHLD ignored or reaped by a
//     handler, on kernels older than 6.15), or the fork server was killed before reporting it
//     (see mp/process.h); again after terminating the others.
//
// Guarantees
//   - Nothing is left behind: every child is reaped before spawn()/join() throws or returns true.
//   - Works in programs that ignore SIGCHLD or reap every child in a SIGCHLD handler, and under
//     small descriptor or process limits (a start that runs out is Error(kResourceExhausted)
//     naming the limit, after the processes already started are terminated and reaped).
//   - Each child gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, ...; inside a launcher's
//     rank they nest: mp/launch.h has the rule), unless options.launch_env is false. Reading the
//     launcher's variables, spawn() throws Error(kInvalidArgument) naming them when they are
//     malformed (before anything starts).
//   - The default start method is "spawn", as in PyTorch; fn must then be registered with
//     FORKSAFE_ENTRY_POINT and the program must call InitMain() (see mp/process.h).
#ifndef FORKSAFE_MP_SPAWN_H_
#define FORKSAFE_MP_SPAWN_H_

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "forksafe/mp/launch.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/timeout.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {

/// A child's fn threw.
class ProcessRaisedException : public runtime::Error {
 public:
  ProcessRaisedException(int index, pid_t pid, ChildFailure failure);
  int error_index() const { return index_; }
  pid_t error_pid() const { return pid_; }
  const ChildFailure& failure() const { return failure_; }

 private:
  int index_;
  pid_t pid_;
  ChildFailure failure_;
};

/// A child exited with a non-zero code or was killed by a signal.
class ProcessExitedException : public runtime::Error {
 public:
  ProcessExitedException(int index, pid_t pid, int exit_code);
  int error_index() const { return index_; }
  pid_t error_pid() const { return pid_; }
  /// Negative signal number when killed by a signal.
  int exit_code() const { return exit_code_; }
  /// "SIGKILL (Killed)", or "" when the process exited by itself.
  const std::string& signal_name() const { return signal_name_; }

 private:
  int index_;
  pid_t pid_;
  int exit_code_;
  std::string signal_name_;
};

/// Options of spawn().
struct SpawnOptions {
  int nprocs = 1;
  bool join = true;
  bool daemon = false;
  StartMethod start_method = StartMethod::kSpawn;
  /// After a failure, how long the others get between SIGTERM and SIGKILL.
  std::chrono::duration<double> grace_period = std::chrono::seconds(3);
  /// Gives each child torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...; the nesting rule
  /// of mp/launch.h), so code written for torchrun runs under spawn(). false: the children
  /// inherit the parent's environment unchanged.
  bool launch_env = true;
};

/// The processes started by one spawn() call.
class ProcessContext {
 public:
  ProcessContext(std::vector<Process> processes, std::chrono::duration<double> grace_period);
  /// Terminates and reaps whatever still runs.
  ~ProcessContext();
  ProcessContext(ProcessContext&&) = default;

  /// Waits at most `timeout` (nullopt: until all finished), sleeping in one poll() on the
  /// processes' pidfds (fork server: report channels), so it wakes as soon as any of them exits.
  /// Returns true when every process finished successfully, false when some still run at the
  /// timeout. Throws
  /// ProcessRaisedException / ProcessExitedException on the first failure, after terminating
  /// and reaping the others, and after writing it to TORCHELASTIC_ERROR_FILE when a launcher set
  /// that variable (mp/launch.h).
  bool join(Timeout timeout = std::nullopt);
  /// Starts every process (spawn() calls it). On a failure to start, the ones already started
  /// are terminated and the error is rethrown.
  void StartAll();
  /// The processes, index i at position i.
  std::vector<Process>& processes() { return processes_; }
  /// Their pids.
  std::vector<pid_t> pids() const;

 private:
  /// SIGTERMs every running process but `spare` (-1: none), then reaps them all, SIGKILLing
  /// those still alive after the grace period.
  void TerminateAll(int spare = -1);
  bool JoinOnce(Timeout timeout);
  std::vector<Process> processes_;
  std::vector<bool> done_;
  std::chrono::duration<double> grace_;
};

/// Starts options.nprocs processes running fn(i, args...). See the file comment.
template <class Fn, class... Args>
std::unique_ptr<ProcessContext> spawn(Fn fn, std::tuple<Args...> args, SpawnOptions options = {}) {
  if (options.nprocs < 1) {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                         "spawn: nprocs must be >= 1, got " + std::to_string(options.nprocs));
  }
  internal::CheckedWait(options.grace_period, "spawn: SpawnOptions::grace_period");
  std::vector<Process> procs;
  procs.reserve(options.nprocs);
  LaunchInfo parent;
  int port = 0;
  if (options.launch_env) {
    parent = GetLaunchInfo();
    if (parent.master_addr.empty() && parent.world_size == 1) port = FreeLoopbackPort();
  }
  for (int i = 0; i < options.nprocs; ++i) {
    ProcessOptions po{"", options.daemon, options.start_method, {}};
    if (options.launch_env) po.env = SpawnChildEnvironment(parent, options.nprocs, i, port);
    procs.push_back(std::apply([&](const auto&... a) { return Process(po, fn, i, a...); }, args));
  }
  auto ctx = std::make_unique<ProcessContext>(std::move(procs), options.grace_period);
  ctx->StartAll();
  if (options.join) {
    while (!ctx->join()) {
    }
  }
  return ctx;
}

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_SPAWN_H_
