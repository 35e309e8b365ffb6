// mp/manager_proxies.h: the typed proxies of mp/manager.h (include that header).
//
// What it offers
//   One proxy class per kind of manager object, with Python's method names: DictProxy<K, V>,
//   ListProxy<T>, NamespaceProxy, LockProxy, RLockProxy, SemaphoreProxy, ConditionProxy,
//   EventProxy, BarrierProxy, QueueProxy<T>, ValueProxy<T>, ArrayProxy<T>.
//
// Guarantees
//   - Every method is one round trip to the manager (wait_for: one per wait) and is atomic
//     there. Errors and the failure rule are those of mp/manager.h.
//   - Proxies are values: copies refer to the same object. They cross processes as Process
//     arguments, Queue/Pipe items and Pool task arguments (cereal save/load carry the manager's
//     address, its secret and the object id). Decoding checks the proxy type: bytes of a
//     DictProxy<int, int> decoded as a ListProxy<int> or a DictProxy<std::string, int> throw
//     Error(kInvalidArgument).
//   - Thread safety: a proxy may be used from several threads at once (each call takes its own
//     connection).
//
// Hazards: see mp/manager.h.
#ifndef FORKSAFE_MP_MANAGER_PROXIES_H_
#define FORKSAFE_MP_MANAGER_PROXIES_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/internal/manager_protocol.h"
#include "forksafe/mp/timeout.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {

class Manager;

namespace internal {

[[noreturn]] void ThrowHoldsDescriptors(const char* what);
[[noreturn]] void ThrowNegativeSize(const char* what, int64_t n);
[[noreturn]] void ThrowWrongProxy(const std::string& expected, const std::string& got);

/// The codec bytes of `value` for storing in a manager (no descriptors allowed).
template <class T>
std::string EncodeManaged(const T& value, const char* what) {
  Message m = Encode(value);
  if (!m.fds.empty()) ThrowHoldsDescriptors(what);
  return std::move(m.bytes);
}
template <class T>
std::vector<std::string> EncodeAll(const std::vector<T>& values, const char* what) {
  std::vector<std::string> out;
  out.reserve(values.size());
  for (const T& v : values) out.push_back(EncodeManaged(v, what));
  return out;
}
template <class T>
T DecodeManaged(std::string bytes) {
  Message m;
  m.bytes = std::move(bytes);
  return DecodeAs<T>(m);
}
template <class T>
std::vector<T> DecodeAll(std::vector<std::string>& blobs) {
  std::vector<T> out;
  out.reserve(blobs.size());
  for (std::string& b : blobs) out.push_back(DecodeManaged<T>(std::move(b)));
  return out;
}

template <class T, class = void>
struct Streamable : std::false_type {};
template <class T>
struct Streamable<T,
                  std::void_t<decltype(std::declval<std::ostream&>() << std::declval<const T&>())>>
    : std::true_type {};
/// "key 'abc'" / "key 3" / "a key (of a type that cannot be printed)" for messages.
template <class T>
std::string DescribeKey(const T& key) {
  if constexpr (std::is_convertible_v<const T&, std::string>) {
    return "key '" + std::string(key) + "'";
  } else if constexpr (Streamable<T>::value) {
    std::ostringstream os;
    os << key;
    return "key " + os.str();
  } else {
    return "the key (of a type that cannot be printed)";
  }
}

/// The wait of a call in seconds: 0 without block, nullopt for forever (checks the timeout).
std::optional<double> WaitSeconds(bool block, const Timeout& timeout, const char* what);

/// What every proxy holds: the manager's address, the object id and kind.
class ProxyBase {
 public:
  ProxyBase() = default;
  ProxyBase(std::shared_ptr<const ManagerAddress> addr, uint64_t id, ManagedKind kind)
      : addr_(std::move(addr)), id_(id), kind_(kind) {}

