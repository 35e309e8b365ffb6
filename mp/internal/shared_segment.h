// mp/internal/shared_segment.h: NOT FOR USERS. An anonymous shared memory file (memfd) mapped
// MAP_SHARED. Forked children inherit the mapping; spawned children receive the descriptor
// through the codec and map it again. Anonymous files leave nothing in /dev/shm, ever. Every
// memfd the library creates is owner-only (0600); random names come from
// runtime/internal/random.h.
#ifndef FORKSAFE_MP_INTERNAL_SHARED_SEGMENT_H_
#define FORKSAFE_MP_INTERNAL_SHARED_SEGMENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "forksafe/mp/codec.h"

namespace forksafe::mp::internal {

/// memfd_create(`name`, MFD_CLOEXEC) made owner-only (mode 0600: a memfd starts at 0777).
/// Returns -1 with errno set on failure. Every memfd of the library is made here.
int PrivateMemfd(const char* name);

/// The in-flight references a message takes while it is encoded for a Queue (mp/queue.h): which
/// queue carries them (its identity, so that the shm manager keeps their segments while the
/// queue exists: mp/internal/shm_manager.h), and how to give them back if the message is never
/// put (a refused or timed-out put must not pin memory). One per thread at a time (nests).
class InFlightScope {
 public:
  /// Becomes this thread's current scope; `carrier` is the queue's identity.
  explicit InFlightScope(uint64_t carrier);
  /// Gives back every reference taken, unless Commit() was called; restores the previous scope.
  ~InFlightScope();
  InFlightScope(const InFlightScope&) = delete;
  InFlightScope& operator=(const InFlightScope&) = delete;

  /// The message is in the queue: its references are the queue's now. Idempotent; Queue's
  /// PutMessage calls it at the message's commit point, so that nothing thrown after the commit
  /// gives back references that a queued message holds.
  void Commit() { undo_.clear(); }
  uint64_t carrier() const { return carrier_; }
  /// This thread's scope, or nullptr (the message goes elsewhere: a Pipe, a Process argument).
  static InFlightScope* Current();
  /// Registers how to give back one reference: `undo(keep.get(), arg, carrier())`; `keep` keeps
  /// what it refers to alive until then.
  using Undo = void (*)(void* keep, uint64_t arg, uint64_t carrier);
  void OnCancel(std::shared_ptr<void> keep, Undo undo, uint64_t arg) {
    undo_.emplace_back(std::move(keep), undo, arg);
  }

 private:
  uint64_t carrier_;
  InFlightScope* previous_;
  std::vector<std::tuple<std::shared_ptr<void>, Undo, uint64_t>> undo_;
};

/// A mapped memfd. Move-only; unmaps and closes on destruction.
class SharedSegment {
 public:
  SharedSegment() = default;
  ~SharedSegment();
  SharedSegment(SharedSegment&& o) noexcept;
  SharedSegment& operator=(SharedSegment&& o) noexcept;
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  /// A new zero-filled segment of `bytes` (> 0) bytes. `name` shows in /proc/PID/fd.
  static SharedSegment Create(size_t bytes, const char* name);
  /// Maps the segment behind `fd` (its whole size).
  static SharedSegment Map(FileDescriptor fd);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_.get(); }
  /// Leaves the pages mapped when this object goes (the descriptor still closes): for memory
  /// that a thread's robust-futex list may still point into (a robust mutex it holds, whose
  /// next lock or unlock elsewhere would touch the unmapped page and crash).
  void NeverUnmap() { keep_mapped_ = true; }
  explicit operator bool() const { return data_ != nullptr; }

  template <class Archive>
  void save(Archive& ar) const {
    ar(fd_);
  }
  template <class Archive>
  void load(Archive& ar) {
    FileDescriptor fd;
    ar(fd);
    *this = Map(std::move(fd));
  }

 private:
  FileDescriptor fd_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool keep_mapped_ = false;
};

/// A shared, reference-free handle to a typed object in its own segment. Copies share it.
template <class T>
class SharedObject {
 public:
  SharedObject() = default;
  /// Creates the segment and constructs T in it with `init(T*)`.
  template <class Init>
  static SharedObject Create(const char* name, Init&& init) {
    SharedObject o;
    o.seg_ = std::make_shared<SharedSegment>(SharedSegment::Create(sizeof(T), name));
    init(o.get());
    return o;
  }
  T* get() const { return seg_ ? static_cast<T*>(seg_->data()) : nullptr; }
  T* operator->() const { return get(); }
  explicit operator bool() const { return seg_ != nullptr; }

  template <class Archive>
  void save(Archive& ar) const {
    ar(*seg_);
  }
  template <class Archive>
  void load(Archive& ar) {
    auto seg = std::make_shared<SharedSegment>();
    ar(*seg);
    if (seg->size() < sizeof(T)) {
      throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                           "malformed message: shared segment is smaller than the object it holds");
    }
    seg_ = std::move(seg);
  }

 private:
  std::shared_ptr<SharedSegment> seg_;
};

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_SHARED_SEGMENT_H_
