// examples/consumers/framework.cc: a small "framework" that embeds forksafe, built the three ways
// a user consumes the package (README.md of this folder): CMake, pkg-config and an outside Bazel
// workspace. tools/consumers.sh builds and runs all three; each run must print "ok" for every
// check and exit 0.
//
// What it checks
//   - forksafe::Version() (the library) agrees with FORKSAFE_VERSION_STRING (the headers);
//   - a forksafe::runtime::Error thrown inside the library is caught by its type here, with its
//     code (type information crosses the shared library's boundary);
//   - Pool.map over tensors with the fork and the spawn start methods: the workers' in-place
//     writes are seen here and the results come back (spawn re-runs this program, which finds
//     its own entry points and the library's Pool worker);
//   - a subsystem of the framework's own (a cache guarded by one mutex, busy on another thread)
//     held across forks with HoldAcrossFork: a forked child finds it consistent, and its
//     in_child reset ran;
//   - a ThreadPool used in the parent and then in forked children (a Process and Pool workers).
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/thread_pool.h"
#include "forksafe/version.h"

namespace {

using forksafe::device::Tensor;
using forksafe::runtime::ThreadPool;

int g_failures = 0;

void Check(bool ok, const std::string& what) {
  std::printf("framework: %-72s %s\n", what.c_str(), ok ? "ok" : "MISMATCH");
  std::fflush(stdout);
  if (!ok) ++g_failures;
}

// The framework's own subsystem: a cache whose invariant (sum == 0 + 1 + ... + (count - 1))
// holds whenever its mutex is free. A writer thread keeps updating it; without HoldAcrossFork a
// fork could copy it half-updated.
struct Cache {
  std::mutex mu;
  std::vector<long> entries;
  long sum = 0;
  bool reset_in_child = false;
};
Cache g_cache;

bool CacheConsistent() {
  std::lock_guard<std::mutex> lock(g_cache.mu);
  long expected = 0;
  for (size_t i = 0; i < g_cache.entries.size(); ++i) expected += static_cast<long>(i);
  return expected == g_cache.sum;
}

// The sum of 0..n-1 computed on the default ThreadPool (in the parent, then in forked children,
// where the pool is rebuilt on first use).
long PoolSum(long n) {
  std::atomic<long> total{0};
  ThreadPool::Default().ParallelFor(0, n, 64, [&](int64_t lo, int64_t hi) {
    long s = 0;
    for (int64_t i = lo; i < hi; ++i) s += i;
    total += s;
  });
  return total.load();
}

// A forked child: the cache is consistent, in_child ran, and the ThreadPool works.
void ForkedChild() {
  if (!CacheConsistent()) std::_Exit(10);
  if (!g_cache.reset_in_child) std::_Exit(11);
  if (PoolSum(10000) != 10000L * 9999 / 2) std::_Exit(12);
}

// Pool tasks: doubles a tensor in place (the parent sees it) and returns its sum, computed on
// the worker's ThreadPool.
double DoubleAndSum(Tensor t) {
  float* p = static_cast<float*>(t.data_ptr());
  std::atomic<long> sum{0};
  ThreadPool::Default().ParallelFor(0, t.numel(), 16, [&](int64_t lo, int64_t hi) {
    long s = 0;
    for (int64_t i = lo; i < hi; ++i) {
      p[i] *= 2.f;
      s += static_cast<long>(p[i]);
    }
    sum += s;
  });
  return static_cast<double>(sum.load());
}
FORKSAFE_ENTRY_POINT(DoubleAndSum);

void Unregistered() {}

void CheckPoolMap(const std::string& method) {
  forksafe::mp::PoolOptions options;
  options.processes = 2;
  options.start_method = method;
  forksafe::mp::Pool pool(options);
  std::vector<Tensor> inputs;
  for (int i = 0; i < 16; ++i) inputs.push_back(Tensor::Full({128}, static_cast<double>(i)));
  std::vector<double> sums = pool.map(&DoubleAndSum, inputs);
  bool ok = sums.size() == inputs.size();
  for (size_t i = 0; ok && i < inputs.size(); ++i) {
    ok = sums[i] == 2.0 * 128 * static_cast<double>(i) &&
         inputs[i].item<float>({127}) == 2.f * static_cast<float>(i);
  }
  Check(ok, "Pool.map over 16 tensors (" + method + "): in-place writes and sums");
  pool.close();
  pool.join();
}

}  // namespace

int main(int argc, char** argv) {
  forksafe::mp::InitMain(argc, argv);  // a spawned child runs its entry point here and exits

  Check(std::string(forksafe::Version()) == FORKSAFE_VERSION_STRING,
        std::string("library version ") + forksafe::Version() + " == headers' version");

  // An Error thrown inside the library, caught by its type.
  bool caught = false;
  try {
    forksafe::mp::ProcessOptions o;
    o.start_method = "spawn";
    forksafe::mp::Process p(o, &Unregistered);
    p.start();
  } catch (const forksafe::runtime::Error& e) {
    caught = e.code() == forksafe::runtime::ErrorCode::kNotFound;
  } catch (const std::exception& e) {
    std::printf("framework: caught as std::exception only: %s\n", e.what());
  }
  Check(caught, "runtime::Error(kNotFound) thrown in the library, caught here");

  // The subsystem, held across every fork, busy on a writer thread.
  forksafe::runtime::HoldAcrossFork(&g_cache.mu, "framework.cache",
                                    [] { g_cache.reset_in_child = true; });
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    while (!stop.load()) {
      std::lock_guard<std::mutex> lock(g_cache.mu);
      if (g_cache.entries.size() > 4096) {
        g_cache.entries.clear();
        g_cache.sum = 0;
      }
      g_cache.entries.push_back(0);
      g_cache.sum += static_cast<long>(g_cache.entries.size() - 1);
    }
  });

  Check(PoolSum(10000) == 10000L * 9999 / 2, "ThreadPool in the parent");

  bool children_ok = true;
  for (int i = 0; i < 5; ++i) {
    forksafe::mp::ProcessOptions o;
    o.start_method = "fork";
    forksafe::mp::Process child(o, &ForkedChild);
    child.start();
    child.join(std::chrono::seconds(30));
    std::optional<int> code = child.exitcode();
    if (!code || *code != 0) {
      std::printf("framework: forked child %d exited with %d\n", i, code ? *code : -1000);
      children_ok = false;
    }
  }
  Check(children_ok, "5 forked children: cache held across fork, in_child ran, ThreadPool");

  CheckPoolMap("fork");
  CheckPoolMap("spawn");

  stop = true;
  writer.join();
  forksafe::runtime::AtForkRegistry::Get().Unregister(&g_cache.mu);
  Check(!g_cache.reset_in_child && CacheConsistent(), "the parent's cache is untouched");

  std::printf("framework: %s\n", g_failures == 0 ? "all checks passed" : "FAILED");
  return g_failures == 0 ? 0 : 1;
}
