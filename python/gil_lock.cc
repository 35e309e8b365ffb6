// Python.h first: it sets feature macros that the C library's headers read.
#include <Python.h>

#include "python/gil_lock.h"

#include <unistd.h>

#include <vector>

#include "forksafe/runtime/error.h"

namespace forksafe::python {
namespace {

// One level of holding taken by Lock or TryLockFor on this thread.
struct Level {
  bool ensured = false;  // taken with PyGILState_Ensure (else nothing to give back)
  PyGILState_STATE state = PyGILState_UNLOCKED;
  pid_t pid = 0;  // the process that took it
  // Whether PyGILState_Ensure made this thread's thread state (a thread Python did not know):
  // a child forked by such a thread keeps the GIL on it (see the header).
  bool created_thread_state = false;
};

thread_local std::vector<Level> t_levels;
// The forking thread's state while SuspendForPrepare has let go of the GIL (forks are one at a
// time: the registry serializes them).
thread_local PyThreadState* t_suspended = nullptr;

GilFrameworkLock* g_installed = nullptr;
// The process in which Unlock last ran PyOS_AfterFork_Child (once per child).
pid_t g_after_fork_child_ran = 0;

}  // namespace

bool ThisThreadHoldsTheGil() {
  // The current thread state (process-wide in 3.11) was made on this thread: this thread holds
  // the GIL, in whichever interpreter. (PyGILState_Check answers 1 for every thread once a
  // subinterpreter exists.)
  PyThreadState* current = _PyThreadState_UncheckedGet();
  return current != nullptr && current->thread_id == PyThread_get_thread_ident();
}

namespace {

// Whether the interpreter can hand out the GIL: initialized and not finalizing.
bool PythonAlive() {
  if (!Py_IsInitialized()) return false;
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsFinalizing();
#else
  return !_Py_IsFinalizing();
#endif
}

}  // namespace

void GilFrameworkLock::Lock() {
  Level level;
  level.pid = getpid();
  if (PythonAlive()) {
    level.ensured = true;
    level.created_thread_state = PyGILState_GetThisThreadState() == nullptr;
    level.state = PyGILState_Ensure();
  }
  t_levels.push_back(level);
}

bool GilFrameworkLock::TryLockFor(std::chrono::nanoseconds) {
  if (t_suspended != nullptr) {
    // The forking thread's own holding, let go of for the prepare: back to it.
    PyThreadState* tstate = t_suspended;
    t_suspended = nullptr;
    PyEval_RestoreThread(tstate);
    t_levels.push_back(Level{false, PyGILState_UNLOCKED, getpid(), false});
    return true;
  }
  Lock();
  return true;
}

void GilFrameworkLock::Unlock() {
  if (t_levels.empty()) {
    throw runtime::Error(runtime::ErrorCode::kFailedPrecondition,
                         "the GIL framework lock was unlocked by a thread that did not lock it");
  }
  const Level level = t_levels.back();
  t_levels.pop_back();
  if (!level.ensured || !PythonAlive()) return;
  const pid_t me = getpid();
  if (level.pid != me && g_after_fork_child_ran != me) {
    // A child whose fork this thread made without holding the GIL before: CPython's own child
    // bookkeeping runs here (once), while the thread holds the GIL as it expects. Giving back the
    // GIL copied from the parent would wait for ever if another thread had asked for it at the
    // fork (its drop request survives in the copy); PyOS_AfterFork_Child builds a fresh one.
    g_after_fork_child_ran = me;
    PyOS_AfterFork_Child();
  }
  if (level.pid != me && level.created_thread_state) {
    // Keep the thread state that Ensure made: PyOS_AfterFork_Child deleted every other one, and
    // an interpreter left without any would hand out its used initial one next (a fatal error
    // in 3.11). Only the GIL goes back; PyGILState_Ensure finds this state again.
    PyEval_SaveThread();
    return;
  }
  PyGILState_Release(level.state);
}

bool GilFrameworkLock::HeldByCurrentThread() const {
  return PythonAlive() && ThisThreadHoldsTheGil();
}

void GilFrameworkLock::ResetInChild() {
  // The forking thread is the child's only thread and holds the GIL (TryLockFor): nothing to
  // rebuild here; PyOS_AfterFork_Child rebuilds the GIL itself.
  t_suspended = nullptr;
}

bool GilFrameworkLock::SuspendForPrepare() {
  if (!PythonAlive() || !ThisThreadHoldsTheGil()) return false;
  t_suspended = PyEval_SaveThread();
  return true;
}

bool InstallGilFrameworkLock() {
  if (g_installed != nullptr) return true;
  runtime::FrameworkLock& current = runtime::GetFrameworkLock();
  if (dynamic_cast<runtime::DefaultFrameworkLock*>(&current) == nullptr) return false;
  // Never destroyed: a fork from a C++ thread may still use it while the interpreter exits.
  static GilFrameworkLock* lock = new GilFrameworkLock();
  runtime::SetFrameworkLock(lock);
  g_installed = lock;
  return true;
}

void UninstallGilFrameworkLock() {
  if (g_installed == nullptr) return;
  if (&runtime::GetFrameworkLock() == g_installed) runtime::SetFrameworkLock(nullptr);
  g_installed = nullptr;
}

const char* FrameworkLockKind() {
  runtime::FrameworkLock& current = runtime::GetFrameworkLock();
  if (g_installed != nullptr && &current == g_installed) return "gil";
  if (dynamic_cast<runtime::DefaultFrameworkLock*>(&current) != nullptr) return "default";
  return "custom";
}

}  // namespace forksafe::python