  /// The object's id in its manager (0 for an empty proxy).
  uint64_t id() const { return id_; }
  /// The name of the manager (empty for an empty proxy).
  std::string manager_name() const { return addr_ ? addr_->name : std::string(); }
  /// The manager's pid (0 for an empty proxy).
  pid_t manager_pid() const { return addr_ ? addr_->pid : 0; }
  /// True when this proxy refers to an object (it was not default-constructed).
  explicit operator bool() const { return addr_ != nullptr; }

  /// One round trip (see mp/internal/manager_client.h). `wait`: nullopt waits forever.
  ManagerReply Call(ManagerOp op, const char* what, std::vector<int64_t> ints = {},
                    std::vector<std::string> blobs = {}, std::optional<double> wait = 0.0) const;
  const std::shared_ptr<const ManagerAddress>& address() const { return addr_; }
  ManagedKind kind() const { return kind_; }

 protected:
  template <class Archive>
  void SaveProxy(Archive& ar, const char* type) const {
    const bool present = addr_ != nullptr;
    ar(std::string(type), present);
    if (present) ar(*addr_, id_, kind_);
  }
  template <class Archive>
  void LoadProxy(Archive& ar, const char* type, ManagedKind expected) {
    std::string got;
    bool present = false;
    ar(got, present);
    if (got != type) ThrowWrongProxy(type, got);
    addr_.reset();
    id_ = 0;
    if (!present) return;
    auto addr = std::make_shared<ManagerAddress>();
    ManagedKind kind = ManagedKind::kManager;
    ar(*addr, id_, kind);
    if (kind != expected) ThrowWrongProxy(type, ManagedKindName(kind));
    addr_ = std::move(addr);
    kind_ = kind;
  }

 private:
  std::shared_ptr<const ManagerAddress> addr_;
  uint64_t id_ = 0;
  ManagedKind kind_ = ManagedKind::kManager;
};

}  // namespace internal

// Every proxy: a default constructor (an empty proxy, for decoding into; calls on it throw
// kFailedPrecondition), cereal save/load, and construction by Manager only.
#define FORKSAFE_MP_PROXY_COMMON(Self, Kind)                                  \
 public:                                                                      \
  Self() = default;                                                           \
  template <class Archive>                                                    \
  void save(Archive& ar) const {                                              \
    SaveProxy(ar, typeid(Self).name());                                       \
  }                                                                           \
  template <class Archive>                                                    \
  void load(Archive& ar) {                                                    \
    LoadProxy(ar, typeid(Self).name(), internal::ManagedKind::Kind);          \
  }                                                                           \
                                                                              \
 private:                                                                     \
  friend class Manager;                                                       \
  explicit Self(internal::ProxyBase b) : internal::ProxyBase(std::move(b)) {} \
                                                                              \
 public:

