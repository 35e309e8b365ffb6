// device/internal/cuda_driver.h: NOT FOR USERS. The CUDA driver API, loaded at run time, and the
// device queries that never initialize CUDA in this process.
//
// What it offers
//   - CudaDriver: the table of driver functions the CUDA backend calls, resolved from
//     libcuda.so.1 (dlopen) through cuGetProcAddress with the ABI of CUDA 12.0, falling back to
//     dlsym of the versioned symbol. Nothing links libcuda: a binary starts on any machine.
//   - QueryCudaDevices: how many devices CUDA would show this process, and their names and
//     memory, WITHOUT calling cuInit here (so that a fork afterwards stays safe): from NVML
//     (libnvidia-ml.so.1, initialized and shut down again around the query), mapped through
//     CUDA_VISIBLE_DEVICES when it is a plain list of indices; otherwise (no NVML, MIG enabled,
//     UUIDs in CUDA_VISIBLE_DEVICES) from a short-lived forked child that calls cuInit and answers
//     over a pipe. The first query may therefore fork once and wait for that child, at most 30 s
//     (then it is killed and the answer is "no devices", with that reason).
//
// Guarantees
//   - Thread safety: LoadCudaDriver is called under the backend's initialization lock;
//     QueryCudaDevices may race with itself (both compute, one answer is kept) and takes no lock,
//     so a fork during a query cannot leave a lock held in the child.
//   - The answer of QueryCudaDevices is cached for the life of the process (and inherited by
//     forked children): later changes of CUDA_VISIBLE_DEVICES are not seen, as with CUDA itself.
//
// Hazard: NVML numbers devices in PCI bus order; CUDA numbers them fastest first unless
// CUDA_DEVICE_ORDER=PCI_BUS_ID. The count is the same; on a machine with different GPU models the
// names and memory sizes of Properties() may be in another order than CUDA's indices.
#ifndef FORKSAFE_DEVICE_INTERNAL_CUDA_DRIVER_H_
#define FORKSAFE_DEVICE_INTERNAL_CUDA_DRIVER_H_

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)
#include <cuda.h>
#include <cudaTypedefs.h>
#endif

namespace forksafe::device::internal {

/// What CUDA would show this process, found without initializing CUDA here.
struct CudaDeviceSummary {
  struct Entry {
    std::string name;
    size_t total_memory = 0;
  };
  std::vector<Entry> devices;  ///< Empty when there are none (see why).
  std::string why;             ///< Why there are none ("libcuda.so.1 not found (...)", ...).
  std::string source;          ///< "nvml", "probe" or "none": where the answer came from.
};

/// The cached answer (computed on the first call). Never throws, never calls cuInit here.
const CudaDeviceSummary& QueryCudaDevices();

/// Descriptor numbers open in this process now, with their targets (readlink of /proc/self/fd).
std::map<int, std::string> OpenDescriptors();

/// Descriptors that NVML opened during QueryCudaDevices and kept after nvmlShutdown, with their
/// targets as they were then (seen on driver 580: two eventfds and two pipes). They belong to
/// the driver library and stay for the life of the process; the CUDA backend reports them as
/// kept (runtime/internal/kept_resources.h). Empty when NVML was not used. Never blocks.
std::map<int, std::string> NvmlKeptDescriptors();

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)

