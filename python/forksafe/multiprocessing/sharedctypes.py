"""Value, Array, RawValue and RawArray in shared memory (forksafe's C++ mp/shared_value.h).

The typecodes are multiprocessing's (the array module's, 'c' included) or a ctypes type.
Value and Array come with a lock (an RLock by default, as in multiprocessing; ``lock=False``
for none, or a Lock/RLock of your own): ``.value``, indexing and slicing take it, and
``get_lock()`` returns it for read-modify-write:

    with counter.get_lock():
        counter.value += 1

The memory is forksafe's: it crosses to spawn and forkserver children as a descriptor, is
inherited by forked ones, and is freed when the last process lets go.
"""

import ctypes

from .. import _forksafe
from ..errors import InvalidTypeError
from .reduction import Shareable
from .synchronize import Lock, RLock

_mp = _forksafe.mp

__all__ = ["RawValue", "RawArray", "Value", "Array", "copy", "synchronized", "Synchronized",
           "SynchronizedArray", "SynchronizedString", "SynchronizedBase"]

typecode_to_type = {
    "c": ctypes.c_char, "u": ctypes.c_wchar,
    "b": ctypes.c_byte, "B": ctypes.c_ubyte,
    "h": ctypes.c_short, "H": ctypes.c_ushort,
    "i": ctypes.c_int, "I": ctypes.c_uint,
    "l": ctypes.c_long, "L": ctypes.c_ulong,
    "q": ctypes.c_longlong, "Q": ctypes.c_ulonglong,
    "f": ctypes.c_float, "d": ctypes.c_double,
}


def _ctype(typecode_or_type):
    if isinstance(typecode_or_type, str):
        try:
            return typecode_to_type[typecode_or_type]
        except KeyError:
            raise InvalidTypeError(f"unknown typecode {typecode_or_type!r}; use one of "
                                   f"{''.join(typecode_to_type)} or a ctypes type") from None
    if isinstance(typecode_or_type, type) and issubclass(typecode_or_type, ctypes._SimpleCData):
        return typecode_or_type
    if isinstance(typecode_or_type, type) and issubclass(
            typecode_or_type, (ctypes.Structure, ctypes.Array)):
        return typecode_or_type
    raise InvalidTypeError(f"{typecode_or_type!r} is neither a typecode nor a ctypes type")


class _Block(Shareable):
    """Shared bytes viewed as one ctypes object (a Raw value or array)."""

    __slots__ = ("_handle", "_ctype", "obj")
    _public_name = "Value, Array, RawValue and RawArray"

    def __init__(self, ctype):
        self._ctype = ctype
        self._handle = _mp.SharedBytes(ctypes.sizeof(ctype))
        self.obj = ctype.from_buffer(self._handle)

    @staticmethod
    def _handle_type():
        return _mp.SharedBytes

    def _extra(self):
        return _describe(self._ctype)

    @classmethod
    def _rebuild(cls, handle, description):
        ctype = _from_description(description)
        obj = cls.__new__(cls)
        obj._handle = handle
        obj._ctype = ctype
        obj.obj = ctype.from_buffer(handle)
        obj.obj._forksafe_block = obj
        return obj


def _describe(ctype):
    # ctypes array types (c_int * 10) are made on the fly and cannot be pickled by name.
    if issubclass(ctype, ctypes.Array):
        return ("array", _describe(ctype._type_), ctype._length_)
    return ("type", ctype)


def _from_description(description):
    if description[0] == "array":
        return _from_description(description[1]) * description[2]
    return description[1]


def _raw(ctype):
    block = _Block(ctype)
    block.obj._forksafe_block = block  # the ctypes object keeps its shared memory
    return block


def RawValue(typecode_or_type, *args):
    """A ctypes object in shared memory, without a lock."""
    block = _raw(_ctype(typecode_or_type))
    if args:
        block.obj.__init__(*args)
    return block.obj


def RawArray(typecode_or_type, size_or_initializer):
    """A ctypes array in shared memory, without a lock: n zeros, or a copy of a sequence."""
    ctype = _ctype(typecode_or_type)
    if isinstance(size_or_initializer, int):
        if size_or_initializer < 0:
            raise ValueError(f"RawArray: negative size {size_or_initializer}")
        block = _raw(ctype * size_or_initializer)
    else:
        init = list(size_or_initializer)
        block = _raw(ctype * len(init))
        block.obj[:] = init
    return block.obj


