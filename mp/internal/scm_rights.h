// mp/internal/scm_rights.h: NOT FOR USERS. Passing descriptors on AF_UNIX sockets (SCM_RIGHTS),
// shared by Connection's framing and the Queue's descriptor channel.
#ifndef FORKSAFE_MP_INTERNAL_SCM_RIGHTS_H_
#define FORKSAFE_MP_INTERNAL_SCM_RIGHTS_H_

#include <sys/socket.h>

#include <vector>

#include "mp/codec.h"

namespace forksafe::mp::internal {

/// Attaches `fds` to `mh` as one SCM_RIGHTS control message, with `buf` as its storage (which
/// must outlive the sendmsg call).
void AttachDescriptors(msghdr& mh, std::vector<char>& buf, const std::vector<int>& fds);

/// Takes ownership of every descriptor received in `mh`'s control messages, appending to `out`.
void CollectDescriptors(msghdr& mh, std::vector<FileDescriptor>* out);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_SCM_RIGHTS_H_
