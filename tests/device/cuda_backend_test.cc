// Tests of the CUDA backend (device/cuda_backend.h).
//
// Without a GPU (CI, or a build without the CUDA Toolkit headers) the no-GPU behaviour is asserted
// for real: no devices, queries that never initialize, operations that throw kUnavailable naming
// the cause, a forked child that is fine. The GPU tests then skip with the reason.
//
// With a GPU: allocation, copies and memset of several sizes, the caching allocator (reuse,
// coalescing, HoldAfterFree, EmptyCache), the fork rules, and IPC: export/import within the
// process, in a spawned process, in a child forked before initialization, legacy handles and IPC
// events. Tests that need a process that never initialized CUDA spawn this binary again
// (/proc/self/exe --gtest_filter=CudaHelper.Run with FORKSAFE_CUDA_TEST_ROLE set): the test
// process itself may have initialized CUDA in an earlier test. Every child is bounded.
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/device/backend.h"
#include "forksafe/device/cuda_backend.h"
#include "forksafe/device/device.h"
#include "forksafe/device/ipc.h"
#include "forksafe/device/registry.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"
#include "tests/support/fd_passing.h"

extern char** environ;

namespace forksafe::device {
namespace {

using forksafe::testing::RunInChild;
using forksafe::testing::WaitChild;
using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;

constexpr Device kCuda0{DeviceType::kCUDA, 0};
constexpr int kPassedFd = 200;  // where a spawned helper finds the descriptor it is given

CudaBackend& Cuda() { return static_cast<CudaBackend&>(GetBackend(DeviceType::kCUDA)); }

bool HasGpu() { return Cuda().DeviceCount() > 0; }

#define SKIP_WITHOUT_GPU()                                     \
  do {                                                         \
    if (!HasGpu()) GTEST_SKIP() << Cuda().UnavailableReason(); \
  } while (0)

template <typename Fn>
void ExpectError(Fn fn, ErrorCode code, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown; expected " << runtime::ErrorCodeName(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "\"" << needle << "\" not in: " << e.what();
  }
}

// One of the causes the backend names when there is no device.
bool NamesACause(const std::string& msg) {
  for (const char* cause : {"libcuda.so.1 not found", "built without the CUDA Toolkit headers",
                            "cuInit failed", "NVML reports no", "CUDA_VISIBLE_DEVICES hides",
                            "cuDeviceGetCount reports no device", "did not answer"}) {
    if (msg.find(cause) != std::string::npos) return true;
  }
  return false;
}

// ---- without a GPU ------------------------------------------------------------------------------

TEST(CudaBackendTest, IsRegisteredAndQueriesNeverInitialize) {
  ASSERT_TRUE(HasBackend(DeviceType::kCUDA));
  CudaBackend& b = Cuda();
  EXPECT_EQ(b.name(), "cuda");
  EXPECT_EQ(b.type(), DeviceType::kCUDA);
  EXPECT_EQ(b.fork_behavior(), ForkBehavior::kPoisonInChild);
  EXPECT_EQ(b.ipc(), static_cast<IpcBackend*>(&b));
  const BackendState before = b.state();
  const int n = b.DeviceCount();
  EXPECT_GE(n, 0);
  EXPECT_EQ(n, b.DeviceCount());  // cached
  for (int i = 0; i < n; ++i) {
    const DeviceProperties p = b.Properties(i);
    EXPECT_FALSE(p.name.empty());
    EXPECT_GT(p.total_memory, 0u);
    EXPECT_FALSE(p.host_accessible);
    EXPECT_TRUE(p.supports_ipc);
  }
  EXPECT_EQ(b.IpcEventPoolCapacity(0), CudaBackend::kIpcEventPoolCapacity);
  if (!b.initialized()) {
    EXPECT_EQ(b.Stats(0).segments, 0u);
  }
  EXPECT_EQ(b.state(), before);  // none of the above initialized anything
  if (n == 0) {
    EXPECT_EQ(b.state(), BackendState::kUninitialized);
    const std::string why = b.UnavailableReason();
    EXPECT_EQ(why.rfind("no CUDA devices: ", 0), 0u) << why;
    EXPECT_TRUE(NamesACause(why)) << why;
    EXPECT_EQ(DeviceCount(DeviceType::kCUDA), 0);
  } else {
    EXPECT_EQ(b.UnavailableReason(), "");
  }
}

TEST(CudaBackendTest, WithoutDevicesEveryOperationThrowsUnavailable) {
  if (HasGpu()) GTEST_SKIP() << "this machine has a CUDA device";
  CudaBackend& b = Cuda();
  char host[16] = {0};
  auto unavailable = [&](const char* what, auto fn) {
    SCOPED_TRACE(what);
    try {
      fn();
      ADD_FAILURE() << what << " did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
      EXPECT_NE(std::string(e.what()).find("no CUDA devices: "), std::string::npos) << e.what();
      EXPECT_TRUE(NamesACause(e.what())) << e.what();
    }
  };
  unavailable("Allocate", [&] { b.Allocate(0, 16); });
  unavailable("Free", [&] { b.Free(0, host); });
  unavailable("Copy", [&] { b.Copy(host, kCPU, host, kCuda0, 16); });
  unavailable("Memset", [&] { b.Memset(0, host, 0, 16); });
  unavailable("Synchronize", [&] { b.Synchronize(0); });
  unavailable("Initialize", [&] { b.Initialize(); });
  unavailable("ExportMemory", [&] { b.ExportMemory(0, host, 16); });
  unavailable("ExportLegacyMemory", [&] { b.ExportLegacyMemory(0, host, 16); });
  IpcMemoryHandle h;
  h.device = kCuda0;
  unavailable("ImportMemory", [&] { b.ImportMemory(h); });
  unavailable("ReleaseImported", [&] { b.ReleaseImported(0, host); });
  unavailable("HoldAfterFree", [&] { b.HoldAfterFree(0, host, [] { return true; }); });
  unavailable("RecordIpcEvent", [&] { b.RecordIpcEvent(0); });
  unavailable("WaitIpcEvent", [&] { b.WaitIpcEvent(0, IpcEventHandle{}); });
  unavailable("MemoryInfo", [&] { b.MemoryInfo(0); });
  unavailable("EmptyCache", [&] { b.EmptyCache(0); });
  // Through the registry, too.
  unavailable("device::Allocate", [&] { Allocate(kCuda0, 16); });
  unavailable("GetIpcBackend", [&] { GetIpcBackend(kCuda0); });
  unavailable("SetDefaultDevice", [&] { SetDefaultDevice(kCuda0); });
  EXPECT_EQ(b.state(), BackendState::kUninitialized);  // failed initialization leaves no trace
  EXPECT_EQ(DefaultDevice(), kCPU);
}

TEST(CudaBackendTest, WithoutDevicesAForkedChildIsFine) {
  if (HasGpu()) GTEST_SKIP() << "this machine has a CUDA device";
  auto r = RunInChild(
      [] {
        CudaBackend& b = Cuda();
        if (b.DeviceCount() != 0 || b.state() != BackendState::kUninitialized) return 1;
        try {
          b.Allocate(0, 16);
          return 2;
        } catch (const Error& e) {
          if (e.code() != ErrorCode::kUnavailable) return 3;  // not poisoned: never initialized
        }
        if (b.state() != BackendState::kUninitialized) return 4;
        return DefaultDevice() == kCPU ? 0 : 5;
      },
      30s, 30);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

// ---- helpers for the GPU tests ------------------------------------------------------------------

std::vector<unsigned char> Pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<unsigned char>((i * 131 + seed * 7 + i / 251) & 0xFF);
  return v;
}

std::vector<unsigned char> ReadBack(const void* dev, size_t n) {
  std::vector<unsigned char> out(n);
  Cuda().Copy(out.data(), kCPU, dev, kCuda0, n);
  return out;
}

template <typename T>
std::string ToHex(const T& v) {
  static_assert(std::is_trivially_copyable<T>::value, "plain data only");
  const auto* p = reinterpret_cast<const unsigned char*>(&v);
  std::string s;
  for (size_t i = 0; i < sizeof(T); ++i) {
    static const char* kDigits = "0123456789abcdef";
    s += kDigits[p[i] >> 4];
    s += kDigits[p[i] & 15];
  }
  return s;
}

template <typename T>
T FromHex(const std::string& s) {
  T v{};
  auto* p = reinterpret_cast<unsigned char*>(&v);
  for (size_t i = 0; i < sizeof(T) && 2 * i + 1 < s.size(); ++i) {
    p[i] = static_cast<unsigned char>(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  }
  return v;
}

// Spawns this binary as a helper with `role` (and `args`), giving it `fd` (if >= 0) as
// kPassedFd. Bounded: the helper is killed after 90 s.
forksafe::testing::ChildResult SpawnHelper(const std::string& role, const std::string& args,
                                           int fd = -1) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv(*e);
    // Bazel's files of this test must not be overwritten by the helper's GoogleTest.
    bool drop = false;
    for (const char* p :
         {"XML_OUTPUT_FILE=", "GTEST_OUTPUT=", "TEST_PREMATURE_EXIT_FILE=", "GTEST_SHARD_",
          "TEST_SHARD_", "TEST_TOTAL_SHARDS=", "FORKSAFE_CUDA_TEST_"}) {
      drop = drop || kv.rfind(p, 0) == 0;
    }
    if (!drop) env.push_back(kv);
  }
  env.push_back("FORKSAFE_CUDA_TEST_ROLE=" + role);
  env.push_back("FORKSAFE_CUDA_TEST_ARGS=" + args);
  std::vector<char*> envp;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", filter = "--gtest_filter=CudaHelper.Run";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (fd >= 0) posix_spawn_file_actions_adddup2(&fa, fd, kPassedFd);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    forksafe::testing::ChildResult r;
    ADD_FAILURE() << "posix_spawn: " << strerror(rc);
    return r;
  }
  return WaitChild(pid, 90s);
}

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Imports `h`, checks that its bytes are `want`, writes `reply` over them, releases. Returns 0
// when all went well (used by helpers and children).
int ImportCheckAndReply(const IpcMemoryHandle& h, unsigned want, unsigned reply) {
  CudaBackend& b = Cuda();
  void* p = b.ImportMemory(h);
  void* again = b.ImportMemory(h);  // mapped once per process, counted twice
  if (again != p) return 10;
  b.ReleaseImported(0, again);
  if (b.Stats(0).imported_segments != (h.kind == IpcKind::kSegment ? 1u : 0u)) return 11;
  if (ReadBack(p, h.size) != Pattern(h.size, want)) return 12;
  const auto out = Pattern(h.size, reply);
  b.Copy(p, kCuda0, out.data(), kCPU, h.size);
  b.ReleaseImported(0, p);
  if (b.Stats(0).imported_segments != 0u) return 13;
  if (h.kind == IpcKind::kSegment) {  // stays mapped, idle, until EmptyCache
    if (b.Stats(0).idle_imports != 1u) return 14;
    b.EmptyCache(0);
    if (b.Stats(0).idle_imports != 0u) return 15;
  }
  return 0;
}

