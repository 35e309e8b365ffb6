#include "forksafe/device/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "forksafe/runtime/error.h"

namespace forksafe::device {
namespace {

using runtime::Error;
using runtime::ErrorCode;

Error Invalid(const std::string& message) { return Error(ErrorCode::kInvalidArgument, message); }

std::string ShapeString(const std::vector<int64_t>& v) {
  return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
}

// Validates `shape` and returns its number of elements; the byte size must fit too.
int64_t CheckShape(const std::vector<int64_t>& shape, DType dtype, const char* what) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      throw Invalid(absl::StrCat(what, ": shape ", ShapeString(shape), " has a negative extent (",
                                 shape[i], " in dimension ", i, "); every extent must be >= 0"));
    }
    if (__builtin_mul_overflow(n, shape[i], &n)) {
      throw Invalid(absl::StrCat(what, ": shape ", ShapeString(shape),
                                 " has more elements than fit in int64"));
    }
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(DTypeSize(dtype)), &bytes)) {
    throw Invalid(absl::StrCat(what, ": shape ", ShapeString(shape), " of ", DTypeName(dtype),
                               " is too large to address"));
  }
  return n;
}

std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i] == 0 ? 1 : shape[i];  // keeps strides meaningful for empty tensors
  }
  return strides;
}

int64_t WrapDim(int64_t dim, int64_t ndim, const char* what) {
  if (ndim == 0) {
    throw Invalid(absl::StrCat(what, ": dimension ", dim,
                               " does not exist on a 0-dimensional (scalar) tensor"));
  }
  const int64_t d = dim < 0 ? dim + ndim : dim;
  if (d < 0 || d >= ndim) {
    throw Invalid(absl::StrCat(what, ": dimension ", dim, " is out of range for a tensor of ", ndim,
                               " dimension(s) (valid: ", -ndim, "..", ndim - 1, ")"));
  }
  return d;
}

int64_t WrapIndex(int64_t index, int64_t size, int64_t dim, const char* what) {
  const int64_t i = index < 0 ? index + size : index;
  if (i < 0 || i >= size) {
    throw Invalid(absl::StrCat(what, ": index ", index, " is out of range for dimension ", dim,
                               " of size ", size,
                               size == 0 ? " (the dimension is empty)"
                                         : absl::StrCat(" (valid: ", -size, "..", size - 1, ")")));
  }
  return i;
}

// Copies `n` bytes from host memory to memory on `device`.
void HostToDevice(void* dst, Device device, const void* src, size_t n) {
  if (n == 0) return;
  if (device.is_cpu()) {
    std::memcpy(dst, src, n);
  } else {
    Copy(dst, device, src, kCPU, n);
  }
}

// Copies `n` bytes from memory on `device` to host memory.
void DeviceToHost(void* dst, const void* src, Device device, size_t n) {
  if (n == 0) return;
  if (device.is_cpu()) {
    std::memcpy(dst, src, n);
  } else {
    Copy(dst, kCPU, src, device, n);
  }
}

void* Advance(void* p, int64_t bytes) {
  // Integer arithmetic: device pointers (tagged on the simulated accelerator) are not objects.
  return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes));
}

// Gathers the elements of a strided view, whose element (0, ..., 0) is at `src`, into `dst`
// row-major. Every extent is > 0 and there is at least one dimension.
void Gather(const char* src, char* dst, const std::vector<int64_t>& shape,
            const std::vector<int64_t>& strides, size_t isz) {
  const int nd = static_cast<int>(shape.size());
  const int64_t inner = shape[nd - 1];
  const int64_t inner_step = strides[nd - 1] * static_cast<int64_t>(isz);
  std::vector<int64_t> idx(nd, 0);
  int64_t off = 0;  // in elements
  for (;;) {
    const char* p = src + off * static_cast<int64_t>(isz);
    for (int64_t j = 0; j < inner; ++j, dst += isz) std::memcpy(dst, p + j * inner_step, isz);
    int k = nd - 2;
    for (; k >= 0; --k) {
      if (++idx[k] < shape[k]) {
        off += strides[k];
        break;
      }
      off -= (shape[k] - 1) * strides[k];
      idx[k] = 0;
    }
    if (k < 0) return;
  }
}

