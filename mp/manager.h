// mp/manager.h: Manager — a server process that holds objects, used through typed proxies, as
// Python's multiprocessing.Manager().
//
// What it offers
//   Manager starts a manager process (start method "fork", "spawn" or "forkserver"; default
//   get_start_method()) and creates objects in it; each creation returns a proxy:
//     dict<K, V>(), list<T>(), Namespace(), Lock(), RLock(), Semaphore(n), BoundedSemaphore(n),
//     Condition() (its own RLock, or over a manager Lock/RLock), Event(), Barrier(n),
//     Queue<T>(maxsize), Value<T>(v), Array<T>(n or contents).
//   K, V and T are any codec type (mp/codec.h: cereal-serializable) that holds no file
//   descriptor. The manager stores values as their encoded bytes, so it needs no C++ type; the
//   proxies encode and decode on the caller's side. Dict keys are compared by their encoding
//   (equal values encode equally; 0.0 and -0.0 are different keys, as are NaNs).
//   A proxy is a small value (copyable; default-constructed = empty, for decoding into) usable
//   in any process it reaches: a Process argument (fork: copied; spawn/forkserver: encoded), an
//   item of an mp::Queue or Pipe, a Pool task argument.
//
//     mp::Manager manager;                                  // starts the manager process
//     auto d = manager.dict<std::string, std::string>();
//     auto l = manager.list<int>({0, 1, 2});
//     mp::Process p(&Worker, d, l);                         // Worker(DictProxy<..>,
//     ListProxy<int>)
//
// Guarantees
//   - Each proxy call is one round trip to the manager, and each operation on an object is
//     atomic (the manager applies operations one at a time). A call that blocks (a lock acquire,
//     a Queue get, an Event/Condition/Barrier wait) blocks only its caller: the manager serves
//     each connection on a thread of its own, and each process keeps a small pool of connections
//     to its managers, so other threads and processes go on meanwhile.
//   - Sync objects follow Python's semantics; ownership of a Lock/RLock is the calling (process,
//     thread): one process may use proxies from several threads. Releasing a lock the caller does
//     not hold, re-acquiring a held non-recursive Lock with block=true, a Condition wait/notify
//     without its lock, and a BoundedSemaphore released above its initial value throw
//     Error(kFailedPrecondition). Timeouts follow mp/timeout.h (negative: kInvalidArgument).
//   - Owner death (beyond Python, whose manager lock stays held forever): when the process that
//     holds a Lock or RLock exits without releasing it (killed, or ended), the next acquire()
//     takes it over, within the manager's 100 ms wait slice for a waiter already blocked and at
//     once for a new or non-blocking one, and that proxy's previous_owner_died() is true: the
//     guarded data may be half-updated, as with mp::Lock. A Condition's wait re-acquires such a
//     lock too. The owner is the process at the other end of its connection as the kernel names
//     it (SO_PEERCRED), so pid namespaces do not fool it; a thread that ends while its process
//     lives is not an owner death (the lock stays held, as for any mutex).
//   - Errors as in Python: a missing dict key or Namespace attribute -> kNotFound naming it; a
//     list/Array index out of range -> kInvalidArgument with the index and the size (negative
//     indices count from the end); Queue.get on an empty queue and Queue.put on a full one
//     (timeout or no block) -> kDeadlineExceeded (the code of mp::Empty and mp::Full: the rule of
//     runtime/error.h); Barrier: the waiter whose timeout ran out gets kDeadlineExceeded and breaks
//     the barrier, the others get kFailedPrecondition until reset(). Negative Semaphore values,
//     Barrier parties < 1, an unknown object id, or a proxy decoded as the wrong proxy type ->
//     kInvalidArgument.
//   - Failure rule: when the manager is gone (shutdown(), or its process died, e.g. SIGKILL),
//     every proxy call throws Error(kClosed) naming the manager and saying it is gone, promptly:
//     connecting to a dead manager is refused at once and a call in flight (even one blocked in
//     a Lock acquire) sees its connection end. Nothing hangs: connect and every round trip are
//     bounded by the call's own timeout plus 30 s (kDeadlineExceeded for a stopped manager); a
//     call with no timeout waits as long as the manager lives.
//   - The manager process dies with its owner, however the owner dies (the lifeline of
//     mp/process.h), and stops when the owner's Manager is destroyed.
//   - RAII: ~Manager() is shutdown(): it stops the manager, reaps it, and leaves nothing behind
//     (no process, no socket — the socket has an abstract name, nothing on disk —, no /dev/shm
//     entry, no descriptor in the owner). shutdown() is idempotent.
//
// Threat model (security)
//   Only holders of a proxy can talk to the manager. Its socket is an abstract AF_UNIX socket
//   with a random 128-bit name (not on disk, not guessable), connections from another uid are
//   refused (SO_PEERCRED), and the first message of a connection must present the manager's
//   32-byte random secret (compared in constant time; mp/internal/server_auth.h), which every
//   proxy carries. A proxy is therefore a capability, like Python's authkey: whoever receives
//   a proxy's encoding (through a Queue, a Pipe, a file you write it to) can use the manager.
//   Out of scope as in server_auth.h: processes of the same user that can ptrace the owner or
//   the manager, and root. Malformed requests never crash the manager: the connection that sent
//   one is dropped, everyone else is served on.
//
// Hazards
//   - Objects live until shutdown(): dropping every proxy of an object does not free it in the
//     manager. Create long-lived objects once, not one per task.
//   - A call with no timeout to a manager that is stopped (SIGSTOP) waits until it resumes.
//   - Values holding file descriptors (Connection, mp::Queue, tensors) cannot be stored
//     (kInvalidArgument): put a descriptor-free description in the manager instead.
//   - Each proxy call costs a round trip through the manager process (tens of microseconds):
//     for hot data use shared memory (mp/shared_value.h, mp/sharing.h).
//   - The Manager object belongs to the process that created it: destroy it there. A forked
//     child's copy of a Manager must not be destroyed (fork children normally _exit).
#ifndef FORKSAFE_MP_MANAGER_H_
#define FORKSAFE_MP_MANAGER_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "forksafe/mp/manager_proxies.h"
#include "forksafe/mp/start_method.h"
#include "forksafe/mp/timeout.h"

