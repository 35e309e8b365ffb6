// Under a memory cgroup (issue 12, "the process around us"): a program that embeds forksafe may
// run in a container whose memory limit is far below the machine's. Sizes beyond the cgroup's room
// must fail at once with an error that names the cgroup (not set off its OOM killer, which takes
// the whole process), and the ordinary work (a Pool mapping over tensors, a Queue of shared
// tensors) must go on under the limit.
//
// The test makes a cgroup of its own (v1 or v2; tests/support/test_cgroup.h) with a 256 MiB limit
// and moves a forked child into it, or into a cgroup below it. That needs write access to
// /sys/fs/cgroup (root, outside a read-only mount: the target is tagged no-sandbox); where there is
// none it skips and says why.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/shared_value.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/memory_bounds.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"
#include "tests/support/test_cgroup.h"

namespace forksafe::mp {
namespace {

using device::Tensor;
using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;

constexpr uint64_t kLimit = uint64_t{256} << 20;

// A memory cgroup of this test's own (tests/support/test_cgroup.h: it kills what is left inside,
// removes the cgroup and restores what it changed, also when the test fails or was killed in an
// earlier run), limited to kLimit.
std::unique_ptr<forksafe::testing::TestCgroup> MakeMemoryCgroup(std::string* why) {
  auto cg = forksafe::testing::TestCgroup::Make("memory", why);
  if (cg == nullptr) return nullptr;
  const char* limit_file = cg->v2() ? "memory.max" : "memory.limit_in_bytes";
  if (!cg->Write(limit_file, std::to_string(kLimit))) {
    *why = "the cgroup " + cg->dir() + " takes no memory limit (" + limit_file + ": " +
           strerror(errno) + ")";
    return nullptr;  // its destructor removes it
  }
  return cg;
}

// Returns the code, or -1 when `f` did not throw, and the message in *what.
template <class F>
int CodeOf(F f, std::string* what) {
  try {
    f();
  } catch (const Error& e) {
    *what = e.what();
    return static_cast<int>(e.code());
  }
  return -1;
}

Tensor AddOne(Tensor t) {
  float* p = static_cast<float*>(t.data_ptr());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] += 1.f;
  return t;
}
FORKSAFE_ENTRY_POINT(AddOne);

// The body of the child that runs inside the cgroup; 0 when everything held.
int UnderTheLimit() {
  // 1. The bounds see the cgroup.
  bool seen = false;
  for (const auto& l : runtime::internal::MemoryLimits(runtime::internal::MemoryUse::kShared)) {
    if (l.name.find("cgroup") != std::string::npos && l.bytes <= kLimit) seen = true;
  }
  if (!seen) {
    fprintf(stderr, "MemoryLimits(kShared) does not list the cgroup's room\n");
    return 1;
  }
  // 2. Sizes beyond the room: kResourceExhausted naming the cgroup, at once.
  struct Case {
    const char* what;
    std::function<void()> f;
  };
  const std::vector<Case> cases = {
      {"Array<double>(2^27) (1 GiB)", [] { Array<double> a(size_t{1} << 27); }},
      {"SharedEmpty({2^28}) file_descriptor (1 GiB)",
       [] {
         set_sharing_strategy("file_descriptor");
         SharedEmpty({int64_t{1} << 28});
       }},
      {"SharedEmpty({2^28}) file_system (1 GiB)",
       [] {
         set_sharing_strategy("file_system");
         SharedEmpty({int64_t{1} << 28});
       }},
  };
  for (const Case& c : cases) {
    std::string msg;
    const int code = CodeOf(c.f, &msg);
    if (code != static_cast<int>(ErrorCode::kResourceExhausted) ||
        msg.find("cgroup") == std::string::npos) {
      fprintf(stderr, "%s: code %d, \"%s\" (wanted kResourceExhausted naming the cgroup)\n", c.what,
              code, msg.c_str());
      return 2;
    }
  }
  // 3. Work that fits goes on: a Pool over shared tensors, in every start method...
  set_sharing_strategy("file_descriptor");
  for (const char* method : {"fork", "spawn", "forkserver"}) {
    PoolOptions o;
    o.processes = 2;
    o.start_method = method;
    Pool pool(o);
    std::vector<Tensor> in;
    for (int i = 0; i < 32; ++i) in.push_back(Tensor::Full({65536}, static_cast<double>(i)));
    std::vector<Tensor> out = pool.map(&AddOne, in, 4);
    for (int i = 0; i < 32; ++i) {
      if (out[i].item<float>({65535}) != i + 1.f) {
        fprintf(stderr, "%s: result %d is wrong\n", method, i);
        return 3;
      }
    }
  }
  // ... and a Queue holding 1000 shared tensors (4 MiB) before any is read.
  Queue q;
  for (int i = 0; i < 1000; ++i) q.put(Tensor::Full({1024}, static_cast<double>(i)));
  for (int i = 0; i < 1000; ++i) {
    if (q.get<Tensor>(true, 10.0).item<float>({1023}) != static_cast<float>(i)) return 4;
  }
  return 0;
}

TEST(MemoryCgroup, BeyondItsRoomIsAClearErrorAndWorkUnderItGoesOn) {
  std::string why;
  std::unique_ptr<forksafe::testing::TestCgroup> cg = MakeMemoryCgroup(&why);
  if (cg == nullptr) GTEST_SKIP() << why;
  const forksafe::testing::TestCgroup* c = cg.get();
  auto r = forksafe::testing::RunInChild(
      [c] {
        if (!c->Join()) {
          fprintf(stderr, "cannot join the cgroup (%s): %s\n", c->dir().c_str(), strerror(errno));
          return 10;
        }
        return UnderTheLimit();
      },
      120s, 120);
  EXPECT_TRUE(r.ok()) << r.Describe()
                      << " (killed by signal 9: the cgroup's OOM killer, a size not refused)";
}

// Review of issue 14, finding 3: memory_bounds.cc located the cgroup itself and read only the
// process's cgroup and the hierarchy's root, so a limit on an ancestor (a container's or a job's
// cgroup, with the process in a cgroup below it) was never seen and a size beyond it set off the
// OOM killer. It now uses runtime/internal/cgroup.h, which walks every ancestor.
TEST(MemoryCgroup, ALimitOnAnAncestorCgroupIsSeen) {
  std::string why;
  std::unique_ptr<forksafe::testing::TestCgroup> cg = MakeMemoryCgroup(&why);
  if (cg == nullptr) GTEST_SKIP() << why;
  if (!cg->v2()) cg->Write("memory.use_hierarchy", "1");  // v1: limits apply to sub-cgroups
  const std::string inner = cg->MakeSub("inner");         // no limit of its own
  ASSERT_FALSE(inner.empty()) << strerror(errno);
  const forksafe::testing::TestCgroup* c = cg.get();
  auto r = forksafe::testing::RunInChild(
      [c, &inner] {
        if (!c->Join(inner)) {
          fprintf(stderr, "cannot join %s: %s\n", inner.c_str(), strerror(errno));
          return 10;
        }
        bool seen = false;
        for (const auto& l :
             runtime::internal::MemoryLimits(runtime::internal::MemoryUse::kShared)) {
          if (l.name.find(c->dir() + "/memory.") != std::string::npos && l.bytes <= kLimit) {
            seen = true;
          }
        }
        if (!seen) {
          fprintf(stderr, "MemoryLimits(kShared) does not list the room under %s\n",
                  c->dir().c_str());
          return 1;
        }
        std::string msg;
        const int code = CodeOf([] { Array<double> a(size_t{1} << 27); }, &msg);  // 1 GiB
        if (code != static_cast<int>(ErrorCode::kResourceExhausted) ||
            msg.find("cgroup") == std::string::npos) {
          fprintf(stderr, "Array<double>(2^27): code %d, \"%s\"\n", code, msg.c_str());
          return 2;
        }
        return 0;
      },
      60s, 60);
  EXPECT_TRUE(r.ok()) << r.Describe()
                      << " (killed by signal 9: the cgroup's OOM killer, a size not refused)";
}

}  // namespace
}  // namespace forksafe::mp
