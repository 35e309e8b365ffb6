// python/tensor.cc: forksafe.Tensor (device::Tensor) for Python: DLPack both ways
// (__dlpack__, __dlpack_device__, forksafe.from_dlpack) and the buffer protocol, so numpy and
// torch see a forksafe tensor, and forksafe sees theirs, without a copy.
#include "python/tensor.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "forksafe/device/device.h"
#include "forksafe/device/dlpack.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/tensor.h"
#include "forksafe/runtime/error.h"
#include "python/errors.h"
#include "python/nogil.h"

namespace py = pybind11;

namespace forksafe::python {
namespace {

using device::DType;
using device::Tensor;
using runtime::Error;
using runtime::ErrorCode;

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kInt32,
                                DType::kInt64,   DType::kUInt8,   DType::kBool,
                                DType::kFloat16, DType::kBFloat16};

// The struct-module format of a dtype for the buffer protocol; bfloat16 has none.
const char* BufferFormat(DType d) {
  switch (d) {
    case DType::kFloat32: return "f";
    case DType::kFloat64: return "d";
    case DType::kInt32: return "i";
    case DType::kInt64: return "q";
    case DType::kUInt8: return "B";
    case DType::kBool: return "?";
    case DType::kFloat16: return "e";
    case DType::kBFloat16: return nullptr;
  }
  return nullptr;
}

py::tuple ToTuple(const std::vector<int64_t>& v) {
  py::tuple t(v.size());
  for (size_t i = 0; i < v.size(); ++i) t[i] = v[i];
  return t;
}

// A capsule's destructor: a capsule still named "dltensor" was never consumed, so its tensor
// goes back to its producer here (without the GIL: python/nogil.h says why).
void DeleteUnconsumedCapsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;  // consumed: "used_dltensor"
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr && managed->deleter != nullptr) {
    WithoutGil([managed] { managed->deleter(managed); });
  }
}

// A DLManagedTensor that shows `original`'s tensor (its shape and strides point into `original`,
// which must live until `deleter` runs) with a context and deleter of its own: how a release is
// routed (without the GIL, with it, with a notice).
DLManagedTensor* Rewrapped(DLManagedTensor* original, void* ctx,
                           void (*deleter)(DLManagedTensor*)) {
  auto* wrapper = new DLManagedTensor();
  wrapper->dl_tensor = original->dl_tensor;
  wrapper->manager_ctx = ctx;
  wrapper->deleter = deleter;
  return wrapper;
}

// device::ToDLPack(t) behind a deleter that gives the tensor back without the GIL: its consumer
// (numpy, torch) releases it from a deallocation, with the GIL held, and the last reference to
// shared memory takes the arena's lock, which a fork's prepare holds while it waits for the GIL.
DLManagedTensor* ToDLPackReleasedWithoutGil(const Tensor& t) {
  DLManagedTensor* original = device::ToDLPack(t);
  return Rewrapped(original, original, [](DLManagedTensor* self) {
    auto* original = static_cast<DLManagedTensor*>(self->manager_ctx);
    delete self;
    if (original->deleter != nullptr) WithoutGil([original] { original->deleter(original); });
  });
}

