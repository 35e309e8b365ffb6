// mp/internal/segment_import.cc: the receiving side of the shared arena (checking a handle,
// mapping a peer's segment once: SharedArena::Import, the recently imported segments kept
// mapped) and the sending side's SharedBlock::Export (the in-flight reference). The rest of the
// arena is in shared_arena.cc; what both use is in arena_segment.h.
#include "forksafe/mp/internal/shared_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/internal/arena_segment.h"
#include "forksafe/mp/internal/shared_segment.h"
#include "forksafe/mp/internal/shm_manager.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/mutex.h"

namespace forksafe::mp::internal {

using runtime::Error;
using runtime::ErrorCode;

void CheckHandle(const SharedBlock::Handle& h) {
  auto malformed = [](const char* why) {
    return Error(ErrorCode::kInvalidArgument, absl::StrCat("malformed tensor handle: ", why));
  };
  switch (h.kind) {
    case SegmentKind::kMemfd:
      if (!h.fd) throw malformed("no descriptor");
      return;
    case SegmentKind::kNamed:
      if (h.name.rfind("/forksafe_", 0) != 0 || h.name.find('/', 1) != std::string::npos ||
          h.name.size() > 255 || h.name.find('\0') != std::string::npos) {
        throw malformed("bad segment name");
      }
      return;
  }
  throw malformed("unknown segment kind");
}

// Builds the page tables of a newly mapped segment now, once, instead of one minor fault per page
// at the first touch of every tensor (256 faults for a 1 MiB tensor), but only for the pages the
// segment holds (its data extents, SEEK_DATA / SEEK_HOLE): a sparse segment from a peer (a huge
// memfd never written) would otherwise be made resident whole, as MAP_POPULATE did. Our own
// segments are read in whole when created (ReserveSegmentMemory), so they are one extent. At most
// kMaxPopulatedExtents extents; without MADV_POPULATE_READ (Linux < 5.14) nothing is populated
// and pages fault in at first touch. Populated for reading: in a shared writable mapping the
// entries are writable all the same (a later write takes no fault), and populating for writing
// made this process's first read of each page 7x slower on a VM that pages the guest's page
// tables (bench/first_read_floor.cc; docs/peers.md, "Workload 3's tail").
static void PopulateHeldPages(char* base, int fd, size_t size) {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;
#endif
  constexpr int kMaxPopulatedExtents = 64;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  off_t pos = 0;
  for (int n = 0; n < kMaxPopulatedExtents && static_cast<size_t>(pos) < size; ++n) {
    const off_t data = lseek(fd, pos, SEEK_DATA);
    if (data < 0) return;  // ENXIO: no data after pos (or no SEEK_DATA: nothing populated)
    off_t hole = lseek(fd, data, SEEK_HOLE);
    if (hole < 0 || static_cast<size_t>(hole) > size) hole = static_cast<off_t>(size);
    const size_t from = static_cast<size_t>(data) / page * page;
    const size_t to = static_cast<size_t>(hole);
    if (to > from && madvise(base + from, to - from, MADV_POPULATE_READ) != 0 && errno == EINVAL) {
      return;  // the kernel has no MADV_POPULATE_READ
    }
    pos = hole;
  }
}

void CheckBlockPlacement(uint64_t offset, uint64_t size, uint64_t segment_size) {
  if (offset < kHeaderBytes + kBlockHeader || offset > segment_size ||
      size > segment_size - offset || offset % kAlign != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("malformed tensor handle: block outside its segment (offset ", offset,
                             ", ", size, " bytes, in a segment of ", segment_size, " bytes)"));
  }
}

