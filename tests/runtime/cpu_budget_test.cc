// Default sizes that respect the process (issue 14, "Thread counts that respect the process"):
// ThreadPool num_threads = 0 and mp::Pool processes = 0 follow the affinity mask and the cgroup
// CPU quota (runtime/cpu_budget.h), FORKSAFE_NUM_THREADS and OMP_NUM_THREADS override them, and a
// malformed override is a clear error. Before the fix both used hardware_concurrency(): under a
// 1-CPU mask on a 2-CPU machine the default pool had 2 threads (DefaultsFollowAffinity failed).
//
// What changes the process (the mask, the environment, the cgroup) happens in a forked child.
// The parsers are tested on file contents and on fake /proc + /sys trees (internal/cgroup.h takes
// the root of every path), and the real quota on a cgroup of the test's own
// (tests/support/test_cgroup.h: v2 where its cpu controller is available, else v1; it leaves the
// machine as found), which needs root and a writable /sys/fs/cgroup: where there is none the test
// skips and says why.
//
// Review of issue 14: a malformed OMP_NUM_THREADS threw even when FORKSAFE_NUM_THREADS decided
// (it is now not read then, and alone it is a warning); the mask was the calling thread's, so a
// pinned worker got pools of 1 (APinnedThreadGetsTheProcessCount); the memory bounds had a
// cgroup locator of their own that missed ancestors and container roots (MemoryRoom tests).
#include <sched.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/mp/pool.h"
#include "forksafe/runtime/cpu_budget.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/cgroup.h"
#include "forksafe/runtime/internal/cpu_budget_parts.h"
#include "forksafe/runtime/internal/memory_bounds.h"
#include "forksafe/runtime/thread_pool.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"
#include "tests/support/test_cgroup.h"

namespace forksafe::runtime {
namespace {

using forksafe::testing::RunInChild;
using internal::CgroupDirChain;
using internal::CgroupMount;
using internal::ComputeCpuBudget;
using internal::CpuBudgetInputs;
using internal::CpusFromCfs;
using internal::CpusFromCpuMax;
using internal::ParseCgroupMounts;
using internal::ParseProcCgroup;
using internal::ParseThreadOverride;
using internal::ReadCpuQuota;
using namespace std::chrono_literals;

// ---- helpers ----------------------------------------------------------------------------------

bool WriteFile(const std::string& path, const std::string& text) {
  FILE* f = fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  const bool ok = fputs(text.c_str(), f) >= 0;
  return fclose(f) == 0 && ok;
}

// Restricts the calling process to its first allowed CPU.
bool PinToOneCpu() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return false;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) {
      CPU_ZERO(&set);
      CPU_SET(c, &set);
      return sched_setaffinity(0, sizeof set, &set) == 0;
    }
  }
  return false;
}

int MaskCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
}

// In a child: the default ThreadPool's and the default fork Pool's sizes must both be `want`.
// Returns 0, or a code after saying what differed.
int DefaultsAre(int want, const char* why) {
  ThreadPool pool;
  if (pool.num_threads() != want) {
    fprintf(stderr, "%s: default ThreadPool has %d threads, want %d (%s)\n", why,
            pool.num_threads(), want, GetCpuBudget().ToString().c_str());
    return 3;
  }
  mp::PoolOptions o;
  o.start_method = "fork";
  mp::Pool p(o);
  if (p.processes() != want) {
    fprintf(stderr, "%s: default Pool has %d processes, want %d\n", why, p.processes(), want);
    return 4;
  }
  return 0;
}

void ClearOverrides() {
  unsetenv(kForksafeNumThreadsEnv);
  unsetenv(kOmpNumThreadsEnv);
}

