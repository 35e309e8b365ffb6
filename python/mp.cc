// python/mp.cc: forksafe._forksafe.mp, the C++ mp layer for forksafe.multiprocessing.
//
// The behaviour is the C++ layer's (mp/queue.h, mp/connection.h, mp/synchronize.h,
// mp/shared_value.h, mp/sharing.h); this file adapts its shapes:
//   - A Python message is a pickle's bytes plus what the pickle carries out of band: forksafe
//     tensors (they cross as shared-memory handles, mp/sharing.h) and descriptors (the state of
//     a Lock, a Queue or a Connection inside the message). Queue.put and Connection.send take
//     the three; get and recv return them. forksafe/multiprocessing/reduction.py does the
//     pickling.
//   - Every object that can cross processes has _encode() -> (bytes, [fd, ...]) and a static
//     _decode(bytes, [fd, ...]): the codec's form, for pickling it into a spawned child's
//     arguments. _encode's descriptors are new and the caller's to close; _decode takes
//     ownership of those it is given, on every path.
//   - Every call that may wait releases the GIL. Queue's Empty and Full are Python's
//     queue.Empty and queue.Full; other errors are forksafe's exception classes.
#include "python/mp.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/codec.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/shared_arena.h"
#include "forksafe/mp/internal/shared_segment.h"
#include "forksafe/mp/launch.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/shared_value.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/mp/synchronize.h"
#include "forksafe/mp/timeout.h"
#include "forksafe/runtime/error.h"
#include "python/nogil.h"
#include "python/tensor.h"

namespace py = pybind11;