// ---- the helper (runs only when spawned by a test below) ----------------------------------------

TEST(CudaHelper, Run) {
  const char* role_env = getenv("FORKSAFE_CUDA_TEST_ROLE");
  if (role_env == nullptr) GTEST_SKIP() << "a helper process of the CUDA tests, not a test";
  const std::string role = role_env;
  const std::string args =
      getenv("FORKSAFE_CUDA_TEST_ARGS") ? getenv("FORKSAFE_CUDA_TEST_ARGS") : "";
  CudaBackend& b = Cuda();
  ASSERT_EQ(b.state(), BackendState::kUninitialized) << "a spawned process starts fresh";
  if (role == "import") {  // args: an IpcMemoryHandle whose fd is kPassedFd
    IpcMemoryHandle h = FromHex<IpcMemoryHandle>(args);
    h.fd = kPassedFd;
    EXPECT_EQ(ImportCheckAndReply(h, 1, 2), 0);
    close(kPassedFd);
  } else if (role == "export_and_exit") {
    // args: how many (default 1). Sends handles to blocks of 3 MiB (a segment each) holding
    // pattern 1 + i over kPassedFd, then drops its memory and exits.
    const int count = args.empty() ? 1 : std::stoi(args);
    const size_t n = 3 << 20;
    std::vector<void*> blocks;  // all kept until every handle is sent: no block is reused
    for (int i = 0; i < count; ++i) {
      void* p = b.Allocate(0, n);
      blocks.push_back(p);
      const auto in = Pattern(n, 1 + static_cast<unsigned>(i));
      b.Copy(p, kCuda0, in.data(), kCPU, n);
      IpcMemoryHandle h = b.ExportMemory(0, p, n);
      EXPECT_TRUE(forksafe::testing::SendWithFd(kPassedFd, h.fd, &h, sizeof h));
      close(h.fd);
    }
    for (void* p : blocks) b.Free(0, p);
    close(kPassedFd);
  } else if (role == "record_busy_event") {
    // Sends an event recorded behind queued work over kPassedFd, then waits for a byte.
    alarm(60);
    const size_t n = size_t{64} << 20;
    void* p = b.Allocate(0, n);
    IpcEventHandle ev;
    for (int tries = 0; tries < 20 && ev.complete; ++tries) {  // until the work is still queued
      for (int i = 0; i < 50; ++i) b.Memset(0, p, i, n);
      ev = b.RecordIpcEvent(0);
    }
    EXPECT_TRUE(WriteAll(kPassedFd, &ev, sizeof ev));
    char go = 0;
    EXPECT_TRUE(ReadAll(kPassedFd, &go, 1));
    b.Synchronize(0);
    b.Free(0, p);
    close(kPassedFd);
  } else if (role == "import_legacy") {
    IpcMemoryHandle h = FromHex<IpcMemoryHandle>(args);
    EXPECT_EQ(ImportCheckAndReply(h, 3, 4), 0);
  } else if (role == "wait_event") {  // args: memory handle, then event handle
    const size_t split = 2 * sizeof(IpcMemoryHandle);
    IpcMemoryHandle h = FromHex<IpcMemoryHandle>(args.substr(0, split));
    const IpcEventHandle ev = FromHex<IpcEventHandle>(args.substr(split));
    h.fd = kPassedFd;
    void* p = b.ImportMemory(h);
    b.WaitIpcEvent(0, ev);  // the exporter's memset finishes before our copy reads
    const auto got = ReadBack(p, h.size);
    EXPECT_EQ(got, std::vector<unsigned char>(h.size, 0x5A));
    b.ReleaseImported(0, p);
    close(kPassedFd);
  } else if (role == "fork_child_uses_cuda") {
    auto r = RunInChild(
        [] {
          CudaBackend& c = Cuda();
          void* p = c.Allocate(0, 4096);
          const auto in = Pattern(4096, 9);
          c.Copy(p, kCuda0, in.data(), kCPU, 4096);
          const bool same = ReadBack(p, 4096) == in;
          c.Free(0, p);
          return same ? 0 : 1;
        },
        60s, 60);
    EXPECT_TRUE(r.ok()) << r.Describe();
    EXPECT_EQ(b.state(), BackendState::kUninitialized);
  } else if (role == "fork_before_init") {
    // The child is forked before this process initializes CUDA, then imports what it exports.
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      close(sv[0]);
      alarm(60);
      IpcMemoryHandle h;
      const int fd = forksafe::testing::ReceiveWithFd(sv[1], &h, sizeof h);
      if (fd < 0) _exit(20);
      h.fd = fd;
      const int rc = ImportCheckAndReply(h, 5, 6);
      close(fd);
      char done = static_cast<char>(rc);
      _exit(WriteAll(sv[1], &done, 1) ? rc : 21);
    }
    close(sv[1]);
    ASSERT_GT(pid, 0);
    const size_t n = 3 << 20;
    void* p = b.Allocate(0, n);
    const auto in = Pattern(n, 5);
    b.Copy(p, kCuda0, in.data(), kCPU, n);
    IpcMemoryHandle h = b.ExportMemory(0, p, n);
    EXPECT_TRUE(forksafe::testing::SendWithFd(sv[0], h.fd, &h, sizeof h));
    char done = 0;
    EXPECT_TRUE(ReadAll(sv[0], &done, 1));
    auto r = WaitChild(pid, 60s);
    EXPECT_TRUE(r.ok()) << r.Describe();
    EXPECT_EQ(ReadBack(p, n), Pattern(n, 6));  // the child wrote its reply into our memory
    close(h.fd);
    close(sv[0]);
    b.Free(0, p);
  } else {
    FAIL() << "unknown helper role " << role;
  }
}

