// mp/shared_value.h: Python multiprocessing's shared ctypes, Value and Array, for processes.
//
// What it offers
//   Value<T> is one T in shared memory; Array<T> is n of them. Like multiprocessing.Value and
//   multiprocessing.Array, each comes with a Lock by default (get_lock()) and is shared with
//   processes created by fork() (they inherit the mapping) or by spawn (Encode() the handle,
//   Decode() it there: the memfd travels out of band and is mapped again). Copies of a handle
//   share the same memory.
//
// Guarantees
//   - One segment per object: a header, the lock, then the element(s). Decoding validates the
//     header against T (element size, alignment, count) and the segment's size, so a malformed
//     message throws Error(kInvalidArgument) instead of letting a handle read past the mapping.
//   - Value::get/set, Array::to_vector and Value::update take the lock when there is one, like
//     Python's synchronized wrappers, unless the calling thread already holds it (so they can be
//     used inside `std::lock_guard g(v.get_lock())`, where Python would use its RLock).
//   - The lock is a full mp::Lock: robust against processes dying while holding it (see
//     mp/synchronize.h), and it can be encoded on its own.
//   - Thread safety: as for the data you put in them; every method may be called from any thread.
//   - Sizes: Array(n) throws kInvalidArgument when n * sizeof(T) (plus the header) overflows, and
//     kResourceExhausted, before any memory is reserved or touched, when it is more than the memory
//     available now or the process's limits (RLIMIT_FSIZE, RLIMIT_AS, the memory cgroup): see
//     runtime/internal/memory_bounds.h.
//
// Hazards
//   - T must be trivially copyable and must not point anywhere: pointers are meaningless in
//     another process. A static_assert rejects non-trivially-copyable types.
//   - `v.set(v.get() + 1)` is two locked steps, not one: another process can update in between.
//     Use update() or hold get_lock() around the pair.
//   - Array::operator[], at() and data() give direct access into shared memory without locking,
//     like std::span (a const handle still gives mutable access). Hold get_lock() while several
//     processes write.
//   - With lock = false (or a default-constructed, empty Array) there is no lock at all:
//     get_lock() and update() throw kFailedPrecondition,
//     and concurrent access to a T wider than a machine word may tear.
#ifndef FORKSAFE_MP_SHARED_VALUE_H_
#define FORKSAFE_MP_SHARED_VALUE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/internal/shared_segment.h"
#include "forksafe/mp/synchronize.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {
namespace internal {

/// NOT FOR USERS. The header at offset 0 of a Value or Array segment; the elements follow at
/// data_offset. The lock comes first so that a Lock handle can view it alone.
struct ValueBlockHeader {
  LockState lock;  ///< Initialized only when has_lock.
  uint32_t kind;   ///< kValueKind or kArrayKind.
  uint32_t has_lock;
  uint64_t elem_size;
  uint64_t elem_align;
  uint64_t count;
  uint64_t data_offset;
};

enum BlockKind : uint32_t {
  kValueKind = 0x554C4156,  // "VALU"
  kArrayKind = 0x59415241,  // "ARAY"
};

/// NOT FOR USERS. The untyped part of Value and Array: a segment holding a header and `count`
/// elements of `elem_size` bytes. Copies share the segment. (Named ValueBlock, not SharedBlock:
/// mp/internal/shared_arena.h has a SharedBlock in this namespace, and two classes of one name
/// with different inline members is an ODR violation that debug builds link wrongly.)
class ValueBlock {
 public:
  ValueBlock() = default;
  /// A new zero-filled block. Throws kInvalidArgument when the size overflows, kResourceExhausted
  /// when it is more than the system can give (checked before the segment is created).
  static ValueBlock Create(BlockKind kind, size_t elem_size, size_t elem_align, size_t count,
                           bool lock);
  /// Adopts a decoded segment after checking that it holds a block of `kind` whose elements are
  /// `elem_size` bytes aligned to `elem_align`, entirely inside the mapping.
  static ValueBlock Adopt(std::shared_ptr<SharedSegment> segment, BlockKind kind, size_t elem_size,
                          size_t elem_align);

  void* data() const { return data_; }
  size_t count() const { return count_; }
  bool has_lock() const { return has_lock_; }
  /// A Lock handle on the block's lock; kFailedPrecondition when it was created with lock=false.
  Lock MakeLock(const char* what) const;

