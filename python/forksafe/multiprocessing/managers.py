"""forksafe.multiprocessing.managers: multiprocessing's managers (SyncManager, BaseManager,
BaseProxy, Namespace, ...), as torch.multiprocessing gives them too. forksafe.multiprocessing's
Manager() starts a SyncManager whose server process uses forksafe's start method; one made here
directly (SyncManager().start()) uses multiprocessing's own.
"""

from multiprocessing.managers import *  # noqa: F401,F403
from multiprocessing.managers import __all__  # noqa: F401