// What `f` writes on stderr (descriptor 2 goes to an unlinked file meanwhile; restored also when
// `f` throws).
std::string CaptureStderr(const std::function<void()>& f) {
  const char* base = getenv("TEST_TMPDIR");
  std::string path = std::string(base != nullptr ? base : "/tmp") + "/stderr_XXXXXX";
  const int fd = mkstemp(path.data());
  if (fd < 0) return "(cannot capture stderr: " + std::string(strerror(errno)) + ")";
  unlink(path.c_str());
  fflush(stderr);
  const int saved = dup(2);
  dup2(fd, 2);
  struct Restore {
    int fd, saved;
    ~Restore() {
      fflush(stderr);
      dup2(saved, 2);
      close(saved);
    }
  };
  {
    Restore restore{fd, saved};
    try {
      f();
    } catch (...) {
      close(fd);
      throw;
    }
  }
  std::string text;
  char buf[4096];
  ssize_t n;
  lseek(fd, 0, SEEK_SET);
  while ((n = read(fd, buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  close(fd);
  return text;
}

// The message of the Error `f` throws with kInvalidArgument; "" (and a failure) otherwise.
std::string InvalidArgumentOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something else: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

// A directory of the test's own under TEST_TMPDIR, removed (recursively) at the end.
class TempTree {
 public:
  TempTree() {
    const char* base = getenv("TEST_TMPDIR");
    std::string templ = std::string(base != nullptr ? base : "/tmp") + "/cpu_budget_XXXXXX";
    if (mkdtemp(templ.data()) != nullptr) root_ = templ;
  }
  ~TempTree() {
    if (!root_.empty()) {
      const std::string cmd = "rm -rf '" + root_ + "'";
      (void)!system(cmd.c_str());
    }
  }
  const std::string& root() const { return root_; }
  // Writes `text` to root + path, making the directories on the way.
  void Put(const std::string& path, const std::string& text) {
    std::string dir = root_;
    size_t start = 1;
    for (size_t at = path.find('/', start); at != std::string::npos; at = path.find('/', start)) {
      dir = root_ + path.substr(0, at);
      mkdir(dir.c_str(), 0755);
      start = at + 1;
    }
    ASSERT_TRUE(WriteFile(root_ + path, text)) << root_ + path;
  }

 private:
  std::string root_;
};

// ---- the defect: defaults follow the affinity mask --------------------------------------------

TEST(CpuBudgetTest, DefaultsFollowAffinity) {
  if (MaskCpus() < 2) GTEST_SKIP() << "needs 2 CPUs in the mask to show a difference";
  auto r = RunInChild(
      [] {
        ClearOverrides();
        if (!PinToOneCpu()) return 2;
        const CpuBudget b = GetCpuBudget();
        if (b.affinity_cpus != 1 || b.cpus != 1) {
          fprintf(stderr, "budget under a 1-CPU mask: %s\n", b.ToString().c_str());
          return 5;
        }
        return DefaultsAre(1, "1-CPU mask");
      },
      60s);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

TEST(CpuBudgetTest, TheWholeMaskIsUsedWhenNothingElseLimits) {
  const int mask = MaskCpus();
  const CpuBudget b = GetCpuBudget();
  EXPECT_EQ(b.affinity_cpus, mask) << b.ToString();
  EXPECT_GE(b.cpus, 1);
  EXPECT_LE(b.cpus, std::max(1, mask)) << b.ToString();
  if (getenv(kForksafeNumThreadsEnv) == nullptr && getenv(kOmpNumThreadsEnv) == nullptr) {
    EXPECT_EQ(b.cpus, b.quota_cpus > 0 ? std::min(mask, b.quota_cpus) : mask) << b.ToString();
  }
}

// ---- the overrides ----------------------------------------------------------------------------

TEST(CpuBudgetTest, ForksafeNumThreadsWinsOverOmpAndTheMask) {
  auto r = RunInChild(
      [] {
        ClearOverrides();
        if (!PinToOneCpu()) return 2;
        setenv(kForksafeNumThreadsEnv, "3", 1);
        setenv(kOmpNumThreadsEnv, "2", 1);
        if (GetCpuBudget().source != CpuBudgetSource::kForksafeNumThreads) return 5;
        return DefaultsAre(3, "FORKSAFE_NUM_THREADS=3 OMP_NUM_THREADS=2");
      },
      60s);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

TEST(CpuBudgetTest, OmpNumThreadsFirstNumberIsUsed) {
  auto r = RunInChild(
      [] {
        ClearOverrides();
        setenv(kOmpNumThreadsEnv, " 3 ,2,1", 1);
        setenv(kForksafeNumThreadsEnv, "", 1);  // empty: as if unset
        if (GetCpuBudget().source != CpuBudgetSource::kOmpNumThreads) return 5;
        return DefaultsAre(3, "OMP_NUM_THREADS=\" 3 ,2,1\"");
      },
      60s);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

TEST(CpuBudgetTest, OverrideValues) {
  EXPECT_EQ(ParseThreadOverride("V", nullptr, false), 0);
  EXPECT_EQ(ParseThreadOverride("V", "", false), 0);
  EXPECT_EQ(ParseThreadOverride("V", "  ", true), 0);
  EXPECT_EQ(ParseThreadOverride("V", "1", false), 1);
  EXPECT_EQ(ParseThreadOverride("V", " 12\n", false), 12);
  EXPECT_EQ(ParseThreadOverride("V", "65536", false), kMaxThreadOverride);
  EXPECT_EQ(ParseThreadOverride("V", "8,4,2", true), 8);
  EXPECT_EQ(ParseThreadOverride("V", "8 , 4", true), 8);
  for (const char* bad :
       {"0", "-2", "+2", "4x", "x4", "auto", "1.5", "65537", "99999999999999999999", "4,2"}) {
    const std::string what =
        InvalidArgumentOf([bad] { ParseThreadOverride("MY_VAR", bad, false); });
    EXPECT_NE(what.find("MY_VAR=\"" + std::string(bad) + "\""), std::string::npos) << what;
    EXPECT_NE(what.find("unset"), std::string::npos) << "says what to do: " << what;
  }
  for (const char* bad : {"4,", ",4", "4,0", "4,,2", "4;2", "0,4"}) {
    const std::string what = InvalidArgumentOf([bad] { ParseThreadOverride("OMP_X", bad, true); });
    EXPECT_NE(what.find("OMP_X=\"" + std::string(bad) + "\""), std::string::npos) << what;
    EXPECT_NE(what.find("comma-separated"), std::string::npos) << what;
  }
}

TEST(CpuBudgetTest, MalformedForksafeNumThreadsIsAClearErrorOfBothDefaults) {
  auto r = RunInChild(
      [] {
        for (const char* value : {"four", "0", "4,2", "-1"}) {
          ClearOverrides();
          setenv(kForksafeNumThreadsEnv, value, 1);
          setenv(kOmpNumThreadsEnv, "2", 1);  // valid, but ours is the one that decides
          const std::string needle = std::string(kForksafeNumThreadsEnv) + "=\"" + value + "\"";
          const std::string a = InvalidArgumentOf([] { ThreadPool pool; });
          const std::string b = InvalidArgumentOf([] {
            mp::PoolOptions o;
            o.start_method = "fork";
            mp::Pool p(o);
          });
          if (a.find(needle) == std::string::npos || b.find(needle) == std::string::npos) {
            fprintf(stderr, "want %s in both:\n  %s\n  %s\n", needle.c_str(), a.c_str(), b.c_str());
            return 3;
          }
          // An explicit size does not read the environment.
          ThreadPool sized(ThreadPoolOptions{2, "sized", 100ms});
          if (sized.num_threads() != 2) return 4;
        }
        return ::testing::Test::HasFailure() ? 5 : 0;
      },
      60s);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

// Review of issue 14, finding 1: a malformed OMP_NUM_THREADS threw even when a valid
// FORKSAFE_NUM_THREADS decided the count. It must not even be read then.
TEST(CpuBudgetTest, OmpNumThreadsIsNotReadWhenForksafeNumThreadsDecides) {
  auto r = RunInChild(
      [] {
        ClearOverrides();
        setenv(kForksafeNumThreadsEnv, "2", 1);
        for (const char* bad : {"0", "4,x", "auto"}) {
          setenv(kOmpNumThreadsEnv, bad, 1);
          CpuBudget b;
          std::string err;
          try {
            err = CaptureStderr([&b] { b = GetCpuBudget(); });
          } catch (const std::exception& e) {
            fprintf(stderr,
                    "OMP_NUM_THREADS=\"%s\" threw although FORKSAFE_NUM_THREADS=2 decides: %s\n",
                    bad, e.what());
            return 3;
          }
          if (b.cpus != 2 || b.source != CpuBudgetSource::kForksafeNumThreads) {
            fprintf(stderr, "OMP_NUM_THREADS=\"%s\": %s\n", bad, b.ToString().c_str());
            return 4;
          }
          if (!err.empty() || !b.warning.empty()) {
            fprintf(stderr, "OMP_NUM_THREADS=\"%s\" was parsed: \"%s\" \"%s\"\n", bad, err.c_str(),
                    b.warning.c_str());
            return 5;
          }
          if (DefaultsAre(2, "FORKSAFE_NUM_THREADS=2 with a malformed OMP_NUM_THREADS") != 0)
            return 6;
        }
        return 0;
      },
      60s);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

// Finding 1, the other half: OMP_NUM_THREADS belongs to another library. A malformed value alone
// is warned about once on stderr (what was wrong, what is used instead), and the default falls back
// to the affinity mask and quota, as if it were unset.
TEST(CpuBudgetTest, MalformedOmpNumThreadsAloneWarnsOnceAndFallsBackToTheCpus) {
  auto r = RunInChild(
      [] {
        ClearOverrides();
        const CpuBudget unset = GetCpuBudget();  // what the mask and the quota give
        setenv(kOmpNumThreadsEnv, "four", 1);
        CpuBudget first;
        CpuBudget second;
        int pool_threads = 0;
        int pool_processes = 0;
        std::string err;
        try {
          err = CaptureStderr([&] {
            first = GetCpuBudget();
            second = GetCpuBudget();
            ThreadPool pool;
            pool_threads = pool.num_threads();
            mp::PoolOptions o;
            o.start_method = "fork";
            mp::Pool p(o);
            pool_processes = p.processes();
          });
        } catch (const std::exception& e) {
          fprintf(stderr, "a malformed OMP_NUM_THREADS alone threw: %s\n", e.what());
          return 3;
        }
        if (first.cpus != unset.cpus || first.source != unset.source || second.cpus != unset.cpus ||
            pool_threads != unset.cpus || pool_processes != unset.cpus) {
          fprintf(stderr, "want %s; got %s, %s, pool %d, Pool %d\n", unset.ToString().c_str(),
                  first.ToString().c_str(), second.ToString().c_str(), pool_threads,
                  pool_processes);
          return 4;
        }
        const std::string needle = "OMP_NUM_THREADS=\"four\"";
        const size_t at = err.find(needle);
        if (at == std::string::npos || err.find(needle, at + 1) != std::string::npos ||
            err.find(unset.ToString()) == std::string::npos ||
            err.find(kForksafeNumThreadsEnv) == std::string::npos) {
          fprintf(stderr, "want one warning naming %s, the count used (%s) and %s; stderr:\n%s\n",
                  needle.c_str(), unset.ToString().c_str(), kForksafeNumThreadsEnv, err.c_str());
          return 5;
        }
        if (first.warning.find(needle) == std::string::npos) {
          fprintf(stderr, "CpuBudget::warning: \"%s\"\n", first.warning.c_str());
          return 6;
        }
        return 0;
      },
      60s);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

// Review of issue 14, finding 2: sched_getaffinity(0) reads the calling thread's mask. A thread
// that pinned itself (OpenMP's and many frameworks' workers do) then sized every pool it made to
// 1. The default must be the process's count, from whichever thread asks.
TEST(CpuBudgetTest, APinnedThreadGetsTheProcessCount) {
  if (MaskCpus() < 2) {
    GTEST_SKIP() << "needs >= 2 CPUs in the affinity mask (it has " << MaskCpus()
                 << "): a thread pinned to one CPU must differ from the process";
  }
  auto r = RunInChild(
      [] {
        ClearOverrides();
        const CpuBudget process = GetCpuBudget();
        int rc = 0;
        std::thread pinned([&process, &rc] {
          if (!PinToOneCpu() || MaskCpus() != 1) {
            rc = 2;
            return;
          }
          const CpuBudget b = GetCpuBudget();
          if (b.affinity_cpus != process.affinity_cpus || b.cpus != process.cpus) {
            fprintf(stderr, "from a thread pinned to 1 CPU: %s; the process: %s\n",
                    b.ToString().c_str(), process.ToString().c_str());
            rc = 5;
            return;
          }
          ThreadPool pool;
          if (pool.num_threads() != process.cpus) rc = 3;
        });
        pinned.join();
        return rc;
      },
      60s);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

// ---- the rules on made-up inputs --------------------------------------------------------------

TEST(CpuBudgetTest, ComputeTakesTheSmallerOfMaskAndQuota) {
  CpuBudgetInputs in;
  in.affinity_cpus = 8;
  in.hardware_cpus = 64;
  EXPECT_EQ(ComputeCpuBudget(in).cpus, 8);
  EXPECT_EQ(ComputeCpuBudget(in).source, CpuBudgetSource::kAffinity);
  in.quota = {3, "/sys/fs/cgroup/a/cpu.max"};
  CpuBudget b = ComputeCpuBudget(in);
  EXPECT_EQ(b.cpus, 3);
  EXPECT_EQ(b.source, CpuBudgetSource::kCgroupQuota);
  EXPECT_NE(b.ToString().find("/sys/fs/cgroup/a/cpu.max"), std::string::npos) << b.ToString();
  in.quota = {16, "q"};
  EXPECT_EQ(ComputeCpuBudget(in).cpus, 8);
  EXPECT_EQ(ComputeCpuBudget(in).source, CpuBudgetSource::kAffinity);
  in.affinity_cpus = 0;  // mask unreadable: the machine, still under the quota
  EXPECT_EQ(ComputeCpuBudget(in).cpus, 16);
  in.quota = {};
  EXPECT_EQ(ComputeCpuBudget(in).cpus, 64);
  EXPECT_EQ(ComputeCpuBudget(in).source, CpuBudgetSource::kHardware);
  in.hardware_cpus = 0;  // nothing known: 1
  EXPECT_EQ(ComputeCpuBudget(in).cpus, 1);
  in.omp_num_threads = "5,1";
  EXPECT_EQ(ComputeCpuBudget(in).cpus, 5);
  in.forksafe_num_threads = "7";
  EXPECT_EQ(ComputeCpuBudget(in).cpus, 7);
  EXPECT_EQ(ComputeCpuBudget(in).source, CpuBudgetSource::kForksafeNumThreads);
  // FORKSAFE_NUM_THREADS decides: a malformed OMP_NUM_THREADS is not read.
  in.omp_num_threads = "auto";
  b = ComputeCpuBudget(in);
  EXPECT_EQ(b.cpus, 7);
  EXPECT_TRUE(b.warning.empty()) << b.warning;
  // Alone, it is ignored with a warning: the CPUs decide.
  in.forksafe_num_threads = nullptr;
  in.affinity_cpus = 6;
  in.quota = {4, "/sys/fs/cgroup/q/cpu.max"};
  b = ComputeCpuBudget(in);
  EXPECT_EQ(b.cpus, 4);
  EXPECT_EQ(b.source, CpuBudgetSource::kCgroupQuota);
  EXPECT_NE(b.warning.find("OMP_NUM_THREADS=\"auto\""), std::string::npos) << b.warning;
  EXPECT_NE(b.warning.find(b.ToString()), std::string::npos) << b.warning;
  // Ours stays an error.
  in.forksafe_num_threads = "auto";
  EXPECT_NE(
      InvalidArgumentOf([&in] { ComputeCpuBudget(in); }).find("FORKSAFE_NUM_THREADS=\"auto\""),
      std::string::npos);
}

TEST(CgroupParseTest, CpuMax) {
  EXPECT_EQ(CpusFromCpuMax("max 100000\n"), 0);
  EXPECT_EQ(CpusFromCpuMax("max"), 0);
  EXPECT_EQ(CpusFromCpuMax("100000 100000\n"), 1);
  EXPECT_EQ(CpusFromCpuMax("150000 100000"), 2);  // 1.5 CPUs: rounded up
  EXPECT_EQ(CpusFromCpuMax("50000 100000"), 1);
  EXPECT_EQ(CpusFromCpuMax("400000 100000"), 4);
  EXPECT_EQ(CpusFromCpuMax("1000 100000"), 1);            // 1% of a CPU is still 1 thread
  EXPECT_EQ(CpusFromCpuMax("200000"), 2);                 // the default period
  EXPECT_EQ(CpusFromCpuMax("9223372036854775807 1"), 0);  // beyond any machine: none
  for (const char* bad : {"", "\n", "abc 100000", "100000 0", "100000 -5", "-1 100000", "0 100000",
                          "1 2 3", "10000x 100000"}) {
    EXPECT_EQ(CpusFromCpuMax(bad), -1) << "\"" << bad << "\"";
  }
}

TEST(CgroupParseTest, Cfs) {
  EXPECT_EQ(CpusFromCfs("-1\n", "100000\n"), 0);
  EXPECT_EQ(CpusFromCfs("-1", ""), 0);
  EXPECT_EQ(CpusFromCfs("100000\n", "100000\n"), 1);
  EXPECT_EQ(CpusFromCfs("250000", "100000"), 3);
  EXPECT_EQ(CpusFromCfs("", "100000"), -1);
  EXPECT_EQ(CpusFromCfs("0", "100000"), -1);
  EXPECT_EQ(CpusFromCfs("100000", ""), -1);
  EXPECT_EQ(CpusFromCfs("100000", "0"), -1);
}

TEST(CgroupParseTest, ProcSelfCgroup) {
  const auto m = ParseProcCgroup(
      "12:cpu,cpuacct:/user.slice/job\n4:memory:/x\n1:name=systemd:/s\n0::/user.slice/job\n"
      "garbage\n3::/not-v2\n5:pids:relative\n");
  ASSERT_EQ(m.size(), 4u);
  EXPECT_FALSE(m[0].v2);
  EXPECT_EQ(m[0].controllers, (std::vector<std::string>{"cpu", "cpuacct"}));
  EXPECT_EQ(m[0].path, "/user.slice/job");
  EXPECT_EQ(m[2].controllers, (std::vector<std::string>{"name=systemd"}));
  EXPECT_TRUE(m[3].v2);
  EXPECT_EQ(m[3].path, "/user.slice/job");
}

TEST(CgroupParseTest, Mountinfo) {
  const auto m = ParseCgroupMounts(
      "24 30 0:22 / /sys rw,nosuid - sysfs sysfs rw\n"
      "35 24 0:30 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755\n"
      "36 35 0:31 / /sys/fs/cgroup/unified rw shared:10 - cgroup2 cgroup2 rw,nsdelegate\n"
      "40 35 0:35 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw shared:15 master:3 - cgroup cgroup "
      "rw,cpu,cpuacct\n"
      "41 35 0:36 / /sys/fs/cgroup/my\\040dir rw - cgroup cgroup rw,memory\n"
      "42 35 0:37 / /broken rw - cgroup2\n");
  ASSERT_EQ(m.size(), 3u);
  EXPECT_TRUE(m[0].v2);
  EXPECT_EQ(m[0].mount_point, "/sys/fs/cgroup/unified");
  EXPECT_FALSE(m[1].v2);
  EXPECT_EQ(m[1].root, "/docker/abc");
  EXPECT_EQ(m[1].mount_point, "/sys/fs/cgroup/cpu,cpuacct");
  EXPECT_EQ(m[1].controllers, (std::vector<std::string>{"rw", "cpu", "cpuacct"}));
  EXPECT_EQ(m[2].mount_point, "/sys/fs/cgroup/my dir");  // \040 decoded
}

TEST(CgroupParseTest, DirChainWalksUpToTheMount) {
  const CgroupMount v2{true, "/", "/sys/fs/cgroup", {}};
  EXPECT_EQ(
      CgroupDirChain("/R", v2, "/a/b"),
      (std::vector<std::string>{"/R/sys/fs/cgroup/a/b", "/R/sys/fs/cgroup/a", "/R/sys/fs/cgroup"}));
  EXPECT_EQ(CgroupDirChain("", v2, "/"), (std::vector<std::string>{"/sys/fs/cgroup"}));
  const CgroupMount docker{false, "/docker/abc", "/sys/fs/cgroup/cpu", {"cpu"}};
  EXPECT_EQ(CgroupDirChain("", docker, "/docker/abc"),
            (std::vector<std::string>{"/sys/fs/cgroup/cpu"}));
  EXPECT_EQ(CgroupDirChain("", docker, "/docker/abc/x"),
            (std::vector<std::string>{"/sys/fs/cgroup/cpu/x", "/sys/fs/cgroup/cpu"}));
  EXPECT_TRUE(CgroupDirChain("", docker, "/docker/abcd").empty());  // not below the root
  EXPECT_TRUE(CgroupDirChain("", docker, "/other").empty());
  EXPECT_TRUE(CgroupDirChain("", v2, "/../x").empty());  // outside this cgroup namespace
}

// ---- fake /proc + /sys trees ------------------------------------------------------------------

TEST(CgroupTreeTest, V2TheMostRestrictiveAncestorWins) {
  TempTree t;
  ASSERT_FALSE(t.root().empty());
  t.Put("/proc/self/mountinfo",
        "30 1 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n");
  t.Put("/proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  t.Put("/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n");
  t.Put("/sys/fs/cgroup/kubepods/pod1/cpu.max", "250000 100000\n");
  t.Put("/sys/fs/cgroup/kubepods/cpu.max", "400000 100000\n");
  internal::CpuQuota q = ReadCpuQuota(t.root());
  EXPECT_EQ(q.cpus, 3);
  EXPECT_EQ(q.file, "/sys/fs/cgroup/kubepods/pod1/cpu.max");
  t.Put("/sys/fs/cgroup/kubepods/cpu.max", "100000 100000\n");  // the grandparent is tighter
  q = ReadCpuQuota(t.root());
  EXPECT_EQ(q.cpus, 1);
  EXPECT_EQ(q.file, "/sys/fs/cgroup/kubepods/cpu.max");
  t.Put("/sys/fs/cgroup/kubepods/cpu.max", "garbage\n");  // skipped, never guessed
  EXPECT_EQ(ReadCpuQuota(t.root()).cpus, 3);
}

TEST(CgroupTreeTest, HybridV1CpuControllerUnderAContainerRoot) {
  TempTree t;
  ASSERT_FALSE(t.root().empty());
  // Like this CI machine: v2 without controllers at /sys/fs/cgroup/unified, v1 cpu beside it;
  // like docker without a cgroup namespace: the v1 mount's root is the container's cgroup.
  t.Put("/proc/self/mountinfo",
        "36 35 0:31 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
        "40 35 0:35 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n");
  t.Put("/proc/self/cgroup", "3:cpu,cpuacct:/docker/abc/job\n0::/\n");
  t.Put("/sys/fs/cgroup/unified/cpu.max", "100000 100000\n");  // not this process's: "0::/" is
  t.Put("/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us", "-1\n");
  t.Put("/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us", "100000\n");
  t.Put("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "150000\n");
  t.Put("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  // The v2 root's cpu.max above does apply (it is the process's v2 cgroup, "/"): 1 CPU.
  internal::CpuQuota q = ReadCpuQuota(t.root());
  EXPECT_EQ(q.cpus, 1);
  EXPECT_EQ(q.file, "/sys/fs/cgroup/unified/cpu.max");
  t.Put("/sys/fs/cgroup/unified/cpu.max", "max 100000\n");
  q = ReadCpuQuota(t.root());
  EXPECT_EQ(q.cpus, 2);  // 1.5 CPUs of the container, rounded up
  EXPECT_EQ(q.file, "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us");
}

TEST(CgroupTreeTest, NoMountinfoFallsBackToTheUsualPlacesAndNothingIsNone) {
  TempTree t;
  ASSERT_FALSE(t.root().empty());
  EXPECT_EQ(ReadCpuQuota(t.root()).cpus, 0);  // nothing readable: no quota
  t.Put("/proc/self/cgroup", "0::/a\n");
  t.Put("/sys/fs/cgroup/a/cpu.max", "300000 100000\n");
  EXPECT_EQ(ReadCpuQuota(t.root()).cpus, 3);
}

TEST(CgroupTreeTest, MemoryRoomIsTheTightestAncestorUnderAContainerRoot) {
  TempTree t;
  ASSERT_FALSE(t.root().empty());
  // v1 memory mounted with the container's cgroup as its root (docker without a cgroup
  // namespace): the old locator of memory_bounds.cc read /sys/fs/cgroup/memory/docker/abc/job,
  // which does not exist in the container, and missed every limit; it also read only the
  // process's cgroup and the root, never the ancestors between.
  t.Put("/proc/self/mountinfo",
        "41 35 0:36 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n");
  t.Put("/proc/self/cgroup", "4:memory:/docker/abc/job/step\n0::/\n");
  const std::string m = "/sys/fs/cgroup/memory";
  t.Put(m + "/job/step/memory.limit_in_bytes", "9223372036854771712\n");  // v1: no limit
  t.Put(m + "/job/step/memory.usage_in_bytes", "1000\n");
  t.Put(m + "/job/memory.limit_in_bytes", "300000\n");
  t.Put(m + "/job/memory.usage_in_bytes", "100000\n");
  t.Put(m + "/memory.limit_in_bytes", "1000000\n");
  t.Put(m + "/memory.usage_in_bytes", "500000\n");
  internal::MemoryCgroupRoom room = internal::ReadMemoryCgroupRoom(t.root());
  EXPECT_EQ(room.bytes, 200000u);
  EXPECT_EQ(room.file, m + "/job/memory.limit_in_bytes");
  t.Put(m + "/memory.usage_in_bytes", "900000\n");  // the container's root is tighter now
  room = internal::ReadMemoryCgroupRoom(t.root());
  EXPECT_EQ(room.bytes, 100000u);
  EXPECT_EQ(room.file, m + "/memory.limit_in_bytes");
  // v2: memory.max - memory.current; "max" is no limit.
  TempTree v2;
  ASSERT_FALSE(v2.root().empty());
  v2.Put("/proc/self/mountinfo", "30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  v2.Put("/proc/self/cgroup", "0::/a/b\n");
  v2.Put("/sys/fs/cgroup/a/b/memory.max", "max\n");
  v2.Put("/sys/fs/cgroup/a/b/memory.current", "10\n");
  EXPECT_EQ(internal::ReadMemoryCgroupRoom(v2.root()).bytes, UINT64_MAX);
  v2.Put("/sys/fs/cgroup/a/memory.max", "4096\n");
  v2.Put("/sys/fs/cgroup/a/memory.current", "1024\n");
  room = internal::ReadMemoryCgroupRoom(v2.root());
  EXPECT_EQ(room.bytes, 3072u);
  EXPECT_EQ(room.file, "/sys/fs/cgroup/a/memory.max");
}

// ---- a real cgroup quota ----------------------------------------------------------------------

TEST(CpuBudgetTest, DefaultsFollowACgroupQuota) {
  if (MaskCpus() < 2) GTEST_SKIP() << "needs 2 CPUs in the mask to show a 1-CPU quota";
  std::string why;
  // A cpu cgroup of the test's own (tests/support/test_cgroup.h: it restores what it changed and
  // removes the cgroup, also when the test fails).
  std::unique_ptr<forksafe::testing::TestCgroup> cg =
      forksafe::testing::TestCgroup::Make("cpu", &why);
  if (cg == nullptr) GTEST_SKIP() << why;
  const bool quota_set = cg->v2() ? cg->Write("cpu.max", "100000 100000")
                                  : cg->Write("cpu.cfs_period_us", "100000") &&
                                        cg->Write("cpu.cfs_quota_us", "100000");
  ASSERT_TRUE(quota_set) << "the cgroup " << cg->dir()
                         << " takes no CPU quota: " << strerror(errno);
  const forksafe::testing::TestCgroup* c = cg.get();
  auto r = RunInChild(
      [c] {
        ClearOverrides();
        if (!c->Join()) {
          fprintf(stderr, "cannot join %s: %s\n", c->dir().c_str(), strerror(errno));
          return 2;
        }
        const CpuBudget b = GetCpuBudget();
        if (b.cpus != 1 || b.source != CpuBudgetSource::kCgroupQuota ||
            b.quota_file.find(c->dir()) != 0) {
          fprintf(stderr, "budget in a 1-CPU cgroup (%s): %s\n", c->dir().c_str(),
                  b.ToString().c_str());
          return 5;
        }
        return DefaultsAre(1, "a cgroup with a 1-CPU quota");
      },
      60s);
  EXPECT_TRUE(r.ok()) << r.Describe();
}

}  // namespace
}  // namespace forksafe::runtime
