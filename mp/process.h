// mp/process.h: Process, start methods, and the call that lets the library take over a spawned
// child.
//
// What it offers
//   Process runs a function in another process, as Python's multiprocessing.Process does:
//   start(), join(timeout), is_alive(), pid(), exitcode() (negative signal number when killed by a
//   signal), terminate(), kill(), close(). Three start methods:
//   - "fork": fork() through the runtime's at-fork protocol (pools drained, framework lock held,
//     devices reset in the child). Any callable works; its arguments are copied, not encoded.
//   - "spawn": a fresh copy of this executable (posix_spawn of /proc/self/exe) that runs only the
//     requested entry point. The target must be registered with FORKSAFE_ENTRY_POINT and its
//     arguments go through the codec (descriptors out of band).
//   - "forkserver": a server process, spawned once from a clean state (before any threads of
//     user code) forks children on request. Its socket is an inherited socketpair, so no other
//     process — let alone another user — can ask it for processes; and it serves nothing before
//     its creator presents a 32-byte secret it handed the server on a private pipe (threat model:
//     mp/internal/server_auth.h). Same target rules as spawn.
//
//   Programs that use spawn or forkserver call InitMain(argc, argv) first thing in main(): in a
//   spawned child or the fork server it runs the library's side and never returns; otherwise it
//   returns at once.
//
// Guarantees
//   - Children die when their parent dies, however it dies (SIGKILL included): each child watches
//     a "lifeline" pipe whose only writer is the parent, and kills itself on end-of-file, within
//     milliseconds. Children are always reaped: no zombies stay behind a joined or destroyed
//     Process.
//   - The library is a guest in your program: it does not own the program's signal dispositions,
//     descriptor table or resource limits, and works with whatever they are:
//     * SIGCHLD ignored, or a SIGCHLD handler that reaps every child (waitpid(-1, ...)): join(),
//       is_alive(), terminate() and the destructor still work. A child is waited for through its
//       pidfd (never a recycled pid); when someone else took its exit status, exitcode() comes
//       from the kernel's exit information of the pidfd (Linux 6.15+), else from the child's own
//       report (a normal return, an exception, exit(n)); a child that left neither (killed by a
//       signal, or _exit(), on an older kernel) makes exitcode() throw Error(kFailedPrecondition)
//       naming the cause. The fork server sets SIGCHLD to its default for itself and its
//       children (as Python's forkserver does) and reports every status; fork and spawn
//       children inherit yours. Under forkserver, too, a status is never invented: when the
//       fork server was killed before it could report one, exitcode() throws the same way.
//     * Under every start method an exit is seen by any look, also one with no wait at all:
//       is_alive() turns false, exitcode() is set, join(0) is true, and close() works without
//       a join, as soon as the process has exited.
//     * A child may close every descriptor from 3 up (daemons and exec wrappers do): its lifeline
//       watcher holds the lifeline in a private descriptor table, so the child is neither killed
//       for it nor cut loose from its parent. Where unshare() is refused, the watcher falls back
//       to noticing its parent's death by getppid() (within 50 ms). After exec() no watcher runs.
//     * Out of descriptors (RLIMIT_NOFILE) or processes (RLIMIT_NPROC, EAGAIN from fork):
//       start() throws Error(kResourceExhausted) naming the process, the limit and its value, and
//       leaves nothing behind. This holds in the fork server too (it keeps the limit it started
//       with): a request whose descriptors do not fit there is refused, and the server serves on.
//   - Every wait blocks in poll() (on the pidfd, or the report channel under forkserver) or
//     sleeps in short naps where there is no pidfd; none spins, the destructor included.
//   - If the target throws, the child reports the exception's type, message and the stack trace
//     at the throw point to the parent (failure()), and exits with code 1.
//   - A Process belongs to the process that started it: in a forked child, the inherited copy
//     refuses to signal or wait (Error(kFailedPrecondition)) and its destructor does nothing.
//   - Thread safety: one Process object is not to be used from several threads at once; different
//     Process objects are independent.
//
// Hazards
//   - ~Process of a started, non-daemon process waits for it to exit (as Python waits for
//     non-daemonic children at exit); a daemon process is terminated (SIGTERM, then SIGKILL after
//     one second). Join explicitly when the child may run long.
//   - With "fork", the child runs with the parent's memory as it was at the fork: threads other
//     than the caller do not exist there (the runtime makes its own pools and devices safe; your
//     own threads and locks are your business, see runtime/at_fork.h).
#ifndef FORKSAFE_MP_PROCESS_H_
#define FORKSAFE_MP_PROCESS_H_

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cereal/details/traits.hpp"
#include "forksafe/device/storage_sharing.h"
#include "forksafe/device/tensor.h"
#include "forksafe/mp/codec.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/entry_point.h"
#include "forksafe/mp/start_method.h"