/// A dict of the manager: K -> V, in insertion order.
template <class K, class V>
class DictProxy : public internal::ProxyBase {
  FORKSAFE_MP_PROXY_COMMON(DictProxy, kDict)
  /// The value of `key`; Error(kNotFound) naming the key when absent.
  V get(const K& key) const {
    try {
      return One(Call(internal::ManagerOp::kDictGet, "dict.get", {}, {Key(key)}));
    } catch (const runtime::Error& e) {
      if (e.code() != runtime::ErrorCode::kNotFound) throw;
      throw runtime::Error(e.code(), e.message() + ": " + internal::DescribeKey(key) +
                                         " (use get(key, default) or contains(key))");
    }
  }
  /// The value of `key`, or `fallback` when absent.
  V get(const K& key, const V& fallback) const {
    auto r = Call(internal::ManagerOp::kDictGetOpt, "dict.get", {}, {Key(key)});
    return r.blobs.empty() ? fallback : One(std::move(r));
  }
  /// d[key] = value.
  void set(const K& key, const V& value) {
    Call(internal::ManagerOp::kDictSet, "dict.set", {}, {Key(key), Val(value)});
  }
  /// Sets every entry of `entries` (one atomic operation).
  void update(const std::map<K, V>& entries) {
    std::vector<std::string> blobs;
    for (const auto& [k, v] : entries) {
      blobs.push_back(Key(k));
      blobs.push_back(Val(v));
    }
    Call(internal::ManagerOp::kDictUpdate, "dict.update", {}, std::move(blobs));
  }
  /// The value of `key`, first setting it to `value` when absent.
  V setdefault(const K& key, const V& value) {
    return One(
        Call(internal::ManagerOp::kDictSetDefault, "dict.setdefault", {}, {Key(key), Val(value)}));
  }
  bool contains(const K& key) const {
    return Call(internal::ManagerOp::kDictContains, "dict.contains", {}, {Key(key)}).ints.at(0);
  }
  /// Removes `key`; returns whether it was there.
  bool erase(const K& key) {
    return !Call(internal::ManagerOp::kDictPop, "dict.erase", {}, {Key(key)}).blobs.empty();
  }
  /// Removes `key` and returns its value; Error(kNotFound) naming it when absent.
  V pop(const K& key) {
    auto r = Call(internal::ManagerOp::kDictPop, "dict.pop", {}, {Key(key)});
    if (r.blobs.empty()) {
      throw runtime::Error(runtime::ErrorCode::kNotFound,
                           "dict.pop: " + internal::DescribeKey(key) + " is not in the dict");
    }
    return One(std::move(r));
  }
  /// Removes `key` and returns its value, or `fallback` when absent.
  V pop(const K& key, const V& fallback) {
    auto r = Call(internal::ManagerOp::kDictPop, "dict.pop", {}, {Key(key)});
    return r.blobs.empty() ? fallback : One(std::move(r));
  }
  size_t size() const {
    return static_cast<size_t>(Call(internal::ManagerOp::kDictSize, "dict.size").ints.at(0));
  }
  std::vector<K> keys() const {
    auto r = Call(internal::ManagerOp::kDictKeys, "dict.keys");
    return internal::DecodeAll<K>(r.blobs);
  }
  std::vector<V> values() const {
    auto r = Call(internal::ManagerOp::kDictValues, "dict.values");
    return internal::DecodeAll<V>(r.blobs);
  }
  /// (key, value) pairs in insertion order.
  std::vector<std::pair<K, V>> items() const {
    auto r = Call(internal::ManagerOp::kDictItems, "dict.items");
    std::vector<std::pair<K, V>> out;
    for (size_t i = 0; i + 1 < r.blobs.size(); i += 2) {
      out.emplace_back(internal::DecodeManaged<K>(std::move(r.blobs[i])),
                       internal::DecodeManaged<V>(std::move(r.blobs[i + 1])));
    }
    return out;
  }
  void clear() { Call(internal::ManagerOp::kDictClear, "dict.clear"); }
  /// A snapshot as a std::map.
  std::map<K, V> copy() const {
    std::map<K, V> out;
    for (auto& [k, v] : items()) out[std::move(k)] = std::move(v);
    return out;
  }

 private:
  static std::string Key(const K& k) { return internal::EncodeManaged(k, "dict key"); }
  static std::string Val(const V& v) { return internal::EncodeManaged(v, "dict value"); }
  static V One(internal::ManagerReply r) {
    return internal::DecodeManaged<V>(std::move(r.blobs.at(0)));
  }
};

/// Shared by ListProxy and ArrayProxy: indexed access (negative indices count from the end).
template <class T>
class SequenceOps : public internal::ProxyBase {
 public:
  SequenceOps() = default;
  explicit SequenceOps(internal::ProxyBase b) : internal::ProxyBase(std::move(b)) {}
  T get(int64_t index) const {
    return internal::DecodeManaged<T>(
        std::move(Call(internal::ManagerOp::kSeqGet, "get", {index}).blobs.at(0)));
  }
  void set(int64_t index, const T& value) {
    Call(internal::ManagerOp::kSeqSet, "set", {index}, {internal::EncodeManaged(value, "set")});
  }
  size_t size() const {
    return static_cast<size_t>(Call(internal::ManagerOp::kSeqSize, "size").ints.at(0));
  }
  /// A snapshot of every item.
  std::vector<T> copy() const {
    auto r = Call(internal::ManagerOp::kSeqCopy, "copy");
    return internal::DecodeAll<T>(r.blobs);
  }
};