const char* CppTypeFor(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float";
    case DType::kFloat64: return "double";
    case DType::kInt32: return "int32_t";
    case DType::kInt64: return "int64_t";
    case DType::kUInt8: return "uint8_t";
    case DType::kBool: return "bool";
    case DType::kFloat16:
    case DType::kBFloat16: return "uint16_t (raw bits)";
  }
  return "?";
}

// Converts `v` to one element of `dtype` at `out` (DTypeSize(dtype) bytes).
void EncodeScalar(double v, DType dtype, void* out, const char* what) {
  auto not_fit = [&](const char* why) {
    return Invalid(absl::StrCat(what, ": value ", v, " does not fit dtype ", DTypeName(dtype), " (",
                                why, ")"));
  };
  auto integral = [&](double lo, double hi_exclusive) {
    if (!std::isfinite(v) || std::trunc(v) != v) throw not_fit("not an integer");
    if (v < lo || v >= hi_exclusive) {
      throw not_fit(absl::StrCat("outside [", lo, ", ", hi_exclusive, ")").c_str());
    }
  };
  auto as_float = [&]() -> float {
    if (std::isfinite(v) && std::fabs(v) > static_cast<double>(std::numeric_limits<float>::max())) {
      throw not_fit("beyond the largest finite value");
    }
    return static_cast<float>(v);
  };
  switch (dtype) {
    case DType::kFloat32: {
      const float f = as_float();
      std::memcpy(out, &f, sizeof f);
      return;
    }
    case DType::kFloat64: std::memcpy(out, &v, sizeof v); return;
    case DType::kInt32: {
      integral(-2147483648.0, 2147483648.0);
      const int32_t x = static_cast<int32_t>(v);
      std::memcpy(out, &x, sizeof x);
      return;
    }
    case DType::kInt64: {
      integral(-9223372036854775808.0, 9223372036854775808.0);
      const int64_t x = static_cast<int64_t>(v);
      std::memcpy(out, &x, sizeof x);
      return;
    }
    case DType::kUInt8: {
      integral(0.0, 256.0);
      const uint8_t x = static_cast<uint8_t>(v);
      std::memcpy(out, &x, sizeof x);
      return;
    }
    case DType::kBool: {
      const uint8_t x = v != 0 ? 1 : 0;
      std::memcpy(out, &x, sizeof x);
      return;
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      const float f = as_float();
      const uint16_t h = dtype == DType::kFloat16 ? Float16Bits(f) : BFloat16Bits(f);
      const bool inf = dtype == DType::kFloat16 ? (h & 0x7FFF) == 0x7C00 : (h & 0x7FFF) == 0x7F80;
      if (std::isfinite(v) && inf) throw not_fit("beyond the largest finite value");
      std::memcpy(out, &h, sizeof h);
      return;
    }
  }
  throw Invalid(absl::StrCat(what, ": invalid dtype value ", static_cast<int>(dtype)));
}

}  // namespace

// ---- DType ----------------------------------------------------------------------------------

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
    case DType::kBool: return 1;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
  }
  throw Invalid(absl::StrCat("invalid dtype value ", static_cast<int>(dtype),
                             "; use one of the DType enumerators"));
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kBool: return "bool";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "invalid";
}

uint16_t Float16Bits(float value) {
  uint32_t f;
  std::memcpy(&f, &value, sizeof f);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t exp = (f >> 23) & 0xFFu;
  uint32_t mant = f & 0x7FFFFFu;
  if (exp == 0xFF) return static_cast<uint16_t>(sign | 0x7C00u | (mant != 0 ? 0x200u : 0u));
  const int32_t e = static_cast<int32_t>(exp) - 127 + 15;
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7C00u);
  if (e <= 0) {  // a half subnormal, or zero
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const int shift = 14 - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may round up to infinity
  return static_cast<uint16_t>(h);
}