// Takes the DLManagedTensor out of a "dltensor" capsule and marks it consumed.
Tensor AdoptCapsule(py::handle capsule) {
  if (!PyCapsule_CheckExact(capsule.ptr()) || !PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
    throw Error(ErrorCode::kInvalidArgument,
                "from_dlpack needs an object with __dlpack__ (a numpy array, a torch tensor, a "
                "forksafe.Tensor) or an unconsumed \"dltensor\" capsule; a capsule can be "
                "consumed once");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  // The producer's deleter may touch Python objects without taking the GIL (numpy 1.24's
  // decrefs the array), and the last forksafe tensor over the memory may go on any thread: call
  // it through a wrapper that takes the GIL. The wrapper's dl_tensor is a copy whose shape and
  // strides point into `managed`, which lives until the wrapper's deleter runs.
  DLManagedTensor* wrapper = Rewrapped(managed, managed, [](DLManagedTensor* self) {
    auto* original = static_cast<DLManagedTensor*>(self->manager_ctx);
    delete self;
    if (original->deleter == nullptr || !Py_IsInitialized()) return;  // Python is gone: leak
    py::gil_scoped_acquire gil;
    original->deleter(original);
  });
  // Consumed from here on (before the GIL goes: another thread must not adopt it too).
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");
  Tensor t;
  try {
    NoGil nogil;  // as in Create
    t = device::FromDLPack(wrapper);
  } catch (...) {
    delete wrapper;  // FromDLPack took nothing: the capsule owns `managed` again
    PyCapsule_SetName(capsule.ptr(), "dltensor");
    throw;
  }
  return t;
}

// A DLPack export whose consumer's release also calls a Python callable: the wrapper's context.
struct ReleaseNotice {
  DLManagedTensor* original;  // device::ToDLPack's, given back first
  PyObject* callback;         // owned reference
};

// The wrapper's deleter: gives the tensor back (no Python involved), then calls the callback with
// the GIL (the consumer may let go on any thread). At interpreter exit the callback is leaked,
// never called: the objects it would touch may be gone.
void DeleteWithNotice(DLManagedTensor* self) {
  auto* notice = static_cast<ReleaseNotice*>(self->manager_ctx);
  DLManagedTensor* original = notice->original;
  PyObject* callback = notice->callback;
  delete notice;
  delete self;
  if (original->deleter != nullptr) WithoutGil([original] { original->deleter(original); });
  if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  // torch frees a tensor at any point, also while an exception is being raised (a rebuild that
  // failed, an operator's TypeError): the callback must neither see nor clear that exception,
  // or the caller returns NULL with none set (SystemError in place of the real error).
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* result = PyObject_CallNoArgs(callback);
  if (result == nullptr) {
    PyErr_WriteUnraisable(callback);
  } else {
    Py_DECREF(result);
  }
  Py_DECREF(callback);
  PyErr_Restore(type, value, traceback);
  PyGILState_Release(gil);
}

// A "dltensor" capsule over CPU tensor `t` (as __dlpack__) whose release by its consumer calls
// `on_release()` once, after the consumer's reference to the memory is gone.
py::object CapsuleWithNotice(const Tensor& t, py::object on_release) {
  if (!t.device().is_cpu()) {
    throw Error(ErrorCode::kInvalidArgument,
                "_dlpack_with_release: a " + t.device().ToString() + " tensor; CPU only");
  }
  if (!PyCallable_Check(on_release.ptr())) {  // said now, not as an unraisable error at release
    throw Error(ErrorCode::kInvalidArgument,
                std::string("_dlpack_with_release: on_release must be callable, got ") +
                    Py_TYPE(on_release.ptr())->tp_name);
  }
  DLManagedTensor* original = device::ToDLPack(t);
  DLManagedTensor* wrapper = Rewrapped(
      original, new ReleaseNotice{original, on_release.release().ptr()}, &DeleteWithNotice);
  PyObject* capsule = PyCapsule_New(wrapper, "dltensor", &DeleteUnconsumedCapsule);
  if (capsule == nullptr) {  // nothing consumed it: undo without calling back
    auto* notice = static_cast<ReleaseNotice*>(wrapper->manager_ctx);
    Py_DECREF(notice->callback);
    delete notice;
    delete wrapper;
    original->deleter(original);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

Tensor Create(const char* what, py::object shape, const std::string& dtype,
              const std::string& device_name, std::optional<double> fill) {
  std::vector<int64_t> dims;
  if (py::isinstance<py::int_>(shape)) {
    dims.push_back(shape.cast<int64_t>());
  } else {
    try {
      dims = shape.cast<std::vector<int64_t>>();
    } catch (const py::cast_error&) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string(what) + ": the shape must be an int or a sequence of ints, got " +
                      std::string(py::str(py::type::of(shape))));
    }
  }
  const DType d = ParseDType(dtype);
  const device::Device dev = device::ParseDevice(device_name);
  // The device registry's first use registers its at-fork handler, which waits for a fork in
  // progress: never with the GIL held (python/gil_lock.h, Hazards).
  NoGil nogil;
  if (fill.has_value()) return Tensor::Full(dims, *fill, d, dev);
  return std::string(what) == "Tensor.zeros" ? Tensor::Zeros(dims, d, dev)
                                             : Tensor::Empty(dims, d, dev);
}

// pybind11 2.10 calls def_buffer's function from the type's bf_getbuffer without catching what
// it throws, and the exception would cross CPython's C frames (memoryview(), numpy):
// std::terminate. The type's bf_getbuffer is this wrapper, which turns forksafe's errors into
// Python's.
getbufferproc g_pybind_getbuffer = nullptr;

int GuardedGetBuffer(PyObject* obj, Py_buffer* view, int flags) {
  try {
    return g_pybind_getbuffer(obj, view, flags);
  } catch (const Error& e) {
    RaiseError(e);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_BufferError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_BufferError, "forksafe.Tensor: the buffer could not be made");
  }
  if (view != nullptr) view->obj = nullptr;
  return -1;
}

}  // namespace

// "float32", "int64", ... (torch's and numpy's names; "float" and "double" too).
DType ParseDType(const std::string& name) {
  if (name == "float") return DType::kFloat32;
  if (name == "double") return DType::kFloat64;
  if (name == "half") return DType::kFloat16;
  for (DType d : kAllDTypes) {
    if (name == device::DTypeName(d)) return d;
  }
  std::string known;
  for (DType d : kAllDTypes) known += std::string(known.empty() ? "" : ", ") + device::DTypeName(d);
  throw Error(ErrorCode::kInvalidArgument, "unknown dtype \"" + name + "\"; use one of " + known);
}