/// A list of the manager.
template <class T>
class ListProxy : public SequenceOps<T> {
 public:
  ListProxy() = default;
  template <class Archive>
  void save(Archive& ar) const {
    this->SaveProxy(ar, typeid(ListProxy).name());
  }
  template <class Archive>
  void load(Archive& ar) {
    this->LoadProxy(ar, typeid(ListProxy).name(), internal::ManagedKind::kList);
  }
  void append(const T& value) {
    this->Call(internal::ManagerOp::kListAppend, "list.append", {},
               {internal::EncodeManaged(value, "list.append")});
  }
  void extend(const std::vector<T>& values) {
    this->Call(internal::ManagerOp::kListExtend, "list.extend", {},
               internal::EncodeAll(values, "list.extend"));
  }
  /// Removes and returns the item at `index` (default: the last).
  T pop(int64_t index = -1) {
    return internal::DecodeManaged<T>(
        std::move(this->Call(internal::ManagerOp::kListPop, "list.pop", {index}).blobs.at(0)));
  }
  /// Inserts before `index` (clamped to the list, as Python).
  void insert(int64_t index, const T& value) {
    this->Call(internal::ManagerOp::kListInsert, "list.insert", {index},
               {internal::EncodeManaged(value, "list.insert")});
  }
  void reverse() { this->Call(internal::ManagerOp::kListReverse, "list.reverse"); }
  void clear() { this->Call(internal::ManagerOp::kListClear, "list.clear"); }

 private:
  friend class Manager;
  explicit ListProxy(internal::ProxyBase b) : SequenceOps<T>(std::move(b)) {}
};

/// A fixed-size array of the manager (get/set by index, size, copy).
template <class T>
class ArrayProxy : public SequenceOps<T> {
 public:
  ArrayProxy() = default;
  template <class Archive>
  void save(Archive& ar) const {
    this->SaveProxy(ar, typeid(ArrayProxy).name());
  }
  template <class Archive>
  void load(Archive& ar) {
    this->LoadProxy(ar, typeid(ArrayProxy).name(), internal::ManagedKind::kArray);
  }

 private:
  friend class Manager;
  explicit ArrayProxy(internal::ProxyBase b) : SequenceOps<T>(std::move(b)) {}
};

/// Named attributes of any codec type.
class NamespaceProxy : public internal::ProxyBase {
  FORKSAFE_MP_PROXY_COMMON(NamespaceProxy, kNamespace)
  template <class T>
  void set(const std::string& name, const T& value) {
    Call(internal::ManagerOp::kNsSet, "Namespace.set", {},
         {name, internal::EncodeManaged(value, "Namespace.set")});
  }
  /// The attribute `name` as a T; Error(kNotFound) naming it when absent.
  template <class T>
  T get(const std::string& name) const {
    return internal::DecodeManaged<T>(
        std::move(Call(internal::ManagerOp::kNsGet, "Namespace.get", {}, {name}).blobs.at(0)));
  }
  bool has(const std::string& name) const;
  /// Removes `name`; returns whether it was there.
  bool erase(const std::string& name);
  /// The attribute names, sorted.
  std::vector<std::string> names() const;
};

/// A non-recursive lock of the manager.
class LockProxy : public internal::ProxyBase {
  FORKSAFE_MP_PROXY_COMMON(LockProxy, kLock)
  /// With block=false returns at once; otherwise waits at most `timeout` (forever when absent).
  /// Returns whether the lock was taken. kFailedPrecondition when the caller holds it already
  /// and would wait.
  bool acquire(bool block = true, Timeout timeout = std::nullopt);
  /// kFailedPrecondition when the calling (process, thread) does not hold it.
  void release();
  /// True when this proxy's last successful acquire took the lock over from a process that
  /// exited holding it (killed, or ended without releasing): the data it guards may be
  /// half-updated. As mp::Lock::previous_owner_died; each proxy object keeps its own answer.
  bool previous_owner_died() const { return owner_died_; }
  void lock() { acquire(); }
  bool try_lock() { return acquire(false); }
  void unlock() { release(); }

