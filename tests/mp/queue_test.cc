// Queue, SimpleQueue and JoinableQueue: in one process and across processes (fork, spawn,
// forkserver), many producers and consumers, big items, descriptors, forwarding, killed peers,
// bad input.
#include "forksafe/mp/queue.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/queue_spin.h"
#include "forksafe/mp/process.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/resident_memory.h"

namespace forksafe::mp {
namespace {

using runtime::Error;
using runtime::ErrorCode;
using testing::RssShmemKb;
using namespace std::chrono_literals;

void Produce(Queue q, int producer, int n) {
  for (int i = 0; i < n; ++i) q.put(std::make_pair(producer, i));
}
FORKSAFE_ENTRY_POINT(Produce);

// Gets pairs until it sees the sentinel (-1, -1); reports what it got on `results`.
void Consume(Queue q, Queue results) {
  std::vector<std::pair<int, int>> got;
  for (;;) {
    auto item = q.get<std::pair<int, int>>(true, 60.0);
    if (item.first < 0) break;
    got.push_back(item);
  }
  results.put(got);
}
FORKSAFE_ENTRY_POINT(Consume);

void Forward(Queue in, Queue out) { out.put(in.get<std::string>(true, 30.0) + " (forwarded)"); }
FORKSAFE_ENTRY_POINT(Forward);

void UseReceivedConnection(Queue q) {
  Connection c = q.get<Connection>(true, 30.0);
  c.send(std::string("hello through a queued connection"));
}
FORKSAFE_ENTRY_POINT(UseReceivedConnection);

void PutAndExit(Queue q, std::string big) { q.put(big); }  // exits at once after put
FORKSAFE_ENTRY_POINT(PutAndExit);

void WorkAndMarkDone(JoinableQueue q, int n) {
  for (int i = 0; i < n; ++i) {
    q.get<int>(true, 30.0);
    q.task_done();
  }
}
FORKSAFE_ENTRY_POINT(WorkAndMarkDone);

TEST(QueueTest, SameProcessFifoAndSizes) {
  Queue q(3);
  EXPECT_TRUE(q.empty());
  q.put(std::string("a"));
  q.put(std::string("b"));
  q.put_nowait(std::string("c"));
  EXPECT_EQ(q.qsize(), 3);
  EXPECT_TRUE(q.full());
  EXPECT_THROW(q.put_nowait(std::string("d")), Full);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(q.put(std::string("d"), true, 0.05), Full);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 40ms);
  EXPECT_EQ(q.get<std::string>(), "a");
  EXPECT_EQ(q.get<std::string>(), "b");
  EXPECT_EQ(q.get_nowait<std::string>(), "c");
  EXPECT_THROW(q.get_nowait<std::string>(), Empty);
  EXPECT_THROW(q.get<std::string>(true, 0.02), Empty);
  EXPECT_EQ(q.maxsize(), 3);
}

// Empty and Full are waits that ran out, like every timeout of the library: kDeadlineExceeded
// (the rule in runtime/error.h), for the non-blocking calls and for an expired timeout alike.
TEST(QueueTest, EmptyAndFullAreDeadlineExceeded) {
  Queue q(1);
  q.put(1);
  auto code_of = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kInternal;  // nothing thrown
  };
  EXPECT_EQ(code_of([&] { q.put_nowait(2); }), ErrorCode::kDeadlineExceeded);
  EXPECT_EQ(code_of([&] { q.put(2, true, 0.01); }), ErrorCode::kDeadlineExceeded);
  EXPECT_EQ(q.get<int>(), 1);
  EXPECT_EQ(code_of([&] { q.get_nowait<int>(); }), ErrorCode::kDeadlineExceeded);
  EXPECT_EQ(code_of([&] { q.get<int>(true, 0.01); }), ErrorCode::kDeadlineExceeded);
  try {
    q.get_nowait<int>();
    ADD_FAILURE() << "get_nowait on an empty queue returned";
  } catch (const Empty& e) {
    EXPECT_EQ(std::string(e.what()).rfind("deadline_exceeded: ", 0), 0u) << e.what();
  }
}

