#include "forksafe/device/dlpack.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/storage.h"
#include "forksafe/runtime/error.h"

namespace forksafe::device {
namespace {

using runtime::Error;
using runtime::ErrorCode;

// What a DLManagedTensor made by ToDLPack owns.
struct ExportContext {
  DLManagedTensor managed{};
  Tensor tensor;  // holds the storage
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

void DeleteExport(DLManagedTensor* self) {
  if (self == nullptr) return;
  delete static_cast<ExportContext*>(self->manager_ctx);  // never throws: see storage.h
}

const char* DLDeviceTypeName(int type) {
  switch (type) {
    case kDLCPU: return "kDLCPU";
    case kDLCUDA: return "kDLCUDA";
    case kDLCUDAHost: return "kDLCUDAHost";
    case kDLOpenCL: return "kDLOpenCL";
    case kDLVulkan: return "kDLVulkan";
    case kDLMetal: return "kDLMetal";
    case kDLVPI: return "kDLVPI";
    case kDLROCM: return "kDLROCM";
    case kDLROCMHost: return "kDLROCMHost";
    case kDLExtDev: return "kDLExtDev";
    case kDLCUDAManaged: return "kDLCUDAManaged";
  }
  return "unknown";
}

}  // namespace

DLDataType ToDLDataType(DType dtype) {
  DLDataType t;
  t.lanes = 1;
  switch (dtype) {
    case DType::kFloat32:
      t.code = kDLFloat;
      t.bits = 32;
      return t;
    case DType::kFloat64:
      t.code = kDLFloat;
      t.bits = 64;
      return t;
    case DType::kInt32:
      t.code = kDLInt;
      t.bits = 32;
      return t;
    case DType::kInt64:
      t.code = kDLInt;
      t.bits = 64;
      return t;
    case DType::kUInt8:
      t.code = kDLUInt;
      t.bits = 8;
      return t;
    case DType::kBool:
      t.code = kDLBoolCode;
      t.bits = 8;
      return t;
    case DType::kFloat16:
      t.code = kDLFloat;
      t.bits = 16;
      return t;
    case DType::kBFloat16:
      t.code = kDLBfloat;
      t.bits = 16;
      return t;
  }
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat("ToDLPack: invalid dtype value ", static_cast<int>(dtype)));
}

DType FromDLDataType(DLDataType dtype) {
  if (dtype.lanes == 1) {
    switch (dtype.code) {
      case kDLFloat:
        if (dtype.bits == 32) return DType::kFloat32;
        if (dtype.bits == 64) return DType::kFloat64;
        if (dtype.bits == 16) return DType::kFloat16;
        break;
      case kDLInt:
        if (dtype.bits == 32) return DType::kInt32;
        if (dtype.bits == 64) return DType::kInt64;
        break;
      case kDLUInt:
        if (dtype.bits == 8) return DType::kUInt8;
        break;
      case kDLBfloat:
        if (dtype.bits == 16) return DType::kBFloat16;
        break;
      case kDLBoolCode:
        if (dtype.bits == 8) return DType::kBool;
        break;
      default: break;
    }
  }
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat("FromDLPack: DLPack dtype (code ", dtype.code, ", bits ", dtype.bits,
                           ", lanes ", dtype.lanes,
                           ") is not supported; forksafe supports, with lanes = 1: kDLFloat "
                           "16/32/64, kDLBfloat 16, kDLInt 32/64, kDLUInt 8 and bool (code ",
                           kDLBoolCode, ", 8 bits). Convert the tensor to one of these first"));
}

DLDevice ToDLDevice(const Device& device) {
  DLDevice d;
  d.device_id = device.index;
  switch (device.type) {
    case DeviceType::kCPU:
      d.device_type = kDLCPU;
      d.device_id = 0;
      return d;
    case DeviceType::kCUDA: d.device_type = kDLCUDA; return d;
    case DeviceType::kSimAccel: d.device_type = kDLExtDev; return d;
  }
  throw Error(ErrorCode::kInvalidArgument,
              absl::StrCat("ToDLPack: device ", device.ToString(), " has no DLPack device type"));
}

