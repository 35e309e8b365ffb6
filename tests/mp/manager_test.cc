// Tests of mp/manager.h: a manager process and its proxies, under every start method, across
// processes, threads, Pool workers and mp::Queue; the manager killed mid-use; bad input.
//
// Every wait is bounded: proxy calls that block take a timeout (or are released by the test),
// children are joined with a timeout, and the test main's watchdog turns a hang into a failure.
#include "forksafe/mp/manager.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <variant>
#include <vector>

#include "cereal/types/variant.hpp"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/manager_client.h"
#include "forksafe/mp/internal/server_auth.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using forksafe::runtime::Error;
using forksafe::runtime::ErrorCode;
using forksafe::testing::RunInChild;
using forksafe::testing::WaitUntil;
using namespace std::chrono_literals;
using SteadyClock = std::chrono::steady_clock;

constexpr double kJoin = 30.0;  // seconds a child may take

double SecondsSince(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

// Runs fn, which must throw an Error; returns it (fails the test otherwise).
template <class Fn>
Error ErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_FALSE(e.message().empty());
    return e;
  }
  ADD_FAILURE() << "expected an Error";
  return Error(ErrorCode::kInternal, "no error");
}

ManagerOptions With(const std::string& method) {
  ManagerOptions o;
  o.start_method = method;
  return o;
}

ProcessOptions Child(const std::string& method) {
  ProcessOptions o;
  o.start_method = method;
  return o;
}

bool ProcessGone(pid_t pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

// Gone, or a zombie (dead; its reaper, maybe not us, has not collected it yet).
bool ProcessDead(pid_t pid) {
  if (ProcessGone(pid)) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

// ---- the tutorial's Server Process example ---------------------------------------------------
//
// Python's dict takes keys and values of any type; a C++ dict has one key and one value type, so
// the example uses std::variant (cereal encodes it) and std::monostate for None.
using Key = std::variant<int, std::string, double>;
using Val = std::variant<std::monostate, int, std::string>;

void TutorialChild(DictProxy<Key, Val> d, ListProxy<int> l) {
  d.set(1, std::string("1"));
  d.set(std::string("2"), 2);
  d.set(0.25, std::monostate{});
  l.reverse();
}
FORKSAFE_ENTRY_POINT(TutorialChild);

// Python's repr of the dict, e.g. {1: '1', '2': 2, 0.25: None}.
std::string Repr(const std::vector<std::pair<Key, Val>>& items) {
  std::ostringstream os;
  os << "{";
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) os << ", ";
    std::visit(
        [&](const auto& k) {
          using T = std::decay_t<decltype(k)>;
          if constexpr (std::is_same_v<T, std::string>)
            os << "'" << k << "'";
          else
            os << k;
        },
        items[i].first);
    os << ": ";
    std::visit(
        [&](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, std::monostate>) {
            os << "None";
          } else if constexpr (std::is_same_v<T, std::string>) {
            os << "'" << v << "'";
          } else {
            os << v;
          }
        },
        items[i].second);
  }
  os << "}";
  return os.str();
}

class ManagerMethods : public ::testing::TestWithParam<std::string> {};

TEST_P(ManagerMethods, TutorialServerProcessExample) {
  Manager manager(With(GetParam()));
  auto d = manager.dict<Key, Val>();
  auto l = manager.list<int>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  Process p(Child(GetParam()), &TutorialChild, d, l);
  p.start();
  ASSERT_TRUE(p.join(kJoin));
  ASSERT_EQ(p.exitcode(), 0) << (p.failure() ? p.failure()->message : "");
  EXPECT_EQ(Repr(d.items()), "{1: '1', '2': 2, 0.25: None}");
  EXPECT_EQ(l.copy(), (std::vector<int>{9, 8, 7, 6, 5, 4, 3, 2, 1, 0}));
  EXPECT_EQ(std::get<std::string>(d.get(1)), "1");
  EXPECT_EQ(std::get<int>(d.get(std::string("2"))), 2);
}

// ---- concurrency across processes ------------------------------------------------------------

void Increment(DictProxy<std::string, int> d, LockProxy lock, int times) {
  for (int i = 0; i < times; ++i) {
    if (!lock.acquire(true, 20.0)) throw Error(ErrorCode::kDeadlineExceeded, "lock");
    d.set("n", d.get("n") + 1);  // a read-modify-write that only the lock makes atomic
    lock.release();
  }
}
FORKSAFE_ENTRY_POINT(Increment);

