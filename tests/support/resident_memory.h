// tests/support/resident_memory.h: how much shared memory this process has resident, for tests
// that check memory is given back (RssShmem in /proc/self/status: the shared pages this process
// maps and has touched or faulted in).
#ifndef FORKSAFE_TESTS_SUPPORT_RESIDENT_MEMORY_H_
#define FORKSAFE_TESTS_SUPPORT_RESIDENT_MEMORY_H_

#include <cstdio>

namespace forksafe::testing {

/// Kilobytes of shared memory this process has resident; -1 where /proc cannot tell.
inline long RssShmemKb() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  long kb = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "RssShmem: %ld kB", &kb) == 1) break;
  }
  std::fclose(f);
  return kb;
}

}  // namespace forksafe::testing

#endif  // FORKSAFE_TESTS_SUPPORT_RESIDENT_MEMORY_H_
