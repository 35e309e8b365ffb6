// Tests of the tensor layer of device/: Storage (refcounts, deleters, zero-byte blocks), DType,
// Tensor (creation, views that share storage, strided reads, copies across devices, element
// access on the CPU and the simulated accelerator, every bad-input path), DLPack export/import
// (zero-copy both ways, deleters called exactly once) and fork behaviour (CPU tensors readable in
// a forked child, simulated-accelerator tensors poisoned there).
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/device/device.h"
#include "forksafe/device/dlpack.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/sim_backend.h"
#include "forksafe/device/storage.h"
#include "forksafe/device/storage_sharing.h"
#include "forksafe/device/tensor.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::device {
namespace {

using forksafe::testing::RunInChild;
using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;

const Device kSim0(DeviceType::kSimAccel, 0);
const Device kSim1(DeviceType::kSimAccel, 1);

SimBackend& Sim() { return static_cast<SimBackend&>(GetBackend(DeviceType::kSimAccel)); }

// Runs `fn` and checks that it throws an Error with `code` whose what() contains `needle`.
template <class Fn>
void ExpectError(Fn&& fn, ErrorCode code, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown; expected " << runtime::ErrorCodeName(code)
                  << " mentioning \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "\"" << e.what() << "\" does not mention \"" << needle << "\"";
  }
}

#define EXPECT_ERROR(code, needle, ...)                      \
  do {                                                       \
    SCOPED_TRACE(#__VA_ARGS__);                              \
    ExpectError([&] { (void)(__VA_ARGS__); }, code, needle); \
  } while (0)

std::vector<float> Iota(int n, float start = 0) {
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

// A CPU storage over malloc'd memory whose release is counted.
Storage CountedCpuStorage(size_t nbytes, std::atomic<int>* releases, void** out_ptr = nullptr) {
  void* p = std::malloc(nbytes);
  if (out_ptr != nullptr) *out_ptr = p;
  return Storage::FromExternal(kCPU, p, nbytes, [releases, p](void* q) {
    EXPECT_EQ(q, p);
    releases->fetch_add(1);
    std::free(q);
  });
}

// ---- Storage --------------------------------------------------------------------------------

TEST(StorageTest, CopiesShareTheBlockAndCountReferences) {
  Storage a = Storage::Allocate(kCPU, 256);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(a.nbytes(), 256u);
  EXPECT_EQ(a.device(), kCPU);
  EXPECT_EQ(a.use_count(), 1);
  {
    Storage b = a;
    EXPECT_EQ(a.use_count(), 2);
    EXPECT_EQ(b.data(), a.data());
    EXPECT_TRUE(a == b);
    std::memset(b.data(), 0x7f, 256);
    EXPECT_EQ(static_cast<unsigned char*>(a.data())[255], 0x7f);
    EXPECT_FALSE(a.is_shared());
    b.set_shared(true);
    EXPECT_TRUE(a.is_shared());
    EXPECT_EQ(a.sharing_context(), nullptr);
    auto ctx = std::make_shared<int>(42);
    b.set_sharing_context(ctx);
    EXPECT_EQ(*std::static_pointer_cast<int>(a.sharing_context()), 42);
    EXPECT_EQ(ctx.use_count(), 2);  // the storage holds one reference
  }
  EXPECT_EQ(a.use_count(), 1);
  EXPECT_TRUE(a != Storage::Allocate(kCPU, 256));
}

TEST(StorageTest, ExternalDeleterRunsOnceWhenTheLastReferenceGoes) {
  std::atomic<int> releases{0};
  void* p = nullptr;
  {
    Storage s = CountedCpuStorage(64, &releases, &p);
    EXPECT_EQ(s.data(), p);
    Tensor t = Tensor::FromStorage(s, DType::kFloat32, {16});
    EXPECT_EQ(s.use_count(), 2);  // the tensor holds one
    Tensor view = t.Slice(0, 2, 6);
    EXPECT_EQ(s.use_count(), 3);
    s = Storage();  // drop the original handle: the tensors keep the block alive
    t = Tensor();
    EXPECT_EQ(releases.load(), 0);
    EXPECT_EQ(view.storage().use_count(), 1);
    view.set<float>({0}, 1.5f);
    EXPECT_EQ(static_cast<float*>(p)[2], 1.5f);
  }
  EXPECT_EQ(releases.load(), 1);
}

TEST(StorageTest, RefcountIsThreadSafe) {
  std::atomic<int> releases{0};
  {
    Storage s = CountedCpuStorage(16, &releases);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([s] {  // a copy per thread
        for (int i = 0; i < 2000; ++i) {
          std::vector<Storage> copies(8, s);
          Tensor view = Tensor::FromStorage(copies[3], DType::kUInt8, {16});
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(s.use_count(), 1);
    EXPECT_EQ(releases.load(), 0);
  }
  EXPECT_EQ(releases.load(), 1);
}

TEST(StorageTest, ZeroByteStorages) {
  Storage empty;
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.nbytes(), 0u);
  EXPECT_EQ(empty.device(), kCPU);
  Storage cpu0 = Storage::Allocate(kCPU, 0);
  EXPECT_EQ(cpu0.data(), nullptr);
  const size_t before = Sim().BytesInUse(1);
  Storage sim0 = Storage::Allocate(kSim1, 0);
  EXPECT_EQ(sim0.data(), nullptr);
  EXPECT_EQ(sim0.device(), kSim1);
  EXPECT_EQ(Sim().BytesInUse(1), before);
  int calls = 0;
  {
    Storage ext = Storage::FromExternal(kCPU, nullptr, 0, [&](void*) { ++calls; });
  }
  EXPECT_EQ(calls, 1);  // the deleter runs even for an empty block
}

TEST(StorageTest, DeviceMemoryIsFreedWithTheLastReference) {
  const size_t before = Sim().BytesInUse(1);
  {
    Storage s = Storage::Allocate(kSim1, 1000);
    EXPECT_EQ(s.device(), kSim1);
    EXPECT_GE(Sim().BytesInUse(1), before + 1000);
    Storage copy = s;
    s = Storage();
    EXPECT_GE(Sim().BytesInUse(1), before + 1000);
  }
  EXPECT_EQ(Sim().BytesInUse(1), before);
}

TEST(StorageTest, BadInputs) {
  int calls = 0;
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "null pointer with a size of 16",
               Storage::FromExternal(kCPU, nullptr, 16, [&](void*) { ++calls; }));
  EXPECT_EQ(calls, 0);  // a failed FromExternal does not take the memory
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "sim:7 does not exist",
               Storage::Allocate(Device(DeviceType::kSimAccel, 7), 16));
  EXPECT_ERROR(ErrorCode::kResourceExhausted, "out of memory",
               Storage::Allocate(kSim0, size_t{1} << 40));
  if (!HasBackend(DeviceType::kCUDA)) {
    EXPECT_ERROR(ErrorCode::kUnavailable, "no \"cuda\" backend",
                 Storage::Allocate(Device(DeviceType::kCUDA, 0), 16));
  }
}

TEST(StorageTest, AThrowingDeleterDoesNotEscape) {
  int calls = 0;
  {
    Storage s = Storage::FromExternal(kCPU, &calls, sizeof calls, [&](void*) {
      ++calls;
      throw std::runtime_error("deleter failure");
    });
  }
  EXPECT_EQ(calls, 1);
}

// What the sharing layer's extension point (device/storage_sharing.h) lets mp/ do: move a block
// in place (share_memory_), keep an identity table (WeakStorage), wrap a release (legacy IPC).
TEST(StorageTest, MoveStorageDataRedirectsEveryHandleAndReleasesTheOldMemory) {
  std::atomic<int> old_releases{0}, new_releases{0};
  void* old_ptr = nullptr;
  Storage s = CountedCpuStorage(4 * sizeof(float), &old_releases, &old_ptr);
  Tensor t = Tensor::FromStorage(s, DType::kFloat32, {4});
  Tensor view = t.Slice(0, 1, 3);
  for (int i = 0; i < 4; ++i) t.set<float>({i}, static_cast<float>(i));
  std::vector<float> replacement(4);
  std::memcpy(replacement.data(), old_ptr, 4 * sizeof(float));  // the caller copies first
  MoveStorageData(s, replacement.data(), [&](void* p) {
    EXPECT_EQ(p, replacement.data());
    new_releases.fetch_add(1);
  });
  EXPECT_EQ(old_releases.load(), 1);  // the old block went at once
  EXPECT_EQ(s.data(), replacement.data());
  EXPECT_EQ(t.data_ptr(), replacement.data());
  EXPECT_EQ(view.data_ptr(), replacement.data() + 1);
  EXPECT_EQ(view.ToVector<float>(), (std::vector<float>{1, 2}));
  view.set<float>({0}, 10.f);
  EXPECT_EQ(replacement[1], 10.f);
  EXPECT_EQ(s.use_count(), 3);
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "null destination",
               MoveStorageData(s, nullptr, nullptr));
  s = Storage();
  t = Tensor();
  view = Tensor();
  EXPECT_EQ(new_releases.load(), 1);
  EXPECT_EQ(old_releases.load(), 1);
}

TEST(StorageTest, WrapStorageReleaseRunsTheWrapperWithTheOldRelease) {
  std::atomic<int> old_releases{0}, wrapper_calls{0};
  Storage s = CountedCpuStorage(16, &old_releases);
  EXPECT_FALSE(IsBackendAllocation(s));
  EXPECT_TRUE(IsBackendAllocation(Storage::Allocate(kCPU, 16)));
  WrapStorageRelease(s, [&](std::function<void(void*)> old) {
    return std::function<void(void*)>([&, old](void* p) {
      wrapper_calls.fetch_add(1);
      old(p);
    });
  });
  EXPECT_EQ(old_releases.load(), 0);
  s = Storage();
  EXPECT_EQ(wrapper_calls.load(), 1);
  EXPECT_EQ(old_releases.load(), 1);
}

// The extension point itself: one sharing layer per process, reached by ShareHostStorage for CPU
// storages only. (This binary does not link mp/, so the test installs its own.)
std::atomic<int> g_test_shares{0};
void TestShare(const Storage& s) {
  g_test_shares.fetch_add(1);
  s.set_shared(true);
}
const StorageSharing kTestSharing{"test", &TestShare};
const StorageSharing kOtherSharing{"other", &TestShare};

TEST(StorageSharingTest, InstallOnceAndShareHostStoragesOnly) {
  Storage cpu = Storage::Allocate(kCPU, 8);
  if (GetStorageSharing() == nullptr) {
    EXPECT_FALSE(ShareHostStorage(cpu));  // nothing installed: memory stays private
    EXPECT_FALSE(cpu.is_shared());
  }
  InstallStorageSharing(&kTestSharing);
  InstallStorageSharing(&kTestSharing);  // the same table again: a no-op
  EXPECT_EQ(GetStorageSharing(), &kTestSharing);
  EXPECT_ERROR(ErrorCode::kAlreadyExists, "\"test\" is installed already",
               InstallStorageSharing(&kOtherSharing));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "null", InstallStorageSharing(nullptr));
  const int before = g_test_shares.load();
  EXPECT_TRUE(ShareHostStorage(cpu));
  EXPECT_TRUE(cpu.is_shared());
  EXPECT_EQ(g_test_shares.load(), before + 1);
  Storage sim = Storage::Allocate(Device(DeviceType::kSimAccel, 0), 8);
  EXPECT_FALSE(ShareHostStorage(sim));  // device memory is shared through device/ipc.h instead
  EXPECT_EQ(g_test_shares.load(), before + 1);
}

