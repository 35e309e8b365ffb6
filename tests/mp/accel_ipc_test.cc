// Accelerator tensors across processes (device/ipc.h through mp/sharing.h): the same tests run on
// the simulated accelerator (always) and on CUDA (skipped with a reason where there is no GPU).
// Covered: Queue, Pipe, Process arguments and Pool; the producer frees, reallocates, or exits
// before the consumer reads; stream ordering (the consumer never reads half-written data);
// thousands of tensors; a SIGKILLed consumer gives its device memory back; legacy handles for
// memory forksafe did not allocate, with the producer-keeps-alive rule enforced; malformed
// handles; forked children.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/device/cuda_backend.h"
#include "forksafe/device/ipc.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/sim_backend.h"
#include "forksafe/device/tensor.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using device::Device;
using device::DeviceType;
using device::DType;
using device::Tensor;
using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;

constexpr double kGet = 60.0;  // seconds any get may wait before the test fails

Device Parse(const std::string& name) { return device::ParseDevice(name); }

device::SimBackend& Sim() {
  return static_cast<device::SimBackend&>(device::GetBackend(DeviceType::kSimAccel));
}

// A float tensor on `dev` holding start, start+1, ...
Tensor Iota(const Device& dev, int64_t n, float start) {
  std::vector<float> host(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) host[static_cast<size_t>(i)] = start + static_cast<float>(i);
  return Tensor::FromVector(host, {n}).To(dev);
}

// Whether `t` holds start, start+1, ... (read on the host, after every wait).
bool IsIota(const Tensor& t, float start) {
  const std::vector<float> v = t.ToVector<float>();
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] != start + static_cast<float>(i)) return false;
  }
  return true;
}

// Writes `value` into every float of device tensor `t` (a host copy, then one device copy).
void FillDevice(Tensor& t, float value) {
  std::vector<float> host(static_cast<size_t>(t.numel()), value);
  device::Copy(t.data_ptr(), t.device(), host.data(), device::kCPU, t.nbytes());
}

size_t DeviceFree(const Device& dev) {
  device::GetIpcBackend(dev).EmptyCache(dev.index);
  return device::GetIpcBackend(dev).MemoryInfo(dev.index).free;
}

// ---- child processes (spawn / forkserver entry points) ----------------------------------------

// Receives a tensor, adds 1 to every element on the device's memory, and reports.
void AddOneOnDevice(Queue in, Queue done) {
  Tensor t = in.get<Tensor>(true, kGet);
  std::vector<float> v = t.ToVector<float>();
  for (float& x : v) x += 1.f;
  device::Copy(t.data_ptr(), t.device(), v.data(), device::kCPU, t.nbytes());
  done.put(t.is_shared());
}
FORKSAFE_ENTRY_POINT(AddOneOnDevice);

// Sends a tensor of 7s, drops it, allocates a tensor of the same size (which a careless caching
// allocator would carve from the same block), fills it with 9s, and waits for the parent.
void SendFreeAndReallocate(std::string dev, Queue out, Queue go) {
  Tensor first = Iota(Parse(dev), 4096, 7.f);
  out.put(first);
  first = Tensor();  // the producer drops its tensor
  Tensor second = Tensor::Empty({4096}, DType::kFloat32, Parse(dev));
  FillDevice(second, 9.f);
  device::Synchronize(Parse(dev));
  out.put(std::string("reallocated"));
  go.get<bool>(true, kGet);
}
FORKSAFE_ENTRY_POINT(SendFreeAndReallocate);

// Sends a tensor and returns (the process exits normally).
void SendAndExit(std::string dev, Queue out, int64_t n) { out.put(Iota(Parse(dev), n, 3.f)); }
FORKSAFE_ENTRY_POINT(SendAndExit);