float Float16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exp = (bits >> 10) & 0x1Fu;
  const uint32_t mant = bits & 0x3FFu;
  uint32_t f;
  if (exp == 0) {
    const float m = std::ldexp(static_cast<float>(mant), -24);
    return sign != 0 ? -m : m;
  } else if (exp == 31) {
    f = sign | 0x7F800000u | (mant << 13);
  } else {
    f = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &f, sizeof out);
  return out;
}

uint16_t BFloat16Bits(float value) {
  uint32_t f;
  std::memcpy(&f, &value, sizeof f);
  if ((f & 0x7F800000u) == 0x7F800000u && (f & 0x7FFFFFu) != 0) {
    return static_cast<uint16_t>((f >> 16) | 0x40u);  // quiet NaN, sign kept
  }
  const uint32_t rounding = 0x7FFFu + ((f >> 16) & 1u);
  return static_cast<uint16_t>((f + rounding) >> 16);
}

float BFloat16ToFloat(uint16_t bits) {
  const uint32_t f = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &f, sizeof out);
  return out;
}

// ---- Tensor: construction -------------------------------------------------------------------

Tensor::Tensor() : shape_{0}, strides_{1} {}

Tensor::Tensor(Storage storage, DType dtype, std::vector<int64_t> shape,
               std::vector<int64_t> strides, int64_t offset)
    : storage_(std::move(storage)),
      dtype_(dtype),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      storage_offset_(offset) {}

Tensor Tensor::Empty(const std::vector<int64_t>& shape, DType dtype, Device device) {
  const int64_t n = CheckShape(shape, dtype, "Tensor::Empty");
  Storage s = Storage::Allocate(device, static_cast<size_t>(n) * DTypeSize(dtype));
  return Tensor(std::move(s), dtype, shape, ContiguousStrides(shape), 0);
}

Tensor Tensor::Zeros(const std::vector<int64_t>& shape, DType dtype, Device device) {
  Tensor t = Empty(shape, dtype, device);
  const size_t n = t.nbytes();
  if (n == 0) return t;
  if (device.is_cpu()) {
    std::memset(t.data_ptr(), 0, n);
  } else {
    // Queued on the device's stream: every later copy or kernel on the device sees the zeros.
    GetBackend(device.type).Memset(device.index, t.data_ptr(), 0, n);
  }
  return t;
}

Tensor Tensor::Full(const std::vector<int64_t>& shape, double value, DType dtype, Device device) {
  CheckShape(shape, dtype, "Tensor::Full");
  unsigned char pattern[8];
  EncodeScalar(value, dtype, pattern, "Tensor::Full");
  Tensor t = Empty(shape, dtype, device);
  const size_t isz = DTypeSize(dtype);
  const int64_t n = t.numel();
  if (n == 0) return t;
  std::unique_ptr<char[]> staging;
  char* dst = nullptr;
  if (device.is_cpu()) {
    dst = static_cast<char*>(t.data_ptr());
  } else {
    staging.reset(new char[t.nbytes()]);
    dst = staging.get();
  }
  // One element, then the filled prefix copied onto the rest, doubling: log2(n) memcpy calls
  // instead of one per element (64 MiB of float32: 30-40 ms per element, a memcpy's time so).
  const size_t total = t.nbytes();
  std::memcpy(dst, pattern, isz);
  for (size_t filled = isz; filled < total;) {
    const size_t step = std::min(filled, total - filled);
    std::memcpy(dst + filled, dst, step);
    filled += step;
  }
  if (staging) HostToDevice(t.data_ptr(), device, staging.get(), t.nbytes());
  return t;
}

Tensor Tensor::FromHost(const void* data, size_t count, const std::vector<int64_t>& shape,
                        DType dtype, Device device) {
  const int64_t n = CheckShape(shape, dtype, "Tensor::FromVector");
  if (static_cast<uint64_t>(n) != count) {
    throw Invalid(absl::StrCat("Tensor::FromVector: ", count, " value(s) given for shape ",
                               ShapeString(shape), ", which has ", n,
                               " element(s); the counts must match"));
  }
  Tensor t = Empty(shape, dtype, device);
  HostToDevice(t.data_ptr(), device, data, t.nbytes());
  return t;
}