TEST(StorageTest, WeakStorageDoesNotKeepTheBlockAlive) {
  WeakStorage none;
  EXPECT_TRUE(none.expired());
  EXPECT_FALSE(none.Lock().has_value());
  std::atomic<int> releases{0};
  Storage s = CountedCpuStorage(8, &releases);
  WeakStorage w(s);
  EXPECT_FALSE(w.expired());
  EXPECT_EQ(s.use_count(), 1);
  {
    std::optional<Storage> locked = w.Lock();
    ASSERT_TRUE(locked.has_value());
    EXPECT_TRUE(*locked == s);
    EXPECT_EQ(s.use_count(), 2);
  }
  s = Storage();
  EXPECT_EQ(releases.load(), 1);
  EXPECT_TRUE(w.expired());
  EXPECT_FALSE(w.Lock().has_value());
}

// ---- DType ----------------------------------------------------------------------------------

TEST(DTypeTest, SizesNamesAndSixteenBitConversions) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kFloat64), 8u);
  EXPECT_EQ(DTypeSize(DType::kInt32), 4u);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
  EXPECT_EQ(DTypeSize(DType::kUInt8), 1u);
  EXPECT_EQ(DTypeSize(DType::kBool), 1u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_STREQ(DTypeName(DType::kFloat32), "float32");
  EXPECT_STREQ(DTypeName(DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(DTypeName(DType::kBool), "bool");
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "invalid dtype value 99",
               DTypeSize(static_cast<DType>(99)));

  EXPECT_EQ(Float16Bits(1.0f), 0x3C00);
  EXPECT_EQ(Float16Bits(-2.0f), 0xC000);
  EXPECT_EQ(Float16Bits(65504.0f), 0x7BFF);
  EXPECT_EQ(Float16Bits(1e5f), 0x7C00);                          // overflow -> infinity
  EXPECT_EQ(Float16Bits(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(Float16Bits(0.1f), 0x2E66);                          // rounded to nearest
  EXPECT_EQ(Float16Bits(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie rounds to even
  EXPECT_EQ(Float16Bits(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_TRUE(std::isnan(Float16ToFloat(Float16Bits(std::nanf("")))));
  for (float f : {0.0f, 1.0f, -3.5f, 0.000061035156f, 5.9604645e-8f, 65504.0f}) {
    EXPECT_EQ(Float16ToFloat(Float16Bits(f)), f) << f;
  }
  EXPECT_EQ(BFloat16Bits(1.0f), 0x3F80);
  EXPECT_EQ(BFloat16Bits(3.0f), 0x4040);
  EXPECT_EQ(BFloat16ToFloat(BFloat16Bits(-0.5f)), -0.5f);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(BFloat16Bits(std::nanf("")))));
}

// ---- Tensor creation ------------------------------------------------------------------------

TEST(TensorTest, EmptyHasContiguousMetadata) {
  Tensor t = Tensor::Empty({2, 3, 4}, DType::kInt64, kCPU);
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.shape(), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(t.strides(), (std::vector<int64_t>{12, 4, 1}));
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 24u * 8);
  EXPECT_EQ(t.element_size(), 8u);
  EXPECT_EQ(t.storage().nbytes(), 24u * 8);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.data_ptr(), t.storage().data());
  EXPECT_FALSE(t.is_shared());
  EXPECT_EQ(t.device(), kCPU);

  Tensor def;
  EXPECT_EQ(def.shape(), std::vector<int64_t>{0});
  EXPECT_EQ(def.numel(), 0);
  EXPECT_EQ(def.dtype(), DType::kFloat32);

  {
    DeviceGuard g(kSim1);  // the default device argument is the current device
    Tensor s = Tensor::Empty({5});
    EXPECT_EQ(s.device(), kSim1);
  }
  Tensor scalar = Tensor::Full({}, 7.0, DType::kFloat64, kCPU);
  EXPECT_EQ(scalar.dim(), 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.item<double>({}), 7.0);
}

TEST(TensorTest, ZerosAndFullOnCpuAndSim) {
  for (Device d : {kCPU, kSim0}) {
    SCOPED_TRACE(d.ToString());
    EXPECT_EQ(Tensor::Zeros({2, 3}, DType::kFloat32, d).ToVector<float>(),
              std::vector<float>(6, 0.f));
    EXPECT_EQ(Tensor::Full({4}, -3, DType::kInt32, d).ToVector<int32_t>(),
              std::vector<int32_t>(4, -3));
    EXPECT_EQ(Tensor::Full({2}, 1e12, DType::kInt64, d).ToVector<int64_t>(),
              std::vector<int64_t>(2, 1000000000000));
    EXPECT_EQ(Tensor::Full({3}, 255, DType::kUInt8, d).ToVector<uint8_t>(),
              std::vector<uint8_t>(3, 255));
    EXPECT_EQ(Tensor::Full({3}, 2.5, DType::kBool, d).ToVector<bool>(), std::vector<bool>(3, true));
    EXPECT_EQ(Tensor::Zeros({3}, DType::kBool, d).ToVector<bool>(), std::vector<bool>(3, false));
    EXPECT_EQ(Tensor::Full({2}, 0.25, DType::kFloat64, d).ToVector<double>(),
              std::vector<double>(2, 0.25));
    EXPECT_EQ(Tensor::Full({2}, 1.5, DType::kFloat16, d).ToVector<uint16_t>(),
              std::vector<uint16_t>(2, 0x3E00));
    EXPECT_EQ(Tensor::Full({2}, 1.0, DType::kBFloat16, d).ToVector<uint16_t>(),
              std::vector<uint16_t>(2, 0x3F80));
    EXPECT_EQ(Tensor::Zeros({0, 5}, DType::kFloat32, d).ToVector<float>(), std::vector<float>{});
  }
}

// Full fills by doubling copies of the first element: every element of every size is the value,
// sizes that are not powers of two included.
TEST(TensorTest, FullFillsEveryElementOfOddSizes) {
  for (int64_t n : {1, 2, 3, 7, 1000, 1000003}) {
    const std::vector<int64_t> ints =
        Tensor::Full({n}, -5, DType::kInt64, kCPU).ToVector<int64_t>();
    ASSERT_EQ(static_cast<int64_t>(ints.size()), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(ints[i], -5) << "n " << n << " at " << i;
    const std::vector<uint8_t> bytes =
        Tensor::Full({n}, 9, DType::kUInt8, kSim0).ToVector<uint8_t>();
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bytes[i], 9) << "n " << n << " at " << i;
  }
}

// Reads the line "<key>: <value>" of the /proc/self/smaps entry of the mapping that holds `p`.
std::optional<std::string> SmapsField(const void* p, const std::string& key) {
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return std::nullopt;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  char line[512];
  bool inside = false;
  std::optional<std::string> out;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && std::strchr(line, '-') != nullptr &&
        std::strncmp(line, key.c_str(), key.size()) != 0) {
      inside = addr >= lo && addr < hi;
      continue;
    }
    if (inside && std::strncmp(line, (key + ":").c_str(), key.size() + 1) == 0) {
      out = std::string(line + key.size() + 1);
      break;
    }
  }
  std::fclose(f);
  return out;
}

// A CPU block of CpuBackend::kHugePageThreshold or more is 2 MiB aligned and advised as huge
// pages (device/cpu_backend.h): the kernel reports its mapping THP-eligible.
TEST(TensorTest, LargeCpuTensorsAreEligibleForHugePages) {
  std::string mode;
  if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    char buf[128] = {};
    if (std::fgets(buf, sizeof buf, f) != nullptr) mode = buf;
    std::fclose(f);
  }
  if (mode.empty() || mode.find("[never]") != std::string::npos) {
    GTEST_SKIP() << "transparent huge pages are off or absent on this kernel (" << mode << ")";
  }
  Tensor big = Tensor::Full({int64_t{8} << 20 >> 2}, 1.0, DType::kFloat32, kCPU);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data_ptr()) % (uintptr_t{2} << 20), 0u);
  const std::optional<std::string> eligible = SmapsField(big.data_ptr(), "THPeligible");
  if (!eligible) GTEST_SKIP() << "this kernel's smaps has no THPeligible field";
  EXPECT_EQ(std::stoi(*eligible), 1) << "the 8 MiB block's mapping is not THP-eligible";
  EXPECT_EQ(big.ToVector<float>().back(), 1.0f);
}