TEST_P(ManagerMethods, FourProcessesIncrementUnderAManagerLock) {
  Manager manager(With(GetParam()));
  auto d = manager.dict<std::string, int>({{"n", 0}});
  auto lock = manager.Lock();
  std::vector<std::unique_ptr<Process>> procs;
  for (int i = 0; i < 4; ++i) {
    procs.push_back(std::make_unique<Process>(Child(GetParam()), &Increment, d, lock, 200));
    procs.back()->start();
  }
  for (auto& p : procs) {
    ASSERT_TRUE(p->join(60.0));
    EXPECT_EQ(p->exitcode(), 0) << (p->failure() ? p->failure()->message : "");
  }
  EXPECT_EQ(d.get("n"), 800);
}

// Takes the Lock and the RLock (twice), says so, then leaves without releasing either: by
// SIGKILL, or by a plain _exit.
void HoldAndLeave(LockProxy lock, RLockProxy rlock, EventProxy held, bool kill) {
  if (!lock.acquire(true, 20.0) || !rlock.acquire(true, 20.0) || !rlock.acquire(true, 20.0)) {
    throw Error(ErrorCode::kDeadlineExceeded, "HoldAndLeave: a lock was not free");
  }
  held.set();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the parent blocks meanwhile
  if (kill) raise(SIGKILL);
  _exit(0);
}
FORKSAFE_ENTRY_POINT(HoldAndLeave);

// Python's manager leaves such a lock held forever; ours hands it to the next acquirer (a waiter
// already blocked, a non-blocking try) and tells it so, as mp::Lock does.
TEST_P(ManagerMethods, ALockWhoseOwnerDiedGoesToTheNextAcquirerWhoIsTold) {
  Manager manager(With(GetParam()));
  auto lock = manager.Lock();
  auto rlock = manager.RLock();
  for (const bool kill : {true, false}) {
    SCOPED_TRACE(kill ? "owner killed" : "owner _exit without release");
    auto held = manager.Event();
    Process p(Child(GetParam()), &HoldAndLeave, lock, rlock, held, kill);
    p.start();
    ASSERT_TRUE(held.wait(20.0)) << "the child never took the locks";
    EXPECT_FALSE(lock.acquire(false)) << "a live owner's lock must stay held";
    // Blocked while the owner lives, then taken over (bounded: 20 s, not forever).
    ASSERT_TRUE(lock.acquire(true, 20.0)) << "the dead owner's Lock was never handed over";
    EXPECT_TRUE(lock.previous_owner_died());
    ASSERT_TRUE(p.join(kJoin));
    EXPECT_EQ(p.exitcode(), kill ? -SIGKILL : 0);
    ASSERT_TRUE(rlock.acquire(false)) << "a non-blocking try takes a dead owner's RLock at once";
    EXPECT_TRUE(rlock.previous_owner_died());
    rlock.release();  // the take-over's depth is 1, not the dead owner's 2
    auto other = std::async(std::launch::async, [rlock]() mutable {
      const bool got = rlock.acquire(false);
      if (got) rlock.release();
      return got;
    });
    EXPECT_TRUE(other.get()) << "one release after a take-over frees the RLock";
    lock.release();
    ASSERT_TRUE(lock.acquire(false));
    EXPECT_FALSE(lock.previous_owner_died()) << "an ordinary acquire clears the flag";
    lock.release();
  }
}

void Produce(QueueProxy<int> q, int n) {
  for (int i = 0; i < n; ++i) q.put(i);
}
FORKSAFE_ENTRY_POINT(Produce);

void SetAfter(EventProxy e, int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  e.set();
}
FORKSAFE_ENTRY_POINT(SetAfter);

void WaitAtBarrier(BarrierProxy b, ListProxy<int64_t> out) { out.append(b.wait(20.0)); }
FORKSAFE_ENTRY_POINT(WaitAtBarrier);