def _make_lock(lock):
    if lock is True or lock is None:
        return RLock()
    if isinstance(lock, (Lock, RLock)):
        return lock
    if callable(getattr(lock, "acquire", None)) and callable(getattr(lock, "release", None)):
        # Any lock object, as multiprocessing takes (a threading.Lock guards only this process's
        # threads, and the value then cannot be sent to another process).
        return lock
    raise AttributeError(f"lock must be True, False, or a lock (acquire and release), "
                         f"not {lock!r}")


class Synchronized:
    """A shared value with a lock (what Value returns): .value under the lock."""

    def __init__(self, block, lock):
        self._block = block
        self._obj = block.obj
        self._lock = lock
        self.acquire = lock.acquire
        self.release = lock.release

    def __reduce__(self):
        return synchronized, (self._block.obj, self._lock)

    def get_lock(self):
        return self._lock

    def get_obj(self):
        return self._obj

    def __enter__(self):
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)

    @property
    def value(self):
        with self._lock:
            return self._obj.value

    @value.setter
    def value(self, v):
        with self._lock:
            self._obj.value = v

    def __repr__(self):
        return f"<Synchronized wrapper for {self._obj!r}>"


class SynchronizedArray(Synchronized):
    """A shared array with a lock (what Array returns): indexing and slicing under the lock."""

    def __len__(self):
        return len(self._obj)

    def __getitem__(self, i):
        with self._lock:
            return self._obj[i]

    def __setitem__(self, i, v):
        with self._lock:
            self._obj[i] = v

    def __iter__(self):
        return iter(self[:])

    # .value (c_char arrays) is Synchronized's.

    @property
    def raw(self):
        with self._lock:
            return self._obj.raw


class SynchronizedString(SynchronizedArray):
    """A shared array of c_char with a lock: .value and .raw as bytes (Array('c', ...))."""


# multiprocessing.sharedctypes' base class, under its name (isinstance checks).
SynchronizedBase = Synchronized


def _field_property(name):
    def get(self):
        with self._lock:
            return getattr(self._obj, name)

    def set(self, value):
        with self._lock:
            setattr(self._obj, name, value)

    return property(get, set, doc=f"the field {name!r}, under the lock")


_struct_wrappers = {}  # ctypes.Structure subclass -> its Synchronized subclass


def synchronized(obj, lock=None, ctx=None):
    """multiprocessing.sharedctypes.synchronized: `obj` (a RawValue or RawArray) with a lock
    (an RLock when `lock` is None). A Structure's fields are properties taken under the lock."""
    block = getattr(obj, "_forksafe_block", None)
    if block is None:
        raise TypeError(f"synchronized() takes a RawValue or RawArray of "
                        f"forksafe.multiprocessing, not {type(obj).__name__}")
    lock = _make_lock(lock)
    ctype = type(obj)
    if issubclass(ctype, ctypes.Array):
        if ctype._type_ is ctypes.c_char:
            return SynchronizedString(block, lock)
        return SynchronizedArray(block, lock)
    if issubclass(ctype, ctypes.Structure):
        cls = _struct_wrappers.get(ctype)
        if cls is None:
            fields = {f[0]: _field_property(f[0]) for f in ctype._fields_}
            cls = _struct_wrappers[ctype] = type(
                f"Synchronized{ctype.__name__}", (Synchronized,), fields)
        return cls(block, lock)
    return Synchronized(block, lock)


def copy(obj):
    """multiprocessing.sharedctypes.copy: a new RawValue/RawArray holding a copy of `obj`."""
    new = _raw(type(obj)).obj
    ctypes.memmove(ctypes.addressof(new), ctypes.addressof(obj), ctypes.sizeof(obj))
    return new


def Value(typecode_or_type, *args, lock=True, ctx=None):
    """A shared value; with a lock unless lock=False (then the raw ctypes object)."""
    obj = RawValue(typecode_or_type, *args)
    if lock is False:
        return obj
    return synchronized(obj, None if lock is True else lock)


def Array(typecode_or_type, size_or_initializer, *, lock=True, ctx=None):
    """A shared array; with a lock unless lock=False (then the raw ctypes array)."""
    obj = RawArray(typecode_or_type, size_or_initializer)
    if lock is False:
        return obj
    return synchronized(obj, None if lock is True else lock)