// ---- with a GPU
// -----------------------------------------------------------------------------------

TEST(CudaGpuTest, AllocateCopyMemsetRoundTrips) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  for (size_t n : {size_t{1}, size_t{511}, size_t{512}, size_t{4097}, size_t{1} << 20,
                   (size_t{1} << 20) + 1, size_t{3} << 20, (size_t{37} << 20) + 3}) {
    SCOPED_TRACE(n);
    void* a = b.Allocate(0, n);
    void* c = b.Allocate(0, n);
    ASSERT_NE(a, c);
    const auto in = Pattern(n, static_cast<unsigned>(n));
    b.Copy(a, kCuda0, in.data(), kCPU, n);  // H2D
    EXPECT_EQ(ReadBack(a, n), in);          // D2H
    b.Copy(c, kCuda0, a, kCuda0, n);        // D2D
    EXPECT_EQ(ReadBack(c, n), in);
    b.Memset(0, a, 0xA7, n);  // queued; the copy after it on the same stream sees it
    EXPECT_EQ(ReadBack(a, n), std::vector<unsigned char>(n, 0xA7));
    b.Synchronize(0);
    b.Free(0, a);
    b.Free(0, c);
  }
  EXPECT_TRUE(b.initialized());
  ExpectError([&] { b.Free(0, reinterpret_cast<void*>(0x1000)); }, ErrorCode::kInvalidArgument,
              "was not returned by Allocate");
}

