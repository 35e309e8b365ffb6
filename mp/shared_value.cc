#include "forksafe/mp/shared_value.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/internal/memory_bounds.h"

namespace forksafe::mp::internal {
namespace {

using runtime::Error;
using runtime::ErrorCode;

const char* KindName(BlockKind kind) { return kind == kValueKind ? "Value" : "Array"; }

// Elements start at a multiple of their alignment (and of max_align_t) past the header.
// elem_align is checked (ValidAlignment) before this runs: the rounding cannot fail.
size_t DataOffset(size_t elem_align) {
  const size_t align = std::max(elem_align, alignof(std::max_align_t));
  return runtime::internal::RoundUpOrThrow(sizeof(ValueBlockHeader), align, "Value/Array");
}

bool ValidAlignment(size_t align) {
  return align != 0 && (align & (align - 1)) == 0 && align <= 4096;
}

}  // namespace

ValueBlock ValueBlock::Create(BlockKind kind, size_t elem_size, size_t elem_align, size_t count,
                              bool lock) {
  if (!ValidAlignment(elem_align)) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat(KindName(kind), ": element alignment ", elem_align,
                             " is not supported (must be a power of two <= 4096)"));
  }
  const size_t offset = DataOffset(elem_align);
  if (elem_size == 0 || count > (std::numeric_limits<size_t>::max() - offset) / elem_size) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat(KindName(kind), ": ", count, " elements of ", elem_size,
                             " bytes do not fit in memory; ask for fewer"));
  }
  // The constructor fills every element at once: refuse what the system cannot give before the
  // segment exists (1 << 40 doubles used to be touched page by page until the process was killed).
  const size_t bytes = offset + count * elem_size;
  runtime::internal::CheckMemoryAvailable(
      bytes, runtime::internal::MemoryUse::kShared,
      absl::StrCat(KindName(kind), " of ", count, " elements of ", elem_size, " bytes"));
  auto segment = std::make_shared<SharedSegment>(
      SharedSegment::Create(bytes, kind == kValueKind ? "value" : "array"));
  ValueBlockHeader* h = new (segment->data()) ValueBlockHeader();
  h->kind = kind;
  h->has_lock = lock ? 1 : 0;
  h->elem_size = elem_size;
  h->elem_align = elem_align;
  h->count = count;
  h->data_offset = offset;
  if (lock) LockCore::InitState(&h->lock, /*recursive=*/false);
  return ValueBlock(std::move(segment), *h);
}

ValueBlock ValueBlock::Adopt(std::shared_ptr<SharedSegment> segment, BlockKind kind,
                             size_t elem_size, size_t elem_align) {
  const char* name = KindName(kind);
  auto malformed = [name](const std::string& why) {
    return Error(ErrorCode::kInvalidArgument,
                 absl::StrCat("malformed message: cannot decode a ", name, ": ", why,
                              "; decode into the same type (and element type) that was encoded"));
  };
  if (!segment || segment->size() < sizeof(ValueBlockHeader)) {
    throw malformed("the shared segment is smaller than its header");
  }
  // Copy the header out once: another process could change it while we check it.
  ValueBlockHeader h;
  std::memcpy(static_cast<void*>(&h), segment->data(), sizeof(h));
  if (h.kind != kind) throw malformed("the shared segment holds something else");
  if (h.elem_size != elem_size || h.elem_align != elem_align) {
    throw malformed(absl::StrCat("it holds elements of ", h.elem_size, " bytes aligned to ",
                                 h.elem_align, ", not ", elem_size, " aligned to ", elem_align));
  }
  if (h.data_offset != DataOffset(elem_align)) throw malformed("bad data offset");
  if (segment->size() < h.data_offset) throw malformed("the segment ends before its data");
  const size_t room = (segment->size() - h.data_offset) / elem_size;
  if (h.count > room || (kind == kValueKind && h.count != 1)) {
    throw malformed(
        absl::StrCat("it claims ", h.count, " elements but the segment has room for ", room));
  }
  if (h.has_lock > 1 || (h.has_lock == 1 && h.lock.kind != kLockKind)) {
    throw malformed("its lock is not a valid Lock");
  }
  return ValueBlock(std::move(segment), h);
}

ValueBlock::ValueBlock(std::shared_ptr<SharedSegment> segment, const ValueBlockHeader& h)
    : segment_(std::move(segment)),
      data_(static_cast<char*>(segment_->data()) + h.data_offset),
      count_(static_cast<size_t>(h.count)),
      has_lock_(h.has_lock != 0) {}

Lock ValueBlock::MakeLock(const char* what) const {
  if (!has_lock()) ThrowNoLock(what);
  return LockAccess::MakeLock(LockCore::Adopt(segment_));
}

void ThrowNoLock(const char* what) {
  throw Error(ErrorCode::kFailedPrecondition,
              absl::StrCat(what,
                           ": this object was created with lock = false and has no lock; "
                           "create it with lock = true, or synchronize access yourself"));
}

void ThrowIndex(size_t index, size_t size) {
  throw Error(
      ErrorCode::kInvalidArgument,
      size == 0 ? absl::StrCat("Array.at: index ", index, " is out of range: the Array is empty")
                : absl::StrCat("Array.at: index ", index, " is out of range for an Array of size ",
                               size, "; valid indices are 0 to ", size - 1));
}

}  // namespace forksafe::mp::internal
