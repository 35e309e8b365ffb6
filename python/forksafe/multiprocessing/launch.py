"""launch_info(): which rank of which job this process is, as its launcher (torchrun, Open MPI's
mpirun, MPICH's mpiexec, Slurm's srun, or spawn()) told it.

The rules live in C++ (forksafe/runtime/launch_info.h: which variables, in which order, and the
errors); this module gives them Python's shape:

    info = mp.launch_info()
    info.rank, info.world_size, info.local_rank, info.launcher   # 0, 1, 0, "none" when alone

Malformed or contradictory variables raise forksafe.InvalidArgumentError naming them.
"""

from collections import namedtuple

from .. import _forksafe

__all__ = ["LaunchInfo", "launch_info"]

LaunchInfo = namedtuple(
    "LaunchInfo", "launcher rank local_rank world_size local_world_size node_rank master_addr "
                  "master_port")
LaunchInfo.__doc__ = """This process's place in its job. launcher: "none", "spawn", "torchrun",
"env", "openmpi", "mpich" or "slurm"; master_addr "" and master_port 0 when no rendezvous is set."""


def launch_info():
    """This process's LaunchInfo, read from the environment now."""
    return LaunchInfo(*_forksafe.mp.launch_info())
