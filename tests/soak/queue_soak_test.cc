// Queue soak (issue 7, "Load"): a million messages from 4 producer processes into one consumer,
// with no loss, no duplicate and each producer's order kept. Every message carries its
// producer's id and a sequence number. The queue is bounded, so producers also spend time
// blocked on a full queue. Size: FORKSAFE_SOAK_SCALE (tests/soak/soak_scale.h).
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/soak/soak_scale.h"

namespace forksafe::mp {
namespace {

using namespace std::chrono_literals;

constexpr int kProducers = 4;
constexpr int kIdShift = 48;  // message = producer id << 48 | sequence

// A producer: puts `count` messages "id, 0..count-1". A put that stays blocked for 60 s throws
// Full, which fails the process (and the test) instead of hanging.
void Produce(Queue q, int id, int64_t count) {
  for (int64_t seq = 0; seq < count; ++seq) {
    q.put((static_cast<int64_t>(id) << kIdShift) | seq, true, 60s);
  }
}
FORKSAFE_ENTRY_POINT(Produce);

TEST(QueueSoakTest, MillionMessagesFromFourProducers) {
  const int64_t total = forksafe::testing::Scaled(1000000, kProducers);
  const int64_t per_producer = total / kProducers;
  const std::string method = getenv("FORKSAFE_SOAK_START_METHOD") != nullptr
                                 ? getenv("FORKSAFE_SOAK_START_METHOD")
                                 : "fork";
  Queue q(QueueOptions{10000, size_t{1} << 20});

  const auto start = std::chrono::steady_clock::now();
  std::vector<Process> producers;
  for (int id = 0; id < kProducers; ++id) {
    producers.emplace_back(ProcessOptions{"producer-" + std::to_string(id), false, method},
                           &Produce, q, id, per_producer);
    producers.back().start();
  }

  std::vector<int64_t> next(kProducers, 0);  // the sequence expected next from each producer
  int64_t received = 0, bad_id = 0, duplicated = 0, skipped = 0;
  const int64_t expected = per_producer * kProducers;
  std::string first_problem;
  while (received < expected) {
    int64_t m;
    try {
      m = q.get<int64_t>(true, 60s);
    } catch (const Empty&) {
      FAIL() << "no message for 60 s after " << received << " of " << expected
             << " (a producer hung or died)";
    }
    ++received;
    const int id = static_cast<int>(m >> kIdShift);
    const int64_t seq = m & ((int64_t{1} << kIdShift) - 1);
    if (id < 0 || id >= kProducers) {
      ++bad_id;
      continue;
    }
    if (seq != next[id]) {
      // Lower: a duplicate (or a reordering); higher: the messages in between were lost.
      if (seq < next[id]) {
        ++duplicated;
      } else {
        skipped += seq - next[id];
      }
      if (first_problem.empty()) {
        first_problem = "producer " + std::to_string(id) + " sent " + std::to_string(seq) +
                        " where " + std::to_string(next[id]) + " was expected";
      }
    }
    if (seq >= next[id]) next[id] = seq + 1;
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  for (Process& p : producers) {
    ASSERT_TRUE(p.join(60s)) << p.name() << " did not exit";
    EXPECT_EQ(p.exitcode(), 0) << p.name() << " failed";
  }
  // Nothing more may arrive: that would be a duplicate.
  EXPECT_THROW(q.get<int64_t>(true, 200ms), Empty) << "more messages than were sent";
  EXPECT_EQ(bad_id, 0);
  EXPECT_EQ(duplicated, 0) << first_problem;
  EXPECT_EQ(skipped, 0) << first_problem;
  int64_t lost = skipped;
  for (int id = 0; id < kProducers; ++id) {
    EXPECT_EQ(next[id], per_producer) << "producer " << id << ": messages lost at the end";
    lost += per_producer - next[id];
  }
  printf(
      "soak: queue: %lld messages from %d %s producers in %.2f s (%.0f messages/s); "
      "lost %lld, duplicated %lld\n",
      static_cast<long long>(received), kProducers, method.c_str(), secs, received / secs,
      static_cast<long long>(lost), static_cast<long long>(duplicated));
  RecordProperty("messages", static_cast<int>(received));
  RecordProperty("messages_per_s", static_cast<int>(received / secs));
}

}  // namespace
}  // namespace forksafe::mp