std::shared_ptr<SharedBlock> SharedArena::Import(SharedBlock::Handle h) {
  auto malformed = [](const char* why) {
    return Error(ErrorCode::kInvalidArgument, absl::StrCat("malformed tensor handle: ", why));
  };
  CheckHandle(h);
  Impl& a = *impl_;
  runtime::internal::MutexLock lk(&a.mu);
  const std::string key = SegmentKey(h.kind, h.segment_id);
  std::shared_ptr<Segment> seg;
  if (auto it = a.imported.find(key); it != a.imported.end()) seg = it->second.lock();
  if (!seg) {
    for (auto& s : a.owned) {  // our own segment coming back (put and get in one process)
      if (s->kind == h.kind && s->id == h.segment_id) seg = s;
    }
  }
  if (!seg) {
    seg = std::make_shared<Segment>();
    seg->kind = h.kind;
    int fd = -1;
    if (h.kind == SegmentKind::kMemfd) {
      fd = h.fd.owned() ? h.fd.release() : FileDescriptor::Dup(h.fd.get()).release();
    } else {
      fd = shm_open(h.name.c_str(), O_RDWR | O_CLOEXEC, 0600);
      if (fd < 0) {
        throw Error(ErrorCode::kNotFound,
                    absl::StrCat("shared segment ", h.name,
                                 " no longer exists: every process that held it let go before "
                                 "this one opened it"));
      }
      seg->name = h.name;
    }
    seg->fd.reset(fd);
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kHeaderBytes)) {
      throw malformed("segment too small");
    }
    seg->size = static_cast<size_t>(st.st_size);
    void* p = mmap(nullptr, seg->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) ThrowNoSpace(errno, seg->size, h.kind);
    seg->base = static_cast<char*>(p);
    PopulateHeldPages(seg->base, fd, seg->size);
    if (seg->header()->magic != kSegmentMagic || seg->header()->id != h.segment_id) {
      throw malformed("not a forksafe segment");
    }
    seg->id = h.segment_id;
    a.imported[key] = seg;
    ++a.stats.segments_mapped;
    a.recent.push_back(seg);
    if (a.recent.size() > 16) a.recent.pop_front();
  }
  CheckBlockPlacement(h.offset, h.size, seg->size);
  BlockHeader* b = seg->block(h.offset);
  if (b->magic != kBlockMagic || h.size > b->size) throw malformed("not a block");
  // Adopt the in-flight reference the exporter took for us: it is ours now, not the queue's.
  DropCarrierRef(seg->header(), h.carrier);
  return std::shared_ptr<SharedBlock>(
      new SharedBlock(seg, h.offset, seg->base + h.offset, static_cast<size_t>(h.size), false));
}

std::string SharedBlock::key() const { return absl::StrCat(seg_->id, "@", offset_); }

int32_t SharedBlock::shared_count() const { return seg_->block(offset_)->refs.load(); }

namespace {
// Undoes Export() for a message that was never put (InFlightScope::OnCancel).
void GiveBackInFlight(void* segment, uint64_t offset, uint64_t carrier) {
  auto* seg = static_cast<Segment*>(segment);
  DropCarrierRef(seg->header(), carrier);
  seg->block(offset)->refs.fetch_sub(1);
  seg->header()->live_refs.fetch_sub(1);
}
}  // namespace

SharedBlock::Handle SharedBlock::Export() const {
  Handle h;
  h.kind = seg_->kind;
  if (h.kind == SegmentKind::kMemfd) {
    // Borrowed: the codec duplicates it into the message (once per message, however many tensors
    // of this segment the message holds).
    h.fd = FileDescriptor::Borrow(seg_->fd.get());
  } else {
    h.name = seg_->name;
  }
  h.segment_id = seg_->id;
  h.offset = offset_;
  h.size = size_;
  seg_->block(offset_)->refs.fetch_add(1);  // the in-flight reference
  seg_->header()->live_refs.fetch_add(1);
  if (InFlightScope* scope = InFlightScope::Current()) {
    h.carrier = scope->carrier();
    AddCarrierRef(seg_->header(), h.carrier);
    // Given back if the message is never put (the scope is not committed).
    scope->OnCancel(seg_, &GiveBackInFlight, offset_);
  }
  return h;
}

}  // namespace forksafe::mp::internal
