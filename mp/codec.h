// mp/codec.h: the one value codec of forksafe::mp, with out-of-band file descriptors.
//
// What it offers
//   Encode(values...) turns C++ values into a Message: bytes plus a list of file descriptors that
//   travel beside the bytes (SCM_RIGHTS), like pickle protocol 5's out-of-band buffers.
//   Decode(message, values...) does the reverse. Process arguments, Pipe and Queue messages all go
//   through it. The bytes are cereal's binary archive (Debian's libcereal-dev): every standard
//   type cereal supports works (arithmetic types, std::string, std::vector, std::map, std::tuple,
//   std::optional, ...), and so does any user type with a cereal `serialize` (or save/load)
//   member or free function. Types that own a file descriptor (Connection, Queue, Lock, shared
//   segments) serialize it out of band through FileDescriptor.
//
// Guarantees
//   - Decode never trusts the bytes: malformed or truncated input, a length field longer than
//     the bytes left, a bool that is not 0 or 1, or a descriptor index out of range, throws
//     Error(kInvalidArgument); it never reads out of bounds and allocates at most a small
//     multiple of the message's size (mp/internal/bounded_archive.h).
//   - Descriptors are dup()ed into the message on encode and owned by it; decode transfers
//     ownership to the decoded FileDescriptor objects; whatever is not claimed is closed with the
//     Message. Nothing leaks on any path.
//   - Thread safety: Encode/Decode are reentrant; a Message is a plain value.
#ifndef FORKSAFE_MP_CODEC_H_
#define FORKSAFE_MP_CODEC_H_

#include <cstdint>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cereal/archives/binary.hpp"
#include "cereal/cereal.hpp"
#include "cereal/types/map.hpp"
#include "cereal/types/optional.hpp"
#include "cereal/types/string.hpp"
#include "cereal/types/tuple.hpp"
#include "cereal/types/utility.hpp"
#include "cereal/types/vector.hpp"
#include "forksafe/mp/internal/bounded_archive.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {

/// An owned file descriptor (move-only); closed on destruction.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  /// Takes ownership of `fd` (-1 for none).
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() { reset(); }
  FileDescriptor(FileDescriptor&& o) noexcept : owned_(o.owned_), fd_(o.release()) {}
  FileDescriptor& operator=(FileDescriptor&& o) noexcept {
    if (this != &o) {
      const bool owned = o.owned_;
      reset(o.release());
      owned_ = owned;
    }
    return *this;
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;

  /// A new descriptor for the same open file (close-on-exec). Throws on failure.
  static FileDescriptor Dup(int fd);
  /// Refers to `fd` without owning it: never closed by this object. For encoding a descriptor
  /// that its owner keeps open (the codec duplicates it into the message).
  static FileDescriptor Borrow(int fd) {
    FileDescriptor f(fd);
    f.owned_ = false;
    return f;
  }

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  /// Gives up ownership and returns the descriptor.
  int release() { return std::exchange(fd_, -1); }
  /// Closes the current descriptor (if any) and takes `fd`.
  void reset(int fd = -1);

  /// cereal: the descriptor itself travels out of band; the bytes hold its index.
  template <class Archive>
  void save(Archive& ar) const;
  template <class Archive>
  void load(Archive& ar);
  /// Decodes a descriptor as a borrowed view of the message's own (no dup): valid only while the
  /// message being decoded lives. For decoders that usually discard it (tensor handles whose
  /// segment is already mapped); Dup() it to keep it.
  template <class Archive>
  static FileDescriptor LoadBorrowed(Archive& ar);
  /// True when this object closes its descriptor.
  bool owned() const { return owned_; }

 private:
  bool owned_ = true;
  int fd_ = -1;
};

/// Bytes plus out-of-band descriptors.
struct Message {
  std::string bytes;
  std::vector<FileDescriptor> fds;
};

namespace internal {

// The descriptor list of the message being encoded or decoded on this thread, so that
// FileDescriptor::save/load can reach it (set for the duration of Encode/Decode; nests).
struct CodecContext {
  std::vector<FileDescriptor>* fds = nullptr;
  // Files already in `fds`: by descriptor number for borrowed descriptors (their owner keeps them
  // open for the whole encode, so a number cannot be reused meanwhile; no system call), else by
  // (device, inode, access mode): a file referenced many times in one message (tensors carved
  // from one shared segment) travels as one descriptor. The access mode keeps the two ends of a
  // pipe, which share an inode, apart.
  std::vector<std::pair<int, int32_t>> seen_numbers;
  std::vector<std::pair<std::tuple<uint64_t, uint64_t, int>, int32_t>> seen;
};
/// Index of `fd`'s open file in the message being encoded, adding a duplicate if it is new.
int32_t AddDescriptor(CodecContext& ctx, int fd, bool borrowed);
CodecContext*& CurrentCodecContext();

class ScopedCodecContext {
 public:
  explicit ScopedCodecContext(std::vector<FileDescriptor>* fds) : previous_(CurrentCodecContext()) {
    ctx_.fds = fds;
    CurrentCodecContext() = &ctx_;
  }
  ~ScopedCodecContext() { CurrentCodecContext() = previous_; }
  ScopedCodecContext(const ScopedCodecContext&) = delete;
  ScopedCodecContext& operator=(const ScopedCodecContext&) = delete;