// Queues slow work that writes the tensor, sends it at once (before the work is done), exits.
void SendBeforeTheWorkIsDone(std::string dev, Queue out) {
  const Device d = Parse(dev);
  Tensor t = Tensor::Zeros({1 << 18}, DType::kFloat32, d);
  if (d.type == DeviceType::kSimAccel) {
    Sim().LaunchKernel(d.index, t.data_ptr(), t.nbytes(), [](void* view, size_t bytes) {
      std::this_thread::sleep_for(300ms);
      float* f = static_cast<float*>(view);
      for (size_t i = 0; i < bytes / sizeof(float); ++i) f[i] = 5.f;
    });
  } else {
    device::Backend& b = device::GetBackend(d.type);
    for (int i = 0; i < 50; ++i) b.Memset(d.index, t.data_ptr(), 0, t.nbytes());
    std::vector<float> five(static_cast<size_t>(t.numel()), 5.f);
    // A synchronous copy is ordered after the memsets; the event then covers all of it.
    device::Copy(t.data_ptr(), d, five.data(), device::kCPU, t.nbytes());
  }
  out.put(t);
}
FORKSAFE_ENTRY_POINT(SendBeforeTheWorkIsDone);

// Sim only: queues work that takes 5 s, sends the tensor, and dies by SIGKILL before it is done.
void SendAndDieBeforeTheWorkIsDone(Queue out) {
  const Device d(DeviceType::kSimAccel, 0);
  Tensor t = Tensor::Zeros({1024}, DType::kFloat32, d);
  Sim().LaunchKernel(0, t.data_ptr(), t.nbytes(),
                     [](void*, size_t) { std::this_thread::sleep_for(5s); });
  out.put(t);
  out.put(std::string("sent"));
  std::this_thread::sleep_for(100ms);  // let the feeder hand the messages over
  raise(SIGKILL);
}
FORKSAFE_ENTRY_POINT(SendAndDieBeforeTheWorkIsDone);

// Echoes `n` tensors back, then returns.
void Echo(Queue in, Queue out, int n) {
  for (int i = 0; i < n; ++i) out.put(in.get<Tensor>(true, kGet));
}
FORKSAFE_ENTRY_POINT(Echo);

// Receives `n` tensors, says how many it holds, then holds them until killed.
void HoldUntilKilled(Queue in, Queue report, int n) {
  std::vector<Tensor> held;
  for (int i = 0; i < n; ++i) held.push_back(in.get<Tensor>(true, kGet));
  report.put(static_cast<int>(held.size()));
  std::this_thread::sleep_for(120s);
}
FORKSAFE_ENTRY_POINT(HoldUntilKilled);

// Produces `n` tensors of `bytes` for another process and exits (they outlive it).
void ProduceAndExit(std::string dev, Queue out, int n, int64_t floats) {
  for (int i = 0; i < n; ++i) out.put(Iota(Parse(dev), floats, static_cast<float>(i)));
}
FORKSAFE_ENTRY_POINT(ProduceAndExit);

// Doubles what arrives on the pipe and the argument, in place on the device.
void DoubleOnDevice(Connection c, Tensor as_argument) {
  Tensor t = c.recv<Tensor>();
  for (Tensor* x : {&t, &as_argument}) {
    std::vector<float> v = x->ToVector<float>();
    for (float& f : v) f *= 2.f;
    device::Copy(x->data_ptr(), x->device(), v.data(), device::kCPU, x->nbytes());
  }
  c.send(std::string("doubled"));
}
FORKSAFE_ENTRY_POINT(DoubleOnDevice);

// A Pool task: the sum of a device tensor, and a new device tensor of the same size holding it.
std::pair<double, Tensor> SumOnDevice(Tensor t) {
  double sum = 0;
  for (float f : t.ToVector<float>()) sum += f;
  return {sum, Tensor::Full({t.numel()}, sum, DType::kFloat32, t.device())};
}
FORKSAFE_ENTRY_POINT(SumOnDevice);

