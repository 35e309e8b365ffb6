// The fork server and the descriptor table, under a hostile program: the server killed before it
// reported a status, the server or a receiver short of descriptors (RLIMIT_NOFILE), poll() failing
// under a wait, a spawned child whose request cannot be sent. Each case runs in a bounded,
// leak-checked child of the test (ExpectChildPasses, tests/mp/hostile_program.h); a child body
// returns 0 for success and CHECK()s its way through.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/mp/connection.h"
#include "forksafe/mp/process.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/mp/hostile_program.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using runtime::Error;
using runtime::ErrorCode;
using testing::RunInChild;
using namespace std::chrono_literals;

// ---- entry points (registered: usable with every start method) ----
void ExitWith(int code) { std::exit(code); }
FORKSAFE_ENTRY_POINT(ExitWith);

void SleepMs(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }
FORKSAFE_ENTRY_POINT(SleepMs);

void HoldDescriptors(const std::vector<FileDescriptor>& fds) { (void)fds; }
FORKSAFE_ENTRY_POINT(HoldDescriptors);

// ---- the fork server: its death, and its descriptor limit ----

TEST(ForkServerTest, AStatusLostWithTheServerIsUnknownNotInvented) {
  ExpectChildPasses([] {
    Process p(ProcessOptions{"orphan", false, "forkserver"}, &SleepMs, 60000);
    p.start();
    const pid_t server = ParentOf(p.pid());
    CHECK(server > 0 && server != getpid());
    CHECK(::kill(server, SIGKILL) == 0);  // reaped by the library when it notices
    std::this_thread::sleep_for(50ms);
    p.kill();  // the orphan dies without a report; init (or a subreaper) takes its status
    CHECK(p.join(10s));
    try {
      const std::optional<int> code = p.exitcode();
      fprintf(stderr, "exit code %d\n", code.value_or(-1000));
      CHECK(false);
    } catch (const Error& e) {
      fprintf(stderr, "error: %s\n", e.what());
      CHECK(e.code() == ErrorCode::kFailedPrecondition);
      CHECK(Contains(e.message(), "fork server") && Contains(e.message(), "status is lost"));
    }
    // A new server serves the next process, and its status is known again.
    Process q(ProcessOptions{"next", false, "forkserver"}, &SleepMs, 5000);
    q.start();
    const pid_t new_server = ParentOf(q.pid());  // still running (5 s): readable
    CHECK(new_server > 0 && new_server != server);
    q.terminate();
    CHECK(q.join(10s) && q.exitcode() == -SIGTERM);
    return 0;
  });
}

TEST(ForkServerTest, ARequestOverTheServersDescriptorLimitIsRefusedAndTheServerLives) {
  ExpectChildPasses([] {
    Process first(ProcessOptions{"first", true, "forkserver"}, &SleepMs, 60000);
    first.start();
    const pid_t server = ParentOf(first.pid());
    CHECK(server > 0);
    // Room for 3 more descriptors in the server: a request carries 2 of its own (result channel,
    // lifeline) plus its arguments'.
    int top = -1;
    for (int fd = 0; fd < 4096; ++fd) {
      char target[256];
      if (readlink(("/proc/" + std::to_string(server) + "/fd/" + std::to_string(fd)).c_str(),
                   target, sizeof(target)) >= 0) {
        top = fd;
      }
    }
    CHECK(top >= 3);
    fprintf(stderr, "the fork server's highest descriptor is %d\n", top);
    const rlimit small{static_cast<rlim_t>(top + 4), static_cast<rlim_t>(top + 4)};
    CHECK(prlimit(server, RLIMIT_NOFILE, &small, nullptr) == 0);
    std::vector<FileDescriptor> many;
    for (int i = 0; i < 8; ++i) {  // distinct files: the codec sends one file once
      many.emplace_back(static_cast<int>(syscall(SYS_memfd_create, "held", MFD_CLOEXEC)));
      CHECK(many.back().get() >= 0);
    }
    Process heavy(ProcessOptions{"heavy", false, "forkserver"}, &HoldDescriptors, std::move(many));
    try {
      heavy.start();
      CHECK(false);
    } catch (const Error& e) {
      CHECK(ClearLimitError(e, "RLIMIT_NOFILE"));
      CHECK(Contains(e.message(), "heavy") && Contains(e.message(), "fork server"));
    }
    // The same server lives on: it starts the next process, and reports the first one's exit.
    Process light(ProcessOptions{"light", false, "forkserver"}, &SleepMs, 5000);
    light.start();
    CHECK(ParentOf(light.pid()) == server);  // still running (5 s): its parent is readable
    light.terminate();
    CHECK(light.join(10s) && light.exitcode() == -SIGTERM);
    first.kill();
    CHECK(first.join(10s) && first.exitcode() == -SIGKILL);
    return 0;
  });
}

