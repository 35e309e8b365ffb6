// mp/internal/manager_protocol.h: NOT FOR USERS. The messages between manager proxies and the
// manager process (mp/manager.h), and what a proxy carries to reach its manager.
//
// One request, one reply, on a connection that carries nothing else at the time (a client uses a
// connection for one call at a time). Values travel as codec bytes (Encode(value).bytes): the
// server stores and compares bytes and never needs the C++ types.
#ifndef FORKSAFE_MP_INTERNAL_MANAGER_PROTOCOL_H_
#define FORKSAFE_MP_INTERNAL_MANAGER_PROTOCOL_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "forksafe/mp/codec.h"

namespace forksafe::mp::internal {

/// The kinds of object a manager holds (kManager: the manager itself, for kCreate).
enum class ManagedKind : uint8_t {
  kManager = 0,
  kDict,
  kList,
  kNamespace,
  kLock,
  kRLock,
  kSemaphore,
  kBoundedSemaphore,
  kCondition,
  kEvent,
  kBarrier,
  kQueue,
  kValue,
  kArray,
  kEnd,  // one past the last
};

/// "dict", "list", ... (for messages).
const char* ManagedKindName(ManagedKind kind);

/// Operations. Each is valid for the kinds the server's dispatch lists.
enum class ManagerOp : uint16_t {
  kCreate = 1,  // ints: parameters of the kind; blobs: initial contents. Out: ints[0] = id.
  kPing,
  // dict (blobs hold keys and values)
  kDictGet,       // blobs[0] key -> blobs[0] value, or kNotFound
  kDictGetOpt,    // blobs[0] key -> zero or one blob
  kDictSet,       // key, value
  kDictContains,  // key -> ints[0] 0/1
  kDictPop,       // key -> zero or one blob (erased)
  kDictSize,
  kDictKeys,
  kDictValues,
  kDictItems,  // out: key, value, key, value, ... in insertion order
  kDictClear,
  kDictUpdate,      // in: key, value, key, value, ...
  kDictSetDefault,  // key, default -> the value now stored
  // sequences: list and array
  kSeqGet,  // ints[0] index
  kSeqSet,  // ints[0] index, blobs[0] value
  kSeqSize,
  kSeqCopy,
  // list only
  kListAppend,
  kListExtend,
  kListPop,     // ints[0] index
  kListInsert,  // ints[0] index, blobs[0] value
  kListReverse,
  kListClear,
  // namespace (blobs[0] attribute name as plain bytes)
  kNsGet,
  kNsSet,
  kNsHas,
  kNsErase,
  kNsNames,
  // lock, rlock, condition (on its lock), semaphores
  kAcquire,  // timeout; out ints[0] 0/1
  kRelease,  // ints[0] n (semaphores)
  kSemValue,
  // condition
  kCondWait,    // timeout -> ints[0] notified
  kCondNotify,  // ints[0] n (-1: all)
  // event
  kEventSet,
  kEventClear,
  kEventIsSet,
  kEventWait,
  // barrier
  kBarrierWait,  // -> ints[0] arrival index
  kBarrierAbort,
  kBarrierReset,
  kBarrierInfo,  // -> parties, n_waiting, broken
  // queue
  kQueuePut,
  kQueueGet,
  kQueueSize,  // -> size, maxsize
  // value
  kValueGet,
  kValueSet,
  kEnd,
};

/// A call. `timeout` < 0 means forever (validated by the client; the server refuses other
/// negative values as kInvalidArgument).
struct ManagerRequest {
  uint64_t object = 0;
  ManagedKind kind = ManagedKind::kManager;
  ManagerOp op = ManagerOp::kPing;
  int32_t pid = 0;  // the caller, for lock ownership
  int64_t tid = 0;  // the caller's thread (gettid)
  double timeout = -1;
  std::vector<int64_t> ints;
  std::vector<std::string> blobs;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(object, kind, op, pid, tid, timeout, ints, blobs);
  }
};

/// The answer: code < 0 for success, else a runtime::ErrorCode with `message`.
struct ManagerReply {
  int32_t code = -1;
  std::string message;
  std::vector<int64_t> ints;
  std::vector<std::string> blobs;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(code, message, ints, blobs);
  }
};

/// What a proxy carries to reach its manager. Holding it (the secret in particular) is what
/// allows talking to the manager: see the threat model in mp/manager.h.
struct ManagerAddress {
  std::string socket_name;  // abstract AF_UNIX name, without the leading NUL
  std::string secret;       // kSecretBytes random bytes
  std::string name;         // "Manager-1"
  int32_t pid = 0;          // the manager process

  template <class Archive>
  void serialize(Archive& ar) {
    ar(socket_name, secret, name, pid);
  }
};

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_MANAGER_PROTOCOL_H_
