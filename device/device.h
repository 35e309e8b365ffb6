// device/device.h: naming a device.
//
// What it offers
//   `Device` is a value: a backend type plus an index ("cpu", "sim:1", "cuda:0"). ParseDevice and
//   ToString convert to and from that text form.
//
// Guarantees
//   Plain value type: trivially copyable, thread-safe, safe across fork.
#ifndef FORKSAFE_DEVICE_DEVICE_H_
#define FORKSAFE_DEVICE_DEVICE_H_

#include <cstdint>
#include <string>

namespace forksafe::device {

/// The kinds of backend forksafe knows.
enum class DeviceType : uint8_t {
  kCPU = 0,  ///< Host memory; always available; fork-safe.
  kSimAccel =
      1,      ///< The simulated accelerator: behaves like a GPU across fork (see sim_backend.h).
  kCUDA = 2,  ///< NVIDIA GPUs through the CUDA driver.
};

/// Number of DeviceType values.
inline constexpr int kNumDeviceTypes = 3;

/// "cpu", "sim" or "cuda".
const char* DeviceTypeName(DeviceType type);

/// A device: a backend type and an index within it (always 0 for the CPU).
struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  constexpr Device() = default;
  constexpr Device(DeviceType t, int i) : type(t), index(i) {}

  bool is_cpu() const { return type == DeviceType::kCPU; }
  /// "cpu", "sim:0", "cuda:1".
  std::string ToString() const;

  friend bool operator==(const Device& a, const Device& b) {
    return a.type == b.type && a.index == b.index;
  }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
};

/// The CPU device.
inline constexpr Device kCPU{DeviceType::kCPU, 0};

/// Parses "cpu", "sim", "sim:1", "cuda:0" (an omitted index means 0). Throws kInvalidArgument
/// with the accepted forms for anything else. Does not check that the device exists.
Device ParseDevice(const std::string& text);

}  // namespace forksafe::device

#endif  // FORKSAFE_DEVICE_DEVICE_H_
