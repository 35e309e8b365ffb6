"""forksafe.multiprocessing.dummy: multiprocessing's API over threads (multiprocessing.dummy),
under its usual name: threads need no fork to be made safe.
"""

from multiprocessing.dummy import *  # noqa: F401,F403
from multiprocessing.dummy import __all__  # noqa: F401