Tensor Tensor::FromVector(const std::vector<uint16_t>& bits, const std::vector<int64_t>& shape,
                          DType dtype, Device device) {
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    throw Invalid(
        absl::StrCat("Tensor::FromVector: uint16_t bits make a float16 or bfloat16 "
                     "tensor, not ",
                     DTypeName(dtype), "; pass DType::kFloat16 or DType::kBFloat16"));
  }
  return FromHost(bits.data(), bits.size(), shape, dtype, device);
}

Tensor Tensor::FromStorage(Storage storage, DType dtype, std::vector<int64_t> shape,
                           std::optional<std::vector<int64_t>> strides, int64_t storage_offset) {
  constexpr const char* kWhat = "Tensor::FromStorage";
  const int64_t n = CheckShape(shape, dtype, kWhat);
  std::vector<int64_t> st = strides.has_value() ? std::move(*strides) : ContiguousStrides(shape);
  if (st.size() != shape.size()) {
    throw Invalid(absl::StrCat(kWhat, ": ", st.size(), " stride(s) ", ShapeString(st),
                               " for shape ", ShapeString(shape), "; give one per dimension"));
  }
  for (size_t i = 0; i < st.size(); ++i) {
    if (st[i] < 0) {
      throw Invalid(absl::StrCat(kWhat, ": stride ", st[i], " of dimension ", i,
                                 " is negative; only strides >= 0 are supported"));
    }
  }
  if (storage_offset < 0) {
    throw Invalid(absl::StrCat(kWhat, ": storage offset ", storage_offset, " is negative"));
  }
  const int64_t isz = static_cast<int64_t>(DTypeSize(dtype));
  // Last element reached, plus one, in elements; 0 elements reach nothing past the offset.
  int64_t end = storage_offset;
  bool overflow = false;
  if (n > 0) {
    for (size_t i = 0; i < shape.size(); ++i) {
      int64_t span = 0;
      overflow |= __builtin_mul_overflow(shape[i] - 1, st[i], &span);
      overflow |= __builtin_add_overflow(end, span, &end);
    }
    overflow |= __builtin_add_overflow(end, 1, &end);
  }
  int64_t end_bytes = 0;
  overflow |= __builtin_mul_overflow(end, isz, &end_bytes);
  if (overflow || static_cast<uint64_t>(end_bytes) > storage.nbytes()) {
    throw Invalid(absl::StrCat(kWhat, ": a ", DTypeName(dtype), " view of shape ",
                               ShapeString(shape), ", strides ", ShapeString(st), " and offset ",
                               storage_offset, " needs ",
                               overflow ? std::string("more than 2^63") : absl::StrCat(end_bytes),
                               " bytes of storage, but the storage has ", storage.nbytes()));
  }
  return Tensor(std::move(storage), dtype, std::move(shape), std::move(st), storage_offset);
}

// ---- Tensor: metadata -----------------------------------------------------------------------

int64_t Tensor::size(int64_t dim) const { return shape_[WrapDim(dim, this->dim(), "size")]; }

int64_t Tensor::stride(int64_t dim) const { return strides_[WrapDim(dim, this->dim(), "stride")]; }

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  void* base = storage_.data();
  if (base == nullptr) return nullptr;
  return Advance(base, storage_offset_ * static_cast<int64_t>(element_size()));
}

std::string Tensor::DebugString() const {
  return absl::StrCat("Tensor(", DTypeName(dtype_), ", shape=", ShapeString(shape_),
                      ", strides=", ShapeString(strides_), ", offset=", storage_offset_, ", ",
                      device().ToString(), ")");
}

// ---- Tensor: views --------------------------------------------------------------------------

