"""How Python objects cross processes in forksafe.multiprocessing: a pickle plus what it carries
out of band.

A message (a Queue item, a Pipe message, a Process's or Pool task's arguments) is a pickle's
bytes, a list of forksafe tensors and a list of descriptors. Pickling takes out of band:

- numpy arrays and torch CPU tensors: their memory crosses as a forksafe shared-memory tensor
  (mp/sharing.h), never as pickled bytes. A torch tensor's storage moves into forksafe's shared
  memory in place on its first send (as torch's own queues do), so a receiver's writes are seen
  by the sender; a numpy array that is not in shared memory yet is copied into it once (numpy
  cannot move an array's memory; create arrays with ``shared_ndarray`` or ``share_memory`` to
  share writes both ways).
- forksafe.Tensor: as a shared-memory handle (CPU) or a device handle (the simulated
  accelerator, CUDA), the producer may exit after sending.
- forksafe.multiprocessing's own objects (Queue, Lock, Event, Value, ...): their shared state's
  descriptors travel beside the bytes.

Guarantees: nothing is left open on any path (descriptors returned by the C++ layer are closed
once pickled or adopted, whatever fails); an object that cannot cross (a lambda, a local
function) raises forksafe.InvalidArgumentError naming it and saying what to do.
"""

import ctypes
import io
import os
import pickle
import sys

from .. import _forksafe
from ..errors import InvalidArgumentError

_mp = _forksafe.mp
_CTYPES = (ctypes._SimpleCData, ctypes.Array, ctypes.Structure, ctypes.Union)
Tensor = _forksafe.Tensor

# numpy and torch are optional: imported lazily, only if the program uses them.
_np = None
_torch = None


def _numpy():
    global _np
    if _np is None and "numpy" in sys.modules:
        _np = sys.modules["numpy"]
    return _np


def _torch_module():
    global _torch
    if _torch is None and "torch" in sys.modules:
        _torch = sys.modules["torch"]
    return _torch


class Shareable:
    """Base of the objects whose state is a C++ codec value (a shared segment's descriptor):
    subclasses set ``_handle`` (a _forksafe.mp object) and may override ``_extra`` (picklable
    state kept beside the handle) and ``_rebuild`` (a classmethod: handle, extra -> object)."""

    __slots__ = ()

    def _extra(self):
        return None

    @classmethod
    def _rebuild(cls, handle, extra):
        obj = cls.__new__(cls)
        obj._handle = handle
        return obj

    def __reduce__(self):
        raise InvalidArgumentError(
            f"{type(self).__name__} objects cross processes as Process or Pool arguments or inside "
            "forksafe.multiprocessing's queues and pipes; they cannot be pickled otherwise "
            "(for example into a plain multiprocessing queue)")


# ---- numpy arrays and torch tensors in shared memory ----------------------------------------

# torch storages moved into forksafe's shared memory: storage data pointer -> the uint8
# forksafe.Tensor that owns that memory (kept alive as long as the storage is).
_torch_shared = {}


def _forksafe_tensor_of_array(arr):
    """The shared forksafe.Tensor under numpy array `arr`'s memory, or None."""
    base = arr
    while base is not None:
        if isinstance(base, Tensor):
            return base if base.is_shared() else None
        if isinstance(base, memoryview):
            base = base.obj
            continue
        base = getattr(base, "base", None)
    return None


def shared_ndarray(shape, dtype="float64"):
    """A new numpy array in forksafe's shared memory (zeros): a process it is sent to (Queue,
    Pipe, Process argument) writes into the very same memory."""
    np = _numpy() or __import__("numpy")
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise InvalidArgumentError("a shared array cannot hold Python objects (dtype=object)")
    shape = tuple(int(s) for s in (shape if hasattr(shape, "__len__") else (shape,)))
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    t = _mp.shared_empty([max(nbytes, 1)], "uint8")
    buf = np.asarray(t)
    buf[:] = 0
    return np.ndarray(shape, dtype=dtype, buffer=buf, offset=0)


def share_memory(obj):
    """numpy: a copy of `obj` in shared memory (itself when it is already shared). torch: moves
    the tensor's storage into forksafe's shared memory in place and returns the tensor (as
    ``tensor.share_memory_()``). forksafe.Tensor: moved in place."""
    if isinstance(obj, Tensor):
        return _mp.share_memory_(obj)
    torch = _torch_module()
    if torch is not None and isinstance(obj, torch.Tensor):
        _share_torch_(obj)
        return obj
    np = _numpy()
    if np is not None and isinstance(obj, np.ndarray):
        if _forksafe_tensor_of_array(obj) is not None:
            return obj
        out = shared_ndarray(obj.shape, obj.dtype)
        out[...] = obj
        return out
    raise InvalidArgumentError(
        f"share_memory: {type(obj).__name__} is not a numpy array, torch tensor or "
        "forksafe.Tensor")


