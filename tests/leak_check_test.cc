// The leak check of tests/support/leak_check.h, tested: each kind of leak (descriptor, running
// child, zombie, /dev/shm name, shared mapping, a shared tensor kept alive) is made on purpose in
// a sub-run of this binary (the LeakSelfTest cases, registered only when FORKSAFE_LEAK_SELFTEST is
// set), and the sub-run must fail that test with a message naming the resource. Clean tests, the
// ExpectLeak opt-out, and the servers the library keeps for the life of the process (fork server,
// shm manager) must pass; a kept resource the library abandons must not.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/runtime/internal/kept_resources.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"
#include "tests/support/leak_check.h"

extern char** environ;

namespace forksafe::testing {
namespace {

using namespace std::chrono_literals;

// ---- the sub-run: tests that leak on purpose ------------------------------------------------

// A child that lives until this process exits (or 30 s pass).
pid_t ForkSleeper() {
  fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    alarm(30);
    for (;;) pause();
  }
  return pid;
}

void ExitNow(int) { _exit(0); }
FORKSAFE_ENTRY_POINT(ExitNow);

// A stand-in for a server the library keeps: the registry says what it keeps.
struct FakeServer {
  pid_t pid = 0;
  int fd = -1;
};
FakeServer g_fake_server;

void StartFakeServer(const char* label) {
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  close(p[1]);
  g_fake_server.fd = p[0];
  g_fake_server.pid = ForkSleeper();
  ASSERT_GT(g_fake_server.pid, 0);
  printf("%s: pid %d fd %d\n", label, g_fake_server.pid, g_fake_server.fd);
}

device::Tensor& KeptTensor() {
  static auto* t = new device::Tensor();  // outlives the test on purpose
  return *t;
}

const std::vector<std::pair<const char*, std::function<void()>>>& SelfTests() {
  static const auto* tests = new std::vector<std::pair<const char*, std::function<void()>>>{
      {"LeaksFd", [] { ASSERT_GE(open("/dev/null", O_RDONLY | O_CLOEXEC), 0); }},
      {"LeaksRunningChild", [] { printf("leaked child %d\n", ForkSleeper()); }},
      {"LeaksZombie",
       [] {
         fflush(nullptr);
         const pid_t pid = fork();
         if (pid == 0) _exit(0);
         siginfo_t info;
         ASSERT_EQ(waitid(P_PID, pid, &info, WEXITED | WNOWAIT), 0);  // exited, not reaped
         printf("leaked zombie %d\n", pid);
       }},
      {"LeaksShmName",
       [] {
         // Unique: sub-runs in other sandboxes may have the same pid.
         const std::string name = "/forksafe_" + std::to_string(getpid()) + "_leakselftest" +
                                  std::to_string(std::random_device{}());
         const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
         ASSERT_GE(fd, 0) << name << ": " << strerror(errno);
         close(fd);
         printf("leaked name %s\n", name.c_str() + 1);
       }},
      {"LeaksMapping",
       [] {
         const int fd = memfd_create("leak-selftest", MFD_CLOEXEC);
         ASSERT_GE(fd, 0);
         ASSERT_EQ(ftruncate(fd, 4096), 0);
         ASSERT_NE(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), MAP_FAILED);
         close(fd);
       }},
      {"LeaksSharedTensor",
       [] {
         mp::set_sharing_strategy("file_system");
         KeptTensor() = mp::SharedEmpty({1024});
         mp::set_sharing_strategy("file_descriptor");
       }},
      {"Clean",
       [] {
         const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
         close(fd);
         const ChildResult r = RunInChild([] { return 0; });
         EXPECT_TRUE(r.ok()) << r.Describe();
         mp::set_sharing_strategy("file_system");
         { device::Tensor t = mp::SharedEmpty({1024}); }  // the arena caches it; not a leak
         mp::set_sharing_strategy("file_descriptor");
         { device::Tensor t = mp::SharedEmpty({1024}); }
       }},
      {"ExpectedLeak",
       [] {
         ExpectLeak("deliberate: checks the opt-out");
         ASSERT_GE(open("/dev/null", O_RDONLY | O_CLOEXEC), 0);
       }},
      {"KeptFirst", [] { StartFakeServer("fake server 1"); }},
      // Replaces the first server in the registry without stopping it: the library lost it.
      {"KeptReplaced", [] { StartFakeServer("fake server 2"); }},
      {"LibForkServerFirst",
       [] {
         mp::Process p(mp::ProcessOptions{"", false, "forkserver"}, &ExitNow, 0);
         p.start();
         ASSERT_TRUE(p.join(30.0));
         EXPECT_EQ(p.exitcode(), 0);
       }},
      {"LibForkServerAgain",
       [] {
         mp::Process p(mp::ProcessOptions{"", false, "forkserver"}, &ExitNow, 0);
         p.start();
         ASSERT_TRUE(p.join(30.0));
       }},
      {"LibShmManager",
       [] {
         mp::set_sharing_strategy("file_system");
         { device::Tensor t = mp::SharedEmpty({1 << 20}); }  // starts the manager (kept)
         mp::set_sharing_strategy("file_descriptor");
       }},
  };
  return *tests;
}