 private:
  bool owner_died_ = false;
};

/// A recursive lock of the manager: its owner may acquire it again; release() undoes one level.
class RLockProxy : public internal::ProxyBase {
  FORKSAFE_MP_PROXY_COMMON(RLockProxy, kRLock)
  bool acquire(bool block = true, Timeout timeout = std::nullopt);
  void release();
  /// As LockProxy::previous_owner_died (on a take-over the depth restarts at 1).
  bool previous_owner_died() const { return owner_died_; }
  void lock() { acquire(); }
  bool try_lock() { return acquire(false); }
  void unlock() { release(); }

 private:
  bool owner_died_ = false;
};

/// A Semaphore or BoundedSemaphore of the manager.
class SemaphoreProxy : public internal::ProxyBase {
 public:
  SemaphoreProxy() = default;
  template <class Archive>
  void save(Archive& ar) const {
    SaveProxy(ar, typeid(SemaphoreProxy).name());
  }
  template <class Archive>
  void load(Archive& ar) {
    LoadProxyOfEither(ar);  // a Semaphore or a BoundedSemaphore
  }
  /// Takes a unit; with block=false returns at once, else waits at most `timeout`.
  bool acquire(bool block = true, Timeout timeout = std::nullopt);
  /// Gives back `n` (>= 1) units; kFailedPrecondition above a BoundedSemaphore's initial value.
  void release(int n = 1);
  /// The units available now.
  int get_value() const;
  void lock() { acquire(); }
  bool try_lock() { return acquire(false); }
  void unlock() { release(); }

 private:
  friend class Manager;
  explicit SemaphoreProxy(internal::ProxyBase b) : internal::ProxyBase(std::move(b)) {}
  template <class Archive>
  void LoadProxyOfEither(Archive& ar);
};

/// A condition variable of the manager, over its own RLock or a manager Lock/RLock.
class ConditionProxy : public internal::ProxyBase {
  FORKSAFE_MP_PROXY_COMMON(ConditionProxy, kCondition)
  /// Acquires the underlying lock (see LockProxy::acquire).
  bool acquire(bool block = true, Timeout timeout = std::nullopt);
  void release();
  void lock() { acquire(); }
  bool try_lock() { return acquire(false); }
  void unlock() { release(); }
  /// Releases the lock, waits for a notify (at most `timeout`), re-acquires the lock; returns
  /// false when the timeout ran out. The lock must be held: kFailedPrecondition otherwise.
  bool wait(Timeout timeout = std::nullopt);
  /// Waits until predicate() (checked first, under the lock) or the timeout; returns its last
  /// value. The lock must be held.
  template <class Predicate>
  bool wait_for(Predicate predicate, Timeout timeout = std::nullopt) {
    const auto limit = internal::CheckedWait(timeout, "Condition.wait_for");
    const auto deadline = std::chrono::steady_clock::now() +
                          limit.value_or(std::chrono::steady_clock::duration::zero());
    bool result = predicate();
    while (!result) {
      if (limit) {
        const auto left = deadline - std::chrono::steady_clock::now();
        if (left <= std::chrono::steady_clock::duration::zero()) break;
        wait(std::chrono::duration<double>(left).count());
      } else {
        wait();
      }
      result = predicate();
    }
    return result;
  }
  /// Wakes up to `n` (>= 0) waiters. The lock must be held.
  void notify(int n = 1);
  void notify_all();
};

/// An event of the manager.
class EventProxy : public internal::ProxyBase {
  FORKSAFE_MP_PROXY_COMMON(EventProxy, kEvent)
  bool is_set() const;
  void set();
  void clear();
  /// Waits until the flag is set, at most `timeout`; returns the flag.
  bool wait(Timeout timeout = std::nullopt);
};

