// python/module.cc: forksafe._forksafe, the CPython extension under the `forksafe` package.
//
// A thin adapter over libforksafe.so (the process's one forksafe: a framework loaded in the same
// process shares its registry). The behaviour lives in C++; this file gives it Python's shapes:
// errors become the exception classes of forksafe/errors.py, blocking calls release the GIL, and
// Python callables run on forksafe's threads with the GIL taken for them. Loading it makes the
// GIL the framework lock (python/gil_lock.h) and registers forksafe's at-fork handlers (the
// OpenMP one among them) for every fork of the process.
#include <errno.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/device/registry.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/cpu_budget.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/openmp_fork.h"
#include "forksafe/runtime/thread_pool.h"
#include "forksafe/version.h"
#include "python/errors.h"
#include "python/gil_lock.h"
#include "python/mp.h"
#include "python/nogil.h"
#include "python/tensor.h"

namespace py = pybind11;

namespace forksafe::python {
namespace {

using runtime::Error;
using runtime::ErrorCode;

// forksafe.errors' classes by ErrorCodeName, set once by forksafe/__init__.py.
py::dict* g_error_classes = nullptr;

constexpr ErrorCode kAllCodes[] = {
    ErrorCode::kInvalidArgument,   ErrorCode::kNotFound,
    ErrorCode::kAlreadyExists,     ErrorCode::kFailedPrecondition,
    ErrorCode::kForkPoisoned,      ErrorCode::kUnavailable,
    ErrorCode::kResourceExhausted, ErrorCode::kDeadlineExceeded,
    ErrorCode::kCancelled,         ErrorCode::kClosed,
    ErrorCode::kOwnerDied,         ErrorCode::kProcessFailed,
    ErrorCode::kInternal,
};

// ---------------------------------------------------------------------------------------------
// A Python callable run on a forksafe thread, and its result.

// What a task left: a value or an exception (set with the GIL held, read with the GIL held).
// Deleted with the GIL held: it owns Python objects and may be released last by a worker.
struct Outcome {
  uint64_t generation = runtime::ForkGeneration();  // the process that submitted the task
  // Guards no field of its own: `done` is atomic, set under mu so that a waiter that checked it
  // under mu cannot miss the notify.
  runtime::internal::Mutex mu;
  runtime::internal::CondVar cv;
  // Set under mu, read without it too (in a forked child `mu` may be a copy held by a thread
  // that does not exist there).
  std::atomic<bool> done{false};
  py::object value;  // touched with the GIL held only
  py::object error;  // the exception instance, if the call raised
};

template <typename T>
std::shared_ptr<T> GilDeleted(T* p) {
  return std::shared_ptr<T>(p, [](T* q) {
    if (!Py_IsInitialized()) return;  // the interpreter is gone: leak rather than crash
    py::gil_scoped_acquire gil;
    delete q;
  });
}

// A callable with its arguments.
struct Call {
  py::object fn;
  py::tuple args;
  py::dict kwargs;
};

// The result of ThreadPool.submit: result(timeout), exception(timeout), done().
class Future {
 public:
  explicit Future(std::shared_ptr<Outcome> o) : o_(std::move(o)) {}

  bool done() const { return o_->done.load(); }

  // Waits (GIL released) for the outcome; TimeoutError (DeadlineExceededError) when `timeout`
  // seconds pass first.
  void WaitFor(std::optional<double> timeout) const {
    bool finished;
    if (!done() && runtime::ForkGeneration() != o_->generation) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "this Future belongs to a task of the parent process that had not finished at "
                  "the fork; the task runs in the parent only, so its result never comes here");
    }
    {
      NoGil nogil;
      runtime::internal::MutexLock lk(&o_->mu);
      finished = true;
      if (timeout.has_value()) {
        // As std::condition_variable::wait_for with a predicate: one steady-clock deadline.
        const auto until = std::chrono::steady_clock::now() +
                           std::chrono::ceil<std::chrono::steady_clock::duration>(
                               std::chrono::duration<double>(*timeout));
        while (!o_->done.load()) {
          if (!o_->cv.WaitUntil(&lk, until)) {
            finished = o_->done.load();
            break;
          }
        }
      } else {
        while (!o_->done.load()) o_->cv.Wait(&lk);
      }
    }
    if (!finished) {
      throw Error(ErrorCode::kDeadlineExceeded,
                  "the task has not finished within the timeout; call result() again to wait "
                  "longer");
    }
  }

