// device/tensor.h: dtypes and strided tensors over a Storage.
//
// What it offers
//   `DType` names the element types forksafe moves around (float16 and bfloat16 are carried as raw
//   16-bit patterns: device/ does no arithmetic on them; Float16Bits() and friends convert).
//   `Tensor` is a strided view over a Storage (device/storage.h): dtype, shape, strides and storage
//   offset (both in elements), on the storage's device. It offers
//   - creation: Empty, Zeros, Full, FromVector (host data, optionally copied to a device),
//     FromStorage (a view over an existing Storage: what DLPack import and mp/ build on);
//   - views that share the storage: View (reshape of a contiguous tensor), Slice, Transpose,
//     Select; a write through a view is seen by every tensor over the same storage;
//   - copies: Contiguous, Clone, To(device), all through the backend registry's Copy;
//   - element access for tests and examples: item<T>/set<T> (one element, on any device, through
//     explicit copies for device memory) and ToVector<T> (any device, any strides).
//   Sharing tensors between processes is the job of mp/: it provides share_memory_(), which moves
//   a tensor's storage into a shared segment. device/ only reports the result (is_shared()).
//
// Element types in C++
//   float32 <-> float, float64 <-> double, int32 <-> int32_t, int64 <-> int64_t,
//   uint8 <-> uint8_t, bool <-> bool (stored as one byte, 0 or 1), float16 and bfloat16 <->
//   uint16_t holding the raw bits. item<T>, set<T> and ToVector<T> throw kInvalidArgument when T
//   does not match the dtype.
//
// Indexing rules
//   Dimensions and indices may be negative and count from the end (-1 is the last), as in Python.
//   Anything still outside its range after that is an error (kInvalidArgument), never clamped.
//
// Guarantees
//   - Every bad argument throws forksafe::runtime::Error(kInvalidArgument) naming the values
//     involved; device errors (kUnavailable, kResourceExhausted, kForkPoisoned) pass through.
//   - Copies between devices are synchronous: when To(), Clone(), ToVector(), item() or set()
//     returns, the data has arrived.
//   - Thread safety: a Tensor is a value (a handle). Distinct Tensor objects may be used from
//     different threads at once, even over the same storage (the storage refcount is atomic);
//     one Tensor object must not be assigned while another thread uses it. Concurrent writes to
//     the same elements race, as with any memory.
//
// Fork behaviour
//   Tensor metadata (shape(), dtype(), ...) is always usable in a forked child. Data access
//   follows the device (see storage.h): CPU tensors created in the parent are readable in the
//   child (copy-on-write: the child's writes stay in the child unless the storage is shared by
//   mp/); tensors on a poisoned backend (the simulated accelerator, CUDA, once the parent used
//   them) throw kForkPoisoned on any data access in the child, and can be dropped there safely.
//
// Hazards
//   - data_ptr() of a non-CPU tensor is a device pointer: never dereference it on the host (the
//     simulated accelerator's pointers fault at once). Use item(), ToVector() or To(kCPU).
//   - Views keep their storage alive: a small slice of a huge tensor holds all of it. Clone()
//     the slice to let the rest go.
#ifndef FORKSAFE_DEVICE_TENSOR_H_
#define FORKSAFE_DEVICE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "forksafe/device/device.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/storage.h"

namespace forksafe::device {

/// Element types.
enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kInt32 = 2,
  kInt64 = 3,
  kUInt8 = 4,
  kBool = 5,      ///< One byte per element, 0 or 1.
  kFloat16 = 6,   ///< IEEE half, carried as raw 16-bit patterns (uint16_t in C++).
  kBFloat16 = 7,  ///< bfloat16, carried as raw 16-bit patterns (uint16_t in C++).
};

/// Size of one element in bytes.
size_t DTypeSize(DType dtype);
/// "float32", "float64", "int32", "int64", "uint8", "bool", "float16", "bfloat16".
const char* DTypeName(DType dtype);

/// IEEE half bits of `value`, rounded to nearest even (overflow gives infinity).
uint16_t Float16Bits(float value);
/// The float that half bits `bits` denote (exact).
float Float16ToFloat(uint16_t bits);
/// bfloat16 bits of `value`, rounded to nearest even (NaN stays a quiet NaN).
uint16_t BFloat16Bits(float value);
/// The float that bfloat16 bits `bits` denote (exact).
float BFloat16ToFloat(uint16_t bits);

namespace internal {
// The DType a C++ element type maps to without ambiguity (uint16_t has none: it is either
// float16 or bfloat16).
template <class T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kFloat32;
};
template <>
struct DTypeOf<double> {
  static constexpr DType value = DType::kFloat64;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::kInt32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::kInt64;
};
template <>
struct DTypeOf<uint8_t> {
  static constexpr DType value = DType::kUInt8;
};
template <>
struct DTypeOf<bool> {
  static constexpr DType value = DType::kBool;
};

template <class T>
constexpr bool kIsElementType =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, int32_t> ||
    std::is_same_v<T, int64_t> || std::is_same_v<T, uint8_t> || std::is_same_v<T, bool> ||
    std::is_same_v<T, uint16_t>;

