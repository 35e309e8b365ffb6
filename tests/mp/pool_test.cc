// Pool with the three start methods: map/starmap/imap/imap_unordered/apply/apply_async/map_async,
// result states and timeouts, task exceptions with stack traces, workers that die mid-task,
// maxtasksperchild, initializers, close/join/terminate, bad input, and no process left behind.
#include "forksafe/mp/pool.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "forksafe/mp/process.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;

// ---- task functions (registered: usable with every start method) ----
int Square(int x) { return x * x; }
FORKSAFE_ENTRY_POINT(Square);

int Add(int a, int b) { return a + b; }
FORKSAFE_ENTRY_POINT(Add);

std::string Greet(const std::string& who) { return "hello " + who; }
FORKSAFE_ENTRY_POINT(Greet);

int SleepMs(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
FORKSAFE_ENTRY_POINT(SleepMs);

int Pid(int) { return static_cast<int>(getpid()); }
FORKSAFE_ENTRY_POINT(Pid);

[[gnu::noinline]] void ThrowDeep(int x) {
  throw std::invalid_argument("bad value " + std::to_string(x));
}
int ThrowOn5(int x) {
  if (x == 5) ThrowDeep(x);
  return x * 10;
}
FORKSAFE_ENTRY_POINT(ThrowOn5);

enum Death { kSegfault = 0, kSigkill = 1, kExit3 = 2 };
int DieIf(int x, int victim, int how) {
  if (x == victim) {
    std::this_thread::sleep_for(50ms);  // mid-task
    if (how == kSegfault) {
      // A real SIGSEGV delivery, not a null store: UBSan would report a store and exit 1.
      raise(SIGSEGV);
    } else if (how == kSigkill) {
      raise(SIGKILL);
    } else {
      std::exit(3);
    }
  }
  return x + 100;
}
FORKSAFE_ENTRY_POINT(DieIf);

// Initializer: records that it ran, and reports this worker's pid to the test.
int g_init_calls = 0;
int g_init_value = 0;
void InitWorker(Connection report, int value) {
  ++g_init_calls;
  g_init_value = value;
  report.send(static_cast<int>(getpid()));
}
FORKSAFE_ENTRY_POINT(InitWorker);

std::tuple<int, int, int> InitState(int) {
  return {g_init_calls, g_init_value, static_cast<int>(getpid())};
}
FORKSAFE_ENTRY_POINT(InitState);

void FailingInit(int code) { throw std::runtime_error("init failed with " + std::to_string(code)); }
FORKSAFE_ENTRY_POINT(FailingInit);

// Descriptors cross both ways: an input Connection, and a Connection returned as a result.
int SendPid(Connection out) {
  out.send(static_cast<int>(getpid()));
  return 1;
}
FORKSAFE_ENTRY_POINT(SendPid);

Connection Mailbox(int x) {
  auto [a, b] = Pipe();
  a.send(x * 3);
  return b;
}
FORKSAFE_ENTRY_POINT(Mailbox);

int NotRegistered(int x) { return x; }
void NotRegisteredInit(int) {}

std::vector<int> Range(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

PoolOptions Opts(const std::string& method, int processes = 2) {
  PoolOptions o;
  o.processes = processes;
  o.start_method = method;
  return o;
}

bool ProcessGone(pid_t pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

// Waits (bounded) until the pool has `n` workers again.
bool WaitForWorkers(Pool& pool, size_t n, std::chrono::seconds limit = 20s) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < limit) {
    if (pool.pids().size() == n) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

class PoolTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PoolTest, MapKeepsInputOrderForEveryChunksize) {
  Pool pool(Opts(GetParam()));
  EXPECT_EQ(pool.processes(), 2);
  EXPECT_EQ(pool.start_method(), GetParam());
  const std::vector<int> xs = Range(1000);
  std::vector<int> expected;
  for (int x : xs) expected.push_back(x * x);
  for (int cs : {0, 1, 7}) {
    EXPECT_EQ(pool.map(&Square, xs, cs), expected) << "chunksize " << cs;
  }
  EXPECT_TRUE(pool.map(&Square, std::vector<int>{}).empty());
  // Parameters taken by const reference; inputs converted to the parameter type.
  EXPECT_EQ(pool.map(&Greet, std::vector<const char*>{"a", "b"}),
            (std::vector<std::string>{"hello a", "hello b"}));
}

TEST_P(PoolTest, StarmapAndApply) {
  Pool pool(Opts(GetParam()));
  std::vector<std::tuple<int, int>> pairs;
  for (int i = 0; i < 50; ++i) pairs.emplace_back(i, 1000 * i);
  const std::vector<int> sums = pool.starmap(&Add, pairs, 3);
  ASSERT_EQ(sums.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sums[i], 1001 * i);
  EXPECT_EQ(pool.apply(&Add, 2, 3), 5);
  EXPECT_EQ(pool.apply(&Square, 12), 144);
  EXPECT_EQ(pool.starmap_async(&Add, pairs).get(30s), sums);
}

TEST_P(PoolTest, ImapYieldsInOrderAndImapUnorderedYieldsEverything) {
  Pool pool(Opts(GetParam()));
  const std::vector<int> xs = Range(100);
  std::vector<int> got;
  for (int r : pool.imap(&Square, xs, 3)) got.push_back(r);
  ASSERT_EQ(got.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(got[i], i * i);

  auto it = pool.imap(&Square, std::vector<int>{4, 5});
  EXPECT_EQ(it.next(30s), 16);
  EXPECT_EQ(it.next(30s), 25);
  EXPECT_EQ(it.next(30s), std::nullopt);

  // A slow first task: with two workers, the quick ones come out first.
  pool.map(&SleepMs, std::vector<int>{100, 100}, 1);  // both workers are up
  const std::vector<int> ms = {800, 1, 2, 3, 4, 5};
  auto un = pool.imap_unordered(&SleepMs, ms);
  std::vector<int> order;
  while (auto r = un.next(30s)) order.push_back(*r);
  EXPECT_EQ(std::multiset<int>(order.begin(), order.end()),
            std::multiset<int>(ms.begin(), ms.end()));
  EXPECT_NE(order.front(), 800) << "imap_unordered waited for the slow task";
  EXPECT_EQ(order.back(), 800);
}

TEST_P(PoolTest, DescriptorsTravelInInputsAndResults) {
  Pool pool(Opts(GetParam()));
  std::vector<Connection> readers, writers;
  for (int i = 0; i < 4; ++i) {
    auto [r, w] = Pipe();
    readers.push_back(r);
    writers.push_back(w);
  }
  EXPECT_EQ(pool.map(&SendPid, writers, 1), (std::vector<int>{1, 1, 1, 1}));
  for (Connection& r : readers) {
    ASSERT_TRUE(r.poll(10s));
    EXPECT_NE(r.recv<int>(), getpid());
  }
  std::vector<Connection> boxes = pool.map(&Mailbox, std::vector<int>{1, 2, 3}, 1);
  ASSERT_EQ(boxes.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(boxes[i].poll(10s));
    EXPECT_EQ(boxes[i].recv<int>(), (i + 1) * 3);
  }
}

TEST_P(PoolTest, AsyncResultStatesAndTimeouts) {
  Pool pool(Opts(GetParam()));
  AsyncResult<int> r = pool.apply_async(&SleepMs, 400);
  EXPECT_FALSE(r.ready());
  try {
    r.successful();
    FAIL() << "successful() before ready must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("not ready"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(r.wait(0.01));
  EXPECT_TRUE(r.wait(30s));
  EXPECT_TRUE(r.ready());
  EXPECT_TRUE(r.successful());
  EXPECT_EQ(r.get(), 400);
  EXPECT_EQ(r.get(0.0), 400);  // again, from the cache

  AsyncResult<std::vector<int>> m = pool.map_async(&Square, Range(20), 1);
  std::vector<int> expected;
  for (int i = 0; i < 20; ++i) expected.push_back(i * i);
  EXPECT_EQ(m.get(30s), expected);
  EXPECT_TRUE(m.ready());
  EXPECT_TRUE(m.successful());

  AsyncResult<int> slow = pool.apply_async(&SleepMs, 5000);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    slow.get(0.2);
    FAIL() << "get(0.2) of a 5 s task must time out";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDeadlineExceeded);
    EXPECT_NE(std::string(e.what()).find("not ready within 0.2 s"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  EXPECT_THROW(slow.get(-1.0), Error);  // negative timeout
  AsyncResult<int> empty;
  EXPECT_THROW(empty.ready(), Error);
  // The destructor terminates the slow task.
}

TEST_P(PoolTest, ATaskThatThrowsFailsOnlyItsResult) {
  Pool pool(Opts(GetParam()));
  std::vector<AsyncResult<int>> rs;
  for (int i = 0; i < 10; ++i) rs.push_back(pool.apply_async(&ThrowOn5, i));
  for (int i = 0; i < 10; ++i) {
    if (i != 5) {
      EXPECT_EQ(rs[i].get(30s), i * 10);
      continue;
    }
    try {
      rs[i].get(30s);
      FAIL() << "task 5 must fail";
    } catch (const RemoteError& e) {
      EXPECT_EQ(e.code(), ErrorCode::kProcessFailed);
      EXPECT_EQ(e.failure().type, "std::invalid_argument");
      EXPECT_EQ(e.failure().message, "bad value 5");
      EXPECT_NE(e.failure().traceback.find("ThrowDeep"), std::string::npos)
          << e.failure().traceback;
      EXPECT_NE(std::string(e.what()).find("bad value 5"), std::string::npos);
      EXPECT_GT(e.worker_pid(), 0);
    }
    EXPECT_TRUE(rs[i].ready());
    EXPECT_FALSE(rs[i].successful());
  }
  // map fails as a whole, with the task's error.
  try {
    pool.map(&ThrowOn5, Range(10), 1);
    FAIL() << "map must throw";
  } catch (const RemoteError& e) {
    EXPECT_EQ(e.failure().message, "bad value 5");
  }
  // imap raises in place and goes on.
  auto it = pool.imap(&ThrowOn5, Range(8));
  for (int i = 0; i < 8; ++i) {
    if (i == 5) {
      EXPECT_THROW(it.next(30s), RemoteError);
    } else {
      EXPECT_EQ(it.next(30s), i * 10);
    }
  }
  EXPECT_EQ(it.next(30s), std::nullopt);
  EXPECT_EQ(pool.map(&Square, std::vector<int>{3}), std::vector<int>{9});  // still healthy
}

TEST_P(PoolTest, AWorkerThatDiesFailsItsTaskAndIsReplaced) {
  struct Case {
    int how;
    int exit_code;
    const char* text;
  };
  for (const Case& c :
       {Case{kSegfault, -SIGSEGV, "SIGSEGV (Segmentation fault)"},
        Case{kSigkill, -SIGKILL, "SIGKILL (Killed)"}, Case{kExit3, 3, "exited with code 3"}}) {
    SCOPED_TRACE(c.text);
    Pool pool(Opts(GetParam()));
    const std::vector<pid_t> before = pool.pids();
    std::vector<AsyncResult<int>> rs;
    for (int i = 0; i < 8; ++i) rs.push_back(pool.apply_async(&DieIf, i, 3, c.how));
    for (int i = 0; i < 8; ++i) {
      if (i != 3) {
        EXPECT_EQ(rs[i].get(30s), i + 100);
        continue;
      }
      try {
        rs[i].get(30s);
        FAIL() << "the task that killed its worker must fail";
      } catch (const WorkerLostError& e) {
        EXPECT_EQ(e.code(), ErrorCode::kProcessFailed);
        EXPECT_EQ(e.exit_code(), c.exit_code);
        EXPECT_NE(std::string(e.what()).find(c.text), std::string::npos) << e.what();
        EXPECT_NE(std::find(before.begin(), before.end(), e.worker_pid()), before.end());
        EXPECT_TRUE(ProcessGone(e.worker_pid()));
        const std::vector<pid_t> now = pool.pids();
        EXPECT_EQ(std::count(now.begin(), now.end(), e.worker_pid()), 0);
      }
    }
    ASSERT_TRUE(WaitForWorkers(pool, 2)) << "no replacement worker";
    EXPECT_EQ(pool.map(&Square, Range(10), 1).size(), 10u);
  }
}

TEST_P(PoolTest, MaxTasksPerChildReplacesWorkers) {
  PoolOptions o = Opts(GetParam());
  o.maxtasksperchild = 2;
  Pool pool(o);
  const std::vector<int> pids = pool.map(&Pid, Range(20), 1);
  std::map<int, int> per_pid;
  for (int p : pids) ++per_pid[p];
  EXPECT_GE(per_pid.size(), 10u) << "each worker may run only 2 tasks";
  for (const auto& [pid, n] : per_pid) EXPECT_LE(n, 2) << "pid " << pid;
  ASSERT_TRUE(WaitForWorkers(pool, 2));
}

TEST_P(PoolTest, InitializerRunsOncePerWorker) {
  auto [reader, writer] = Pipe();
  PoolOptions o = Opts(GetParam());
  o.set_initializer(&InitWorker, writer, 42);
  std::set<int> task_pids;
  {
    Pool pool(o);
    for (const auto& [calls, value, pid] : pool.map(&InitState, Range(40), 1)) {
      EXPECT_EQ(calls, 1);
      EXPECT_EQ(value, 42);
      task_pids.insert(pid);
    }
    pool.close();
    ASSERT_TRUE(pool.join(30s));
  }
  std::set<int> init_pids;
  while (reader.poll(0.5)) init_pids.insert(reader.recv<int>());
  EXPECT_EQ(init_pids.size(), 2u) << "one initializer call per worker";
  for (int p : task_pids) EXPECT_EQ(init_pids.count(p), 1u) << p;
}

TEST_P(PoolTest, AFailingInitializerBreaksThePoolInsteadOfHanging) {
  PoolOptions o = Opts(GetParam());
  o.set_initializer(&FailingInit, 7);
  Pool pool(o);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    pool.apply_async(&Square, 2).get(30s);
    FAIL() << "the pool must be broken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("initializer"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("init failed with 7"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
}

TEST_P(PoolTest, CloseLetsQueuedWorkFinishThenJoin) {
  Pool pool(Opts(GetParam()));
  EXPECT_THROW(pool.join(1.0), Error);  // before close
  try {
    pool.join();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition);
  }
  auto r = pool.map_async(&SleepMs, std::vector<int>{50, 50, 50, 50}, 1);
  const std::vector<pid_t> pids = pool.pids();
  pool.close();
  try {
    pool.apply_async(&Square, 1);
    FAIL() << "submitting after close() must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition);
  }
  ASSERT_TRUE(pool.join(30s));
  EXPECT_TRUE(r.ready());
  EXPECT_EQ(r.get(), (std::vector<int>{50, 50, 50, 50}));
  EXPECT_TRUE(pool.pids().empty());
  for (pid_t p : pids) EXPECT_TRUE(ProcessGone(p)) << p;
  EXPECT_TRUE(pool.join(0.0));  // again
}

TEST_P(PoolTest, TerminateCancelsRunningAndQueuedTasks) {
  Pool pool(Opts(GetParam()));
  std::vector<AsyncResult<int>> rs;
  for (int i = 0; i < 5; ++i) rs.push_back(pool.apply_async(&SleepMs, 20000));
  EXPECT_FALSE(rs[0].wait(0.3));  // two are running, three queued
  const std::vector<pid_t> pids = pool.pids();
  const auto t0 = std::chrono::steady_clock::now();
  pool.terminate();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  for (auto& r : rs) {
    try {
      r.get(10s);
      FAIL() << "a terminated task must fail";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kCancelled) << e.what();
    }
  }
  EXPECT_TRUE(pool.join(10s));
  for (pid_t p : pids) EXPECT_TRUE(ProcessGone(p)) << p;
  EXPECT_THROW(pool.apply_async(&Square, 1), Error);
}

TEST_P(PoolTest, NoWorkerOutlivesThePool) {
  std::set<int> pids;
  {
    Pool pool(Opts(GetParam(), 3));
    for (pid_t p : pool.pids()) pids.insert(p);
    for (int p : pool.map(&Pid, Range(30), 1)) pids.insert(p);
    auto lost = pool.apply_async(&DieIf, 0, 0, kSigkill);  // one replaced worker too
    EXPECT_THROW(lost.get(30s), WorkerLostError);
    ASSERT_TRUE(WaitForWorkers(pool, 3));
    for (pid_t p : pool.pids()) pids.insert(p);
    pool.apply_async(&SleepMs, 20000);  // still running at destruction
  }
  EXPECT_GE(pids.size(), 4u);
  for (int p : pids) EXPECT_TRUE(ProcessGone(p)) << "worker " << p << " outlived its pool";
}

TEST_P(PoolTest, BadInputIsAClearError) {
  try {
    Pool p(Opts(GetParam(), -1));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("processes"), std::string::npos) << e.what();
  }
  PoolOptions o = Opts(GetParam());
  o.maxtasksperchild = -2;
  EXPECT_THROW(Pool{o}, Error);
  Pool pool(Opts(GetParam(), 1));
  try {
    pool.map(&Square, Range(3), -1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("chunksize"), std::string::npos) << e.what();
  }
  EXPECT_THROW(pool.imap(&Square, Range(3), -1), Error);
}

INSTANTIATE_TEST_SUITE_P(StartMethods, PoolTest, ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

TEST(PoolErrorsTest, UnknownStartMethod) {
  try {
    Pool p(Opts("threads"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("fork, spawn, forkserver"), std::string::npos);
  }
}

TEST(PoolErrorsTest, SpawnNeedsRegisteredFunctions) {
  for (const char* method : {"spawn", "forkserver"}) {
    SCOPED_TRACE(method);
    Pool pool(Opts(method, 1));
    try {
      pool.map(&NotRegistered, Range(3));
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotFound);
      EXPECT_NE(std::string(e.what()).find("FORKSAFE_ENTRY_POINT"), std::string::npos) << e.what();
    }
    try {
      pool.map([](int x) { return x; }, Range(3));
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("only with \"fork\""), std::string::npos) << e.what();
    }
    EXPECT_EQ(pool.map(&Square, Range(3)), (std::vector<int>{0, 1, 4}));  // still usable

    PoolOptions o = Opts(method, 1);
    o.initializer = [] {};
    try {
      Pool p(o);
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("set_initializer"), std::string::npos) << e.what();
    }
    PoolOptions u = Opts(method, 1);
    u.set_initializer(&NotRegisteredInit, 1);
    try {
      Pool p(u);
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotFound);
      EXPECT_NE(std::string(e.what()).find("FORKSAFE_ENTRY_POINT"), std::string::npos);
    }
  }
}