namespace forksafe::mp {

/// How to start a Manager.
struct ManagerOptions {
  std::string name;          ///< Default "Manager-N".
  StartMethod start_method;  ///< kDefault ("") means get_start_method().
  /// How long the constructor waits for the manager process to listen.
  Timeout start_timeout = 60.0;
};

/// A manager process and the factory of its objects. Move-only.
class Manager {
 public:
  /// Starts the manager process. Throws what Process::start throws, Error(kProcessFailed) when
  /// the manager did not come up, kDeadlineExceeded after start_timeout.
  explicit Manager(ManagerOptions options = {});
  /// shutdown().
  ~Manager();
  Manager(Manager&&) noexcept;
  Manager& operator=(Manager&&) noexcept;
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  /// Stops the manager process and reaps it (SIGKILL after 5 s if it does not stop). Idempotent;
  /// every proxy call afterwards throws Error(kClosed) saying it was shut down.
  void shutdown();
  /// True between construction and shutdown() (and while the process lives).
  bool running() const;
  /// The manager process's pid.
  pid_t pid() const;
  const std::string& name() const;
  /// The start method of the manager process (kDefault once moved from).
  StartMethod start_method() const;

  /// A new dict holding `contents`.
  template <class K, class V>
  DictProxy<K, V> dict(const std::map<K, V>& contents = {}) {
    std::vector<std::string> blobs;
    for (const auto& [k, v] : contents) {
      blobs.push_back(internal::EncodeManaged(k, "Manager::dict"));
      blobs.push_back(internal::EncodeManaged(v, "Manager::dict"));
    }
    return DictProxy<K, V>(Create(internal::ManagedKind::kDict, {}, std::move(blobs)));
  }
  /// A new list holding `contents`.
  template <class T>
  ListProxy<T> list(const std::vector<T>& contents = {}) {
    return ListProxy<T>(
        Create(internal::ManagedKind::kList, {}, internal::EncodeAll(contents, "Manager::list")));
  }
  /// A new, empty Namespace (named attributes of any codec type).
  NamespaceProxy Namespace() { return NamespaceProxy(Create(internal::ManagedKind::kNamespace)); }
  /// A new Lock (non-recursive).
  LockProxy Lock() { return LockProxy(Create(internal::ManagedKind::kLock)); }
  /// A new RLock.
  RLockProxy RLock() { return RLockProxy(Create(internal::ManagedKind::kRLock)); }
  /// A semaphore holding `value` (>= 0, else kInvalidArgument) units.
  SemaphoreProxy Semaphore(int value = 1) {
    return SemaphoreProxy(Create(internal::ManagedKind::kSemaphore, {value}));
  }
  /// A semaphore capped at its initial `value` (>= 0).
  SemaphoreProxy BoundedSemaphore(int value = 1) {
    return SemaphoreProxy(Create(internal::ManagedKind::kBoundedSemaphore, {value}));
  }
  /// A condition over a new RLock of its own.
  ConditionProxy Condition();
  /// A condition over a Lock or RLock of this manager (else kInvalidArgument).
  ConditionProxy Condition(const LockProxy& lock);
  ConditionProxy Condition(const RLockProxy& lock);
  /// A new, cleared Event.
  EventProxy Event() { return EventProxy(Create(internal::ManagedKind::kEvent)); }
  /// A barrier for `parties` (>= 1) callers.
  BarrierProxy Barrier(int parties) {
    return BarrierProxy(Create(internal::ManagedKind::kBarrier, {parties}));
  }
  /// A FIFO queue holding at most `maxsize` items (<= 0: unbounded).
  template <class T>
  QueueProxy<T> Queue(int64_t maxsize = 0) {
    return QueueProxy<T>(Create(internal::ManagedKind::kQueue, {maxsize}));
  }
  /// A value holding `initial`.
  template <class T>
  ValueProxy<T> Value(const T& initial = T{}) {
    return ValueProxy<T>(Create(internal::ManagedKind::kValue, {},
                                {internal::EncodeManaged(initial, "Manager::Value")}));
  }
  /// A fixed-size array of `n` (>= 0) value-initialized items.
  template <class T>
  ArrayProxy<T> Array(int64_t n) {
    if (n < 0) internal::ThrowNegativeSize("Manager::Array", n);
    return Array(std::vector<T>(static_cast<size_t>(n)));
  }
  /// A fixed-size array holding `contents`.
  template <class T>
  ArrayProxy<T> Array(const std::vector<T>& contents) {
    return ArrayProxy<T>(
        Create(internal::ManagedKind::kArray, {}, internal::EncodeAll(contents, "Manager::Array")));
  }

 private:
  internal::ProxyBase Create(internal::ManagedKind kind, std::vector<int64_t> ints = {},
                             std::vector<std::string> blobs = {});
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_MANAGER_H_
