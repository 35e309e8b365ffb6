// tests/support/workloads.h: small, checkable parallel workloads that the fork tests run before
// and after fork() (in the parent, in pool workers and in children).
//
// Both compute 0 + 1 + ... + (n - 1), so a caller compares with n * (n - 1) / 2. Thread safety:
// each call is independent. Fork: they are what the tests use to show that a pool or oneTBB
// works in a child, so they must only be called where the test expects that to hold.
#ifndef FORKSAFE_TESTS_SUPPORT_WORKLOADS_H_
#define FORKSAFE_TESTS_SUPPORT_WORKLOADS_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "forksafe/runtime/thread_pool.h"
#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/parallel_reduce.h"

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

/// Keeps a parent busy the way the fork tests need while other threads fork: a feeder thread
/// posts short tasks to `pool` (resting 200 us after every 64), and a second thread runs
/// TbbSum(50000) in a loop on a one-worker pool of its own (oneTBB used from a pool worker, as
/// runtime/tbb_fork.h recommends: the drain joins that worker, which releases its hold on
/// oneTBB). Stop() (or the destructor) ends both threads; the counters are then final.
class BusyParent {
 public:
  explicit BusyParent(runtime::ThreadPool& pool)
      : feeder_([this, &pool] {
          while (!stop_) {
            pool.Post([this] {
              volatile long x = 0;
              for (int i = 0; i < 2000; ++i) x += i;
              ++completed;
            });
            if (++submitted % 64 == 0) {
              std::this_thread::sleep_for(std::chrono::microseconds(200));
            }
          }
        }),
        tbb_user_([this] {
          while (!stop_) {
            if (tbb_pool_.Submit([] { return TbbSum(50000); }).get() != 1249975000L) {
              tbb_wrong = true;
            }
            ++tbb_rounds;
          }
        }) {}
  ~BusyParent() { Stop(); }
  BusyParent(const BusyParent&) = delete;
  BusyParent& operator=(const BusyParent&) = delete;

  /// Ends both threads (idempotent). Tasks already posted may still run: Wait() on the pool.
  void Stop() {
    stop_ = true;
    if (feeder_.joinable()) feeder_.join();
    if (tbb_user_.joinable()) tbb_user_.join();
  }

  /// The statistics of the one-worker pool that runs oneTBB.
  runtime::ThreadPoolStats tbb_pool_stats() const { return tbb_pool_.stats(); }

  std::atomic<long> submitted{0};      ///< Tasks posted to the pool.
  std::atomic<long> completed{0};      ///< Tasks that ran.
  std::atomic<long> tbb_rounds{0};     ///< TbbSum rounds finished.
  std::atomic<bool> tbb_wrong{false};  ///< Some round gave a wrong sum.

 private:
  std::atomic<bool> stop_{false};
  runtime::ThreadPool tbb_pool_{runtime::ThreadPoolOptions{1, "tbb_user", std::chrono::seconds(5)}};
  std::thread feeder_;  // declared last: started once everything above exists
  std::thread tbb_user_;
};

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_SUPPORT_WORKLOADS_H_
