// tests/support/workloads.h: small, checkable parallel workloads that the fork tests run before
// and after fork() (in the parent, in pool workers and in children).
//
// Both compute 0 + 1 + ... + (n - 1), so a caller compares with n * (n - 1) / 2. Thread safety:
// each call is independent. Fork: they are what the tests use to show that a pool or oneTBB
// works in a child, so they must only be called where the test expects that to hold.
#ifndef FORKSAFE_TESTS_SUPPORT_WORKLOADS_H_
#define FORKSAFE_TESTS_SUPPORT_WORKLOADS_H_

#include <atomic>
#include <cstdint>

#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/parallel_reduce.h"
#include "runtime/thread_pool.h"

namespace forksafe::testing {

/// The sum of [0, n) with tbb::parallel_reduce.
inline long TbbSum(long n) {
  return tbb::parallel_reduce(
      tbb::blocked_range<long>(0, n), 0L,
      [](const tbb::blocked_range<long>& r, long acc) {
        for (long i = r.begin(); i != r.end(); ++i) acc += i;
        return acc;
      },
      [](long a, long b) { return a + b; });
}

/// The sum of [0, n) with `pool`.ParallelFor in blocks of 64.
inline int64_t PoolSum(runtime::ThreadPool& pool, int64_t n) {
  std::atomic<int64_t> s{0};
  pool.ParallelFor(0, n, 64, [&](int64_t a, int64_t b) {
    int64_t local = 0;
    for (int64_t i = a; i < b; ++i) local += i;
    s += local;
  });
  return s.load();
}

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_SUPPORT_WORKLOADS_H_
