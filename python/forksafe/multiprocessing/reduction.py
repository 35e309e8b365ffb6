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

import atexit
import copyreg
import ctypes
import io
import os
import pickle
import sys
import threading
import types
import weakref

# multiprocessing.reduction's names, which programs import from this module's usual place (a
# reducer registered with ForkingPickler is used by forksafe's pickling too).
from multiprocessing.reduction import (  # noqa: F401
    HAVE_SEND_HANDLE, AbstractReducer, DupFd, ForkingPickler, dump, recv_handle, recvfds,
    register, send_handle, sendfds)

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
        _teach_torch(_torch)
    return _torch


def _import_torch():
    # A receiver rebuilding a tensor may not have imported torch yet.
    __import__("torch")
    return _torch_module()


def _teach_torch(torch):
    """torch.Tensor.is_shared() and share_memory_() learn forksafe's shared memory, from the
    moment forksafe.multiprocessing meets torch (at its import when torch is imported first):
    - share_memory_() of a CPU tensor moves it into forksafe's shared memory (as its first send
      would), so `model.share_memory()` / `t.share_memory_()` before forking Hogwild workers
      or taking views puts the tensors where forksafe's messages find them: a worker that sends
      a parameter, or a view of a shared buffer sent to a worker, stays over the same memory.
      (Into torch's own shared memory, the first send had to copy it out again, and the
      writes no longer reached the other processes or the other views.) On a tensor forksafe
      moved already it does nothing; device tensors and tensors torch shared already keep
      torch's behaviour.
    - is_shared() is True for a tensor in forksafe's shared memory (torch alone says False: the
      memory is not its allocator's)."""
    tensor = getattr(torch, "Tensor", None)
    if tensor is None or getattr(tensor, "_forksafe_taught", False):
        return
    torch_is_shared, torch_share_memory_ = tensor.is_shared, tensor.share_memory_

    def is_shared(self):
        if self.is_cpu and _torch_storage_tensor(self) is not None:
            return True
        return torch_is_shared(self)

    def share_memory_(self):
        if self.is_cpu and self.numel() != 0 and not torch_is_shared(self):
            _share_torch_(self)  # moves it unless forksafe has it already
            return self
        return torch_share_memory_(self)

    is_shared.__doc__, share_memory_.__doc__ = torch_is_shared.__doc__, torch_share_memory_.__doc__
    tensor.is_shared, tensor.share_memory_ = is_shared, share_memory_
    tensor._forksafe_taught = True


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
        name = getattr(type(self), "_public_name", None) or f"{type(self).__name__} objects"
        raise InvalidArgumentError(
            f"{name} cross processes as arguments of forksafe.multiprocessing's Process and Pool "
            "or inside its queues and pipes; they cannot be pickled otherwise (for example into "
            "a plain multiprocessing queue, or for a Process of multiprocessing's own context: "
            "give such code forksafe.multiprocessing.get_context(method), e.g. torch's "
            "DataLoader(multiprocessing_context=...))")


# ---- numpy arrays and torch tensors in shared memory ----------------------------------------

# torch storages moved into forksafe's shared memory: storage data pointer -> the uint8
# forksafe.Tensor that owns that memory (kept alive as long as the storage is).
_torch_shared = {}


# The numpy arrays (the bases of received arrays) that hold a copy made to carry an array that
# was not shared: their memory is shared memory, but the receiver's to own, as pickling's copy
# would be. Sent on, such an array is copied again; only arrays made shared on purpose
# (shared_ndarray, share_memory, and what they reach) cross by reference.
# By id (numpy arrays cannot be hashed), each with a weak reference that removes it.
_private_copies = {}


def _mark_private(base):
    key = id(base)
    _private_copies[key] = weakref.ref(base, lambda _, key=key: _private_copies.pop(key, None))


def _is_private(base):
    ref = _private_copies.get(id(base))
    return ref is not None and ref() is base


