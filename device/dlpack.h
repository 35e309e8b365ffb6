// device/dlpack.h: zero-copy exchange of tensors with other frameworks through DLPack 0.6.
//
// What it offers
//   ToDLPack() lends a Tensor to a DLPack consumer (PyTorch, JAX, CuPy, TVM, ...) and FromDLPack()
//   adopts a tensor a DLPack producer lends to forksafe. Neither copies the data: both sides see
//   the same memory, so a write through one is visible through the other.
//
//   Devices: kDLCPU <-> cpu; kDLCUDA <-> cuda:N (import needs a registered CUDA backend, else
//   kUnavailable); the simulated accelerator is exported as kDLExtDev with device_id = its index,
//   and kDLExtDev is imported as sim:device_id.
//   Dtypes: float32/float64 (kDLFloat 32/64), float16 (kDLFloat 16), bfloat16 (kDLBfloat 16),
//   int32/int64 (kDLInt 32/64), uint8 (kDLUInt 8), all with lanes = 1. bool is exchanged as type
//   code kDLBoolCode (6) with 8 bits, the code DLPack 0.8 later standardized: DLPack 0.6 has no
//   bool, so a consumer that only knows 0.6 will refuse it.
//
// Ownership
//   - ToDLPack: the returned DLManagedTensor holds a reference to the tensor's Storage (and owns
//     its shape and strides arrays). The consumer must call `managed->deleter(managed)` exactly
//     once when done; the storage stays alive until then (and for as long as forksafe tensors
//     still use it). data is the address of element (0, ..., 0) and byte_offset is 0, as PyTorch
//     does.
//   - FromDLPack: on success forksafe owns `managed`: the returned Tensor's Storage calls
//     `managed->deleter(managed)` exactly once, when the last tensor over it goes (views
//     included). If FromDLPack throws, it took nothing: the caller still owns `managed`.
//
// Guarantees
//   - Errors: kInvalidArgument for a null or malformed DLManagedTensor (negative ndim or extents,
//     negative strides, missing shape) and for dtypes outside the list above; kUnavailable for a
//     device type without a forksafe backend; kInvalidArgument for a device index that does not
//     exist.
//   - Thread safety: both functions are thread-safe. The deleter of an exported tensor may run on
//     any thread.
//
// Fork behaviour
//   As for Storage (device/storage.h): an exported or imported CPU tensor is readable in a forked
//   child; device memory of a poisoned backend is not, and releasing it in the child (calling the
//   deleter there) quietly forgets it instead of throwing.
#ifndef FORKSAFE_DEVICE_DLPACK_H_
#define FORKSAFE_DEVICE_DLPACK_H_

#include <dlpack/dlpack.h>

#include <cstdint>

#include "forksafe/device/device.h"
#include "forksafe/device/tensor.h"

namespace forksafe::device {

/// DLDataType code used for bool (DLPack 0.8's kDLBool; absent from 0.6).
inline constexpr uint8_t kDLBoolCode = 6;

/// Lends `tensor` to a DLPack consumer without copying. Call the result's deleter exactly once.
DLManagedTensor* ToDLPack(const Tensor& tensor);

/// Adopts `managed` without copying; see "Ownership" above. Throws as listed above.
Tensor FromDLPack(DLManagedTensor* managed);

/// The DLPack dtype of `dtype`.
DLDataType ToDLDataType(DType dtype);
/// The DType of a DLPack dtype. Throws kInvalidArgument for one forksafe does not support.
DType FromDLDataType(DLDataType dtype);
/// The DLPack device of `device`.
DLDevice ToDLDevice(const Device& device);
/// The forksafe device of a DLPack device. Throws kUnavailable for a device type without a
/// backend, kInvalidArgument for a device index that does not exist.
Device FromDLDevice(DLDevice device);

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_DLPACK_H_
