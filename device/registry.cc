#include "forksafe/device/registry.h"

#include <array>
#include <atomic>
#include <string>
#include <vector>

#include <cstdio>
#include <exception>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "forksafe/device/ipc.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/launch_info.h"
#include "forksafe/runtime/tbb_fork.h"

namespace forksafe::device {
namespace {

using runtime::Error;
using runtime::ErrorCode;

uint32_t Encode(const Device& d) {
  return (static_cast<uint32_t>(d.type) << 24) | static_cast<uint32_t>(d.index & 0xFFFFFF);
}
Device Decode(uint32_t v) { return Device(static_cast<DeviceType>(v >> 24), v & 0xFFFFFF); }

// The factories of self-registered backends (FORKSAFE_REGISTER_BACKEND), by DeviceType. Constant-
// initialized, so that registrations from static initializers may come in any order.
runtime::internal::Mutex g_factories_mu;
BackendFactory g_factories[kNumDeviceTypes] FORKSAFE_GUARDED_BY(g_factories_mu) = {};
bool g_registry_built FORKSAFE_GUARDED_BY(g_factories_mu) = false;

struct Registry {
  std::array<std::atomic<Backend*>, kNumDeviceTypes> backends{};
  std::atomic<uint32_t> default_device{Encode(kCPU)};

  Registry() {
    for (auto& b : backends) b.store(nullptr);
    {
      // Every registered backend, in DeviceType order (cpu, sim, cuda); later registrations make
      // theirs at once (RegisterBackendFactory).
      runtime::internal::MutexLock lk(&g_factories_mu);
      g_registry_built = true;
      for (int i = 0; i < kNumDeviceTypes; ++i) {
        if (g_factories[i] != nullptr) backends[i].store(g_factories[i]().release());
      }
    }
    runtime::AtForkHandler h;
    h.name = "device_registry";
    h.prepare = [this](const runtime::PrepareAttempt&) {
      ForEach([](Backend& b) { b.OnForkPrepare(); });
      return true;
    };
    h.parent = [this](bool) { ForEach([](Backend& b) { b.OnForkParent(); }); };
    h.child = [this](bool) { OnChild(); };
    runtime::AtForkRegistry::Get().Register(this, std::move(h));
  }

  template <typename Fn>
  void ForEach(Fn fn) {
    for (auto& slot : backends) {
      if (Backend* b = slot.load(std::memory_order_acquire)) fn(*b);
    }
  }

  void OnChild();
};

thread_local std::optional<Device> t_current;

Registry& Reg() {
  static auto* reg = new Registry();  // leaked: used from at-fork handlers
  return *reg;
}

// Made at load time, after oneTBB's handler: the registry's handler is then registered before
// the pools a program makes, so it prepares after they drained (handlers prepare in reverse
// order), when parking the simulated accelerator's idle device thread can make the fork quiet
// (runtime/at_fork.h, NoteThreadsParkedForFork), and before oneTBB's, which then sees it.
const bool g_registry_at_load = (runtime::InstallTbbForkHandler(), Reg(), true);

void Registry::OnChild() {
  // Written only when different: each page written after a fork costs a copy-on-write fault.
  if (default_device.load() != Encode(kCPU)) default_device.store(Encode(kCPU));
  if (t_current.has_value()) t_current.reset();  // the forking thread is the child's only thread
  ForEach([](Backend& b) { b.OnForkChild(); });
}

}  // namespace

void RegisterBackend(std::unique_ptr<Backend> backend) {
  if (!backend) throw Error(ErrorCode::kInvalidArgument, "RegisterBackend: null backend");
  auto& slot = Reg().backends[static_cast<int>(backend->type())];
  Backend* expected = nullptr;
  if (!slot.compare_exchange_strong(expected, backend.get())) {
    throw Error(ErrorCode::kAlreadyExists,
                absl::StrCat("a backend for device type \"", DeviceTypeName(backend->type()),
                             "\" is already registered (\"", expected->name(), "\")"));
  }
  backend.release();  // owned by the registry for the life of the process
}

bool RegisterBackendFactory(DeviceType type, BackendFactory factory) noexcept {
  const int i = static_cast<int>(type);
  if (factory == nullptr || i < 0 || i >= kNumDeviceTypes) {
    std::fprintf(stderr,
                 "forksafe: RegisterBackendFactory: no factory, or device type %d is out "
                 "of range; ignored\n",
                 i);
    return false;
  }
  bool built = false;
  {
    runtime::internal::MutexLock lk(&g_factories_mu);
    if (g_factories[i] != nullptr) {
      std::fprintf(stderr,
                   "forksafe: a second backend for device type \"%s\" registered itself; "
                   "the first one is kept\n",
                   DeviceTypeName(type));
      return false;
    }
    g_factories[i] = factory;
    built = g_registry_built;
  }
  if (!built) return true;  // made when the registry is first used
  try {
    RegisterBackend(factory());  // registered after the registry's first use: made now
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forksafe: registering the backend for device type \"%s\" failed: %s\n",
                 DeviceTypeName(type), e.what());
    return false;
  }
  return true;
}