// Whether C++ type T reads and writes elements of `dtype`.
template <class T>
bool Matches(DType dtype) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  } else {
    return dtype == DTypeOf<T>::value;
  }
}

template <class T>
const char* CppTypeName();
template <>
inline const char* CppTypeName<float>() {
  return "float";
}
template <>
inline const char* CppTypeName<double>() {
  return "double";
}
template <>
inline const char* CppTypeName<int32_t>() {
  return "int32_t";
}
template <>
inline const char* CppTypeName<int64_t>() {
  return "int64_t";
}
template <>
inline const char* CppTypeName<uint8_t>() {
  return "uint8_t";
}
template <>
inline const char* CppTypeName<bool>() {
  return "bool";
}
template <>
inline const char* CppTypeName<uint16_t>() {
  return "uint16_t";
}
}  // namespace internal

/// A strided view of typed elements over a Storage. Copies of a Tensor share its storage.
class Tensor {
 public:
  /// Pass as Slice's `end` to mean "to the end of the dimension".
  static constexpr int64_t kToEnd = std::numeric_limits<int64_t>::max();

  /// An empty float32 CPU tensor of shape {0}.
  Tensor();

  // ---- Creation --------------------------------------------------------------------------

  /// A contiguous tensor with uninitialized elements. Throws kInvalidArgument for a negative
  /// extent or a size that overflows; device errors as Storage::Allocate.
  static Tensor Empty(const std::vector<int64_t>& shape, DType dtype = DType::kFloat32,
                      Device device = CurrentDevice());
  /// A contiguous tensor of zeros (false for bool). On an accelerator the fill is queued on the
  /// device's stream, so every later copy or kernel on that device sees it.
  static Tensor Zeros(const std::vector<int64_t>& shape, DType dtype = DType::kFloat32,
                      Device device = CurrentDevice());
  /// A contiguous tensor with every element `value` converted to `dtype`. Throws
  /// kInvalidArgument when `value` does not fit: a non-integral, non-finite or out-of-range
  /// value for an integer dtype, or a finite value beyond a floating dtype's range. For bool,
  /// any non-zero value is true.
  static Tensor Full(const std::vector<int64_t>& shape, double value, DType dtype = DType::kFloat32,
                     Device device = CurrentDevice());

  /// A contiguous tensor holding `values` (row-major), of dtype DTypeOf<T>, created on the CPU
  /// and copied to `device` if that is not the CPU. Throws kInvalidArgument when values.size()
  /// differs from the number of elements of `shape`.
  template <class T>
  static Tensor FromVector(const std::vector<T>& values, const std::vector<int64_t>& shape,
                           Device device = kCPU);
  /// Raw 16-bit patterns for a float16 or bfloat16 tensor (`dtype` must be one of the two).
  static Tensor FromVector(const std::vector<uint16_t>& bits, const std::vector<int64_t>& shape,
                           DType dtype, Device device = kCPU);

  /// A view over `storage`: element (i0, i1, ...) lives at element
  /// storage_offset + sum(ik * strides[k]) of the storage. Strides default to contiguous.
  /// Throws kInvalidArgument for negative extents, negative strides or offset, a strides vector
  /// of the wrong length, or a view that does not fit inside the storage.
  static Tensor FromStorage(Storage storage, DType dtype, std::vector<int64_t> shape,
                            std::optional<std::vector<int64_t>> strides = std::nullopt,
                            int64_t storage_offset = 0);

  // ---- Metadata ---------------------------------------------------------------------------

  DType dtype() const { return dtype_; }
  /// Bytes per element.
  size_t element_size() const { return DTypeSize(dtype_); }
  const std::vector<int64_t>& shape() const { return shape_; }
  /// Strides in elements, one per dimension.
  const std::vector<int64_t>& strides() const { return strides_; }
  /// Extent of dimension `dim` (negative counts from the end).
  int64_t size(int64_t dim) const;
  /// Stride of dimension `dim` (negative counts from the end).
  int64_t stride(int64_t dim) const;
  /// Offset of element (0, ..., 0) from the start of the storage, in elements.
  int64_t storage_offset() const { return storage_offset_; }
  /// Number of dimensions (0 for a scalar).
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  /// Number of elements (1 for a scalar, 0 when any extent is 0).
  int64_t numel() const;
  /// numel() * element_size(): the bytes this view covers (not the storage's size).
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  /// True when the elements are laid out row-major without gaps (extents of 1 are ignored).
  bool is_contiguous() const;
  Device device() const { return storage_.device(); }
  const Storage& storage() const { return storage_; }
  /// Address of element (0, ..., 0): a host pointer for CPU tensors, a device pointer otherwise
  /// (see the hazard above). Null for a zero-byte storage.
  void* data_ptr() const;
  /// True when mp/ has moved the storage into shared memory (mp/ provides share_memory_()).
  bool is_shared() const { return storage_.is_shared(); }
  /// "Tensor(float32, shape=[2, 3], strides=[3, 1], offset=0, sim:0)".
  std::string DebugString() const;

