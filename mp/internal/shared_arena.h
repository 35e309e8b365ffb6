// mp/internal/shared_arena.h: NOT FOR USERS. The caching allocator of shared memory behind
// shared tensors, and the cross-process handles to its blocks.
//
// Layout: memory comes in segments (a memfd, or a named POSIX shm object for the file_system
// strategy). A segment starts with a SegmentHeader; blocks follow, each with a BlockHeader that
// holds a reference count shared by every process that maps the block. Segments are reserved with
// fallocate() when created, so running out of memory is a clean error at allocation, never a
// SIGBUS at first touch.
//
// Lifetimes: a block's shared count is the number of live references in all processes plus the
// references in flight (exported, not yet imported). Exporting increments it; importing adopts
// the in-flight reference. The process that created the segment reuses a block once the count
// drops to zero (its caching allocator keeps freed blocks by size class). The segment's memory
// goes back to the kernel when every process has unmapped it.
#ifndef FORKSAFE_MP_INTERNAL_SHARED_ARENA_H_
#define FORKSAFE_MP_INTERNAL_SHARED_ARENA_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mp/codec.h"

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

    template <class Archive>
    void save(Archive& ar) const {
      ar(static_cast<uint8_t>(kind), fd, name, segment_id, offset, size);
    }
    template <class Archive>
    void load(Archive& ar) {
      uint8_t k = 0;
      ar(k);
      if (k > static_cast<uint8_t>(SegmentKind::kNamed)) ThrowMalformed("unknown segment kind");
      kind = static_cast<SegmentKind>(k);
      fd = FileDescriptor::LoadBorrowed(ar);  // Import dups it only for a segment new here
      ar(name, segment_id, offset, size);
    }
  };

  /// Makes a handle for another process, with one in-flight reference it will adopt.
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
  uint64_t segments_mapped = 0;   ///< Imported from other processes.
  uint64_t blocks_allocated = 0;
  uint64_t blocks_reused = 0;     ///< Served from the cache instead of fresh memory.
  uint64_t bytes_reserved = 0;    ///< In segments this process created.
  uint64_t live_segments = 0;     ///< Segments this process maps now.
};

/// The process-wide arena.
class SharedArena {
 public:
  static SharedArena& Get();

  /// A block of at least `bytes` bytes (0 allowed) of segment kind `kind`. When `cached` is
  /// false the block gets a fresh segment of its own (for measuring what the cache saves).
  /// Throws kResourceExhausted (saying whether memory, /dev/shm or descriptors ran out).
  std::shared_ptr<SharedBlock> Allocate(size_t bytes, SegmentKind kind, bool cached = true);

  /// Maps the block behind `handle` (the segment is mapped once per process and cached) and
  /// adopts its in-flight reference. Throws kInvalidArgument for a malformed handle.
  std::shared_ptr<SharedBlock> Import(SharedBlock::Handle handle);

  /// Unmaps segments of this process's cache whose blocks are all free.
  void EmptyCache();

  /// EmptyCache(), and also lets go of the recently imported segments kept mapped for speed
  /// (each is unmapped unless a live block holds it). Registered as a cache of
  /// runtime::ReleaseCachedResources().
  void ReleaseCaches();

  ArenaStats stats() const;

  /// Prefix of named segments ("/forksafe_<pid>_"), for the shm manager.
  static std::string NamePrefix();

 private:
  SharedArena();
  struct Impl;
  Impl* impl_;
  friend class SharedBlock;
  friend class Segment;
};

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_SHARED_ARENA_H_
