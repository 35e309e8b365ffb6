// Tests of Device parsing, the backend registry, the CPU backend and the simulated accelerator,
// including the fork rules: CPU default in the child, poisoning, queries that never initialize.
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/device/backend.h"
#include "forksafe/device/cpu_backend.h"
#include "forksafe/device/device.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/sim_backend.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::device {
namespace {

using forksafe::testing::RunInChild;
using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;

SimBackend& Sim() { return static_cast<SimBackend&>(GetBackend(DeviceType::kSimAccel)); }

TEST(DeviceTest, ParsesAndPrints) {
  EXPECT_EQ(ParseDevice("cpu"), kCPU);
  EXPECT_EQ(ParseDevice("sim"), Device(DeviceType::kSimAccel, 0));
  EXPECT_EQ(ParseDevice("sim:1").ToString(), "sim:1");
  EXPECT_EQ(ParseDevice("cuda:3"), Device(DeviceType::kCUDA, 3));
  for (const char* bad : {"", "gpu", "cpu:1", "sim:", "sim:-1", "sim:x", "cuda:1:2"}) {
    try {
      ParseDevice(bad);
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("expected \"cpu\""), std::string::npos) << e.what();
    }
  }
}

TEST(RegistryTest, BuiltInBackendsAndErrors) {
  EXPECT_TRUE(HasBackend(DeviceType::kCPU));
  EXPECT_TRUE(HasBackend(DeviceType::kSimAccel));
  EXPECT_EQ(DeviceCount(DeviceType::kCPU), 1);
  EXPECT_EQ(DeviceCount(DeviceType::kSimAccel), 2);
  try {
    SetDefaultDevice(Device(DeviceType::kSimAccel, 7));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("has 2 device(s)"), std::string::npos) << e.what();
  }
  if (!HasBackend(DeviceType::kCUDA)) {
    try {
      GetBackend(DeviceType::kCUDA);
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
      EXPECT_NE(std::string(e.what()).find("available backends: cpu, sim"), std::string::npos)
          << e.what();
    }
  }
  try {
    RegisterBackend(std::make_unique<CpuBackend>());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kAlreadyExists);
  }
  // Every backend registered itself (FORKSAFE_REGISTER_BACKEND); a second factory for a type is
  // refused without throwing (it runs from static initializers).
  EXPECT_TRUE(HasBackend(DeviceType::kCPU));
  EXPECT_TRUE(HasBackend(DeviceType::kSimAccel));
  EXPECT_TRUE(HasBackend(DeviceType::kCUDA));
  EXPECT_FALSE(RegisterBackendFactory(DeviceType::kCPU, []() -> std::unique_ptr<Backend> {
    return std::make_unique<CpuBackend>();
  }));
  EXPECT_EQ(GetBackend(DeviceType::kCPU).name(), "cpu");
  std::vector<Device> all = AvailableDevices();
  ASSERT_GE(all.size(), 3u);
  EXPECT_EQ(all[0], kCPU);
}

TEST(RegistryTest, CurrentDeviceIsPerThreadAndFollowsDefault) {
  EXPECT_EQ(CurrentDevice(), DefaultDevice());
  {
    DeviceGuard g(Device(DeviceType::kSimAccel, 1));
    EXPECT_EQ(CurrentDevice(), Device(DeviceType::kSimAccel, 1));
    Device other_thread;
    std::thread([&] { other_thread = CurrentDevice(); }).join();
    EXPECT_EQ(other_thread, DefaultDevice());
  }
  EXPECT_EQ(CurrentDevice(), DefaultDevice());
}

TEST(CpuBackendTest, AllocateCopyFree) {
  void* a = Allocate(kCPU, 1000);
  void* b = Allocate(kCPU, 1000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % CpuBackend::kAlignment, 0u);
  std::memset(a, 0x5a, 1000);
  Copy(b, kCPU, a, kCPU, 1000);
  EXPECT_EQ(std::memcmp(a, b, 1000), 0);
  Free(kCPU, a);
  Free(kCPU, b);
  EXPECT_THROW(Allocate(kCPU, 0), Error);
  EXPECT_TRUE(GetBackend(DeviceType::kCPU).Properties(0).host_accessible);
}