def is_shared(obj):
    """True when `obj`'s memory is in shared memory that forksafe can send without a copy."""
    if isinstance(obj, Tensor):
        return obj.is_shared()
    torch = _torch_module()
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_storage_tensor(obj) is not None
    np = _numpy()
    if np is not None and isinstance(obj, np.ndarray):
        return _forksafe_tensor_of_array(obj) is not None
    return False


def _untyped_storage(t):
    """t's untyped storage (torch >= 2.0: untyped_storage(); 1.13: storage().untyped())."""
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage()
    return t.storage().untyped()


def _torch_storage_tensor(t):
    if t.device.type != "cpu":
        return None
    return _torch_shared.get(_untyped_storage(t).data_ptr())


def _share_torch_(t):
    """Moves torch tensor `t`'s storage into forksafe's shared memory, in place (every tensor
    object that is `t` sees it; other views made earlier keep the old memory)."""
    torch = _torch_module()
    if t.device.type != "cpu":
        raise InvalidArgumentError(
            f"a torch tensor on {t.device} cannot cross through forksafe's shared memory; move it "
            "to the CPU, or share it with torch's own CUDA IPC")
    if _torch_storage_tensor(t) is not None:
        return t
    storage = _untyped_storage(t)
    nbytes = storage.nbytes()
    fs = _mp.shared_empty([max(nbytes, 1)], "uint8")
    new = torch.from_dlpack(fs)[:nbytes]
    if nbytes:
        new.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    with torch.no_grad():
        t.set_(_untyped_storage(new), t.storage_offset(), t.size(), t.stride())
    _remember_torch_storage(t, fs)
    return t


_pruned_at = 64


def _remember_torch_storage(t, fs):
    """Records that `t`'s storage is forksafe tensor `fs`'s memory. The record holds a handle of
    `fs`; records whose torch storage is gone (the record's handle is the last one) are dropped
    from time to time, so the memory returns to the arena."""
    global _pruned_at
    _torch_shared[_untyped_storage(t).data_ptr()] = fs
    if len(_torch_shared) >= _pruned_at:
        for ptr, held in list(_torch_shared.items()):
            if held._storage_use_count() <= 1:
                del _torch_shared[ptr]
        _pruned_at = max(64, 2 * len(_torch_shared))


def share_torch_arguments(args, kwargs):
    """Moves the torch CPU tensors among a forked Process's arguments (top level, and the
    parameters and buffers of modules) to shared memory, so the child shares them."""
    torch = _torch_module()
    if torch is None:
        return
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.nn.Module):
            for t in list(value.parameters()) + list(value.buffers()):
                if t.device.type == "cpu" and not t.is_sparse:
                    _share_torch_(t)
        elif (isinstance(value, torch.Tensor) and value.device.type == "cpu"
              and value.layout == torch.strided and (value.is_leaf or not value.requires_grad)):
            _share_torch_(value)


def _rebuild_torch(fs, dtype, size, stride, offset, requires_grad, parameter):
    torch = _torch_module() or __import__("torch")
    flat = torch.from_dlpack(fs)
    t = torch.empty(0, dtype=getattr(torch, dtype))
    t.set_(_untyped_storage(flat), offset, size, stride)
    _remember_torch_storage(t, fs)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