def _forksafe_tensor_of_array(arr):
    """The shared forksafe.Tensor under numpy array `arr`'s memory, or None (not in shared
    memory, or a received private copy)."""
    base = arr
    while base is not None:
        if isinstance(base, Tensor):
            return base if base.is_shared() else None
        if isinstance(base, memoryview):
            base = base.obj
            continue
        if _private_copies and _is_private(base):
            return None
        base = getattr(base, "base", None)
    return None


def shared_ndarray(shape, dtype="float64", order="C"):
    """A new numpy array in forksafe's shared memory (zeros), in row-major ("C") or column-major
    ("F") order: a process it is sent to (Queue, Pipe, Process argument) writes into the very
    same memory."""
    np = _numpy() or __import__("numpy")
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise InvalidArgumentError("a shared array cannot hold Python objects (dtype=object)")
    shape = tuple(int(s) for s in (shape if hasattr(shape, "__len__") else (shape,)))
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    t = _mp.shared_empty([max(nbytes, 1)], "uint8")
    buf = np.asarray(t)
    buf[:] = 0
    if order not in ("C", "F"):
        raise InvalidArgumentError(f"shared_ndarray: order must be 'C' or 'F', not {order!r}")
    return np.ndarray(shape, dtype=dtype, buffer=buf, offset=0, order=order)


def release_cached_memory():
    """Drops the records of torch storages no tensor uses any more and returns the arena's
    cached, unreferenced memory to the system, including the segments received lately that no
    live tensor here uses (kept mapped for speed: up to 16; a file_system segment leaves
    /dev/shm once no process holds it). Runs at
    interpreter exit too: a process whose shm manager dies with it (a PID namespace ending)
    leaves nothing behind."""
    _prune_torch_records()
    _mp.empty_cache()


@atexit.register
def _release_at_exit():
    _torch_shared.clear()
    try:
        _mp.empty_cache()
    except Exception:
        pass


def share_memory(obj):
    """numpy and forksafe.Tensor: a copy of `obj` in shared memory (`obj` itself when it is
    already shared; its memory cannot move while views of it may exist). torch: moves the
    tensor's storage into forksafe's shared memory in place and returns the tensor (as
    ``tensor.share_memory_()``; views taken before keep the old memory)."""
    if isinstance(obj, Tensor):
        if obj.is_shared() or obj.device != "cpu":
            return obj
        return _mp.share_memory_(obj.clone())
    torch = _torch_module()
    if torch is not None and isinstance(obj, torch.Tensor):
        _share_torch_(obj)
        return obj
    np = _numpy()
    if np is not None and isinstance(obj, np.ndarray):
        if _forksafe_tensor_of_array(obj) is not None:
            return obj
        # A column-major array stays column-major (as pickling keeps it); any other layout
        # (a broadcast or a strided view) becomes a compact row-major copy, as in pickling.
        fortran = obj.flags.f_contiguous and not obj.flags.c_contiguous
        out = shared_ndarray(obj.shape, obj.dtype, "F" if fortran else "C")
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
        return _torch_storage_tensor(obj) is not None or (obj.is_cpu and obj.numel() == 0)
    np = _numpy()
    if np is not None and isinstance(obj, np.ndarray):
        return _forksafe_tensor_of_array(obj) is not None
    return False


def _untyped_storage(t):
    """t's untyped storage: untyped_storage() (torch >= 2.0), or _storage() (torch 1.13, where
    storage() wraps it in a TypedStorage made in Python: 0.55 us against 0.08)."""
    global _untyped_storage_of
    if _untyped_storage_of is None:
        for name in ("untyped_storage", "_storage"):
            method = getattr(type(t), name, None)
            if method is not None and type(method(t)).__name__ == "UntypedStorage":
                _untyped_storage_of = method
                break
        else:
            _untyped_storage_of = lambda x: x.storage().untyped()  # noqa: E731
    return _untyped_storage_of(t)