namespace forksafe::mp {

/// Takes over a spawned child or the fork server (and then never returns); returns at once in any
/// other process. Call it first thing in main() of programs that use "spawn" or "forkserver".
void InitMain(int argc, char** argv);

/// {"fork", "spawn", "forkserver"}: the names StartMethod accepts.
std::vector<std::string> get_all_start_methods();
/// The process-wide default start method (fork unless set); never StartMethod::kDefault.
StartMethod get_start_method();
/// Sets the default start method (a name converts: set_start_method("spawn")). Throws
/// kInvalidArgument for an unknown name (listing the valid ones) or for kDefault (""), and
/// kFailedPrecondition when it was already set to another method, unless `force`.
void set_start_method(StartMethod method, bool force = false);

/// How to start a Process.
struct ProcessOptions {
  std::string name;          ///< Default "Process-N".
  bool daemon = false;       ///< Terminated, not waited for, when the Process is destroyed.
  StartMethod start_method;  ///< kDefault ("") means get_start_method().
  /// Environment variables set in the child before its target runs (name, value), under every
  /// start method (mp::spawn() gives its children torchrun's variables this way). The parent's
  /// environment is not touched. Names must be non-empty and hold no '='. Under "spawn" the new
  /// program starts with them (its static initializers see them); under "fork" and
  /// "forkserver" they are set in the child before the target runs. (Otherwise a child has its
  /// parent's environment, except under "forkserver": there it has the fork server's, which was
  /// the parent's when the server started, as in Python.)
  std::vector<std::pair<std::string, std::string>> env{};
};

/// What a child reported when its target threw.
struct ChildFailure {
  std::string type;     ///< The exception's type, demangled ("std::runtime_error").
  std::string message;  ///< Its what().
  /// The child's stack at the throw, one frame a line, from the throw down to the target (the
  /// library's launcher frames below it are left out); may be empty.
  std::string traceback;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(type, message, traceback);
  }
};

namespace internal {
/// Installs mp/'s sharing layer in the device layer's extension point (device/storage_sharing.h),
/// once per process; later calls cost one check. Defined in mp/sharing.cc: a target that passes
/// tensors to a Process links //mp:sharing (libforksafe.so and //:forksafe have it), under every
/// start method: a fork-only lambda target with a tensor argument too, which shares the tensor
/// instead of handing the child a private copy-on-write copy. Without it the link fails, naming
/// this function.
void InstallStorageSharing();

/// With the fork start method arguments are copied with the parent's memory, not encoded: CPU
/// tensor arguments are moved to shared memory first (device::ShareHostStorage), so that they
/// cross without copies there too.
template <class T>
void ShareForFork(const T& value) {
  if constexpr (std::is_same_v<T, device::Tensor>) {
    InstallStorageSharing();
    device::ShareHostStorage(value.storage());
  } else if constexpr (std::is_same_v<T, std::vector<device::Tensor>>) {
    InstallStorageSharing();
    for (const device::Tensor& t : value) device::ShareHostStorage(t.storage());
  }
}
}  // namespace internal

/// A function running in another process.
class Process {
 public:
  /// A process that will run fn(args...). See the start methods above for what fn may be.
  template <class Fn, class... Args>
  explicit Process(Fn&& fn, Args&&... args)
      : Process(ProcessOptions{}, std::forward<Fn>(fn), std::forward<Args>(args)...) {}

  template <class Fn, class... Args>
  Process(ProcessOptions options, Fn&& fn, Args&&... args) : Process(std::move(options), 0) {
    Bind(std::forward<Fn>(fn), std::forward<Args>(args)...);
  }

  ~Process();
  Process(Process&&) noexcept;
  Process& operator=(Process&&) noexcept;
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  /// Starts the process. Throws kFailedPrecondition if already started, kClosed after close()
  /// (as Python raises ValueError "process object is closed"), kInvalidArgument for an unknown
  /// start method, kNotFound for an unregistered target under spawn/forkserver,
  /// kResourceExhausted when descriptors or processes ran out (naming the limit).
  void start();
  /// Waits until the process exits or `timeout` passes; returns whether it exited.
  /// kFailedPrecondition before start(), kClosed after close().
  bool join(Timeout timeout = std::nullopt);
  /// True between start() and the process's exit. kClosed after close().
  bool is_alive();
  /// The child's pid (0 before start).
  pid_t pid() const;
  /// Exit code once exited (negative signal number if killed by a signal); nullopt before.
  /// kClosed after close(); kFailedPrecondition when the program took the status and nothing
  /// else knows it (see "guest" in the file comment).
  std::optional<int> exitcode();
  /// Sends SIGTERM (no-op once exited). kClosed after close().
  void terminate();
  /// Sends SIGKILL (no-op once exited). kClosed after close().
  void kill();
  /// Releases resources; throws kFailedPrecondition while the process still runs. Closing twice
  /// is fine. Afterwards start, join, is_alive, exitcode, terminate and kill throw kClosed;
  /// pid(), name(), daemon(), start_method() and failure() still answer.
  void close();

