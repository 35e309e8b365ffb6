// mp/internal/arena_segment.h: NOT FOR USERS. The shared arena's segments and its state, shared
// by the two files of the arena: shared_arena.cc (creating segments, allocating and freeing blocks,
// the caches, fork) and segment_import.cc (mapping a peer's segment, exporting a block). The
// layout and the lifetime rules are in shared_arena.h.
//
// Thread safety: a Segment's allocation state and everything in SharedArena::Impl are guarded by
// Impl::mu; a Segment's mapping (base, size, fd, name, id) is written once, before it is shared.
#ifndef FORKSAFE_MP_INTERNAL_ARENA_SEGMENT_H_
#define FORKSAFE_MP_INTERNAL_ARENA_SEGMENT_H_

#include <sys/mman.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/internal/shared_arena.h"
#include "forksafe/mp/internal/shm_manager.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::mp::internal {

constexpr uint32_t kBlockMagic = 0x424c4b31;  // "BLK1"
constexpr size_t kHeaderBytes = 4096;         // segment header page
constexpr size_t kBlockHeader = 64;
constexpr size_t kAlign = 64;
constexpr size_t kMinSegment = size_t{4} << 20;
constexpr size_t kMaxSegment = size_t{64} << 20;
constexpr size_t kDedicatedAbove = size_t{16} << 20;  // bigger blocks get a segment of their own
// The large-segment cache (see the header's "Large segments"): at most this many bytes by default,
// never more than kLargeCacheShare of the memory the system could give with the cache empty, and a
// cached segment serves a request only if it is at most kLargeReuseSlack times the request's size.
constexpr size_t kDefaultLargeCacheBytes = size_t{256} << 20;
constexpr size_t kLargeCacheShare = 4;  // a quarter
constexpr size_t kLargeReuseSlack = 2;

struct BlockHeader {
  uint32_t magic;
  std::atomic<int32_t> refs;
  uint64_t size;  // usable bytes after the header
};

/// Throws the error for a failed creation or mapping of `bytes` of shared memory of `kind`
/// (errno `err`): out of descriptors, /dev/shm full, or out of memory, each saying what to do.
[[noreturn]] void ThrowNoSpace(int err, size_t bytes, SegmentKind kind);

// A mapped segment. Created by this process (owned) or imported.
class Segment {
 public:
  SegmentKind kind;
  FileDescriptor fd;  // kept so the segment can be exported again
  std::string name;   // kNamed
  char* base = nullptr;
  size_t size = 0;
  uint64_t id = 0;
  bool owned = false;
  uint64_t generation = 0;  // runtime::ForkGeneration() when it was created
  // Allocation state (owned segments only), guarded by the arena's mutex.
  size_t bump = kHeaderBytes;
  int live_blocks = 0;
  // Every reference left is in flight in a queue that no longer exists (EmptyCache found it).
  bool only_dead_refs = false;
  // A dedicated segment of this process's that is on the arena's `lingering` list.
  bool lingering = false;
  bool dedicated = false;  // holds one block (set where it was created)
  // A dedicated memfd segment that may go on the large-segment cache when its block is freed here
  // (set where it was created, never changed); `in_large_cache` while it is there (under mu).
  bool cacheable = false;
  bool in_large_cache = false;

  ~Segment() {
    // A named segment is unlinked by its creator when no reference to any of its blocks is left
    // anywhere (none in flight in a live queue either); a dedicated one also by whichever process
    // drops its count to zero (~SharedBlock), and the shm manager unlinks what is left after the
    // creator's death (the lifetime rule of mp/internal/shm_manager.h).
    // A creation that failed half-way (base not mapped yet) is unlinked at once.
    if (OwnedHere() && kind == SegmentKind::kNamed && !name.empty() &&
        (base == nullptr || header()->live_refs.load() == 0 || only_dead_refs)) {
      shm_unlink(name.c_str());
    }
    if (base != nullptr) munmap(base, size);
  }
  // Created by this very process (not inherited from the parent): only then may it hand out
  // blocks, and unlink its name.
  bool OwnedHere() const { return owned && generation == runtime::ForkGeneration(); }
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base); }
  BlockHeader* block(uint64_t offset) const {
    return reinterpret_cast<BlockHeader*>(base + offset - kBlockHeader);
  }
};

// The allocator's state, all under mu. (A Segment's own bookkeeping, live_blocks and
// lingering, is changed under the arena's mu too; it is not annotated, being another object's.)
struct SharedArena::Impl {
  runtime::internal::Mutex mu;
  std::vector<std::shared_ptr<Segment>> owned FORKSAFE_GUARDED_BY(mu);  // this process's segments
  // Dedicated named segments of this process whose last block here was dropped while references
  // remained elsewhere (in flight, or in other processes): kept until those go (the process that
  // drops the count to zero unlinks the name) or are found dead (EmptyCache), so that such a
  // segment is never left in /dev/shm for the creator's lifetime.
  std::vector<std::shared_ptr<Segment>> lingering FORKSAFE_GUARDED_BY(mu);
  std::map<size_t, std::vector<std::pair<std::weak_ptr<Segment>, uint64_t>>> free_bins
      FORKSAFE_GUARDED_BY(mu);
  // freed here, held elsewhere
  std::deque<std::pair<std::weak_ptr<Segment>, uint64_t>> pending FORKSAFE_GUARDED_BY(mu);
  std::set<std::pair<const Segment*, uint64_t>> pending_set FORKSAFE_GUARDED_BY(mu);  // `pending`'s
  // every segment mapped here, by key
  std::map<std::string, std::weak_ptr<Segment>> imported FORKSAFE_GUARDED_BY(mu);
  // The segments imported most recently, kept mapped even when no block of theirs is alive, so
  // that a consumer receiving tensor after tensor from one segment does not map and unmap it
  // each time.
  std::deque<std::shared_ptr<Segment>> recent FORKSAFE_GUARDED_BY(mu);
  size_t next_segment FORKSAFE_GUARDED_BY(mu) = kMinSegment;
  // Dedicated memfd segments whose block was freed here, kept mapped and faulted for the next
  // large block, oldest first ("Large segments" in the header); their bytes, and the bound.
  std::deque<std::shared_ptr<Segment>> large_cache FORKSAFE_GUARDED_BY(mu);
  size_t large_cached_bytes FORKSAFE_GUARDED_BY(mu) = 0;
  size_t large_cache_limit FORKSAFE_GUARDED_BY(mu) = kDefaultLargeCacheBytes;
  ArenaStats stats FORKSAFE_GUARDED_BY(mu);
};

/// The key of a segment in SharedArena::Impl::imported.
inline std::string SegmentKey(SegmentKind kind, uint64_t id) {
  return absl::StrCat(static_cast<int>(kind), ":", id);
}

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_ARENA_SEGMENT_H_
