// mp/internal/shared_arena.cc: the shared arena's allocating side: creating segments, handing
// out and taking back blocks, the caches (free blocks, lingering and large segments, the recently
// imported), and the arena across fork. Importing and exporting are in segment_import.cc; what
// both use is in arena_segment.h; the rules are in shared_arena.h.
#include "forksafe/mp/internal/shared_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/internal/arena_segment.h"
#include "forksafe/mp/internal/shared_segment.h"
#include "forksafe/mp/internal/shm_manager.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/fork_aware_once.h"
#include "forksafe/runtime/internal/kept_resources.h"
#include "forksafe/runtime/internal/memory_bounds.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/internal/random.h"

namespace forksafe::mp::internal {
namespace {

using runtime::Error;
using runtime::ErrorCode;

// Size classes: powers of two from 64 B, then 1 MiB steps... keep it simple: powers of two.
size_t SizeClass(size_t n) {
  size_t c = kAlign;
  while (c < n) c <<= 1;
  return c;
}

}  // namespace

[[noreturn]] void ThrowNoSpace(int err, size_t bytes, SegmentKind kind) {
  if (err == EMFILE || err == ENFILE) {
    throw Error(ErrorCode::kResourceExhausted,
                "out of file descriptors while creating shared memory; raise the limit "
                "(ulimit -n) or close unused connections");
  }
  if (kind == SegmentKind::kNamed) {
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat("/dev/shm has no room for ", bytes,
                             " more bytes of shared memory; free shared tensors, enlarge /dev/shm "
                             "(mount -o remount,size=...), or use the file_descriptor sharing "
                             "strategy"));
  }
  throw Error(ErrorCode::kResourceExhausted,
              absl::StrCat("out of memory reserving ", bytes,
                           " bytes of shared memory; free shared tensors or lower batch sizes"));
}

namespace {

// Reserves a new segment's memory now, so that a full tmpfs or a memory limit is an error here,
// not a SIGBUS at first touch: by reading every page in through the creator's mapping
// (MADV_POPULATE_READ, Linux 5.14), else with fallocate. Reading them in rather than fallocating
// them also makes a later process's first read of them several times cheaper on VMs that page
// the guest's page tables (docs/peers.md, "Workload 3's tail"), and leaves the creator's page
// tables built (no fault at its first write of each page).
void ReserveSegmentMemory(char* base, int fd, size_t size, SegmentKind kind) {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;
#endif
  if (madvise(base, size, MADV_POPULATE_READ) == 0) return;
  const int err = errno;
  // EFAULT: a page would have raised SIGBUS (tmpfs full); ENOMEM: out of memory (or a cgroup's).
  if (err == EFAULT) ThrowNoSpace(ENOSPC, size, kind);
  if (err == ENOMEM) ThrowNoSpace(ENOMEM, size, kind);
  // EINVAL (a kernel before 5.14), or madvise refused (a seccomp filter): fallocate instead.
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(size));
  if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) ThrowNoSpace(rc, size, kind);
}