class SelfTest : public ::testing::Test {
 public:
  explicit SelfTest(std::function<void()> body) : body_(std::move(body)) {}
  void TestBody() override { body_(); }

 private:
  std::function<void()> body_;
};

const bool g_registered = [] {
  if (getenv("FORKSAFE_LEAK_SELFTEST") == nullptr) return false;
  runtime::internal::RegisterKeptResources("leak_selftest_server",
                                           [](runtime::internal::KeptResources& k) {
                                             k.AddFd(g_fake_server.fd, "fake server socket");
                                             k.AddChild(g_fake_server.pid, "fake server");
                                           });
  for (const auto& [name, body] : SelfTests()) {
    std::function<void()> b = body;
    ::testing::RegisterTest("LeakSelfTest", name, nullptr, nullptr, __FILE__, __LINE__,
                            [b]() -> ::testing::Test* { return new SelfTest(b); });
  }
  return true;
}();

// ---- the checks: run the sub-run, read what it said ------------------------------------------

struct SubRun {
  pid_t pid = 0;
  ChildResult result;
  std::string output;
};

// Runs this binary with `filter` (LeakSelfTest cases) and FORKSAFE_LEAK_SELFTEST=1; stdout and
// stderr go to an unlinked file that is read back. At most 60 s.
SubRun RunSelf(const std::string& filter) {
  SubRun run;
  const char* dir = getenv("TEST_TMPDIR");
  std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/leak_selftest_XXXXXX";
  const int out = mkostemp(path.data(), O_CLOEXEC);
  if (out < 0) {
    ADD_FAILURE() << "mkostemp: " << strerror(errno);
    return run;
  }
  unlink(path.c_str());
  // Bazel's variables would make the sub-run write this test's XML report, shard files, etc.
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (key == "XML_OUTPUT_FILE" || key == "GTEST_OUTPUT" || key == "TEST_PREMATURE_EXIT_FILE" ||
        key == "TEST_SHARD_STATUS_FILE" || key == "TEST_TOTAL_SHARDS" ||
        key == "TEST_SHARD_INDEX" || key.rfind("GTEST_", 0) == 0 ||
        key == "TEST_WARNINGS_OUTPUT_FILE") {
      continue;
    }
    env_storage.push_back(kv);
  }
  env_storage.push_back("FORKSAFE_LEAK_SELFTEST=1");
  std::vector<char*> envp;
  for (std::string& s : env_storage) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string arg0 = "leak_check_test", arg1 = "--gtest_filter=" + filter,
              arg2 = "--gtest_color=no";
  char* argv[] = {arg0.data(), arg1.data(), arg2.data(), nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out, 1);
  posix_spawn_file_actions_adddup2(&fa, out, 2);
  const int rc = posix_spawn(&run.pid, "/proc/self/exe", &fa, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ADD_FAILURE() << "posix_spawn: " << strerror(rc);
    close(out);
    return run;
  }
  run.result = WaitChild(run.pid, 60s);
  char buf[4096];
  off_t off = 0;
  for (ssize_t n; (n = pread(out, buf, sizeof(buf), off)) > 0; off += n) run.output.append(buf, n);
  close(out);
  return run;
}

