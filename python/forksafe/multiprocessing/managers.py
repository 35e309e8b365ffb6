"""forksafe.multiprocessing.managers: multiprocessing's managers (SyncManager, BaseManager,
BaseProxy, Namespace, ...), as torch.multiprocessing gives them too. forksafe.multiprocessing's
Manager() starts a SyncManager whose server process uses forksafe's start method; one made here
directly (SyncManager().start()) uses multiprocessing's own.
"""

import multiprocessing.managers as _stdlib_managers
from multiprocessing.managers import *  # noqa: F401,F403
from multiprocessing.managers import __all__  # noqa: F401

# Its other public names too (DictProxy, ListProxy, AutoProxy, Namespace, Token, ...): programs
# import them although its __all__ leaves them out.
globals().update({k: v for k, v in vars(_stdlib_managers).items()
                  if not k.startswith("_") and k not in globals()})