std::shared_ptr<Segment> CreateSegment(size_t size, SegmentKind kind, uint32_t flags) {
  auto seg = std::make_shared<Segment>();
  seg->kind = kind;
  seg->size = size;
  seg->owned = true;
  seg->generation = runtime::ForkGeneration();
  int fd;
  if (kind == SegmentKind::kMemfd) {
    fd = PrivateMemfd("forksafe:tensor-arena");
  } else {
    // Check the room in /dev/shm first: reserving more than is free would fill it page by page
    // before failing, squeezing every other user of /dev/shm meanwhile.
    struct statvfs vfs;
    if (statvfs("/dev/shm", &vfs) == 0 &&
        static_cast<unsigned long long>(vfs.f_bavail) * vfs.f_frsize < size) {
      ThrowNoSpace(ENOSPC, size, kind);
    }
    // 128 bits from getrandom(): not guessable, and a forked child does not repeat its
    // parent's sequence (a seeded generator copied by fork() would).
    seg->name = absl::StrCat(SharedArena::NamePrefix(), runtime::internal::RandomHex128());
    // The manager learns the name before it exists: a SIGKILL at any moment from here on leaves
    // nothing behind (the manager removes it, or finds it never was).
    ShmManagerTrack(seg->name);
    fd = shm_open(seg->name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  }
  if (fd < 0) {
    const int err = errno;
    seg->name.clear();  // not ours to unlink
    ThrowNoSpace(err, size, kind);
  }
  seg->fd.reset(fd);
  // From here on a failure unlinks the name (the segment's destructor: owned, no references).
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) ThrowNoSpace(errno, size, kind);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) ThrowNoSpace(errno, size, kind);
  seg->base = static_cast<char*>(p);  // zero-filled: no references, no carriers
  ReserveSegmentMemory(seg->base, fd, size, kind);
  struct stat st;
  fstat(fd, &st);
  seg->id = kind == SegmentKind::kMemfd ? static_cast<uint64_t>(st.st_ino)
                                        : runtime::internal::RandomId();
  SegmentHeader* h = seg->header();
  h->magic = kSegmentMagic;
  h->size = size;
  h->id = seg->id;
  h->creator = getpid();
  h->live_refs.store(0);
  h->pid_ns = PidNamespaceId();
  h->creator_start = SelfStartTicks();
  h->flags = flags;
  return seg;
}

}  // namespace

SharedArena* SharedArena::Make() {
  return new SharedArena();  // leaked: blocks may outlive static destruction
}

SharedArena& SharedArena::Get() {
  // Not a function-local static: the constructor registers an at-fork handler, which waits for a
  // fork running on another thread (runtime/internal/fork_aware_once.h).
  return runtime::internal::ForkAwareOnce<SharedArena, &SharedArena::Make>();
}

SharedArena::SharedArena() : impl_(new Impl()) {
  // A forked child inherits the mappings (MAP_SHARED, so they stay shared) but not the right to
  // hand out blocks from the parent's segments: it starts an allocator of its own. After a fork
  // whose prepare took the lock, the segments it had mapped stay mapped and are found again by
  // Import; after one that could not, the child's arena starts empty (inherited blocks keep their
  // segments mapped, but a segment coming back is mapped anew).
  static int tag;
  runtime::AtForkHandler h;
  h.name = "mp_shared_arena";
  // The lock is taken the one way a prepare may take a mutex (runtime::LockForFork): bounded.
  h.prepare = [this](const runtime::PrepareAttempt& attempt) {
    return runtime::LockForFork(impl_->mu, attempt);
  };
  h.parent = [this](bool prepared) {
    if (prepared) {
      impl_->mu.AssertHeld();  // the prepare took it
      impl_->mu.Unlock();
    }
  };
  h.child = [this](bool prepared) {
    // runtime::ForkGeneration() moved on before this ran: blocks and segments made before the
    // fork are the parent's from here on ("Blocks across fork" in the header; a child of a fork
    // that could not take the lock keeps the segments' `owned` flags, and OwnedHere() is false).
    if (!prepared) {
      // The lock's holder (another thread, gone here) may have been half-way through changing
      // the arena: abandon all of it (leaked, never read again) and start empty. Inherited
      // blocks keep their segments mapped through their own references; the generation keeps
      // the parent's segments from being allocated from or unlinked here.
      impl_ = new Impl();
      return;
    }
    impl_->mu.AssertHeld();  // the prepare took it, and this is the child's only thread
    // Keep the parent's segments mapped (tensors inherited by the child point into them) but
    // stop allocating from them: move them to the imported set.
    for (auto& seg : impl_->owned) {
      seg->owned = false;  // never unlink the parent's names from the child
      impl_->imported[SegmentKey(seg->kind, seg->id)] = seg;
    }
    // The shared_ptrs of owned segments are intentionally kept alive by leaking the vector: the
    // inherited SharedBlocks hold their own references anyway.
    new (&impl_->owned) std::vector<std::shared_ptr<Segment>>();
    // The parent's free lists are abandoned the same way, not cleared: clearing them would write
    // to every cached entry's control block (a weak_ptr release each) and free the lists' memory,
    // which makes malloc consolidate its free chunks. Each page written is a copy-on-write fault
    // in the child; with a few hundred cached blocks that was most of a fork's cost
    // (docs/performance.md, "fork").
    using Bins = decltype(impl_->free_bins);
    using Pending = decltype(impl_->pending);
    using PendingSet = decltype(impl_->pending_set);
    using Segments = decltype(impl_->lingering);
    new (&impl_->free_bins) Bins();
    new (&impl_->pending) Pending();
    new (&impl_->pending_set) PendingSet();
    new (&impl_->lingering) Segments();  // the parent's to unlink, not ours
    // The parent's cached large segments stay the parent's (never handed out here: OwnedHere()
    // is false for them too); abandoned like the lists above.
    new (&impl_->large_cache) decltype(impl_->large_cache)();
    impl_->large_cached_bytes = 0;
    impl_->mu.Unlock();
  };
  runtime::AtForkRegistry::Get().Register(&tag, std::move(h));
  // The arena keeps nothing for the life of the process; its caches go on request
  // (runtime::ReleaseCachedResources).
  runtime::internal::RegisterKeptResources("mp_shared_arena", nullptr, [this] { ReleaseCaches(); });
}