TEST(CudaGpuTest, CachingAllocatorReusesAndCoalesces) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  b.Initialize();
  b.EmptyCache(0);
  const auto base = b.Stats(0);
  void* a = b.Allocate(0, 1000);
  void* c = b.Allocate(0, 1000);
  EXPECT_EQ(b.Stats(0).segments, base.segments + 1) << "small blocks share one segment";
  b.Free(0, a);
  void* again = b.Allocate(0, 1000);
  EXPECT_EQ(again, a) << "a freed block is reused";
  // Two neighbours freed coalesce into one block that a bigger request fits.
  void* x = b.Allocate(0, 256 << 10);
  void* y = b.Allocate(0, 256 << 10);
  b.Free(0, x);
  b.Free(0, y);
  void* z = b.Allocate(0, 512 << 10);
  EXPECT_EQ(z, std::min(x, y));
  EXPECT_EQ(b.Stats(0).segments, base.segments + 1);
  // A large request gets a segment of its own.
  void* big = b.Allocate(0, 8 << 20);
  EXPECT_EQ(b.Stats(0).segments, base.segments + 2);
  b.Free(0, big);
  void* big2 = b.Allocate(0, 8 << 20);
  EXPECT_EQ(big2, big);
  for (void* p : {again, c, z, big2}) b.Free(0, p);
  b.EmptyCache(0);
  EXPECT_EQ(b.Stats(0).segments, base.segments);
  EXPECT_EQ(b.Stats(0).allocated_bytes, base.allocated_bytes);
}