Tensor Tensor::View(const std::vector<int64_t>& new_shape) const {
  if (!is_contiguous()) {
    throw Invalid(absl::StrCat("View(", ShapeString(new_shape), ") needs a contiguous tensor, but ",
                               DebugString(),
                               " is not (a transpose, a stepped slice or a select of it?); call "
                               "Contiguous() first, which copies"));
  }
  const int64_t n = numel();
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < new_shape.size(); ++i) {
    if (new_shape[i] == -1) {
      if (infer >= 0) {
        throw Invalid(
            absl::StrCat("View(", ShapeString(new_shape), "): only one extent may be -1"));
      }
      infer = static_cast<int>(i);
    } else if (new_shape[i] < 0) {
      throw Invalid(absl::StrCat("View(", ShapeString(new_shape), "): extent ", new_shape[i],
                                 " in dimension ", i,
                                 " is negative (only -1, to infer, is allowed)"));
    } else if (__builtin_mul_overflow(known, new_shape[i], &known)) {
      throw Invalid(absl::StrCat("View(", ShapeString(new_shape), "): too many elements"));
    }
  }
  std::vector<int64_t> shape = new_shape;
  if (infer >= 0) {
    if (known == 0 || n % known != 0) {
      throw Invalid(absl::StrCat("View(", ShapeString(new_shape), "): cannot infer the -1 extent: ",
                                 n, " element(s) are not a multiple of ", known));
    }
    shape[infer] = n / known;
  } else if (known != n) {
    throw Invalid(absl::StrCat("View(", ShapeString(new_shape), ") has ", known,
                               " element(s), but the tensor of shape ", ShapeString(shape_),
                               " has ", n));
  }
  std::vector<int64_t> strides = ContiguousStrides(shape);
  return Tensor(storage_, dtype_, std::move(shape), std::move(strides), storage_offset_);
}

Tensor Tensor::Slice(int64_t dim, int64_t start, int64_t end, int64_t step) const {
  const int64_t d = WrapDim(dim, this->dim(), "Slice");
  const int64_t size = shape_[d];
  if (step < 1) {
    throw Invalid(absl::StrCat("Slice(dim=", dim, "): step ", step, " must be >= 1"));
  }
  const int64_t s = start < 0 ? start + size : start;
  const int64_t e = end == kToEnd ? size : (end < 0 ? end + size : end);
  if (s < 0 || s > e || e > size) {
    throw Invalid(absl::StrCat("Slice(dim=", dim, ", start=", start,
                               ", end=", end == kToEnd ? std::string("kToEnd") : absl::StrCat(end),
                               "): dimension ", d, " has size ", size,
                               "; need 0 <= start <= end <= ", size, " after adding ", size,
                               " to negative values"));
  }
  const int64_t len = s == e ? 0 : 1 + (e - s - 1) / step;
  std::vector<int64_t> shape = shape_;
  std::vector<int64_t> strides = strides_;
  shape[d] = len;
  if (len > 1) strides[d] *= step;  // len > 1 means step < size: no overflow
  return Tensor(storage_, dtype_, std::move(shape), std::move(strides),
                storage_offset_ + s * strides_[d]);
}

Tensor Tensor::Transpose(int64_t d0, int64_t d1) const {
  const int64_t a = WrapDim(d0, dim(), "Transpose");
  const int64_t b = WrapDim(d1, dim(), "Transpose");
  std::vector<int64_t> shape = shape_;
  std::vector<int64_t> strides = strides_;
  std::swap(shape[a], shape[b]);
  std::swap(strides[a], strides[b]);
  return Tensor(storage_, dtype_, std::move(shape), std::move(strides), storage_offset_);
}

Tensor Tensor::Select(int64_t dim, int64_t index) const {
  const int64_t d = WrapDim(dim, this->dim(), "Select");
  const int64_t i = WrapIndex(index, shape_[d], d, "Select");
  std::vector<int64_t> shape = shape_;
  std::vector<int64_t> strides = strides_;
  shape.erase(shape.begin() + d);
  strides.erase(strides.begin() + d);
  return Tensor(storage_, dtype_, std::move(shape), std::move(strides),
                storage_offset_ + i * strides_[d]);
}

