#include "forksafe/mp/codec.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace forksafe::mp {

FileDescriptor FileDescriptor::Dup(int fd) {
  const int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      throw runtime::Error(runtime::ErrorCode::kResourceExhausted,
                           "out of file descriptors while duplicating one for a message; close "
                           "unused connections or raise the limit (ulimit -n)");
    }
    runtime::ThrowSystemError("dup of file descriptor " + std::to_string(fd), err);
  }
  return FileDescriptor(copy);
}

void FileDescriptor::reset(int fd) {
  if (fd_ >= 0 && owned_) ::close(fd_);
  fd_ = fd;
  owned_ = true;
}

namespace internal {

CodecContext*& CurrentCodecContext() {
  thread_local CodecContext* ctx = nullptr;
  return ctx;
}

int32_t AddDescriptor(CodecContext& ctx, int fd, bool borrowed) {
  if (borrowed) {
    for (const auto& [n, i] : ctx.seen_numbers) {
      if (n == fd) return i;
    }
  }
  struct stat st;
  std::tuple<uint64_t, uint64_t, int> key{0, 0, 0};
  // Borrowed descriptors are deduplicated by number only (no system calls on the hot path of
  // tensors); others by the file they refer to.
  const int fl = borrowed ? -1 : fcntl(fd, F_GETFL);
  const bool known = !borrowed && fl >= 0 && fstat(fd, &st) == 0;
  if (known) {
    key = {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), fl & O_ACCMODE};
    for (const auto& [k, i] : ctx.seen) {
      if (k == key) {
        if (borrowed) ctx.seen_numbers.emplace_back(fd, i);
        return i;
      }
    }
  }
  // A borrowed descriptor is kept open by its owner until the message is sent: the message can
  // borrow it too (no dup, no close).
  ctx.fds->push_back(borrowed ? FileDescriptor::Borrow(fd) : FileDescriptor::Dup(fd));
  const int32_t index = static_cast<int32_t>(ctx.fds->size() - 1);
  if (known) ctx.seen.emplace_back(key, index);
  if (borrowed) ctx.seen_numbers.emplace_back(fd, index);
  return index;
}

void ThrowOutsideCodec() {
  throw runtime::Error(runtime::ErrorCode::kFailedPrecondition,
                       "a FileDescriptor can only be serialized through mp::Encode/mp::Decode, "
                       "which carry descriptors out of band");
}

void ThrowMalformed(const char* what) {
  throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                       std::string("malformed message: ") + what +
                           "; the sender and receiver disagree on the message's types, or the "
                           "bytes were corrupted");
}

}  // namespace internal
}  // namespace forksafe::mp
