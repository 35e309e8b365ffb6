#include "forksafe/mp/internal/scm_rights.h"

#include <sys/resource.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp::internal {

void AttachDescriptors(msghdr& mh, std::vector<char>& buf, const std::vector<int>& fds) {
  buf.assign(CMSG_SPACE(sizeof(int) * fds.size()), 0);
  mh.msg_control = buf.data();
  mh.msg_controllen = buf.size();
  cmsghdr* c = CMSG_FIRSTHDR(&mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
}

void CollectDescriptors(msghdr& mh, std::vector<FileDescriptor>* out) {
  std::vector<FileDescriptor> got;
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    int fd;
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      got.emplace_back(fd);
    }
  }
  if (mh.msg_flags & MSG_CTRUNC) {
    // The kernel installs the passed descriptors one by one and drops the rest (silently, but for
    // this flag) when the table is full; the ones that did arrive are closed with `got`.
    rlimit rl{};
    const std::string limit = getrlimit(RLIMIT_NOFILE, &rl) != 0 ? std::string("unknown")
                              : rl.rlim_cur == RLIM_INFINITY     ? std::string("unlimited")
                                                                 : std::to_string(rl.rlim_cur);
    throw runtime::Error(
        runtime::ErrorCode::kResourceExhausted,
        absl::StrCat("recv: descriptors sent with a message were lost on arrival (", got.size(),
                     " arrived): this process is at its limit of ", limit,
                     " open descriptors (RLIMIT_NOFILE, ulimit -n): raise the limit, or close "
                     "descriptors (finished processes, connections, tensors) before receiving "
                     "more. The message is lost, and the channel cannot be read in step after "
                     "it"));
  }
  for (FileDescriptor& f : got) out->push_back(std::move(f));
}

}  // namespace forksafe::mp::internal
