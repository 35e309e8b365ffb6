// Bad input to mp/ (docs/reliability.md, "Bad input"): sizes are overflow-checked and bounded by
// what the system can give before memory is committed; timeouts follow mp/timeout.h (NaN and
// negative: kInvalidArgument; +infinity: forever). Each row asserts the documented code and that
// the message names what was wrong. Absurd sizes run in a memory-bounded child.
//
// This file also includes mp/shared_value.h and mp/internal/shared_arena.h in one translation
// unit: they used to define two different mp::internal::SharedBlock classes (issue 12).
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/shared_arena.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/shared_value.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/mp/spawn.h"
#include "forksafe/mp/synchronize.h"
#include "forksafe/mp/timeout.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/resources.h"
#include "gtest/gtest.h"
#include "tests/support/bad_call.h"

namespace forksafe::mp {

// An entry point that takes an Array: decoding needs Array() (the guide's example did not
// compile without it).
void NegateAll(Array<double> a, Value<int> calls) {
  for (double& x : a) x = -x;
  calls.update([](int& v) { ++v; });
}
FORKSAFE_ENTRY_POINT(NegateAll);

void RankNoop(int rank, int unused) {}
FORKSAFE_ENTRY_POINT(RankNoop);

namespace {

using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;

constexpr size_t kMax = std::numeric_limits<size_t>::max();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

using forksafe::testing::BadCall;

std::string CheckRows(const std::vector<BadCall>& rows, bool bounded) {
  return forksafe::testing::CheckBadCalls(rows, bounded);
}

TEST(OneDefinitionPerName, ValueBlockAndTheArenaBlockLiveTogether) {
  // Both classes in one translation unit, each used: a second definition of one name would not
  // compile here, and an unoptimized build would link the wrong inline data().
  Array<int> a(std::vector<int>{1, 2, 3});
  auto block = internal::SharedArena::Get().Allocate(64, internal::SegmentKind::kMemfd);
  ASSERT_NE(block->data(), nullptr);
  static_cast<char*>(block->data())[0] = 7;
  EXPECT_EQ(a.to_vector(), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(a.data()[2], 3);
  block.reset();
  runtime::ReleaseCachedResources();
}

TEST(MpBadInput, SizesThatWrapOrExceedTheSystemFailFast) {
  const std::vector<BadCall> rows = {
      {"Queue(QueueOptions{0, SIZE_MAX - 7})",
       [] {
         Queue q(QueueOptions{0, kMax - 7});
       },
       ErrorCode::kInvalidArgument,
       {"ring_bytes", std::to_string(kMax - 7)}},
      {"Queue(QueueOptions{0, SIZE_MAX})",
       [] {
         Queue q(QueueOptions{0, kMax});
       },
       ErrorCode::kInvalidArgument,
       {"ring_bytes", std::to_string(kMax)}},
      {"Queue(QueueOptions{0, 4 GiB + 1})",
       [] {
         Queue q(QueueOptions{0, (size_t{4} << 30) + 1});
       },
       ErrorCode::kInvalidArgument,
       {"ring_bytes"}},
      {"Queue(QueueOptions{0, 4095})",
       [] {
         Queue q(QueueOptions{0, 4095});
       },
       ErrorCode::kInvalidArgument,
       {"ring_bytes", "4095"}},
      {"Queue(QueueOptions{0, 0})",
       [] {
         Queue q(QueueOptions{0, 0});
       },
       ErrorCode::kInvalidArgument,
       {"ring_bytes"}},
      {"Array<double>(1 << 40)",
       [] { Array<double> a(size_t{1} << 40); },
       ErrorCode::kResourceExhausted,
       {"Array", "bytes is more than this system can provide"}},
      {"Array<double>(1 << 40, 0, no lock)",
       [] { Array<double> a(size_t{1} << 40, 0.0, false); },
       ErrorCode::kResourceExhausted,
       {"Array"}},
      {"Array<double>(SIZE_MAX / 4): n * sizeof overflows",
       [] { Array<double> a(kMax / 4); },
       ErrorCode::kInvalidArgument,
       {"Array", std::to_string(kMax / 4)}},
      {"Array<char>(SIZE_MAX)",
       [] { Array<char> a(kMax); },
       ErrorCode::kInvalidArgument,
       {"Array"}},
      {"SharedEmpty({1 << 40}) file_descriptor",
       [] {
         set_sharing_strategy("file_descriptor");
         SharedEmpty({int64_t{1} << 40});
       },
       ErrorCode::kResourceExhausted,
       {std::to_string(int64_t{4} << 40), "bytes is more than"}},
      {"SharedEmpty({1 << 40}) file_system",
       [] {
         set_sharing_strategy("file_system");
         SharedEmpty({int64_t{1} << 40});
       },
       ErrorCode::kResourceExhausted,
       {std::to_string(int64_t{4} << 40)}},
      {"SharedEmpty({1 << 61}) float",
       [] { SharedEmpty({int64_t{1} << 61}); },
       ErrorCode::kResourceExhausted,
       {"bytes is more than"}},
      {"SharedArena::Allocate(SIZE_MAX - 8)",
       [] { internal::SharedArena::Get().Allocate(kMax - 8, internal::SegmentKind::kMemfd); },
       ErrorCode::kResourceExhausted,
       {std::to_string(kMax - 8)}},
      {"share_memory_ of a 0-sized tensor is fine, of a bad shape is not",
       [] { SharedEmpty({-1}); },
       ErrorCode::kInvalidArgument,
       {">= 0"}},
  };
  const std::string failures = CheckRows(rows, /*bounded=*/true);
  EXPECT_TRUE(failures.empty()) << failures;
}

TEST(MpBadInput, NaNAndNegativeTimeoutsAreInvalidEverywhere) {
  Queue q;
  JoinableQueue jq;
  Lock lock;
  RLock rlock;
  Semaphore sem(0);
  Event ev;
  auto [a, b] = Pipe();
  std::vector<BadCall> rows;
  for (double bad : {kNaN, -1.0, -kInf, -1e-9}) {
    const std::string v = std::isnan(bad) ? "nan" : "-";
    auto add = [&](const std::string& name, std::function<void()> f) {
      rows.push_back({name + "(" + std::to_string(bad) + ")",
                      std::move(f),
                      ErrorCode::kInvalidArgument,
                      {"timeout", v}});
    };
    add("Queue::get", [&q, bad] { q.get<int>(true, bad); });
    add("Queue::put", [&q, bad] { q.put(1, true, bad); });
    add("JoinableQueue::join", [&jq, bad] { jq.join(bad); });
    add("Lock::acquire", [&lock, bad] { lock.acquire(true, bad); });
    add("RLock::acquire", [&rlock, bad] { rlock.acquire(true, bad); });
    add("Semaphore::acquire", [&sem, bad] { sem.acquire(true, bad); });
    add("Event::wait", [&ev, bad] { ev.wait(bad); });
    add("Connection::poll", [&a = a, bad] { a.poll(bad); });
    add("Connection::RecvMessage", [&a = a, bad] { a.RecvMessage(bad); });
    add("Barrier(default timeout)", [bad] { Barrier br(2, nullptr, bad); });
    add("Barrier::wait", [bad] { Barrier(1).wait(bad); });
    add("Condition::wait", [bad] {
      Condition c;
      c.acquire();
      try {
        c.wait(bad);
      } catch (...) {
        c.release();
        throw;
      }
      c.release();
    });
    add("spawn(grace_period)", [bad] {
      SpawnOptions o;
      o.grace_period = std::chrono::duration<double>(bad);
      spawn(&RankNoop, std::make_tuple(0), o);  // throws before any process starts
    });
  }
  // Not wrapped in a child: nothing here allocates; the handles must stay usable afterwards.
  const std::string failures = CheckRows(rows, /*bounded=*/false);
  EXPECT_TRUE(failures.empty()) << failures;
  q.put(5);
  EXPECT_EQ(q.get<int>(true, 1.0), 5);
  (void)b;
}

TEST(MpBadInput, InfinityAndHugeTimeoutsWaitForever) {
  // +infinity (and a finite wait past steady_clock's range) is "forever", not a deadline in the
  // past: the value put 200 ms later arrives.
  for (double forever : {kInf, 1e300, 1e18}) {
    Queue q;
    std::thread late([q]() mutable {
      std::this_thread::sleep_for(200ms);
      q.put(42);
    });
    EXPECT_EQ(q.get<int>(true, forever), 42) << forever;
    late.join();
    Event ev;
    ev.set();
    EXPECT_TRUE(ev.wait(forever));
    Lock l;
    EXPECT_TRUE(l.acquire(true, forever));
    l.release();
  }
  EXPECT_EQ(internal::CheckedWait(Timeout(kInf), "x"), std::nullopt);
  EXPECT_EQ(internal::CheckedWait(Timeout(), "x"), std::nullopt);
  EXPECT_EQ(internal::CheckedWait(Timeout(0.0), "x"), std::chrono::steady_clock::duration::zero());
  EXPECT_EQ(internal::CheckedWait(Timeout(1.5), "x"), std::chrono::milliseconds(1500));
  // Zero still means "do not wait".
  Queue empty;
  EXPECT_THROW(empty.get<int>(true, 0.0), Empty);
}

TEST(MpBadInput, AnEntryPointTakesAnArray) {
  Array<double> empty;  // the decoded-into state
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_FALSE(empty.has_lock());
  EXPECT_EQ(empty.to_vector(), std::vector<double>{});
  try {
    empty.get_lock();
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition);
  }
  Array<double> arr(std::vector<double>{1, 2, 3});
  Value<int> calls(0);
  Process p(ProcessOptions{"", false, "spawn"}, &NegateAll, arr, calls);
  p.start();
  ASSERT_TRUE(p.join(60.0));
  EXPECT_EQ(p.exitcode(), std::optional<int>(0));
  EXPECT_EQ(arr.to_vector(), (std::vector<double>{-1, -2, -3}));
  EXPECT_EQ(calls.get(), 1);
}

}  // namespace
}  // namespace forksafe::mp