// ---- Tensor: copies -------------------------------------------------------------------------

void Tensor::CopyToHost(void* dst) const {
  const int64_t n = numel();
  if (n == 0) return;
  if (is_contiguous()) {
    DeviceToHost(dst, data_ptr(), device(), nbytes());
    return;
  }
  const size_t isz = element_size();
  const char* src = nullptr;
  std::unique_ptr<char[]> staging;
  if (device().is_cpu()) {
    src = static_cast<const char*>(data_ptr());
  } else {
    // One copy of the whole span the view touches, then a gather on the host.
    int64_t span = 1;
    for (size_t i = 0; i < shape_.size(); ++i) span += (shape_[i] - 1) * strides_[i];
    const size_t span_bytes = static_cast<size_t>(span) * isz;
    staging.reset(new char[span_bytes]);
    DeviceToHost(staging.get(), data_ptr(), device(), span_bytes);
    src = staging.get();
  }
  Gather(src, static_cast<char*>(dst), shape_, strides_, isz);
}

Tensor Tensor::Contiguous() const { return is_contiguous() ? *this : Clone(); }

Tensor Tensor::Clone() const {
  const Device dev = device();
  Tensor out = Empty(shape_, dtype_, dev);
  if (out.nbytes() == 0) return out;
  if (dev.is_cpu()) {
    CopyToHost(out.data_ptr());
  } else if (is_contiguous()) {
    Copy(out.data_ptr(), dev, data_ptr(), dev, nbytes());  // device to device
  } else {
    std::unique_ptr<char[]> staging(new char[out.nbytes()]);
    CopyToHost(staging.get());
    HostToDevice(out.data_ptr(), dev, staging.get(), out.nbytes());
  }
  return out;
}

Tensor Tensor::To(Device target) const {
  const Device dev = device();
  if (target == dev) return *this;
  Tensor out = Empty(shape_, dtype_, target);
  if (out.nbytes() == 0) return out;
  if (target.is_cpu()) {
    CopyToHost(out.data_ptr());
  } else if (is_contiguous()) {
    Copy(out.data_ptr(), target, data_ptr(), dev, nbytes());
  } else {
    std::unique_ptr<char[]> staging(new char[out.nbytes()]);
    CopyToHost(staging.get());
    HostToDevice(out.data_ptr(), target, staging.get(), out.nbytes());
  }
  return out;
}

// ---- Tensor: element access -----------------------------------------------------------------

void Tensor::CheckType(bool matches, const char* cpp_type, const char* what) const {
  if (matches) return;
  throw Invalid(absl::StrCat(what, "<", cpp_type, ">: the tensor's dtype is ", DTypeName(dtype_),
                             "; use ", what, "<", CppTypeFor(dtype_), ">"));
}

int64_t Tensor::ElementOffset(std::initializer_list<int64_t> index, const char* what) const {
  if (static_cast<int64_t>(index.size()) != dim()) {
    throw Invalid(absl::StrCat(what, ": got ", index.size(), " index(es) for a tensor of ", dim(),
                               " dimension(s) (shape ", ShapeString(shape_),
                               "); pass one index per dimension ({} for a scalar)"));
  }
  int64_t off = storage_offset_;
  int64_t d = 0;
  for (int64_t i : index) {
    off += WrapIndex(i, shape_[d], d, what) * strides_[d];
    ++d;
  }
  return off;
}

void Tensor::ReadElement(int64_t element_offset, void* out) const {
  const size_t isz = element_size();
  DeviceToHost(out, Advance(storage_.data(), element_offset * static_cast<int64_t>(isz)), device(),
               isz);
}

void Tensor::WriteElement(int64_t element_offset, const void* in) const {
  const size_t isz = element_size();
  HostToDevice(Advance(storage_.data(), element_offset * static_cast<int64_t>(isz)), device(), in,
               isz);
}

}  // namespace forksafe::device
