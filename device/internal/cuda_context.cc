// device/internal/cuda_context.cc: the CUDA backend's driver errors, per-device setup (primary
// context, stream, allocation properties), stream synchronization that notices dead exporters,
// and the exit drain (device/internal/cuda_state.h).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "forksafe/device/internal/cuda_driver.h"
#include "forksafe/device/internal/cuda_state.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/process_liveness.h"
#include "forksafe/runtime/internal/random.h"

namespace forksafe::device::internal {

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)

using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::MutexLock;

void ThrowCu(const CudaDriver& d, CUresult r, const std::string& what, const std::string& advice) {
  ErrorCode code = ErrorCode::kInternal;
  std::string hint = advice;
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    code = ErrorCode::kResourceExhausted;
    if (hint.empty()) hint = "free tensors or call EmptyCache, or use a smaller batch";
  } else if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_HANDLE) {
    code = ErrorCode::kInvalidArgument;
  } else if (r == CUDA_ERROR_NOT_SUPPORTED) {
    code = ErrorCode::kUnavailable;
  }
  if (hint.empty()) hint = "this is a driver failure; check the GPU with nvidia-smi";
  throw Error(code, absl::StrCat(what, " failed: ", CuResultText(d, r), "; ", hint));
}

// Per-device setup on first use; the caller holds st.mu.
void EnsureDeviceLocked(CudaContext& c, DeviceState& st) {
  if (st.ready) return;
  const CudaDriver* d = c.d;
  const auto before = OpenDescriptors();
  FS_CU(d->cuDeviceGet(&st.dev, st.index), absl::StrCat("cuDeviceGet(", st.index, ")"));
  FS_CU(d->cuDevicePrimaryCtxRetain(&st.ctx, st.dev),
        absl::StrCat("cuDevicePrimaryCtxRetain(cuda:", st.index, ")"));
  FS_CU(d->cuCtxSetCurrent(st.ctx), "cuCtxSetCurrent");
  int vmm = 0, posix_fd = 0;
  d->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, st.dev);
  d->cuDeviceGetAttribute(&posix_fd,
                          CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, st.dev);
  if (!vmm || !posix_fd) {
    throw Error(ErrorCode::kUnavailable,
                absl::StrCat("cuda:", st.index, " does not support ",
                             !vmm ? "virtual memory management (cuMemCreate)"
                                  : "POSIX file descriptor handles for cuMemCreate",
                             ", which forksafe's CUDA allocator needs; use a newer GPU or driver"));
  }
  st.prop = CUmemAllocationProp{};
  st.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  st.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  st.prop.location.id = st.dev;
  st.prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  FS_CU(
      d->cuMemGetAllocationGranularity(&st.granularity, &st.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      "cuMemGetAllocationGranularity");
  if (st.granularity == 0) st.granularity = kSmallSegment;
  FS_CU(d->cuStreamCreate(&st.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  st.pool_id = runtime::internal::RandomId();
  st.ready = true;
  const auto after = OpenDescriptors();
  MutexLock lk(&c.fds_mu);
  for (const auto& [fd, target] : after) {
    if (before.count(fd) == 0) c.driver_fds.insert(fd);
  }
}

// The device's state, set up and its context current on this thread. Caller must not hold st.mu.
DeviceState& Dev(CudaContext& c, int index) {
  if (index < 0 || index >= static_cast<int>(c.devices.size())) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("cuda:", index, " is not visible to the CUDA driver in this process (",
                             c.devices.size(),
                             " device(s)); NVML and the driver disagree: check "
                             "CUDA_VISIBLE_DEVICES and MIG settings"));
  }
  DeviceState& st = *c.devices[static_cast<size_t>(index)];
  {
    MutexLock lk(&st.mu);
    EnsureDeviceLocked(c, st);
  }
  const CUresult r = c.d->cuCtxSetCurrent(st.ctx);
  if (r != CUDA_SUCCESS) ThrowCu(*c.d, r, "cuCtxSetCurrent");
  return st;
}