/// A barrier of the manager (no action: the manager runs no user code).
class BarrierProxy : public internal::ProxyBase {
  FORKSAFE_MP_PROXY_COMMON(BarrierProxy, kBarrier)
  /// Waits until `parties` callers wait; returns this caller's arrival index (0..parties-1).
  /// Timeout: kDeadlineExceeded and the barrier breaks; broken: kFailedPrecondition.
  int64_t wait(Timeout timeout = std::nullopt);
  /// Breaks the barrier: current and later waiters fail until reset().
  void abort();
  /// Back to the initial state; current waiters fail with kFailedPrecondition.
  void reset();
  int64_t parties() const;
  int64_t n_waiting() const;
  bool broken() const;
};

/// A FIFO queue of the manager.
template <class T>
class QueueProxy : public internal::ProxyBase {
  FORKSAFE_MP_PROXY_COMMON(QueueProxy, kQueue)
  /// With block, waits up to `timeout` for room (bounded queues); throws
  /// Error(kDeadlineExceeded) when there is none.
  void put(const T& value, bool block = true, Timeout timeout = std::nullopt) {
    Call(internal::ManagerOp::kQueuePut, "Queue.put", {},
         {internal::EncodeManaged(value, "Queue.put")},
         internal::WaitSeconds(block, timeout, "Queue.put"));
  }
  void put_nowait(const T& value) { put(value, false); }
  /// The oldest item. With block, waits up to `timeout`; Error(kDeadlineExceeded) when empty.
  T get(bool block = true, Timeout timeout = std::nullopt) {
    auto r = Call(internal::ManagerOp::kQueueGet, "Queue.get", {}, {},
                  internal::WaitSeconds(block, timeout, "Queue.get"));
    return internal::DecodeManaged<T>(std::move(r.blobs.at(0)));
  }
  T get_nowait() { return get(false); }
  int64_t qsize() const { return Call(internal::ManagerOp::kQueueSize, "Queue.qsize").ints.at(0); }
  bool empty() const { return qsize() == 0; }
  bool full() const {
    auto r = Call(internal::ManagerOp::kQueueSize, "Queue.full");
    return r.ints.at(1) > 0 && r.ints.at(0) >= r.ints.at(1);
  }
};

/// A single value of the manager.
template <class T>
class ValueProxy : public internal::ProxyBase {
  FORKSAFE_MP_PROXY_COMMON(ValueProxy, kValue)
  T get() const {
    return internal::DecodeManaged<T>(
        std::move(Call(internal::ManagerOp::kValueGet, "Value.get").blobs.at(0)));
  }
  void set(const T& value) {
    Call(internal::ManagerOp::kValueSet, "Value.set", {},
         {internal::EncodeManaged(value, "Value.set")});
  }
};

#undef FORKSAFE_MP_PROXY_COMMON

template <class Archive>
void SemaphoreProxy::LoadProxyOfEither(Archive& ar) {
  // The bytes carry the kind; a SemaphoreProxy accepts a Semaphore or a BoundedSemaphore.
  std::string type;
  bool present = false;
  ar(type, present);
  if (type != typeid(SemaphoreProxy).name()) {
    internal::ThrowWrongProxy(typeid(SemaphoreProxy).name(), type);
  }
  std::shared_ptr<internal::ManagerAddress> addr;
  uint64_t id = 0;
  internal::ManagedKind kind = internal::ManagedKind::kManager;
  if (present) {
    addr = std::make_shared<internal::ManagerAddress>();
    ar(*addr, id, kind);
  }
  if (present && kind != internal::ManagedKind::kSemaphore &&
      kind != internal::ManagedKind::kBoundedSemaphore) {
    internal::ThrowWrongProxy("Semaphore", internal::ManagedKindName(kind));
  }
  static_cast<internal::ProxyBase&>(*this) =
      present ? internal::ProxyBase(std::move(addr), id, kind) : internal::ProxyBase();
}

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_MANAGER_PROXIES_H_
