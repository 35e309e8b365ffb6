// tests/fuzz/tensor_handle_fuzz.cc: the handle of a tensor shared across processes
// (mp/sharing.h TensorHandle, mp/internal/shared_arena.h SharedBlock::Handle), as another process
// encodes it: dtype, shape, strides, offset, and the block (segment kind, descriptor or name,
// segment id, offset, size); for an accelerator tensor also the device section (device, handle
// kind, segment descriptor, id, size, range, the event's descriptor and slot).
// Input: [segment size u64][the handle's codec bytes]. The message carries two descriptor slots
// (/dev/null, empty). The target decodes the handle, checks it (CheckTensorHandle), places the
// block in a segment of the given size (CheckBlockPlacement) and builds the view over a storage of
// the block's size (Tensor::FromStorage), as ImportTensor does, without mapping anything.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "forksafe/device/storage.h"
#include "forksafe/device/tensor.h"
#include "forksafe/mp/codec.h"
#include "forksafe/mp/internal/shared_arena.h"
#include "forksafe/mp/sharing.h"
#include "tests/fuzz/fuzz_target.h"

namespace forksafe::fuzz {
namespace {

using runtime::Error;
using runtime::ErrorCode;
namespace in = mp::internal;

std::string List(const std::vector<int64_t>& v) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < v.size(); ++i) o << (i ? "," : "") << v[i];
  o << ']';
  return o.str();
}

std::string Run(std::string_view input) {
  if (input.size() < 8) return "short";
  uint64_t segment_size;
  std::memcpy(&segment_size, input.data(), 8);
  mp::Message msg = MessageWithSlots(std::string(input.substr(8)), {true, false});
  try {
    in::TensorHandle h = mp::DecodeAs<in::TensorHandle>(msg);
    in::CheckTensorHandle(h);
    in::CheckBlockPlacement(h.block.offset, h.block.size, segment_size);
    // The view must fit in the block; nothing reads the storage's bytes.
    static char byte;
    const uint64_t bytes = h.on_device ? h.device.size : h.block.size;
    device::Storage storage = device::Storage::FromExternal(
        device::kCPU, &byte, static_cast<size_t>(bytes), [](void*) {});
    const device::Tensor t = device::Tensor::FromStorage(
        storage, static_cast<device::DType>(h.dtype), h.shape, h.strides, h.offset);
    std::ostringstream o;
    o << device::DTypeName(t.dtype()) << " " << List(t.shape()) << " strides " << List(t.strides())
      << " offset " << t.storage_offset() << " block "
      << (h.block.kind == in::SegmentKind::kMemfd ? "memfd" : h.block.name) << " "
      << h.block.segment_id << "@" << h.block.offset << "+" << h.block.size;
    if (h.on_device) {
      o << " device "
        << device::DeviceTypeName(static_cast<device::DeviceType>(h.device.device_type)) << ":"
        << h.device.device_index << (h.device.kind == 0 ? " segment " : " legacy ")
        << h.device.segment_id << "@" << h.device.offset << "+" << h.device.size << " of "
        << h.device.segment_size << (h.device.event_complete ? " complete" : " event slot ")
        << (h.device.event_complete ? std::string() : std::to_string(h.device.event_slot));
    }
    return o.str();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument) __builtin_trap();
    return ErrorText(e);
  }
}

// A handle's bytes, as ExportTensor's message would carry them (descriptor slot 0).
std::string Input(uint64_t segment_size, uint8_t dtype, std::vector<int64_t> shape,
                  std::vector<int64_t> strides, int64_t offset, in::SegmentKind kind,
                  const std::string& name, uint64_t id, uint64_t block_offset,
                  uint64_t block_size) {
  in::TensorHandle h;
  h.dtype = dtype;
  h.shape = std::move(shape);
  h.strides = std::move(strides);
  h.offset = offset;
  h.block.kind = kind;
  if (kind == in::SegmentKind::kMemfd) h.block.fd = DevNull();
  h.block.name = name;
  h.block.segment_id = id;
  h.block.offset = block_offset;
  h.block.size = block_size;
  mp::Message m = MessageWithSlots("", {true, false});
  m.fds.clear();
  mp::EncodeInto(m, h);
  std::string s(8, '\0');
  std::memcpy(s.data(), &segment_size, 8);
  return s + m.bytes;
}

// An accelerator tensor's handle: a 64-byte holder block plus the device section.
std::string DeviceInput(uint8_t device_type, int32_t index, uint8_t kind, uint64_t seg_size,
                        uint64_t offset, uint64_t size) {
  in::TensorHandle h;
  h.dtype = 0;
  h.shape = {static_cast<int64_t>(size / 4)};
  h.strides = {1};
  h.block.kind = in::SegmentKind::kMemfd;
  h.block.fd = DevNull();
  h.block.segment_id = 9;
  h.block.offset = 4160;
  h.block.size = 64;
  h.on_device = true;
  h.device.device_type = device_type;
  h.device.device_index = index;
  h.device.kind = kind;
  h.device.memory_fd = DevNull();
  h.device.segment_id = 77;
  h.device.segment_size = seg_size;
  h.device.offset = offset;
  h.device.size = size;
  h.device.exporter = 1234;
  h.device.event_complete = false;
  h.device.event_fd = DevNull();
  h.device.event_slot = 5;
  h.device.event_sequence = 2;
  mp::Message m = MessageWithSlots("", {true, false});
  m.fds.clear();
  mp::EncodeInto(m, h);
  std::string s(8, '\0');
  const uint64_t segment_size = 1 << 22;
  std::memcpy(s.data(), &segment_size, 8);
  return s + m.bytes;
}

}  // namespace

std::string Describe(std::string_view input) { return Run(input); }

std::vector<Seed> Seeds() {
  using in::SegmentKind;
  return {
      {"memfd_matrix", Input(1 << 22, 0, {2, 3}, {3, 1}, 0, SegmentKind::kMemfd, "", 7, 4160, 24),
       "float32 [2,3] strides [3,1] offset 0 block memfd 7@4160+24"},
      {"named_view",
       Input(1 << 22, 3, {4}, {2}, 1, SegmentKind::kNamed, "/forksafe_12_3", 3, 8256, 64),
       "int64 [4] strides [2] offset 1 block /forksafe_12_3 3@8256+64"},
      {"scalar_bool", Input(8192, 5, {}, {}, 0, SegmentKind::kMemfd, "", 1, 4160, 1),
       "bool [] strides [] offset 0 block memfd 1@4160+1"},
      {"empty_half", Input(8192, 6, {0, 5}, {5, 1}, 0, SegmentKind::kMemfd, "", 2, 4160, 0),
       "float16 [0,5] strides [5,1] offset 0 block memfd 2@4160+0"},
      {"view_too_big", Input(1 << 22, 0, {2, 3}, {3, 1}, 1, SegmentKind::kMemfd, "", 7, 4160, 24),
       "error: invalid_argument"},
      {"sim_device", DeviceInput(1, 0, 0, 2 << 20, 4096, 1024),
       "float32 [256] strides [1] offset 0 block memfd 9@4160+64 device sim:0 segment 77@4096+1024 "
       "of 2097152 event slot 5"},
      {"cpu_device_section", DeviceInput(0, 0, 0, 2 << 20, 0, 64), "error: invalid_argument"},
  };
}

}  // namespace forksafe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)forksafe::fuzz::Run(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