_untyped_storage_of = None


def _storage_ptr(t):
    # The address of t's storage, without making a storage object (that costs microseconds).
    return t.data_ptr() - t.storage_offset() * t.element_size()


def _torch_storage_tensor(t):
    if not t.is_cpu:
        return None
    entry = _torch_shared.get(_storage_ptr(t))
    return entry[0] if entry is not None else None


def _shared_record(t):
    """The record (fs, weak tensor, nbytes) of CPU torch tensor `t`'s memory, moving `t` into
    shared memory first when it is not there yet (a message's per-tensor path; `t` is not
    empty)."""
    # The storage's address (_storage_ptr, inlined: this runs once per tensor of every message).
    entry = _torch_shared.get(t.data_ptr() - t.storage_offset() * t.element_size())
    if entry is None:
        with _moving:  # two threads sending one fresh tensor: one moves it, the other finds it
            entry = _torch_shared.get(_storage_ptr(t))
            if entry is None:
                entry = _move_to_shared(_torch_module(), t)
    return entry


_moving = threading.RLock()


def _new_moving_lock():
    # A forked child: another thread of the parent may have held the lock (in the middle of a
    # send) when it forked; that thread does not exist here, so the child's first send would wait
    # for it for ever.
    global _moving
    _moving = threading.RLock()


os.register_at_fork(after_in_child=_new_moving_lock)


def _share_torch_(t):
    """Moves torch tensor `t`'s storage into forksafe's shared memory, in place (every tensor
    object that is `t` sees it; other views made earlier keep the old memory)."""
    if not t.is_cpu:
        raise InvalidArgumentError(
            f"a torch tensor on {t.device} cannot cross through forksafe's shared memory; move it "
            "to the CPU, or share it with torch's own CUDA IPC")
    if t.numel() != 0:
        with _moving:
            if _torch_storage_tensor(t) is None:
                _move_to_shared(_torch_module(), t)
    return t  # an empty tensor has no memory to share: it crosses as its shape alone


def _move_to_shared(torch, t):
    """_share_torch_'s move of non-empty CPU tensor `t` (not shared yet); returns its record.
    About 5 us for a small tensor, plus the copy."""
    storage = _untyped_storage(t)
    # Only the part of the storage `t` spans moves: the same strides over a block of that size.
    # Moving the whole storage copied it all for each view sent (a view moves alone: the
    # storage's other views keep the old memory), so Pool.map over the 800 rows of an 8 MB
    # tensor copied 6.4 GB (20 s, 7.6 GB resident) where the rows hold 8 MB.
    size, stride = t.size(), t.stride()
    span = 1 + sum((n - 1) * s for n, s in zip(size, stride))  # elements, from the first
    element = t.element_size()
    numel = t.numel()
    if span > 2 * numel:
        # A view spread over far more memory than it holds (a column: its span is nearly the
        # whole storage, and Pool.map over 400 columns of 4 MB held 1.9 GB): a compact copy,
        # whose strides are contiguous.
        fs = _mp.shared_empty([numel * element], "uint8")
        ptr = fs.data_ptr()
        compact = _torch_view_of(torch, fs, ptr).view(t.dtype).view(size)
        compact.copy_(t.detach())
        shared, stride = _untyped_storage(compact), compact.stride()
    else:
        # The block and the copy in one call (raw bytes at memcpy speed; torch's uint8 copy_
        # took 4x longer), then torch's view of the block. (Records of storages torch let go
        # of are dropped by their release, and pruned as they double: a prune per move made a
        # message of n fresh tensors cost n^2, 14.8 s for 8000.)
        fs = _mp.shared_copy(storage.data_ptr() + t.storage_offset() * element, span * element)
        ptr = fs.data_ptr()
        shared = _untyped_storage(_torch_view_of(torch, fs, ptr))
    if t.is_inference():  # no version counter to keep; set_ only inside inference mode
        with torch.inference_mode():
            t.set_(shared, 0, size, stride)
    else:
        # `.data =`, not set_: set_ is an in-place op and bumps t's version counter, so a tensor
        # saved for backward ("modified by an inplace operation") could not be sent.
        moved = torch.empty(0, dtype=t.dtype)
        moved.set_(shared, 0, size, stride)
        t.data = moved
    return _remember_torch_storage(fs, ptr, t)  # t itself: a reply over it is made from it