std::unique_lock<std::mutex> SharedArena::LockForTesting() {
  return std::unique_lock<std::mutex>(impl_->mu.native());
}

std::string SharedArena::NamePrefix() { return absl::StrCat("/forksafe_", getpid(), "_"); }

namespace {

// Segments of this process whose blocks are all free here although references are left
// elsewhere, with their counts taken BEFORE a scan of /proc (see RefSnapshot): the candidates
// for being held only by dead queues.
using Candidates = std::vector<std::pair<std::shared_ptr<Segment>, RefSnapshot>>;

Candidates NeedingScan(SharedArena::Impl& a) FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(a.mu) {
  Candidates out;
  for (auto* list : {&a.owned, &a.lingering}) {
    for (auto& seg : *list) {
      if (seg->live_blocks == 0 && seg->header()->live_refs.load() != 0) {
        out.emplace_back(seg, SnapshotRefs(seg->header()));
      }
    }
  }
  return out;
}

// Segments of this process whose blocks are all free here and that no reference anywhere can use
// any more: none left, or only in-flight ones in queues that no process holds (messages never
// read; judged from `scan`, taken after `candidates` with the lock released, when there is one).
// Removed from `a.owned` / `a.lingering`; the caller drops them (unmapped, and unlinked for
// file_system), outside the lock where it can.
std::vector<std::shared_ptr<Segment>> TakeUnusedSegments(SharedArena::Impl& a,
                                                         const Candidates& candidates,
                                                         const ProcScan* scan)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(a.mu) {
  std::vector<std::shared_ptr<Segment>> out;
  for (auto* list : {&a.owned, &a.lingering}) {
    for (auto it = list->begin(); it != list->end();) {
      Segment& s = **it;
      bool unused = false;
      if (s.live_blocks == 0) {
        if (s.header()->live_refs.load() == 0) {
          unused = true;
        } else if (scan != nullptr && ScanJudges(*scan, s.header()->creator_start)) {
          for (const auto& [seg, before] : candidates) {
            if (seg.get() == &s) {
              unused = s.only_dead_refs =
                  OnlyDeadCarriersHold(s.header(), before, scan->live_carriers);
            }
          }
        }
      }
      if (unused) {
        out.push_back(std::move(*it));
        it = list->erase(it);
      } else {
        ++it;
      }
    }
  }
  return out;
}

// Drops the dedicated segments of `a.lingering` whose count reached zero (their names went with
// the last reference): moved to `out`, for the caller to unmap outside the lock. No scan.
void TakeFinishedLingering(SharedArena::Impl& a, std::vector<std::shared_ptr<Segment>>& out)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(a.mu) {
  for (auto it = a.lingering.begin(); it != a.lingering.end();) {
    if ((*it)->header()->live_refs.load() == 0) {
      out.push_back(std::move(*it));
      it = a.lingering.erase(it);
    } else {
      ++it;
    }
  }
}

// Moves every segment of the large-segment cache to `out` (dropped by the caller, outside the lock
// where it can: unmapped, the descriptor closed; the memory goes back once no other process maps
// it).
void TakeLargeCache(SharedArena::Impl& a, std::vector<std::shared_ptr<Segment>>& out)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(a.mu) {
  for (auto& seg : a.large_cache) {
    seg->in_large_cache = false;
    out.push_back(std::move(seg));
  }
  a.large_cache.clear();
  a.large_cached_bytes = 0;
}

// Evicts the oldest cached large segments into `out` until the cache holds at most `cap` bytes.
void TrimLargeCache(SharedArena::Impl& a, size_t cap, std::vector<std::shared_ptr<Segment>>& out)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(a.mu) {
  while (!a.large_cache.empty() && a.large_cached_bytes > cap) {
    std::shared_ptr<Segment> seg = std::move(a.large_cache.front());
    a.large_cache.pop_front();
    a.large_cached_bytes -= seg->size;
    seg->in_large_cache = false;
    out.push_back(std::move(seg));
  }
}

// The smallest cached large segment that can hold a block of `bytes` without being more than
// kLargeReuseSlack times the segment it would need, and that no process holds any block of (its
// shared count is 0: nothing held, nothing in flight); taken off the cache. Null if none.
std::shared_ptr<Segment> TakeCachedLarge(SharedArena::Impl& a, size_t bytes, SegmentKind kind)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(a.mu) {
  if (a.large_cache.empty() || bytes > a.large_cache_limit) return nullptr;  // no overflow below
  const size_t need = kHeaderBytes + kBlockHeader + bytes;
  auto best = a.large_cache.end();
  for (auto it = a.large_cache.begin(); it != a.large_cache.end(); ++it) {
    const Segment& s = **it;
    if (s.kind != kind || s.size < need || s.size / kLargeReuseSlack > need) continue;
    if (s.header()->live_refs.load() != 0) continue;  // a receiver holds it, or it is in flight
    if (best == a.large_cache.end() || s.size < (*best)->size) best = it;
  }
  if (best == a.large_cache.end()) return nullptr;
  std::shared_ptr<Segment> seg = std::move(*best);
  a.large_cache.erase(best);
  a.large_cached_bytes -= seg->size;
  seg->in_large_cache = false;
  return seg;
}

// What the system could still give to shared memory now (the tightest bound of
// CheckMemoryAvailable's kShared), or 0 when it cannot be told. Read outside the arena's lock.
size_t SharedMemoryRoom() noexcept {
  try {
    std::vector<runtime::internal::MemoryLimit> limits =
        runtime::internal::MemoryLimits(runtime::internal::MemoryUse::kShared);
    uint64_t room = UINT64_MAX;
    for (const auto& l : limits) room = std::min(room, l.bytes);
    return static_cast<size_t>(std::min<uint64_t>(room, SIZE_MAX));
  } catch (...) {
    return 0;
  }
}

// CreateSegment(size), and when memory or /dev/shm is short: give back what the cache holds
// (segments whose blocks are all free, or held only by dead queues; the scan of /proc for those
// runs with the lock released), start again from the smallest segment size, and try once more
// with the least size that serves the request. Pressure that went away does not leave the arena
// failing (the size does not grow on failures). Called with a.mu held (the caller's MutexLock),
// which it releases around the scan and takes again before it returns or throws.
std::shared_ptr<Segment> CreateWithRecovery(SharedArena::Impl& a, size_t& size, size_t least,
                                            SegmentKind kind, uint32_t flags)
    FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(a.mu) {
  try {
    return CreateSegment(size, kind, flags);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kResourceExhausted) throw;
    Candidates candidates = NeedingScan(a);
    std::optional<ProcScan> scan;
    if (!candidates.empty()) {
      a.mu.Unlock();  // never scan /proc with the lock held: it would stall every allocation
      try {
        scan = ScanProc();
      } catch (...) {
        a.mu.Lock();  // the caller's MutexLock releases it
        throw;
      }
      a.mu.Lock();
    }
    std::vector<std::shared_ptr<Segment>> unused =
        TakeUnusedSegments(a, candidates, scan ? &*scan : nullptr);
    TakeLargeCache(a, unused);
    candidates.clear();
    unused.clear();  // unmapped (and unlinked) now: the room comes back before the retry
    a.next_segment = kMinSegment;
    size = least;
    return CreateSegment(size, kind, flags);
  }
}

}  // namespace

