#include "forksafe/runtime/internal/thread_count.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace forksafe::runtime::internal {

int ListedThreads(int limit) {
  const int fd = open("/proc/self/task", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  alignas(8) char buf[2048];
  int n = 0;
  for (long got;
       (limit == 0 || n < limit) && (got = syscall(SYS_getdents64, fd, buf, sizeof buf)) > 0;) {
    for (long off = 0; off < got;) {
      const auto* d = reinterpret_cast<const dirent64*>(buf + off);
      if (d->d_name[0] != '.') ++n;
      off += d->d_reclen;
    }
  }
  close(fd);
  return n;
}

bool ThreadCountIs(int n) {
  // 0 and below: not trusted yet (minus the disagreements seen so far); 1: trusted; -3: never.
  static std::atomic<int> trust{0};
  struct stat st;
  if (n < 1 || stat("/proc/self/task", &st) != 0 || st.st_nlink != static_cast<nlink_t>(n) + 2) {
    return false;
  }
  const int t = trust.load(std::memory_order_relaxed);
  if (t == 1) return true;
  if (t <= -3) return false;
  // Until the link count has agreed once with a listing, check it against one. A thread that
  // starts or ends in between can make them disagree once; a procfs that does not count threads
  // in the link count disagrees every time, and after three the rule stays off (safe).
  const int listed = ListedThreads();
  struct stat again;
  if (listed < 1 || stat("/proc/self/task", &again) != 0) return false;
  // A thread started or ended between the two stat() calls: no verdict either way.
  if (again.st_nlink != st.st_nlink) return false;
  const bool agrees = again.st_nlink == static_cast<nlink_t>(listed) + 2;
  trust.store(agrees ? 1 : t - 1, std::memory_order_relaxed);
  return agrees && listed == n;
}

}  // namespace forksafe::runtime::internal
