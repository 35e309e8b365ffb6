"""The package: import, version, errors, bad input (python/forksafe, python/module.cc)."""
import re
import threading

import pytest

import forksafe
from forksafe import _forksafe


def test_version_is_the_librarys():
    assert re.fullmatch(r"\d+\.\d+\.\d+", forksafe.__version__), forksafe.__version__
    assert forksafe.__version__ == _forksafe.version()


def test_import_makes_the_gil_the_framework_lock_and_registers_the_handlers():
    assert forksafe.framework_lock() == "gil"
    names = _forksafe.handler_names()
    assert "openmp" in names, names


def test_every_error_code_has_its_class_and_raises_it():
    for code in _forksafe.error_code_names():
        cls = forksafe.errors.BY_CODE[code]
        with pytest.raises(cls) as info:
            _forksafe._raise_for_test(code, "what went wrong; what to do")
        assert isinstance(info.value, forksafe.Error)
        assert info.value.code == code
        assert info.value.message == "what went wrong; what to do"
        assert str(info.value) == f"{code}: what went wrong; what to do"


def test_errors_are_the_builtin_exceptions_python_users_catch():
    assert issubclass(forksafe.InvalidArgumentError, ValueError)
    assert issubclass(forksafe.DeadlineExceededError, TimeoutError)
    assert issubclass(forksafe.NotFoundError, LookupError)
    assert issubclass(forksafe.ClosedError, EOFError)
    assert issubclass(forksafe.ClosedError, ValueError)  # a closed Queue, as in multiprocessing


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_threads=-1), "thread"),
    (dict(drain_deadline=-1.0), "drain_deadline"),
    (dict(drain_deadline=float("nan")), "drain_deadline"),
])
def test_bad_pool_arguments_are_clear_errors(kwargs, words):
    with pytest.raises(forksafe.InvalidArgumentError, match=words):
        forksafe.ThreadPool(**kwargs)


def test_bad_calls_are_clear_errors():
    with forksafe.ThreadPool(1) as pool:
        with pytest.raises(forksafe.InvalidArgumentError, match="callable"):
            pool.submit(42)
    with pytest.raises(forksafe.FailedPreconditionError, match="closed"):
        pool.submit(print)
    with pytest.raises(forksafe.InvalidArgumentError, match="cpu"):
        forksafe.set_default_device("tpu:0")


def test_pool_runs_python_callables_and_carries_their_exceptions():
    with forksafe.ThreadPool(2, name="calls") as pool:
        assert pool.submit(pow, 2, 10).result(10) == 1024
        assert pool.map(lambda a, b: a * b, range(5), range(5), timeout=10) == [0, 1, 4, 9, 16]
        f = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            f.result(10)
        assert isinstance(f.exception(10), ZeroDivisionError)
        assert pool.submit(dict, a=1).result(10) == {"a": 1}
        pool.wait()  # a task counts as completed just after its result is set
        assert pool.stats()["tasks_completed"] == 8
        assert pool.stats()["task_exceptions"] == 0  # a Python exception is the task's result


def test_result_with_a_timeout_raises_timeout_error_and_can_be_retried():
    gate = threading.Event()
    with forksafe.ThreadPool(1) as pool:
        f = pool.submit(gate.wait, 30)
        with pytest.raises(TimeoutError):
            f.result(0.05)
        assert not f.done()
        gate.set()
        assert f.result(30) is True


def test_closing_runs_what_is_queued():
    ran = []
    pool = forksafe.ThreadPool(1)
    for i in range(20):
        pool.submit(ran.append, i)
    pool.close()
    pool.close()  # idempotent
    assert ran == list(range(20))
    assert pool.closed