_pruned_at = 64
_bytes_since_prune = 0
_PRUNE_BYTES = 64 << 20


def _torch_view_of(torch, fs, ptr):
    """A torch uint8 tensor over forksafe tensor `fs`'s memory at `ptr` (its data_ptr(), which
    the callers have at hand: a call into the binding costs 0.15 us), by DLPack, no copy. When
    torch lets go of that memory (its storage dies: the last tensor over it is gone), the record
    of it is dropped at once (_torch_storage_released), so the block goes back to the arena then,
    not at a later prune: a receiver that drops a tensor lets its sender reuse the warm block (a
    large segment from the arena's cache, a pooled block) for the next fresh tensor, instead of
    new memory and its first-touch page faults."""
    global _from_capsule
    if _from_capsule is None:
        # torch.from_dlpack of a capsule is torch._C._from_dlpack behind a Python wrapper (0.3 us).
        _from_capsule = getattr(torch._C, "_from_dlpack", None) or torch.from_dlpack
    return _from_capsule(fs._dlpack_with_release(lambda: _torch_storage_released(ptr)))


_from_capsule = None


def _torch_storage_released(ptr):
    # A torch storage over the memory at `ptr` died (called from its DLPack deleter, with the
    # GIL, wherever torch let go). The record goes once no other torch storage uses the memory
    # (its `fs` handle is the last one); otherwise the last one's release drops it.
    entry = _torch_shared.get(ptr)
    if entry is not None and _record_unused(ptr, entry):
        _torch_shared.pop(ptr, None)


def _record_unused(ptr, entry):
    # No torch storage uses the memory any more: the recorded tensor is gone or now over other
    # memory (set_), and no DLPack import of the memory is alive (`fs` is its last holder).
    held, ref, _ = entry
    t = ref()
    return (t is None or _storage_ptr(t) != ptr) and held._storage_use_count() <= 1


def _live_tensor_over(entry, ptr, torch_dtype):
    """The recorded torch tensor of `entry` when a message's tensor can be made from it with one
    op (as_strided): alive, still over the whole memory at `ptr`, of `torch_dtype`, not part of
    an autograd graph. Else None (the caller imports the memory afresh)."""
    t = entry[1]()
    if (t is None or t.dtype is not torch_dtype or t.requires_grad
            or _storage_ptr(t) != ptr or type(t) is not _torch.Tensor):
        return None  # (a subclass's as_strided would be of the subclass)
    return t


def _remember_torch_storage(fs, ptr, tensor):
    """Records that torch tensor `tensor`'s storage is forksafe tensor `fs`'s whole memory (at
    `ptr`). The
    record holds `fs` and a weak reference to `tensor`: a later message over the same memory is
    made from `tensor` while it lives (as_strided: no new DLPack import; its metadata may have
    changed, its storage is checked), and a tensor sent again is found by its storage's address.
    The record is dropped when torch lets go of the memory (_torch_view_of); a prune, which runs
    once the records doubled in number or 64 MiB were recorded since the last, also drops
    records whose memory no torch tensor uses any more. Returns the record."""
    global _bytes_since_prune
    nbytes = fs.nbytes
    entry = _torch_shared[ptr] = (fs, weakref.ref(tensor), nbytes)
    _bytes_since_prune += nbytes
    if len(_torch_shared) >= _pruned_at or _bytes_since_prune >= _PRUNE_BYTES:
        _prune_torch_records()
    return entry


