// python/gil_lock.h: CPython's GIL as forksafe's framework lock (the Python package's own; not
// installed as a C++ header).
//
// What it offers
//   GilFrameworkLock, the runtime::FrameworkLock that `import forksafe` installs: every fork in
//   the process is made with the GIL held by the forking thread, taken last in prepare (after
//   every pool, oneTBB and OpenMP are quiet) and given back first, as MindSpore holds it across
//   fork. C++ code of the process that takes forksafe's framework lock (FrameworkLockGuard)
//   takes the GIL.
//
// Guarantees
//   - os.fork() (and any fork from a thread that holds the GIL) lets go of the GIL as the fork
//     begins (SuspendForPrepare) and takes it back last: a pool task that needs the GIL while
//     os.fork() drains the pool finishes instead of running into the drain deadline. The thread
//     returns from fork() holding the GIL as it did before, in both processes; CPython's own
//     bookkeeping (PyOS_AfterFork_Child, os.register_at_fork hooks) runs as for any os.fork().
//   - A fork from a thread that does not hold the GIL takes it, through PyGILState_Ensure, so no
//     Python code runs in the parent at the fork instant; the parent gives it back after the
//     fork. In the child (a thread that Python did not know, or C++ code on a Python thread
//     inside Py_BEGIN_ALLOW_THREADS), the forking thread runs CPython's child bookkeeping
//     (PyOS_AfterFork_Child: a fresh GIL, the other threads' states gone, the
//     os.register_at_fork hooks) while it holds the GIL, then gives the GIL back: the child's
//     code takes it where it needs it (PyGILState_Ensure, Py_END_ALLOW_THREADS) and runs Python
//     at once. It must not call PyOS_AfterFork_Child again. Those hooks run before forksafe's
//     other child handlers (the framework lock is released first): a hook must not use forksafe's
//     pools or devices.
//   - Before Python is initialized and once it is finalizing, the lock holds nothing and every
//     call returns at once.
//
// Hazards
//   - The GIL has no timed acquire: a fork waits for it for as long as another thread keeps it,
//     past AtForkOptions::framework_lock_timeout. A thread that holds the GIL in native code and
//     waits there for something a fork holds (a forksafe call that waits for a registration or a
//     drained pool, say) deadlocks with that fork. forksafe's Python API releases the GIL around
//     every call that can block; a framework that calls forksafe's C++ API from its own Python
//     binding must release the GIL around such calls too.
//   - Between the start of the fork and the end of prepare other Python threads run (the GIL is
//     let go): state that the forking thread's own Python code left half-done is visible to them,
//     as at any bytecode boundary. os.fork() holds CPython's import lock meanwhile: a pool task
//     that imports a module for the first time waits for the fork to end, and so the drain runs
//     into its deadline (import what tasks need before forking).
//   - Only the registry of the process's primary forksafe lets go of its framework lock. If a
//     framework's own static copy of forksafe was loaded before `import forksafe`,
//     libforksafe.so nests in it (runtime/at_fork.h, "One registry per process") and the GIL is
//     held through the drain: a pool task that needs the GIL then waits until the drain deadline.
#ifndef FORKSAFE_PYTHON_GIL_LOCK_H_
#define FORKSAFE_PYTHON_GIL_LOCK_H_

#include <chrono>

#include "forksafe/runtime/framework_lock.h"

namespace forksafe::python {

/// The GIL as a runtime::FrameworkLock. One per process (Install()).
class GilFrameworkLock final : public runtime::FrameworkLock {
 public:
  /// Takes the GIL (PyGILState_Ensure); recursive.
  void Lock() override;
  /// Takes the GIL; blocks until it has it (the GIL has no timed acquire: see Hazards).
  bool TryLockFor(std::chrono::nanoseconds timeout) override;
  /// Gives back one level taken by Lock or TryLockFor.
  void Unlock() override;
  /// True when the calling thread holds the GIL.
  bool HeldByCurrentThread() const override;
  /// Nothing: the child's GIL is rebuilt by PyOS_AfterFork_Child.
  void ResetInChild() override;
  /// Lets go of the GIL held by the forking thread (PyEval_SaveThread); TryLockFor takes it back.
  bool SuspendForPrepare() override;
};

/// Makes the GIL the process's framework lock, unless the process already set a lock of its own
/// (then that lock stays, and this returns false). Call with the GIL held, at import.
bool InstallGilFrameworkLock();

/// Puts back the default framework lock if the GIL is installed. Not called at interpreter exit:
/// a fork on another thread may be using the lock, which holds nothing once Python finalizes.
void UninstallGilFrameworkLock();

/// Whether the calling thread holds the GIL (of any interpreter).
bool ThisThreadHoldsTheGil();

/// "gil", "default" or "custom": which framework lock the process uses.
const char* FrameworkLockKind();

}  // namespace forksafe::python

#endif  // FORKSAFE_PYTHON_GIL_LOCK_H_