bool Has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

// The line of `text` that contains `what` ("" if none).
std::string LineWith(const std::string& text, const std::string& what) {
  const size_t at = text.find(what);
  if (at == std::string::npos) return "";
  const size_t begin = text.rfind('\n', at), end = text.find('\n', at);
  return text.substr(begin == std::string::npos ? 0 : begin + 1,
                     end == std::string::npos ? std::string::npos : end - begin - 1);
}

// Expects the sub-run of `test` to fail it with a leak report that contains `what`.
void ExpectReported(const std::string& test, const std::string& what, const SubRun& run) {
  EXPECT_TRUE(run.result.exited && run.result.exit_code == 1) << run.result.Describe();
  EXPECT_TRUE(Has(run.output, "[  FAILED  ] LeakSelfTest." + test)) << run.output;
  EXPECT_TRUE(Has(run.output, "forksafe leak check: LeakSelfTest." + test + " left behind"))
      << run.output;
  EXPECT_TRUE(Has(run.output, what)) << "expected \"" << what << "\" in:\n" << run.output;
}

int PidAfter(const std::string& text, const std::string& label) {
  const std::string line = LineWith(text, label);
  return line.empty() ? -1 : atoi(line.c_str() + line.find(label) + label.size());
}

TEST(LeakCheck, ReportsALeakedDescriptor) {
  const SubRun run = RunSelf("LeakSelfTest.LeaksFd");
  ExpectReported("LeaksFd", "-> /dev/null", run);
  EXPECT_TRUE(Has(LineWith(run.output, "-> /dev/null"), "open file descriptor ")) << run.output;
}

TEST(LeakCheck, ReportsALeakedRunningChild) {
  const SubRun run = RunSelf("LeakSelfTest.LeaksRunningChild");
  const int pid = PidAfter(run.output, "leaked child ");
  ASSERT_GT(pid, 0) << run.output;
  ExpectReported("LeaksRunningChild", "child process " + std::to_string(pid) + " (", run);
}

TEST(LeakCheck, ReportsAZombie) {
  const SubRun run = RunSelf("LeakSelfTest.LeaksZombie");
  const int pid = PidAfter(run.output, "leaked zombie ");
  ASSERT_GT(pid, 0) << run.output;
  ExpectReported("LeaksZombie", "child process " + std::to_string(pid) + " (", run);
  EXPECT_TRUE(Has(LineWith(run.output, "child process " + std::to_string(pid)), "zombie"))
      << run.output;
}

TEST(LeakCheck, ReportsADevShmName) {
  const SubRun run = RunSelf("LeakSelfTest.LeaksShmName");
  const std::string line = LineWith(run.output, "leaked name ");
  ASSERT_FALSE(line.empty()) << run.output;
  const std::string name = line.substr(line.find("leaked name ") + 12);
  ASSERT_EQ(name.rfind("forksafe_" + std::to_string(run.pid) + "_leakselftest", 0), 0u) << name;
  shm_unlink(("/" + name).c_str());  // the sub-run left it on purpose
  ExpectReported("LeaksShmName", "/dev/shm entry " + name, run);
}

TEST(LeakCheck, ReportsASharedMapping) {
  const SubRun run = RunSelf("LeakSelfTest.LeaksMapping");
  ExpectReported("LeaksMapping", "/memfd:leak-selftest", run);
  EXPECT_TRUE(Has(LineWith(run.output, "/memfd:leak-selftest"), "shared mapping ")) << run.output;
  EXPECT_FALSE(Has(run.output, "open file descriptor")) << run.output;
}

TEST(LeakCheck, ReportsASharedTensorKeptAlive) {
  const SubRun run = RunSelf("LeakSelfTest.LeaksSharedTensor");
  const std::string prefix = "forksafe_" + std::to_string(run.pid) + "_";
  ExpectReported("LeaksSharedTensor", "/dev/shm entry " + prefix, run);
  EXPECT_TRUE(Has(LineWith(run.output, "shared mapping "), "/dev/shm/" + prefix)) << run.output;
  EXPECT_TRUE(Has(LineWith(run.output, "open file descriptor "), "/dev/shm/" + prefix))
      << run.output;
}