TEST(CudaGpuTest, HoldAfterFreeKeepsABlockUntilReleased) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  b.Initialize();
  b.EmptyCache(0);
  for (bool before_free : {false, true}) {
    SCOPED_TRACE(before_free ? "hold before Free" : "hold after Free");
    bool released = false;
    void* p = b.Allocate(0, 4096);
    if (before_free) b.HoldAfterFree(0, p, [&] { return released; });
    b.Free(0, p);
    if (!before_free) b.HoldAfterFree(0, p, [&] { return released; });
    EXPECT_EQ(b.Stats(0).held_blocks, 1u);
    std::vector<void*> others;
    for (int i = 0; i < 8; ++i) {
      others.push_back(b.Allocate(0, 4096));
      EXPECT_NE(others.back(), p) << "a held block was handed out again";
    }
    b.EmptyCache(0);
    EXPECT_EQ(b.Stats(0).held_blocks, 1u) << "EmptyCache keeps a block released() refuses";
    released = true;
    b.EmptyCache(0);
    EXPECT_EQ(b.Stats(0).held_blocks, 0u);
    for (void* o : others) b.Free(0, o);
  }
  ExpectError([&] { b.HoldAfterFree(0, reinterpret_cast<void*>(0x1000), [] { return true; }); },
              ErrorCode::kInvalidArgument, "HoldAfterFree");
}

TEST(CudaGpuTest, EmptyCacheReturnsMemory) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  const size_t n = size_t{256} << 20;
  void* p = b.Allocate(0, n);
  b.Memset(0, p, 1, n);
  b.Synchronize(0);
  const IpcMemoryInfo used = b.MemoryInfo(0);
  EXPECT_GT(used.total, 0u);
  b.Free(0, p);
  const IpcMemoryInfo cached = b.MemoryInfo(0);
  EXPECT_LT(cached.free, used.free + n / 2) << "a freed block stays cached";
  b.EmptyCache(0);
  const IpcMemoryInfo emptied = b.MemoryInfo(0);
  EXPECT_GE(emptied.free, cached.free + n / 2) << "EmptyCache gave the segment back";
  EXPECT_EQ(b.Stats(0).reserved_bytes % (2 << 20), 0u);
}

TEST(CudaGpuTest, ChildForkedAfterInitIsPoisoned) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  b.Initialize();
  SetDefaultDevice(kCuda0);
  auto r = RunInChild(
      [] {
        CudaBackend& c = Cuda();
        if (!c.poisoned()) return 1;
        if (DefaultDevice() != kCPU) return 2;
        if (c.DeviceCount() < 1) return 3;  // queries still work
        for (int op = 0; op < 3; ++op) {
          try {
            if (op == 0) c.Allocate(0, 16);
            if (op == 1) c.RecordIpcEvent(0);
            if (op == 2) c.MemoryInfo(0);
            return 4;
          } catch (const Error& e) {
            const std::string m = e.what();
            if (e.code() != ErrorCode::kForkPoisoned) return 5;
            if (m.find("spawn") == std::string::npos || m.find("forkserver") == std::string::npos) {
              return 6;
            }
          }
        }
        return 0;
      },
      30s, 30);
  SetDefaultDevice(kCPU);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

TEST(CudaGpuTest, ChildOfAnUninitializedParentCanUseCuda) {
  SKIP_WITHOUT_GPU();
  auto r = SpawnHelper("fork_child_uses_cuda", "");
  EXPECT_TRUE(r.ok()) << r.Describe();
}