std::shared_ptr<SharedBlock> SharedArena::Allocate(size_t bytes, SegmentKind kind, bool cached) {
  // A large block from a cached segment first: it needs no new memory, so no check of the room.
  if (cached && kind == SegmentKind::kMemfd && bytes > kDedicatedAbove) {
    Impl& a = *impl_;
    runtime::internal::MutexLock lk(&a.mu);
    if (std::shared_ptr<Segment> seg = TakeCachedLarge(a, bytes, kind)) {
      const uint64_t off = kHeaderBytes + kBlockHeader;
      BlockHeader* b = seg->block(off);
      b->magic = kBlockMagic;  // ours, but in memory that other processes could write
      b->size = seg->size - off;
      b->refs.store(1);
      seg->header()->live_refs.fetch_add(1);
      seg->only_dead_refs = false;
      ++seg->live_blocks;
      ++a.stats.blocks_allocated;
      ++a.stats.blocks_reused;
      ++a.stats.large_segments_reused;
      return std::shared_ptr<SharedBlock>(new SharedBlock(seg, off, seg->base + off, bytes, true));
    }
  }
  // Before any arithmetic on `bytes` and before anything is reserved: more than the system can
  // give is kResourceExhausted now, not an OOM kill while the reservation fills memory.
  // The arena's own cache counts against what is free: when the request does not fit, give the
  // cache back first and judge again.
  const auto use = kind == SegmentKind::kNamed ? runtime::internal::MemoryUse::kSharedNamed
                                               : runtime::internal::MemoryUse::kShared;
  try {
    runtime::internal::CheckMemoryAvailable(bytes, use, "shared memory for a tensor");
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kResourceExhausted) throw;
    EmptyCache();
    runtime::internal::CheckMemoryAvailable(bytes, use, "shared memory for a tensor");
  }
  const size_t cls = SizeClass(std::max<size_t>(bytes, 1));
  Impl& a = *impl_;
  std::vector<std::shared_ptr<Segment>> finished;  // unmapped after the lock is released
  runtime::internal::MutexLock lk(&a.mu);
  TakeFinishedLingering(a, finished);
  auto make = [&](const std::shared_ptr<Segment>& seg, uint64_t off) {
    a.mu.AssertHeld();  // called only below, under lk
    BlockHeader* b = seg->block(off);
    b->refs.store(1);
    seg->header()->live_refs.fetch_add(1);
    ++seg->live_blocks;
    ++a.stats.blocks_allocated;
    return std::shared_ptr<SharedBlock>(new SharedBlock(seg, off, seg->base + off, bytes, true));
  };
  if (cached && cls <= kDedicatedAbove) {
    // 1. A freed block of the same class.
    auto& bin = a.free_bins[cls];
    while (!bin.empty()) {
      auto [w, off] = bin.back();
      bin.pop_back();
      if (auto seg = w.lock(); seg && seg->kind == kind) {
        ++a.stats.blocks_reused;
        return make(seg, off);
      }
    }
    // 2. Blocks freed here while other processes still held them: look at a few of them (a
    //    bounded amount of work per allocation), reclaim the ones now free everywhere.
    for (int looked = 0; looked < 32 && !a.pending.empty(); ++looked) {
      auto [w, off] = a.pending.front();
      a.pending.pop_front();
      auto seg = w.lock();
      if (!seg || a.pending_set.count({seg.get(), off}) == 0) continue;  // stale entry
      BlockHeader* b = seg->block(off);
      if (b->refs.load() != 0) {
        a.pending.push_back({seg, off});
        continue;
      }
      a.pending_set.erase({seg.get(), off});
      if (SizeClass(b->size) == cls && seg->kind == kind) {
        ++a.stats.blocks_reused;
        return make(seg, off);
      }
      a.free_bins[SizeClass(b->size)].push_back({seg, off});
    }
    // 3. Fresh memory from the newest segment of this kind with room.
    const size_t need = kBlockHeader + cls;
    for (auto it = a.owned.rbegin(); it != a.owned.rend(); ++it) {
      Segment& s = **it;
      if (s.kind != kind || s.size - s.bump < need) continue;
      const uint64_t off = s.bump + kBlockHeader;
      s.bump += need;
      BlockHeader* b = s.block(off);
      b->magic = kBlockMagic;
      b->size = cls;
      return make(*it, off);
    }
    // 4. A new segment, twice the size of the last (up to a cap). The size grows only when a
    //    segment was made: a failed attempt never makes the next one bigger.
    const size_t least =
        runtime::internal::RoundUpOrThrow(kHeaderBytes + need, 4096, "shared memory");
    size_t seg_size = std::max(a.next_segment, least);
    auto seg = CreateWithRecovery(a, seg_size, least, kind, 0);
    a.next_segment = std::min(std::max(a.next_segment, seg_size) * 2, kMaxSegment);
    ++a.stats.segments_created;
    a.stats.bytes_reserved += seg_size;
    a.owned.push_back(seg);
    a.imported[SegmentKey(seg->kind, seg->id)] = seg;
    const uint64_t off = seg->bump + kBlockHeader;
    seg->bump += need;
    BlockHeader* b = seg->block(off);
    b->magic = kBlockMagic;
    b->size = cls;
    return make(seg, off);
  }
  // A dedicated segment (large block, or caching disabled).
  size_t seg_size = runtime::internal::RoundUpOrThrow(
      kHeaderBytes + kBlockHeader + std::max<size_t>(bytes, 1), 4096, "shared memory");
  auto seg = CreateWithRecovery(a, seg_size, seg_size, kind, kSegmentDedicated);
  seg->dedicated = true;
  // Only memfd segments are cached: a named one is unlinked by whichever process drops its last
  // reference (~SharedBlock), so its name could vanish under a reuse.
  seg->cacheable = cached && kind == SegmentKind::kMemfd;
  ++a.stats.segments_created;
  a.stats.bytes_reserved += seg_size;
  a.imported[SegmentKey(seg->kind, seg->id)] = seg;  // so that it is found when it comes back
  const uint64_t off = kHeaderBytes + kBlockHeader;
  seg->bump = seg_size;
  BlockHeader* b = seg->block(off);
  b->magic = kBlockMagic;
  b->size = seg_size - off;
  // Not kept in `owned`: the segment goes away with its last block here (its name with the last
  // reference anywhere; see ~SharedBlock), or onto the large-segment cache (memfd).
  return make(seg, off);
}