// Every sim test below initializes the sim backend in this (parent) process, which is what the
// fork tests need: they check what a child of an initialized parent sees.
TEST(SimBackendTest, ExplicitCopiesRoundTrip) {
  const Device d0(DeviceType::kSimAccel, 0), d1(DeviceType::kSimAccel, 1);
  std::vector<float> host(1024), back(1024, 0.f);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i);
  void* p0 = Allocate(d0, host.size() * sizeof(float));
  void* p1 = Allocate(d1, host.size() * sizeof(float));
  EXPECT_FALSE(GetBackend(DeviceType::kSimAccel).Properties(0).host_accessible);
  Copy(p0, d0, host.data(), kCPU, host.size() * sizeof(float));
  Copy(p1, d1, p0, d0, host.size() * sizeof(float));  // device to device
  Sim().LaunchKernel(1, p1, host.size() * sizeof(float), [](void* v, size_t n) {
    float* f = static_cast<float*>(v);
    for (size_t i = 0; i < n / sizeof(float); ++i) f[i] *= 2;
  });
  Synchronize(d1);
  Copy(back.data(), kCPU, p1, d1, host.size() * sizeof(float));
  for (size_t i = 0; i < host.size(); ++i) ASSERT_EQ(back[i], 2 * host[i]);
  EXPECT_GE(Sim().BytesInUse(0), host.size() * sizeof(float));
  Free(d0, p0);
  Free(d1, p1);
  EXPECT_EQ(Sim().BytesInUse(0), 0u);
  EXPECT_EQ(Sim().BytesInUse(1), 0u);
  EXPECT_EQ(Sim().context_owner(), getpid());
}

TEST(SimBackendTest, MemoryErrorsAreClear) {
  const Device d0(DeviceType::kSimAccel, 0);
  void* p = Allocate(d0, 256);
  char buf[512] = {};
  try {
    Copy(p, d0, buf, kCPU, 512);  // past the end of the allocation
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("not inside a live allocation"), std::string::npos);
  }
  try {
    Copy(p, Device(DeviceType::kSimAccel, 1), buf, kCPU, 16);  // wrong device
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not memory of device sim:1"), std::string::npos);
  }
  try {
    Allocate(d0, size_t{1} << 40);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kResourceExhausted);
    EXPECT_NE(std::string(e.what()).find("FORKSAFE_SIM_MEMORY_MB"), std::string::npos);
  }
  Free(d0, p);
  try {
    Free(d0, p);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("double free"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Sim().LaunchKernel(0, p, 16, [](void*, size_t) {}), Error);  // freed memory
}

TEST(SimBackendTest, KernelErrorsSurfaceAtSynchronize) {
  const Device d0(DeviceType::kSimAccel, 0);
  void* p = Allocate(d0, 64);
  Sim().LaunchKernel(0, p, 64, [](void*, size_t) { throw std::runtime_error("kernel fault"); });
  EXPECT_THROW(Synchronize(d0), std::runtime_error);
  Synchronize(d0);  // reported once
  Free(d0, p);
}

TEST(SimBackendTest, AllocationsCoalesceWhenFreed) {
  const Device d0(DeviceType::kSimAccel, 0);
  const size_t total = GetBackend(DeviceType::kSimAccel).Properties(0).total_memory;
  std::vector<void*> ps;
  for (int i = 0; i < 4; ++i) ps.push_back(Allocate(d0, total / 4));
  EXPECT_THROW(Allocate(d0, 256), Error);  // full
  Free(d0, ps[1]);
  Free(d0, ps[3]);
  Free(d0, ps[2]);  // coalesces 1..3
  void* big = Allocate(d0, 3 * (total / 4));
  Free(d0, big);
  Free(d0, ps[0]);
  EXPECT_EQ(Sim().BytesInUse(0), 0u);
}