// Legacy (sim): sends a tensor over memory from AllocateForeign ("the framework's cudaMalloc"),
// then exits without waiting for the receiver.
void SendForeignAndExit(Queue out) {
  void* p = Sim().AllocateForeign(0, 4096);
  device::Storage s = device::Storage::FromExternal(Device(DeviceType::kSimAccel, 0), p, 4096,
                                                    [](void* q) { Sim().FreeForeign(0, q); });
  Tensor t = Tensor::FromStorage(s, DType::kFloat32, {1024});
  FillDevice(t, 1.f);
  out.put(t);
  std::this_thread::sleep_for(100ms);
}
FORKSAFE_ENTRY_POINT(SendForeignAndExit);

// Legacy: receives a tensor, checks it, reports, keeps it until told, then drops it and says so.
void HoldLegacy(Queue in, Queue report, Queue go) {
  Tensor t = in.get<Tensor>(true, kGet);
  bool ok = true;
  for (float f : t.ToVector<float>()) ok = ok && f == 1.f;
  report.put(ok);
  go.get<bool>(true, kGet);
  for (float f : t.ToVector<float>()) ok = ok && f == 1.f;  // still valid: the free was deferred
  t = Tensor();
  report.put(ok);
}
FORKSAFE_ENTRY_POINT(HoldLegacy);

// Reports what the event pool does in this process (the environment is set by the parent).
void ReportEvents(Queue out) {
  device::IpcBackend& ipc = Sim();
  const device::IpcEventHandle e = ipc.RecordIpcEvent(0);
  out.put(std::make_pair(ipc.IpcEventPoolCapacity(0), e.complete));
}
FORKSAFE_ENTRY_POINT(ReportEvents);

// ---- the tests, per device ---------------------------------------------------------------------

class AccelIpc : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dev_ = Parse(GetParam());
    const int n = device::DeviceCount(dev_.type);
    if (n <= dev_.index) {
      GTEST_SKIP() << "no " << GetParam() << " device on this machine ("
                   << device::DeviceTypeName(dev_.type) << " devices: " << n
                   << "); this test runs where there is one";
    }
  }
  ProcessOptions Spawn() { return ProcessOptions{"", false, "spawn"}; }
  ProcessOptions ForkServer() { return ProcessOptions{"", false, "forkserver"}; }
  bool is_sim() const { return dev_.type == DeviceType::kSimAccel; }
  Device dev_;
};

TEST_P(AccelIpc, ConsumerWritesLandInTheProducersMemory) {
  Tensor t = Iota(dev_, 1000, 0.f);
  Queue q, done;
  Process p(Spawn(), &AddOneOnDevice, q, done);
  p.start();
  q.put(t);
  EXPECT_TRUE(t.is_shared());
  EXPECT_TRUE(done.get<bool>(true, kGet)) << "the receiver's tensor says it is shared";
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
  EXPECT_TRUE(IsIota(t, 1.f)) << "the child wrote the same device memory (zero copy)";
}

TEST_P(AccelIpc, ProducerFreesAndReallocatesBeforeTheConsumerReads) {
  Queue out, go;
  Process p(Spawn(), &SendFreeAndReallocate, GetParam(), out, go);
  p.start();
  Tensor t = out.get<Tensor>(true, kGet);
  EXPECT_EQ(out.get<std::string>(true, kGet), "reallocated");
  // The producer freed its tensor and allocated another of the same size: that one must not
  // have been carved from the block we still read.
  EXPECT_TRUE(IsIota(t, 7.f));
  go.put(true);
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
  EXPECT_TRUE(IsIota(t, 7.f)) << "and after the producer exited";
}

TEST_P(AccelIpc, ProducerExitsBeforeTheConsumerReads) {
  Queue out;
  Process p(ForkServer(), &SendAndExit, GetParam(), out, int64_t{1} << 16);
  p.start();
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
  Tensor t = out.get<Tensor>(true, kGet);  // the producer is gone
  ASSERT_EQ(t.numel(), 1 << 16);
  EXPECT_TRUE(IsIota(t, 3.f));
}