void SharedArena::EmptyCache() {
  // The counts are taken under the lock, then /proc is scanned without it (a scan takes
  // milliseconds per process; holding the lock would stall every allocation and free, and the
  // fork prepare), then the verdicts are applied under the lock again.
  Candidates candidates;
  {
    runtime::internal::MutexLock lk(&impl_->mu);
    candidates = NeedingScan(*impl_);
  }
  std::optional<ProcScan> scan;
  if (!candidates.empty()) scan = ScanProc();
  std::vector<std::shared_ptr<Segment>> unused;
  {
    runtime::internal::MutexLock lk(&impl_->mu);
    unused = TakeUnusedSegments(*impl_, candidates, scan ? &*scan : nullptr);
    if (!unused.empty()) impl_->next_segment = kMinSegment;
    TakeLargeCache(*impl_, unused);
  }
  // Unmapped (and unlinked) here, outside the lock.
}

void SharedArena::ReleaseCaches() {
  EmptyCache();
  std::deque<std::shared_ptr<Segment>> recent;
  {
    runtime::internal::MutexLock lk(&impl_->mu);
    recent.swap(impl_->recent);
  }
  // Unmapped here, outside the lock, unless a live block still holds the segment.
}

ArenaStats SharedArena::stats() const {
  runtime::internal::MutexLock lk(&impl_->mu);
  ArenaStats s = impl_->stats;
  s.live_segments = 0;
  for (auto& [k, w] : impl_->imported) s.live_segments += !w.expired();
  s.large_cache_bytes = impl_->large_cached_bytes;
  return s;
}