  template <class Archive>
  void save(Archive& ar) const {
    ar(*segment_);
  }
  /// Decodes a segment; the caller must then Adopt() it (Value and Array know T).
  template <class Archive>
  static std::shared_ptr<SharedSegment> LoadSegment(Archive& ar) {
    auto segment = std::make_shared<SharedSegment>();
    ar(*segment);
    return segment;
  }

 private:
  ValueBlock(std::shared_ptr<SharedSegment> segment, const ValueBlockHeader& header);
  std::shared_ptr<SharedSegment> segment_;
  // Validated once, kept here: later changes to the shared header cannot move them.
  void* data_ = nullptr;
  size_t count_ = 0;
  bool has_lock_ = false;
};

/// Throws kFailedPrecondition: `what` needs a lock but the object was created with lock=false.
[[noreturn]] void ThrowNoLock(const char* what);
/// Throws kInvalidArgument: index out of range.
[[noreturn]] void ThrowIndex(size_t index, size_t size);

/// Holds a Lock for a scope unless the calling thread holds it already.
class LockUnlessHeld {
 public:
  explicit LockUnlessHeld(Lock* lock)
      : lock_(lock != nullptr && !LockAccess::CoreOf(*lock).HeldByCaller() ? lock : nullptr) {
    if (lock_ != nullptr) lock_->acquire();
    // Without a lock, still order this access against other processes' plain accesses.
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  ~LockUnlessHeld() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (lock_ != nullptr) lock_->release();
  }
  LockUnlessHeld(const LockUnlessHeld&) = delete;
  LockUnlessHeld& operator=(const LockUnlessHeld&) = delete;

 private:
  Lock* lock_;
};

}  // namespace internal

/// One T in shared memory, with an optional Lock (multiprocessing.Value).
template <class T>
class Value {
  static_assert(std::is_trivially_copyable_v<T>,
                "mp::Value<T> needs a trivially copyable T: it lives in shared memory and is "
                "copied bytewise between processes (use plain numbers or structs of them, not "
                "std::string, std::vector or pointers)");

 public:
  /// A new shared value holding `initial`, with a Lock unless `lock` is false.
  explicit Value(T initial = T{}, bool lock = true)
      : block_(internal::ValueBlock::Create(internal::kValueKind, sizeof(T), alignof(T), 1, lock)) {
    std::memcpy(block_.data(), &initial, sizeof(T));
    if (lock) lock_ = block_.MakeLock("Value");
  }
  Value(const Value&) = default;  // copies share the value
  Value& operator=(const Value&) = default;

  /// The current value (read under the lock, if any).
  T get() const {
    internal::LockUnlessHeld guard(lock_ptr());
    T out;
    std::memcpy(&out, block_.data(), sizeof(T));
    return out;
  }
  /// Stores `value` (under the lock, if any).
  void set(const T& value) {
    internal::LockUnlessHeld guard(lock_ptr());
    std::memcpy(block_.data(), &value, sizeof(T));
  }
  /// Applies `f` to the value under the lock and returns the new value. `f` is either
  /// `void(T&)` (edits in place) or `T(T)` (returns the new value). Throws kFailedPrecondition
  /// when created with lock=false.
  template <class F>
  T update(F&& f) {
    if (!lock_.has_value()) internal::ThrowNoLock("Value.update");
    internal::LockUnlessHeld guard(lock_ptr());
    T current;
    std::memcpy(&current, block_.data(), sizeof(T));
    static_assert(std::is_invocable_v<F, T&>, "Value::update(f): f must be void(T&) or T(T)");
    if constexpr (std::is_void_v<std::invoke_result_t<F, T&>>) {
      f(current);
    } else {
      static_assert(std::is_convertible_v<std::invoke_result_t<F, T&>, T>,
                    "Value::update(f): f must return void (editing its T& argument) or a T");
      current = f(current);
    }
    std::memcpy(block_.data(), &current, sizeof(T));
    return current;
  }
  /// The lock guarding the value. Throws kFailedPrecondition when created with lock=false.
  Lock& get_lock() const {
    if (!lock_.has_value()) internal::ThrowNoLock("Value.get_lock");
    return *lock_;
  }
  /// True when the value has a lock.
  bool has_lock() const { return lock_.has_value(); }