TEST_P(ManagerMethods, QueueEventAndBarrierAcrossProcesses) {
  Manager manager(With(GetParam()));
  auto q = manager.Queue<int>();
  Process producer(Child(GetParam()), &Produce, q, 100);
  producer.start();
  for (int i = 0; i < 100; ++i) ASSERT_EQ(q.get(true, 20.0), i);
  ASSERT_TRUE(producer.join(kJoin));
  EXPECT_TRUE(q.empty());

  auto e = manager.Event();
  const auto t0 = SteadyClock::now();
  Process setter(Child(GetParam()), &SetAfter, e, 200);
  setter.start();
  EXPECT_TRUE(e.wait(20.0));
  EXPECT_GE(SecondsSince(t0), 0.15);
  ASSERT_TRUE(setter.join(kJoin));

  auto b = manager.Barrier(4);
  auto arrivals = manager.list<int64_t>();
  std::vector<std::unique_ptr<Process>> procs;
  for (int i = 0; i < 3; ++i) {
    procs.push_back(std::make_unique<Process>(Child(GetParam()), &WaitAtBarrier, b, arrivals));
    procs.back()->start();
  }
  arrivals.append(b.wait(20.0));
  for (auto& p : procs) {
    ASSERT_TRUE(p->join(kJoin));
    EXPECT_EQ(p->exitcode(), 0) << (p->failure() ? p->failure()->message : "");
  }
  std::vector<int64_t> seen = arrivals.copy();
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3}));
}

int AddToDict(DictProxy<int, int> d, int key) {
  d.set(key, key * key);
  return static_cast<int>(getpid());
}
FORKSAFE_ENTRY_POINT(AddToDict);

void FromMpQueue(Queue q) {
  auto d = q.get<DictProxy<int, int>>(true, 20.0);
  d.set(-1, 42);
}
FORKSAFE_ENTRY_POINT(FromMpQueue);

TEST_P(ManagerMethods, ProxiesThroughAnMpQueueAndToPoolWorkers) {
  Manager manager(With(GetParam()));
  auto d = manager.dict<int, int>();
  Queue q;
  Process p(Child(GetParam()), &FromMpQueue, q);
  p.start();
  q.put(d);
  ASSERT_TRUE(p.join(kJoin));
  EXPECT_EQ(p.exitcode(), 0) << (p.failure() ? p.failure()->message : "");
  EXPECT_EQ(d.get(-1), 42);

  PoolOptions po;
  po.processes = 2;
  po.start_method = GetParam();
  Pool pool(po);
  std::vector<std::tuple<DictProxy<int, int>, int>> tasks;
  for (int i = 0; i < 20; ++i) tasks.emplace_back(d, i);
  const std::vector<int> pids = pool.starmap(&AddToDict, tasks);
  EXPECT_EQ(pids.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(d.get(i), i * i);
  EXPECT_EQ(d.size(), 21u);
  pool.close();
  pool.join();
}

TEST_P(ManagerMethods, ManagerDiesWithItsOwner) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const std::string method = GetParam();
  const auto r = RunInChild(
      [&] {
        close(fds[0]);
        Manager manager(With(method));
        const pid_t pid = manager.pid();
        if (write(fds[1], &pid, sizeof pid) != sizeof pid) return 2;
        kill(getpid(), SIGKILL);  // the owner dies without shutting down
        return 3;
      },
      30s, 30);
  close(fds[1]);
  pid_t manager_pid = 0;
  ASSERT_EQ(read(fds[0], &manager_pid, sizeof manager_pid),
            static_cast<ssize_t>(sizeof manager_pid));
  close(fds[0]);
  EXPECT_EQ(r.signal, SIGKILL) << r.Describe();
  EXPECT_TRUE(WaitUntil([&] { return ProcessDead(manager_pid); }, 10s))
      << "manager " << manager_pid << " (" << method << ") outlived its owner";
}