// X(member, typedef version, exported symbol for the dlsym fallback)
#define FORKSAFE_CUDA_DRIVER_FUNCTIONS(X)                                    \
  X(cuGetErrorName, 6000, "cuGetErrorName")                                  \
  X(cuGetErrorString, 6000, "cuGetErrorString")                              \
  X(cuDriverGetVersion, 2020, "cuDriverGetVersion")                          \
  X(cuDeviceGet, 2000, "cuDeviceGet")                                        \
  X(cuDeviceGetCount, 2000, "cuDeviceGetCount")                              \
  X(cuDeviceGetName, 2000, "cuDeviceGetName")                                \
  X(cuDeviceTotalMem, 3020, "cuDeviceTotalMem_v2")                           \
  X(cuDeviceGetAttribute, 2000, "cuDeviceGetAttribute")                      \
  X(cuDevicePrimaryCtxRetain, 7000, "cuDevicePrimaryCtxRetain")              \
  X(cuCtxSetCurrent, 4000, "cuCtxSetCurrent")                                \
  X(cuStreamCreate, 2000, "cuStreamCreate")                                  \
  X(cuStreamSynchronize, 2000, "cuStreamSynchronize")                        \
  X(cuStreamQuery, 2000, "cuStreamQuery")                                    \
  X(cuStreamWaitEvent, 3020, "cuStreamWaitEvent")                            \
  X(cuMemGetAllocationGranularity, 10020, "cuMemGetAllocationGranularity")   \
  X(cuMemCreate, 10020, "cuMemCreate")                                       \
  X(cuMemRelease, 10020, "cuMemRelease")                                     \
  X(cuMemAddressReserve, 10020, "cuMemAddressReserve")                       \
  X(cuMemAddressFree, 10020, "cuMemAddressFree")                             \
  X(cuMemMap, 10020, "cuMemMap")                                             \
  X(cuMemUnmap, 10020, "cuMemUnmap")                                         \
  X(cuMemSetAccess, 10020, "cuMemSetAccess")                                 \
  X(cuMemExportToShareableHandle, 10020, "cuMemExportToShareableHandle")     \
  X(cuMemImportFromShareableHandle, 10020, "cuMemImportFromShareableHandle") \
  X(cuMemcpyHtoDAsync, 3020, "cuMemcpyHtoDAsync_v2")                         \
  X(cuMemcpyDtoHAsync, 3020, "cuMemcpyDtoHAsync_v2")                         \
  X(cuMemcpyDtoDAsync, 3020, "cuMemcpyDtoDAsync_v2")                         \
  X(cuMemcpyPeerAsync, 4000, "cuMemcpyPeerAsync")                            \
  X(cuMemsetD8Async, 3020, "cuMemsetD8Async")                                \
  X(cuMemGetInfo, 3020, "cuMemGetInfo_v2")                                   \
  X(cuMemGetAddressRange, 3020, "cuMemGetAddressRange_v2")                   \
  X(cuIpcGetMemHandle, 4010, "cuIpcGetMemHandle")                            \
  X(cuIpcOpenMemHandle, 11000, "cuIpcOpenMemHandle_v2")                      \
  X(cuIpcCloseMemHandle, 4010, "cuIpcCloseMemHandle")                        \
  X(cuEventCreate, 2000, "cuEventCreate")                                    \
  X(cuEventRecord, 2000, "cuEventRecord")                                    \
  X(cuEventQuery, 2000, "cuEventQuery")                                      \
  X(cuEventDestroy, 4000, "cuEventDestroy_v2")                               \
  X(cuIpcGetEventHandle, 4010, "cuIpcGetEventHandle")                        \
  X(cuIpcOpenEventHandle, 4010, "cuIpcOpenEventHandle")

/// The driver functions the backend uses, with the ABI of the typedef versions above.
struct CudaDriver {
  void* library = nullptr;  ///< dlopen handle of libcuda.so.1 (never closed).
  int driver_version = 0;   ///< cuDriverGetVersion, e.g. 12040.
  PFN_cuInit_v2000 cuInit = nullptr;
#define FORKSAFE_CUDA_MEMBER(name, version, symbol) PFN_##name##_v##version name = nullptr;
  FORKSAFE_CUDA_DRIVER_FUNCTIONS(FORKSAFE_CUDA_MEMBER)
#undef FORKSAFE_CUDA_MEMBER
};

/// Loads libcuda.so.1, calls cuInit(0) and resolves every function. Returns null and sets `*why`
/// ("libcuda.so.1 not found (...)", "cuInit failed: ...") on failure. The first success is kept
/// for the life of the process; call it only where initializing CUDA is intended.
const CudaDriver* LoadCudaDriver(std::string* why);

/// "CUDA_ERROR_OUT_OF_MEMORY (out of memory)" for `result`.
std::string CuResultText(const CudaDriver& driver, CUresult result);

#endif  // FORKSAFE_HAVE_CUDA_HEADERS

}  // namespace forksafe::device::internal

#endif  // FORKSAFE_DEVICE_INTERNAL_CUDA_DRIVER_H_