namespace forksafe::python {
namespace {

using device::Tensor;
using runtime::Error;
using runtime::ErrorCode;
using ReleaseGil = py::call_guard<NoGil>;
using Seconds = std::optional<double>;

// A negative timeout is 0, as in multiprocessing (a `deadline - time.monotonic()` that ran out
// gives queue.Empty or False, not an error); NaN stays an error (mp/timeout.h).
mp::Timeout ToTimeout(Seconds s) {
  if (!s.has_value()) return mp::Timeout();
  return mp::Timeout(*s < 0 ? 0.0 : *s);
}

// ---------------------------------------------------------------------------------------------
// Waits that Ctrl-C ends. Python runs a signal's handler only when the interpreter has control,
// so a wait in C++ with the GIL released would hold KeyboardInterrupt (or a SIGALRM or SIGTERM
// handler's exception) until the wait ended: never, for a wait without a timeout. A blocking
// call is therefore a series of waits of at most kSignalSlice; between two, with the GIL,
// Python's handlers run (PyErr_CheckSignals) and an exception from one ends the call, as in
// multiprocessing. A wait that the item ends early costs nothing more; a long one wakes 20 times
// a second.
constexpr double kSignalSlice = 0.05;

// Calls attempt(slice) with the GIL released until it returns true (then true) or `timeout`
// (None: forever; NaN: attempt's own error) has passed (then false).
template <class Attempt>
bool WaitInterruptibly(Seconds timeout, Attempt&& attempt) {
  if (timeout.has_value() && std::isnan(*timeout)) {
    NoGil nogil;
    return attempt(ToTimeout(timeout));  // says what was wrong
  }
  const auto start = std::chrono::steady_clock::now();
  const double total = timeout.has_value() ? std::max(*timeout, 0.0) : 0.0;
  auto left = [&] {
    return total - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (;;) {
    const double slice = timeout.has_value() ? std::clamp(left(), 0.0, kSignalSlice) : kSignalSlice;
    bool done;
    {
      NoGil nogil;
      done = attempt(mp::Timeout(slice));
    }
    if (done) return true;
    if (timeout.has_value() && left() <= 0) return false;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// A call with multiprocessing's (block, timeout): non-blocking, one attempt with the GIL
// released (its timeout unused); blocking, WaitInterruptibly.
template <class Attempt>
bool BlockOrTry(bool block, Seconds timeout, Attempt&& attempt) {
  if (!block) {
    NoGil nogil;
    return attempt(mp::Timeout());
  }
  return WaitInterruptibly(timeout, attempt);
}

// acquire(block, timeout) of a lock or semaphore.
template <class L>
bool Acquire(L& lock, bool block, Seconds timeout) {
  return BlockOrTry(block, timeout, [&](const mp::Timeout& t) { return lock.acquire(block, t); });
}

// "within 2.5 s" / "" (no timeout) for the messages of waits that ran out.
std::string Within(Seconds timeout) {
  if (!timeout.has_value()) return std::string();
  char text[64];
  std::snprintf(text, sizeof(text), " within %g s", std::max(*timeout, 0.0));
  return text;
}

// ---------------------------------------------------------------------------------------------
// Messages: (pickle bytes, tensors, descriptors).

// The descriptors the caller lends for one encode (borrowed: the codec dups what it keeps).
std::vector<mp::FileDescriptor> Borrowed(const std::vector<int>& fds) {
  std::vector<mp::FileDescriptor> out;
  out.reserve(fds.size());
  for (int fd : fds) {
    if (fd < 0) throw Error(ErrorCode::kInvalidArgument, "a message's descriptor is negative");
    out.push_back(mp::FileDescriptor::Borrow(fd));
  }
  return out;
}

mp::Message EncodePayload(const std::string& pickle, const std::vector<Tensor>& tensors,
                          const std::vector<int>& fds) {
  return mp::Encode(pickle, tensors, Borrowed(fds));
}

// A decoded message, its descriptors released to Python (the caller closes or adopts them).
struct Payload {
  std::string pickle;
  std::vector<Tensor> tensors;
  std::vector<mp::FileDescriptor> fds;
};

Payload DecodePayload(mp::Message& msg) {
  Payload p;
  mp::Decode(msg, p.pickle, p.tensors, p.fds);
  return p;
}

// Connection.recv's message: one of send() (pickle, tensors, descriptors) or, from a peer that
// used send_bytes() (multiprocessing programs send pickle.dumps(x) that way), a bare pickle.
Payload DecodeSentOrBytes(mp::Message& msg) {
  if (msg.fds.empty()) {
    try {
      return DecodePayload(msg);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument) throw;
    }
    Payload p;
    p.pickle = std::move(msg.bytes);
    return p;
  }
  return DecodePayload(msg);
}

// Connection.recv_bytes's bytes: a send_bytes() message as it is; a send() message's pickle
// when it carries nothing out of band (multiprocessing's recv_bytes of a send() message is the
// pickle: pickle.loads reads it), else an error that says to recv() it.
std::string BytesOfMessage(mp::Message& msg) {
  const bool bare = msg.fds.empty();
  Payload p;
  try {
    p = DecodePayload(msg);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument || !bare) throw;
    return std::move(msg.bytes);
  }
  if (p.tensors.empty() && p.fds.empty()) return std::move(p.pickle);
  // Decoded all the same, so that the tensors' references in flight are taken and given back,
  // and the descriptors closed, as `p` goes: refused undecoded, each message's shared memory
  // stayed counted for good (the sender's grew by 825 MB over 800 messages of 1 MiB).
  throw Error(ErrorCode::kInvalidArgument,
              "Connection.recv_bytes: this message was sent with send() and carries shared "
              "tensors or descriptors; receive it with recv()");
}

// The descriptors as ints that Python owns (and closes or adopts): an owned one is released, a
// borrowed one (an arena segment's, still the arena's) is duplicated: closing it would close the
// arena's.
py::list ReleaseToPython(std::vector<mp::FileDescriptor>& descriptors) {
  py::list fds;
  for (auto& fd : descriptors) {
    if (fd.owned()) {
      fds.append(fd.release());
    } else {
      mp::FileDescriptor dup = mp::FileDescriptor::Dup(fd.get());
      fds.append(dup.release());
    }
  }
  return fds;
}

py::tuple ToPython(Payload p) {
  py::list fds = ReleaseToPython(p.fds);
  return py::make_tuple(py::bytes(p.pickle), py::cast(std::move(p.tensors)), fds);
}

// The codec form of one object, for pickling it into a spawned child's arguments.
template <class T>
py::tuple EncodeObject(const T& value) {
  mp::Message msg;
  {
    NoGil nogil;
    msg = mp::Encode(value);
  }
  return py::make_tuple(py::bytes(msg.bytes), ReleaseToPython(msg.fds));
}

// What a decoded T starts as (the codec decodes into a value).
template <class T>
T Blank() {
  return T{};
}
template <>
mp::Barrier Blank<mp::Barrier>() {
  return mp::Barrier(1);
}

template <class T>
T DecodeObject(const std::string& bytes, const std::vector<int>& fds) {
  mp::Message msg;
  msg.bytes = bytes;
  for (int fd : fds) msg.fds.emplace_back(fd);  // owned from here on, closed on every path
  NoGil nogil;
  T value = Blank<T>();
  mp::Decode(msg, value);
  return value;
}

template <class T, class... Options>
void AddCodec(py::class_<T, Options...>& cls) {
  cls.def("_encode", &EncodeObject<T>,
          "(bytes, [fd, ...]): this object's codec form; the descriptors are the caller's.");
  cls.def_static("_decode", &DecodeObject<T>, py::arg("data"), py::arg("fds"),
                 "The object from its codec form; takes ownership of the descriptors.");
}

// Python's queue.Empty / queue.Full for the C++ ones (a Queue user catches those).
[[noreturn]] void RaiseQueueError(const char* name, const std::string& message) {
  py::gil_scoped_acquire gil;
  py::object cls = py::module_::import("queue").attr(name);
  PyErr_SetObject(cls.ptr(), py::str(message).ptr());
  throw py::error_already_set();
}

// ---------------------------------------------------------------------------------------------
// Queue (Queue, SimpleQueue and JoinableQueue are all a C++ JoinableQueue: one kind of segment).

class PyQueue {
 public:
  PyQueue() = default;  // an empty handle, for decoding into
  PyQueue(int64_t maxsize, size_t ring_bytes) : q_(mp::QueueOptions{maxsize, ring_bytes}) {}
  explicit PyQueue(mp::JoinableQueue q) : q_(std::move(q)) {}

  // Called with the GIL. A blocking put waits for room in slices (WaitInterruptibly).
  void Put(const std::string& pickle, const std::vector<Tensor>& tensors,
           const std::vector<int>& fds, bool block, Seconds timeout) {
    std::string full;
    auto attempt = [&](const mp::Timeout& t) {
      try {
        mp::internal::InFlightScope in_flight(q_.CarrierId());
        q_.PutMessage(EncodePayload(pickle, tensors, fds), block, t);
        return true;
      } catch (const mp::Full& e) {
        full = e.message();
        return false;
      }
    };
    if (!BlockOrTry(block, timeout, attempt)) {
      RaiseQueueError("Full",
                      block ? "Queue.put: no room" + Within(timeout) + " (" + full + ")" : full);
    }
  }

  // A blocking get that finds the queue empty spins inside the C++ get, with the GIL released
  // here, for as long as the queue's adaptive rule says (mp/internal/queue_spin.h: about twice
  // the recent wait, 50 to 400 us, or a nap until shortly before a later item is expected). It
  // learns a Python peer's longer turn by itself, which a fixed 200 us poll here used to cover
  // (bench/peers, workload 1: 162 -> 56 us). It waits in slices (WaitInterruptibly), so that
  // Ctrl-C ends it.
  py::tuple Get(bool block, Seconds timeout) {
    Payload p;
    std::string empty;
    auto attempt = [&](const mp::Timeout& t) {
      try {
        mp::Message m = q_.GetMessage(block, t);
        p = DecodePayload(m);
        return true;
      } catch (const mp::Empty& e) {
        empty = e.message();
        return false;
      }
    };
    if (!BlockOrTry(block, timeout, attempt)) {
      RaiseQueueError("Empty", block ? "Queue.get: nothing arrived" + Within(timeout) : empty);
    }
    return ToPython(std::move(p));
  }

  mp::JoinableQueue& queue() { return q_; }
  const mp::JoinableQueue& queue() const { return q_; }

  template <class Archive>
  void save(Archive& ar) const {
    ar(q_);
  }
  template <class Archive>
  void load(Archive& ar) {
    ar(q_);
  }

 private:
  mp::JoinableQueue q_{nullptr};
  friend struct PyQueueAccess;
};

// ---------------------------------------------------------------------------------------------
// Connection.

class PyConnection {
 public:
  PyConnection() = default;
  explicit PyConnection(mp::Connection c) : c_(std::move(c)) {}

  void Send(const std::string& pickle, const std::vector<Tensor>& tensors,
            const std::vector<int>& fds) {
    c_.SendMessage(EncodePayload(pickle, tensors, fds));
  }
  // Waits for the message's start in slices (Ctrl-C ends it), then reads it whole.
  py::tuple Recv(Seconds timeout) {
    // (A write-only end: RecvMessage says so; it would never poll readable.)
    if (c_.readable() &&
        !WaitInterruptibly(timeout, [&](const mp::Timeout& t) { return c_.poll(t); })) {
      throw Error(ErrorCode::kDeadlineExceeded,
                  "Connection.recv: nothing arrived" + Within(timeout));
    }
    Payload p;
    {
      NoGil nogil;
      mp::Message m = c_.RecvMessage(mp::Timeout());
      p = DecodeSentOrBytes(m);
    }
    return ToPython(std::move(p));
  }
  mp::Connection& conn() { return c_; }
  const mp::Connection& conn() const { return c_; }

  template <class Archive>
  void save(Archive& ar) const {
    ar(c_);
  }
  template <class Archive>
  void load(Archive& ar) {
    ar(c_);
  }

 private:
  mp::Connection c_;
};

// ---------------------------------------------------------------------------------------------
// Value / Array: a shared block of bytes (8-byte aligned) that Python views through ctypes.

class SharedBytes {
 public:
  SharedBytes() = default;
  explicit SharedBytes(size_t nbytes) : a_(Words(nbytes)) {}
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(a_.data()); }
  size_t capacity() const { return a_.size() * sizeof(int64_t); }

  template <class Archive>
  void save(Archive& ar) const {
    ar(a_);
  }
  template <class Archive>
  void load(Archive& ar) {
    ar(a_);
  }

 private:
  // The block: 8-byte words. Its errors say the size asked for in bytes (a Value or Array of
  // the Python package), not the words it is stored as.
  static mp::Array<int64_t> Words(size_t nbytes) {
    try {
      return mp::Array<int64_t>((nbytes + 7) / 8 + (nbytes == 0 ? 1 : 0), 0, false);
    } catch (const Error& e) {
      throw Error(e.code(), "a shared Value or Array of " + std::to_string(nbytes) +
                                " bytes could not be made: " + e.message());
    }
  }

  mp::Array<int64_t> a_;
};

// A Python callable held by C++ (Barrier's action): called and destroyed with the GIL.
std::function<void()> HoldCallable(py::object fn) {
  if (fn.is_none()) return nullptr;
  auto held = std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
  return [held] {
    py::gil_scoped_acquire gil;
    (*held)();
  };
}

}  // namespace

void BindMp(py::module_& parent) {
  py::module_ m =
      parent.def_submodule("mp", "forksafe's C++ mp layer (use forksafe.multiprocessing)");

  // ---- Queue --------------------------------------------------------------------------------
  py::class_<PyQueue, NoGilHolder<PyQueue>> queue(m, "Queue");
  queue
      .def(py::init<int64_t, size_t>(), py::arg("maxsize") = 0,
           py::arg("ring_bytes") = size_t{1} << 20)
      .def("put", &PyQueue::Put, py::arg("pickle"), py::arg("tensors"), py::arg("fds"),
           py::arg("block") = true, py::arg("timeout") = py::none())
      .def("get", &PyQueue::Get, py::arg("block") = true, py::arg("timeout") = py::none())
      .def(
          "poll",
          [](PyQueue& q, Seconds timeout) {
            return WaitInterruptibly(timeout,
                                     [&](const mp::Timeout& t) { return q.queue().poll(t); });
          },
          py::arg("timeout") = 0.0)
      .def("qsize", [](const PyQueue& q) { return q.queue().qsize(); })
      .def("empty", [](const PyQueue& q) { return q.queue().empty(); })
      .def("full", [](const PyQueue& q) { return q.queue().full(); })
      .def_property_readonly("maxsize", [](const PyQueue& q) { return q.queue().maxsize(); })
      .def(
          "close", [](PyQueue& q) { q.queue().close(); }, ReleaseGil())
      .def(
          "task_done", [](PyQueue& q) { q.queue().task_done(); }, ReleaseGil())
      .def(
          "join",
          [](PyQueue& q, Seconds timeout) {
            return WaitInterruptibly(timeout,
                                     [&](const mp::Timeout& t) { return q.queue().join(t); });
          },
          py::arg("timeout") = py::none());
  AddCodec(queue);

  // ---- Connection and Pipe ------------------------------------------------------------------
  py::class_<PyConnection, NoGilHolder<PyConnection>> conn(m, "Connection");
  conn.def("send", &PyConnection::Send, py::arg("pickle"), py::arg("tensors"), py::arg("fds"),
           ReleaseGil())
      .def("recv", &PyConnection::Recv, py::arg("timeout") = py::none())
      .def(
          "send_bytes", [](PyConnection& c, const std::string& data) { c.conn().send_bytes(data); },
          ReleaseGil())
      .def("recv_bytes",
           [](PyConnection& c) {
             if (c.conn().readable()) {
               WaitInterruptibly(std::nullopt,
                                 [&](const mp::Timeout& t) { return c.conn().poll(t); });
             }
             std::string data;
             {
               NoGil nogil;
               mp::Message m = c.conn().RecvMessage(mp::Timeout());
               data = BytesOfMessage(m);
             }
             return py::bytes(data);
           })
      .def(
          "poll",
          [](const PyConnection& c, Seconds t) {
            return WaitInterruptibly(t, [&](const mp::Timeout& s) { return c.conn().poll(s); });
          },
          py::arg("timeout") = 0.0)
      .def("close", [](PyConnection& c) { c.conn().close(); })
      .def_property_readonly("closed", [](const PyConnection& c) { return c.conn().closed(); })
      .def_property_readonly("readable", [](const PyConnection& c) { return c.conn().readable(); })
      .def_property_readonly("writable", [](const PyConnection& c) { return c.conn().writable(); })
      .def("fileno", [](const PyConnection& c) { return c.conn().fileno(); });
  AddCodec(conn);
  m.def(
      "Pipe",
      [](bool duplex) {
        auto ends = mp::Pipe(duplex);
        return std::make_pair(PyConnection(std::move(ends.first)),
                              PyConnection(std::move(ends.second)));
      },
      py::arg("duplex") = true);

  // ---- Locks and the other primitives ---------------------------------------------------------
  py::class_<mp::Lock, NoGilHolder<mp::Lock>> lock(m, "Lock");
  lock.def(py::init<>())
      .def(
          "acquire",
          [](mp::Lock& l, bool b, Seconds t) {
            if (!t.has_value() && b && mp::internal::LockAccess::CoreOf(l).HeldByCaller()) {
              return l.acquire(true, mp::Timeout());  // the holder's untimed acquire: the error
            }
            return Acquire(l, b, t);
          },
          py::arg("block") = true, py::arg("timeout") = py::none())
      .def("release", &mp::Lock::release)
      .def("previous_owner_died", &mp::Lock::previous_owner_died);
  AddCodec(lock);

  py::class_<mp::RLock, NoGilHolder<mp::RLock>> rlock(m, "RLock");
  rlock.def(py::init<>())
      .def(
          "acquire", [](mp::RLock& l, bool b, Seconds t) { return Acquire(l, b, t); },
          py::arg("block") = true, py::arg("timeout") = py::none())
      .def("release", &mp::RLock::release)
      .def("previous_owner_died", &mp::RLock::previous_owner_died);
  AddCodec(rlock);

  py::class_<mp::Semaphore, NoGilHolder<mp::Semaphore>> sem(m, "Semaphore");
  sem.def(py::init<int>(), py::arg("value") = 1)
      .def(
          "acquire", [](mp::Semaphore& s, bool b, Seconds t) { return Acquire(s, b, t); },
          py::arg("block") = true, py::arg("timeout") = py::none())
      .def("release", &mp::Semaphore::release, py::arg("n") = 1)
      .def("get_value", &mp::Semaphore::get_value);
  AddCodec(sem);

  py::class_<mp::BoundedSemaphore, mp::Semaphore, NoGilHolder<mp::BoundedSemaphore>> bsem(
      m, "BoundedSemaphore");
  bsem.def(py::init<int>(), py::arg("value") = 1);
  AddCodec(bsem);

  py::class_<mp::Condition, NoGilHolder<mp::Condition>> cond(m, "Condition");
  cond.def(py::init<mp::Lock>(), py::arg("lock"))
      .def(py::init<mp::RLock>(), py::arg("lock"))
      .def(
          "acquire", [](mp::Condition& c, bool b, Seconds t) { return Acquire(c, b, t); },
          py::arg("block") = true, py::arg("timeout") = py::none())
      .def("release", &mp::Condition::release)
      .def(
          "wait", [](mp::Condition& c, Seconds t) { return c.wait(ToTimeout(t)); },
          py::arg("timeout") = py::none(), ReleaseGil())
      .def("notify", &mp::Condition::notify, py::arg("n") = 1)
      .def("notify_all", &mp::Condition::notify_all);
  AddCodec(cond);

  py::class_<mp::Event, NoGilHolder<mp::Event>> event(m, "Event");
  event.def(py::init<>())
      .def("is_set", &mp::Event::is_set)
      .def("set", &mp::Event::set, ReleaseGil())
      .def("clear", &mp::Event::clear, ReleaseGil())
      .def(
          "wait",
          [](mp::Event& e, Seconds t) {
            return WaitInterruptibly(t, [&](const mp::Timeout& s) { return e.wait(s); });
          },
          py::arg("timeout") = py::none());
  AddCodec(event);

  py::class_<mp::Barrier, NoGilHolder<mp::Barrier>> barrier(m, "Barrier");
  barrier
      .def(py::init([](int parties, py::object action, Seconds timeout) {
             return mp::Barrier(parties, HoldCallable(std::move(action)), ToTimeout(timeout));
           }),
           py::arg("parties"), py::arg("action") = py::none(), py::arg("timeout") = py::none())
      .def(
          "wait", [](mp::Barrier& b, Seconds t) { return b.wait(ToTimeout(t)); },
          py::arg("timeout") = py::none(), ReleaseGil())
      .def("reset", &mp::Barrier::reset, ReleaseGil())
      .def("abort", &mp::Barrier::abort, ReleaseGil())
      .def_property_readonly("parties", &mp::Barrier::parties)
      .def_property_readonly("n_waiting", &mp::Barrier::n_waiting)
      .def_property_readonly("broken", &mp::Barrier::broken);
  AddCodec(barrier);
  m.def(
      "_barrier_with_action",
      [](const mp::Barrier& b, py::object action) {
        mp::Barrier out = b;
        out.set_action(HoldCallable(std::move(action)));
        return out;
      },
      "A handle of barrier `b` (decoded in this process) that runs `action` here.");

  // ---- Value / Array ------------------------------------------------------------------------
  py::class_<SharedBytes, NoGilHolder<SharedBytes>> bytes(m, "SharedBytes", py::buffer_protocol());
  bytes.def(py::init<size_t>(), py::arg("nbytes"))
      .def_property_readonly("address", &SharedBytes::address)
      .def_property_readonly("capacity", &SharedBytes::capacity)
      .def_buffer([](const SharedBytes& b) {
        return py::buffer_info(reinterpret_cast<void*>(b.address()), 1, "B",
                               static_cast<py::ssize_t>(b.capacity()), /*readonly=*/false);
      });
  AddCodec(bytes);

  // ---- Tensors and the sharing strategies ----------------------------------------------------
  m.def("encode_tensor", [](const Tensor& t) { return EncodeObject(t); });
  m.def("decode_tensor", &DecodeObject<Tensor>, py::arg("data"), py::arg("fds"));
  m.def(
      "share_memory_", [](Tensor& t) { return mp::share_memory_(t); }, ReleaseGil());
  m.def(
      "shared_empty",
      [](const std::vector<int64_t>& shape, const std::string& dtype) {
        return mp::SharedEmpty(shape, ParseDType(dtype));
      },
      py::arg("shape"), py::arg("dtype") = "float32", ReleaseGil());
  m.def(
      "shared_copy",
      [](uintptr_t address, size_t nbytes) {
        // One call for what a torch storage's move into shared memory needs: a block and the
        // copy (raw bytes, at memcpy speed, without the GIL).
        Tensor t = mp::SharedEmpty({static_cast<int64_t>(std::max<size_t>(nbytes, 1))},
                                   device::DType::kUInt8);
        if (nbytes > 0) std::memcpy(t.data_ptr(), reinterpret_cast<const void*>(address), nbytes);
        return t;
      },
      py::arg("address"), py::arg("nbytes"), ReleaseGil(),
      "A new shared uint8 tensor holding a copy of the `nbytes` bytes at `address` (the memory "
      "of a live object the caller keeps alive: a torch storage).");
  m.def(
      "empty_cache", [] { mp::internal::SharedArena::Get().ReleaseCaches(); }, ReleaseGil(),
      "Returns the arena's cached, unreferenced memory to the system, and unmaps the segments "
      "received lately that no live tensor here uses (file_system segments leave /dev/shm once "
      "no process holds them).");
  m.def(
      "arena_stats",
      [] {
        const mp::internal::ArenaStats s = mp::internal::SharedArena::Get().stats();
        py::dict d;
        d["segments_created"] = s.segments_created;
        d["segments_mapped"] = s.segments_mapped;
        d["blocks_allocated"] = s.blocks_allocated;
        d["blocks_reused"] = s.blocks_reused;
        d["bytes_reserved"] = s.bytes_reserved;
        d["live_segments"] = s.live_segments;
        d["large_segments_reused"] = s.large_segments_reused;
        d["large_cache_bytes"] = s.large_cache_bytes;
        return d;
      },
      "This process's shared-memory arena counters (mp/internal/shared_arena.h, ArenaStats), "
      "for tests and benchmarks.");
  m.def("get_all_sharing_strategies", &mp::get_all_sharing_strategies);
  m.def("get_sharing_strategy", &mp::get_sharing_strategy);
  m.def("set_sharing_strategy", &mp::set_sharing_strategy, py::arg("strategy"));

  // ---- Launchers (mp/launch.h) ---------------------------------------------------------------
  m.def(
      "launch_info",
      [] {
        const mp::LaunchInfo i = mp::GetLaunchInfo();
        return py::make_tuple(mp::LauncherName(i.launcher), i.rank, i.local_rank, i.world_size,
                              i.local_world_size, i.node_rank, i.master_addr, i.master_port);
      },
      "(launcher, rank, local_rank, world_size, local_world_size, node_rank, master_addr, "
      "master_port) from the launcher's variables.");
  m.def(
      "spawn_child_environment",
      [](int nprocs, int index, int master_port) {
        py::dict env;
        for (auto& [k, v] :
             mp::SpawnChildEnvironment(mp::GetLaunchInfo(), nprocs, index, master_port)) {
          env[py::str(k)] = py::str(v);
        }
        return env;
      },
      py::arg("nprocs"), py::arg("index"), py::arg("master_port"),
      "The variables spawn() gives child `index` of `nprocs` of this process (mp/launch.h).");
  m.def("free_loopback_port", &mp::FreeLoopbackPort);
  m.def("record_failure_for_launcher", &mp::RecordFailureForLauncher, py::arg("type"),
        py::arg("message"), py::arg("traceback"),
        "Writes a failure to TORCHELASTIC_ERROR_FILE in torchelastic's form; False when unset.");
}

}  // namespace forksafe::python
