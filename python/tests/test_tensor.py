"""forksafe.Tensor with numpy and torch: DLPack both ways and the buffer protocol, no copies
(python/tensor.cc)."""
import gc
import sys

import numpy as np
import pytest

import forksafe
from conftest import run_forked


def test_creation_and_metadata():
    t = forksafe.Tensor.full([2, 3], 1.5, dtype="float64")
    assert t.shape == (2, 3) and t.strides == (3, 1)
    assert t.dtype == "float64" and t.device == "cpu" and t.ndim == 2
    assert t.numel() == 6 and t.nbytes == 48 and t.is_contiguous()
    assert np.asarray(t).tolist() == [[1.5] * 3] * 2
    assert forksafe.Tensor.zeros(4, dtype="int64").shape == (4,)
    assert set(forksafe._forksafe.dtypes()) >= {"float32", "float64", "int32", "int64", "uint8",
                                                "bool", "float16", "bfloat16"}


@pytest.mark.parametrize("dtype, np_dtype", [
    ("float32", np.float32), ("float64", np.float64), ("int32", np.int32), ("int64", np.int64),
    ("uint8", np.uint8), ("bool", np.bool_), ("float16", np.float16)])
def test_numpy_sees_the_tensor_through_the_buffer_protocol_without_a_copy(dtype, np_dtype):
    t = forksafe.Tensor.zeros([3, 4], dtype=dtype)
    a = np.asarray(t)
    assert a.dtype == np_dtype and a.shape == (3, 4)
    a[1, 2] = 1
    b = np.asarray(t)  # a second view of the same memory
    assert b[1, 2] == 1
    assert a.ctypes.data == t.data_ptr()


def test_a_strided_view_keeps_its_strides():
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = forksafe.from_dlpack(base[:, 1])  # a column: stride 4 elements
    assert t.shape == (3,) and t.strides == (4,) and not t.is_contiguous()
    assert np.asarray(t).tolist() == [1.0, 5.0, 9.0]


def test_from_dlpack_shares_a_numpy_arrays_memory_keeps_it_alive_and_lets_it_go():
    a = np.arange(6, dtype=np.int64)
    keep = a.base if a.base is not None else a
    refs = sys.getrefcount(keep)
    t = forksafe.from_dlpack(a)
    assert t.dtype == "int64" and t.shape == (6,)
    a[0] = 42
    assert np.asarray(t)[0] == 42
    del a
    gc.collect()
    assert np.asarray(t).tolist() == [42, 1, 2, 3, 4, 5]  # the array lives as long as t
    del t
    gc.collect()
    assert sys.getrefcount(keep) == refs - 1, "the producer's array was not given back"


def test_numpy_from_dlpack_of_a_forksafe_tensor():
    t = forksafe.Tensor.full([4], 2.0)
    a = np.from_dlpack(t)  # numpy 1.24 marks DLPack imports read-only
    np.asarray(t)[3] = 7.0
    assert a.tolist() == [2.0, 2.0, 2.0, 7.0]


def test_torch_shares_memory_both_ways():
    torch = pytest.importorskip("torch", reason="torch is not importable by /usr/bin/python3")
    t = forksafe.Tensor.zeros([2, 2])
    x = torch.from_dlpack(t)
    x[0, 1] = 3.0
    assert np.asarray(t)[0, 1] == 3.0
    y = torch.arange(5, dtype=torch.int32)
    u = forksafe.from_dlpack(y)
    y[4] = -1
    assert np.asarray(u).tolist() == [0, 1, 2, 3, -1]
    assert u.data_ptr() == y.data_ptr()


def test_bad_input_is_a_clear_error():
    with pytest.raises(forksafe.InvalidArgumentError, match="float32"):
        forksafe.Tensor.empty([2], dtype="complex64")
    with pytest.raises(forksafe.InvalidArgumentError, match="shape"):
        forksafe.Tensor.empty("abc")
    with pytest.raises(forksafe.InvalidArgumentError):
        forksafe.Tensor.empty([-1])
    with pytest.raises(forksafe.InvalidArgumentError, match="__dlpack__"):
        forksafe.from_dlpack(42)
    with pytest.raises(forksafe.InvalidArgumentError, match="bfloat16"):
        memoryview(forksafe.Tensor.zeros([2], dtype="bfloat16"))
    capsule = forksafe.Tensor.zeros([2]).__dlpack__()
    forksafe.from_dlpack(capsule)
    with pytest.raises(forksafe.InvalidArgumentError, match="consumed once"):
        forksafe.from_dlpack(capsule)
    with pytest.raises(forksafe.InvalidArgumentError, match="must be callable, got int"):
        forksafe.Tensor.zeros([2])._dlpack_with_release(42)
    if "sim:0" in forksafe.available_devices():
        with pytest.raises(forksafe.InvalidArgumentError, match="CPU only"):
            forksafe.Tensor.zeros([2], device="sim:0")._dlpack_with_release(lambda: None)


def test_an_unconsumed_capsule_gives_the_tensor_back():
    a = np.zeros(1000)
    refs = sys.getrefcount(a)
    t = forksafe.from_dlpack(a)  # holds one reference to `a` until its memory is let go
    for _ in range(100):
        t.__dlpack__()  # dropped at once: the capsule's destructor releases the export
    del t
    gc.collect()
    assert sys.getrefcount(a) == refs, "an export that nobody consumed was never released"


def test_a_tensor_is_readable_in_a_forked_child():
    t = forksafe.Tensor.full([3], 5.0)
    assert run_forked(lambda: 0 if np.asarray(t).tolist() == [5.0] * 3 else 1) == 0