def _prune_torch_records():
    global _pruned_at, _bytes_since_prune
    for ptr, entry in list(_torch_shared.items()):
        if _record_unused(ptr, entry):
            _torch_shared.pop(ptr, None)  # a storage's release may have dropped it meanwhile
    _pruned_at = max(64, 2 * len(_torch_shared))
    _bytes_since_prune = 0


_torch_dtypes = {}  # "float32" -> torch.float32


def _rebuild_torch(fs, dtype, size, stride, offset, requires_grad, parameter, flat=False):
    """The torch tensor a message describes, over forksafe tensor `fs`'s memory. While a torch
    tensor over that memory lives here (the sender's own, or one received before and kept), the
    new one is made from it with one op (0.9 us); else the memory is imported (DLPack) and
    typed, and `flat` (one dimension, contiguous, the whole memory) makes the typed view itself
    the tensor (0.4 us, where an as_strided more takes 1.4 us)."""
    torch = _torch or _import_torch()
    torch_dtype = _torch_dtype(torch, dtype)
    ptr = fs.data_ptr()
    entry = _torch_shared.get(ptr)
    live = _live_tensor_over(entry, ptr, torch_dtype) if entry is not None else None
    t = None
    if live is not None:
        try:
            t = live.as_strided(size, stride, offset)
        except RuntimeError:  # outside the live tensor's storage: import the memory instead
            pass
    if t is None:
        base = _torch_view_of(torch, fs, ptr)
        try:
            typed = base.view(torch_dtype)
            # The record names a tensor that lives as long as the one returned: the typed view
            # (the as_strided result keeps it as its base) or, when flat, the tensor itself.
            t = typed if flat else typed.as_strided(size, stride, offset)
            _remember_torch_storage(fs, ptr, typed)
        except RuntimeError:  # the memory's size is not a multiple of the element's
            t = torch.empty(0, dtype=torch_dtype)
            t.set_(_untyped_storage(base), offset, size, stride)
            _remember_torch_storage(fs, ptr, t)
    return _with_grad(torch, t, requires_grad, parameter)


def _rebuild_empty_torch(dtype, size, stride, requires_grad, parameter):
    torch = _torch or _import_torch()
    t = torch.empty_strided(size, stride, dtype=_torch_dtype(torch, dtype))
    return _with_grad(torch, t, requires_grad, parameter)


def _torch_dtype(torch, name):
    # torch.float32 for "float32", looked up once per name, not per message.
    dtype = _torch_dtypes.get(name)
    if dtype is None:
        dtype = _torch_dtypes[name] = getattr(torch, name)
    return dtype


def _rebuild_subclass(cls, state, rebuild, args):
    t = rebuild(*args)
    if cls is not None:
        t = t.as_subclass(cls)
    if state:
        t.__dict__.update(state)
    return t


def _with_grad(torch, t, requires_grad, parameter):
    # A rebuilt tensor as it was sent: an nn.Parameter, or requiring grad, or plain.
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