// Memory this process imported is passed on to a third process after its producer exited (the
// CUDA driver cannot export an imported handle: the import's descriptor is sent instead).
TEST_P(AccelIpc, AReceivedTensorIsPassedOnAfterItsProducerExited) {
  Queue out;
  Process producer(ForkServer(), &SendAndExit, GetParam(), out, int64_t{1} << 16);
  producer.start();
  Tensor t = out.get<Tensor>(true, kGet);
  ASSERT_TRUE(producer.join(30s));
  EXPECT_EQ(producer.exitcode(), 0);
  Queue q, done;
  Process consumer(Spawn(), &AddOneOnDevice, q, done);
  consumer.start();
  q.put(t);  // not allocated here, and its producer is gone
  EXPECT_TRUE(done.get<bool>(true, kGet));
  ASSERT_TRUE(consumer.join(30s));
  EXPECT_EQ(consumer.exitcode(), 0);
  EXPECT_TRUE(IsIota(t, 4.f)) << "the third process wrote the producer's memory";
}

TEST_P(AccelIpc, ConsumerWaitsForTheProducersWork) {
  Queue out;
  Process p(Spawn(), &SendBeforeTheWorkIsDone, GetParam(), out);
  p.start();
  Tensor t = out.get<Tensor>(true, kGet);
  // The tensor was sent before the work writing it finished; reading waits for that work.
  for (float f : t.ToVector<float>()) ASSERT_EQ(f, 5.f);
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
}

TEST_P(AccelIpc, ThousandsOfTensorsRoundTrip) {
  const size_t before = DeviceFree(dev_);
  constexpr int kSmall = 2000, kLarge = 8;
  {
    Queue in, out;
    Process echo(ForkServer(), &Echo, in, out, kSmall + kLarge);
    echo.start();
    std::vector<Tensor> sent;
    for (int i = 0; i < kSmall + kLarge; ++i) {
      sent.push_back(Iota(dev_, i < kSmall ? 1024 : (1 << 18), static_cast<float>(i)));
    }
    Tensor busy;
    if (dev_.type == DeviceType::kCUDA) {
      // Work still running when the first tensor is sent: its IPC event is a real one, which
      // the echo waits for (the test below then checks that the waits do not pile up).
      busy = Tensor::Empty({int64_t{16} << 20}, DType::kFloat32, dev_);
      device::Backend& b = device::GetBackend(dev_.type);
      for (int i = 0; i < 50; ++i) b.Memset(dev_.index, busy.data_ptr(), i, busy.nbytes());
    }
    std::atomic<bool> stop{false};
    std::thread feeder([&] {
      try {
        for (const Tensor& t : sent) {
          if (stop.load()) return;
          in.put(t, true, kGet);
        }
      } catch (const Error& e) {
        ADD_FAILURE() << "feeding the echo: " << e.what();
      }
    });
    struct JoinOnExit {  // also when an assertion below returns early
      std::thread& t;
      std::atomic<bool>& stop;
      ~JoinOnExit() {
        stop.store(true);
        t.join();
      }
    } join_feeder{feeder, stop};
    for (int i = 0; i < kSmall + kLarge; ++i) {
      Tensor back = out.get<Tensor>(true, kGet);
      ASSERT_EQ(back.storage(), sent[static_cast<size_t>(i)].storage())
          << "tensor " << i << " came home as the same storage";
    }
    if (dev_.type == DeviceType::kCUDA) {
      // (Before any synchronize, which forgets every wait.) Waits on the echo's events that the
      // stream has passed are forgotten, not piled up: they once grew by one per message and
      // made every send on both sides record an event (a round trip took 8 times longer).
      EXPECT_LE(static_cast<device::CudaBackend&>(device::GetBackend(DeviceType::kCUDA))
                    .Stats(dev_.index)
                    .ipc_waits,
                1u);
    }
    ASSERT_TRUE(echo.join(30s));
    EXPECT_EQ(echo.exitcode(), 0);
    for (int i : {0, 1, kSmall - 1, kSmall, kSmall + kLarge - 1}) {
      EXPECT_TRUE(IsIota(sent[static_cast<size_t>(i)], static_cast<float>(i))) << i;
    }
  }
  EXPECT_EQ(DeviceFree(dev_), before) << "every block came back once all holders let go";
}

