// mp/internal/queue_spin.h: how long a Queue getter that finds the queue empty spins (yielding
// the CPU) before it sleeps on the doorbell, and whether it sets a timer to be awake when the
// next item is expected (mp/queue.cc, GetMessage and SleepOnBell). Internal.
//
// What it offers
//   GetterSpin: the adaptive rule, one per queue handle in a process (Queue::State: every copy of
//   one Queue object in a process shares it; a queue received from another process has its own).
//   It learns how long this process's gets wait for an item and plans the next wait (Next()):
//
//     typical = the recent wait, an exponentially weighted average (each new wait counts half)
//               of how long gets that found the queue empty waited until an item was there (or
//               until their timeout: a lower bound of the wait); a wait longer than kPredictMax
//               counts as kIdleSample (2 x kPredictMax): the queue was idle.
//     typical <= kMax (400 us): spin 2 x typical, within [kMin, kMax] (50 to 400 us), then sleep
//               on the doorbell.
//     kMax < typical <= kPredictMax (20 ms): the items come later than any spin should wait, but
//               regularly (a producer that works ~1 ms per item): spin kMin, then nap (sleep on
//               the doorbell with a timer) until kMax / 2 before the item is expected, then spin
//               up to kMax around that moment, then sleep until the doorbell rings. An item that
//               comes on time finds the getter awake: the putter wakes nobody, and the getter's
//               wake-up (a timer) was off the item's path.
//     typical > kPredictMax: spin kMin, then sleep until the doorbell rings.
//
//   A wait that ended in a sleep counts as long as it was (spin + sleep + wake-up), so spins that
//   keep ending in sleeps raise typical: the spin grows to catch items that come a little later,
//   and once they come later than kMax it falls to kMin and the nap takes over. One wait longer
//   than kPredictMax (an idle queue, a worker between jobs) alone puts typical above it, so the
//   next get spins kMin and sleeps without a timer; a few quick items bring the spin back.
//
// Guarantees
//   - Next().spin is within [kMin, kMax]; with no wait recorded yet it is kMin (the fixed 50 us
//     spin this replaced) and there is no nap. A get spins at most kMin + kMax in all when it
//     naps, at most kMax otherwise (plus up to kMax again after each wake-up that found the
//     queue empty: another getter took the item), and is woken by at most one timer beyond the
//     bell.
//   - Thread safety: Record and Next may be called from any thread at once; concurrent records
//     may lose one another (the average is a hint, not an account).
//
// Hazard: items that keep coming just under kMax after each get, or irregularly around a typical
// wait of 0.4-20 ms, cost up to kMax (+ kMin) of CPU per item (yielding, so a runnable thread on
// the same CPU takes it first), and a timer wake-up per item in the second case: the price of not
// paying a cross-CPU wake-up on the item's path.
#ifndef FORKSAFE_MP_INTERNAL_QUEUE_SPIN_H_
#define FORKSAFE_MP_INTERNAL_QUEUE_SPIN_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace forksafe::mp {
class Queue;
}

namespace forksafe::mp::internal {

class GetterSpin {
 public:
  using Duration = std::chrono::nanoseconds;
  static constexpr Duration kMin = std::chrono::microseconds(50);
  static constexpr Duration kMax = std::chrono::microseconds(400);
  static constexpr Duration kPredictMax = std::chrono::milliseconds(20);
  static constexpr Duration kIdleSample = 2 * kPredictMax;

  /// The next wait of a get that finds the queue empty: spin `spin`, then sleep on the doorbell;
  /// when `nap` is not zero, that sleep ends `nap` after the get began waiting at the latest,
  /// and the getter spins up to kMax before it sleeps again (until the doorbell rings).
  struct Wait {
    Duration spin;
    Duration nap;
  };
  Wait Next() const {
    const int64_t typical = typical_ns_.load(std::memory_order_relaxed);
    if (typical > kPredictMax.count()) return {kMin, Duration::zero()};
    if (typical > kMax.count()) return {kMin, Duration(typical) - kMax / 2};
    return {Duration(std::clamp<int64_t>(2 * typical, kMin.count(), kMax.count())),
            Duration::zero()};
  }

  /// A get that found the queue empty waited `waited` (until an item was there, or its timeout).
  void Record(Duration waited) {
    const int64_t w =
        waited > kPredictMax ? kIdleSample.count() : std::max<int64_t>(waited.count(), 0);
    const int64_t t = typical_ns_.load(std::memory_order_relaxed);
    typical_ns_.store(t + (w - t) / 2, std::memory_order_relaxed);
  }

  /// The recent wait (for tests and diagnostics).
  Duration Typical() const { return Duration(typical_ns_.load(std::memory_order_relaxed)); }

 private:
  std::atomic<int64_t> typical_ns_{0};
};

/// The rule of `q`'s handle in this process (for tests: they may Record waits); `q` must be open.
GetterSpin& GetterSpinOf(const Queue& q);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_QUEUE_SPIN_H_
