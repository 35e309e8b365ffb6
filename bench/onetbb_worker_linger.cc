// bench/onetbb_worker_linger.cc: why runtime/tbb_fork.cc holds a task_scheduler_handle between
// forks. A stand-alone program (no forksafe code) that repeats, N times: a thread runs
// tbb::parallel_reduce and is joined (as a pool's drain ends its workers before a fork), then
// tbb::finalize on a lifetime handle, then a check whether any other thread of the process is
// still alive 200 us later, then fork() (the child runs one parallel_reduce under alarm(5)).
//
//   bazel run //bench:onetbb_worker_linger -- 3000 prepare-only   # attach only before finalize
//   bazel run //bench:onetbb_worker_linger -- 3000 held           # what forksafe does
//
// With "prepare-only", the joined thread dropped the last reference to oneTBB's scheduler, so
// oneTBB shut its workers down detached, and some are still running (in tbbmalloc, among other
// places) after finalize returned: those forks could hand the child a held tbbmalloc lock. With
// "held", the handle keeps a reference that only the blocking finalize drops, which joins every
// worker. Figures: docs/reliability.md.
#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "oneapi/tbb/blocked_range.h"
#include "oneapi/tbb/global_control.h"
#include "oneapi/tbb/parallel_reduce.h"

namespace {

long Sum(long n) {
  return tbb::parallel_reduce(
      tbb::blocked_range<long>(0, n), 0L,
      [](const tbb::blocked_range<long>& r, long acc) {
        for (long i = r.begin(); i != r.end(); ++i) acc += i;
        return acc;
      },
      [](long a, long b) { return a + b; });
}

int ThreadCount() {
  const int fd = open("/proc/self/task", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  alignas(8) char buf[4096];
  int n = 0;
  for (;;) {
    const long got = syscall(SYS_getdents64, fd, buf, sizeof buf);
    if (got <= 0) break;
    for (long off = 0; off < got;) {
      if (buf[off + 19] != '.') ++n;
      off += *reinterpret_cast<const unsigned short*>(buf + off + 16);
    }
  }
  close(fd);
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  const int forks = argc > 1 ? atoi(argv[1]) : 3000;
  const bool held = argc > 2 && strcmp(argv[2], "held") == 0;
  if (forks <= 0 || (argc > 2 && !held && strcmp(argv[2], "prepare-only") != 0)) {
    fprintf(stderr, "usage: %s FORKS [prepare-only|held]\n", argv[0]);
    return 2;
  }
  // Several workers whatever the number of cores, so that there is something to join.
  tbb::global_control parallelism(tbb::global_control::max_allowed_parallelism, 16);
  tbb::task_scheduler_handle handle;
  if (held) handle = tbb::task_scheduler_handle(tbb::attach{});
  std::minstd_rand rng(1);
  int alive_after_finalize = 0, refused = 0, children_failed = 0;
  for (int i = 0; i < forks; ++i) {
    std::atomic<bool> stop{false};
    std::thread user([&] {
      while (!stop) Sum(50000);
    });
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
    stop = true;
    user.join();
    if (!handle) handle = tbb::task_scheduler_handle(tbb::attach{});
    if (!tbb::finalize(handle, std::nothrow)) {
      ++refused;
      continue;
    }
    if (held) handle = tbb::task_scheduler_handle(tbb::attach{});
    // A joined thread stays listed for a few microseconds; one still listed 200 us later runs.
    if (ThreadCount() > 1) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (ThreadCount() > 1) ++alive_after_finalize;
    }
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(5);
      _exit(Sum(20000) == 199990000L ? 0 : 3);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0) {
      ++children_failed;
    }
  }
  printf(
      "%s: %d forks, a oneTBB thread still running after finalize in %d, finalize refused %d, "
      "children failed or hung %d\n",
      held ? "held" : "prepare-only", forks, alive_after_finalize, refused, children_failed);
  return 0;
}