  py::object result(std::optional<double> timeout) const {
    WaitFor(timeout);
    if (o_->error) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(o_->error.ptr())), o_->error.ptr());
      throw py::error_already_set();
    }
    return o_->value;
  }

  py::object exception(std::optional<double> timeout) const {
    WaitFor(timeout);
    return o_->error ? o_->error : py::none();
  }

 private:
  std::shared_ptr<Outcome> o_;
};

// Runs `call` on this (forksafe) thread with the GIL and records its outcome.
void RunCall(const std::shared_ptr<Call>& call, const std::shared_ptr<Outcome>& out) {
  if (!Py_IsInitialized()) return;
  {
    py::gil_scoped_acquire gil;
    try {
      out->value = call->fn(*call->args, **call->kwargs);
    } catch (py::error_already_set& e) {
      e.restore();
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb);
      PyErr_NormalizeException(&type, &value, &tb);
      if (tb != nullptr) PyException_SetTraceback(value, tb);
      out->error = py::reinterpret_steal<py::object>(value);
      Py_XDECREF(type);
      Py_XDECREF(tb);
    }
  }
  runtime::internal::MutexLock lk(&out->mu);
  out->done = true;
  out->cv.NotifyAll();
}

// Destroys a pool on the thread that lets go of its last reference: with the GIL released (the
// destructor joins workers that may be waiting for the GIL), and never on one of the pool's own
// workers (it would wait for itself): there, on a thread of its own.
void DestroyPool(runtime::ThreadPool* pool) {
  if (pool->OnThisPoolsWorker()) {
    std::thread([pool] { delete pool; }).detach();
    return;
  }
  if (Py_IsInitialized() && ThisThreadHoldsTheGil()) {
    NoGil nogil;
    delete pool;
    return;
  }
  delete pool;
}

// forksafe.ThreadPool: runtime::ThreadPool for Python callables. Every call that can wait (for
// the pool's lock, which a fork holds, or for tasks) runs with the GIL released, on its own
// reference to the pool, so that close() on another thread cannot free the pool under it.
class PyThreadPool {
 public:
  explicit PyThreadPool(const runtime::ThreadPoolOptions& options) {
    NoGil nogil;  // registering waits for a fork in progress
    pool_ = std::shared_ptr<runtime::ThreadPool>(new runtime::ThreadPool(options), &DestroyPool);
  }
  PyThreadPool(const PyThreadPool&) = delete;
  PyThreadPool& operator=(const PyThreadPool&) = delete;

  bool closed() const { return !pool_; }

  // A reference to the pool, taken with the GIL held; kFailedPrecondition once closed.
  std::shared_ptr<runtime::ThreadPool> get() const {
    if (!pool_) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "the ThreadPool is closed; create a new one (or use it in a with-block)");
    }
    return pool_;
  }

  Future Submit(py::object fn, py::args args, py::kwargs kwargs) {
    if (!PyCallable_Check(fn.ptr())) {
      throw Error(ErrorCode::kInvalidArgument,
                  "ThreadPool.submit needs a callable as its first argument, got " +
                      std::string(py::str(py::type::of(fn))));
    }
    auto call = GilDeleted(new Call{std::move(fn), py::tuple(args), py::dict(kwargs)});
    auto out = GilDeleted(new Outcome());
    std::shared_ptr<runtime::ThreadPool> p = get();
    NoGil nogil;
    p->Post([call, out] { RunCall(call, out); });
    return Future(out);
  }

  void Wait() {
    std::shared_ptr<runtime::ThreadPool> p = get();
    NoGil nogil;
    p->Wait();
  }

  // Runs what is queued, then joins the workers (once no other call still uses the pool).
  void Close() {
    if (pool_ && pool_->OnThisPoolsWorker()) {
      throw Error(ErrorCode::kFailedPrecondition,
                  "ThreadPool.close() was called from one of the pool's own tasks; it would wait "
                  "for itself: close the pool from another thread");
    }
    std::shared_ptr<runtime::ThreadPool> p = std::move(pool_);
    NoGil nogil;
    p.reset();
  }

  // fn(pool) with the GIL released (the pool's lock may be held by a fork).
  template <typename Fn>
  auto Apply(Fn fn) const {
    std::shared_ptr<runtime::ThreadPool> p = get();
    NoGil nogil;
    return fn(*p);
  }

 private:
  std::shared_ptr<runtime::ThreadPool> pool_;
};

// For the test hooks: waits for child `pid` at most `timeout` seconds. Its exit status (128 +
// the signal for a signal), or -1 after killing it when it outlived the timeout.
int WaitBounded(pid_t pid, double timeout) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
  int status = 0;
  for (;;) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (done < 0 && errno != EINTR) return -3;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