  /// codec: the segment travels out of band; decoding checks it holds a Value<T>.
  template <class Archive>
  void save(Archive& ar) const {
    ar(block_);
  }
  template <class Archive>
  void load(Archive& ar) {
    internal::ValueBlock block = internal::ValueBlock::Adopt(
        internal::ValueBlock::LoadSegment(ar), internal::kValueKind, sizeof(T), alignof(T));
    std::optional<Lock> lock;
    if (block.has_lock()) lock = block.MakeLock("Value");
    block_ = std::move(block);
    lock_ = std::move(lock);
  }

 private:
  Lock* lock_ptr() const { return lock_.has_value() ? &*lock_ : nullptr; }
  internal::ValueBlock block_;
  mutable std::optional<Lock> lock_;
};

/// n Ts in shared memory, with an optional Lock (multiprocessing.Array).
template <class T>
class Array {
  static_assert(std::is_trivially_copyable_v<T>,
                "mp::Array<T> needs a trivially copyable T: it lives in shared memory and is "
                "copied bytewise between processes (use plain numbers or structs of them, not "
                "std::string, std::vector or pointers)");

 public:
  /// An empty Array: no elements, no lock, no shared memory. It is what a decoded argument starts
  /// as (entry points decode into default-constructed values); assign a real Array to use it.
  Array() = default;
  /// n copies of `fill`, with a Lock unless `lock` is false. kInvalidArgument if n * sizeof(T)
  /// overflows; kResourceExhausted, before anything is touched, if the system cannot give it.
  explicit Array(size_t n, const T& fill = T{}, bool lock = true)
      : block_(internal::ValueBlock::Create(internal::kArrayKind, sizeof(T), alignof(T), n, lock)) {
    T* p = data();
    for (size_t i = 0; i < n; ++i) std::memcpy(p + i, &fill, sizeof(T));
    if (lock) lock_ = block_.MakeLock("Array");
  }
  /// A copy of `init`, with a Lock unless `lock` is false.
  explicit Array(const std::vector<T>& init, bool lock = true)
      : block_(internal::ValueBlock::Create(internal::kArrayKind, sizeof(T), alignof(T),
                                            init.size(), lock)) {
    if (!init.empty()) std::memcpy(data(), init.data(), init.size() * sizeof(T));
    if (lock) lock_ = block_.MakeLock("Array");
  }
  Array(const Array&) = default;  // copies share the elements
  Array& operator=(const Array&) = default;

  /// The number of elements.
  size_t size() const { return block_.count(); }
  /// The elements, in shared memory (unlocked access; see Hazards).
  T* data() const { return static_cast<T*>(block_.data()); }
  /// Element i, unchecked (unlocked access).
  T& operator[](size_t i) const { return data()[i]; }
  /// Element i; throws kInvalidArgument when i >= size() (unlocked access).
  T& at(size_t i) const {
    if (i >= size()) internal::ThrowIndex(i, size());
    return data()[i];
  }
  T* begin() const { return data(); }
  T* end() const { return data() + size(); }
  /// A copy of all elements, taken under the lock (if any).
  std::vector<T> to_vector() const {
    internal::LockUnlessHeld guard(lock_ptr());
    std::vector<T> out(size());
    if (!out.empty()) std::memcpy(out.data(), data(), out.size() * sizeof(T));
    return out;
  }
  /// The lock guarding the elements. Throws kFailedPrecondition when created with lock=false.
  Lock& get_lock() const {
    if (!lock_.has_value()) internal::ThrowNoLock("Array.get_lock");
    return *lock_;
  }
  /// True when the array has a lock.
  bool has_lock() const { return lock_.has_value(); }

  /// codec: the segment travels out of band; decoding checks it holds an Array<T> that fits.
  template <class Archive>
  void save(Archive& ar) const {
    ar(block_);
  }
  template <class Archive>
  void load(Archive& ar) {
    internal::ValueBlock block = internal::ValueBlock::Adopt(
        internal::ValueBlock::LoadSegment(ar), internal::kArrayKind, sizeof(T), alignof(T));
    std::optional<Lock> lock;
    if (block.has_lock()) lock = block.MakeLock("Array");
    block_ = std::move(block);
    lock_ = std::move(lock);
  }

 private:
  Lock* lock_ptr() const { return lock_.has_value() ? &*lock_ : nullptr; }
  internal::ValueBlock block_;
  mutable std::optional<Lock> lock_;
};

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_SHARED_VALUE_H_