TEST_P(AccelIpc, AKilledConsumerGivesItsDeviceMemoryBack) {
  const size_t before = DeviceFree(dev_);
  constexpr int kN = 4;
  constexpr int64_t kFloats = int64_t{1} << 20;  // 4 MiB each
  Queue q, report;
  Process producer(ForkServer(), &ProduceAndExit, GetParam(), q, kN, kFloats);
  Process consumer(Spawn(), &HoldUntilKilled, q, report, kN);
  producer.start();
  consumer.start();
  EXPECT_EQ(report.get<int>(true, kGet), kN);
  ASSERT_TRUE(producer.join(30s));
  EXPECT_EQ(producer.exitcode(), 0);
  // Only the consumer holds the memory now (the producer exited).
  const size_t held = DeviceFree(dev_);
  EXPECT_LE(held + kN * kFloats * sizeof(float), before) << "the consumer's mappings hold it";
  consumer.kill();
  ASSERT_TRUE(consumer.join(30s));
  EXPECT_EQ(consumer.exitcode(), -SIGKILL);
  size_t after = 0;
  for (int i = 0; i < 200 && (after = DeviceFree(dev_)) != before; ++i) {
    std::this_thread::sleep_for(20ms);  // the kernel or driver tears the mappings down
  }
  EXPECT_EQ(after, before) << "device free memory returned to where it was";
}

TEST_P(AccelIpc, PipeAndProcessArguments) {
  Tensor through_pipe = Iota(dev_, 256, 1.f);
  Tensor as_argument = Iota(dev_, 128, 10.f);
  auto [mine, theirs] = Pipe();
  Process p(Spawn(), &DoubleOnDevice, theirs, as_argument);
  p.start();
  mine.send(through_pipe);
  ASSERT_TRUE(mine.poll(kGet));
  EXPECT_EQ(mine.recv<std::string>(), "doubled");
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
  const std::vector<float> a = through_pipe.ToVector<float>();
  const std::vector<float> b = as_argument.ToVector<float>();
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], 2.f * (1.f + i));
  for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b[i], 2.f * (10.f + i));
}

TEST_P(AccelIpc, PoolMapsOverDeviceTensors) {
  std::vector<Tensor> inputs;
  for (int i = 0; i < 40; ++i) inputs.push_back(Tensor::Full({256}, i, DType::kFloat32, dev_));
  PoolOptions o;
  o.processes = 2;
  o.start_method = "forkserver";
  Pool pool(o);
  std::vector<std::pair<double, Tensor>> out = pool.map(&SumOnDevice, inputs);
  ASSERT_EQ(out.size(), inputs.size());
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].first, 256.0 * i);
    ASSERT_EQ(out[i].second.device(), dev_) << "results come back on the device";
    EXPECT_EQ(out[i].second.item<float>({5}), static_cast<float>(256.0 * i));
  }
  pool.close();
  pool.join();
}