# ---- the pickler ------------------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    """pickle with out-of-band items. reducer_override sees only objects that are not atomic
    (int, str, tuple, dict, ... never reach it), so plain data pickles at C speed."""

    def __init__(self, file, tensors, fds):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors
        self._fds = fds
        # multiprocessing's own reducers (its Connections, sockets, and what libraries
        # registered with ForkingPickler) keep working for what forksafe does not take.
        self.dispatch_table = _dispatch_table()

    def _add_tensor(self, t):
        self._tensors.append(t)
        return len(self._tensors) - 1

    def _add_object(self, kind, block_or_obj):
        data, fds = block_or_obj._handle._encode()
        first = len(self._fds)
        self._fds.extend(fds)
        return _load_item, (kind, type(block_or_obj), data, first, len(fds),
                            block_or_obj._extra())

    def reducer_override(self, obj):
        cls = type(obj)
        if cls is Tensor:
            if obj.device == "cpu" and not obj.is_shared():
                # A shared copy crosses; the tensor itself stays where it is (moving it would
                # free the memory that numpy or DLPack views of it still point at).
                obj = _mp.share_memory_(obj.clone())
            return _load_item, ("T", self._add_tensor(obj))
        np = _np or _numpy()
        if np is not None and cls is np.ndarray:
            if obj.dtype.hasobject:
                return NotImplemented
            fs = _forksafe_tensor_of_array(obj)
            if fs is None:  # a private array: a copy crosses, the receiver's own (writable)
                flags = 0
                obj = share_memory(obj)
                fs = _forksafe_tensor_of_array(obj)
            else:  # shared on purpose: the same memory; a read-only view arrives read-only
                flags = _N_SHARED if obj.flags.writeable else _N_SHARED | _N_READ_ONLY
            offset = obj.__array_interface__["data"][0] - fs.data_ptr()
            dtype = obj.dtype.str if obj.dtype.fields is None else obj.dtype  # fields travel
            return _load_item, ("N", self._add_tensor(fs), dtype, obj.shape, obj.strides, offset,
                                flags)
        torch = _torch or _torch_module()
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._reduce_torch(torch, obj)
        if isinstance(obj, Shareable):
            return self._add_object("O", obj)
        if isinstance(obj, _CTYPES):  # RawValue / RawArray: their shared block crosses
            block = getattr(obj, "_forksafe_block", None)
            return self._add_object("R", block) if block is not None else NotImplemented
        if cls is _FunctionType:
            # Functions pickle by name: a lambda or a local function cannot be found by the
            # receiver. Say so here, with the name, not with pickle's error deep inside.
            qualname = obj.__qualname__
            if "<lambda>" in qualname or "<locals>" in qualname:
                raise InvalidArgumentError(
                    f"{obj.__module__}.{qualname} cannot be sent to another process: lambdas and "
                    "functions defined inside functions have no importable name. Define it at "
                    "the top level of a module (the main script works) and pass that.")
        return NotImplemented

    def _reduce_torch(self, torch, obj):
        # is_cpu, not device.type: 30 ns against 210 per tensor (a Pool chunk holds hundreds).
        if not obj.is_cpu:
            return NotImplemented  # torch's reductions (CUDA tensors: torch's CUDA IPC)
        if obj.layout is not torch.strided or obj.is_quantized:
            # Sparse and quantized tensors: torch's own pickling (torch.multiprocessing's
            # reducer cannot send them). A sparse tensor's indices and values come back here
            # and cross through shared memory; a quantized one's bytes are copied.
            return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        if obj.is_conj() or obj.is_neg():
            # A lazily conjugated or negated view: its memory alone would give the wrong
            # values. It crosses as a resolved (shared) copy.
            obj = obj.resolve_conj().resolve_neg()
        if obj.requires_grad and not obj.is_leaf:
            raise InvalidArgumentError(
                "a torch tensor that requires grad and is not a leaf cannot cross processes "
                "(its graph stays here); send tensor.detach()")
        cls = type(obj)
        plain = cls is torch.Tensor or cls is torch.nn.Parameter
        parameter = cls is torch.nn.Parameter or (not plain and
                                                  isinstance(obj, torch.nn.Parameter))
        if obj.numel() == 0:  # no memory to share (its address may be null): the shape crosses
            rebuilt = (_rebuild_empty_torch, (_dtype_name(obj.dtype), tuple(obj.size()),
                                              obj.stride(), obj.requires_grad, parameter))
        else:
            entry = _shared_record(obj)
            meta = _torch_meta(obj, entry[2], parameter)
            rebuilt = (_load_item, ("P", self._add_tensor(entry[0])) + meta)
        if plain:
            return rebuilt
        # A subclass (as_subclass, a Parameter's subclass) crosses as torch sends it: its class
        # and attributes over the same shared memory (a Parameter's subclass as a Parameter).
        state = getattr(obj, "__dict__", None) or None
        return _rebuild_subclass, (None if parameter else cls, state) + rebuilt


_FunctionType = types.FunctionType
_dtype_names = {}


def _dtype_name(dtype):
    # "float32" for torch.float32, str() of a torch dtype made once per dtype, not per message.
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype)[6:]
    return name


_dispatch_cache = ({}, {}, {})
_ForkingPickler = None


def _dispatch_table():
    """copyreg's reducers with ForkingPickler's on top, merged once and again whenever either
    changed: compared whole (0.6 us with torch's 78 reducers), since a reducer replaced or
    removed and another added leaves the sizes as they were (a cache keyed on the sizes kept
    the first reducer for good)."""
    global _dispatch_cache, _ForkingPickler
    # Imported once, not per message (with _dtype_name: dumps 5.3 -> 4.7 us).
    if _ForkingPickler is None:
        from multiprocessing.reduction import ForkingPickler as _ForkingPickler
    extra = _ForkingPickler._extra_reducers
    seen_copyreg, seen_extra, table = _dispatch_cache
    if seen_extra != extra or seen_copyreg != copyreg.dispatch_table or not table:
        seen_copyreg, seen_extra = dict(copyreg.dispatch_table), dict(extra)
        table = dict(seen_copyreg)
        table.update(seen_extra)
        _dispatch_cache = (seen_copyreg, seen_extra, table)
    return table

# What the message being unpickled on this thread carries out of band (loads sets it).
_loading = threading.local()


_N_READ_ONLY = 1  # "N" items' flags
_N_SHARED = 2


def _load_item(kind, *args):
    # loads' shortcut for a message with nothing out of band sets no items: none are needed.
    tensors, fds, used = getattr(_loading, "items", None) or ((), (), set())
    if kind == "T":
        return tensors[args[0]]
    if kind == "P":
        return _rebuild_torch(tensors[args[0]], *args[1:])
    if kind == "N":
        i, dtype, shape, strides, offset, flags = args
        np = _numpy() or __import__("numpy")
        base = np.asarray(tensors[i])
        if not flags & _N_SHARED:
            _mark_private(base)
        arr = np.ndarray(shape, dtype=np.dtype(dtype), buffer=base, offset=offset,
                         strides=strides)
        if flags & _N_READ_ONLY:
            arr.flags.writeable = False
        return arr
    if kind in ("O", "R"):
        cls, data, first, n, extra = args
        taken = fds[first:first + n]
        used.update(range(first, first + n))
        obj = cls._rebuild(cls._handle_type()._decode(data, taken), extra)
        return obj.obj if kind == "R" else obj
    raise pickle.UnpicklingError(f"unknown out-of-band item {kind!r}")


# ---- one torch tensor: the fast form -----------------------------------------------------------
#
# A message that is one plain CPU torch tensor (the round trip of a shared tensor, a fresh
# tensor's send) skips the pickler: its bytes are _FAST followed by a pickle of the tensor's
# metadata only, and its one out-of-band tensor is the shared memory. A pickle never starts with
# _FAST (protocol 2 and up start with PROTO, 0x80), so loads tells the two apart by the first
# byte. Everything else (a subclass such as Parameter, a view that is conjugated or negated, a
# tensor that requires grad and is not a leaf, an empty tensor, sparse, quantized or device
# tensors) takes the pickler, which says what is wrong where something cannot cross. A message
# of one plain value (int, float, str, bytes, None, ...) cannot hold anything out of band and
# takes the C pickler alone. Measured (/usr/bin/python3, one process, a shared 4 KiB float32
# tensor): dumps + loads 11.4 -> 5.0 us; a float 2.5 -> 0.7 us; docs/peers.md has the round trip.

_FAST = b"\x00"
_ATOMIC = frozenset((int, float, bool, complex, str, bytes, type(None)))
_FAST_BYTE = _FAST[0]


def _dumps_torch(obj):
    """The fast form of torch tensor `obj` (exact type torch.Tensor), or None for the pickler."""
    if (not obj.is_cpu or obj.layout is not _torch.strided or obj.is_quantized or obj.is_conj()
            or obj.is_neg() or (obj.requires_grad and not obj.is_leaf) or obj.numel() == 0):
        return None
    entry = _shared_record(obj)
    meta = _torch_meta(obj, entry[2], False)
    return _FAST + pickle.dumps(meta, pickle.HIGHEST_PROTOCOL), [entry[0]], []


def _torch_meta(obj, nbytes, parameter):
    """_rebuild_torch's arguments after its first for torch tensor `obj` over forksafe memory of
    `nbytes`: dtype, size, stride, offset, requires_grad, parameter, and whether it is flat (one
    dimension, contiguous, the whole memory: the receiver makes it with one torch op)."""
    size = tuple(obj.size())
    stride = obj.stride()
    offset = obj.storage_offset()
    flat = (offset == 0 and stride == (1,) and size[0] * obj.element_size() == nbytes)
    return (_dtype_name(obj.dtype), size, stride, offset, obj.requires_grad, parameter, flat)


def dumps(obj):
    """(bytes, tensors, fds): `obj` pickled with its out-of-band items. The fds are new and the
    caller's to close (close_fds)."""
    cls = type(obj)
    if cls in _ATOMIC:  # nothing out of band can be inside: the C pickler alone (0.2 us, not 1)
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), [], []
    torch = _torch or _torch_module()
    if torch is not None and cls is torch.Tensor:
        fast = _dumps_torch(obj)
        if fast is not None:
            return fast
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
    if not fds:
        if not tensors:  # nothing out of band (a number, a string, a list of them, ...)
            return pickle.loads(data)
        if len(tensors) == 1 and data and data[0] == _FAST_BYTE:
            return _rebuild_torch(tensors[0], *pickle.loads(data[1:]))
    used = set()
    previous = getattr(_loading, "items", None)
    _loading.items = (tensors, fds, used)
    try:
        return pickle.loads(data)
    finally:
        _loading.items = previous
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
    _spawn_local.depth = getattr(_spawn_local, "depth", 0) + 1
    try:
        data, tensors, fds = dumps(obj)
    finally:
        _spawn_local.depth -= 1
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
    _pending_spawn_fds().extend(fds)
    return _spawn_rebuild, (data, blobs, n_message_fds, dup)


