// python/nogil.h: the GIL released around a C++ call, safely at interpreter exit.
//
// What it offers
//   NoGil: releases the GIL for its scope and takes it back at the end, as pybind11's
//   gil_scoped_release; usable as py::call_guard<NoGil>. Every call of the extension that
//   releases the GIL uses it.
//
// Why not pybind11's
//   At interpreter exit, a daemon thread that takes the GIL back is ended by CPython with
//   pthread_exit, which unwinds the thread's stack (a forced unwind). gil_scoped_release takes the
//   GIL back in its destructor, which is noexcept: the unwind reached it there and called
//   std::terminate, so a program whose daemon thread was blocked in a forksafe wait (Queue.get,
//   Event.wait, Lock.acquire, Connection.recv) when it ended aborted ("terminate called without an
//   active exception", exit code 134) instead of exiting with its own status.
//
// Guarantees
//   NoGil's destructor lets that unwind pass (noexcept(false)): the thread ends as CPython means
//   it to, running the destructors of the C++ frames it leaves. Where the destructor runs while
//   another exception unwinds (a second one would terminate too) and the interpreter is
//   finalizing, the thread sleeps until the process exits instead of taking the GIL back.
//
// WithoutGil(fn) runs fn with the GIL released when this thread holds it, for what is destroyed
// from a Python object's deallocation, and NoGilHolder<T> is the pybind11 holder that destroys
// its object that way. The last reference to shared memory or a shared segment takes forksafe's
// internal locks (the shared arena's), which a fork's prepare holds while it waits to take the
// GIL last: a thread that freed a tensor with the GIL held while another forked deadlocked both.
//
// Hazard: code inside a NoGil scope must not touch Python objects (take py::gil_scoped_acquire).
// Hazard: WithoutGil runs under noexcept destructors (pybind11's holders, DLPack deleters), so it
// keeps the GIL once the interpreter is finalizing; a daemon thread whose deallocation is under
// way at the very moment finalization starts could still meet CPython's forced unwind there.
#ifndef FORKSAFE_PYTHON_NOGIL_H_
#define FORKSAFE_PYTHON_NOGIL_H_

#include <Python.h>
#include <unistd.h>

#include <exception>
#include <memory>

namespace forksafe::python {

class NoGil {
 public:
  NoGil() : state_(PyEval_SaveThread()) {}
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

  /// Takes the GIL back; may end the thread (see the file comment) by an exception that is not
  /// an error: it must be let through, never caught without rethrowing.
  ~NoGil() noexcept(false) {
    if (std::uncaught_exceptions() > 0 && _Py_IsFinalizing()) {
      for (;;) pause();  // the process is exiting; a second exception here would abort it
    }
    PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

/// Runs fn() without the GIL if this thread holds it (and the interpreter is not finalizing).
template <class Fn>
void WithoutGil(Fn&& fn) {
  if (!Py_IsInitialized() || _Py_IsFinalizing() || !PyGILState_Check()) {
    fn();
    return;
  }
  PyThreadState* state = PyEval_SaveThread();
  fn();
  PyEval_RestoreThread(state);
}

/// The deleter of NoGilHolder.
template <class T>
struct DeleteWithoutGil {
  void operator()(T* p) const {
    WithoutGil([p] { delete p; });
  }
};

/// A pybind11 holder (py::class_<T, NoGilHolder<T>>) that destroys its object without the GIL.
template <class T>
using NoGilHolder = std::unique_ptr<T, DeleteWithoutGil<T>>;

}  // namespace forksafe::python

#endif  // FORKSAFE_PYTHON_NOGIL_H_