TEST(QueueTest, ManyItemsInOneProcessBeyondTheRing) {
  // Far more bytes than the ring holds, put and gotten by two threads of one process.
  Queue q(QueueOptions{0, 64 * 1024});
  const int n = 20000;
  std::thread producer([&] {
    for (int i = 0; i < n; ++i) q.put(std::vector<int>(16, i));
  });
  for (int i = 0; i < n; ++i) {
    auto v = q.get<std::vector<int>>(true, 30.0);
    ASSERT_EQ(v.size(), 16u);
    ASSERT_EQ(v[0], i);
  }
  producer.join();
}

// Like Consume, but a getter left asleep with items in the queue (a lost doorbell ring) fails
// the child: its get() would return only when its 10 s timeout expires and it rechecks the
// queue, while the whole exchange takes ~0.1 s; any get() slower than 5 s exits with code 3.
void ConsumeImpatiently(Queue q, Queue results) {
  std::vector<std::pair<int, int>> got;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    auto item = q.get<std::pair<int, int>>(true, 10.0);
    if (std::chrono::steady_clock::now() - start > 5s) _exit(3);
    if (item.first < 0) break;
    got.push_back(item);
  }
  results.put(got);
}
FORKSAFE_ENTRY_POINT(ConsumeImpatiently);

// The largest string whose encoding fits in `limit` bytes.
size_t LargestStringWithin(size_t limit) {
  size_t n = limit;
  while (n > 0 && Encode(std::string(n, 'a')).bytes.size() > limit) --n;
  return n;
}

constexpr size_t kSmallItemLimit = 4096;

// Puts one item at the queue's item limit and one just over it; reports the second's error code
// (-1: it was accepted).
void PutAtAndOverTheLimit(Queue q, Queue report) {
  const size_t n = LargestStringWithin(kSmallItemLimit);
  q.put(std::string(n, 'a'));
  int code = -1;
  try {
    q.put(std::string(n + 1, 'b'));
  } catch (const Error& e) {
    code = static_cast<int>(e.code());
  }
  report.put(code);
}
FORKSAFE_ENTRY_POINT(PutAtAndOverTheLimit);

class QueueAcrossProcesses : public ::testing::TestWithParam<std::string> {
 protected:
  ProcessOptions Opt() { return ProcessOptions{"", false, GetParam()}; }
};

TEST_P(QueueAcrossProcesses, ManyProducersManyConsumersNoLossNoDuplicate) {
  Queue q(QueueOptions{0, 256 * 1024});
  Queue results;
  const int producers = 4, consumers = 3, per = 1500;
  std::vector<Process> ps;
  for (int c = 0; c < consumers; ++c) ps.emplace_back(Opt(), &Consume, q, results);
  for (int p = 0; p < producers; ++p) ps.emplace_back(Opt(), &Produce, q, p, per);
  for (Process& p : ps) p.start();
  for (int p = consumers; p < consumers + producers; ++p) ASSERT_TRUE(ps[p].join(60s));
  for (int c = 0; c < consumers; ++c) q.put(std::make_pair(-1, -1));
  std::set<std::pair<int, int>> all;
  size_t total = 0;
  for (int c = 0; c < consumers; ++c) {
    auto got = results.get<std::vector<std::pair<int, int>>>(true, 60.0);
    total += got.size();
    // Each producer's items reach any one consumer in the order they were put.
    std::vector<int> last(producers, -1);
    for (auto& [p, i] : got) {
      EXPECT_GT(i, last[p]);
      last[p] = i;
    }
    all.insert(got.begin(), got.end());
  }
  for (Process& p : ps) {
    ASSERT_TRUE(p.join(60s));
    EXPECT_EQ(p.exitcode(), 0);
  }
  EXPECT_EQ(total, size_t{producers * per}) << "lost or duplicated messages";
  EXPECT_EQ(all.size(), size_t{producers * per});
  EXPECT_TRUE(q.empty());
}

