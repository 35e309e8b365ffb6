// runtime/internal/fork_aware_once.h: NOT FOR USERS. A process-lifetime object made on first
// use, whose making may wait for a fork running on another thread.
//
// Why it exists
//   An object whose constructor registers an at-fork handler (runtime/at_fork.h) waits, inside
//   its constructor, for a fork in progress to finish its handlers. Made as a C++ function-local
//   static, it waited holding the static's guard: a child forked meanwhile inherited that guard
//   "in progress" with no thread to finish it, and the child's first use waited for ever (a
//   Python child that sent its first tensor while its parent's threads had just begun to send
//   theirs hung in SharedArena::Get()).
//
// Guarantees
//   ForkAwareOnce<T, Make>() returns the one T of this process, made by Make() on first use;
//   concurrent first uses wait for the one making it. It runs on pthread_once, which glibc makes
//   fork-aware: in a child forked while another thread was in Make(), the child's first use runs
//   Make() itself (the parent's half-made object is abandoned there). The fast path is one
//   acquire load.
//
// Hazards
//   Make() must not throw (pthread_once is C) and must not use ForkAwareOnce<T, Make> itself.
#ifndef FORKSAFE_RUNTIME_INTERNAL_FORK_AWARE_ONCE_H_
#define FORKSAFE_RUNTIME_INTERNAL_FORK_AWARE_ONCE_H_

#include <pthread.h>

namespace forksafe::runtime::internal {

template <class T, T* (*Make)()>
T& ForkAwareOnce() {
  static T* instance = nullptr;                    // constant-initialized: no guard
  static pthread_once_t once = PTHREAD_ONCE_INIT;  // constant-initialized: no guard
  pthread_once(&once, [] { instance = Make(); });
  return *instance;
}

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_FORK_AWARE_ONCE_H_
