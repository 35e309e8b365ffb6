// python/errors.h: how the extension turns a forksafe::runtime::Error into a Python exception.
#ifndef FORKSAFE_PYTHON_ERRORS_H_
#define FORKSAFE_PYTHON_ERRORS_H_

#include "forksafe/runtime/error.h"

namespace forksafe::python {

/// Sets the Python error for `e`: the class of forksafe/errors.py for its code (RuntimeError
/// before forksafe/__init__.py registered them). Requires the GIL.
void RaiseError(const runtime::Error& e);

}  // namespace forksafe::python

#endif  // FORKSAFE_PYTHON_ERRORS_H_