// Getters that find the queue empty sleep on the doorbell. Bursts of 1..7 items with pauses in
// between put every getter to sleep again and again; each burst must wake enough of them, and
// a getter that drained several rings must pass the baton to the others.
TEST_P(QueueAcrossProcesses, BurstsWakeEverySleepingGetter) {
  Queue q, results;
  const int consumers = 4, bursts = 60;
  std::vector<Process> ps;
  for (int c = 0; c < consumers; ++c) ps.emplace_back(Opt(), &ConsumeImpatiently, q, results);
  for (Process& p : ps) p.start();
  int n = 0;
  for (int b = 0; b < bursts; ++b) {
    for (int k = 0; k < 1 + b % 7; ++k) q.put(std::make_pair(0, n++));
    std::this_thread::sleep_for(std::chrono::microseconds(200 + 300 * (b % 5)));
  }
  for (int c = 0; c < consumers; ++c) q.put(std::make_pair(-1, -1));
  std::set<int> all;
  size_t total = 0;
  for (int c = 0; c < consumers; ++c) {
    auto got = results.get<std::vector<std::pair<int, int>>>(true, 20.0);
    total += got.size();
    for (auto& item : got) all.insert(item.second);
  }
  for (Process& p : ps) {
    ASSERT_TRUE(p.join(30s));
    EXPECT_EQ(p.exitcode(), 0) << "a getter slept through a put: a doorbell ring was lost";
  }
  EXPECT_EQ(total, static_cast<size_t>(n));
  EXPECT_EQ(all.size(), static_cast<size_t>(n));
}

TEST_P(QueueAcrossProcesses, BigItemsDescriptorsAndForwarding) {
  Queue in, out;
  // A big item (out of band) put by a child that exits right away: nothing is lost.
  std::string big(6 << 20, 'z');
  big[777] = 'q';
  Process putter(Opt(), &PutAndExit, in, big);
  putter.start();
  ASSERT_TRUE(putter.join(60s));
  EXPECT_EQ(putter.exitcode(), 0);
  EXPECT_EQ(in.get<std::string>(true, 10.0), big);
  // Forwarding a received value to another queue.
  in.put(std::string("payload"));
  Process fwd(Opt(), &Forward, in, out);
  fwd.start();
  EXPECT_EQ(out.get<std::string>(true, 30.0), "payload (forwarded)");
  ASSERT_TRUE(fwd.join(30s));
  // A Connection through a queue.
  auto [mine, theirs] = Pipe();
  in.put(theirs);
  theirs.close();
  Process user(Opt(), &UseReceivedConnection, in);
  user.start();
  ASSERT_TRUE(mine.poll(30s));
  EXPECT_EQ(mine.recv<std::string>(), "hello through a queued connection");
  ASSERT_TRUE(user.join(30s));
  EXPECT_EQ(user.exitcode(), 0);
}

TEST_P(QueueAcrossProcesses, JoinableQueueTaskDoneAndJoin) {
  JoinableQueue q;
  for (int i = 0; i < 50; ++i) q.put(i);
  EXPECT_FALSE(q.join(0.02)) << "nothing was processed yet";
  Process worker(Opt(), &WorkAndMarkDone, q, 50);
  worker.start();
  EXPECT_TRUE(q.join(30.0));
  ASSERT_TRUE(worker.join(30s));
  EXPECT_EQ(worker.exitcode(), 0);
  try {
    q.task_done();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition);
  }
}

// QueueOptions::max_item_bytes: the put-side limit (1 GiB by default) made small enough to test,
// applied by a child that received the queue (every start method); the over-limit put is refused
// whole and the queue goes on. Items over a quarter of the 4 KiB ring travel out of band.
TEST_P(QueueAcrossProcesses, TheItemLimitHoldsInEveryProcessAndARefusedPutLeavesNoTrace) {
  QueueOptions o;
  o.ring_bytes = 4096;
  o.max_item_bytes = kSmallItemLimit;
  Queue q(o);
  Queue report;
  Process p(Opt(), &PutAtAndOverTheLimit, q, report);
  p.start();
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
  EXPECT_EQ(report.get<int>(true, 10.0), static_cast<int>(ErrorCode::kInvalidArgument));
  EXPECT_EQ(q.get<std::string>(true, 10.0).size(), LargestStringWithin(kSmallItemLimit));
  EXPECT_TRUE(q.empty());
  try {
    q.put(std::string(kSmallItemLimit, 'c'));
    FAIL() << "an item over max_item_bytes was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("max_item_bytes"), std::string::npos) << e.what();
  }
  q.put(std::string("after"));
  EXPECT_EQ(q.get<std::string>(true, 10.0), "after");
}