bool HasBackend(DeviceType type) {
  const int i = static_cast<int>(type);
  return i >= 0 && i < kNumDeviceTypes && Reg().backends[i].load() != nullptr;
}

Backend& GetBackend(DeviceType type) {
  const int i = static_cast<int>(type);
  Backend* b = (i >= 0 && i < kNumDeviceTypes) ? Reg().backends[i].load() : nullptr;
  if (b == nullptr) {
    std::vector<std::string> names;
    Reg().ForEach([&](Backend& x) { names.push_back(x.name()); });
    throw Error(ErrorCode::kUnavailable,
                absl::StrCat("no \"", DeviceTypeName(type),
                             "\" backend is available in this build or on this machine; "
                             "available backends: ",
                             absl::StrJoin(names, ", ")));
  }
  return *b;
}

void FinishQueuedWork() {
  Reg().ForEach([](Backend& b) {
    try {
      b.FinishQueuedWork();
    } catch (...) {
      // Left for the next operation, as documented.
    }
  });
}

IpcBackend& GetIpcBackend(Device device) {
  CheckDevice(device);
  IpcBackend* ipc = GetBackend(device.type).ipc();
  if (ipc == nullptr) {
    throw Error(ErrorCode::kUnavailable,
                absl::StrCat("memory of ", device.ToString(),
                             " cannot be exported to other processes by its backend",
                             device.is_cpu() ? " (CPU tensors cross through shared memory: "
                                               "mp::share_memory_)"
                                             : ""));
  }
  return *ipc;
}

int DeviceCount(DeviceType type) { return HasBackend(type) ? GetBackend(type).DeviceCount() : 0; }

std::vector<Device> AvailableDevices() {
  std::vector<Device> out;
  Reg().ForEach([&](Backend& b) {
    const int n = b.DeviceCount();
    for (int i = 0; i < n; ++i) out.emplace_back(b.type(), i);
  });
  return out;
}

void CheckDevice(const Device& device) {
  Backend& b = GetBackend(device.type);
  const int n = b.DeviceCount();
  if (n == 0) {
    const std::string why = b.UnavailableReason();
    if (!why.empty()) {
      throw Error(ErrorCode::kUnavailable,
                  absl::StrCat("device ", device.ToString(), " is not available: ", why));
    }
  }
  if (device.index < 0 || device.index >= n) {
    throw Error(ErrorCode::kInvalidArgument,
                absl::StrCat("device ", device.ToString(), " does not exist: backend \"", b.name(),
                             "\" has ", n, " device(s)"));
  }
}

Device DefaultDevice() { return Decode(Reg().default_device.load()); }

void SetDefaultDevice(const Device& device) {
  CheckDevice(device);
  Reg().default_device.store(Encode(device));
}

Device RankDevice(DeviceType type) {
  if (type == DeviceType::kCPU) return kCPU;
  const int n = DeviceCount(type);
  if (n <= 0) {
    throw Error(ErrorCode::kUnavailable,
                absl::StrCat("RankDevice: this process has no ", DeviceTypeName(type),
                             " device (no backend, or none visible: check CUDA_VISIBLE_DEVICES)"));
  }
  return Device(type, runtime::GetLaunchInfo().local_rank % n);
}

Device CurrentDevice() { return t_current.has_value() ? *t_current : DefaultDevice(); }

void SetCurrentDevice(std::optional<Device> device) {
  if (device.has_value()) CheckDevice(*device);
  t_current = device;
}

DeviceGuard::DeviceGuard(const Device& device) : previous_(t_current) { SetCurrentDevice(device); }

DeviceGuard::~DeviceGuard() { t_current = previous_; }

void* Allocate(const Device& device, size_t bytes) {
  return GetBackend(device.type).Allocate(device.index, bytes);
}

void Free(const Device& device, void* ptr) { GetBackend(device.type).Free(device.index, ptr); }

void Copy(void* dst, const Device& dst_device, const void* src, const Device& src_device,
          size_t bytes) {
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    GetBackend(DeviceType::kCPU).Copy(dst, dst_device, src, src_device, bytes);
    return;
  }
  if (dst_device.is_cpu() || src_device.is_cpu() || dst_device.type == src_device.type) {
    const Device& accel = dst_device.is_cpu() ? src_device : dst_device;
    GetBackend(accel.type).Copy(dst, dst_device, src, src_device, bytes);
    return;
  }
  // Two different accelerator types: stage through host memory.
  Backend& cpu = GetBackend(DeviceType::kCPU);
  void* staging = cpu.Allocate(0, bytes == 0 ? 1 : bytes);
  try {
    GetBackend(src_device.type).Copy(staging, kCPU, src, src_device, bytes);
    GetBackend(dst_device.type).Copy(dst, dst_device, staging, kCPU, bytes);
  } catch (...) {
    cpu.Free(0, staging);
    throw;
  }
  cpu.Free(0, staging);
}

void Synchronize(const Device& device) { GetBackend(device.type).Synchronize(device.index); }

}  // namespace forksafe::device