TEST_P(AccelIpc, AForkedChildOfAParentThatUsedTheDeviceIsRefusedClearly) {
  Tensor t = Iota(dev_, 16, 0.f);
  Queue q;
  q.put(t);
  const auto r = forksafe::testing::RunInChild(
      [&] {
        try {
          Tensor got = q.get<Tensor>(true, 10.0);
          return 3;  // imported in a poisoned child
        } catch (const Error& e) {
          const std::string what = e.what();
          return e.code() == ErrorCode::kForkPoisoned &&
                         (what.find("spawn") != std::string::npos ||
                          what.find("forkserver") != std::string::npos)
                     ? 0
                     : 4;
        }
      },
      30s);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

INSTANTIATE_TEST_SUITE_P(Devices, AccelIpc, ::testing::Values("sim:0", "cuda:0"),
                         [](const auto& info) {
                           return info.param.substr(0, info.param.find(':'));
                         });

// ---- the simulated accelerator only ------------------------------------------------------------

TEST(SimIpc, AProducerThatDiesBeforeItsWorkIsDoneIsAnErrorNotHalfWrittenData) {
  Queue out;
  Process p(ProcessOptions{"", false, "spawn"}, &SendAndDieBeforeTheWorkIsDone, out);
  p.start();
  Tensor t = out.get<Tensor>(true, kGet);
  EXPECT_EQ(out.get<std::string>(true, kGet), "sent");
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), -SIGKILL);
  try {
    t.ToVector<float>();
    FAIL() << "read memory whose producer died before writing it";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kProcessFailed);
    EXPECT_NE(std::string(e.what()).find("exited before its work on it completed"),
              std::string::npos)
        << e.what();
  }
}

TEST(SimIpc, LegacyHandlesEnforceTheProducerKeepsAliveRule) {
  // The producer's tensor lives in memory forksafe did not allocate: it crosses with a legacy
  // handle. Dropping it while the consumer holds it must not free it under the consumer.
  bool freed = false;
  void* p = Sim().AllocateForeign(0, 4096);
  {
    device::Storage s =
        device::Storage::FromExternal(Device(DeviceType::kSimAccel, 0), p, 4096, [&freed](void* q) {
          Sim().FreeForeign(0, q);
          freed = true;
        });
    Tensor t = Tensor::FromStorage(s, DType::kFloat32, {1024});
    FillDevice(t, 1.f);
    Queue in, report, go;
    Process c(ProcessOptions{"", false, "spawn"}, &HoldLegacy, in, report, go);
    c.start();
    in.put(t);
    EXPECT_TRUE(report.get<bool>(true, kGet));
    t = Tensor();
    s = device::Storage();  // the producer drops its last handle while the consumer holds it
    EXPECT_FALSE(freed) << "the free is deferred while another process maps the memory";
    go.put(true);
    EXPECT_TRUE(report.get<bool>(true, kGet)) << "the consumer's data stayed intact";
    ASSERT_TRUE(c.join(30s));
    EXPECT_EQ(c.exitcode(), 0);
    // The consumer let go: the next legacy operation runs the deferred free.
    void* other = Sim().AllocateForeign(0, 256);
    device::Storage s2 = device::Storage::FromExternal(Device(DeviceType::kSimAccel, 0), other, 256,
                                                       [](void* q) { Sim().FreeForeign(0, q); });
    Queue self;
    self.put(Tensor::FromStorage(s2, DType::kFloat32, {64}));
    Tensor back = self.get<Tensor>(true, kGet);
    EXPECT_EQ(back.storage(), s2) << "a legacy tensor that comes home is the same storage";
  }
  EXPECT_TRUE(freed) << "the deferred free ran once the consumer let go";
}

TEST(SimIpc, ALegacyTensorWhoseProducerExitedIsRefusedClearly) {
  Queue out;
  Process p(ProcessOptions{"", false, "spawn"}, &SendForeignAndExit, out);
  p.start();
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
  try {
    Tensor t = out.get<Tensor>(true, kGet);
    FAIL() << "imported a legacy handle whose producer had exited";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition);
    const std::string what = e.what();
    EXPECT_NE(what.find("has exited"), std::string::npos) << what;
    EXPECT_NE(what.find("keeps the tensor alive"), std::string::npos) << what;
  }
}