TEST(CudaGpuTest, ExportImportWithinTheProcess) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  const size_t n = 5000;
  void* p = b.Allocate(0, n);
  char* q = static_cast<char*>(p) + 1000;
  IpcMemoryHandle h = b.ExportMemory(0, q, 2000);
  EXPECT_EQ(h.kind, IpcKind::kSegment);
  EXPECT_GE(h.fd, 0);
  EXPECT_NE(h.segment_id, 0u);
  EXPECT_EQ(h.segment_size % (2 << 20), 0u);
  EXPECT_EQ(h.size, 2000u);
  EXPECT_EQ(h.exporter, getpid());
  EXPECT_EQ(b.ImportMemory(h), q) << "an own segment comes back as the original pointer";
  b.ReleaseImported(0, q);
  ExpectError([&] { b.ReleaseImported(0, q); }, ErrorCode::kInvalidArgument, "ImportMemory");
  ExpectError([&] { b.ExportMemory(0, p, n + 4096); }, ErrorCode::kInvalidArgument,
              "not inside one allocated block");
  int dummy = 0;
  ExpectError([&] { b.ExportMemory(0, &dummy, 4); }, ErrorCode::kInvalidArgument,
              "ExportLegacyMemory");
  close(h.fd);
  b.Free(0, p);
}

TEST(CudaGpuTest, ExportImportInASpawnedProcess) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  const size_t n = 3 << 20;  // a segment of its own
  void* p = b.Allocate(0, n + 4096);
  char* q = static_cast<char*>(p) + 4096;
  const auto in = Pattern(n, 1);
  b.Copy(q, kCuda0, in.data(), kCPU, n);
  IpcMemoryHandle h = b.ExportMemory(0, q, n);
  auto r = SpawnHelper("import", ToHex(h), h.fd);
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_EQ(ReadBack(q, n), Pattern(n, 2)) << "the helper's writes land in our memory";
  close(h.fd);
  b.Free(0, p);
}

// Handles of `count` segments from an "export_and_exit" helper, each with its descriptor.
std::vector<IpcMemoryHandle> ReceiveFromExporter(int count) {
  std::vector<IpcMemoryHandle> out;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    ADD_FAILURE() << "socketpair: " << strerror(errno);
    return out;
  }
  auto exporter = SpawnHelper("export_and_exit", std::to_string(count), sv[1]);
  close(sv[1]);
  EXPECT_TRUE(exporter.ok()) << exporter.Describe();
  for (int i = 0; i < count; ++i) {
    IpcMemoryHandle h;
    const int fd = forksafe::testing::ReceiveWithFd(sv[0], &h, sizeof h);
    if (fd < 0) {
      ADD_FAILURE() << "the exporter sent " << i << " of " << count << " handles";
      break;
    }
    h.fd = fd;
    out.push_back(h);
  }
  close(sv[0]);
  return out;
}

// The first export of a segment keeps its descriptor for the next ones, for at most 256
// segments per device; the least recently exported gives its up first and asks the driver again.
TEST(CudaGpuTest, ExportDescriptorsAreKeptWithinBounds) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  b.EmptyCache(0);
  const size_t before = b.Stats(0).export_fds;  // segments earlier tests still hold
  constexpr int kBlocks = 260;                  // a segment each (over 1 MiB)
  const size_t n = 3 << 20;
  std::vector<void*> blocks;
  for (int i = 0; i < kBlocks; ++i) {
    blocks.push_back(b.Allocate(0, n));
    IpcMemoryHandle h = b.ExportMemory(0, blocks.back(), n);
    EXPECT_GE(h.fd, 0);
    close(h.fd);
  }
  EXPECT_EQ(b.Stats(0).export_fds, 256u) << "the bound";
  IpcMemoryHandle again = b.ExportMemory(0, blocks[0], n);  // gave its descriptor up: anew
  EXPECT_GE(again.fd, 0);
  EXPECT_EQ(b.Stats(0).export_fds, 256u);
  close(again.fd);
  IpcMemoryHandle last = b.ExportMemory(0, blocks.back(), n);  // kept: a duplicate
  EXPECT_GE(last.fd, 0);
  close(last.fd);
  for (void* p : blocks) b.Free(0, p);
  b.EmptyCache(0);
  EXPECT_LE(b.Stats(0).export_fds, before) << "released segments close theirs";
}

// A -> B -> C: B passes on memory it imported from A, after A exited and after B let go of its
// own mapping. The driver refuses to export an imported handle (CUDA_ERROR_INVALID_VALUE), so B
// sends the copy of A's descriptor that its import kept.
TEST(CudaGpuTest, AnImportedSegmentIsPassedOnAfterItsExporterExited) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  std::vector<IpcMemoryHandle> hs = ReceiveFromExporter(1);
  ASSERT_EQ(hs.size(), 1u) << "the exporter sends its handle before it exits";
  IpcMemoryHandle h = hs[0];
  void* p = b.ImportMemory(h);
  close(h.fd);
  EXPECT_EQ(ReadBack(p, h.size), Pattern(h.size, 1)) << "valid after its exporter exited";
  const IpcMemoryHandle again = b.ExportMemory(0, p, h.size);
  EXPECT_GE(again.fd, 0);
  EXPECT_EQ(again.segment_id, h.segment_id);
  EXPECT_EQ(again.size, h.size);
  b.ReleaseImported(0, p);
  b.EmptyCache(0);  // unmapped here: only the descriptor in `again` keeps the memory now
  EXPECT_EQ(b.Stats(0).imported_segments, 0u);
  EXPECT_EQ(b.Stats(0).idle_imports, 0u);
  auto importer = SpawnHelper("import", ToHex(again), again.fd);
  EXPECT_TRUE(importer.ok()) << importer.Describe();
  close(again.fd);
}