# ---- the pickler ------------------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    def __init__(self, file, tensors, fds):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors
        self._fds = fds

    def _add_fds(self, fds):
        first = len(self._fds)
        self._fds.extend(fds)
        return first, len(fds)

    def _add_tensor(self, t):
        self._tensors.append(t)
        return len(self._tensors) - 1

    def persistent_id(self, obj):
        if isinstance(obj, _CTYPES):  # RawValue / RawArray: their shared block crosses
            block = getattr(obj, "_forksafe_block", None)
            if block is not None:
                data, fds = block._handle._encode()
                first, n = self._add_fds(fds)
                return ("R", type(block), data, first, n, block._extra())
            return None
        if isinstance(obj, Shareable):
            data, fds = obj._handle._encode()
            first, n = self._add_fds(fds)
            return ("O", type(obj), data, first, n, obj._extra())
        if isinstance(obj, Tensor):
            return ("T", self._add_tensor(obj))
        np = _numpy()
        if np is not None and type(obj) is np.ndarray and not obj.dtype.hasobject:
            fs = _forksafe_tensor_of_array(obj)
            if fs is None:
                obj = share_memory(obj)
                fs = _forksafe_tensor_of_array(obj)
            offset = obj.__array_interface__["data"][0] - fs.data_ptr()
            return ("N", self._add_tensor(fs), obj.dtype.str, obj.shape, obj.strides, offset)
        torch = _torch_module()
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            if obj.requires_grad and not obj.is_leaf:
                raise InvalidArgumentError(
                    "a torch tensor that requires grad and is not a leaf cannot cross processes "
                    "(its graph stays here); send tensor.detach()")
            if obj.is_sparse or obj.layout != torch.strided:
                return None
            _share_torch_(obj)
            fs = _torch_storage_tensor(obj)
            return ("P", self._add_tensor(fs), str(obj.dtype).split(".")[1], tuple(obj.size()),
                    obj.stride(), obj.storage_offset(), obj.requires_grad,
                    isinstance(obj, torch.nn.Parameter))
        return None

    def reducer_override(self, obj):
        # Functions pickle by name: a lambda or a local function cannot be found by the
        # receiver. Say so here, with the name, instead of pickle's PicklingError deep inside.
        if type(obj).__name__ == "function":
            qualname = getattr(obj, "__qualname__", "")
            if "<lambda>" in qualname or "<locals>" in qualname:
                raise InvalidArgumentError(
                    f"{obj.__module__}.{qualname} cannot be sent to another process: lambdas and "
                    "functions defined inside functions have no importable name. Define it at "
                    "the top level of a module (the main script works) and pass that.")
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors, fds, used):
        super().__init__(file)
        self._tensors = tensors
        self._fds = fds
        self._used = used

    def persistent_load(self, pid):
        kind = pid[0]
        if kind in ("O", "R"):
            _, cls, data, first, n, extra = pid
            fds = self._fds[first:first + n]
            self._used.update(range(first, first + n))
            handle_type = cls._handle_type()
            obj = cls._rebuild(handle_type._decode(data, fds), extra)
            return obj.obj if kind == "R" else obj
        if kind == "T":
            return self._tensors[pid[1]]
        if kind == "N":
            _, i, dtype, shape, strides, offset = pid
            np = _numpy() or __import__("numpy")
            buf = np.asarray(self._tensors[i])
            return np.ndarray(shape, dtype=np.dtype(dtype), buffer=buf, offset=offset,
                              strides=strides)
        if kind == "P":
            return _rebuild_torch(self._tensors[pid[1]], *pid[2:])
        raise pickle.UnpicklingError(f"unknown out-of-band item {kind!r}")


def dumps(obj):
    """(bytes, tensors, fds): `obj` pickled with its out-of-band items. The fds are new and the
    caller's to close (close_fds)."""
    buf = io.BytesIO()
    tensors, fds = [], []
    try:
        _Pickler(buf, tensors, fds).dump(obj)
    except BaseException:
        close_fds(fds)
        raise
    return buf.getvalue(), tensors, fds


def loads(data, tensors, fds):
    """The object `dumps` made. Takes ownership of `fds`: what the objects do not adopt is closed."""
    used = set()
    try:
        return _Unpickler(io.BytesIO(data), tensors, fds, used).load()
    finally:
        for i, fd in enumerate(fds):
            if i not in used:
                _close(fd)


def close_fds(fds):
    for fd in fds:
        _close(fd)


def _close(fd):
    try:
        os.close(fd)
    except OSError:
        pass


# ---- spawn and forkserver: a Process's state inside the stdlib's pickle -----------------------


def spawn_reduce(obj):
    """For pickling `obj` into a child being started by spawn or forkserver (inside the stdlib's
    ForkingPickler, while multiprocessing's spawning Popen is set): (callable, args) that rebuild
    it in the child. Tensors and descriptors travel as descriptors the start method hands to the
    child; they stay open here until Process.start has launched it (close_pending_spawn_fds)."""
    from multiprocessing import reduction as stdlib_reduction
    data, tensors, fds = dumps(obj)
    n_message_fds = len(fds)
    try:
        blobs = []
        for t in tensors:
            tdata, tfds = _mp.encode_tensor(t)
            blobs.append((tdata, len(fds), len(tfds)))
            fds.extend(tfds)
        dup = [stdlib_reduction.DupFd(fd) for fd in fds]
    except BaseException:
        close_fds(fds)
        raise
    _pending_spawn_fds.extend(fds)
    return _spawn_rebuild, (data, blobs, n_message_fds, dup)


_pending_spawn_fds = []


def close_pending_spawn_fds():
    """Closes the descriptors spawn_reduce lent to the child just launched."""
    fds = list(_pending_spawn_fds)
    del _pending_spawn_fds[:]
    close_fds(fds)


def _spawn_rebuild(data, blobs, n_message_fds, dup):
    fds = [d.detach() for d in dup]
    tensors = []
    try:
        for tdata, first, n in blobs:
            taken = fds[first:first + n]
            fds[first:first + n] = [-1] * n  # decode_tensor owns them from here, on every path
            tensors.append(_mp.decode_tensor(tdata, taken))
    except BaseException:
        close_fds([fd for fd in fds if fd >= 0])
        raise
    return loads(data, tensors, fds[:n_message_fds])
