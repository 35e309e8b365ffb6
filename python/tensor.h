// python/tensor.h: forksafe.Tensor and forksafe.from_dlpack (python/tensor.cc), for the
// extension's module definition (python/module.cc).
#ifndef FORKSAFE_PYTHON_TENSOR_H_
#define FORKSAFE_PYTHON_TENSOR_H_

#include <pybind11/pybind11.h>

#include <string>

#include "forksafe/device/tensor.h"

namespace forksafe::python {

/// The dtype named `name` (torch's and numpy's names: "float32", "int64", ...; "float", "double"
/// and "half" too). Throws Error(kInvalidArgument) listing the known names.
device::DType ParseDType(const std::string& name);

/// Adds Tensor, from_dlpack and dtypes to `m`.
void BindTensor(pybind11::module_& m);

}  // namespace forksafe::python

#endif  // FORKSAFE_PYTHON_TENSOR_H_
