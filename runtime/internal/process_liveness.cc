#include "forksafe/runtime/internal/process_liveness.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace forksafe::runtime::internal {

bool ProcessExited(pid_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  // Exists (or EPERM: another user's). A zombie has exited too: read its state from /proc.
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  // Not readable: /proc hides other users' processes (hidepid) or shows another pid namespace.
  // kill() found the process (or EPERM): alive. A process reaped meanwhile is seen next time.
  if (fd < 0) return false;
  char buf[512];
  ssize_t n;
  do {
    n = read(fd, buf, sizeof buf - 1);
  } while (n < 0 && errno == EINTR);
  close(fd);
  if (n <= 0) return false;  // unreadable: say alive, the safe side for every caller
  buf[n] = '\0';
  // "pid (comm) S ...": comm may hold ')' and spaces, so the state follows the last ')'.
  const char* paren = std::strrchr(buf, ')');
  if (paren == nullptr || paren[1] != ' ' || paren[2] == '\0') return false;
  return paren[2] == 'Z' || paren[2] == 'X';
}

}  // namespace forksafe::runtime::internal
