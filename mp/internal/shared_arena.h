// mp/internal/shared_arena.h: NOT FOR USERS. The caching allocator of shared memory behind
// shared tensors, and the cross-process handles to its blocks.
//
// Layout: memory comes in segments (a memfd, or a named POSIX shm object for the file_system
// strategy). A segment starts with a SegmentHeader; blocks follow, each with a BlockHeader that
// holds a reference count shared by every process that maps the block. Segments are reserved when
// created (every page read in through the creator's mapping, MADV_POPULATE_READ; fallocate() on
// kernels before 5.14), so running out of memory is a clean error at allocation, never a SIGBUS at
// first touch.
//
// Lifetimes: a block's shared count is the number of live references in all processes plus the
// references in flight (exported, not yet imported). Exporting increments it; importing adopts
// the in-flight reference. The process that created the segment reuses a block once the count
// drops to zero (its caching allocator keeps freed blocks by size class). A block over 16 MiB (or
// any block with the cache off) gets a dedicated segment: for file_system, never reused:
// whichever process drops its count to zero unlinks its name, so it is never left in /dev/shm
// while its creator lives; when the creator lets go while references remain elsewhere, it keeps
// the segment on a list that EmptyCache checks for references held only by dead queues. For
// file_descriptor, see "Large segments" below. The segment's memory goes back to the kernel when
// it is unlinked (or a memfd) and every process has unmapped it and closed its descriptors.
//
// Large segments (file_descriptor only): when the creator's block of a dedicated memfd segment is
// freed, the creator keeps the segment (mapped, its pages faulted in) on a bounded cache, and a
// later large block reuses it, once its shared count is 0 (no process holds a block of it and
// none is in flight), so that a fresh large tensor costs a copy into warm memory instead of a new
// memfd, its reservation, 16,384 first-touch page-table entries per 64 MiB, and a new mapping in
// the receiver (which keeps its most recently imported segments mapped and finds a reused one by
// its identity, validating the block as for any import). Rules:
//   - a cached segment serves a request whose segment would be at least half its size (at most
//     2x the memory asked for), the smallest such first; it is never handed out while held;
//   - the cache holds at most min(limit, a quarter of what the system could give to shared memory
//     with the cache empty: CheckMemoryAvailable's kShared bounds, cgroup room included), judged
//     at each insertion, oldest evicted first. The limit is 256 MiB unless SetLargeCacheLimit
//     (mp::set_sharing_large_cache_limit) says otherwise; 0 turns the cache off;
//   - EmptyCache / ReleaseCaches (runtime::ReleaseCachedResources) drop it all, and so does
//     Allocate when memory or /dev/shm is short (before it fails); with set_sharing_cache_enabled
//     (false) new segments are not cached and the cache is not used;
//   - named (file_system) segments are never cached: their name is unlinked by whichever process
//     drops the last reference, so it could vanish under a reuse;
//   - a forked child never allocates from its parent's cached segments (it abandons the list, and
//     the segments are not OwnedHere() there).
// Hazard: a receiver keeps up to 16 recently imported segments mapped; a segment the creator
// evicted stays in memory until the receiver lets go of it (ReleaseCaches there) or maps others.
//
// Blocks across fork(): a SharedBlock that a forked child inherits (a copy of the parent's
// object, made by fork itself) holds no reference of the child's: dropping it there gives nothing
// back, so the parent's counts stay true whatever the child does, _exit and SIGKILL included (a
// reference taken for the child at the fork would be lost by every child that exits without
// running destructors, and pin the segment for ever). Hazard: the block stays the parent's; once
// the parent lets go of it, it may be reused under the child. A forked child may use an inherited
// tensor for as long as the parent keeps it (a Process keeps its arguments until it is
// destroyed); to own one, receive it through a Queue or Pipe, which takes a reference.
//
// In-flight references (the rule, for both segment kinds): a reference exported while a message
// is encoded for a Queue (an InFlightScope, mp/internal/shared_segment.h) is counted in the
// segment header under that queue's identity (mp/internal/shm_manager.h, SegmentHeader), and
// the handle says which queue; the import that adopts it takes it off that queue's count. So:
//   - a segment stays while such a message is unread and some process holds the queue, even
//     after its creator exited (file_system: the name stays; file_descriptor: the descriptor
//     travels in the queue);
//   - a message that is never put (refused, timed out) gives its references back at once; one
//     that is put hands them to the queue at the commit point (Queue::PutMessage commits the
//     scope there, and nothing after it throws);
//   - references in flight in a queue that no process holds any more (messages never read) are
//     dead: a segment that only they hold is freed (EmptyCache in the creator, the shm manager
//     after it), although its count is not zero. "No process holds it" comes from a scan of
//     /proc taken after a snapshot of the segment's counts (RefSnapshot), never under the
//     arena's lock; see the Hazard of mp/internal/shm_manager.h for queues in transit.
#ifndef FORKSAFE_MP_INTERNAL_SHARED_ARENA_H_
#define FORKSAFE_MP_INTERNAL_SHARED_ARENA_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "forksafe/mp/codec.h"