INSTANTIATE_TEST_SUITE_P(StartMethods, ManagerMethods,
                         ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

// ---- every proxy, in one process -----------------------------------------------------------

TEST(ManagerTest, DictListNamespaceValueArray) {
  Manager manager;
  auto d = manager.dict<std::string, int>({{"a", 1}});
  d.set("b", 2);
  d.update({{"c", 3}, {"a", 10}});
  EXPECT_EQ(d.get("a"), 10);
  EXPECT_EQ(d.get("zz", -1), -1);
  EXPECT_TRUE(d.contains("b"));
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"a", "b", "c"}));  // insertion order
  EXPECT_EQ(d.values(), (std::vector<int>{10, 2, 3}));
  EXPECT_EQ(d.setdefault("d", 4), 4);
  EXPECT_EQ(d.setdefault("d", 5), 4);
  EXPECT_EQ(d.pop("d"), 4);
  EXPECT_EQ(d.pop("d", 7), 7);
  EXPECT_TRUE(d.erase("c"));
  EXPECT_FALSE(d.erase("c"));
  EXPECT_EQ(d.copy(), (std::map<std::string, int>{{"a", 10}, {"b", 2}}));
  const Error missing = ErrorOf([&] { d.get("nope"); });
  EXPECT_EQ(missing.code(), ErrorCode::kNotFound);
  EXPECT_NE(missing.message().find("'nope'"), std::string::npos) << missing.message();
  EXPECT_EQ(ErrorOf([&] { d.pop("nope"); }).code(), ErrorCode::kNotFound);
  d.clear();
  EXPECT_EQ(d.size(), 0u);

  auto l = manager.list<std::string>({"x"});
  l.append("y");
  l.extend({"z", "w"});
  l.insert(0, "first");
  l.insert(100, "last");  // clamped, as Python
  EXPECT_EQ(l.copy(), (std::vector<std::string>{"first", "x", "y", "z", "w", "last"}));
  EXPECT_EQ(l.get(-1), "last");
  l.set(-2, "W");
  EXPECT_EQ(l.pop(), "last");
  EXPECT_EQ(l.pop(0), "first");
  EXPECT_EQ(l.size(), 4u);
  const Error range = ErrorOf([&] { l.get(4); });
  EXPECT_EQ(range.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(range.message().find("index 4"), std::string::npos) << range.message();
  EXPECT_NE(range.message().find("size 4"), std::string::npos) << range.message();
  EXPECT_EQ(ErrorOf([&] { l.set(-5, "q"); }).code(), ErrorCode::kInvalidArgument);
  l.clear();
  EXPECT_EQ(ErrorOf([&] { l.pop(); }).code(), ErrorCode::kInvalidArgument);

  auto ns = manager.Namespace();
  ns.set("x", 10);
  ns.set("name", std::string("n"));
  EXPECT_EQ(ns.get<int>("x"), 10);
  EXPECT_EQ(ns.get<std::string>("name"), "n");
  EXPECT_TRUE(ns.has("x"));
  EXPECT_EQ(ns.names(), (std::vector<std::string>{"name", "x"}));
  EXPECT_TRUE(ns.erase("x"));
  const Error attr = ErrorOf([&] { ns.get<int>("x"); });
  EXPECT_EQ(attr.code(), ErrorCode::kNotFound);
  EXPECT_NE(attr.message().find("'x'"), std::string::npos) << attr.message();

  auto v = manager.Value<double>(1.5);
  EXPECT_EQ(v.get(), 1.5);
  v.set(2.5);
  EXPECT_EQ(v.get(), 2.5);

  auto a = manager.Array<int>(3);
  EXPECT_EQ(a.copy(), (std::vector<int>{0, 0, 0}));
  a.set(1, 7);
  a.set(-1, 9);
  EXPECT_EQ(a.get(1), 7);
  EXPECT_EQ(a.size(), 3u);
  EXPECT_EQ(a.copy(), (std::vector<int>{0, 7, 9}));
  EXPECT_EQ(ErrorOf([&] { a.get(3); }).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(manager.Array<int>(std::vector<int>{1, 2}).copy(), (std::vector<int>{1, 2}));
}

TEST(ManagerTest, LocksSemaphoresConditionEventBarrierQueueInThreads) {
  Manager manager;
  auto lock = manager.Lock();
  ASSERT_TRUE(lock.acquire());
  EXPECT_EQ(ErrorOf([&] { lock.acquire(); }).code(), ErrorCode::kFailedPrecondition);
  EXPECT_FALSE(lock.acquire(false));
  // Another thread is another owner: it can neither take nor release it.
  std::async(std::launch::async, [&] {
    EXPECT_FALSE(lock.acquire(true, 0.1));
    EXPECT_EQ(ErrorOf([&] { lock.release(); }).code(), ErrorCode::kFailedPrecondition);
  }).get();
  lock.release();
  EXPECT_EQ(ErrorOf([&] { lock.release(); }).code(), ErrorCode::kFailedPrecondition);

  auto rlock = manager.RLock();
  ASSERT_TRUE(rlock.acquire());
  ASSERT_TRUE(rlock.acquire());
  rlock.release();
  std::async(std::launch::async, [&] { EXPECT_FALSE(rlock.acquire(false)); }).get();
  rlock.release();
  std::async(std::launch::async, [&] {
    EXPECT_TRUE(rlock.acquire(false));
    rlock.release();
  }).get();

  auto sem = manager.Semaphore(2);
  EXPECT_TRUE(sem.acquire());
  EXPECT_TRUE(sem.acquire());
  EXPECT_FALSE(sem.acquire(true, 0.05));
  sem.release(2);
  EXPECT_EQ(sem.get_value(), 2);
  auto bsem = manager.BoundedSemaphore(1);
  EXPECT_EQ(ErrorOf([&] { bsem.release(); }).code(), ErrorCode::kFailedPrecondition);

  auto cond = manager.Condition();
  auto flag = manager.Value<int>(0);
  auto waiter = std::async(std::launch::async, [&] {
    cond.acquire();
    const bool ok = cond.wait_for([&] { return flag.get() == 1; }, 20.0);
    cond.release();
    return ok;
  });
  std::this_thread::sleep_for(50ms);
  cond.acquire();
  flag.set(1);
  cond.notify_all();
  cond.release();
  EXPECT_TRUE(waiter.get());
  EXPECT_EQ(ErrorOf([&] { cond.wait(0.1); }).code(), ErrorCode::kFailedPrecondition);
  auto over = manager.Condition(manager.Lock());
  over.acquire();
  EXPECT_FALSE(over.wait(0.05));  // times out, then holds the lock again
  over.release();

  auto ev = manager.Event();
  EXPECT_FALSE(ev.is_set());
  EXPECT_FALSE(ev.wait(0.05));
  ev.set();
  EXPECT_TRUE(ev.wait());
  ev.clear();
  EXPECT_FALSE(ev.is_set());

  auto bar = manager.Barrier(2);
  EXPECT_EQ(bar.parties(), 2);
  EXPECT_EQ(ErrorOf([&] { bar.wait(0.05); }).code(), ErrorCode::kDeadlineExceeded);
  EXPECT_TRUE(bar.broken());
  EXPECT_EQ(ErrorOf([&] { bar.wait(1.0); }).code(), ErrorCode::kFailedPrecondition);
  bar.reset();
  auto other = std::async(std::launch::async, [&] { return bar.wait(20.0); });
  const int64_t mine = bar.wait(20.0);
  EXPECT_EQ(mine + other.get(), 1);

  auto q = manager.Queue<std::string>(1);
  q.put("a");
  EXPECT_TRUE(q.full());
  EXPECT_EQ(ErrorOf([&] { q.put_nowait("b"); }).code(), ErrorCode::kDeadlineExceeded);
  EXPECT_EQ(q.qsize(), 1);
  EXPECT_EQ(q.get_nowait(), "a");
  EXPECT_EQ(ErrorOf([&] { q.get(true, 0.05); }).code(), ErrorCode::kDeadlineExceeded);
}

TEST(ManagerTest, ABlockedCallDoesNotBlockOtherThreads) {
  Manager manager;
  auto q = manager.Queue<int>();
  auto d = manager.dict<int, int>();
  auto blocked = std::async(std::launch::async, [&] { return q.get(true, 20.0); });
  std::this_thread::sleep_for(50ms);
  const auto t0 = SteadyClock::now();
  for (int i = 0; i < 50; ++i) d.set(i, i);
  EXPECT_EQ(d.size(), 50u);
  EXPECT_LT(SecondsSince(t0), 5.0);
  q.put(7);
  EXPECT_EQ(blocked.get(), 7);
}

TEST(ManagerTest, AForkedChildDoesNotReuseItsParentsConnections) {
  Manager manager;
  auto d = manager.dict<int, int>();
  d.set(0, 0);  // leaves an idle connection in this process's pool
  ASSERT_GE(internal::IdleManagerConnections(), 1u);
  // The child (forked from a helper thread) and this thread call the manager at the same time:
  // a shared connection would mix their replies up.
  auto child = std::async(std::launch::async, [&] {
    return RunInChild(
        [&] {
          if (internal::IdleManagerConnections() != 0) return 2;
          for (int i = 1; i <= 200; ++i) {
            d.set(i, -i);
            if (d.get(i) != -i) return 3;
          }
          return 0;
        },
        30s, 30);
  });
  for (int i = 0; i < 200; ++i) {
    d.set(1000 + i, i);
    ASSERT_EQ(d.get(1000 + i), i);
  }
  const auto r = child.get();
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_EQ(d.size(), 401u);
}

// ---- failure ---------------------------------------------------------------------------------

TEST(ManagerTest, KilledManagerFailsEveryCallPromptlyIncludingABlockedOne) {
  Manager manager;
  auto d = manager.dict<int, int>();
  auto l = manager.list<int>({1});
  auto ns = manager.Namespace();
  auto lock = manager.Lock();
  auto rlock = manager.RLock();
  auto sem = manager.Semaphore(0);
  auto cond = manager.Condition();
  auto ev = manager.Event();
  auto bar = manager.Barrier(2);
  auto q = manager.Queue<int>();
  auto v = manager.Value<int>(1);
  auto a = manager.Array<int>(2);
  d.set(1, 1);
  ASSERT_TRUE(lock.acquire());
  // Another thread blocks (no timeout) on the lock this thread holds.
  auto blocked = std::async(std::launch::async, [&] {
    try {
      lock.acquire();
    } catch (const Error& e) {
      return e;
    }
    return Error(ErrorCode::kInternal, "acquired");
  });
  std::this_thread::sleep_for(200ms);
  const pid_t pid = manager.pid();
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  ASSERT_EQ(blocked.wait_for(5s), std::future_status::ready) << "a blocked call hung";
  const Error b = blocked.get();
  EXPECT_EQ(b.code(), ErrorCode::kClosed) << b.what();
  EXPECT_NE(b.message().find(manager.name()), std::string::npos) << b.message();
  EXPECT_NE(b.message().find("gone"), std::string::npos) << b.message();

  std::vector<std::function<void()>> calls = {
      [&] { d.get(1); },         [&] { d.set(2, 2); },    [&] { l.append(2); },
      [&] { ns.get<int>("x"); }, [&] { lock.release(); }, [&] { rlock.acquire(); },
      [&] { sem.acquire(); },    [&] { cond.acquire(); }, [&] { ev.wait(); },
      [&] { bar.wait(); },       [&] { q.get(); },        [&] { v.get(); },
      [&] { a.set(0, 1); },
  };
  for (size_t i = 0; i < calls.size(); ++i) {
    const auto t0 = SteadyClock::now();
    const Error e = ErrorOf(calls[i]);
    EXPECT_EQ(e.code(), ErrorCode::kClosed) << "call " << i << ": " << e.what();
    EXPECT_LT(SecondsSince(t0), 2.0) << "call " << i;
  }
  EXPECT_EQ(ErrorOf([&] { manager.dict<int, int>(); }).code(), ErrorCode::kClosed);
  manager.shutdown();  // reaps the killed process
  EXPECT_EQ(internal::IdleManagerConnections(), 0u);
}

TEST(ManagerTest, ShutdownTwiceThenUseIsAClearError) {
  Manager manager;
  auto d = manager.dict<int, int>();
  d.set(1, 1);
  const pid_t pid = manager.pid();
  manager.shutdown();
  manager.shutdown();
  EXPECT_FALSE(manager.running());
  EXPECT_TRUE(ProcessGone(pid));
  const Error e = ErrorOf([&] { d.get(1); });
  EXPECT_EQ(e.code(), ErrorCode::kClosed);
  EXPECT_NE(e.message().find("was shut down"), std::string::npos) << e.message();
  EXPECT_EQ(ErrorOf([&] { manager.Lock(); }).code(), ErrorCode::kClosed);
}

// ---- bad input -------------------------------------------------------------------------------

// A raw connection to the manager behind `proxy` (the way a proxy connects).
Connection RawConnect(const internal::ProxyBase& proxy) {
  const std::string& name = proxy.address()->socket_name;
  FileDescriptor fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path + 1, name.data(), name.size());
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  EXPECT_EQ(connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), len), 0) << strerror(errno);
  return Connection(std::move(fd), true, true);
}

