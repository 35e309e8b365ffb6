// device/registry.h: the backends of this process, the default device and the current device.
//
// What it offers
//   One registry per process, holding a backend per DeviceType. It knows backends only through
//   the Backend interface: each backend registers itself (FORKSAFE_REGISTER_BACKEND in its own
//   .cc: cpu_backend.cc, sim_backend.cc, cuda_backend.cc, as c10's backends do), and the registry
//   makes every registered backend when it is first used, in DeviceType order (cpu, sim, cuda),
//   whatever the order of registration. A backend registered after that first use is made at
//   once. RegisterBackend() adds an already-made backend for a type no one registered. The
//   registry keeps a process-wide default device and a per-thread current device (DeviceGuard
//   sets it for a scope), and forwards memory operations to the right backend.
//
// Fork behaviour (the registry registers one at-fork handler on first use)
//   In a forked child: the default device becomes CPU (as MindSpore does), the forking thread's
//   current device is cleared (so it follows the default), and every backend that was initialized
//   in the parent and cannot survive fork is poisoned (see backend.h).
//
// Guarantees
//   - DeviceCount(), HasBackend() and Properties() never initialize a backend; safe in a child.
//   - Thread-safe; lookups are lock-free. Registration takes a small lock (never held while a
//     backend runs an operation).
//   - The CUDA backend is registered in every build: without headers, driver or GPU it has no
//     devices (and says why).
//
// Hazards
//   - Self-registration runs from static initializers (FORKSAFE_REGISTER_BACKEND), so each
//     backend's library must be linked whole: //device:cpu_backend, :sim_backend and
//     :cuda_backend are `alwayslink` (device/BUILD.bazel), and //device depends on all three. A
//     target that links a backend's object some other way (a static archive without
//     --whole-archive) silently loses that backend: HasBackend() says false for its type.
//   - A backend factory runs under the registration lock, on the first thread that uses the
//     registry: it must not call into the registry (construct only; initialize on first use).
//   - A fork while another thread registers a backend leaves the registration lock held in the
//     child; registering there would then block. Registration happens at load time in practice.
#ifndef FORKSAFE_DEVICE_REGISTRY_H_
#define FORKSAFE_DEVICE_REGISTRY_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "forksafe/device/backend.h"
#include "forksafe/device/device.h"

namespace forksafe::device {

/// Adds a backend for its type(). Throws kAlreadyExists when one is registered for that type.
void RegisterBackend(std::unique_ptr<Backend> backend);

/// Makes a backend; registered with RegisterBackendFactory.
using BackendFactory = std::unique_ptr<Backend> (*)();

/// Registers the factory of the backend for `type` (normally through FORKSAFE_REGISTER_BACKEND,
/// at load time). The registry calls it when it is first used, or at once if that has happened.
/// Returns false (and reports on stderr) when `type` has a factory already, or is out of range;
/// never throws (it runs from static initializers).
bool RegisterBackendFactory(DeviceType type, BackendFactory factory) noexcept;

/// Registers `Class` (default-constructible, derived from Backend) as the backend for `type`.
/// Use once, at namespace scope, in the backend's own .cc; its library must be `alwayslink`.
#define FORKSAFE_REGISTER_BACKEND(type, Class)                             \
  [[maybe_unused]] static const bool forksafe_backend_registered_##Class = \
      ::forksafe::device::RegisterBackendFactory(                          \
          (type), []() -> std::unique_ptr<::forksafe::device::Backend> {   \
            return std::make_unique<Class>();                              \
          })

/// True when a backend is registered for `type`.
bool HasBackend(DeviceType type);

/// The backend for `type`. Throws kUnavailable (naming what is available) when there is none.
Backend& GetBackend(DeviceType type);

/// Number of devices of `type`; 0 when no backend is registered. Never initializes.
int DeviceCount(DeviceType type);

/// Every device of every registered backend, CPU first. Never initializes.
std::vector<Device> AvailableDevices();

/// Throws kInvalidArgument/kUnavailable unless `device` names an existing device.
void CheckDevice(const Device& device);

/// The process default device (CPU unless set; CPU again in every forked child).
Device DefaultDevice();
/// Sets the default device after CheckDevice(). Does not initialize the backend.
void SetDefaultDevice(const Device& device);

/// This rank's device of `type` under a launcher (runtime/launch_info.h): index
/// LOCAL_RANK modulo DeviceCount(type), so the ranks of one node spread over its devices and a
/// rank whose launcher narrowed CUDA_VISIBLE_DEVICES to one device gets that one (the backend
/// counts only the visible devices). Index 0 without a launcher; the CPU for kCPU. Never
/// initializes a backend and does not change the default device (a forked child's default is
/// the CPU whatever its rank). Throws kUnavailable (naming the type) when there is no device of
/// `type`, and kInvalidArgument for malformed launcher variables.
Device RankDevice(DeviceType type);

/// The calling thread's current device: the one set by SetCurrentDevice/DeviceGuard, else the
/// default device.
Device CurrentDevice();
/// Sets the calling thread's current device (after CheckDevice); nullopt clears it.
void SetCurrentDevice(std::optional<Device> device);

/// Makes `device` the calling thread's current device for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(const Device& device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  std::optional<Device> previous_;
};

/// Allocates `bytes` on `device` through its backend.
void* Allocate(const Device& device, size_t bytes);
/// Frees memory allocated on `device`.
void Free(const Device& device, void* ptr);
/// Copies between any two devices; non-CPU to another non-CPU type is staged through the host.
void Copy(void* dst, const Device& dst_device, const void* src, const Device& src_device,
          size_t bytes);
/// Waits for all queued work on `device`.
void Synchronize(const Device& device);
/// Backend::FinishQueuedWork() of every backend: waits for the work this process queued on any
/// device it used, never initializing anything; errors stay for the next operation. mp/ children
/// call it before they exit.
void FinishQueuedWork();

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_REGISTRY_H_
