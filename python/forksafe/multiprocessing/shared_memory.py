"""forksafe.multiprocessing.shared_memory: multiprocessing's SharedMemory and ShareableList under
their usual names. For tensors and arrays, forksafe's own shared memory needs no names to
manage: see share_memory() and shared_ndarray().
"""

from multiprocessing.shared_memory import *  # noqa: F401,F403
from multiprocessing.shared_memory import __all__  # noqa: F401