void BindTensor(py::module_& m) {
  py::class_<Tensor, NoGilHolder<Tensor>> cls(m, "Tensor", py::buffer_protocol());
  cls.def_static(
         "empty",
         [](py::object shape, const std::string& dtype, const std::string& device) {
           return Create("Tensor.empty", shape, dtype, device, std::nullopt);
         },
         py::arg("shape"), py::arg("dtype") = "float32", py::arg("device") = "cpu")
      .def_static(
          "zeros",
          [](py::object shape, const std::string& dtype, const std::string& device) {
            return Create("Tensor.zeros", shape, dtype, device, std::nullopt);
          },
          py::arg("shape"), py::arg("dtype") = "float32", py::arg("device") = "cpu")
      .def_static(
          "full",
          [](py::object shape, double value, const std::string& dtype, const std::string& device) {
            return Create("Tensor.full", shape, dtype, device, value);
          },
          py::arg("shape"), py::arg("value"), py::arg("dtype") = "float32",
          py::arg("device") = "cpu")
      .def_property_readonly("shape", [](const Tensor& t) { return ToTuple(t.shape()); })
      .def_property_readonly("strides", [](const Tensor& t) { return ToTuple(t.strides()); })
      .def_property_readonly(
          "dtype", [](const Tensor& t) { return std::string(device::DTypeName(t.dtype())); })
      .def_property_readonly("device", [](const Tensor& t) { return t.device().ToString(); })
      .def_property_readonly("ndim", &Tensor::dim)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def("numel", &Tensor::numel)
      .def("is_contiguous", &Tensor::is_contiguous)
      .def("is_shared", &Tensor::is_shared)
      .def("_storage_use_count", [](const Tensor& t) { return t.storage().use_count(); })
      .def("data_ptr", [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); })
      .def("contiguous", &Tensor::Contiguous, py::call_guard<NoGil>())
      .def("clone", &Tensor::Clone, py::call_guard<NoGil>())
      .def(
          "to", [](const Tensor& t, const std::string& d) { return t.To(device::ParseDevice(d)); },
          py::call_guard<NoGil>())
      .def("__repr__", &Tensor::DebugString)
      .def(
          "__dlpack__",
          [](const Tensor& t, py::object stream) {
            (void)stream;
            if (!t.device().is_cpu()) {
              // The consumer reads on its own stream: what forksafe queued on the device (a
              // Zeros' fill, a copy) must be done first.
              NoGil nogil;
              device::Synchronize(t.device());
            }
            DLManagedTensor* managed = ToDLPackReleasedWithoutGil(t);
            PyObject* capsule = PyCapsule_New(managed, "dltensor", &DeleteUnconsumedCapsule);
            if (capsule == nullptr) {
              managed->deleter(managed);
              throw py::error_already_set();
            }
            return py::reinterpret_steal<py::object>(capsule);
          },
          py::arg("stream") = py::none())
      .def("_dlpack_with_release", &CapsuleWithNotice, py::arg("on_release"),
           "A DLPack capsule of this CPU tensor (as __dlpack__) whose consumer's release calls "
           "on_release() once, with the GIL, after its reference to the memory is gone (never "
           "at interpreter exit). forksafe.multiprocessing drops its record of a torch "
           "storage's shared memory this way.")
      .def("__dlpack_device__",
           [](const Tensor& t) {
             const DLDevice d = device::ToDLDevice(t.device());
             return py::make_tuple(static_cast<int>(d.device_type), d.device_id);
           })
      .def_buffer([](const Tensor& t) -> py::buffer_info {
        if (!t.device().is_cpu()) {
          throw Error(ErrorCode::kInvalidArgument,
                      "a " + t.device().ToString() +
                          " tensor has no buffer on the host; use .to(\"cpu\") first, or "
                          "__dlpack__ for a zero-copy exchange on the device");
        }
        const char* format = BufferFormat(t.dtype());
        if (format == nullptr) {
          throw Error(ErrorCode::kInvalidArgument,
                      "bfloat16 has no buffer-protocol format; exchange it through __dlpack__ "
                      "(torch.from_dlpack) instead");
        }
        std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
        std::vector<py::ssize_t> strides;
        for (int64_t s : t.strides()) {
          strides.push_back(static_cast<py::ssize_t>(s * static_cast<int64_t>(t.element_size())));
        }
        return py::buffer_info(t.data_ptr(), static_cast<py::ssize_t>(t.element_size()), format,
                               static_cast<py::ssize_t>(shape.size()), shape, strides);
      });
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  g_pybind_getbuffer = type->tp_as_buffer->bf_getbuffer;
  type->tp_as_buffer->bf_getbuffer = &GuardedGetBuffer;

  m.def(
      "from_dlpack",
      [](py::object obj) {
        if (py::hasattr(obj, "__dlpack__")) return AdoptCapsule(obj.attr("__dlpack__")());
        return AdoptCapsule(obj);
      },
      py::arg("obj"),
      "A forksafe.Tensor over the memory of `obj` (anything with __dlpack__, or a capsule), "
      "without a copy.");
  m.def("dtypes", [] {
    std::vector<std::string> out;
    for (DType d : kAllDTypes) out.emplace_back(device::DTypeName(d));
    return out;
  });
}

}  // namespace forksafe::python