 private:
  CodecContext ctx_;
  CodecContext* previous_;
};

[[noreturn]] void ThrowMalformed(const char* what);
[[noreturn]] void ThrowOutsideCodec();

}  // namespace internal

/// Encodes `values` into `msg`, replacing its bytes and appending to its descriptors (those
/// already there keep their indices, so a message can carry another message's descriptors).
template <class... Ts>
void EncodeInto(Message& msg, const Ts&... values) {
  std::ostringstream os(std::ios::binary);
  {
    internal::ScopedCodecContext ctx(&msg.fds);
    cereal::BinaryOutputArchive ar(os);
    (ar(values), ...);
  }
  msg.bytes = std::move(os).str();
}

/// Encodes `values` into one Message.
template <class... Ts>
Message Encode(const Ts&... values) {
  Message msg;
  EncodeInto(msg, values...);
  return msg;
}

/// Decodes `values` (in the order they were encoded) from `msg`, taking the descriptors they
/// refer to. Throws Error(kInvalidArgument) on malformed input or leftover bytes.
template <class... Ts>
void Decode(Message& msg, Ts&... values) {
  size_t left = 0;
  try {
    internal::ScopedCodecContext ctx(&msg.fds);
    internal::BoundedInputArchive ar(msg.bytes);
    (ar(values), ...);
    left = ar.remaining();
  } catch (const cereal::Exception& e) {
    internal::ThrowMalformed(e.what());
  } catch (const std::length_error& e) {
    internal::ThrowMalformed(e.what());
  } catch (const std::bad_alloc&) {
    internal::ThrowMalformed("a length field asks for more memory than exists");
  }
  if (left != 0) internal::ThrowMalformed("trailing bytes");
}

/// Decodes one value of type T.
template <class T>
T DecodeAs(Message& msg) {
  T value{};
  Decode(msg, value);
  return value;
}

template <class Archive>
void FileDescriptor::save(Archive& ar) const {
  internal::CodecContext* ctx = internal::CurrentCodecContext();
  if (ctx == nullptr) internal::ThrowOutsideCodec();
  const int32_t index = fd_ >= 0 ? internal::AddDescriptor(*ctx, fd_, !owned_) : -1;
  ar(index);
}

template <class Archive>
void FileDescriptor::load(Archive& ar) {
  internal::CodecContext* ctx = internal::CurrentCodecContext();
  if (ctx == nullptr) internal::ThrowOutsideCodec();
  int32_t index = -1;
  ar(index);
  if (index == -1) {
    reset();
    return;
  }
  if (index < 0 || static_cast<size_t>(index) >= ctx->fds->size() || !(*ctx->fds)[index]) {
    internal::ThrowMalformed("file descriptor index out of range");
  }
  // Several values may refer to one descriptor of the message: each gets its own duplicate.
  reset(Dup((*ctx->fds)[index].get()).release());
}

template <class Archive>
FileDescriptor FileDescriptor::LoadBorrowed(Archive& ar) {
  internal::CodecContext* ctx = internal::CurrentCodecContext();
  if (ctx == nullptr) internal::ThrowOutsideCodec();
  int32_t index = -1;
  ar(index);
  if (index == -1) return FileDescriptor();
  if (index < 0 || static_cast<size_t>(index) >= ctx->fds->size() || !(*ctx->fds)[index]) {
    internal::ThrowMalformed("file descriptor index out of range");
  }
  return Borrow((*ctx->fds)[index].get());
}

}  // namespace forksafe::mp

// device::Tensor is a codec value wherever the codec is: a tensor put on a Queue, sent on a Pipe,
// passed to a Process or given to a Pool needs no header beyond the one that carries it. It
// crosses as a shared-memory handle (mp/sharing.h says how); the encoding itself is compiled in
// mp/sharing.cc (part of libforksafe.so and of @forksafe//:forksafe; a Bazel target that depends
// on single layers adds //mp:sharing, or the link fails naming forksafe::mp::internal::SaveTensor).
namespace forksafe::device {
class Tensor;
}  // namespace forksafe::device

namespace forksafe::mp::internal {
void SaveTensor(cereal::BinaryOutputArchive& ar, const device::Tensor& t);
void LoadTensor(BoundedInputArchive& ar, device::Tensor& t);
}  // namespace forksafe::mp::internal

namespace forksafe::device {
// cereal hooks (found by argument-dependent lookup).
template <class Archive>
void save(Archive& ar, const Tensor& t) {
  mp::internal::SaveTensor(ar, t);
}
template <class Archive>
void load(Archive& ar, Tensor& t) {
  mp::internal::LoadTensor(ar, t);
}
}  // namespace forksafe::device

#endif  // FORKSAFE_MP_CODEC_H_
