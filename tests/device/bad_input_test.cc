// Bad input to the device layer (docs/reliability.md, "Bad input"): every size of the public API
// is overflow-checked and bounded by what the system can give before memory is committed, and
// each call throws the code its header documents, with a message naming the value. Absurd sizes
// run in a bounded child (tests/support/bounded_child.h), so a regression cannot take the machine
// down.
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "forksafe/device/cpu_backend.h"
#include "forksafe/device/registry.h"
#include "forksafe/device/sim_backend.h"
#include "forksafe/device/tensor.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/memory_bounds.h"
#include "gtest/gtest.h"
#include "tests/support/bad_call.h"

namespace forksafe::device {
namespace {

using runtime::Error;
using runtime::ErrorCode;
using runtime::internal::CheckedRoundUp;
using runtime::internal::CheckMemoryAgainst;
using runtime::internal::MemoryLimit;
using runtime::internal::RoundUpOrThrow;

constexpr size_t kMax = std::numeric_limits<size_t>::max();

using forksafe::testing::BadCall;
using forksafe::testing::BadCallVerdict;

std::string CheckRows(const std::vector<BadCall>& rows) {
  return forksafe::testing::CheckBadCalls(rows, /*bounded=*/true);
}

TEST(CheckedRoundUp, NeverWraps) {
  struct Row {
    size_t n, align;
    bool ok;
    size_t out;
  };
  const Row rows[] = {
      {0, 64, true, 0},
      {1, 64, true, 64},
      {64, 64, true, 64},
      {65, 64, true, 128},
      {kMax - 63, 64, true, kMax - 63},  // already a multiple of 64
      {kMax - 62, 64, false, 0},
      {kMax - 8, 64, false, 0},
      {kMax, 64, false, 0},
      {kMax, 1, true, kMax},
      {kMax - 7, 8, true, kMax - 7},
      {kMax - 6, 8, false, 0},
      {5, 0, false, 0},  // alignment 0 is refused, not a division by zero
  };
  for (const Row& r : rows) {
    size_t out = 12345;
    EXPECT_EQ(CheckedRoundUp(r.n, r.align, &out), r.ok) << r.n << " / " << r.align;
    if (r.ok) {
      EXPECT_EQ(out, r.out) << r.n << " / " << r.align;
    } else {
      EXPECT_EQ(out, 12345u) << "untouched on failure";
    }
  }
  try {
    RoundUpOrThrow(kMax - 8, 64, "cpu: Allocate");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kResourceExhausted);
    EXPECT_NE(e.message().find("cpu: Allocate"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find(std::to_string(kMax - 8)), std::string::npos) << e.message();
  }
}

TEST(MemoryBounds, NamesTheSizeEveryLimitExceededAndTheCure) {
  const std::vector<MemoryLimit> limits = {
      {1000, "RLIMIT_FSIZE", "raise the limit (ulimit -f)"},
      {5000, "the memory available now", "free memory"},
  };
  EXPECT_NO_THROW(CheckMemoryAgainst(1000, limits, "x"));
  try {
    CheckMemoryAgainst(7000, limits, "Array of 7 things");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kResourceExhausted);
    for (const char* w : {"Array of 7 things", "7000 bytes", "RLIMIT_FSIZE is 1000 bytes",
                          "ulimit -f", "the memory available now is 5000 bytes", "free memory"}) {
      EXPECT_NE(e.message().find(w), std::string::npos) << w << " in " << e.message();
    }
  }
  try {
    CheckMemoryAgainst(2000, limits, "y");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("RLIMIT_FSIZE"), std::string::npos) << e.message();
    EXPECT_EQ(e.message().find("the memory available"), std::string::npos) << "not exceeded";
  }
  // What this machine says: every limit that applies has a name and advice.
  for (auto use : {runtime::internal::MemoryUse::kPrivate, runtime::internal::MemoryUse::kShared,
                   runtime::internal::MemoryUse::kSharedNamed}) {
    const auto now = runtime::internal::MemoryLimits(use);
    ASSERT_FALSE(now.empty()) << "no limit could be read on this machine";
    for (const MemoryLimit& l : now) {
      EXPECT_FALSE(l.name.empty());
      EXPECT_FALSE(l.advice.empty());
    }
  }
}

