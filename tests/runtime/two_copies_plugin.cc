// tests/runtime/two_copies_plugin.cc: one copy of forksafe inside a shared object, for
// two_copies_test. BUILD.bazel links it twice (libforksafe_copy_a.so, libforksafe_copy_b.so), each
// with its own static copy of //runtime, as a framework core and an extension would be; the test
// loads both with dlopen(RTLD_LOCAL) and drives them through the plain C functions below.
//
// Busy work (copy_start): a pool of this copy that a feeder thread keeps posting short tasks to
// (some run a oneTBB algorithm), and a mutex held across every fork (HoldAcrossFork) that a second
// thread keeps taking. Strings returned by these functions live until the next call of the same
// function on the same thread.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/framework_lock.h"
#include "forksafe/runtime/thread_pool.h"
#include "tests/support/workloads.h"

// oneTBB only where it can be checked: Debian's oneTBB is not built with ThreadSanitizer, whose
// reports on its task allocator are false (see tbb_fork_test's no_tsan in BUILD.bazel).
#if defined(__SANITIZE_THREAD__)
#define FORKSAFE_COPY_USES_TBB 0
#else
#define FORKSAFE_COPY_USES_TBB 1
#endif

#ifndef FORKSAFE_COPY_NAME
#error "FORKSAFE_COPY_NAME names the copy (BUILD.bazel sets it)"
#endif

namespace {

using forksafe::runtime::AtForkRegistry;
using forksafe::runtime::ForkEvent;
using forksafe::runtime::ForkEventKindName;
using forksafe::runtime::RegistryRole;
using forksafe::runtime::ThreadPool;
using forksafe::runtime::ThreadPoolOptions;

// This copy's pool and held mutex: created once, never destroyed (handlers of the registry).
struct Copy {
  ThreadPool* pool;
  std::mutex held;  // held across every fork
  Copy() {
    ThreadPoolOptions o;
    o.num_threads = 2;
    o.name = "copy_" FORKSAFE_COPY_NAME;
    pool = new ThreadPool(o);
    forksafe::runtime::HoldAcrossFork(&held, "held:copy_" FORKSAFE_COPY_NAME);
  }
};

Copy& TheCopy() {
  static Copy* copy = new Copy();
  return *copy;
}

struct Busy {
  std::atomic<bool> stop{false};
  std::atomic<int> warm{0};  // 1 each for the feeder and the taker once they ran a first round
  std::thread feeder, taker;
};
Busy* g_busy = nullptr;     // between copy_start and copy_stop (test thread only)
std::thread g_holder;       // copy_hold_for_ms's thread, joined by the next call or copy_stop
std::thread g_lock_holder;  // copy_hold_framework_lock_for_ms's thread, likewise
std::atomic<int64_t> g_lock_released_ns{0};  // when g_lock_holder let go (steady clock)

const char* Keep(std::string s) {
  thread_local std::string text;
  text = std::move(s);
  return text.c_str();
}

}  // namespace