TEST(DeviceForkTest, ChildDefaultsToCpuAndSimIsPoisoned) {
  const Device d1(DeviceType::kSimAccel, 1);
  void* p = Allocate(d1, 64);  // the parent uses the accelerator
  SetDefaultDevice(d1);
  SetCurrentDevice(d1);
  auto child = RunInChild(
      [&] {
        if (DefaultDevice() != kCPU) return 1;
        if (CurrentDevice() != kCPU) return 2;
        if (!Sim().poisoned()) return 3;
        // Queries still work and do not throw.
        if (DeviceCount(DeviceType::kSimAccel) != 2) return 4;
        if (GetBackend(DeviceType::kSimAccel).Properties(1).total_memory == 0) return 5;
        try {
          Allocate(d1, 64);
          return 6;
        } catch (const Error& e) {
          const std::string m = e.what();
          if (e.code() != ErrorCode::kForkPoisoned) return 7;
          if (m.find("spawn") == std::string::npos || m.find("forkserver") == std::string::npos)
            return 8;
          if (m.find(std::to_string(getppid())) == std::string::npos) return 9;
        }
        try {
          char c;
          Copy(&c, kCPU, p, d1, 1);
          return 10;
        } catch (const Error& e) {
          if (e.code() != ErrorCode::kForkPoisoned) return 11;
        }
        // CPU work is fine, and so is a grandchild, which is poisoned too.
        void* h = Allocate(kCPU, 128);
        Free(kCPU, h);
        auto gc =
            RunInChild([] { return Sim().poisoned() && DefaultDevice() == kCPU ? 0 : 1; }, 10s);
        return gc.ok() ? 0 : 12;
      },
      20s);
  EXPECT_TRUE(child.ok()) << child.Describe();
  // The parent is untouched.
  EXPECT_EQ(DefaultDevice(), d1);
  EXPECT_EQ(CurrentDevice(), d1);
  EXPECT_TRUE(Sim().initialized());
  Free(d1, p);
  SetDefaultDevice(kCPU);
  SetCurrentDevice(std::nullopt);
}

// A backend that was only queried in the parent is not poisoned in the child: it initializes
// there for the first time (as CUDA does when the parent never touched it).
TEST(DeviceForkTest, QueriesDoNotInitializeAndAnUninitializedBackendWorksInAChild) {
  // A separate instance, since the registered one is initialized by the tests above.
  SimBackend sim;
  EXPECT_EQ(sim.DeviceCount(), 2);
  EXPECT_FALSE(sim.Properties(0).name.empty());
  EXPECT_EQ(sim.state(), BackendState::kUninitialized) << "queries must not initialize";
  auto child = RunInChild(
      [&] {
        if (sim.state() != BackendState::kUninitialized) return 1;
        sim.OnForkChild();             // what the registry does for registered backends
        if (sim.poisoned()) return 2;  // never initialized in the parent: usable here
        void* p = sim.Allocate(0, 64);
        char in[64] = "hello", out[64] = {};
        sim.Copy(p, Device(DeviceType::kSimAccel, 0), in, kCPU, 64);
        sim.Copy(out, kCPU, p, Device(DeviceType::kSimAccel, 0), 64);
        sim.Free(0, p);
        return std::strcmp(out, "hello") == 0 && sim.context_owner() == getpid() ? 0 : 3;
      },
      20s);
  EXPECT_TRUE(child.ok()) << child.Describe();
  EXPECT_EQ(sim.state(), BackendState::kUninitialized);
}

TEST(DeviceForkTest, BadEnvironmentIsAClearError) {
  auto child = RunInChild([] {
    setenv("FORKSAFE_SIM_DEVICES", "lots", 1);
    SimBackend fresh;  // the registered one is fixed once initialized
    try {
      fresh.DeviceCount();
      return 1;
    } catch (const Error& e) {
      return std::string(e.what()).find("FORKSAFE_SIM_DEVICES") != std::string::npos ? 0 : 2;
    }
  });
  EXPECT_TRUE(child.ok()) << child.Describe();
}

}  // namespace
}  // namespace forksafe::device
