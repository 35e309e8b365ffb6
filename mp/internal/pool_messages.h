// mp/internal/pool_messages.h: NOT FOR USERS. The messages between a Pool and its workers
// (mp/pool.cc), with their decoders as pure functions (shared with the fuzz target
// tests/fuzz/pool_messages_fuzz.cc).
//   Parent -> worker: Encode(kind "task"|"exit", id, TaskFn, payload bytes), payload fds attached.
//   Worker -> parent: Encode(kind, id, payload bytes), payload fds attached. Kinds: "ready" (id =
//   pid), "init_failed" (payload ChildFailure), "done" (payload: encoded results), "error"
//   (payload ChildFailure), "malformed" (payload ChildFailure: the worker could not decode a
//   message from the pool, and leaves; the pool fails the chunk the worker held with it).
// The decoders check the envelope only (Error(kInvalidArgument) when malformed); the pool decides
// what an unknown kind means (a worker exits on anything but "task"; the parent ignores kinds it
// does not expect).
#ifndef FORKSAFE_MP_INTERNAL_POOL_MESSAGES_H_
#define FORKSAFE_MP_INTERNAL_POOL_MESSAGES_H_

#include <cstdint>
#include <string>

#include "forksafe/mp/codec.h"

namespace forksafe::mp::internal {

/// What a worker is asked to call. kAddress is honoured only by forked workers (same address
/// space as the parent); kEntry is resolved through the entry-point registry, never trusted as an
/// address.
struct TaskFn {
  enum Kind : int32_t { kNone = 0, kLocal = 1, kAddress = 2, kEntry = 3 };
  int32_t kind = kNone;
  uint64_t local_id = 0;   // kLocal
  uint64_t fn = 0;         // kAddress: the address; kEntry: the offset in its module
  uint64_t runner = 0;     // kAddress: the runner's address
  std::string entry;       // kEntry: the registered name
  std::string runner_key;  // kEntry

  template <class Archive>
  void serialize(Archive& ar) {
    ar(kind, local_id, fn, runner, entry, runner_key);
  }
};

/// A parent -> worker message, decoded.
struct PoolTask {
  std::string kind;
  uint64_t id = 0;
  TaskFn fn;
  Message payload;  // the task's arguments, with the message's descriptors
};
PoolTask DecodePoolTask(Message msg);

/// A worker -> parent message, decoded.
struct PoolReply {
  std::string kind;
  uint64_t id = 0;
  Message payload;  // results or a ChildFailure, with the message's descriptors
};
PoolReply DecodePoolReply(Message msg);

inline PoolTask DecodePoolTask(Message msg) {
  PoolTask t;
  Decode(msg, t.kind, t.id, t.fn, t.payload.bytes);
  t.payload.fds = std::move(msg.fds);
  return t;
}

inline PoolReply DecodePoolReply(Message msg) {
  PoolReply r;
  Decode(msg, r.kind, r.id, r.payload.bytes);
  r.payload.fds = std::move(msg.fds);
  return r;
}

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_POOL_MESSAGES_H_