py::dict StatsDict(const runtime::ThreadPoolStats& s) {
  py::dict d;
  d["tasks_completed"] = s.tasks_completed;
  d["task_exceptions"] = s.task_exceptions;
  d["forks_drained"] = s.forks_drained;
  d["drain_timeouts"] = s.drain_timeouts;
  d["exit_waits"] = s.exit_waits;
  d["rebuilt_in_child"] = s.rebuilt_in_child;
  return d;
}

py::dict ReportDict(const runtime::ForkReport& r) {
  py::list events;
  for (const runtime::ForkEvent& e : r.events) {
    py::dict ev;
    ev["kind"] = runtime::ForkEventKindName(e.kind);
    ev["subsystem"] = e.subsystem;
    ev["detail"] = e.detail;
    events.append(ev);
  }
  py::dict d;
  d["fork_number"] = r.fork_number;
  d["attempts"] = r.attempts;
  d["events"] = events;
  d["clean"] = r.clean();
  d["text"] = r.ToString();
  return d;
}

}  // namespace

void RaiseError(const Error& e) {
  const char* name = runtime::ErrorCodeName(e.code());
  try {
    if (g_error_classes != nullptr && g_error_classes->contains(name)) {
      py::object cls = (*g_error_classes)[name];
      py::object exc = cls(e.message(), name);
      PyErr_SetObject(cls.ptr(), exc.ptr());
      return;
    }
  } catch (py::error_already_set& failed) {
    failed.restore();  // building the exception failed (out of memory): raise that instead
    return;
  }
  PyErr_SetString(PyExc_RuntimeError, e.what());
}

}  // namespace forksafe::python