TEST(TensorTest, FromVectorOnCpuAndSim) {
  Tensor c = Tensor::FromVector(Iota(6), {2, 3});
  EXPECT_EQ(c.device(), kCPU);
  EXPECT_EQ(c.dtype(), DType::kFloat32);
  EXPECT_EQ(static_cast<float*>(c.data_ptr())[4], 4.f);  // a host pointer
  EXPECT_EQ(c.item<float>({1, 1}), 4.f);
  Tensor s = Tensor::FromVector(std::vector<int64_t>{5, 6, 7}, {3}, kSim1);
  EXPECT_EQ(s.device(), kSim1);
  EXPECT_EQ(s.dtype(), DType::kInt64);
  EXPECT_EQ(s.ToVector<int64_t>(), (std::vector<int64_t>{5, 6, 7}));
  Tensor b = Tensor::FromVector(std::vector<bool>{true, false, true}, {3}, kSim0);
  EXPECT_EQ(b.dtype(), DType::kBool);
  EXPECT_EQ(b.ToVector<bool>(), (std::vector<bool>{true, false, true}));
  EXPECT_FALSE(b.item<bool>({1}));
  Tensor h = Tensor::FromVector(std::vector<uint16_t>{0x3C00, 0xC000}, {2}, DType::kFloat16);
  EXPECT_EQ(h.dtype(), DType::kFloat16);
  EXPECT_EQ(Float16ToFloat(h.item<uint16_t>({1})), -2.f);
  Tensor u = Tensor::FromVector(std::vector<uint8_t>{1, 2, 3, 4}, {2, 2});
  EXPECT_EQ(u.item<uint8_t>({1, 0}), 3);
  Tensor d = Tensor::FromVector(std::vector<double>{0.5}, {});
  EXPECT_EQ(d.item<double>({}), 0.5);
  Tensor i = Tensor::FromVector(std::vector<int32_t>{}, {0, 4}, kSim0);
  EXPECT_EQ(i.numel(), 0);
  EXPECT_EQ(i.data_ptr(), nullptr);
  EXPECT_TRUE(i.ToVector<int32_t>().empty());
}

