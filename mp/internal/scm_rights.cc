#include "mp/internal/scm_rights.h"

#include <cstring>

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
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    int fd;
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      out->emplace_back(fd);
    }
  }
}

}  // namespace forksafe::mp::internal
