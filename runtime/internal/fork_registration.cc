#include "forksafe/runtime/internal/fork_registration.h"

#include <gnu/libc-version.h>
#include <pthread.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <utility>

namespace forksafe::runtime::internal {
namespace {

std::atomic<ForkCallback> g_prepare{nullptr};
std::atomic<ForkCallback> g_parent{nullptr};
std::atomic<ForkCallback> g_child{nullptr};
std::atomic<int> g_count{0};          // registrations made (0: not even the first)
std::atomic<bool> g_renewing{false};  // one renewal at a time (never waited for)

// Per fork, on the forking thread (glibc runs a fork's handlers on it; several threads may fork
// at once, and each counts its own).
thread_local int t_prepares = 0;  // prepare calls so far in the fork in progress
thread_local int t_posts = 0;     // parent or child calls so far
thread_local int t_acting = -1;   // the registration whose prepare acted

// glibc runs a fork's prepare handlers newest first and its parent and child handlers oldest
// first, skipping in every phase those registered after the fork began: the first prepare call
// and the last parent (or child) call belong to the same, newest, registration.
template <int N>
void PrepareAt() {
  if (t_prepares++ != 0) return;
  t_acting = N;
  if (ForkCallback cb = g_prepare.load(std::memory_order_acquire)) cb();
}

void AfterFork(const std::atomic<ForkCallback>& callback, bool child) {
  if (++t_posts < t_prepares) return;
  // This fork is over for the counters before the callback runs: a fork made from inside it (a
  // ForkReport listener that forks, say) is then a fork of its own, handled in full, and a
  // callback that throws leaves nothing behind.
  t_prepares = t_posts = 0;
  t_acting = -1;
  // A renewal that another thread was making at the fork does not exist in the child.
  // (Written only when set: each page the child writes costs it a copy-on-write fault.)
  if (child && g_renewing.load(std::memory_order_relaxed)) {
    g_renewing.store(false, std::memory_order_relaxed);
  }
  if (ForkCallback cb = callback.load(std::memory_order_acquire)) cb();
}

template <int N>
void ParentAt() {
  AfterFork(g_parent, false);
}
template <int N>
void ChildAt() {
  AfterFork(g_child, true);
}

struct Trio {
  ForkCallback prepare, parent, child;
};

template <size_t... N>
constexpr auto MakeTrios(std::index_sequence<N...>) {
  return std::array<Trio, sizeof...(N)>{Trio{&PrepareAt<static_cast<int>(N)>,
                                             &ParentAt<static_cast<int>(N)>,
                                             &ChildAt<static_cast<int>(N)>}...};
}
constexpr auto kTrios = MakeTrios(std::make_index_sequence<kMaxForkRegistrations>{});

// glibc 2.36 and later release the at-fork list's lock while a handler runs, so that a handler
// may register another (which the running fork then skips; glibc bugs 27054 and 24595, fixed in
// 2.36); older ones deadlock with several threads, or run the new one in the same fork.
bool CanRegisterInsideAFork() {
  const char* v = gnu_get_libc_version();
  char* end = nullptr;
  const long major = std::strtol(v, &end, 10);
  const long minor = (end != nullptr && *end == '.') ? std::strtol(end + 1, nullptr, 10) : 0;
  return major > 2 || (major == 2 && minor >= 36);
}

}  // namespace

int RegisterForkCallbacks(ForkCallback prepare, ForkCallback parent, ForkCallback child) {
  g_prepare.store(prepare, std::memory_order_release);
  g_parent.store(parent, std::memory_order_release);
  g_child.store(child, std::memory_order_release);
  const int rc = pthread_atfork(kTrios[0].prepare, kTrios[0].parent, kTrios[0].child);
  if (rc == 0) g_count.store(1, std::memory_order_release);
  return rc;
}

int RenewForkRegistration() {
  const int n = g_count.load(std::memory_order_acquire);
  if (n == 0 || n >= kMaxForkRegistrations) return 0;
  if (t_prepares != 0 && !CanRegisterInsideAFork()) return 0;
  if (g_renewing.exchange(true, std::memory_order_acquire)) return 0;  // another thread is
  const int number = g_count.load(std::memory_order_acquire);
  int made = 0;
  if (number < kMaxForkRegistrations) {
    // The number is taken before the registration is made: a child forked in between has a
    // count that covers it (at worst a number without a registration, a harmless gap), never a
    // registration whose number its next renewal would use again.
    g_count.store(number + 1, std::memory_order_release);
    if (pthread_atfork(kTrios[number].prepare, kTrios[number].parent, kTrios[number].child) == 0) {
      made = number;
    }
  }
  g_renewing.store(false, std::memory_order_release);
  return made;
}

int ActingForkRegistration() { return t_acting; }

}  // namespace forksafe::runtime::internal