TEST(QueueFaultTest, AnItemLimitOutsideOneByteToOneGiBIsRefused) {
  for (size_t bad : {size_t{0}, Queue::kMaxItemBytes + 1}) {
    QueueOptions o;
    o.max_item_bytes = bad;
    try {
      Queue q(o);
      FAIL() << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("max_item_bytes"), std::string::npos) << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(StartMethods, QueueAcrossProcesses,
                         ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

TEST(QueueFaultTest, AProducerKilledMidStreamDoesNotWedgeTheQueue) {
  Queue q(QueueOptions{0, 32 * 1024});
  for (int round = 0; round < 5; ++round) {
    Process p(ProcessOptions{"", false, "fork"}, [q]() mutable {
      for (int i = 0;; ++i) q.put(std::vector<int>(8, i), true, 10.0);
    });
    p.start();
    std::this_thread::sleep_for(5ms);
    p.kill();  // likely in the middle of a put, maybe holding the lock
    ASSERT_TRUE(p.join(10s));
    // Everything that was committed is intact and in order; the queue works on.
    int prev = -1;
    while (!q.empty()) {
      auto v = q.get<std::vector<int>>(true, 5.0);
      ASSERT_EQ(v.size(), 8u);
      ASSERT_EQ(v[0], prev + 1);
      prev = v[0];
    }
    q.put(std::vector<int>(8, -5), true, 5.0);
    EXPECT_EQ(q.get<std::vector<int>>(true, 5.0)[0], -5);
  }
}

// A getter killed while asleep leaves a stale sleeper count behind: every later put rings the
// doorbell for nobody. The queue must keep working, in this process and in others, and a
// sleeping getter must still be woken.
TEST(QueueFaultTest, AGetterKilledWhileAsleepLeavesTheQueueWorking) {
  Queue q, back;
  for (int round = 0; round < 3; ++round) {
    Process sleeper(ProcessOptions{"", false, "fork"}, [q]() mutable { q.get<int>(true, 30.0); });
    sleeper.start();
    std::this_thread::sleep_for(50ms);
    sleeper.kill();
    ASSERT_TRUE(sleeper.join(10s));
  }
  for (int i = 0; i < 3000; ++i) q.put(i);  // each rings for the dead sleepers; the pipe fills
  for (int i = 0; i < 3000; ++i) ASSERT_EQ(q.get<int>(true, 5.0), i);
  Process echo(ProcessOptions{"", false, "fork"}, [q, back]() mutable {
    for (int i = 0; i < 100; ++i) back.put(q.get<int>(true, 10.0));
  });
  echo.start();
  for (int i = 0; i < 100; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(i % 3 == 0 ? 500 : 0));
    q.put(i);
    ASSERT_EQ(back.get<int>(true, 10.0), i);
  }
  ASSERT_TRUE(echo.join(10s));
  EXPECT_EQ(echo.exitcode(), 0);
}

TEST(QueueFaultTest, BadInputAndClosedHandles) {
  EXPECT_THROW(Queue(QueueOptions{0, 100}), Error);
  Queue q;
  try {
    q.get<int>(true, -1.0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
  Queue copy = q;
  q.close();
  try {
    copy.put(1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kClosed);
  }
  Queue empty_handle(nullptr);
  EXPECT_THROW(empty_handle.put(1), Error);
  q.join_thread();
  q.cancel_join_thread();
}

// A large ring costs the memory of what it holds, not its size: it gives the pages of got
// messages back (mp/queue.cc, kReleaseFrom). 12 MiB of 1 KiB items go into a 32 MiB ring, and
// out again; then 40 MiB more pass through it one at a time (more than once round the ring).
TEST(QueueTest, ALargeRingGivesBackThePagesOfGotMessages) {
  QueueOptions o;
  o.ring_bytes = size_t{32} << 20;
  Queue q(o);
  const std::string item(1024, 'x');
  const long before = RssShmemKb();
  ASSERT_GE(before, 0) << "/proc/self/status has no RssShmem";
  for (int i = 0; i < 12 * 1024; ++i) q.put(item, true, 10.0);
  const long full = RssShmemKb();
  EXPECT_GE(full - before, 11 * 1024) << "12 MiB of items in the ring should be resident";
  for (int i = 0; i < 12 * 1024; ++i) ASSERT_EQ(q.get<std::string>(true, 10.0), item);
  const long drained = RssShmemKb();
  EXPECT_LE(drained - before, 3 * 1024) << "got messages' pages were not given back";
  for (int i = 0; i < 40 * 1024; ++i) {
    q.put(item, true, 10.0);
    ASSERT_EQ(q.get<std::string>(true, 10.0), item);
  }
  EXPECT_LE(RssShmemKb() - before, 3 * 1024) << "a ring that went round stays resident";
  EXPECT_TRUE(q.empty());
}

// A ring under 8 MiB (the default's 1 MiB) keeps its pages: nothing is given back, and each
// message moves without a page fault.
TEST(QueueTest, ASmallRingKeepsItsPages) {
  Queue q;
  const std::string item(1024, 'x');
  for (int i = 0; i < 2048; ++i) {  // twice round the 1 MiB ring
    q.put(item, true, 10.0);
    ASSERT_EQ(q.get<std::string>(true, 10.0), item);
  }
  const long warm = RssShmemKb();
  for (int i = 0; i < 2048; ++i) {
    q.put(item, true, 10.0);
    ASSERT_EQ(q.get<std::string>(true, 10.0), item);
  }
  EXPECT_LE(std::abs(RssShmemKb() - warm), 64) << "a small ring's pages came and went";
}

// Full says which limit was hit: maxsize (room by count) or the ring's bytes.
TEST(QueueTest, FullSaysWhichLimitWasHit) {
  Queue by_count(2);
  by_count.put(1);
  by_count.put(2);
  try {
    by_count.put_nowait(3);
    FAIL() << "a third item fit under maxsize 2";
  } catch (const Full& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("maxsize"), std::string::npos) << what;
    EXPECT_EQ(what.find("ring"), std::string::npos) << what;
  }
  Queue by_bytes(QueueOptions{0, 4096});  // items over 1 KiB go out of band: 900 bytes each stay
  const std::string item(900, 'x');
  int put = 0;
  try {
    for (; put < 100; ++put) by_bytes.put(item, true, 0.02);
    FAIL() << "100 items of 900 bytes fit in a 4 KiB ring";
  } catch (const Full& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("ring is full by bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("ring_bytes"), std::string::npos) << what;  // what to do
    EXPECT_EQ(what.find("maxsize ="), std::string::npos) << what;
  }
  EXPECT_GT(put, 0);
  for (int i = 0; i < put; ++i) EXPECT_EQ(by_bytes.get<std::string>(true, 5.0), item);
}

// Consecutive messages carrying one file opened with different access modes are different
// descriptors: the second must not share the first's batch (it would arrive read-only).
TEST(QueueTest, DescriptorsOfOneFileWithOtherAccessModesAreNotShared) {
  const int rw = memfd_create("queue-test-accmode", MFD_CLOEXEC);
  ASSERT_GE(rw, 0);
  ASSERT_EQ(ftruncate(rw, 4096), 0);
  const int ro = open(("/proc/self/fd/" + std::to_string(rw)).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(ro, 0);
  Queue q;
  for (int fd : {ro, rw, ro}) {
    Message m;
    m.bytes = "x";
    m.fds.push_back(FileDescriptor::Borrow(fd));  // borrowed, as a shared segment's are
    q.PutMessage(std::move(m));
  }
  for (int want : {O_RDONLY, O_RDWR, O_RDONLY}) {
    Message m = q.GetMessage(true, 5.0);
    ASSERT_EQ(m.fds.size(), 1u);
    EXPECT_EQ(fcntl(m.fds[0].get(), F_GETFL) & O_ACCMODE, want);
  }
  close(ro);
  close(rw);
}

TEST(QueueTest, SimpleQueue) {
  SimpleQueue q;
  EXPECT_TRUE(q.empty());
  q.put(std::string("x"));
  EXPECT_FALSE(q.empty());
  EXPECT_EQ(q.get<std::string>(), "x");
}

TEST(QueueTest, PollWaitsForAMessageAndTakesNothing) {
  Queue q;
  EXPECT_FALSE(q.poll());
  EXPECT_FALSE(q.poll(0.05));
  for (double bad : {-1.0, std::nan("")}) {
    try {
      q.poll(bad);
      ADD_FAILURE() << "poll(" << bad << ") did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("Queue::poll: timeout must be"), std::string::npos)
          << e.what();
    }
  }
  std::thread putter([&] {
    std::this_thread::sleep_for(50ms);
    q.put(7);
  });
  EXPECT_TRUE(q.poll(30.0));
  putter.join();
  EXPECT_EQ(q.qsize(), 1);
  EXPECT_TRUE(q.poll());
  EXPECT_EQ(q.get<int>(false), 7);
  EXPECT_FALSE(q.poll(0.02));
  q.close();
  EXPECT_THROW(q.poll(), Error);
}

// A poller asleep beside a getter drains the doorbell's ring without taking the message: it must
// pass the ring on, or the getter sleeps through the put (until its timeout).
TEST(QueueTest, APollerDoesNotStrandASleepingGetter) {
  Queue q;
  for (int i = 0; i < 30; ++i) {
    bool polled = false;
    int got = -1;
    std::thread poller([&] { polled = q.poll(30.0); });
    std::thread getter([&] {
      try {
        got = q.get<int>(true, 30.0);
      } catch (const Error&) {  // Empty: slept through the put (checked below)
      }
    });
    std::this_thread::sleep_for(2ms);  // both asleep, mostly
    const auto start = std::chrono::steady_clock::now();
    q.put(i);
    getter.join();
    EXPECT_EQ(got, i);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "the getter slept through a put";
    q.put(-1);  // ends the poller if the getter took i before it looked
    poller.join();
    EXPECT_TRUE(polled);
    EXPECT_EQ(q.get<int>(false), -1);
  }
}

// ---- The getter's adaptive spin (mp/internal/queue_spin.h) ---------------------------------

using internal::GetterSpin;
using Micros = std::chrono::microseconds;

// CPU time (user + system) this thread has used so far.
std::chrono::microseconds ThreadCpu() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return std::chrono::seconds(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         Micros(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

// Makes `q`'s getters in this process expect an item `wait` after they start waiting.
void Train(const Queue& q, Micros wait) {
  for (int i = 0; i < 20; ++i) internal::GetterSpinOf(q).Record(wait);
}

TEST(QueueSpinTest, TheRuleStaysWithinItsBoundsLearnsShortWaitsAndFallsBackWhenIdle) {
  GetterSpin spin;
  EXPECT_EQ(spin.Next().spin, GetterSpin::kMin) << "before any wait: the old fixed 50 us";
  EXPECT_EQ(spin.Next().nap, GetterSpin::Duration::zero());
  // Any sequence of waits, however odd (zero, negative from a clock step, hours): in bounds.
  uint64_t x = 12345;
  for (int i = 0; i < 20000; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const int64_t us = static_cast<int64_t>((x >> 33) % (i % 2 == 0 ? 3000 : 30000)) - 100;
    spin.Record(i % 997 == 0 ? std::chrono::hours(5) : Micros(us));
    const GetterSpin::Wait w = spin.Next();
    ASSERT_GE(w.spin, GetterSpin::kMin);
    ASSERT_LE(w.spin, GetterSpin::kMax);
    ASSERT_GE(w.nap, GetterSpin::Duration::zero());
    ASSERT_LT(w.nap, GetterSpin::kPredictMax);
    if (w.nap > GetterSpin::Duration::zero()) ASSERT_EQ(w.spin, GetterSpin::kMin);
  }
  // Items that come ~100 us after the get starts waiting: spin about twice that, no nap.
  for (int i = 0; i < 20; ++i) spin.Record(Micros(100));
  EXPECT_GE(spin.Next().spin, Micros(190));
  EXPECT_LE(spin.Next().spin, Micros(210));
  EXPECT_EQ(spin.Next().nap, GetterSpin::Duration::zero());
  // ~300 us: the spin is capped.
  for (int i = 0; i < 20; ++i) spin.Record(Micros(300));
  EXPECT_EQ(spin.Next().spin, GetterSpin::kMax);
  // One long wait: the next spin is the floor at once.
  spin.Record(std::chrono::milliseconds(5));
  EXPECT_EQ(spin.Next().spin, GetterSpin::kMin);
  // Items that come regularly later than any spin would wait (spins that keep ending in sleeps):
  // the floor, not the cap, and a nap that ends kMax / 2 before the item is expected.
  for (int i = 0; i < 20; ++i) spin.Record(Micros(1000));
  EXPECT_EQ(spin.Next().spin, GetterSpin::kMin);
  EXPECT_GE(spin.Next().nap, Micros(790));
  EXPECT_LE(spin.Next().nap, Micros(810));
  // One idle wait (longer than kPredictMax): the floor and no timer, whatever came before.
  spin.Record(std::chrono::milliseconds(30));
  EXPECT_EQ(spin.Next().spin, GetterSpin::kMin);
  EXPECT_EQ(spin.Next().nap, GetterSpin::Duration::zero());
  // Quick items bring the spin back.
  for (int i = 0; i < 10; ++i) spin.Record(Micros(150));
  EXPECT_GT(spin.Next().spin, GetterSpin::kMin);
  EXPECT_EQ(spin.Next().nap, GetterSpin::Duration::zero());
}

// A getter that waits long on an empty queue sleeps: it does not spin for the whole wait, even
// when its recent items came quickly enough to make its spin the longest, or regularly enough to
// make it nap until the next one is expected. The wait still ends
// on the put that comes, and its timeout is honoured.
TEST(QueueSpinTest, AnIdleGetterSleepsAndStillWakesOnAPutAndAtItsTimeout) {
  Queue q;
  // Trained to spin the longest, and trained to nap until an item expected after 5 ms.
  for (auto [trained, item_comes] :
       {std::pair{Micros(300), false}, std::pair{Micros(300), true}, std::pair{Micros(5000), false},
        std::pair{Micros(5000), true}}) {
    Train(q, trained);
    ASSERT_EQ(internal::GetterSpinOf(q).Next().spin,
              trained < GetterSpin::kMax ? GetterSpin::kMax : GetterSpin::kMin);
    std::thread putter;
    if (item_comes) {
      putter = std::thread([q]() mutable {
        std::this_thread::sleep_for(200ms);
        q.put(42);
      });
    }
    const auto cpu0 = ThreadCpu();
    const auto t0 = std::chrono::steady_clock::now();
    if (item_comes) {
      EXPECT_EQ(q.get<int>(true, 30.0), 42);
    } else {
      EXPECT_THROW(q.get<int>(true, 0.2), Empty);
    }
    const auto wall = std::chrono::steady_clock::now() - t0;
    const auto cpu = ThreadCpu() - cpu0;
    if (putter.joinable()) putter.join();
    EXPECT_GE(wall, 190ms);
    EXPECT_LT(cpu, wall * 3 / 10) << "the getter spun instead of sleeping: " << cpu.count()
                                  << " us of CPU in "
                                  << std::chrono::duration_cast<Micros>(wall).count() << " us";
    EXPECT_EQ(internal::GetterSpinOf(q).Next().spin, GetterSpin::kMin)
        << "after a long wait the next spin is short";
    EXPECT_EQ(internal::GetterSpinOf(q).Next().nap, GetterSpin::Duration::zero());
  }
  // A timeout shorter than the spin is honoured: the spin stops at the deadline.
  Train(q, Micros(300));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(q.get<int>(true, 0.0001), Empty);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, Micros(100));
  EXPECT_THROW(q.get_nowait<int>(), Empty);
}

// Echoes each int back with the next wait its gets had learned (spin and nap, in ns), until it
// gets -1.
void EchoWithSpin(Queue in, Queue out) {
  for (;;) {
    const int v = in.get<int>(true, 30.0);
    if (v < 0) return;
    const GetterSpin::Wait w = internal::GetterSpinOf(in).Next();
    out.put(std::make_tuple(v, static_cast<int64_t>(w.spin.count()),
                            static_cast<int64_t>(w.nap.count())));
  }
}
FORKSAFE_ENTRY_POINT(EchoWithSpin);

// Across processes, with items paced from back to back to idle: every item arrives, the other
// process's spin stays within its bounds, and after an idle gap it is short.
TEST(QueueSpinTest, PacedItemsAcrossProcessesAllArriveAndTheSpinStaysInBounds) {
  Queue to, from;
  Process echo(ProcessOptions{"", false, "fork"}, &EchoWithSpin, to, from);
  echo.start();
  const Micros gaps[] = {Micros(0),   Micros(80),   Micros(150),
                         Micros(300), Micros(1000), Micros(30000)};
  int n = 0;
  for (int round = 0; round < 3; ++round) {
    for (Micros gap : gaps) {
      for (int k = 0; k < 5; ++k, ++n) {
        std::this_thread::sleep_for(gap);
        to.put(n);
        auto [v, spin_ns, nap_ns] = from.get<std::tuple<int, int64_t, int64_t>>(true, 30.0);
        ASSERT_EQ(v, n);
        ASSERT_GE(spin_ns, GetterSpin::kMin.count());
        ASSERT_LE(spin_ns, GetterSpin::kMax.count());
        ASSERT_GE(nap_ns, 0);
        ASSERT_LT(nap_ns, GetterSpin::kPredictMax.count());
        if (gap >= Micros(30000)) {
          EXPECT_EQ(spin_ns, GetterSpin::kMin.count()) << "an idle getter's spin stayed long";
          EXPECT_EQ(nap_ns, 0) << "an idle getter sets a timer";
        }
      }
    }
  }
  to.put(-1);
  ASSERT_TRUE(echo.join(30s));
  EXPECT_EQ(echo.exitcode(), 0);
}

// A putter that dies in the middle of a paced stream leaves a getter that had learned a long
// spin waiting: its get ends at its timeout, the spin falls back, and the queue works on.
TEST(QueueSpinTest, APutterKilledMidStreamLeavesTheGetterSleepingNotSpinning) {
  Queue q;
  Process putter(ProcessOptions{"", false, "fork"}, [q]() mutable {
    for (int i = 0;; ++i) {
      q.put(i, true, 10.0);
      std::this_thread::sleep_for(Micros(150));
    }
  });
  putter.start();
  for (int i = 0; i < 50; ++i) ASSERT_EQ(q.get<int>(true, 30.0), i);
  putter.kill();
  ASSERT_TRUE(putter.join(10s));
  while (!q.empty()) q.get<int>(true, 5.0);
  const auto cpu0 = ThreadCpu();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(q.get<int>(true, 0.2), Empty);
  EXPECT_LT(ThreadCpu() - cpu0, (std::chrono::steady_clock::now() - t0) * 3 / 10);
  EXPECT_EQ(internal::GetterSpinOf(q).Next().spin, GetterSpin::kMin);
  q.put(7);
  EXPECT_EQ(q.get<int>(true, 5.0), 7);
}

}  // namespace
}  // namespace forksafe::mp
