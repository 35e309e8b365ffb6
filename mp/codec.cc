#include "mp/codec.h"

#include <fcntl.h>
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
