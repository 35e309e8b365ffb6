// mp/internal/scm_rights.h: NOT FOR USERS. Passing descriptors on AF_UNIX sockets (SCM_RIGHTS),
// shared by Connection's framing and the Queue's descriptor channel.
#ifndef FORKSAFE_MP_INTERNAL_SCM_RIGHTS_H_
#define FORKSAFE_MP_INTERNAL_SCM_RIGHTS_H_

#include <sys/socket.h>

#include <vector>

#include "forksafe/mp/codec.h"

namespace forksafe::mp::internal {

/// Attaches `fds` to `mh` as one SCM_RIGHTS control message, with `buf` as its storage (which
/// must outlive the sendmsg call).
void AttachDescriptors(msghdr& mh, std::vector<char>& buf, const std::vector<int>& fds);

/// Takes ownership of every descriptor received in `mh`'s control messages, appending to `out`.
/// When the kernel dropped some (MSG_CTRUNC: this process is at RLIMIT_NOFILE), closes the ones
/// that arrived and throws Error(kResourceExhausted) naming the limit: a message is never
/// delivered without descriptors its sender attached. The bytes read with them are consumed, so
/// a stream is then in the middle of a message: the caller must not read it in step afterwards.
void CollectDescriptors(msghdr& mh, std::vector<FileDescriptor>* out);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_SCM_RIGHTS_H_