// ---- Views ----------------------------------------------------------------------------------

TEST(TensorTest, ViewsShareStorageAndWritesShowThrough) {
  Tensor t = Tensor::FromVector(Iota(12), {3, 4});
  Tensor v = t.View({4, 3});
  EXPECT_TRUE(v.storage() == t.storage());
  EXPECT_EQ(t.storage().use_count(), 2);
  v.set<float>({1, 0}, 100.f);  // element 3
  EXPECT_EQ(t.item<float>({0, 3}), 100.f);

  Tensor col = t.Select(1, 2);  // column 2: elements 2, 6, 10
  EXPECT_EQ(col.shape(), std::vector<int64_t>{3});
  EXPECT_EQ(col.strides(), std::vector<int64_t>{4});
  EXPECT_EQ(col.storage_offset(), 2);
  col.set<float>({2}, -1.f);
  EXPECT_EQ(t.item<float>({2, 2}), -1.f);

  Tensor tr = t.Transpose(0, 1);
  EXPECT_EQ(tr.shape(), (std::vector<int64_t>{4, 3}));
  EXPECT_FALSE(tr.is_contiguous());
  tr.set<float>({3, 1}, 55.f);
  EXPECT_EQ(t.item<float>({1, 3}), 55.f);

  Tensor sl = t.Slice(1, 1, 4, 2);  // columns 1 and 3
  EXPECT_EQ(sl.shape(), (std::vector<int64_t>{3, 2}));
  sl.set<float>({0, 1}, 77.f);
  EXPECT_EQ(t.item<float>({0, 3}), 77.f);
  EXPECT_EQ(t.storage().use_count(), 5);  // t, v, col, tr, sl

  // Data pointers of views point into the same block.
  EXPECT_EQ(static_cast<char*>(col.data_ptr()), static_cast<char*>(t.data_ptr()) + 2 * 4);
  Tensor flat = t.View({-1});
  EXPECT_EQ(flat.shape(), std::vector<int64_t>{12});
  EXPECT_EQ(t.View({2, -1, 2}).shape(), (std::vector<int64_t>{2, 3, 2}));
  EXPECT_EQ(t.Slice(0, 1, 2).View({-1}).ToVector<float>(), (std::vector<float>{4, 5, 6, 55}));
  EXPECT_EQ(t.Slice(-1, -2, Tensor::kToEnd).ToVector<float>(),
            (std::vector<float>{2, 77, 6, 55, -1, 11}));
  EXPECT_EQ(t.Slice(0, 3, 3).numel(), 0);
}

TEST(TensorTest, StridedToVectorOnCpuAndSim) {
  for (Device d : {kCPU, kSim0}) {
    SCOPED_TRACE(d.ToString());
    Tensor t = Tensor::FromVector(Iota(24), {2, 3, 4}, d);
    EXPECT_EQ(t.Transpose(0, 2).ToVector<float>(),
              (std::vector<float>{0, 12, 4, 16, 8,  20, 1, 13, 5, 17, 9,  21,
                                  2, 14, 6, 18, 10, 22, 3, 15, 7, 19, 11, 23}));
    EXPECT_EQ(t.Select(2, 1).ToVector<float>(), (std::vector<float>{1, 5, 9, 13, 17, 21}));
    EXPECT_EQ(t.Slice(2, 0, 4, 3).Select(0, 1).ToVector<float>(),
              (std::vector<float>{12, 15, 16, 19, 20, 23}));
    EXPECT_EQ(t.Select(0, 1).Select(0, 2).ToVector<float>(), (std::vector<float>{20, 21, 22, 23}));
    EXPECT_EQ(t.Select(1, -1).Transpose(0, 1).Slice(0, 1, 3).ToVector<float>(),
              (std::vector<float>{9, 21, 10, 22}));
    EXPECT_EQ(t.Select(0, 1).Select(0, 0).Select(0, 3).ToVector<float>(),
              std::vector<float>{15});  // a 0-dim view
    EXPECT_EQ(t.Select(0, 1).Select(0, 0).Select(0, 3).item<float>({}), 15.f);
  }
}