TEST(SimIpc, ALegacyTensorCannotBePassedOn) {
  void* p = Sim().AllocateForeign(0, 1024);
  device::Storage s = device::Storage::FromExternal(Device(DeviceType::kSimAccel, 0), p, 1024,
                                                    [](void* q) { Sim().FreeForeign(0, q); });
  Tensor t = Tensor::FromStorage(s, DType::kFloat32, {256});
  FillDevice(t, 1.f);
  Queue in, out;
  Process fwd(ProcessOptions{"", false, "spawn"}, &Echo, in, out, 1);
  fwd.start();
  in.put(t);
  // The echo child cannot pass it on: its put throws kFailedPrecondition, and the child fails.
  ASSERT_TRUE(fwd.join(30s));
  EXPECT_EQ(fwd.exitcode(), 1) << "the child's put refused to pass the legacy tensor on";
}

TEST(SimIpc, EventPoolIsBoundedAndFallsBackToSynchronizing) {
  device::IpcBackend& ipc = Sim();
  const int cap = ipc.IpcEventPoolCapacity(0);
  EXPECT_EQ(cap, 64);
  std::vector<uint32_t> slots;
  for (int i = 0; i < 3 * cap; ++i) {
    const device::IpcEventHandle e = ipc.RecordIpcEvent(0);
    ASSERT_FALSE(e.complete);
    ASSERT_LT(e.slot, static_cast<uint32_t>(cap)) << "events are recycled within the bound";
    slots.push_back(e.slot);
  }
  EXPECT_EQ(slots[0], slots[cap]) << "round robin";
  ipc.WaitIpcEvent(0, ipc.RecordIpcEvent(0));  // our own event: nothing to wait for
  device::Synchronize(Device(DeviceType::kSimAccel, 0));
  // With no events to be had, the producer synchronizes and says there is nothing to wait for.
  Queue out;
  ASSERT_EQ(setenv("FORKSAFE_SIM_IPC_EVENTS", "0", 1), 0);
  Process p(ProcessOptions{"", false, "spawn"}, &ReportEvents, out);
  p.start();
  unsetenv("FORKSAFE_SIM_IPC_EVENTS");
  const auto [capacity, complete] = out.get<std::pair<int, bool>>(true, kGet);
  EXPECT_EQ(capacity, 0);
  EXPECT_TRUE(complete);
  ASSERT_TRUE(p.join(30s));
}