// Waits for the device's stream. With IPC waits queued, polls, and fails (kProcessFailed) when
// an awaited event is still incomplete and its exporter has exited: that stream would wait
// forever, so the device gets a fresh one.
void SyncStream(CudaContext& c, DeviceState& st, const char* what) {
  const CudaDriver* d = c.d;
  CUstream stream;
  std::vector<PendingWait> waits;
  std::string failure;
  uint64_t last_ticket = 0;
  {
    MutexLock lk(&st.mu);
    stream = st.stream;
    waits = st.waits;
    failure.swap(st.failure);
    last_ticket = st.next_ticket;
  }
  if (!failure.empty()) throw Error(ErrorCode::kProcessFailed, absl::StrCat(what, ": ", failure));
  if (waits.empty()) {
    FS_CU(d->cuStreamSynchronize(stream),
          absl::StrCat(what, ": cuStreamSynchronize(cuda:", st.index, ")"));
    return;
  }
  // Polled: a blocking synchronize could never return if an awaited exporter died. The first
  // 100 us yield instead of sleeping: work just queued behind an IPC wait is usually done by
  // then, and a 20 us sleep costs 60-80 us on a VM.
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    const CUresult r = d->cuStreamQuery(stream);
    if (r == CUDA_SUCCESS) break;
    if (r != CUDA_ERROR_NOT_READY) {
      ThrowCu(*d, r, absl::StrCat(what, ": cuStreamQuery(cuda:", st.index, ")"));
    }
    for (const auto& w : waits) {
      // The event first: one driver call, where a liveness check reads /proc.
      if (d->cuEventQuery(w.event) == CUDA_SUCCESS) continue;
      if (runtime::internal::ProcessAlive(w.exporter)) continue;
      {
        MutexLock lk(&st.mu);
        // Forgotten meanwhile on this same stream (another thread saw the stream idle, so it
        // passed this wait; the event may even be destroyed by now): not a failure.
        if (st.stream == stream &&
            std::none_of(st.waits.begin(), st.waits.end(),
                         [&](const PendingWait& x) { return x.ticket == w.ticket; })) {
          continue;
        }
        if (st.stream == stream) {
          // The old stream is abandoned (destroying it could block); later work uses a new one.
          CUstream fresh = nullptr;
          if (d->cuStreamCreate(&fresh, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) st.stream = fresh;
          st.waits.clear();
        }
      }
      throw Error(ErrorCode::kProcessFailed,
                  absl::StrCat(what, " on cuda:", st.index, ": process ", w.exporter,
                               " exited before the event this device waits for (WaitIpcEvent) "
                               "completed; the data it was writing may be incomplete. Work queued "
                               "on cuda:",
                               st.index, " since that wait was dropped"));
    }
    if (std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
  MutexLock lk(&st.mu);
  if (st.stream == stream) {
    st.waits.erase(std::remove_if(st.waits.begin(), st.waits.end(),
                                  [&](const PendingWait& w) { return w.ticket < last_ticket; }),
                   st.waits.end());
  }
}

// Work queued on memory about to be unmapped must finish first: synchronizes the stream before
// the caller destroys `victims` (of TakeIdleVictims); if that throws, they go back to idle.
void SyncBeforeUnmap(CudaContext& c, DeviceState& st, const char* what,
                     const std::vector<Imported*>& victims) {
  try {
    SyncStream(c, st, what);
  } catch (...) {
    MutexLock lk(&st.mu);
    ReturnIdleVictims(st, victims);
    throw;
  }
}

// Synchronizes every stream this process used, then marks the exit page (see CudaContext).
void DrainAndMark(CudaContext* c) {
  if (c == nullptr || c->owner != getpid()) return;
  for (auto& st : c->devices) {
    if (!st->ready) continue;
    try {
      SyncStream(*c, *st, "finishing queued work");
    } catch (...) {
      return;  // some work failed: the exit page keeps saying "not known to be complete"
    }
  }
  if (c->exit_word != nullptr) __atomic_store_n(c->exit_word, 1u, __ATOMIC_RELEASE);
}

#endif  // FORKSAFE_HAVE_CUDA_HEADERS

}  // namespace forksafe::device::internal