// A released import stays mapped for the next message naming its segment, within bounds
// (32 segments per device), oldest out first; EmptyCache unmaps the idle ones.
TEST(CudaGpuTest, IdleImportsStayMappedWithinBounds) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  b.EmptyCache(0);
  constexpr int kCount = 40;
  std::vector<IpcMemoryHandle> hs = ReceiveFromExporter(kCount);
  ASSERT_EQ(hs.size(), static_cast<size_t>(kCount));
  void* p = b.ImportMemory(hs[0]);
  EXPECT_EQ(ReadBack(p, 4096), Pattern(4096, 1)) << "valid after its exporter exited";
  b.ReleaseImported(0, p);
  EXPECT_EQ(b.Stats(0).imported_segments, 0u);
  EXPECT_EQ(b.Stats(0).idle_imports, 1u);
  IpcMemoryHandle no_fd = hs[0];
  no_fd.fd = -1;  // an idle segment needs no descriptor to be used again: nothing is imported
  EXPECT_EQ(b.ImportMemory(no_fd), p) << "the idle mapping is used again";
  EXPECT_EQ(b.Stats(0).idle_imports, 0u);
  b.ReleaseImported(0, p);
  ExpectError([&] { b.ReleaseImported(0, p); }, ErrorCode::kInvalidArgument,
              "released as often as it was imported");
  std::vector<void*> ps;
  for (const auto& h : hs) ps.push_back(b.ImportMemory(h));
  EXPECT_EQ(b.Stats(0).imported_segments, static_cast<size_t>(kCount));
  EXPECT_EQ(b.Stats(0).idle_imports, 0u);
  for (int i = 0; i < kCount; ++i) {
    EXPECT_EQ(ReadBack(ps[static_cast<size_t>(i)], 4096),
              Pattern(4096, 1 + static_cast<unsigned>(i)))
        << "segment " << i;
    b.ReleaseImported(0, ps[static_cast<size_t>(i)]);
  }
  EXPECT_EQ(b.Stats(0).imported_segments, 0u);
  EXPECT_EQ(b.Stats(0).idle_imports, 32u) << "the bound";
  // Segments 0..7 went (the oldest): importing 0 maps it anew; 39 is idle and used again.
  void* first = b.ImportMemory(hs[0]);
  EXPECT_EQ(b.Stats(0).idle_imports, 32u);
  void* last = b.ImportMemory(hs[kCount - 1]);
  EXPECT_EQ(last, ps[kCount - 1]);
  EXPECT_EQ(b.Stats(0).idle_imports, 31u);
  EXPECT_EQ(ReadBack(first, 4096), Pattern(4096, 1));
  b.ReleaseImported(0, first);
  b.ReleaseImported(0, last);
  EXPECT_EQ(b.Stats(0).idle_imports, 32u);
  b.EmptyCache(0);
  EXPECT_EQ(b.Stats(0).idle_imports, 0u);
  for (auto& h : hs) close(h.fd);
}

TEST(CudaGpuTest, ExportImportInAChildForkedBeforeInit) {
  SKIP_WITHOUT_GPU();
  auto r = SpawnHelper("fork_before_init", "");
  EXPECT_TRUE(r.ok()) << r.Describe();
}

