// device/internal/cuda_ipc_events.cc: the CUDA backend's interprocess events (IpcBackend of
// device/cuda_backend.h): a recycled pool of CU_EVENT_INTERPROCESS events per device, recorded
// on its stream, and waits on other processes' events that notice exporters that exited.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "forksafe/device/cuda_backend.h"
#include "forksafe/device/internal/cuda_driver.h"
#include "forksafe/device/internal/cuda_state.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/process_liveness.h"

namespace forksafe::device {

#if defined(FORKSAFE_HAVE_CUDA_HEADERS)

using internal::Block;
using internal::CudaDriver;
using internal::DeviceState;
using internal::DevPtr;
using internal::HostPtr;
using internal::P;
using internal::Segment;
using internal::ThrowCu;
using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::MutexLock;

namespace {

// Whether `fd` is an exporter's exit page (see CudaContext) saying that it exited normally with
// all its work done. Anything else (no page, another file, a crash) says no.
bool ExitedAfterFinishingItsWork(int fd) {
  if (fd < 0) return false;
  char target[128];
  const ssize_t n = readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), target, sizeof target - 1);
  if (n <= 0 ||
      std::string(target, static_cast<size_t>(n)).rfind("/memfd:forksafe_cudaexit", 0) != 0) {
    return false;
  }
  uint32_t word = 0;
  return pread(fd, &word, sizeof word, 0) == static_cast<ssize_t>(sizeof word) && word == 1;
}

}  // namespace

IpcEventHandle CudaBackend::RecordIpcEvent(int index) {
  Enter(index, "RecordIpcEvent");
  const CudaDriver* d = ctx_->d;
  DeviceState& st = Dev(*ctx_, index);
  IpcEventHandle h;
  h.exporter = getpid();
  CUstream stream = nullptr;
  {
    MutexLock lk(&st.mu);
    stream = st.stream;
    // Everything queued so far has finished (the usual case after a synchronous copy): nothing
    // to wait for, and no event a receiver would have to open while this process still lives.
    // That includes the IPC waits queued on the stream: they are done, so they are forgotten
    // (kept, they would make every later send record an event, and the list would only grow).
    if (st.failure.empty() && d->cuStreamQuery(stream) == CUDA_SUCCESS) {
      st.waits.clear();
      h.complete = true;
      return h;
    }
    size_t slot = static_cast<size_t>(st.next_slot % kIpcEventPoolCapacity);
    bool have = slot < st.pool.size();
    if (!have && slot == st.pool.size()) {
      CUevent ev = nullptr;
      CUipcEventHandle eh{};
      if (d->cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS) {
        if (d->cuIpcGetEventHandle(&eh, ev) == CUDA_SUCCESS) {
          st.pool.push_back(ev);
          st.pool_handles.push_back(eh);
          have = true;
        } else {
          d->cuEventDestroy(ev);
        }
      }
    }
    if (!have && !st.pool.empty()) {  // the pool could not grow: reuse what it has
      slot = static_cast<size_t>(st.next_slot % st.pool.size());
      have = true;
    }
    if (have) {
      const CUresult r = d->cuEventRecord(st.pool[slot], stream);
      if (r != CUDA_SUCCESS) ThrowCu(*d, r, absl::StrCat("RecordIpcEvent on cuda:", index));
      ++st.next_slot;
      h.complete = false;
      h.fd = ctx_->exit_fd;  // borrowed: read by receivers if this process is gone
      h.pool_id = st.pool_id;
      h.slot = static_cast<uint32_t>(slot);
      h.sequence = ++st.sequence;
      static_assert(sizeof(CUipcEventHandle) == 64, "CUipcEventHandle is 64 bytes");
      std::memcpy(h.opaque.data(), st.pool_handles[slot].reserved, 64);
      return h;
    }
  }
  // No event at all: the work is done when the stream is.
  SyncStream(*ctx_, st, "RecordIpcEvent");
  h.complete = true;
  return h;
}

void CudaBackend::WaitIpcEvent(int index, const IpcEventHandle& event) {
  Enter(index, "WaitIpcEvent");
  if (event.complete) return;
  const CudaDriver* d = ctx_->d;
  DeviceState& st = Dev(*ctx_, index);
  MutexLock lk(&st.mu);
  CUevent ev = nullptr;
  if (event.exporter == getpid() && event.pool_id == st.pool_id) {
    if (event.slot >= st.pool.size()) {
      throw Error(ErrorCode::kInvalidArgument, "WaitIpcEvent: no such slot in this process's pool");
    }
    ev = st.pool[event.slot];
  } else {
    const auto key = std::make_pair(event.exporter, std::make_pair(event.pool_id, event.slot));
    auto it = st.opened.find(key);
    if (it != st.opened.end()) {
      ev = it->second.event;
    } else {
      if (st.opened.size() >= 1024) {  // forget events of exporters that have exited
        // One liveness check per exporter (each reads /proc), not one per event.
        std::unordered_map<pid_t, bool> alive;
        auto exporter_alive = [&alive](pid_t pid) {
          auto [at, fresh] = alive.try_emplace(pid, false);
          if (fresh) at->second = runtime::internal::ProcessAlive(pid);
          return at->second;
        };
        for (auto o = st.opened.begin(); o != st.opened.end();) {
          const bool awaited = std::any_of(st.waits.begin(), st.waits.end(), [&](const auto& w) {
            return w.event == o->second.event;
          });
          if (!awaited && !exporter_alive(o->second.exporter)) {
            d->cuEventDestroy(o->second.event);
            o = st.opened.erase(o);
          } else {
            ++o;
          }
        }
      }
      CUipcEventHandle eh{};
      std::memcpy(eh.reserved, event.opaque.data(), 64);
      const CUresult r = d->cuIpcOpenEventHandle(&ev, eh);
      if (r != CUDA_SUCCESS) {
        if (!runtime::internal::ProcessAlive(event.exporter) &&
            ExitedAfterFinishingItsWork(event.fd))
          return;
        if (!runtime::internal::ProcessAlive(event.exporter)) {
          // Its work may or may not have finished: say so at the next Synchronize.
          st.failure =
              absl::StrCat("process ", event.exporter,
                           " exited before its IPC event could be opened here "
                           "(cuIpcOpenEventHandle: ",
                           internal::CuResultText(*d, r), "); the data it wrote may be incomplete");
          return;
        }
        ThrowCu(*d, r, "WaitIpcEvent: cuIpcOpenEventHandle",
                "the handle must come from RecordIpcEvent of a CUDA backend");
      }
      st.opened[key] = internal::OpenedEvent{ev, event.exporter};
    }
  }
  // Waits queued earlier that the stream has passed are done: forget them (bounded list).
  if (!st.waits.empty() && d->cuStreamQuery(st.stream) == CUDA_SUCCESS) st.waits.clear();
  const CUresult r = d->cuStreamWaitEvent(st.stream, ev, 0);
  if (r != CUDA_SUCCESS) ThrowCu(*d, r, absl::StrCat("WaitIpcEvent on cuda:", index));
  if (event.exporter != getpid()) {
    st.waits.push_back(internal::PendingWait{ev, event.exporter, st.next_ticket++});
  }
}

#endif  // FORKSAFE_HAVE_CUDA_HEADERS

}  // namespace forksafe::device