TEST(ManagerTest, BadInputIsRefusedAndNeverCrashesTheManager) {
  Manager manager;
  EXPECT_EQ(ErrorOf([&] { manager.Semaphore(-1); }).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(ErrorOf([&] { manager.BoundedSemaphore(-3); }).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(ErrorOf([&] { manager.Barrier(0); }).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(ErrorOf([&] { manager.Array<int>(-1); }).code(), ErrorCode::kInvalidArgument);
  auto lock = manager.Lock();
  EXPECT_EQ(ErrorOf([&] { lock.acquire(true, -1.0); }).code(), ErrorCode::kInvalidArgument);
  auto q = manager.Queue<int>();
  EXPECT_EQ(ErrorOf([&] { q.get(true, -0.5); }).code(), ErrorCode::kInvalidArgument);
  auto cond = manager.Condition();
  cond.acquire();
  EXPECT_EQ(ErrorOf([&] { cond.notify(-2); }).code(), ErrorCode::kInvalidArgument);
  cond.release();
  {
    Manager other;
    EXPECT_EQ(ErrorOf([&] { manager.Condition(other.Lock()); }).code(),
              ErrorCode::kInvalidArgument);
  }

  // An unknown object id, and a proxy of the wrong kind.
  auto d = manager.dict<int, int>();
  internal::ProxyBase forged(d.address(), 999999, internal::ManagedKind::kDict);
  EXPECT_EQ(ErrorOf([&] { forged.Call(internal::ManagerOp::kDictSize, "forged"); }).code(),
            ErrorCode::kInvalidArgument);
  internal::ProxyBase wrong(d.address(), d.id(), internal::ManagedKind::kList);
  EXPECT_EQ(ErrorOf([&] { wrong.Call(internal::ManagerOp::kSeqSize, "wrong"); }).code(),
            ErrorCode::kInvalidArgument);
  internal::ProxyBase wrong_op(d.address(), d.id(), internal::ManagedKind::kDict);
  EXPECT_EQ(ErrorOf([&] { wrong_op.Call(internal::ManagerOp::kSeqSize, "op"); }).code(),
            ErrorCode::kInvalidArgument);

  // Decoding a proxy as another proxy type.
  Message m = Encode(d);
  EXPECT_EQ(ErrorOf([&] { DecodeAs<ListProxy<int>>(m); }).code(), ErrorCode::kInvalidArgument);
  Message m2 = Encode(d);
  EXPECT_EQ(ErrorOf([&] { DecodeAs<DictProxy<std::string, int>>(m2); }).code(),
            ErrorCode::kInvalidArgument);
  Message m3 = Encode(d);
  auto back = DecodeAs<DictProxy<int, int>>(m3);
  back.set(5, 6);
  EXPECT_EQ(d.get(5), 6);

  // An empty proxy.
  EXPECT_EQ(ErrorOf([] { DictProxy<int, int>().size(); }).code(), ErrorCode::kFailedPrecondition);

  // Garbage after a good hello, a wrong secret, and no hello: each connection is dropped.
  {
    Connection c = RawConnect(d);
    internal::SendServerHello(c, d.address()->secret);
    c.send_bytes(std::string("\xff\x01garbage", 9));
    EXPECT_EQ(ErrorOf([&] { c.RecvMessage(10.0); }).code(), ErrorCode::kClosed);
    c.close();
  }
  {
    Connection c = RawConnect(d);
    internal::SendServerHello(c, std::string(internal::kSecretBytes, 'x'));
    internal::ManagerRequest req;
    req.op = internal::ManagerOp::kPing;
    // Refused: the send may already fail, else the reply never comes.
    EXPECT_EQ(ErrorOf([&] {
                c.send(req);
                c.RecvMessage(10.0);
              }).code(),
              ErrorCode::kClosed);
    c.close();
  }
  {
    Connection c = RawConnect(d);
    internal::ManagerRequest req;
    req.object = d.id();
    req.kind = internal::ManagedKind::kDict;
    req.op = static_cast<internal::ManagerOp>(60000);
    EXPECT_EQ(ErrorOf([&] {
                c.send(req);  // a request instead of the hello
                c.RecvMessage(10.0);
              }).code(),
              ErrorCode::kClosed);
    c.close();
  }
  // Values holding descriptors cannot be stored.
  auto conns = manager.list<Connection>();
  std::pair<Connection, Connection> ends = Pipe();
  EXPECT_EQ(ErrorOf([&] { conns.append(ends.first); }).code(), ErrorCode::kInvalidArgument);
  ends.first.close();
  ends.second.close();
  // The manager serves on.
  d.set(1, 2);
  EXPECT_EQ(d.get(1), 2);
}

}  // namespace
}  // namespace forksafe::mp