extern "C" {

// 0 primary, 1 nested, 2 separate.
int copy_role() {
  // (AtForkRegistry::Get() here is this copy's, unless a copy in the global scope interposes it:
  // two_copies_interpose_test.)
  switch (AtForkRegistry::Get().role()) {
    case RegistryRole::kPrimary: return 0;
    case RegistryRole::kNested: return 1;
    case RegistryRole::kSeparate: return 2;
  }
  return -1;
}

const char* copy_primary_object() { return Keep(AtForkRegistry::Get().PrimaryObject()); }

// The names of this copy's handlers, one per line.
const char* copy_handler_names() {
  std::string out;
  for (const std::string& n : AtForkRegistry::Get().HandlerNames()) out += n + "\n";
  return Keep(out);
}

// This copy's last fork report (ForkReport::ToString()).
const char* copy_last_report() { return Keep(AtForkRegistry::Get().LastReport().ToString()); }

// Events of the last report of kind `kind` ("prepare_retried", ...) whose subsystem begins with
// `subsystem_prefix`.
int copy_count_events(const char* kind, const char* subsystem_prefix) {
  int n = 0;
  for (const ForkEvent& e : AtForkRegistry::Get().LastReport().events) {
    if (strcmp(ForkEventKindName(e.kind), kind) == 0 &&
        e.subsystem.compare(0, strlen(subsystem_prefix), subsystem_prefix) == 0) {
      ++n;
    }
  }
  return n;
}

uint64_t copy_fork_count() { return AtForkRegistry::Get().fork_count(); }

// Runs 64 tasks on this copy's pool, one oneTBB algorithm from a pool worker, and takes its held
// mutex: 0 when all of it worked within 20 s. Used in the parent and in forked children (where
// the pool and oneTBB's workers are started afresh).
int copy_work() {
  Copy& c = TheCopy();
  std::future<long> tbb = c.pool->Submit(
      [] { return FORKSAFE_COPY_USES_TBB ? forksafe::testing::TbbSum(5000) : 5000L * 4999 / 2; });
  std::vector<std::future<int64_t>> results;
  for (int64_t i = 0; i < 64; ++i) {
    results.push_back(c.pool->Submit([i] {
      int64_t s = 0;
      for (int64_t k = 0; k <= i; ++k) s += k;
      return s;
    }));
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int64_t i = 0; i < 64; ++i) {
    if (results[i].wait_until(until) != std::future_status::ready) return 1;
    if (results[i].get() != i * (i + 1) / 2) return 2;
  }
  if (tbb.wait_until(until) != std::future_status::ready || tbb.get() != 5000L * 4999 / 2) return 4;
  if (!c.held.try_lock()) {
    std::unique_lock<std::mutex> lk(c.held, std::defer_lock);
    while (!lk.try_lock()) {
      if (std::chrono::steady_clock::now() > until) return 3;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    lk.release();
  }
  c.held.unlock();
  return 0;
}

// Starts the busy work. Returns 0 once both of its threads ran a first round, 1 when it was
// already running, 2 when they did not within 20 s (stopped again).
//
// Why the wait, and the feeder's posts under the held mutex under ASan: gcc 12's ASan does not
// intercept fork (libasan.so.8 has no fork or atfork symbol), so its thread registry and its
// allocator's locks (SizeClassAllocator64::GetFromAllocator, taken when a thread's cache refills)
// are not held across fork. A fork while a thread is starting, or while a thread refills its
// cache, can leave one held in the child, whose new pool threads then hang: CI's ASan run failed
// fork 0 that way (the child's 64 tasks never ran; reproduced here). glibc's malloc is fork-safe,
// so plain builds keep the feeder allocating across forks.
void copy_stop();

int copy_start() {
  if (g_busy != nullptr) return 1;
  Copy& c = TheCopy();
  g_busy = new Busy();
  Busy* b = g_busy;
  b->feeder = std::thread([b, &c] {
    std::atomic<int64_t> sum{0};
    for (int i = 0; !b->stop.load(); ++i) {
      {
#if defined(__SANITIZE_ADDRESS__)
        std::lock_guard<std::mutex> no_post_across_fork(c.held);
#endif
        c.pool->Post([&sum, i] { sum += i; });
        // oneTBB from a pool worker (runtime/tbb_fork.h): both copies use the process's one
        // oneTBB.
        if (FORKSAFE_COPY_USES_TBB && i % 64 == 0) {
          c.pool->Post([&sum] { sum += forksafe::testing::TbbSum(5000); });
        }
      }
      if (i % 32 == 31) {
        c.pool->Wait();
        if (i == 63) b->warm.fetch_add(1);  // a oneTBB task ran too
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    c.pool->Wait();
  });
  b->taker = std::thread([b, &c] {
    for (int i = 0; !b->stop.load(); ++i) {
      {
        std::lock_guard<std::mutex> lk(c.held);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      if (i == 9) b->warm.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (b->warm.load() < 2) {
    if (std::chrono::steady_clock::now() > until) {
      copy_stop();
      return 2;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return 0;
}

// A thread takes the held mutex for `ms` milliseconds; returns once it holds it.
void copy_hold_for_ms(int ms) {
  if (g_holder.joinable()) g_holder.join();
  std::promise<void> holding;
  std::future<void> taken = holding.get_future();
  g_holder = std::thread([ms, holding = std::move(holding)]() mutable {
    std::lock_guard<std::mutex> lk(TheCopy().held);
    holding.set_value();
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  });
  taken.wait();
}

// From now on this copy's framework lock throws from TryLockFor (a custom lock gone wrong). For a
// forked child only: the lock stays installed for the rest of the process.
void copy_set_throwing_framework_lock() {
  struct Throwing final : forksafe::runtime::FrameworkLock {
    void Lock() override {}
    bool TryLockFor(std::chrono::nanoseconds) override {
      throw std::runtime_error("this framework lock throws (test)");
    }
    void Unlock() override {}
    bool HeldByCurrentThread() const override { return false; }
    void ResetInChild() override {}
  };
  static Throwing* lock = new Throwing();
  forksafe::runtime::SetFrameworkLock(lock);
}

// Installs (once) a listener on this copy's registry that counts the reports it is given.
static std::atomic<int> g_listener_calls{0};
void copy_set_listener() {
  AtForkRegistry::Get().SetEventListener(
      [](const forksafe::runtime::ForkReport&) { g_listener_calls.fetch_add(1); });
}
int copy_listener_calls() { return g_listener_calls.load(); }

// A task of this copy's pool forks; the child runs 8 tasks on the pool (started afresh there)
// and exits 0. Returns 0 when the child did so within 30 s, nonzero otherwise.
int copy_fork_from_worker() {
  Copy& c = TheCopy();
  std::future<int> forked = c.pool->Submit([&c]() -> int {
    const pid_t pid = fork();
    if (pid < 0) return 10;
    if (pid == 0) {
      alarm(30);
      std::vector<std::future<int>> r;
      for (int i = 0; i < 8; ++i) r.push_back(c.pool->Submit([i] { return i; }));
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      for (int i = 0; i < 8; ++i) {
        if (r[i].wait_until(until) != std::future_status::ready || r[i].get() != i) _exit(1);
      }
      _exit(0);
    }
    int status = 0;
    for (int waited_ms = 0; waited_ms < 30000; waited_ms += 5) {
      const pid_t done = waitpid(pid, &status, WNOHANG);
      if (done == pid) return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 11;
      if (done < 0) return 12;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return 13;
  });
  if (forked.wait_for(std::chrono::seconds(40)) != std::future_status::ready) return 14;
  return forked.get();
}

// A thread takes this copy's framework lock for `ms` milliseconds; returns once it holds it.
void copy_hold_framework_lock_for_ms(int ms) {
  if (g_lock_holder.joinable()) g_lock_holder.join();
  g_lock_released_ns.store(0);
  std::promise<void> holding;
  std::future<void> taken = holding.get_future();
  g_lock_holder = std::thread([ms, holding = std::move(holding)]() mutable {
    {
      forksafe::runtime::FrameworkLockGuard lk;
      holding.set_value();
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      g_lock_released_ns.store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
    }
  });
  taken.wait();
}

// When copy_hold_framework_lock_for_ms's thread let go (steady-clock ns), 0 while it holds it.
int64_t copy_framework_lock_released_ns() { return g_lock_released_ns.load(); }

// 1 when the calling thread holds this copy's framework lock (called from a prepare callback).
int copy_framework_lock_held_here() {
  return forksafe::runtime::GetFrameworkLock().HeldByCurrentThread() ? 1 : 0;
}

// Stops the busy work and joins every thread this file started.
void copy_stop() {
  if (g_holder.joinable()) g_holder.join();
  if (g_lock_holder.joinable()) g_lock_holder.join();
  if (g_busy == nullptr) return;
  g_busy->stop.store(true);
  g_busy->feeder.join();
  g_busy->taker.join();
  delete g_busy;
  g_busy = nullptr;
}

}  // extern "C"
