#include "forksafe/mp/internal/shared_segment.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp::internal {

int PrivateMemfd(const char* name) {
  const int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (fchmod(fd, 0600) != 0) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

namespace {
thread_local InFlightScope* t_in_flight = nullptr;
}  // namespace

InFlightScope::InFlightScope(uint64_t carrier) : carrier_(carrier), previous_(t_in_flight) {
  t_in_flight = this;
}

InFlightScope::~InFlightScope() {
  t_in_flight = previous_;
  for (auto& [keep, undo, arg] : undo_) undo(keep.get(), arg, carrier_);
}

InFlightScope* InFlightScope::Current() { return t_in_flight; }

SharedSegment::~SharedSegment() {
  if (data_ != nullptr && !keep_mapped_) munmap(data_, size_);
}

SharedSegment::SharedSegment(SharedSegment&& o) noexcept
    : fd_(std::move(o.fd_)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      keep_mapped_(std::exchange(o.keep_mapped_, false)) {}

SharedSegment& SharedSegment::operator=(SharedSegment&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr && !keep_mapped_) munmap(data_, size_);
    fd_ = std::move(o.fd_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    keep_mapped_ = std::exchange(o.keep_mapped_, false);
  }
  return *this;
}

SharedSegment SharedSegment::Create(size_t bytes, const char* name) {
  if (bytes == 0) {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument, "a shared segment needs >= 1 byte");
  }
  const int fd = PrivateMemfd(absl::StrCat("forksafe:", name).c_str());
  if (fd < 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      throw runtime::Error(runtime::ErrorCode::kResourceExhausted,
                           "out of file descriptors creating shared memory; close unused "
                           "objects or raise the limit (ulimit -n)");
    }
    runtime::ThrowSystemError("memfd_create (mode 0600)", err);
  }
  FileDescriptor owned(fd);
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    runtime::ThrowSystemError(absl::StrCat("ftruncate of a shared segment to ", bytes, " bytes"),
                              errno);
  }
  return Map(std::move(owned));
}

SharedSegment SharedSegment::Map(FileDescriptor fd) {
  struct stat st;
  if (!fd || fstat(fd.get(), &st) != 0) {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                         "cannot map a shared segment: the descriptor is not a valid file");
  }
  if (st.st_size <= 0) {
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                         "cannot map a shared segment of size 0");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    if (err == ENOMEM) {
      throw runtime::Error(runtime::ErrorCode::kResourceExhausted,
                           absl::StrCat("cannot map ", size,
                                        " bytes of shared memory: out of "
                                        "address space or memory"));
    }
    runtime::ThrowSystemError("mmap of a shared segment", err);
  }
  SharedSegment seg;
  seg.fd_ = std::move(fd);
  seg.data_ = p;
  seg.size_ = size;
  return seg;
}

}  // namespace forksafe::mp::internal