TEST(TensorTest, ContiguousSharesOrCopies) {
  Tensor t = Tensor::FromVector(Iota(6), {2, 3});
  Tensor same = t.Contiguous();
  EXPECT_TRUE(same.storage() == t.storage());
  Tensor tr = t.Transpose(0, 1);
  Tensor c = tr.Contiguous();
  EXPECT_FALSE(c.storage() == t.storage());
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.strides(), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(c.ToVector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(c.View({6}).ToVector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
}

TEST(TensorTest, CloneIsIndependentOnCpuAndSim) {
  for (Device d : {kCPU, kSim1}) {
    SCOPED_TRACE(d.ToString());
    Tensor t = Tensor::FromVector(Iota(6), {2, 3}, d);
    Tensor c = t.Clone();
    EXPECT_EQ(c.device(), d);
    EXPECT_FALSE(c.storage() == t.storage());
    EXPECT_NE(c.data_ptr(), t.data_ptr());
    c.set<float>({0, 0}, 42.f);
    t.set<float>({1, 2}, -7.f);
    EXPECT_EQ(t.ToVector<float>(), (std::vector<float>{0, 1, 2, 3, 4, -7}));
    EXPECT_EQ(c.ToVector<float>(), (std::vector<float>{42, 1, 2, 3, 4, 5}));
    Tensor ct = t.Transpose(0, 1).Clone();  // a strided clone is contiguous
    EXPECT_TRUE(ct.is_contiguous());
    EXPECT_EQ(ct.ToVector<float>(), (std::vector<float>{0, 3, 1, 4, 2, -7}));
    // A slice's clone holds only its own elements.
    Tensor sc = t.Slice(1, 1, 2).Clone();
    EXPECT_EQ(sc.storage().nbytes(), 2 * sizeof(float));
    EXPECT_EQ(sc.ToVector<float>(), (std::vector<float>{1, 4}));
  }
}

TEST(TensorTest, ToRoundTripsThroughTheSimulatedAccelerator) {
  Tensor host = Tensor::FromVector(Iota(20, 1), {4, 5});
  EXPECT_TRUE(host.To(kCPU).storage() == host.storage());  // same device: shares
  Tensor s0 = host.To(kSim0);
  EXPECT_EQ(s0.device(), kSim0);
  EXPECT_NE(s0.data_ptr(), host.data_ptr());
  EXPECT_TRUE(s0.To(kSim0).storage() == s0.storage());
  Tensor s1 = s0.To(kSim1);  // accelerator to accelerator
  EXPECT_EQ(s1.device(), kSim1);
  host.set<float>({0, 0}, -100.f);  // copies are independent of the source
  Tensor back = s1.To(kCPU);
  EXPECT_EQ(back.device(), kCPU);
  EXPECT_EQ(back.ToVector<float>(), Iota(20, 1));
  // Strided sources arrive contiguous.
  Tensor st = host.Transpose(0, 1).Slice(0, 0, 5, 2).To(kSim1);
  EXPECT_TRUE(st.is_contiguous());
  EXPECT_EQ(st.shape(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(st.ToVector<float>(),
            (std::vector<float>{-100, 6, 11, 16, 3, 8, 13, 18, 5, 10, 15, 20}));
  Tensor sv = s0.Transpose(0, 1).To(kCPU);
  EXPECT_EQ(sv.item<float>({4, 3}), 20.f);
  EXPECT_EQ(Tensor::Empty({0}, DType::kInt32, kCPU).To(kSim0).numel(), 0);
}

TEST(TensorTest, ItemAndSetOnSim) {
  Tensor t = Tensor::Zeros({3, 4}, DType::kInt32, kSim1);
  t.set<int32_t>({2, 3}, 9);
  t.set<int32_t>({-3, 0}, -4);
  Tensor col = t.Select(1, 1);
  col.set<int32_t>({1}, 8);  // through a strided view on the device
  EXPECT_EQ(t.item<int32_t>({2, 3}), 9);
  EXPECT_EQ(t.item<int32_t>({-1, -1}), 9);
  EXPECT_EQ(t.item<int32_t>({0, 0}), -4);
  EXPECT_EQ(t.item<int32_t>({1, 1}), 8);
  EXPECT_EQ(t.ToVector<int32_t>(), (std::vector<int32_t>{-4, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 9}));
  Tensor h = Tensor::Zeros({2}, DType::kBFloat16, kSim0);
  h.set<uint16_t>({1}, BFloat16Bits(2.0f));
  EXPECT_EQ(BFloat16ToFloat(h.item<uint16_t>({1})), 2.0f);
  Tensor b = Tensor::Zeros({2}, DType::kBool, kSim0);
  b.set<bool>({0}, true);
  EXPECT_TRUE(b.item<bool>({0}));
  EXPECT_EQ(b.ToVector<bool>(), (std::vector<bool>{true, false}));
}

// ---- Bad inputs -----------------------------------------------------------------------------

TEST(TensorErrorsTest, CreationErrors) {
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "negative extent (-2 in dimension 1)",
               Tensor::Empty({3, -2}, DType::kFloat32, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "negative extent",
               Tensor::Zeros({-1}, DType::kFloat32, kSim0));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "negative extent",
               Tensor::Full({-1}, 1.0, DType::kFloat32, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "negative extent",
               Tensor::FromVector(std::vector<float>{}, {-1}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "more elements than fit",
               Tensor::Empty({1 << 30, 1 << 30, 1 << 30}, DType::kFloat32, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "too large to address",
               Tensor::Empty({int64_t{1} << 62}, DType::kFloat64, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "3 value(s) given for shape [2, 2]",
               Tensor::FromVector(std::vector<int32_t>{1, 2, 3}, {2, 2}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "not float32",
               Tensor::FromVector(std::vector<uint16_t>{1}, {1}, DType::kFloat32));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "not an integer",
               Tensor::Full({1}, 1.5, DType::kInt32, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "does not fit dtype uint8",
               Tensor::Full({1}, 256, DType::kUInt8, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "does not fit dtype uint8",
               Tensor::Full({1}, -1, DType::kUInt8, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "does not fit dtype int32",
               Tensor::Full({1}, 3e9, DType::kInt32, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "not an integer",
               Tensor::Full({1}, std::nan(""), DType::kInt64, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "beyond the largest finite value",
               Tensor::Full({1}, 1e40, DType::kFloat32, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "beyond the largest finite value",
               Tensor::Full({1}, 70000, DType::kFloat16, kCPU));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "sim:5 does not exist",
               Tensor::Empty({1}, DType::kFloat32, Device(DeviceType::kSimAccel, 5)));
  // Infinity is a value float dtypes can hold.
  EXPECT_TRUE(
      std::isinf(Tensor::Full({1}, std::numeric_limits<double>::infinity(), DType::kFloat32, kCPU)
                     .item<float>({0})));
}

TEST(TensorErrorsTest, ElementAccessErrors) {
  Tensor t = Tensor::FromVector(std::vector<int32_t>{1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_ERROR(ErrorCode::kInvalidArgument,
               "item<float>: the tensor's dtype is int32; use item<int32_t>",
               t.item<float>({0, 0}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "set<int64_t>: the tensor's dtype is int32",
               t.set<int64_t>({0, 0}, 1));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "ToVector<double>", t.ToVector<double>());
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "use item<uint16_t (raw bits)>",
               Tensor::Zeros({1}, DType::kFloat16, kCPU).item<float>({0}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "got 1 index(es) for a tensor of 2 dimension(s)",
               t.item<int32_t>({0}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "got 3 index(es)", t.set<int32_t>({0, 0, 0}, 1));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "index 3 is out of range for dimension 1 of size 3",
               t.item<int32_t>({0, 3}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "index -3 is out of range for dimension 0 of size 2",
               t.item<int32_t>({-3, 0}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "index 0 is out of range",
               Tensor::Empty({0}, DType::kInt32, kSim0).item<int32_t>({0}));
  Tensor s = t.To(kSim0);
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "out of range", s.set<int32_t>({2, 0}, 1));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "dtype is int32", s.ToVector<uint8_t>());
  EXPECT_EQ(t.ToVector<int32_t>(), (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));  // untouched
}

TEST(TensorErrorsTest, ViewErrors) {
  Tensor t = Tensor::FromVector(Iota(12), {3, 4});
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "needs a contiguous tensor",
               t.Transpose(0, 1).View({12}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "call Contiguous() first",
               t.Slice(1, 0, 4, 2).View({6}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "View([5, 2]) has 10 element(s)", t.View({5, 2}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "only one extent may be -1", t.View({-1, -1}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "cannot infer", t.View({5, -1}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "extent -2 in dimension 0 is negative",
               t.View({-2, -6}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "cannot infer",
               Tensor::Empty({0, 3}, DType::kFloat32, kCPU).View({0, -1}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "dimension 2 is out of range for a tensor of 2",
               t.Slice(2, 0, 1));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "dimension -3 is out of range", t.Select(-3, 0));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "dimension 5 is out of range", t.Transpose(0, 5));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "dimension 2 is out of range", t.size(2));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "index 4 is out of range for dimension 1",
               t.Select(1, 4));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "need 0 <= start <= end <= 4", t.Slice(1, 3, 1));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "need 0 <= start <= end <= 4", t.Slice(1, 0, 5));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "need 0 <= start <= end <= 4", t.Slice(1, -5, 2));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "step 0 must be >= 1", t.Slice(0, 0, 1, 0));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "step -1 must be >= 1", t.Slice(0, 0, 1, -1));
  Tensor scalar = t.Select(0, 0).Select(0, 0);
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "does not exist on a 0-dimensional",
               scalar.Select(0, 0));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "does not exist on a 0-dimensional",
               scalar.Slice(0, 0, 1));
}

TEST(TensorErrorsTest, FromStorageErrors) {
  Storage s = Storage::Allocate(kCPU, 64);  // 16 floats
  Tensor ok = Tensor::FromStorage(s, DType::kFloat32, {4, 2}, std::vector<int64_t>{4, 1}, 2);
  EXPECT_EQ(ok.storage_offset(), 2);
  EXPECT_FALSE(ok.is_contiguous());
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "needs 68 bytes of storage, but the storage has 64",
               Tensor::FromStorage(s, DType::kFloat32, {17}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "needs 72 bytes",
               Tensor::FromStorage(s, DType::kFloat32, {4, 2}, std::vector<int64_t>{4, 1}, 4));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "stride -1 of dimension 0 is negative",
               Tensor::FromStorage(s, DType::kFloat32, {2}, std::vector<int64_t>{-1}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "give one per dimension",
               Tensor::FromStorage(s, DType::kFloat32, {2, 2}, std::vector<int64_t>{1}));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "storage offset -1 is negative",
               Tensor::FromStorage(s, DType::kFloat32, {2}, std::nullopt, -1));
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "negative extent",
               Tensor::FromStorage(s, DType::kFloat32, {-2}));
  EXPECT_ERROR(
      ErrorCode::kInvalidArgument, "more than 2^63",
      Tensor::FromStorage(s, DType::kFloat32, {3}, std::vector<int64_t>{int64_t{1} << 62}));
}

// ---- DLPack ---------------------------------------------------------------------------------

// A DLManagedTensor over malloc'd floats, as another framework would export it.
struct ForeignTensor {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  float* data = nullptr;
  std::atomic<int>* deletes = nullptr;
  DLManagedTensor managed{};
};

DLManagedTensor* MakeForeign(const std::vector<float>& values, std::vector<int64_t> shape,
                             std::vector<int64_t> strides, uint64_t byte_offset,
                             std::atomic<int>* deletes) {
  auto* f = new ForeignTensor;
  f->shape = std::move(shape);
  f->strides = std::move(strides);
  f->data = static_cast<float*>(std::malloc(values.size() * sizeof(float) + 64));
  std::memcpy(f->data, values.data(), values.size() * sizeof(float));
  f->deletes = deletes;
  DLTensor& dl = f->managed.dl_tensor;
  dl.data = reinterpret_cast<char*>(f->data) - byte_offset;  // data + byte_offset = the values
  dl.device = DLDevice{kDLCPU, 0};
  dl.ndim = static_cast<int>(f->shape.size());
  dl.dtype = DLDataType{kDLFloat, 32, 1};
  dl.shape = f->shape.data();
  dl.strides = f->strides.empty() ? nullptr : f->strides.data();
  dl.byte_offset = byte_offset;
  f->managed.manager_ctx = f;
  f->managed.deleter = [](DLManagedTensor* self) {
    auto* owner = static_cast<ForeignTensor*>(self->manager_ctx);
    owner->deletes->fetch_add(1);
    std::free(owner->data);
    delete owner;
  };
  return &f->managed;
}

TEST(DLPackTest, ExportIsZeroCopyAndKeepsTheStorageAlive) {
  std::atomic<int> releases{0};
  void* block = nullptr;
  Tensor base = Tensor::FromStorage(CountedCpuStorage(12 * sizeof(float), &releases, &block),
                                    DType::kFloat32, {3, 4});
  for (int i = 0; i < 12; ++i) static_cast<float*>(block)[i] = static_cast<float>(i);
  Tensor t = base.Transpose(0, 1).Slice(0, 1, 3);  // shape [2, 3], strides [1, 4], offset 1
  DLManagedTensor* m = ToDLPack(t);
  const DLTensor& dl = m->dl_tensor;
  EXPECT_EQ(dl.data, t.data_ptr());
  EXPECT_EQ(dl.data, static_cast<float*>(block) + 1);
  EXPECT_EQ(dl.byte_offset, 0u);
  EXPECT_EQ(dl.device.device_type, kDLCPU);
  EXPECT_EQ(dl.device.device_id, 0);
  EXPECT_EQ(dl.ndim, 2);
  EXPECT_EQ(dl.dtype.code, kDLFloat);
  EXPECT_EQ(dl.dtype.bits, 32);
  EXPECT_EQ(dl.dtype.lanes, 1);
  EXPECT_EQ(std::vector<int64_t>(dl.shape, dl.shape + 2), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::vector<int64_t>(dl.strides, dl.strides + 2), (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(base.storage().use_count(), 3);  // base, t, and the export
  // Writes are visible both ways.
  static_cast<float*>(dl.data)[1 * 1 + 2 * 4] = -9.f;  // element (1, 2) of t
  EXPECT_EQ(t.item<float>({1, 2}), -9.f);
  EXPECT_EQ(base.item<float>({2, 2}), -9.f);
  t.set<float>({0, 1}, 33.f);
  EXPECT_EQ(static_cast<float*>(dl.data)[4], 33.f);
  base = Tensor();
  t = Tensor();
  EXPECT_EQ(releases.load(), 0);  // the export keeps it alive
  EXPECT_EQ(static_cast<float*>(dl.data)[4], 33.f);
  m->deleter(m);
  EXPECT_EQ(releases.load(), 1);
}

TEST(DLPackTest, ImportIsZeroCopyAndCallsTheDeleterOnceAfterTheLastView) {
  std::atomic<int> deletes{0};
  DLManagedTensor* m = MakeForeign(Iota(6), {2, 3}, {}, 0, &deletes);
  float* raw = static_cast<float*>(m->dl_tensor.data);
  {
    Tensor t = FromDLPack(m);
    EXPECT_EQ(t.data_ptr(), raw);
    EXPECT_EQ(t.device(), kCPU);
    EXPECT_EQ(t.dtype(), DType::kFloat32);
    EXPECT_EQ(t.shape(), (std::vector<int64_t>{2, 3}));
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(t.storage().nbytes(), 6 * sizeof(float));
    EXPECT_EQ(t.ToVector<float>(), Iota(6));
    raw[5] = 50.f;
    EXPECT_EQ(t.item<float>({1, 2}), 50.f);
    t.set<float>({0, 0}, -1.f);
    EXPECT_EQ(raw[0], -1.f);
    Tensor view = t.Select(1, 1);
    t = Tensor();
    EXPECT_EQ(deletes.load(), 0);  // a view still uses it
    EXPECT_EQ(view.ToVector<float>(), (std::vector<float>{1, 4}));
  }
  EXPECT_EQ(deletes.load(), 1);
}

TEST(DLPackTest, ImportHonoursStridesAndByteOffset) {
  std::atomic<int> deletes{0};
  // A transposed 3x2 view of a 2x3 buffer, addressed through byte_offset.
  DLManagedTensor* m = MakeForeign(Iota(6), {3, 2}, {1, 3}, 256, &deletes);
  float* values = reinterpret_cast<float*>(static_cast<char*>(m->dl_tensor.data) + 256);
  {
    Tensor t = FromDLPack(m);
    EXPECT_EQ(t.data_ptr(), values);
    EXPECT_EQ(t.strides(), (std::vector<int64_t>{1, 3}));
    EXPECT_FALSE(t.is_contiguous());
    EXPECT_EQ(t.ToVector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
    EXPECT_EQ(t.To(kSim0).ToVector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  }
  EXPECT_EQ(deletes.load(), 1);
}

TEST(DLPackTest, RoundTripCallsEachDeleterExactlyOnce) {
  for (bool drop_original_first : {true, false}) {
    SCOPED_TRACE(drop_original_first ? "original dropped first" : "import dropped first");
    std::atomic<int> releases{0};
    auto t = std::make_unique<Tensor>(Tensor::FromStorage(
        CountedCpuStorage(8 * sizeof(int64_t), &releases), DType::kInt64, {2, 4}));
    for (int64_t i = 0; i < 8; ++i) t->set<int64_t>({i / 4, i % 4}, i * 10);
    auto u = std::make_unique<Tensor>(FromDLPack(ToDLPack(*t)));
    EXPECT_EQ(u->data_ptr(), t->data_ptr());
    EXPECT_EQ(u->dtype(), DType::kInt64);
    EXPECT_EQ(u->shape(), t->shape());
    u->set<int64_t>({1, 3}, -5);
    EXPECT_EQ(t->item<int64_t>({1, 3}), -5);
    t->set<int64_t>({0, 0}, 99);
    EXPECT_EQ(u->item<int64_t>({0, 0}), 99);
    if (drop_original_first)
      t.reset();
    else
      u.reset();
    EXPECT_EQ(releases.load(), 0);
    if (drop_original_first) {
      EXPECT_EQ(u->ToVector<int64_t>(), (std::vector<int64_t>{99, 10, 20, 30, 40, 50, 60, -5}));
      u.reset();
    } else {
      t.reset();
    }
    EXPECT_EQ(releases.load(), 1);
  }
}

TEST(DLPackTest, SimTensorsTravelAsExtDev) {
  const size_t before = Sim().BytesInUse(1);
  {
    Tensor t = Tensor::FromVector(std::vector<int32_t>{1, 2, 3, 4}, {2, 2}, kSim1);
    DLManagedTensor* m = ToDLPack(t);
    EXPECT_EQ(m->dl_tensor.device.device_type, kDLExtDev);
    EXPECT_EQ(m->dl_tensor.device.device_id, 1);
    EXPECT_EQ(m->dl_tensor.data, t.data_ptr());
    Tensor u = FromDLPack(m);
    EXPECT_EQ(u.device(), kSim1);
    EXPECT_EQ(u.data_ptr(), t.data_ptr());
    u.set<int32_t>({0, 1}, 20);
    EXPECT_EQ(t.ToVector<int32_t>(), (std::vector<int32_t>{1, 20, 3, 4}));
    t = Tensor();
    EXPECT_GT(Sim().BytesInUse(1), before);  // the import keeps the device memory
  }
  EXPECT_EQ(Sim().BytesInUse(1), before);
}

TEST(DLPackTest, DTypesRoundTrip) {
  struct Case {
    DType dtype;
    uint8_t code;
    uint8_t bits;
  };
  for (const Case& c :
       {Case{DType::kFloat32, kDLFloat, 32}, Case{DType::kFloat64, kDLFloat, 64},
        Case{DType::kInt32, kDLInt, 32}, Case{DType::kInt64, kDLInt, 64},
        Case{DType::kUInt8, kDLUInt, 8}, Case{DType::kBool, kDLBoolCode, 8},
        Case{DType::kFloat16, kDLFloat, 16}, Case{DType::kBFloat16, kDLBfloat, 16}}) {
    SCOPED_TRACE(DTypeName(c.dtype));
    Tensor t = Tensor::Full({3}, 1, c.dtype, kCPU);
    DLManagedTensor* m = ToDLPack(t);
    EXPECT_EQ(m->dl_tensor.dtype.code, c.code);
    EXPECT_EQ(m->dl_tensor.dtype.bits, c.bits);
    EXPECT_EQ(m->dl_tensor.dtype.lanes, 1);
    Tensor u = FromDLPack(m);
    EXPECT_EQ(u.dtype(), c.dtype);
    EXPECT_EQ(u.data_ptr(), t.data_ptr());
  }
  // A scalar has no shape or strides arrays to speak of.
  Tensor s = Tensor::Full({}, 4, DType::kFloat64, kCPU);
  DLManagedTensor* m = ToDLPack(s);
  EXPECT_EQ(m->dl_tensor.ndim, 0);
  EXPECT_EQ(FromDLPack(m).item<double>({}), 4.0);
}

TEST(DLPackTest, BadImportsLeaveOwnershipWithTheCaller) {
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "pointer is null", FromDLPack(nullptr));
  std::atomic<int> deletes{0};
  DLManagedTensor* m = MakeForeign(Iota(4), {4}, {}, 0, &deletes);
  DLTensor& dl = m->dl_tensor;
  const DLTensor good = dl;
  auto restore = [&] { dl = good; };

  dl.dtype = DLDataType{kDLInt, 8, 1};
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "(code 0, bits 8, lanes 1) is not supported",
               FromDLPack(m));
  dl.dtype = DLDataType{kDLFloat, 32, 4};
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "lanes 4", FromDLPack(m));
  dl.dtype = DLDataType{kDLComplex, 64, 1};
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "not supported", FromDLPack(m));
  restore();
  if (!HasBackend(DeviceType::kCUDA)) {
    dl.device = DLDevice{kDLCUDA, 0};
    EXPECT_ERROR(ErrorCode::kUnavailable, "no CUDA backend is registered", FromDLPack(m));
  }
  dl.device = DLDevice{kDLROCM, 0};
  EXPECT_ERROR(ErrorCode::kUnavailable, "kDLROCM", FromDLPack(m));
  dl.device = DLDevice{kDLExtDev, 9};
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "sim:9 does not exist", FromDLPack(m));
  restore();
  dl.ndim = -1;
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "ndim is -1", FromDLPack(m));
  dl.ndim = 1;
  dl.shape = nullptr;
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "shape is null", FromDLPack(m));
  restore();
  int64_t neg_shape[1] = {-4};
  dl.shape = neg_shape;
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "negative extent", FromDLPack(m));
  restore();
  int64_t neg_stride[1] = {-1};
  dl.strides = neg_stride;
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "is negative", FromDLPack(m));
  restore();
  void* saved = dl.data;
  dl.data = nullptr;
  EXPECT_ERROR(ErrorCode::kInvalidArgument, "data is null", FromDLPack(m));
  dl.data = saved;

  EXPECT_EQ(deletes.load(), 0);  // no failed import called the deleter
  {
    Tensor t = FromDLPack(m);
    EXPECT_EQ(t.ToVector<float>(), Iota(4));
  }
  EXPECT_EQ(deletes.load(), 1);
}

// ---- Fork -----------------------------------------------------------------------------------

TEST(TensorForkTest, CpuTensorsAreReadableInAForkedChild) {
  Tensor t = Tensor::FromVector(Iota(12), {3, 4});
  std::atomic<int> deletes{0};
  Tensor imported = FromDLPack(MakeForeign(Iota(3, 100), {3}, {}, 0, &deletes));
  auto child = RunInChild(
      [&] {
        if (t.ToVector<float>() != Iota(12)) return 1;
        if (t.Transpose(0, 1).ToVector<float>()[1] != 4.f) return 2;
        if (t.item<float>({2, 3}) != 11.f) return 3;
        if (imported.item<float>({2}) != 102.f) return 4;
        t.set<float>({0, 0}, -1.f);  // the child's own copy-on-write page
        if (t.item<float>({0, 0}) != -1.f) return 5;
        if (t.To(kCPU).Clone().item<float>({0, 0}) != -1.f) return 6;
        if (CurrentDevice() != kCPU || Tensor::Zeros({2}).device() != kCPU) return 7;
        t = Tensor();  // releasing in the child is fine too
        imported = Tensor();
        return deletes.load() == 1 ? 0 : 8;
      },
      20s);
  EXPECT_TRUE(child.ok()) << child.Describe();
  EXPECT_EQ(t.item<float>({0, 0}), 0.f);  // the child's write stayed in the child
  EXPECT_EQ(deletes.load(), 0);
}

TEST(TensorForkTest, SimTensorsArePoisonedInAForkedChild) {
  Tensor t = Tensor::FromVector(Iota(8), {2, 4}, kSim0);  // initializes the backend here
  Tensor view = t.Select(1, 1);                           // strided: elements 1 and 5
  DLManagedTensor* exported = ToDLPack(t);
  auto child = RunInChild(
      [&] {
        auto poisoned = [](auto&& fn) {
          try {
            fn();
            return false;
          } catch (const Error& e) {
            return e.code() == ErrorCode::kForkPoisoned &&
                   std::string(e.what()).find("spawn") != std::string::npos;
          }
        };
        // Metadata is still there.
        if (t.shape() != std::vector<int64_t>{2, 4} || t.device() != kSim0) return 1;
        if (!poisoned([&] { t.item<float>({0, 0}); })) return 2;
        if (!poisoned([&] { view.set<float>({0}, 1.f); })) return 3;
        if (!poisoned([&] { t.ToVector<float>(); })) return 4;
        if (!poisoned([&] { view.ToVector<float>(); })) return 5;  // the strided path
        if (!poisoned([&] { t.To(kCPU); })) return 6;
        if (!poisoned([&] { t.Clone(); })) return 7;
        if (!poisoned([&] { Tensor::Zeros({2}, DType::kFloat32, kSim0); })) return 8;
        if (!poisoned([&] { Tensor::FromVector(Iota(2), {2}, kSim1); })) return 9;
        if (!poisoned([&] { Tensor::Empty({2}, DType::kFloat32, kCPU).To(kSim1); })) return 10;
        // Views are metadata only and still work.
        if (t.Transpose(0, 1).shape() != std::vector<int64_t>{4, 2}) return 11;
        // Dropping every reference in the child neither throws nor touches the device.
        exported->deleter(exported);
        view = Tensor();
        t = Tensor();
        return 0;
      },
      20s);
  EXPECT_TRUE(child.ok()) << child.Describe();
  // The parent is untouched.
  EXPECT_EQ(t.ToVector<float>(), Iota(8));
  EXPECT_EQ(view.ToVector<float>(), (std::vector<float>{1, 5}));
  exported->deleter(exported);
}

}  // namespace
}  // namespace forksafe::device
