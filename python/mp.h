// python/mp.h: the C++ mp layer as seen by forksafe.multiprocessing (python/mp.cc), for the
// extension's module definition (python/module.cc).
#ifndef FORKSAFE_PYTHON_MP_H_
#define FORKSAFE_PYTHON_MP_H_

#include <pybind11/pybind11.h>

namespace forksafe::python {

/// Adds the submodule `_forksafe.mp`: Queue, Connection and Pipe (messages are a pickle's bytes
/// plus the tensors and descriptors it carries out of band), the synchronization primitives,
/// shared blocks for Value/Array, and the sharing strategies.
void BindMp(pybind11::module_& m);

}  // namespace forksafe::python

#endif  // FORKSAFE_PYTHON_MP_H_