TEST(DeviceBadInput, SizesThatWrapOrExceedTheSystemFailFast) {
  const Device sim = ParseDevice("sim:0");
  const std::vector<BadCall> rows = {
      {"Allocate(cpu, SIZE_MAX - 8)",
       [] { Allocate(kCPU, kMax - 8); },
       ErrorCode::kResourceExhausted,
       {"cpu", std::to_string(kMax - 8)}},
      {"Allocate(cpu, SIZE_MAX)",
       [] { Allocate(kCPU, kMax); },
       ErrorCode::kResourceExhausted,
       {"cpu", std::to_string(kMax)}},
      {"Allocate(cpu, SIZE_MAX - 63)",
       [] { Allocate(kCPU, kMax - 63); },
       ErrorCode::kResourceExhausted,
       {"cpu", "more than this system can provide"}},
      {"Allocate(cpu, 1 << 50)",
       [] { Allocate(kCPU, size_t{1} << 50); },
       ErrorCode::kResourceExhausted,
       {std::to_string(size_t{1} << 50), "bytes is more than"}},
      {"Allocate(sim:0, SIZE_MAX)",
       [sim] { Allocate(sim, kMax); },
       ErrorCode::kResourceExhausted,
       {"sim", std::to_string(kMax)}},
      {"Allocate(sim:0, SIZE_MAX - 8)",
       [sim] { Allocate(sim, kMax - 8); },
       ErrorCode::kResourceExhausted,
       {"sim"}},
      {"Allocate(sim:0, 1 << 40)",
       [sim] { Allocate(sim, size_t{1} << 40); },
       ErrorCode::kResourceExhausted,
       {"sim:0", "out of memory"}},
      {"Allocate(cpu, 0)", [] { Allocate(kCPU, 0); }, ErrorCode::kInvalidArgument, {"0 bytes"}},
      {"SimBackend::AllocateForeign(0, SIZE_MAX)",
       [] { static_cast<SimBackend&>(GetBackend(DeviceType::kSimAccel)).AllocateForeign(0, kMax); },
       ErrorCode::kResourceExhausted,
       {"sim"}},
      {"Storage::Allocate(cpu, SIZE_MAX - 8)",
       [] { Storage::Allocate(kCPU, kMax - 8); },
       ErrorCode::kResourceExhausted,
       {std::to_string(kMax - 8)}},
      {"Tensor::Empty({1 << 40}) float on cpu",
       [] { Tensor::Empty({int64_t{1} << 40}); },
       ErrorCode::kResourceExhausted,
       {std::to_string(int64_t{4} << 40)}},
      {"Tensor::Zeros({1 << 40}) float on cpu",
       [] { Tensor::Zeros({int64_t{1} << 40}); },
       ErrorCode::kResourceExhausted,
       {std::to_string(int64_t{4} << 40)}},
      {"Tensor::Full({1 << 40}, 1) on sim",
       [sim] { Tensor::Full({int64_t{1} << 40}, 1.0, DType::kFloat32, sim); },
       ErrorCode::kResourceExhausted,
       {"sim"}},
      {"Tensor::Empty({2^62, 4}) overflows int64",
       [] {
         Tensor::Empty({int64_t{1} << 62, 4});
       },
       ErrorCode::kInvalidArgument,
       {"int64"}},
      {"Tensor::Empty({2^61}) of float64 overflows bytes",
       [] { Tensor::Empty({int64_t{1} << 61}, DType::kFloat64); },
       ErrorCode::kInvalidArgument,
       {"too large"}},
      {"Tensor::Empty({-1})",
       [] { Tensor::Empty({-1}); },
       ErrorCode::kInvalidArgument,
       {"negative extent"}},
  };
  const std::string failures = CheckRows(rows);
  EXPECT_TRUE(failures.empty()) << failures;
}

// FORKSAFE_CPU_HUGEPAGES takes 0 or 1 (or nothing); a typo is refused with what to set, not read
// as "on" (it used to be: any value but "0" meant huge pages).
TEST(DeviceBadInput, TheHugePageSettingTakesZeroOrOne) {
  EXPECT_TRUE(CpuBackend::HugePagesSetting(nullptr));
  EXPECT_TRUE(CpuBackend::HugePagesSetting(""));
  EXPECT_TRUE(CpuBackend::HugePagesSetting("1"));
  EXPECT_FALSE(CpuBackend::HugePagesSetting("0"));
  for (const char* bad : {"off", "no", "false", "2", " 0", "0 ", "yes"}) {
    const std::string verdict = BadCallVerdict(
        {bad,
         [bad] { CpuBackend::HugePagesSetting(bad); },
         ErrorCode::kInvalidArgument,
         {"FORKSAFE_CPU_HUGEPAGES=\"", bad, "neither 0 nor 1", "set it to 0", "unset it"}});
    EXPECT_TRUE(verdict.empty()) << bad << ": " << verdict;
  }
}

TEST(DeviceBadInput, ASizeThatFitsStillWorks) {
  // The checks refuse what cannot be given, not what can.
  void* p = Allocate(kCPU, 1 << 20);
  ASSERT_NE(p, nullptr);
  static_cast<char*>(p)[(1 << 20) - 1] = 1;
  Free(kCPU, p);
  Tensor t = Tensor::Zeros({1 << 16});
  EXPECT_EQ(t.numel(), 1 << 16);
}

}  // namespace
}  // namespace forksafe::device