  const std::string& name() const;
  bool daemon() const;
  /// The start method used (or to be used): never kDefault.
  StartMethod start_method() const;
  /// The exception the target threw, once the process exited (nullopt if it did not throw).
  std::optional<ChildFailure> failure();

  /// True once the target's failure report has arrived, which happens just before the process
  /// exits with code 1; reads the reports that are waiting, never blocks. Lets a caller act on a
  /// failure without waiting for the exit.
  bool reported_failure();
  /// The channel the process reports on (its failure, then end-of-file at exit), for poll()ing
  /// next to wait_fd(); -1 before start and after close().
  int report_fd() const;

  /// A descriptor that becomes readable when the process exits (a pidfd for fork and spawn, the
  /// report channel for forkserver), for poll()ing many processes at once; -1 when there is
  /// none (kernels without pidfds). Owned by the Process.
  int wait_fd() const;

  struct Impl;

 private:
  Process(ProcessOptions options, int);  // allocates impl_

  void SetTargets(std::function<void()> local, const void* fn, std::function<Message()> encode,
                  std::function<void()> before_fork = nullptr);

  template <class R, class... Params, class... Args>
  void Bind(R (*fn)(Params...), Args&&... args) {
    auto tup = std::make_shared<std::tuple<std::decay_t<Params>...>>(std::forward<Args>(args)...);
    std::function<Message()> encode;
    if constexpr ((cereal::traits::is_output_serializable<std::decay_t<Params>,
                                                          cereal::BinaryOutputArchive>::value &&
                   ...)) {
      encode = [tup] { return std::apply([](const auto&... a) { return Encode(a...); }, *tup); };
    }
    SetTargets(
        [fn, tup] { std::apply(fn, *tup); }, reinterpret_cast<const void*>(fn), std::move(encode),
        [tup] { std::apply([](const auto&... a) { (internal::ShareForFork(a), ...); }, *tup); });
  }
  template <class R, class... Params, class... Args>
  void Bind(R (&fn)(Params...), Args&&... args) {
    Bind(&fn, std::forward<Args>(args)...);
  }
  template <class F, class... Args,
            class = std::enable_if_t<!std::is_function_v<std::remove_pointer_t<std::decay_t<F>>>>>
  void Bind(F&& f, Args&&... args) {
    auto tup = std::make_shared<std::tuple<std::decay_t<Args>...>>(std::forward<Args>(args)...);
    auto call = [f = std::decay_t<F>(std::forward<F>(f)), tup]() mutable { std::apply(f, *tup); };
    SetTargets(std::move(call), nullptr, nullptr, [tup] {
      std::apply([](const auto&... a) { (internal::ShareForFork(a), ...); }, *tup);
    });
  }

  std::unique_ptr<Impl> impl_;
};

/// A start method bound to a name, as returned by get_context() (Python's context objects).
class Context {
 public:
  /// A context of `method`; kDefault ("") stays the default, resolved when a process starts
  /// (get_context() resolves it at once, as Python's does).
  explicit Context(StartMethod method) : method_(method) {}
  /// The method (kDefault only for a Context built directly with the default).
  StartMethod start_method() const { return method_; }
  /// ProcessOptions with this context's start method.
  ProcessOptions options(std::string name = "", bool daemon = false) const {
    return ProcessOptions{std::move(name), daemon, method_};
  }
  /// A Process using this context's start method.
  template <class Fn, class... Args>
  Process MakeProcess(Fn&& fn, Args&&... args) const {
    return Process(options(), std::forward<Fn>(fn), std::forward<Args>(args)...);
  }

 private:
  StartMethod method_;
};

/// The context of `method` (kDefault or "": get_start_method() now). A name converts; an unknown
/// one throws kInvalidArgument.
Context get_context(StartMethod method = StartMethod::kDefault);

/// The name of a signal ("SIGSEGV") and its description ("Segmentation fault").
std::string SignalName(int sig);

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_PROCESS_H_
