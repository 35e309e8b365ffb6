// mp/internal/child.h: NOT FOR USERS. What runs in a child process, the lifeline that ties
// children to their parent, reaping our own children, the fork server, and the capture of stack
// traces at throw points. Implemented in mp/internal/child.cc, mp/internal/fork_server.cc (the
// fork server, the spawned child's entry and InitMain) and mp/internal/throw_trace.cc.
//
// The rule of this file (and of mp/process.cc): the library is a guest in the program around it.
// It does not own the program's signal dispositions (SIGCHLD may be ignored, or a handler may
// reap every child with waitpid(-1)), its descriptor table (a child may close every descriptor
// from 3 up) or its resource limits (RLIMIT_NOFILE, RLIMIT_NPROC). So: a child is waited for
// through its pidfd and, when someone else reaped it, its status comes from the kernel's pidfd
// exit information or from the child's own report, never from an assumption that waitpid works;
// the lifeline is watched from a private descriptor table; every wait blocks or is bounded;
// running out of descriptors or processes is Error(kResourceExhausted) naming the limit. Only
// the processes the library owns outright (the fork server) set their own dispositions. And a
// forked child calls nothing that takes a lock another thread of the parent may have held at the
// fork (on_exit() included: RegisterExitReport runs in the parent).
#ifndef FORKSAFE_MP_INTERNAL_CHILD_H_
#define FORKSAFE_MP_INTERNAL_CHILD_H_

#include <sys/types.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/process.h"