TEST(CudaGpuTest, LegacyHandles) {
  SKIP_WITHOUT_GPU();
#if defined(FORKSAFE_HAVE_CUDA_HEADERS)
  CudaBackend& b = Cuda();
  b.MemoryInfo(0);  // initializes, and leaves cuda:0's primary context current on this thread
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(lib, nullptr);
  using Alloc = int (*)(unsigned long long*, size_t);
  using FreeFn = int (*)(unsigned long long);
  auto mem_alloc = reinterpret_cast<Alloc>(dlsym(lib, "cuMemAlloc_v2"));
  auto mem_free = reinterpret_cast<FreeFn>(dlsym(lib, "cuMemFree_v2"));
  ASSERT_TRUE(mem_alloc && mem_free);
  const size_t n = 1 << 20;
  unsigned long long dptr = 0;
  ASSERT_EQ(mem_alloc(&dptr, n), 0);
  void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(dptr));
  const auto in = Pattern(n - 256, 3);
  char* q = static_cast<char*>(p) + 256;
  b.Copy(q, kCuda0, in.data(), kCPU, in.size());
  IpcMemoryHandle h = b.ExportLegacyMemory(0, q, in.size());
  EXPECT_EQ(h.kind, IpcKind::kLegacy);
  EXPECT_EQ(h.fd, -1);
  EXPECT_EQ(h.offset, 256u);
  EXPECT_EQ(h.exporter, getpid());
  EXPECT_EQ(b.ImportMemory(h), q) << "our own legacy export comes back as the original pointer";
  b.ReleaseImported(0, q);
  auto r = SpawnHelper("import_legacy", ToHex(h));
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_EQ(ReadBack(q, in.size()), Pattern(in.size(), 4));
  // A handle whose exporter has exited is refused before the driver is asked.
  auto gone = RunInChild([] { return 0; }, 10s, 10);
  ASSERT_TRUE(gone.ok());
  IpcMemoryHandle stale = h;
  stale.exporter = gone.pid;
  ExpectError([&] { b.ImportMemory(stale); }, ErrorCode::kFailedPrecondition, "has exited");
  // Memory of forksafe's allocator is not legacy memory.
  void* own = b.Allocate(0, 64);
  ExpectError([&] { b.ExportLegacyMemory(0, own, 64); }, ErrorCode::kInvalidArgument,
              "ExportMemory");
  b.Free(0, own);
  EXPECT_EQ(mem_free(dptr), 0);
#endif
}

// A wait on another process's event is forgotten once the stream has passed it: the next
// RecordIpcEvent finds nothing pending (so sends carry no event) and the list does not grow.
// (It once grew by one per message, and every send on both sides then recorded an event.)
TEST(CudaGpuTest, WaitsTheStreamHasPassedAreForgotten) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  b.Synchronize(0);
  EXPECT_EQ(b.Stats(0).ipc_waits, 0u);
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  forksafe::testing::ChildResult helper;
  std::thread spawner([&] { helper = SpawnHelper("record_busy_event", "", sv[1]); });
  IpcEventHandle ev;
  pollfd pfd{sv[0], POLLIN, 0};
  const bool got = poll(&pfd, 1, 60000) == 1 && ReadAll(sv[0], &ev, sizeof ev);
  if (got) {
    ev.fd = -1;  // the helper's descriptor number means nothing here
    EXPECT_FALSE(ev.complete) << "the helper's stream was busy: it recorded a real event";
    b.WaitIpcEvent(0, ev);  // opened while the helper lives
  }
  char go = 1;
  (void)send(sv[0], &go, 1, MSG_NOSIGNAL);  // the helper may be gone already
  spawner.join();
  close(sv[0]);
  close(sv[1]);
  ASSERT_TRUE(got) << "the helper sent no event within 60 s";
  EXPECT_TRUE(helper.ok()) << helper.Describe();
  EXPECT_EQ(b.Stats(0).ipc_waits, 1u);
  bool complete = false;
  for (int i = 0; i < 300 && !complete; ++i) {  // the helper's work takes milliseconds
    complete = b.RecordIpcEvent(0).complete;
    if (!complete) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(complete) << "the stream went idle, yet every RecordIpcEvent recorded an event";
  EXPECT_EQ(b.Stats(0).ipc_waits, 0u);
  b.Synchronize(0);
}

TEST(CudaGpuTest, IpcEventsOrderAnotherProcessAfterOurWork) {
  SKIP_WITHOUT_GPU();
  CudaBackend& b = Cuda();
  // Within the process: recycled slots, increasing sequence numbers.
  uint64_t last = 0;
  for (int i = 0; i < 3 * CudaBackend::kIpcEventPoolCapacity; ++i) {
    const IpcEventHandle e = b.RecordIpcEvent(0);
    if (e.complete) continue;  // no event could be had: synchronized instead
    EXPECT_LT(e.slot, static_cast<uint32_t>(CudaBackend::kIpcEventPoolCapacity));
    EXPECT_GT(e.sequence, last);
    last = e.sequence;
    EXPECT_EQ(e.exporter, getpid());
    b.WaitIpcEvent(0, e);
  }
  b.Synchronize(0);
  // Across processes: the helper's copy waits for our memset, which we never synchronize.
  const size_t n = size_t{64} << 20;
  void* p = b.Allocate(0, n);
  b.Memset(0, p, 0x00, n);
  b.Synchronize(0);
  b.Memset(0, p, 0x5A, n);
  const IpcEventHandle ev = b.RecordIpcEvent(0);
  IpcMemoryHandle h = b.ExportMemory(0, p, n);
  auto r = SpawnHelper("wait_event", ToHex(h) + ToHex(ev), h.fd);
  EXPECT_TRUE(r.ok()) << r.Describe();
  close(h.fd);
  b.Free(0, p);
}

}  // namespace
}  // namespace forksafe::device
