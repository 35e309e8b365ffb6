// bench/peers/peers_floor.cc: what the machine allows, measured in the same run as the peers.
// No forksafe code is linked, so no at-fork handler runs.
//
//   floor_pingpong / 64 B : 64 bytes there and back over an AF_UNIX socketpair between two
//                           processes, raw read/write (two context switches and four syscalls).
//   floor_futex_pingpong  : the same turn-taking through a futex in a shared page (FUTEX_WAIT /
//                           FUTEX_WAKE, no data copied): the wake-up mechanism forksafe's Queue
//                           uses. A socket wake-up is a "sync" wake-up that lets the scheduler
//                           pull the woken process onto the waker's CPU; a futex wake-up is not.
//
// PEERS_CHILD_CPU=N in the environment pins the ping-pong children to CPU N (the parent is
// pinned by the caller with taskset): the cross-CPU case, measured deterministically.
//   floor_fork            : fork() + _exit(0) in the child + waitpid() in the parent.
//   floor_memcpy / size   : memcpy of 4 KiB, 1 MiB and 64 MiB between pre-faulted buffers
//                           (the least a copy of a fresh tensor into shared memory costs).
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "bench/peers/harness.h"

namespace {

using peers::Clock;
using peers::Us;

constexpr int kMsg = 64;

bool ReadFull(int fd, char* buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = read(fd, buf + got, n - got);
    if (r <= 0) return false;
    got += static_cast<size_t>(r);
  }
  return true;
}

long Futex(std::atomic<uint32_t>* word, int op, uint32_t val) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, nullptr, nullptr, 0);
}

// Waits until *word == want (FUTEX_WAIT while it differs).
void AwaitValue(std::atomic<uint32_t>* word, uint32_t want) {
  for (;;) {
    const uint32_t v = word->load(std::memory_order_acquire);
    if (v == want) return;
    Futex(word, FUTEX_WAIT, v);
  }
}

void FutexPingPong(const peers::Emitter& out, const peers::Plan& plan) {
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) throw std::runtime_error("mmap");
  auto* word = new (page) std::atomic<uint32_t>(0);
  const pid_t pid = fork();
  if (pid == 0) {
    peers::PinChild();
    for (uint32_t k = 1;; k += 2) {  // parent writes odd values, the child answers k + 1
      AwaitValue(word, k);
      word->store(k + 1, std::memory_order_release);
      Futex(word, FUTEX_WAKE, 1);
    }
  }
  uint32_t k = 1;
  auto samples = peers::Measure(plan, [&](int) {
    const auto t0 = Clock::now();
    word->store(k, std::memory_order_release);
    Futex(word, FUTEX_WAKE, 1);
    AwaitValue(word, k + 1);
    k += 2;
    return Us(Clock::now() - t0);
  });
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  munmap(page, 4096);
  out.Samples("floor_futex_pingpong", "", 0, plan, samples);
}

void PingPong(const peers::Emitter& out, const peers::Plan& plan) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) throw std::runtime_error("socketpair");
  const pid_t pid = fork();
  if (pid == 0) {
    peers::PinChild();
    close(sv[0]);
    char buf[kMsg];
    while (ReadFull(sv[1], buf, kMsg)) {
      buf[1] = static_cast<char>(buf[0] + 1);
      if (write(sv[1], buf, kMsg) != kMsg) _exit(1);
    }
    _exit(0);
  }
  close(sv[1]);
  char buf[kMsg] = {};
  auto samples = peers::Measure(plan, [&](int i) {
    buf[0] = static_cast<char>(i);
    const auto t0 = Clock::now();
    if (write(sv[0], buf, kMsg) != kMsg || !ReadFull(sv[0], buf, kMsg)) {
      throw std::runtime_error("ping-pong: short read or write");
    }
    const double us = Us(Clock::now() - t0);
    if (buf[1] != static_cast<char>(i + 1)) throw std::runtime_error("ping-pong: wrong reply");
    return us;
  });
  close(sv[0]);
  waitpid(pid, nullptr, 0);
  out.Samples("floor_pingpong", "64 B", kMsg, plan, samples);
}

void Fork(const peers::Emitter& out, const peers::Plan& plan) {
  auto samples = peers::Measure(plan, [&](int) {
    const auto t0 = Clock::now();
    const pid_t pid = fork();
    if (pid == 0) _exit(0);
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0) {
      throw std::runtime_error("fork: child did not exit cleanly");
    }
    return Us(Clock::now() - t0);
  });
  out.Samples("floor_fork", "", 0, plan, samples);
}

void Memcpy(const peers::Emitter& out, const peers::Plan& plan, int64_t bytes) {
  const size_t n = static_cast<size_t>(bytes);
  std::unique_ptr<char[]> src(new char[n]), dst(new char[n]);
  memset(src.get(), 1, n);
  memset(dst.get(), 0, n);
  auto samples = peers::Measure(plan, [&](int i) {
    src[0] = static_cast<char>(i);
    const auto t0 = Clock::now();
    memcpy(dst.get(), src.get(), n);
    const double us = Us(Clock::now() - t0);
    if (dst[0] != static_cast<char>(i) || dst[n - 1] != 1) throw std::runtime_error("memcpy");
    return us;
  });
  const double gbs = static_cast<double>(bytes) / (peers::Median(samples) * 1e3);
  char extra[64];
  snprintf(extra, sizeof extra, "\"gb_per_s\": %.2f", gbs);
  out.Samples("floor_memcpy", peers::SizeName(bytes), bytes, plan, samples, {extra});
}

}  // namespace

int main(int argc, char** argv) {
  const peers::Args args = peers::ParseArgs(argc, argv);
  const auto plans = peers::LoadPlan(args.plan);
  peers::Emitter out("floor", args.round, args.suffix);
  out.set_only(args.only);
  if (args.Wants("floor_pingpong")) {
    out.Guard("floor_pingpong", "64 B",
              [&] { PingPong(out, peers::PlanFor(plans, "floor_pingpong")); });
  }
  if (args.Wants("floor_futex_pingpong")) {
    out.Guard("floor_futex_pingpong", "",
              [&] { FutexPingPong(out, peers::PlanFor(plans, "floor_pingpong")); });
  }
  if (args.Wants("floor_fork")) {
    out.Guard("floor_fork", "", [&] { Fork(out, peers::PlanFor(plans, "floor_fork")); });
  }
  if (args.Wants("floor_memcpy")) {
    for (int64_t b : peers::kSizes) {
      out.Guard("floor_memcpy", peers::SizeName(b),
                [&] { Memcpy(out, peers::PlanFor(plans, "floor_memcpy"), b); });
    }
  }
  return 0;
}
