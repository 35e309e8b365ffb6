#include "forksafe/device/device.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"

namespace forksafe::device {

const char* DeviceTypeName(DeviceType type) {
  switch (type) {
    case DeviceType::kCPU: return "cpu";
    case DeviceType::kSimAccel: return "sim";
    case DeviceType::kCUDA: return "cuda";
  }
  return "unknown";
}

std::string Device::ToString() const {
  if (type == DeviceType::kCPU) return "cpu";
  return absl::StrCat(DeviceTypeName(type), ":", index);
}

Device ParseDevice(const std::string& text) {
  auto fail = [&]() -> runtime::Error {
    return runtime::Error(runtime::ErrorCode::kInvalidArgument,
                          absl::StrCat("cannot parse device \"", text,
                                       "\"; expected \"cpu\", \"sim[:N]\" or \"cuda[:N]\" with "
                                       "N a non-negative integer"));
  };
  const size_t colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos) {
    const std::string num = text.substr(colon + 1);
    if (num.empty() || num.size() > 6 || num.find_first_not_of("0123456789") != std::string::npos) {
      throw fail();
    }
    index = std::atoi(num.c_str());
  }
  if (kind == "cpu") {
    if (index != 0) throw fail();
    return kCPU;
  }
  if (kind == "sim") return Device(DeviceType::kSimAccel, index);
  if (kind == "cuda") return Device(DeviceType::kCUDA, index);
  throw fail();
}

}  // namespace forksafe::device