TEST(SimIpc, MalformedHandlesAreRefused) {
  device::IpcBackend& ipc = Sim();
  const Device d(DeviceType::kSimAccel, 0);
  Tensor t = Iota(d, 64, 0.f);
  device::IpcMemoryHandle good = ipc.ExportMemory(0, t.data_ptr(), t.nbytes());
  auto expect = [&](device::IpcMemoryHandle h, ErrorCode code, const char* text) {
    try {
      void* p = ipc.ImportMemory(h);
      ipc.ReleaseImported(0, p);
      ADD_FAILURE() << "imported a bad handle (" << text << ")";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  device::IpcMemoryHandle h = good;
  h.segment_id ^= 1;  // a segment new here, so the descriptor is looked at
  h.fd = pipefd[0];
  expect(h, ErrorCode::kInvalidArgument, "is not a sim:0 segment");
  h = good;
  h.segment_id ^= 1;
  h.segment_size += 4096;
  expect(h, ErrorCode::kInvalidArgument, "is not a sim:0 segment");
  h = good;
  h.offset = h.segment_size;
  expect(h, ErrorCode::kInvalidArgument, "malformed handle");
  h = good;
  h.size = 0;
  expect(h, ErrorCode::kInvalidArgument, "malformed handle");
  h = good;
  h.segment_id ^= 1;
  h.device = Device(DeviceType::kSimAccel, 1);
  expect(h, ErrorCode::kInvalidArgument, "is not a sim:1 segment");
  h = good;
  h.segment_id ^= 1;
  h.fd = -1;
  expect(h, ErrorCode::kInvalidArgument, "no descriptor");
  close(pipefd[0]);
  close(pipefd[1]);
  close(good.fd);
  EXPECT_THROW(ipc.ExportMemory(0, t.data_ptr(), t.nbytes() + 1), Error) << "past the end";
  EXPECT_THROW(ipc.ReleaseImported(0, t.data_ptr()), Error) << "not an import";
  EXPECT_THROW(ipc.ExportLegacyMemory(0, t.data_ptr(), t.nbytes()), Error)
      << "forksafe's own memory takes ExportMemory";
}

TEST(SimIpc, HeldBlocksAreNotReusedUntilReleased) {
  device::SimBackend& sim = Sim();
  const Device d(DeviceType::kSimAccel, 0);
  bool released = false;
  void* a = device::Allocate(d, 4096);
  sim.HoldAfterFree(0, a, [&released] { return released; });
  device::Free(d, a);
  std::vector<void*> others;
  for (int i = 0; i < 64; ++i) {
    void* b = device::Allocate(d, 4096);
    EXPECT_NE(b, a) << "a held block was handed out again";
    others.push_back(b);
  }
  for (void* b : others) device::Free(d, b);
  released = true;
  sim.EmptyCache(0);
  void* c = device::Allocate(d, 4096);
  device::Free(d, c);
  EXPECT_EQ(sim.BytesInUse(0), 0u);
}

TEST(SimIpc, BadCallsAreRefusedClearly) {
  device::SimBackend& sim = Sim();
  const Device d(DeviceType::kSimAccel, 0);
  auto expect = [](const std::function<void()>& call, ErrorCode code, const char* text) {
    try {
      call();
      ADD_FAILURE() << "accepted a bad call (" << text << ")";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect([] { device::GetIpcBackend(device::kCPU); }, ErrorCode::kUnavailable,
         "cross through shared memory");
  void* a = device::Allocate(d, 4096);
  void* inside = static_cast<char*>(a) + 256;
  expect([&] { sim.HoldAfterFree(0, inside, [] { return true; }); }, ErrorCode::kInvalidArgument,
         "not the start of a live block");
  expect([&] { sim.HoldAfterFree(0, a, nullptr); }, ErrorCode::kInvalidArgument, "empty predicate");
  expect([&] { sim.FreeForeign(0, a); }, ErrorCode::kInvalidArgument,
         "not memory from AllocateForeign");
  device::Free(d, a);
  expect([&] { sim.AllocateForeign(0, 0); }, ErrorCode::kInvalidArgument, "size must be > 0");
  void* f = sim.AllocateForeign(0, 512);
  expect([&] { device::Free(d, f); }, ErrorCode::kInvalidArgument, "free it with FreeForeign");
  expect([&] { sim.ExportMemory(0, f, 512); }, ErrorCode::kInvalidArgument,
         "share it with ExportLegacyMemory");
  sim.FreeForeign(0, f);
  device::IpcEventHandle e = sim.RecordIpcEvent(0);
  e.complete = false;
  e.slot = 5000;
  expect([&] { sim.WaitIpcEvent(0, e); }, ErrorCode::kInvalidArgument, "slot out of range");
  device::IpcEventHandle foreign;
  foreign.complete = false;
  foreign.pool_id = 12345;
  foreign.fd = -1;
  expect([&] { sim.WaitIpcEvent(0, foreign); }, ErrorCode::kInvalidArgument, "no descriptor");
  device::Synchronize(d);
  EXPECT_EQ(sim.BytesInUse(0), 0u);
}

TEST(SimIpc, ImportingOwnMemoryReturnsTheSamePointer) {
  device::SimBackend& sim = Sim();
  Tensor t = Iota(Device(DeviceType::kSimAccel, 0), 64, 0.f);
  device::IpcMemoryHandle h = sim.ExportMemory(0, t.data_ptr(), t.nbytes());
  void* p = sim.ImportMemory(h);
  EXPECT_EQ(p, t.data_ptr());
  sim.ReleaseImported(0, p);
  close(h.fd);
}

}  // namespace
}  // namespace forksafe::mp