void SharedArena::SetLargeCacheLimit(size_t bytes) {
  std::vector<std::shared_ptr<Segment>> evicted;  // dropped after the lock is released
  runtime::internal::MutexLock lk(&impl_->mu);
  impl_->large_cache_limit = bytes;
  TrimLargeCache(*impl_, bytes, evicted);
}

size_t SharedArena::LargeCacheLimit() const {
  runtime::internal::MutexLock lk(&impl_->mu);
  return impl_->large_cache_limit;
}

SharedBlock::SharedBlock(std::shared_ptr<Segment> seg, uint64_t offset, void* data, size_t size,
                         bool allocated_here)
    : seg_(std::move(seg)),
      allocated_here_(allocated_here),
      offset_(offset),
      data_(data),
      size_(size),
      generation_(runtime::ForkGeneration()) {}

SharedBlock::~SharedBlock() {
  // Inherited through fork(): holds no reference here ("Blocks across fork" in the header).
  if (generation_ != runtime::ForkGeneration()) return;
  BlockHeader* b = seg_->block(offset_);
  SegmentHeader* h = seg_->header();
  const int32_t seg_left = h->live_refs.fetch_sub(1) - 1;
  const int32_t left = b->refs.fetch_sub(1) - 1;
  // A dedicated segment (one block, never reused): whichever process drops the last reference
  // anywhere unlinks its name (the creator may have let go first while the block was in flight).
  // The creator trusts its own record; others the header.
  const bool dedicated = seg_->OwnedHere() ? seg_->dedicated : (h->flags & kSegmentDedicated) != 0;
  if (dedicated && seg_left == 0 && seg_->kind == SegmentKind::kNamed && !seg_->name.empty()) {
    shm_unlink(seg_->name.c_str());
  }
  if (!seg_->OwnedHere()) return;  // only the creator's allocator reuses blocks
  // A cacheable segment's block going away here: how much the system could still give decides how
  // much the large-segment cache may keep (read before the lock: a few small reads of /proc).
  const size_t room = seg_->cacheable && allocated_here_ ? SharedMemoryRoom() : 0;
  SharedArena::Impl& a = *SharedArena::Get().impl_;
  std::vector<std::shared_ptr<Segment>> finished;  // unmapped after the lock is released
  runtime::internal::MutexLock lk(&a.mu);
  if (allocated_here_) --seg_->live_blocks;
  if (dedicated) {
    TakeFinishedLingering(a, finished);
    if (seg_->cacheable && allocated_here_ && seg_->live_blocks == 0 && !seg_->in_large_cache) {
      // Kept mapped and faulted for the next large block (reused once its shared count is 0),
      // within the cap: the limit, and a quarter of what the system could give without the cache.
      const size_t with = a.large_cached_bytes + seg_->size;
      const size_t cap =
          std::min(a.large_cache_limit, room / kLargeCacheShare + with / kLargeCacheShare);
      if (seg_->size <= cap) {
        TrimLargeCache(a, cap - seg_->size, finished);
        seg_->in_large_cache = true;
        a.large_cached_bytes += seg_->size;
        a.large_cache.push_back(seg_);
      }
      return;
    }
    // The creator's last block is gone but references remain elsewhere: keep the segment on the
    // lingering list so that EmptyCache finds it if only dead queues hold it.
    if (seg_left > 0 && seg_->live_blocks == 0 && seg_->kind == SegmentKind::kNamed &&
        !seg_->lingering) {
      seg_->lingering = true;
      a.lingering.push_back(seg_);
    }
    return;
  }
  const std::pair<const Segment*, uint64_t> id{seg_.get(), offset_};
  if (left == 0) {
    // Free everywhere, and this process saw it happen: reusable now (and no longer pending).
    a.pending_set.erase(id);
    a.free_bins[SizeClass(b->size)].push_back({seg_, offset_});
  } else if (a.pending_set.insert(id).second) {
    a.pending.push_back({seg_, offset_});  // others still hold it: check again later
  }
}

}  // namespace forksafe::mp::internal