PYBIND11_MODULE(_forksafe, m) {
  using namespace forksafe;
  using namespace forksafe::python;
  m.doc() = "forksafe's C++ runtime, for the forksafe package (import forksafe, not this)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const runtime::Error& e) {
      RaiseError(e);
    }
  });

  m.def(
      "version", [] { return std::string(forksafe::Version()); },
      "The version of the libforksafe.so this module runs on.");
  m.def("error_code_names", [] {
    std::vector<std::string> names;
    for (runtime::ErrorCode c : kAllCodes) names.emplace_back(runtime::ErrorCodeName(c));
    return names;
  });
  m.def("_set_error_classes", [](py::dict classes) {
    if (g_error_classes == nullptr) g_error_classes = new py::dict();  // lives as long as Python
    *g_error_classes = std::move(classes);
  });
  m.def("_raise_for_test", [](const std::string& code, const std::string& message) {
    for (runtime::ErrorCode c : kAllCodes) {
      if (code == runtime::ErrorCodeName(c)) throw runtime::Error(c, message);
    }
    throw runtime::Error(runtime::ErrorCode::kInvalidArgument, "no error code named " + code);
  });

  // The fork protocol.
  m.def("install_gil_framework_lock", &InstallGilFrameworkLock);
  m.def("uninstall_gil_framework_lock", &UninstallGilFrameworkLock);
  m.def("framework_lock_kind", [] { return std::string(FrameworkLockKind()); });
  // Every call that may wait for the registry's lock (a fork holds it) releases the GIL, or a
  // fork that let go of the GIL could never take it back (python/gil_lock.h, Hazards).
  using ReleaseGil = py::call_guard<NoGil>;
  m.def("last_fork_report", [] {
    runtime::ForkReport r;
    {
      NoGil nogil;
      r = runtime::AtForkRegistry::Get().LastReport();
    }
    return ReportDict(r);
  });
  m.def(
      "fork_count", [] { return runtime::AtForkRegistry::Get().fork_count(); }, ReleaseGil());
  m.def(
      "handler_names", [] { return runtime::AtForkRegistry::Get().HandlerNames(); }, ReleaseGil());
  m.def("fork_generation", [] { return runtime::ForkGeneration(); });
  m.def(
      "openmp_usable", [] { return runtime::OpenMpUsableInThisProcess(); }, ReleaseGil());
  m.def("install_openmp_fork_handler", [] {
    NoGil nogil;
    runtime::InstallOpenMpForkHandler();
  });
  m.def("order_fork_handlers_after_openmp", [] {
    NoGil nogil;
    runtime::OrderForkHandlersAfterOpenMp();
  });
  m.def(
      "default_thread_count", [] { return runtime::DefaultThreadCount(); }, ReleaseGil());

  // Devices: the default device (the child of a fork gets "cpu").
  m.def(
      "default_device", [] { return device::DefaultDevice().ToString(); }, ReleaseGil());
  m.def(
      "set_default_device",
      [](const std::string& text) { device::SetDefaultDevice(device::ParseDevice(text)); },
      ReleaseGil());
  m.def(
      "rank_device",
      [](const std::string& type) {
        return device::RankDevice(device::ParseDevice(type).type).ToString();
      },
      py::arg("type"), ReleaseGil());
  m.def(
      "available_devices",
      [] {
        std::vector<std::string> out;
        for (const device::Device& d : device::AvailableDevices()) out.push_back(d.ToString());
        return out;
      },
      ReleaseGil());

  // For the tests: a fork made by a thread that Python does not know (a C++ thread of the
  // process). In the child, CPython's bookkeeping has run and the GIL is free
  // (python/gil_lock.h); with `run_python`, the thread takes it and runs Python code. Returns the
  // child's exit status (0: as expected), or -1 if it outlived `timeout` seconds (it is killed).
  m.def("_fork_from_a_cpp_thread_for_test", [](bool run_python, double timeout) {
    int result = -1;
    NoGil nogil;
    std::thread t([&] {
      const pid_t pid = fork();
      if (pid == 0) {
        // The child's bookkeeping ran (python/gil_lock.h); the GIL is free for this thread.
        int code = ThisThreadHoldsTheGil() ? 2 : 0;
        if (code == 0 && run_python) {
          PyGILState_STATE g = PyGILState_Ensure();
          code = PyRun_SimpleString("import forksafe\nassert sum(range(10)) == 45\n") == 0 ? 0 : 3;
          PyGILState_Release(g);
        }
        _exit(code);
      }
      if (pid > 0) result = WaitBounded(pid, timeout);
    });
    t.join();
    return result;
  });

  BindTensor(m);

  // For the tests: a fork made by this Python thread from C++ code that released the GIL. In the
  // child the thread takes the GIL back where it released it (it must be free there, and fresh:
  // CPython's bookkeeping has run) and runs Python. Returns the child's exit status (0: as
  // expected), or -1 if it outlived `timeout` seconds (it is killed).
  m.def("_fork_with_the_gil_released_for_test", [](double timeout) {
    pid_t pid;
    {
      NoGil nogil;
      pid = fork();
    }  // the child takes the GIL back here (PyEval_RestoreThread): it waits for ever if kept
    if (pid == 0) {
      const int rc = PyRun_SimpleString("import forksafe\nassert sum(range(10)) == 45\n");
      _exit(rc == 0 ? 0 : 3);
    }
    NoGil nogil;
    return pid < 0 ? -2 : WaitBounded(pid, timeout);
  });

  BindMp(m);

  py::class_<Future>(m, "Future")
      .def("done", &Future::done)
      .def("result", &Future::result, py::arg("timeout") = py::none())
      .def("exception", &Future::exception, py::arg("timeout") = py::none());

  py::class_<PyThreadPool>(m, "ThreadPool")
      .def(py::init([](int num_threads, const std::string& name, double drain_deadline) {
             if (!(drain_deadline >= 0)) {
               throw runtime::Error(runtime::ErrorCode::kInvalidArgument,
                                    "drain_deadline is in seconds and must be >= 0, got " +
                                        std::to_string(drain_deadline));
             }
             runtime::ThreadPoolOptions o;
             o.num_threads = num_threads;
             o.name = name;
             o.drain_deadline = std::chrono::milliseconds(
                 static_cast<int64_t>(std::min(drain_deadline, 86400.0) * 1000));
             return new PyThreadPool(o);
           }),
           py::arg("num_threads") = 0, py::arg("name") = "python", py::arg("drain_deadline") = 2.0)
      .def("submit", &PyThreadPool::Submit, py::arg("fn"))
      .def("wait", &PyThreadPool::Wait)
      .def("close", &PyThreadPool::Close)
      .def_property_readonly("closed", &PyThreadPool::closed)
      .def_property_readonly(
          "num_threads",
          [](const PyThreadPool& p) {
            return p.Apply([](runtime::ThreadPool& t) { return t.num_threads(); });
          })
      .def_property_readonly(
          "live_workers",
          [](const PyThreadPool& p) {
            return p.Apply([](runtime::ThreadPool& t) { return t.live_workers(); });
          })
      .def_property_readonly("name",
                             [](const PyThreadPool& p) {
                               return p.Apply([](runtime::ThreadPool& t) { return t.name(); });
                             })
      .def("stats", [](const PyThreadPool& p) {
        return StatsDict(p.Apply([](runtime::ThreadPool& t) { return t.stats(); }));
      });
}
