// mp/internal/shm_manager.h: NOT FOR USERS. The manager daemon of the file_system strategy.
//
// A process that creates named shared segments ("/forksafe_<pid>_<random>") starts, on first use,
// a manager: this same executable, spawned with --forksafe-shm-manager (InitMain runs it), talking
// over an inherited socketpair that no other process can reach. The creator tells it each name it
// creates. When the creator exits or is killed (the socket reaches end-of-file), the manager
// removes every segment of it that no process references any more (the segment's shared count is
// zero) or that no process maps any more (scanning /proc/*/maps), then exits. On start, a manager
// also sweeps segments whose creator is dead and that nobody maps: what a killed manager (or a
// crash before the manager started) left behind in an earlier run. The manager does nothing, the
// sweep included, before its creator presented the secret it handed the manager on a private pipe
// (mp/internal/server_auth.h, which also states the threat model); a connection without it is
// closed unread and the manager exits. Names carry 128 bits from getrandom(). The creator's pid is
// only meaningful in its own pid namespace, and /dev/shm is often shared by several (containers,
// the sandboxes of a test runner): the sweep removes only segments whose header says they were
// made in the sweeper's pid namespace, and leaves every other entry alone.

#ifndef FORKSAFE_MP_INTERNAL_SHM_MANAGER_H_
#define FORKSAFE_MP_INTERNAL_SHM_MANAGER_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "mp/codec.h"

namespace forksafe::mp::internal {

inline constexpr const char* kShmManagerFlag = "--forksafe-shm-manager";

/// Tells this process's manager (started on first use) about a new named segment.
/// Never throws: without a manager, the creator still unlinks its segments when it frees them.
void ShmManagerTrack(const std::string& name);

/// The manager's pid (0 when none was started by this process).
pid_t ShmManagerPid();

/// Removes segments of dead creators of this pid namespace that no process maps. Returns how many
/// were removed.
int SweepOrphanedSegments();

/// An identity of this process's pid namespace (the inode of /proc/self/ns/pid; 0 if unknown).
/// Segments record their creator's, so that a sweep in another namespace leaves them alone.
uint64_t PidNamespaceId();

/// Decodes a message from the creator, Encode(kind, name): the segment name to remember for a
/// well-formed "track" request ("forksafe_..." without '/' or NUL, at most 255 bytes), nullopt
/// for anything else it must ignore. Error(kInvalidArgument) for a malformed message.
std::optional<std::string> DecodeTrackRequest(Message& msg);

/// The manager's main loop on descriptor `fd` (never returns).
[[noreturn]] void RunShmManager(int fd);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_SHM_MANAGER_H_