Device FromDLDevice(DLDevice device) {
  Device out;
  switch (device.device_type) {
    case kDLCPU: return kCPU;  // device_id carries nothing for host memory
    case kDLCUDA:
      if (!HasBackend(DeviceType::kCUDA)) {
        throw Error(ErrorCode::kUnavailable,
                    absl::StrCat("FromDLPack: the tensor lives on CUDA device ", device.device_id,
                                 " (kDLCUDA), but no CUDA backend is registered in this process; "
                                 "register one, or move the tensor to the CPU before exporting"));
      }
      out = Device(DeviceType::kCUDA, device.device_id);
      break;
    case kDLExtDev: out = Device(DeviceType::kSimAccel, device.device_id); break;
    default:
      throw Error(ErrorCode::kUnavailable,
                  absl::StrCat("FromDLPack: DLPack device type ", device.device_type, " (",
                               DLDeviceTypeName(device.device_type),
                               ") has no forksafe backend; supported: kDLCPU, kDLCUDA (with a "
                               "CUDA backend) and kDLExtDev (the simulated accelerator). Move the "
                               "tensor to the CPU before exporting it"));
  }
  CheckDevice(out);
  return out;
}

DLManagedTensor* ToDLPack(const Tensor& tensor) {
  auto ctx = std::make_unique<ExportContext>();
  ctx->tensor = tensor;
  ctx->shape = tensor.shape();
  ctx->strides = tensor.strides();
  DLTensor& dl = ctx->managed.dl_tensor;
  dl.data = tensor.data_ptr();
  dl.device = ToDLDevice(tensor.device());
  dl.ndim = static_cast<int>(ctx->shape.size());
  dl.dtype = ToDLDataType(tensor.dtype());
  dl.shape = ctx->shape.empty() ? nullptr : ctx->shape.data();
  dl.strides = ctx->strides.empty() ? nullptr : ctx->strides.data();
  dl.byte_offset = 0;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = &DeleteExport;
  return &ctx.release()->managed;
}

Tensor FromDLPack(DLManagedTensor* managed) {
  if (managed == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, "FromDLPack: the DLManagedTensor pointer is null");
  }
  const DLTensor& dl = managed->dl_tensor;
  if (dl.ndim < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("FromDLPack: ndim is ", dl.ndim, "; it must be >= 0"));
  }
  if (dl.ndim > 0 && dl.shape == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("FromDLPack: ndim is ", dl.ndim, " but shape is null"));
  }
  const DType dtype = FromDLDataType(dl.dtype);
  const Device device = FromDLDevice(dl.device);
  std::vector<int64_t> shape(dl.shape, dl.shape + dl.ndim);
  std::optional<std::vector<int64_t>> strides;
  if (dl.strides != nullptr) strides.emplace(dl.strides, dl.strides + dl.ndim);

  // The storage spans exactly the elements the view reaches. FromStorage validates extents and
  // strides against it; until it succeeded the deleter is disarmed, so that on any error the
  // caller keeps ownership of `managed`.
  int64_t numel = 1;
  int64_t end = 1;  // last element reached, plus one
  bool bad = false;
  for (int i = 0; i < dl.ndim; ++i) {
    const int64_t n = shape[i];
    const int64_t s = strides ? (*strides)[i] : 0;
    if (n < 0 || s < 0) {
      bad = true;
      break;
    }
    if (__builtin_mul_overflow(numel, n, &numel)) bad = true;
    if (strides && n > 0) {
      int64_t span = 0;
      if (__builtin_mul_overflow(n - 1, s, &span) || __builtin_add_overflow(end, span, &end)) {
        bad = true;
      }
    }
  }
  size_t nbytes = 0;
  if (!bad && numel > 0) {
    const int64_t elems = strides ? end : numel;
    int64_t b = 0;
    if (__builtin_mul_overflow(elems, static_cast<int64_t>(DTypeSize(dtype)), &b)) bad = true;
    nbytes = static_cast<size_t>(b);
  }
  // When `bad`, nbytes stays 0 and FromStorage below reports the precise problem.
  if (nbytes != 0 && dl.data == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, "FromDLPack: data is null for a tensor with elements");
  }
  void* data = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(dl.data) + dl.byte_offset);
  auto armed = std::make_shared<bool>(false);
  Storage storage = Storage::FromExternal(device, data, nbytes, [managed, armed](void*) {
    if (*armed && managed->deleter != nullptr) managed->deleter(managed);
  });
  Tensor t =
      Tensor::FromStorage(std::move(storage), dtype, std::move(shape), std::move(strides), 0);
  *armed = true;
  return t;
}

}  // namespace forksafe::device