// poll() failing (ENOMEM) while waiting for a forkserver process: the wait naps and ends at its
// deadline, instead of spinning through it (or forever, in a wait without one).
TEST(ForkServerTest, AFailingPollNapsInsteadOfSpinning) {
  ExpectChildPasses([] {
    Process p(ProcessOptions{"napper", false, "forkserver"}, &SleepMs, 1500);
    p.start();  // the server runs before the filter: only the waiting thread's poll() fails
    bool filtered = false, joined = true;
    double cpu = 1;
    std::thread waiter([&] {
      filtered = FailOnThisThread({{__NR_poll, ENOMEM}, {__NR_ppoll, ENOMEM}});
      if (!filtered) return;
      const double c0 = ThreadCpuSeconds();
      joined = p.join(0.5);
      cpu = ThreadCpuSeconds() - c0;
    });
    waiter.join();
    CHECK(p.join(10s) && p.exitcode() == 0);  // this thread's poll() works
    if (!filtered) return kSkip;
    fprintf(stderr, "cpu %.3f s in a 0.5 s wait whose poll() fails\n", cpu);
    CHECK(!joined);
    CHECK(cpu < 0.25);
    return 0;
  });
}

// The spawned child's request cannot be sent: start() reports that, and the child is killed and
// reaped (through its pidfd) before start() throws; the leak check sees no child left.
TEST(SpawnCleanupTest, AChildWhoseRequestCannotBeSentIsKilledAndReaped) {
  ExpectChildPasses([] {
    int rc = 0;
    bool filtered = false;
    std::thread starter([&] {
      filtered = FailOnThisThread({{__NR_sendmsg, ENOBUFS}, {__NR_sendto, ENOBUFS}});
      if (!filtered) return;
      Process p(ProcessOptions{"unsent", false, "spawn"}, &SleepMs, 60000);
      try {
        p.start();
        rc = 1;
      } catch (const Error& e) {
        fprintf(stderr, "error: %s\n", e.what());
        rc = p.pid() == 0 ? 0 : 2;
      }
    });
    starter.join();
    if (!filtered) return kSkip;
    CHECK(rc == 0);
    return 0;
  });
}

// A secret pipe, a socket pair, a result channel: whichever of a fork server's start runs out of
// descriptors, the error is kResourceExhausted naming the limit, never kInternal.
TEST(ForkServerTest, StartingTheServerWithFewDescriptorsLeftIsAClearError) {
  if (UnderUbsan()) GTEST_SKIP() << kUbsanNeedsDescriptors;
  ExpectChildPasses([] {
    bool started = false;
    // Descriptors in flight are counted per user against the sender's RLIMIT_NOFILE (64 here):
    // other processes of this user (tests running beside this one) can make a step's send fail
    // for a while. That is a clear error too (exit 5); the step is then tried again, bounded.
    int in_flight_retries = 0;
    for (int free_fds = 0; free_fds <= 16 && !started; ++free_fds) {
      const testing::ChildResult r = RunInChild(
          [free_fds] {
            CHECK(SetNofile(64));
            std::vector<int> filler;
            for (int fd; (fd = fcntl(0, F_DUPFD_CLOEXEC, 0)) >= 0;) filler.push_back(fd);
            for (int i = 0; i < free_fds && !filler.empty(); ++i) {
              ::close(filler.back());
              filler.pop_back();
            }
            int rc = 0;
            {
              Process p(ProcessOptions{"squeezed", false, "forkserver"}, &ExitWith, 0);
              try {
                p.start();
                for (int fd : filler) ::close(fd);
                filler.clear();
                rc = p.join(10s) && p.exitcode() == 0 ? 50 : 3;  // 50: it started
              } catch (const Error& e) {
                rc = !ClearLimitError(e, "RLIMIT_NOFILE") ? 4
                     : Contains(e.message(), "in flight") ? 5
                                                          : 0;
              }
            }
            for (int fd : filler) ::close(fd);
            return rc;
          },
          30s, 30);
      if (r.exited && r.exit_code == 5 && ++in_flight_retries <= 50) {
        std::this_thread::sleep_for(100ms);
        --free_fds;  // the same step again
        continue;
      }
      started = r.exited && r.exit_code == 50;
      if (!r.ok() && !started) fprintf(stderr, "%d free: %s\n", free_fds, r.Describe().c_str());
      CHECK(r.ok() || started);
    }
    CHECK(started);  // every step of the start met the shortage on the way up
    return 0;
  });
}