TEST(PoolForkTest, AnyCallableWorksWithFork) {
  int counter = 0;
  PoolOptions o = Opts("fork");
  o.initializer = [&counter] { counter += 7; };  // runs in each worker's copy
  Pool pool(o);
  EXPECT_EQ(pool.map(&NotRegistered, Range(4)), Range(4));  // plain pointers need no macro
  const int offset = 1000;
  EXPECT_EQ(pool.map([offset](int x) { return x + offset; }, std::vector<int>{1, 2}),
            (std::vector<int>{1001, 1002}));
  // A second callable, created after the workers: they are re-forked to carry it.
  std::vector<std::string> names = {"x", "y"};
  EXPECT_EQ(pool.map([&names](int i) { return names[i] + "!"; }, std::vector<int>{0, 1}),
            (std::vector<std::string>{"x!", "y!"}));
  EXPECT_EQ(pool.apply([&counter](int a) { return counter + a; }, 1), 8);
  std::function<int(int, int)> mul = [](int a, int b) { return a * b; };
  EXPECT_EQ(pool.starmap(mul, std::vector<std::tuple<int, int>>{{2, 3}, {4, 5}}),
            (std::vector<int>{6, 20}));
  std::vector<int> seen;
  for (int v : pool.imap_unordered([](int x) { return -x; }, Range(5), 2)) seen.push_back(v);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int>{-4, -3, -2, -1, 0}));
  EXPECT_EQ(counter, 0) << "the initializer ran in the parent";
}

TEST(PoolForkTest, AnInheritedPoolRefusesToWorkInAForkedChild) {
  Pool pool(Opts("fork", 1));
  auto r = forksafe::testing::RunInChild(
      [&] {
        try {
          pool.map(&Square, Range(3));
          return 1;
        } catch (const Error& e) {
          return e.code() == ErrorCode::kFailedPrecondition ? 0 : 2;
        }
      },
      20s);
  EXPECT_TRUE(r.ok()) << r.Describe();
  EXPECT_EQ(pool.map(&Square, Range(3)), (std::vector<int>{0, 1, 4}));
}

}  // namespace
}  // namespace forksafe::mp
