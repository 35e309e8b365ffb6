#include "mp/codec.h"

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
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

namespace internal {

CodecContext*& CurrentCodecContext() {
  thread_local CodecContext* ctx = nullptr;
  return ctx;
}

int32_t AddDescriptor(CodecContext& ctx, int fd) {
  struct stat st;
  std::tuple<uint64_t, uint64_t, int> key{0, 0, 0};
  const int fl = fcntl(fd, F_GETFL);
  const bool known = fstat(fd, &st) == 0 && fl >= 0;
  if (known) {
    key = {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), fl & O_ACCMODE};
    for (const auto& [k, i] : ctx.seen) {
      if (k == key) return i;
    }
  }
  ctx.fds->push_back(FileDescriptor::Dup(fd));
  const int32_t index = static_cast<int32_t>(ctx.fds->size() - 1);
  if (known) ctx.seen.emplace_back(key, index);
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
