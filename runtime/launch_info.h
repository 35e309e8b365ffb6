// runtime/launch_info.h: which rank of which job this process is, as its launcher told it.
//
// What it offers
//   When a job outgrows one process, a launcher starts its ranks: torchrun
//   (torch.distributed.run), Open MPI's mpirun, MPICH's mpiexec (Hydra), Slurm's srun, or
//   forksafe's own mp::spawn(). Each tells a rank who it is through environment variables, each
//   with its own names. GetLaunchInfo() reads them and answers in one shape: rank, local rank,
//   world size, local world size, node rank, the launcher's name and the rendezvous address
//   (MASTER_ADDR / MASTER_PORT) where one is given. A process that no launcher started is rank 0
//   of a world of 1 (Launcher::kNone).
//
//   The runtime uses it itself: a rank's default pool size is its share of the machine's CPUs
//   (runtime/cpu_budget.h), and device::RankDevice() picks a rank's accelerator. Users include
//   forksafe/mp/launch.h, which adds what mp::spawn() gives its children.
//
// Which variables, in this order (the first launcher whose variables are set decides)
//   1. torchrun and the "env://" convention: RANK and WORLD_SIZE (both or neither), LOCAL_RANK,
//      LOCAL_WORLD_SIZE and GROUP_RANK (the node). It comes first because it is what a rank's
//      *children* see: torchrun's workers, and mp::spawn()'s children inside an MPI or Slurm rank,
//      inherit the outer launcher's variables too, and their own must win. Named "spawn" when
//      FORKSAFE_LAUNCHER=spawn (mp::spawn() sets it), "torchrun" when TORCHELASTIC_RUN_ID is set,
//      else "env". Without LOCAL_RANK the job is taken to be on one node: LOCAL_RANK = RANK and
//      LOCAL_WORLD_SIZE = WORLD_SIZE; LOCAL_RANK alone gives LOCAL_WORLD_SIZE = WORLD_SIZE.
//   2. Open MPI: OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK and
//      OMPI_COMM_WORLD_LOCAL_SIZE. Open MPI names no node index: node_rank is
//      rank / local_world_size, exact for its default mapping (ranks fill a node, then the next)
//      with the same number of ranks on every node.
//   3. MPICH and every Hydra-based mpiexec (Intel MPI too): PMI_RANK and PMI_SIZE,
//      MPI_LOCALRANKID and MPI_LOCALNRANKS; node_rank as for Open MPI. Where an MPI launcher
//      gives no local ranks (srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE only), they come from
//      the Slurm step's variables when those name the same rank and world.
//   4. Slurm's srun (a job step: SLURM_STEP_ID or SLURM_STEPID is set; an sbatch script itself is
//      one process, not a step of SLURM_NTASKS ranks): SLURM_PROCID, SLURM_STEP_NUM_TASKS (else
//      SLURM_NTASKS), SLURM_LOCALID, SLURM_NODEID, and the local world size from
//      SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE; the "2(x3),1" form) at the node's
//      index.
//   MASTER_ADDR and MASTER_PORT are read whatever the launcher (users set them under srun and
//   mpirun for torch.distributed's env:// rendezvous); empty / 0 when unset.
//
// Guarantees
//   - A value is a whole decimal number, nothing else (no sign, no blanks); an empty variable is
//     the same as an unset one.
//   - Malformed or contradictory values are Error(kInvalidArgument) naming the variables and
//     their values and saying what to fix: a number that is not one, a rank not below its world
//     size, a local world larger than the world, half of a required pair (RANK without
//     WORLD_SIZE), a port outside 1..65535. A wrong rank is never silently taken for rank 0.
//   - Variables of a launcher later in the order are not checked against those of an earlier
//     one: a rank's children legitimately see two launchers at once.
//   - Computed anew on each call from the environment (a handful of getenv calls); thread-safe
//     except against a concurrent setenv() (the C library's rule for getenv).
#ifndef FORKSAFE_RUNTIME_LAUNCH_INFO_H_
#define FORKSAFE_RUNTIME_LAUNCH_INFO_H_

#include <functional>
#include <string>
#include <vector>

namespace forksafe::runtime {

/// Who started this process.
enum class Launcher {
  kNone,      ///< No launcher: a single process.
  kSpawn,     ///< mp::spawn() (FORKSAFE_LAUNCHER=spawn, with torchrun's variables).
  kTorchrun,  ///< torchrun / torch.distributed.run (TORCHELASTIC_RUN_ID is set).
  kEnv,       ///< RANK and WORLD_SIZE set by something else (torch's env:// convention).
  kOpenMpi,   ///< Open MPI's mpirun / mpiexec.
  kMpich,     ///< MPICH's (Hydra's) mpiexec, or another PMI-1 launcher.
  kSlurm,     ///< Slurm's srun.
};

/// "none", "spawn", "torchrun", "env", "openmpi", "mpich", "slurm".
const char* LauncherName(Launcher launcher);

/// This process's place in its job.
struct LaunchInfo {
  Launcher launcher = Launcher::kNone;
  int rank = 0;              ///< Global rank, in [0, world_size).
  int local_rank = 0;        ///< Rank among the job's processes on this node.
  int world_size = 1;        ///< Processes in the job.
  int local_world_size = 1;  ///< Processes of the job on this node.
  int node_rank = 0;         ///< This node's index in the job.
  std::string master_addr;   ///< MASTER_ADDR ("" when unset).
  int master_port = 0;       ///< MASTER_PORT (0 when unset).

  /// True when a launcher (or mp::spawn()) started this process.
  bool launched() const { return launcher != Launcher::kNone; }
  /// "rank 2 of 4 (local 0 of 2, node 1; torchrun; rendezvous 10.0.0.1:29500)", for logs.
  std::string ToString() const;
};

/// What this process's launcher says, read from the environment now (see the banner). Throws
/// Error(kInvalidArgument) for malformed or contradictory values.
LaunchInfo GetLaunchInfo();

namespace internal {
/// GetLaunchInfo's rules over `getenv` (null for an unset variable), for tests.
LaunchInfo ParseLaunchInfo(const std::function<const char*(const char*)>& getenv);
}  // namespace internal

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_LAUNCH_INFO_H_
