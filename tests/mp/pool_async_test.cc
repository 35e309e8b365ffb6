// Pool's asynchronous faces, with the three start methods: callbacks of map_async /
// starmap_async / apply_async (the thread they run on, exactly-once, before get() returns, a
// callback that throws, terminate), imap / imap_unordered over a generator or an iterator range
// read lazily (bounded read-ahead, a failing input, a failing chunk, close() and a destroyed pool
// in the middle), what a forked worker must not inherit (other workers' channels, results not
// collected yet), and a worker that receives a malformed task message.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <iterator>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/pool_messages.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"

namespace forksafe::mp {
namespace internal {
// The workers' entry point (mp/pool.cc), driven by hand in MalformedTaskMessage below.
void ForksafePoolWorkerMain(Connection conn, int32_t maxtasks, std::string init_entry);
}  // namespace internal

namespace {

using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;

int Square(int x) { return x * x; }
FORKSAFE_ENTRY_POINT(Square);

int Add(int a, int b) { return a + b; }
FORKSAFE_ENTRY_POINT(Add);

int SleepMs(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
FORKSAFE_ENTRY_POINT(SleepMs);

int ThrowOn5(int x) {
  if (x == 5) throw std::invalid_argument("bad value 5");
  return x * 10;
}
FORKSAFE_ENTRY_POINT(ThrowOn5);

int KillSelf(int) {
  raise(SIGKILL);
  return 0;
}
FORKSAFE_ENTRY_POINT(KillSelf);

// The sockets ("socket:[inode]") among this process's open descriptors.
std::set<std::string> SocketTargets() {
  std::set<std::string> out;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    char buf[128];
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = readlink(link.c_str(), buf, sizeof(buf) - 1);
    if (n <= 0) continue;
    buf[n] = '\0';
    if (std::string(buf).rfind("socket:", 0) == 0) out.insert(buf);
  }
  closedir(d);
  return out;
}

std::vector<std::string> WorkerSockets(int) {
  std::set<std::string> s = SocketTargets();
  return std::vector<std::string>(s.begin(), s.end());
}
FORKSAFE_ENTRY_POINT(WorkerSockets);

// Returns one end of a fresh channel holding `x`.
Connection MakeMailbox(int x) {
  auto [a, b] = Pipe();
  a.send(x);
  return b;
}
FORKSAFE_ENTRY_POINT(MakeMailbox);

PoolOptions Opts(const std::string& method, int processes = 2) {
  PoolOptions o;
  o.processes = processes;
  o.start_method = method;
  return o;
}

std::vector<int> Range(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

// Waits (bounded) until pred() holds.
template <class P>
bool Eventually(P pred, std::chrono::seconds limit = 20s) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < limit) {
    if (pred()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return pred();
}

// What a callback saw, filled on the pool's callback thread.
struct Seen {
  std::mutex mu;
  int results = 0;
  int errors = 0;
  std::vector<int> value;
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  std::thread::id thread;
};

class PoolAsyncTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PoolAsyncTest, MapAsyncCallbackGetsTheWholeResultOnAPoolThreadBeforeGetReturns) {
  Pool pool(Opts(GetParam()));
  Seen seen;
  auto r = pool.map_async(
      &Square, Range(20), 3,
      Callbacks{[&](const std::vector<int>& v) {
                  std::this_thread::sleep_for(100ms);  // get() must still see the callback done
                  std::lock_guard<std::mutex> lk(seen.mu);
                  ++seen.results;
                  seen.value = v;
                  seen.thread = std::this_thread::get_id();
                },
                [&](const Error&) {
                  std::lock_guard<std::mutex> lk(seen.mu);
                  ++seen.errors;
                }});
  const std::vector<int> got = r.get(30s);
  std::lock_guard<std::mutex> lk(seen.mu);
  EXPECT_EQ(seen.results, 1);
  EXPECT_EQ(seen.errors, 0);
  EXPECT_EQ(seen.value, got);
  ASSERT_EQ(got.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(got[i], i * i);
  EXPECT_NE(seen.thread, std::this_thread::get_id());
  EXPECT_EQ(pool.callback_failures(), 0u);
}

TEST_P(PoolAsyncTest, ErrorCallbackGetsTheFailureAndTheResultCallbackDoesNotRun) {
  Pool pool(Opts(GetParam()));
  Seen seen;
  auto r = pool.map_async(&ThrowOn5, Range(10), 1,
                          Callbacks{[&](const std::vector<int>&) {
                                      std::lock_guard<std::mutex> lk(seen.mu);
                                      ++seen.results;
                                    },
                                    [&](const Error& e) {
                                      std::lock_guard<std::mutex> lk(seen.mu);
                                      ++seen.errors;
                                      seen.code = e.code();
                                      seen.message = e.what();
                                    }});
  EXPECT_THROW(r.get(30s), RemoteError);
  std::lock_guard<std::mutex> lk(seen.mu);
  EXPECT_EQ(seen.results, 0);
  EXPECT_EQ(seen.errors, 1);
  EXPECT_EQ(seen.code, ErrorCode::kProcessFailed);
  EXPECT_NE(seen.message.find("bad value 5"), std::string::npos) << seen.message;
}

TEST_P(PoolAsyncTest, ApplyAndStarmapTakeCallbacksAsTheirLastArgument) {
  Pool pool(Opts(GetParam()));
  std::atomic<int> sum{-1};
  auto a = pool.apply_async(&Add, 2, 3, Callbacks{[&](const int& v) { sum = v; }});
  EXPECT_EQ(a.get(30s), 5);
  EXPECT_EQ(sum.load(), 5);

  std::vector<int> star;
  std::vector<std::tuple<int, int>> pairs{{1, 2}, {3, 4}, {5, 6}};
  auto s = pool.starmap_async(&Add, pairs, Callbacks{[&](const std::vector<int>& v) { star = v; }});
  EXPECT_EQ(s.get(30s), (std::vector<int>{3, 7, 11}));
  EXPECT_EQ(star, (std::vector<int>{3, 7, 11}));

  // on_error may take the std::exception_ptr: a lost worker's WorkerLostError arrives whole.
  std::exception_ptr lost;
  auto k =
      pool.apply_async(&KillSelf, 0, Callbacks{nullptr, [&](std::exception_ptr e) { lost = e; }});
  EXPECT_THROW(k.get(30s), WorkerLostError);
  ASSERT_TRUE(lost);
  try {
    std::rethrow_exception(lost);
  } catch (const WorkerLostError& e) {
    EXPECT_EQ(e.signal_name().rfind("SIGKILL", 0), 0u) << e.what();
  }
}

TEST_P(PoolAsyncTest, ACallbackThatThrowsIsCountedAndThePoolGoesOn) {
  Pool pool(Opts(GetParam()));
  ::testing::internal::CaptureStderr();
  auto r = pool.apply_async(
      &Square, 4, Callbacks{[](const int&) { throw std::runtime_error("callback exploded"); }});
  EXPECT_EQ(r.get(30s), 16);  // the call itself succeeded
  EXPECT_TRUE(Eventually([&] { return pool.callback_failures() == 1; }));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("callback exploded"), std::string::npos) << err;
  // The callback thread and the dispatcher survive: later calls and callbacks run.
  std::atomic<int> later{0};
  auto again = pool.map_async(&Square, Range(5), Callbacks{[&](const std::vector<int>& v) {
    later = static_cast<int>(v.size());
  }});
  EXPECT_EQ(again.get(30s), (std::vector<int>{0, 1, 4, 9, 16}));
  EXPECT_EQ(later.load(), 5);
  EXPECT_EQ(pool.callback_failures(), 1u);
}

TEST_P(PoolAsyncTest, EveryCallbackRunsExactlyOnceEvenWhenNobodyKeepsTheResult) {
  Pool pool(Opts(GetParam()));
  std::atomic<int> calls{0};
  for (int i = 0; i < 30; ++i) {
    pool.apply_async(&Square, i, Callbacks{[&](const int&) { ++calls; }});  // dropped at once
  }
  auto empty = pool.map_async(&Square, std::vector<int>{},
                              Callbacks{[&](const std::vector<int>& v) { calls += v.empty(); }});
  EXPECT_TRUE(empty.get(30s).empty());
  EXPECT_TRUE(Eventually([&] { return calls.load() == 31; })) << calls.load();
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(calls.load(), 31);
}

TEST_P(PoolAsyncTest, TerminateRunsTheErrorCallbacksWithCancelledBeforeItReturns) {
  Pool pool(Opts(GetParam()));
  std::atomic<int> cancelled{0};
  std::atomic<int> other{0};
  std::vector<AsyncResult<int>> rs;
  for (int i = 0; i < 4; ++i) {
    rs.push_back(pool.apply_async(
        &SleepMs, 20000,
        Callbacks{
            [&](const int&) { ++other; },
            [&](const Error& e) { (e.code() == ErrorCode::kCancelled ? cancelled : other)++; }}));
  }
  EXPECT_FALSE(rs[0].wait(0.2));
  pool.terminate();
  EXPECT_EQ(cancelled.load(), 4);
  EXPECT_EQ(other.load(), 0);
  for (auto& r : rs) EXPECT_THROW(r.get(1s), Error);
}

TEST_P(PoolAsyncTest, ACallbackMaySubmitWorkAndWaitForItsOwnResult) {
  Pool pool(Opts(GetParam()));
  auto own = std::make_shared<AsyncResult<int>>();
  std::atomic<int> inner{-1};
  std::atomic<int> own_value{-1};
  std::mutex mu;
  std::unique_lock<std::mutex> hold(mu);  // the callback waits until `own` is assigned
  *own = pool.apply_async(&Square, 3, Callbacks{[&, own](const int&) {
    std::lock_guard<std::mutex> lk(mu);
    own_value = own->get(10s);       // its own result: no wait for itself
    inner = pool.apply(&Square, 5);  // more work, from the callback thread
  }});
  hold.unlock();
  EXPECT_EQ(own->get(30s), 9);
  EXPECT_EQ(own_value.load(), 9);
  EXPECT_EQ(inner.load(), 25);
}

// ---- lazy imap ----

TEST_P(PoolAsyncTest, ImapOverAnEndlessGeneratorReadsOnlyAWindowAhead) {
  Pool pool(Opts(GetParam()));
  auto pulled = std::make_shared<std::atomic<int>>(0);
  auto it = pool.imap(
      &Square,
      [pulled, i = 0]() mutable -> std::optional<int> {
        ++*pulled;
        return i++;
      },
      2);
  const size_t window = it.window();
  EXPECT_EQ(window, 4u);  // 2 x processes chunks
  for (int k = 0; k < 300; ++k) {
    std::optional<int> v = it.next(30s);
    ASSERT_TRUE(v) << k;
    ASSERT_EQ(*v, k * k);
    // Never more than the consumed items, the window and one chunk being read.
    ASSERT_LE(pulled->load(), k + 1 + static_cast<int>(window + 1) * 2) << k;
  }
  it = pool.imap(&Square, Range(3));  // drops the endless one
  EXPECT_EQ(*it.next(30s), 0);
  const int after = pulled->load();
  EXPECT_EQ(pool.map(&Square, Range(4)), (std::vector<int>{0, 1, 4, 9}));
  EXPECT_EQ(pulled->load(), after) << "a dropped imap's input is not read any more";
}

TEST_P(PoolAsyncTest, ImapUnorderedOverAGeneratorYieldsEveryResultOnce) {
  Pool pool(Opts(GetParam(), 3));
  std::multiset<int> got;
  int n = 0;
  for (int v : pool.imap_unordered(
           &Square,
           [&n]() -> std::optional<int> {
             if (n == 250) return std::nullopt;
             return n++;
           },
           4)) {
    got.insert(v);
  }
  std::multiset<int> want;
  for (int i = 0; i < 250; ++i) want.insert(i * i);
  EXPECT_EQ(got, want);
}

TEST_P(PoolAsyncTest, ImapOverAnInputIteratorRange) {
  Pool pool(Opts(GetParam()));
  std::istringstream in("1 2 3 4 5 6 7 8 9 10 11");
  std::vector<int> got;
  for (int v :
       pool.imap(&Square, std::istream_iterator<int>(in), std::istream_iterator<int>(), 3)) {
    got.push_back(v);
  }
  EXPECT_EQ(got, (std::vector<int>{1, 4, 9, 16, 25, 36, 49, 64, 81, 100, 121}));
}

TEST_P(PoolAsyncTest, AnInputThatThrowsEndsTheIterationWithItsError) {
  Pool pool(Opts(GetParam()));
  int n = 0;
  // Chunks of 3: the error comes in the middle of the third chunk, whose first input still runs.
  auto it = pool.imap(
      &Square,
      [&n]() -> std::optional<int> {
        if (n == 7) throw std::out_of_range("input broke at 7");
        return n++;
      },
      3);
  std::vector<int> got;
  try {
    for (int i = 0; i < 20; ++i) {
      std::optional<int> v = it.next(30s);
      ASSERT_TRUE(v) << "the input's error must come before the end";
      got.push_back(*v);
    }
    FAIL() << "the input's error was not raised";
  } catch (const std::out_of_range& e) {
    EXPECT_STREQ(e.what(), "input broke at 7");
  }
  EXPECT_EQ(got, (std::vector<int>{0, 1, 4, 9, 16, 25, 36}));
  EXPECT_FALSE(it.next(5s));
}

TEST_P(PoolAsyncTest, AFailingChunkOfALazyImapRaisesInItsPlace) {
  Pool pool(Opts(GetParam()));
  int n = 0;
  auto it = pool.imap(&ThrowOn5, [&n]() -> std::optional<int> {
    if (n == 9) return std::nullopt;
    return n++;
  });
  std::vector<int> got;
  int failures = 0;
  for (int i = 0; i < 20; ++i) {
    try {
      std::optional<int> v = it.next(30s);
      if (!v) break;
      got.push_back(*v);
    } catch (const RemoteError& e) {
      ++failures;
      EXPECT_NE(std::string(e.what()).find("bad value 5"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(failures, 1);
  EXPECT_EQ(got, (std::vector<int>{0, 10, 20, 30, 40, 60, 70, 80}));
}

TEST_P(PoolAsyncTest, CloseStopsALazyImapWithAClearErrorAndJoinEnds) {
  Pool pool(Opts(GetParam()));
  auto it = pool.imap(&Square, [i = 0]() mutable -> std::optional<int> { return i++; });
  for (int k = 0; k < 5; ++k) ASSERT_EQ(*it.next(30s), k * k);
  pool.close();
  EXPECT_TRUE(pool.join(30s));
  std::string error;
  int yielded = 0;
  for (int k = 0; k < 100 && error.empty(); ++k) {
    try {
      if (!it.next(30s)) break;
      ++yielded;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition);
      error = e.what();
    }
  }
  EXPECT_LE(yielded, 10);  // what was submitted before close() still ran
  EXPECT_NE(error.find("close() was called"), std::string::npos) << error;
  EXPECT_FALSE(it.next(1s));
}

TEST_P(PoolAsyncTest, ALazyImapThatOutlivesItsPoolEndsCleanly) {
  std::optional<ResultIterator<int>> it;
  {
    Pool pool(Opts(GetParam()));
    it.emplace(pool.imap(&SleepMs,
                         [i = 0]() mutable -> std::optional<int> { return i++ == 0 ? 1 : 20000; }));
    EXPECT_EQ(*it->next(30s), 1);
  }
  int errors = 0;
  bool ended = false;
  for (int k = 0; k < 50 && !ended; ++k) {
    try {
      ended = !it->next(5s).has_value();
    } catch (const Error& e) {  // kCancelled for what was running, then the stop
      EXPECT_TRUE(e.code() == ErrorCode::kCancelled || e.code() == ErrorCode::kFailedPrecondition)
          << e.what();
      ++errors;
    }
  }
  EXPECT_TRUE(ended);
  EXPECT_GE(errors, 1);
}

INSTANTIATE_TEST_SUITE_P(StartMethods, PoolAsyncTest,
                         ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

// Workers forked while a result's Connection waits in the pool, and while other workers run, hold
// neither: each is a socket a worker would keep open (its peer never reading end-of-file).
TEST(PoolForkInheritanceTest, AForkedWorkerHoldsNoOtherWorkersChannelNorAnUncollectedResult) {
  const std::set<std::string> before = SocketTargets();
  PoolOptions o = Opts("fork", 2);
  o.maxtasksperchild = 1;  // every task retires its worker: each next task runs in a new fork
  Pool pool(o);
  const std::vector<pid_t> first = pool.pids();
  ASSERT_EQ(first.size(), 2u);
  auto mailbox = pool.apply_async(&MakeMailbox, 7);
  ASSERT_TRUE(mailbox.wait(30s));  // its Connection waits in the pool, not collected
  // The parent's view is taken once the retired worker's replacement is running: while the pool
  // forks one, this process briefly holds that worker's own ends too, which it rightly keeps.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  for (std::vector<pid_t> now = first; now == first || now.size() != 2; now = pool.pids()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the retired worker was not replaced";
    std::this_thread::sleep_for(5ms);
  }
  const std::set<std::string> during = SocketTargets();
  std::vector<std::vector<std::string>> seen = pool.map(&WorkerSockets, Range(6), 1);
  Connection c = mailbox.get(10s);
  EXPECT_EQ(c.recv<int>(), 7);
  std::set<std::string> pools;  // the pool's channels and the mailbox, in this process
  for (const std::string& t : during) {
    if (!before.count(t)) pools.insert(t);
  }
  ASSERT_FALSE(pools.empty());
  for (const std::vector<std::string>& worker : seen) {
    for (const std::string& t : worker) EXPECT_EQ(pools.count(t), 0u) << t;
  }
}

// A worker that receives bytes that are no task message says so on its channel and leaves
// cleanly (it used to leave by an uncaught throw); the pool fails the chunk it held with that word.
TEST(PoolWorkerTest, AMalformedTaskMessageIsReportedAndTheWorkerLeavesCleanly) {
  auto [parent_end, child_end] = Pipe(true);
  Process worker(ProcessOptions{"malformed-task-worker", true, "fork"},
                 &internal::ForksafePoolWorkerMain, child_end, int32_t{0}, std::string());
  worker.start();
  child_end.close();
  internal::PoolReply ready = internal::DecodePoolReply(parent_end.RecvMessage(30s));
  EXPECT_EQ(ready.kind, "ready");
  parent_end.send_bytes("this is not a task message");
  internal::PoolReply said = internal::DecodePoolReply(parent_end.RecvMessage(30s));
  EXPECT_EQ(said.kind, "malformed");
  const ChildFailure f = DecodeAs<ChildFailure>(said.payload);
  EXPECT_NE(f.message.find("malformed task message"), std::string::npos) << f.message;
  ASSERT_TRUE(worker.join(30s));
  EXPECT_EQ(worker.exitcode(), 0);
  EXPECT_FALSE(worker.failure().has_value()) << "it left by design, not by an uncaught throw";
}

}  // namespace
}  // namespace forksafe::mp