# Per thread: the start() that pickled them (on this thread) closes them once its child has them.
_spawn_local = threading.local()


def in_spawn_reduce():
    """True while spawn_reduce pickles on this thread (an object met again inside it reduces
    as itself, through the same pickler and memo)."""
    return getattr(_spawn_local, "depth", 0) > 0


def _pending_spawn_fds():
    fds = getattr(_spawn_local, "fds", None)
    if fds is None:
        fds = _spawn_local.fds = []
    return fds


def close_pending_spawn_fds():
    """Closes the descriptors spawn_reduce lent to the child this thread just launched."""
    fds = _pending_spawn_fds()
    taken = list(fds)
    del fds[:]
    close_fds(taken)


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


class _TeachTorchOnImport:
    """A finder that only watches for torch's import (a program that imports forksafe first):
    once torch's module has run, _teach_torch runs, before the program can call share_memory_()."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            run = loader.exec_module

            def exec_module(module):
                run(module)
                _torch_module()

            loader.exec_module = exec_module
        return spec


# torch.Tensor.share_memory_() is on forksafe's memory from here on (model.share_memory() before
# the workers start: _teach_torch), whether torch was imported before forksafe or is later.
if _torch_module() is None:
    sys.meta_path.insert(0, _TeachTorchOnImport())