namespace forksafe::mp::internal {

// ---- messages between parent, child and fork server -------------------------------------------
// Parent -> spawned child (on its bootstrap socket, fd 3) and parent -> fork server:
//   Encode(kind="run", entry, name, args_bytes, FileDescriptor result, FileDescriptor lifeline)
//   followed (in fds) by the argument message's own descriptors.
// Reports on the result channel are Encode(kind, payload): child -> parent "hello" (payload "")
//   once running, "failure" (payload Encode(ChildFailure)) if the target threw, and "exiting"
//   (payload Encode(int32 exit code)) right before it exits normally (also from exit() called by
//   the target); fork server -> parent "exit" (payload Encode(int32 wait_status)) after reaping.
//   The kernel's wait status beats the child's own "exiting": the parent uses the latter only
//   when another waiter in the program took the status (see ReapChild). Fork server -> parent on
//   the request socket: Encode(int32 pid).
inline constexpr int kBootstrapFd = 3;
inline constexpr const char* kChildFlag = "--forksafe-mp-child";
inline constexpr const char* kServerFlag = "--forksafe-mp-forkserver";

/// Variables a child sets before its target runs (ProcessOptions::env).
using ChildEnvironment = std::vector<std::pair<std::string, std::string>>;
struct RunRequest {
  std::string entry;
  std::string name;
  Message args;
  FileDescriptor result;    // may be empty for spawn (then the bootstrap socket is used)
  FileDescriptor lifeline;  // read end of the parent's lifeline pipe
  ChildEnvironment env;     // ProcessOptions::env
};
Message EncodeRunRequest(const std::string& entry, const std::string& name, Message args,
                         int result_fd, int lifeline_fd, const ChildEnvironment& env);
/// Decodes a run request from the parent. Error(kInvalidArgument) for a malformed message, a kind
/// other than "run", an empty entry name or a missing lifeline (and, with `need_result`, a
/// missing result channel: the fork server has no other way to report).
RunRequest DecodeRunRequest(Message msg, bool need_result = false);

/// A report read from a child's result channel (or the fork server's, for "exit").
struct ChildReport {
  enum Kind { kHello, kFailure, kExit, kExiting, kOther } kind = kOther;
  std::optional<ChildFailure> failure;  // kFailure, when its payload decoded
  std::optional<int32_t> wait_status;   // kExit, when its payload decoded
  std::optional<int32_t> exit_code;     // kExiting, when its payload decoded
};
/// Decodes Encode(kind, payload). Error(kInvalidArgument) when the envelope is malformed; a
/// malformed payload of a known kind leaves failure / wait_status empty (the report is ignored,
/// the process's exit status still decides).
ChildReport DecodeChildReport(Message& msg);

/// Decodes the fork server's reply to a run request: the new child's pid (> 0).
/// Error(kResourceExhausted) when the server could not fork for lack of processes or memory,
/// Error(kInternal) when it could not fork otherwise or rejected the request,
/// Error(kInvalidArgument) for a malformed reply.
pid_t DecodeForkServerReply(Message& msg);
void SendReport(Connection& c, const std::string& kind, const std::string& payload);

// ---- lifeline ---------------------------------------------------------------------------------
/// A new close-on-exec descriptor for the read end of this process's lifeline pipe (created on
/// first use). Hand it to a child; the parent closes its copy after the child started.
FileDescriptor LifelineReadEnd();
/// In a child, before any user code runs: starts the thread that kills this process when
/// `read_end` reports end-of-file, and returns once that thread no longer depends on this
/// process's descriptor table. The thread takes a private descriptor table (unshare(CLONE_FILES))
/// holding only the lifeline, and closes this process's copy, so that a child that closes every
/// descriptor from 3 up, or reuses their numbers, neither loses its lifeline nor is killed for
/// it. Where unshare is refused (some seccomp profiles), the thread polls the shared descriptor
/// for the hang-up, never reads it, and trusts a hang-up only while the number is still the
/// lifeline (same device and inode); once the program closed it or reused the number, it
/// watches getppid() instead (every 50 ms: the child dies within that of its parent's death).
/// If no thread can be started, PR_SET_PDEATHSIG is the last resort.
void WatchLifeline(FileDescriptor read_end);

// ---- reaping our own children -----------------------------------------------------------------
/// How a non-blocking look at one of our children went.
struct ReapResult {
  enum State {
    kRunning,          // still running (or not yet reapable)
    kReaped,           // exited and reaped now: wait_status is the kernel's
    kReapedElsewhere,  // exited, and someone else in this program reaped it (or SIGCHLD is
                       // ignored): wait_status is the kernel's only when status_known
  } state = kRunning;
  bool status_known = false;
  int wait_status = 0;  // in waitpid()'s encoding
};
/// Looks at child `pid` without blocking: through `pidfd` when it is valid (immune to pid reuse;
/// waitid(P_PIDFD)), else waitpid(pid). When another waiter took the child (ECHILD), the status
/// comes from the kernel's exit information of the pidfd (PIDFD_GET_INFO, Linux 6.15+) when
/// there is one. Never throws for ECHILD; throws kInternal for other failures.
ReapResult ReapChild(pid_t pid, int pidfd);
/// Sends `sig` to child `pid` through `pidfd` when valid (never a recycled pid), else kill().
void SignalChild(pid_t pid, int pidfd, int sig);
/// Blocks until child `pid` has exited and is reaped (by us, or by someone else): sleeps in
/// poll() on `pidfd` when valid, else in short naps; never spins. For a child just sent SIGKILL.
void ReapUntilGone(pid_t pid, int pidfd);

// ---- limits -----------------------------------------------------------------------------------
/// "the limit is N descriptors (RLIMIT_NOFILE, ulimit -n): raise the limit, or run fewer
/// processes at once ...": the tail of every error about a process start that ran out of
/// descriptors.
std::string DescriptorLimitNote();
/// "this user may run N processes and threads (RLIMIT_NPROC, ulimit -u), and the system limits
/// them too ...: raise the limit that was reached, or ...": the same for processes (EAGAIN).
std::string ProcessLimitNote();
/// Throws for a failed attempt to start a process (`what` failed with `err`):
/// Error(kResourceExhausted) naming the limits for EAGAIN, ENOMEM, EMFILE and ENFILE, else
/// Error(kInternal).
[[noreturn]] void ThrowCannotStartProcess(const std::string& what, int err);

// ---- running a target in a child --------------------------------------------------------------
/// Registers (once per process) the exit handler that reports exit(n) called by a target as
/// "exiting" n. Call it in the process that forks, before the fork: on_exit() takes the C
/// library's exit-handler lock, which another thread may hold at the moment of a fork, so a
/// forked child must never call it. The handler does nothing in a process that is not running a
/// target (RunChildBody marks the one that is).
void RegisterExitReport();
/// Runs `target` as the body of a child process and never returns: sets `env` in this process's
/// environment, reports "hello" and any exception on `result`, flushes stdio, and _exits with 0
/// (1 if it threw). exit(n) called by the target is reported as "exiting" n when
/// RegisterExitReport() ran before the fork.
[[noreturn]] void RunChildBody(const std::function<void()>& target, Connection result,
                               const std::string& name, const ChildEnvironment& env);
/// This process's environment with `env`'s variables replacing or added, as a null-terminated
/// array for execve/posix_spawn; the added entries live in `storage`, the others are environ's.
std::vector<char*> EnvironmentWith(const ChildEnvironment& env, std::vector<std::string>& storage);
/// Sets `env` (name, value pairs) in this process's environment without the C library's
/// environment lock (a forked child of a threaded parent may find it held): a new `environ`
/// array, the old entries kept. Safe only while no other thread runs.
void ApplyChildEnvironment(const ChildEnvironment& env);
/// A name that is non-empty and holds no '=' or NUL, and a value without NUL.
bool ValidEnvironmentEntry(const std::string& name, const std::string& value);
/// Throws Error(kInvalidArgument) naming the process when a name in `env` is empty or holds '='.
void CheckChildEnvironment(const ChildEnvironment& env, const std::string& process);

// ---- stack traces at throw points -------------------------------------------------------------
/// Turns capture on for this thread (children turn it on around their target). The caller's
/// frame and its callers' are recorded, and left out of the traces.
void EnableThrowTraceCapture(bool on);
/// The symbolized stack recorded at the most recent throw on this thread ("" if none), from the
/// throw down to the frame just above the function that turned capture on.
std::string LastThrowTrace();

// ---- fork server (mp/internal/fork_server.cc) ------------------------------------------------
/// The running fork server of this process (started on first use, and again after it died):
/// sends a request and returns the pid of the new child. Throws kUnavailable when the server died
/// with the request (the child may or may not have started).
pid_t ForkServerRun(Message request);
/// Reaps and forgets the fork server if it died (the next request starts a new one).
void ForkServerReapIfDead();

/// A C++ type name made readable ("std::runtime_error").
std::string Demangle(const char* mangled);

// ---- program path -----------------------------------------------------------------------------
void SetArgv0(const char* argv0);
const std::string& Argv0();
/// InitMain marks the program (and every child forked from it) as one that serves the library's
/// flags when /proc/self/exe is spawned with them: only then is the shm manager this program
/// (ShmManagerExecutable). A Python interpreter, or a C++ program that skipped InitMain, would
/// take the flag for its own option or ignore it.
void MarkInitMainCalled();
bool InitMainCalled();

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_CHILD_H_