namespace forksafe::mp::internal {

/// How segments are named and found by other processes.
enum class SegmentKind : uint8_t {
  kMemfd = 0,  ///< Anonymous memfd, passed as a descriptor (the file_descriptor strategy).
  kNamed = 1,  ///< Named POSIX shm, passed by name (the file_system strategy).
};

class Segment;

/// One live reference, in this process, to a block of shared memory.
class SharedBlock {
 public:
  ~SharedBlock();
  SharedBlock(const SharedBlock&) = delete;
  SharedBlock& operator=(const SharedBlock&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  /// A key that identifies the block across processes: (segment identity, offset).
  std::string key() const;
  /// References to the block in all processes, including ones in flight (a snapshot).
  int32_t shared_count() const;

  /// Cross-process handle: what travels in a message.
  struct Handle {
    SegmentKind kind = SegmentKind::kMemfd;
    FileDescriptor fd;  // kMemfd
    std::string name;   // kNamed
    uint64_t segment_id = 0;
    uint64_t offset = 0;
    uint64_t size = 0;
    uint64_t carrier = 0;  // the queue whose message holds the in-flight reference (0: none)

    template <class Archive>
    void save(Archive& ar) const {
      ar(static_cast<uint8_t>(kind), fd, name, segment_id, offset, size, carrier);
    }
    template <class Archive>
    void load(Archive& ar) {
      uint8_t k = 0;
      ar(k);
      if (k > static_cast<uint8_t>(SegmentKind::kNamed)) ThrowMalformed("unknown segment kind");
      kind = static_cast<SegmentKind>(k);
      fd = FileDescriptor::LoadBorrowed(ar);  // Import dups it only for a segment new here
      ar(name, segment_id, offset, size, carrier);
    }
  };

  /// Makes a handle for another process, with one in-flight reference it will adopt. Inside an
  /// InFlightScope the reference is the scope's queue's, and given back if the scope is not
  /// committed.
  Handle Export() const;

 private:
  friend class SharedArena;
  SharedBlock(std::shared_ptr<Segment> seg, uint64_t offset, void* data, size_t size,
              bool allocated_here);
  std::shared_ptr<Segment> seg_;
  bool allocated_here_;  // made by Allocate in this process (counts in the segment's live blocks)
  uint64_t offset_;
  void* data_;
  size_t size_;
  // The process generation it was made in (see "Blocks across fork" above).
  uint64_t generation_;
};

/// Checks what a handle from another process says without touching any segment: a named
/// segment's name must be one of forksafe's ("/forksafe_..." with no other '/'), a memfd segment
/// must come with its descriptor. Error(kInvalidArgument) ("malformed tensor handle: ...").
void CheckHandle(const SharedBlock::Handle& h);

/// Checks that a block at `offset` (its data, after its block header) of `size` bytes lies in a
/// segment of `segment_size` bytes, after the segment's header page, 64-byte aligned.
/// Error(kInvalidArgument) otherwise; no arithmetic on the peer's numbers can overflow.
void CheckBlockPlacement(uint64_t offset, uint64_t size, uint64_t segment_size);

/// Counters for tests, benchmarks and diagnostics.
struct ArenaStats {
  uint64_t segments_created = 0;
  uint64_t segments_mapped = 0;  ///< Imported from other processes.
  uint64_t blocks_allocated = 0;
  uint64_t blocks_reused = 0;          ///< Served from the cache instead of fresh memory.
  uint64_t bytes_reserved = 0;         ///< In segments this process created.
  uint64_t live_segments = 0;          ///< Segments this process maps now.
  uint64_t large_segments_reused = 0;  ///< Large blocks served by a cached dedicated segment.
  uint64_t large_cache_bytes = 0;      ///< Bytes on the large-segment cache now.
};

/// The process-wide arena.
class SharedArena {
 public:
  static SharedArena& Get();

  /// A block of at least `bytes` bytes (0 allowed) of segment kind `kind`. When `cached` is
  /// false the block gets a fresh segment of its own (for measuring what the cache saves), never
  /// one from the large-segment cache nor cached after it.
  /// When memory or /dev/shm is short, the cache is given back and the least segment that serves
  /// the request is tried before giving up. Throws kResourceExhausted (saying whether memory,
  /// /dev/shm or descriptors ran out).
  std::shared_ptr<SharedBlock> Allocate(size_t bytes, SegmentKind kind, bool cached = true);

  /// Maps the block behind `handle` (the segment is mapped once per process and cached) and
  /// adopts its in-flight reference. Throws kInvalidArgument for a malformed handle.
  std::shared_ptr<SharedBlock> Import(SharedBlock::Handle handle);

  /// Unmaps segments of this process's cache whose blocks are all free, and those (dedicated
  /// ones included) whose only references left are in flight in queues that no process holds
  /// (scans /proc then, with the arena's lock released), and drops the large-segment cache.
  void EmptyCache();

  /// EmptyCache(), and also lets go of the recently imported segments kept mapped for speed
  /// (each is unmapped unless a live block holds it). Registered as a cache of
  /// runtime::ReleaseCachedResources().
  void ReleaseCaches();

  ArenaStats stats() const;

  /// Bounds the large-segment cache ("Large segments" above) to `bytes` (0: off), evicting what is
  /// over it now. Default 256 MiB.
  void SetLargeCacheLimit(size_t bytes);
  size_t LargeCacheLimit() const;

  /// Prefix of named segments ("/forksafe_<pid>_"), for the shm manager.
  static std::string NamePrefix();

  /// Holds the arena's lock, for tests of a fork whose prepare cannot take it.
  std::unique_lock<std::mutex> LockForTesting();

 public:
  struct Impl;  // defined in arena_segment.h

 private:
  SharedArena();
  static SharedArena* Make();  // for Get()
  Impl* impl_;
  friend class SharedBlock;
  friend class Segment;
};

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_SHARED_ARENA_H_