TEST(LeakCheck, CleanTestsAndCachesPass) {
  const SubRun run = RunSelf("LeakSelfTest.Clean");
  EXPECT_TRUE(run.result.ok()) << run.result.Describe() << "\n" << run.output;
  EXPECT_TRUE(Has(run.output, "[       OK ] LeakSelfTest.Clean")) << run.output;
  EXPECT_TRUE(Has(run.output, "1 test(s) checked, 0 leaked")) << run.output;
}

TEST(LeakCheck, ExpectLeakOptsOutWithItsReason) {
  const SubRun run = RunSelf("LeakSelfTest.ExpectedLeak");
  EXPECT_TRUE(run.result.ok()) << run.result.Describe() << "\n" << run.output;
  EXPECT_TRUE(Has(run.output, "as it expects (deliberate: checks the opt-out)")) << run.output;
  EXPECT_TRUE(Has(run.output, "0 leaked, 1 leaked as expected")) << run.output;
}

// A server the library keeps is not the leak of the test that started it; a second one that
// replaces it while the first still runs is: the first is reported as abandoned.
TEST(LeakCheck, KeptServerIsNotALeakButAnAbandonedOneIs) {
  const SubRun run = RunSelf("LeakSelfTest.KeptFirst:LeakSelfTest.KeptReplaced");
  EXPECT_TRUE(Has(run.output, "[       OK ] LeakSelfTest.KeptFirst")) << run.output;
  const int first = PidAfter(run.output, "fake server 1: pid ");
  const int second = PidAfter(run.output, "fake server 2: pid ");
  ASSERT_GT(first, 0) << run.output;
  ASSERT_GT(second, 0) << run.output;
  ExpectReported("KeptReplaced", "child process " + std::to_string(first) + " (", run);
  EXPECT_TRUE(Has(LineWith(run.output, "child process " + std::to_string(first)),
                  "the fake server that the library kept before this test, abandoned"))
      << run.output;
  EXPECT_TRUE(Has(run.output, "the fake server socket that the library kept")) << run.output;
  EXPECT_FALSE(Has(run.output, "child process " + std::to_string(second) + " ")) << run.output;
}

// The real servers: the fork server and the shm manager live as long as the process, and each
// test that starts or reuses them passes.
TEST(LeakCheck, LibraryServersAreKeptNotLeaked) {
  const SubRun run = RunSelf("LeakSelfTest.Lib*");
  EXPECT_TRUE(run.result.ok()) << run.result.Describe() << "\n" << run.output;
  EXPECT_TRUE(Has(run.output, "3 test(s) checked, 0 leaked")) << run.output;
}

// The body of a forked child is checked too, against the child's state right after the fork.
TEST(LeakCheck, RunInChildReportsWhatTheBodyLeaves) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ASan builds do not check child bodies (see tests/support/child_process.cc: "
                  "gcc 12's ASan allocator is not fork-safe)";
#endif
  const ChildResult leaky = RunInChild([] { return open("/dev/null", O_RDONLY) >= 0 ? 0 : 1; });
  EXPECT_TRUE(leaky.exited && leaky.exit_code == kChildLeakExitCode) << leaky.Describe();
  const ChildResult clean = RunInChild([] {
    const int fd = open("/dev/null", O_RDONLY);
    close(fd);
    const ChildResult inner = RunInChild([] { return 0; });  // reaped: not a leak
    return inner.ok() ? 0 : 1;
  });
  EXPECT_TRUE(clean.ok()) << clean.Describe();
  const ChildResult expected = RunInChild([] {
    ExpectLeak("deliberate: checks the opt-out in a child");
    return open("/dev/null", O_RDONLY) >= 0 ? 0 : 1;
  });
  EXPECT_TRUE(expected.ok()) << expected.Describe();
}

}  // namespace
}  // namespace forksafe::testing
