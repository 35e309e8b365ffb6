// mp/internal/child.h: NOT FOR USERS. What runs in a child process, the lifeline that ties
// children to their parent, the fork server, and the capture of stack traces at throw points.
#ifndef FORKSAFE_MP_INTERNAL_CHILD_H_
#define FORKSAFE_MP_INTERNAL_CHILD_H_

#include <sys/types.h>

#include <functional>
#include <optional>
#include <string>

#include "mp/codec.h"
#include "mp/connection.h"
#include "mp/process.h"

namespace forksafe::mp::internal {

// ---- messages between parent, child and fork server -------------------------------------------
// Parent -> spawned child (on its bootstrap socket, fd 3) and parent -> fork server:
//   Encode(kind="run", entry, name, args_bytes, FileDescriptor result, FileDescriptor lifeline)
//   followed (in fds) by the argument message's own descriptors.
// Reports on the result channel are Encode(kind, payload): child -> parent "hello" (payload "")
//   once running and "failure" (payload Encode(ChildFailure)) if the target threw; fork server ->
//   parent "exit" (payload Encode(int32 wait_status)) after reaping. Fork server -> parent on the
//   request socket: Encode(int32 pid).
inline constexpr int kBootstrapFd = 3;
inline constexpr const char* kChildFlag = "--forksafe-mp-child";
inline constexpr const char* kServerFlag = "--forksafe-mp-forkserver";

struct RunRequest {
  std::string entry;
  std::string name;
  Message args;
  FileDescriptor result;    // may be empty for spawn (then the bootstrap socket is used)
  FileDescriptor lifeline;  // read end of the parent's lifeline pipe
};
Message EncodeRunRequest(const std::string& entry, const std::string& name, Message args,
                         int result_fd, int lifeline_fd);
/// Decodes a run request from the parent. Error(kInvalidArgument) for a malformed message, a kind
/// other than "run", an empty entry name or a missing lifeline (and, with `need_result`, a
/// missing result channel: the fork server has no other way to report).
RunRequest DecodeRunRequest(Message msg, bool need_result = false);

/// A report read from a child's result channel (or the fork server's, for "exit").
struct ChildReport {
  enum Kind { kHello, kFailure, kExit, kOther } kind = kOther;
  std::optional<ChildFailure> failure;  // kFailure, when its payload decoded
  std::optional<int32_t> wait_status;   // kExit, when its payload decoded
};
/// Decodes Encode(kind, payload). Error(kInvalidArgument) when the envelope is malformed; a
/// malformed payload of a known kind leaves failure / wait_status empty (the report is ignored,
/// the process's exit status still decides).
ChildReport DecodeChildReport(Message& msg);

/// Decodes the fork server's reply to a run request: the new child's pid (> 0). Error(kInternal)
/// when the server reports that it could not fork or rejected the request, Error(kInvalidArgument)
/// for a malformed reply.
pid_t DecodeForkServerReply(Message& msg);
void SendReport(Connection& c, const std::string& kind, const std::string& payload);

// ---- lifeline ---------------------------------------------------------------------------------
/// A new close-on-exec descriptor for the read end of this process's lifeline pipe (created on
/// first use). Hand it to a child; the parent closes its copy after the child started.
FileDescriptor LifelineReadEnd();
/// In a child: start the thread that kills this process when `read_end` reports end-of-file.
void WatchLifeline(FileDescriptor read_end);

// ---- running a target in a child --------------------------------------------------------------
/// Runs `target` as the body of a child process and never returns: reports "hello" and any
/// exception on `result`, flushes stdio, and _exits with 0 (1 if it threw).
[[noreturn]] void RunChildBody(const std::function<void()>& target, Connection result,
                               const std::string& name);

// ---- stack traces at throw points -------------------------------------------------------------
/// Turns capture on for this thread (children turn it on around their target). The caller's
/// frame and its callers' are recorded, and left out of the traces.
void EnableThrowTraceCapture(bool on);
/// The symbolized stack recorded at the most recent throw on this thread ("" if none), from the
/// throw down to the frame just above the function that turned capture on.
std::string LastThrowTrace();

// ---- fork server ------------------------------------------------------------------------------
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

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_CHILD_H_