  // ---- Views (share the storage) ----------------------------------------------------------

  /// The same elements with another shape; one extent may be -1 (inferred). Contiguous tensors
  /// only: throws kInvalidArgument for a non-contiguous one (call Contiguous() first) or when the
  /// element counts differ.
  Tensor View(const std::vector<int64_t>& new_shape) const;
  /// Elements start, start+step, ... below end of dimension `dim`. Needs 0 <= start <= end <=
  /// size(dim) after negative wrapping (kToEnd means size(dim)) and step >= 1.
  Tensor Slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  /// Dimensions d0 and d1 swapped.
  Tensor Transpose(int64_t d0, int64_t d1) const;
  /// Element `index` of dimension `dim`, with that dimension removed.
  Tensor Select(int64_t dim, int64_t index) const;

  // ---- Copies -----------------------------------------------------------------------------

  /// This tensor if it is contiguous (sharing the storage), else a contiguous copy on the same
  /// device.
  Tensor Contiguous() const;
  /// A contiguous deep copy on the same device, with its own storage.
  Tensor Clone() const;
  /// This tensor if it is already on `device` (sharing the storage; use Clone() for a copy),
  /// else a contiguous copy on `device` made through the registry's Copy.
  Tensor To(Device device) const;

  // ---- Element access (tests and examples; one copy per call on devices) -------------------

  /// The element at `index` (one entry per dimension; {} for a scalar).
  template <class T>
  T item(std::initializer_list<int64_t> index) const;
  /// Writes `value` at `index`. Every tensor over the same storage sees it.
  template <class T>
  void set(std::initializer_list<int64_t> index, T value);
  /// All elements in row-major order, whatever the strides and the device.
  template <class T>
  std::vector<T> ToVector() const;

 private:
  Tensor(Storage storage, DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides,
         int64_t offset);

  // A contiguous tensor on `device` holding `count` elements copied from host memory at `data`.
  static Tensor FromHost(const void* data, size_t count, const std::vector<int64_t>& shape,
                         DType dtype, Device device);
  void CheckType(bool matches, const char* cpp_type, const char* what) const;
  int64_t ElementOffset(std::initializer_list<int64_t> index, const char* what) const;
  void ReadElement(int64_t element_offset, void* out) const;
  void WriteElement(int64_t element_offset, const void* in) const;
  // Writes numel() elements, row-major and contiguous, to host memory at `dst`.
  void CopyToHost(void* dst) const;

  Storage storage_;
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  int64_t storage_offset_ = 0;
};

// ---- Template definitions -------------------------------------------------------------------

template <class T>
Tensor Tensor::FromVector(const std::vector<T>& values, const std::vector<int64_t>& shape,
                          Device device) {
  static_assert(internal::kIsElementType<T> && !std::is_same_v<T, uint16_t>,
                "FromVector<T>: T must be float, double, int32_t, int64_t, uint8_t or bool; for "
                "float16/bfloat16 pass uint16_t bits and the dtype");
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<uint8_t> bytes(values.begin(), values.end());
    return FromHost(bytes.data(), bytes.size(), shape, DType::kBool, device);
  } else {
    return FromHost(values.data(), values.size(), shape, internal::DTypeOf<T>::value, device);
  }
}

template <class T>
T Tensor::item(std::initializer_list<int64_t> index) const {
  static_assert(internal::kIsElementType<T>,
                "item<T>: T must be float, double, int32_t, int64_t, uint8_t, bool or uint16_t");
  CheckType(internal::Matches<T>(dtype_), internal::CppTypeName<T>(), "item");
  const int64_t off = ElementOffset(index, "item");
  if constexpr (std::is_same_v<T, bool>) {
    uint8_t b = 0;
    ReadElement(off, &b);
    return b != 0;
  } else {
    T v{};
    ReadElement(off, &v);
    return v;
  }
}

template <class T>
void Tensor::set(std::initializer_list<int64_t> index, T value) {
  static_assert(internal::kIsElementType<T>,
                "set<T>: T must be float, double, int32_t, int64_t, uint8_t, bool or uint16_t");
  CheckType(internal::Matches<T>(dtype_), internal::CppTypeName<T>(), "set");
  const int64_t off = ElementOffset(index, "set");
  if constexpr (std::is_same_v<T, bool>) {
    const uint8_t b = value ? 1 : 0;
    WriteElement(off, &b);
  } else {
    WriteElement(off, &value);
  }
}

template <class T>
std::vector<T> Tensor::ToVector() const {
  static_assert(internal::kIsElementType<T>,
                "ToVector<T>: T must be float, double, int32_t, int64_t, uint8_t, bool or "
                "uint16_t");
  CheckType(internal::Matches<T>(dtype_), internal::CppTypeName<T>(), "ToVector");
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<uint8_t> bytes(static_cast<size_t>(numel()));
    CopyToHost(bytes.data());
    return std::vector<bool>(bytes.begin(), bytes.end());
  } else {
    std::vector<T> out(static_cast<size_t>(numel()));
    CopyToHost(out.data());
    return out;
  }
}

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_TENSOR_H_