// ---- descriptors passed to a process at its limit ----

// The kernel counts descriptors in flight (sent, not yet received) per user against the sender's
// RLIMIT_NOFILE, unless it has CAP_SYS_RESOURCE: past it, a send is Error(kResourceExhausted)
// naming the limit and saying that descriptors are in flight, never a bare errno.
TEST(PassedDescriptorsTest, TooManyDescriptorsInFlightIsAClearError) {
  if (UnderUbsan()) GTEST_SKIP() << kUbsanNeedsDescriptors;
  const testing::ChildResult r = RunInChild(
      [] {
        CHECK(SetNofile(32));
        auto [a, b] = Pipe();
        const int memfd = static_cast<int>(syscall(SYS_memfd_create, "passed", MFD_CLOEXEC));
        CHECK(memfd >= 0);
        // The same file eight times a message; nobody reads: each counts as in flight.
        for (int sent = 0; sent < 64; ++sent) {
          Message m;
          for (int i = 0; i < 8; ++i) m.fds.emplace_back(dup(memfd));
          m.bytes = "pinned";
          try {
            a.SendMessage(m);
          } catch (const Error& e) {
            ::close(memfd);
            CHECK(ClearLimitError(e, "RLIMIT_NOFILE (32)"));
            CHECK(Contains(e.message(), "in flight"));
            return 0;
          }
        }
        ::close(memfd);
        return 7;  // 512 descriptors in flight were accepted: this process has CAP_SYS_RESOURCE
      },
      30s, 30);
  if (r.exited && r.exit_code == 7) {
    GTEST_SKIP() << "the kernel did not limit descriptors in flight (CAP_SYS_RESOURCE)";
  }
  EXPECT_TRUE(r.ok()) << r.Describe();
}

// The kernel drops passed descriptors that do not fit the receiver's table (only MSG_CTRUNC says
// so): the receive is Error(kResourceExhausted) naming the limit, never a message without them.
TEST(PassedDescriptorsTest, AReceiverAtItsLimitGetsAClearError) {
  if (UnderUbsan()) GTEST_SKIP() << kUbsanNeedsDescriptors;
  ExpectChildPasses([] {
    auto [a, b] = Pipe();
    Message m;
    for (int i = 0; i < 8; ++i) {  // distinct files
      m.fds.emplace_back(static_cast<int>(syscall(SYS_memfd_create, "passed", MFD_CLOEXEC)));
      CHECK(m.fds.back().get() >= 0);
    }
    m.bytes = "eight descriptors";
    a.SendMessage(m);
    m.fds.clear();  // closes the sender's copies: the 8 now live only in the socket
    int top = 0;
    for (int fd = 0; fd < 4096; ++fd) {
      if (fcntl(fd, F_GETFD) >= 0) top = fd;
    }
    CHECK(SetNofile(static_cast<rlim_t>(top + 2)));  // room for one more, at most a few
    try {
      Message got = b.RecvMessage(10.0);
      fprintf(stderr, "received %zu descriptors\n", got.fds.size());
      CHECK(false);
    } catch (const Error& e) {
      CHECK(ClearLimitError(e, "RLIMIT_NOFILE"));
      CHECK(Contains(e.message(), "lost on arrival"));
    }
    // The rest of that message is still in the stream: the connection is closed, not left to
    // read it as a new frame.
    CHECK(b.closed());
    a.close();
    b.close();
    return 0;
  });
}

}  // namespace
}  // namespace forksafe::mp
