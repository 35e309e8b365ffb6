// mp/launch.h: forksafe inside the launchers users already have (torchrun, mpirun, srun).
//
// What it offers
//   - GetLaunchInfo(): which rank of which job this process is (rank, local_rank, world_size,
//     local_world_size, node_rank, the launcher's name, the rendezvous address), read from the
//     variables of torchrun, Open MPI, MPICH/Hydra, Slurm or mp::spawn(); rank 0 of 1 without a
//     launcher. The rules, their order and the errors are in forksafe/runtime/launch_info.h.
//   - What mp::spawn() gives its children (SpawnChildEnvironment): torchrun's variables, so code
//     written for torchrun runs under spawn() on one machine, and ranks that nest. The rule, for
//     spawn(nprocs = N) called in a process that is rank r of W (local rank l of L, node k):
//         child i:  RANK = r*N + i            WORLD_SIZE = W*N
//                   LOCAL_RANK = l*N + i      LOCAL_WORLD_SIZE = L*N
//                   GROUP_RANK = k            ROLE_RANK, ROLE_WORLD_SIZE = RANK, WORLD_SIZE
//                   MASTER_ADDR / MASTER_PORT = the parent's; without them, and only when the
//                   parent is alone (W = 1), 127.0.0.1 and a port that was free when spawn()
//                   ran (a one-machine env:// rendezvous). Inside a launcher that set none
//                   (mpirun, srun) they stay unset: the W parents could not agree on one, so set
//                   MASTER_ADDR / MASTER_PORT for the job when the children rendezvous.
//                   FORKSAFE_LAUNCHER = spawn
//     Every rank of the outer job must call spawn() with the same N for the global ranks to be
//     0..W*N-1 exactly once (they are, whatever the start method).
//   - The launcher's fault contract (RecordFailureForLauncher): when a spawn() of this rank fails,
//     ProcessContext::join() writes the failure to TORCHELASTIC_ERROR_FILE, when that variable is
//     set, in torchelastic's JSON form ({"message": {"message": "Type: text", "extraInfo":
//     {"py_callstack": ..., "timestamp": ...}}}), so torchrun's summary names the child's error;
//     the exception then goes on up, and a rank that does not catch it exits non-zero, which the
//     launcher reports.
//
// Guarantees
//   - A launcher's SIGTERM (then SIGKILL) to a rank takes its forksafe children with it: they
//     watch their parent's lifeline (mp/process.h) and end within milliseconds of its death,
//     whatever the signal; the shm manager removes the rank's /dev/shm segments when their last
//     user is gone (mp/sharing.h). Tested under mpirun and torchrun (tests/mp/launchers_test.py).
//   - Thread safety: as getenv (runtime/launch_info.h).
#ifndef FORKSAFE_MP_LAUNCH_H_
#define FORKSAFE_MP_LAUNCH_H_

#include <string>
#include <utility>
#include <vector>

#include "forksafe/runtime/launch_info.h"

namespace forksafe::mp {

using runtime::Launcher;
using runtime::LauncherName;
using runtime::LaunchInfo;

/// runtime::GetLaunchInfo(): this process's place in its job. Throws Error(kInvalidArgument) for
/// malformed or contradictory launcher variables, naming them.
LaunchInfo GetLaunchInfo();

/// The variables spawn() sets in child `index` of `nprocs` started by a process whose place is
/// `parent` (the rule of the banner). `master_port` is used as MASTER_PORT when `parent` has no
/// rendezvous address and is alone (FreeLoopbackPort() picks one; 0: none). Throws kInvalidArgument
/// when nprocs < 1 or index is outside [0, nprocs), and kResourceExhausted when the nested world
/// would not fit in an int.
std::vector<std::pair<std::string, std::string>> SpawnChildEnvironment(const LaunchInfo& parent,
                                                                       int nprocs, int index,
                                                                       int master_port);

/// A TCP port of 127.0.0.1 that was free a moment ago (bound to port 0, then released).
int FreeLoopbackPort();

/// Writes a failure to the file named by TORCHELASTIC_ERROR_FILE in torchelastic's JSON form
/// (see the banner); returns false, writing nothing, when the variable is unset or empty.
/// `type` and `message` become "type: message"; `traceback` becomes the py_callstack, which
/// torchrun prints as the failure's traceback (end it with the "type: message" line, as Python's
/// tracebacks do; empty: that line alone). A file that cannot be written is reported on stderr
/// (the failure itself is on its way up; this never throws).
bool RecordFailureForLauncher(const std::string& type, const std::string& message,
                              const std::string& traceback);

}  // namespace forksafe::mp

#endif  // FORKSAFE_MP_LAUNCH_H_
