// The large-segment cache of the shared arena (mp/internal/shared_arena.h, "Large segments") and
// born-shared CPU tensors (mp/sharing.h): segments reused across a send loop, the cap, release
// under EmptyCache, never reusing a segment that another process holds, forked children, and
// tensors that are shared from birth (no copy, no new segment at send).
#include <dirent.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/internal/shared_arena.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/runtime/resources.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using device::DType;
using device::Tensor;
using internal::SegmentKind;
using internal::SharedArena;
using namespace std::chrono_literals;

constexpr int64_t kBig = int64_t{64} << 20;  // bytes: over the 16 MiB of dedicated segments
constexpr size_t kMid = size_t{20} << 20;

int OpenFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n - 3;
}

float* F32(const Tensor& t) { return static_cast<float*>(t.data_ptr()); }

// Acknowledges each tensor with t[0] + t[-1]; an empty tensor stops it.
void Ack(Queue in, Queue out) {
  for (;;) {
    Tensor t = in.get<Tensor>(true, 60.0);
    if (t.numel() == 0) return;
    out.put(static_cast<double>(F32(t)[0]) + F32(t)[t.numel() - 1]);
  }
}
FORKSAFE_ENTRY_POINT(Ack);

// Receives one tensor, says so, holds it until told, then reports whether it still holds `value`
// everywhere it looks (the sender must not have reused its memory meanwhile).
void HoldAndCheck(Queue in, Queue out, Queue go, double value) {
  Tensor t = in.get<Tensor>(true, 60.0);
  out.put(true);
  go.get<bool>(true, 60.0);
  bool same = true;
  for (int64_t i = 0; i < t.numel(); i += 4096) same = same && F32(t)[i] == value;
  out.put(same && F32(t)[t.numel() - 1] == value);
}
FORKSAFE_ENTRY_POINT(HoldAndCheck);

// Writes 42 into t[1] of the tensor it receives, then acknowledges.
void WriteFortyTwo(Queue in, Queue out) {
  Tensor t = in.get<Tensor>(true, 60.0);
  F32(t)[1] = 42.f;
  out.put(true);
}
FORKSAFE_ENTRY_POINT(WriteFortyTwo);

class LargeCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    set_sharing_strategy("file_descriptor");
    set_sharing_cache_enabled(true);
    SharedArena::Get().SetLargeCacheLimit(size_t{256} << 20);
    SharedArena::Get().EmptyCache();
  }
  void TearDown() override {
    set_sharing_cache_enabled(true);
    SharedArena::Get().SetLargeCacheLimit(size_t{256} << 20);
    SharedArena::Get().EmptyCache();
  }
};

TEST_F(LargeCacheTest, FreshLargeTensorsSentInALoopReuseTheirSegments) {
  Queue to, from;
  Process p(ProcessOptions{"", false, "fork"}, &Ack, to, from);
  p.start();
  const int64_t n = kBig / 4;
  const auto a0 = SharedArena::Get().stats();
  int fds_after_warmup = 0;
  uint64_t created_after_warmup = 0;
  for (int i = 0; i < 16; ++i) {
    Tensor t = Tensor::Full({n}, static_cast<double>(i));
    to.put(t);
    ASSERT_EQ(from.get<double>(true, 60.0), 2.0 * i);
    if (i == 3) {
      fds_after_warmup = OpenFds();
      created_after_warmup = SharedArena::Get().stats().segments_created;
    }
    EXPECT_LE(SharedArena::Get().stats().large_cache_bytes, size_t{256} << 20);
  }
  const auto a1 = SharedArena::Get().stats();
  EXPECT_LE(a1.segments_created - a0.segments_created, 4u) << "a segment per tensor";
  EXPECT_LE(a1.segments_created - created_after_warmup, 1u) << "segments_created must stay flat";
  EXPECT_GE(a1.large_segments_reused - a0.large_segments_reused, 10u);
  EXPECT_LE(OpenFds(), fds_after_warmup + 1) << "descriptors grow with the loop";
  to.put(Tensor::Empty({0}, DType::kFloat32, device::kCPU));
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
}

TEST_F(LargeCacheTest, TheCacheNeverHoldsMoreThanItsCapAndEmptyCacheReleasesIt) {
  SharedArena::Get().SetLargeCacheLimit(size_t{50} << 20);
  {
    std::vector<Tensor> ts;
    for (int i = 0; i < 4; ++i)
      ts.push_back(SharedEmpty({static_cast<int64_t>(kMid)}, DType::kUInt8));
  }  // four 20 MiB segments freed: two fit under 50 MiB
  const auto s = SharedArena::Get().stats();
  EXPECT_LE(s.large_cache_bytes, size_t{50} << 20);
  EXPECT_GT(s.large_cache_bytes, kMid);
  // Lowering the limit evicts at once.
  SharedArena::Get().SetLargeCacheLimit(size_t{30} << 20);
  EXPECT_LE(SharedArena::Get().stats().large_cache_bytes, size_t{30} << 20);
  SharedArena::Get().EmptyCache();
  EXPECT_EQ(SharedArena::Get().stats().large_cache_bytes, 0u);
  // runtime::ReleaseCachedResources drops it too.
  { Tensor t = SharedEmpty({static_cast<int64_t>(kMid)}, DType::kUInt8); }
  EXPECT_GT(SharedArena::Get().stats().large_cache_bytes, 0u);
  runtime::ReleaseCachedResources();
  EXPECT_EQ(SharedArena::Get().stats().large_cache_bytes, 0u);
  // A limit of 0 keeps nothing.
  SharedArena::Get().SetLargeCacheLimit(0);
  { Tensor t = SharedEmpty({static_cast<int64_t>(kMid)}, DType::kUInt8); }
  EXPECT_EQ(SharedArena::Get().stats().large_cache_bytes, 0u);
}

TEST_F(LargeCacheTest, ASegmentHeldOrInFlightElsewhereIsNotReusedUntilItIsLetGo) {
  SharedArena& arena = SharedArena::Get();
  auto a = arena.Allocate(kMid, SegmentKind::kMemfd);
  void* const first = a->data();
  internal::SharedBlock::Handle h = a->Export();  // one reference in flight
  a.reset();                                      // freed here: cached, but still counted
  EXPECT_GT(arena.stats().large_cache_bytes, 0u);
  auto b = arena.Allocate(kMid, SegmentKind::kMemfd);
  EXPECT_NE(b->data(), first) << "a segment with a reference in flight was handed out again";
  b.reset();
  auto imported = arena.Import(std::move(h));  // adopts the reference
  EXPECT_EQ(imported->data(), first);
  const uint64_t reused = arena.stats().large_segments_reused;
  auto c = arena.Allocate(kMid, SegmentKind::kMemfd);  // `b`'s segment is free: reused
  EXPECT_EQ(arena.stats().large_segments_reused, reused + 1);
  EXPECT_NE(c->data(), first);
  imported.reset();
  auto d = arena.Allocate(kMid, SegmentKind::kMemfd);  // now the first one is free too
  EXPECT_EQ(d->data(), first);
  // Not wastefully larger: a cached segment serves only requests of at least half its size.
  d.reset();
  c.reset();
  arena.EmptyCache();
  { auto big = arena.Allocate(size_t{64} << 20, SegmentKind::kMemfd); }  // cached when freed
  ASSERT_GT(arena.stats().large_cache_bytes, size_t{64} << 20);
  const uint64_t before = arena.stats().large_segments_reused;
  auto small = arena.Allocate(kMid, SegmentKind::kMemfd);  // 20 MiB: under half of 64 MiB
  EXPECT_EQ(arena.stats().large_segments_reused, before);
  auto half = arena.Allocate(size_t{40} << 20, SegmentKind::kMemfd);  // within 2x: reused
  EXPECT_EQ(arena.stats().large_segments_reused, before + 1);
}

TEST_F(LargeCacheTest, AReceiverStillHoldingATensorKeepsItsSegmentFromReuse) {
  Queue in, out, go;
  Process p(ProcessOptions{"", false, "fork"}, &HoldAndCheck, in, out, go, 1.0);
  p.start();
  const int64_t n = static_cast<int64_t>(kMid) / 4;
  {
    Tensor t = Tensor::Full({n}, 1.0);
    in.put(t);
    ASSERT_TRUE(out.get<bool>(true, 60.0));
  }  // freed here while the child holds it
  std::vector<Tensor> others;
  for (int i = 0; i < 3; ++i) others.push_back(Tensor::Full({n}, 2.0));
  for (Tensor& t : others) share_memory_(t);  // would take the held segment if it were reused
  go.put(true);
  EXPECT_TRUE(out.get<bool>(true, 60.0)) << "the receiver's tensor was overwritten";
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
}

TEST_F(LargeCacheTest, AForkedChildNeverAllocatesFromItsParentsCachedSegments) {
  const void* cached = nullptr;
  {
    Tensor t = SharedEmpty({static_cast<int64_t>(kMid)}, DType::kUInt8);
    cached = t.data_ptr();
  }
  ASSERT_GT(SharedArena::Get().stats().large_cache_bytes, 0u);
  auto r = forksafe::testing::RunInChild([cached] {
    const uint64_t reused = SharedArena::Get().stats().large_segments_reused;
    Tensor t = SharedEmpty({static_cast<int64_t>(kMid)}, DType::kUInt8);
    if (t.data_ptr() == cached) return 2;
    if (SharedArena::Get().stats().large_segments_reused != reused) return 3;
    std::fill_n(static_cast<char*>(t.data_ptr()), kMid, 5);
    return 0;
  });
  EXPECT_TRUE(r.ok()) << r.Describe();
  Tensor again = SharedEmpty({static_cast<int64_t>(kMid)}, DType::kUInt8);
  EXPECT_EQ(again.data_ptr(), cached) << "the parent serves its cached segment";
}

TEST_F(LargeCacheTest, OffWithTheCacheAndNeverForFileSystemSegments) {
  set_sharing_cache_enabled(false);
  { Tensor t = SharedEmpty({static_cast<int64_t>(kMid)}, DType::kUInt8); }
  EXPECT_EQ(SharedArena::Get().stats().large_cache_bytes, 0u);
  set_sharing_cache_enabled(true);
  set_sharing_strategy("file_system");
  { Tensor t = SharedEmpty({static_cast<int64_t>(kMid)}, DType::kUInt8); }
  EXPECT_EQ(SharedArena::Get().stats().large_cache_bytes, 0u);
  set_sharing_strategy("file_descriptor");
}

class BornSharedTest : public ::testing::Test {
 protected:
  void TearDown() override { set_tensors_born_shared(false); }
};

TEST_F(BornSharedTest, ScopeAndProcessSettingDecideWhereNewTensorsLive) {
  EXPECT_FALSE(tensors_born_shared());
  EXPECT_FALSE(Tensor::Empty({256}, DType::kFloat32, device::kCPU).is_shared());
  {
    BornSharedScope scope;
    EXPECT_TRUE(tensors_born_shared());
    Tensor t = Tensor::Full({256}, 3.0);
    EXPECT_TRUE(t.is_shared()) << "born shared, without share_memory_";
    void* before = t.data_ptr();
    share_memory_(t);
    EXPECT_EQ(t.data_ptr(), before) << "share_memory_ of a born-shared tensor moves nothing";
    EXPECT_EQ(t.item<float>({255}), 3.f);
    {
      BornSharedScope off(false);
      EXPECT_FALSE(Tensor::Empty({256}, DType::kFloat32, device::kCPU).is_shared());
    }
    EXPECT_TRUE(Tensor::Empty({256}, DType::kFloat32, device::kCPU).is_shared());
  }
  EXPECT_FALSE(Tensor::Empty({256}, DType::kFloat32, device::kCPU).is_shared());
  set_tensors_born_shared(true);
  EXPECT_TRUE(Tensor::Zeros({16}, DType::kInt32, device::kCPU).is_shared());
  {
    BornSharedScope off(false);
    EXPECT_FALSE(Tensor::Zeros({16}, DType::kInt32, device::kCPU).is_shared());
  }
  set_tensors_born_shared(false);
  EXPECT_FALSE(Tensor::Zeros({16}, DType::kInt32, device::kCPU).is_shared())
      << "turning it off restores private allocation";
  EXPECT_FALSE(Tensor::Empty({0}, DType::kFloat32, device::kCPU).is_shared());
}

TEST_F(BornSharedTest, ASendCopiesNothingAndTheReceiversWriteIsSeen) {
  Queue in, out;
  Process p(ProcessOptions{"", false, "fork"}, &WriteFortyTwo, in, out);
  p.start();
  set_tensors_born_shared(true);
  Tensor t = Tensor::Full({int64_t{1} << 18}, 1.0);  // 1 MiB
  set_tensors_born_shared(false);
  void* const data = t.data_ptr();
  const auto a0 = SharedArena::Get().stats();
  in.put(t);
  ASSERT_TRUE(out.get<bool>(true, 60.0));
  const auto a1 = SharedArena::Get().stats();
  EXPECT_EQ(a1.blocks_allocated, a0.blocks_allocated) << "the send allocated shared memory";
  EXPECT_EQ(a1.segments_created, a0.segments_created);
  EXPECT_EQ(t.data_ptr(), data) << "the send moved the data";
  EXPECT_EQ(F32(t)[1], 42.f);
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
}

TEST_F(BornSharedTest, AForkedChildsWriteLandsInTheParentsBornSharedTensor) {
  // The documented Hazard: born-shared memory is MAP_SHARED, so fork does not copy it on write.
  Tensor priv = Tensor::Full({64}, 1.0);
  set_tensors_born_shared(true);
  Tensor born = Tensor::Full({64}, 1.0);
  set_tensors_born_shared(false);
  auto r = forksafe::testing::RunInChild([&] {
    F32(priv)[0] = 5.f;
    F32(born)[0] = 5.f;
    return 0;
  });
  ASSERT_TRUE(r.ok()) << r.Describe();
  EXPECT_EQ(F32(priv)[0], 1.f) << "private memory is the child's own after fork";
  EXPECT_EQ(F32(born)[0], 5.f) << "born-shared memory is the parent's: the child wrote into it";
}

TEST_F(BornSharedTest, LargeBornSharedTensorsReuseCachedSegments) {
  SharedArena::Get().EmptyCache();
  BornSharedScope scope;
  { Tensor t = Tensor::Full({kBig / 4}, 1.0); }
  const auto a0 = SharedArena::Get().stats();
  for (int i = 0; i < 4; ++i) {
    Tensor t = Tensor::Full({kBig / 4}, static_cast<double>(i));
    EXPECT_TRUE(t.is_shared());
    EXPECT_EQ(F32(t)[kBig / 4 - 1], static_cast<float>(i));
  }
  const auto a1 = SharedArena::Get().stats();
  EXPECT_EQ(a1.segments_created, a0.segments_created);
  EXPECT_EQ(a1.large_segments_reused - a0.large_segments_reused, 4u);
}

// ---- A new segment's page tables ---------------------------------------------------------------
// A new segment is reserved by reading every page in through its creator's mapping
// (MADV_POPULATE_READ, mp/internal/shared_arena.cc ReserveSegmentMemory) and a receiver that maps
// it builds its page tables at once (PopulateHeldPages): neither the creator's first write nor the
// receiver's first read of a tensor takes a page fault per page (256 per MiB before; each costs
// 20-35 us on a VM that pages the guest's page tables, docs/peers.md "Workload 3's tail").

long MinorFaults() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

// Whether this kernel has MADV_POPULATE_READ (Linux 5.14); without it segments are fallocated and
// pages fault in at first touch, as before.
bool KernelPopulatesOnRequest() {
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  const bool ok = madvise(p, 4096, 22 /* MADV_POPULATE_READ */) == 0;
  munmap(p, 4096);
  return ok;
}

// Reads every page of the tensor it receives; answers with the page faults that took, or -1 when
// a value was wrong.
void ReadEveryPage(Queue in, Queue out) {
  Tensor t = in.get<Tensor>(true, 60.0);
  const long f0 = MinorFaults();
  const auto* bytes = static_cast<const volatile unsigned char*>(t.data_ptr());
  bool right = true;
  for (size_t i = 0; i < t.nbytes(); i += 4096) right = right && bytes[i] == 7;
  const long faults = MinorFaults() - f0;
  out.put(right ? static_cast<int64_t>(faults) : int64_t{-1});
}
FORKSAFE_ENTRY_POINT(ReadEveryPage);

TEST_F(LargeCacheTest, NeitherTheCreatorsFirstWriteNorAReceiversFirstReadFaultsPerPage) {
  if (!KernelPopulatesOnRequest()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_READ (< 5.14)";
  Queue in, out;
  // Started before the segment exists, so the child maps it by import, not by inheriting it.
  Process p(ProcessOptions{"", false, "fork"}, &ReadEveryPage, in, out);
  p.start();
  const uint64_t created = SharedArena::Get().stats().segments_created;
  Tensor t = SharedEmpty({static_cast<int64_t>(kMid)}, DType::kUInt8);  // 20 MiB: 5,120 pages
  ASSERT_EQ(SharedArena::Get().stats().segments_created, created + 1) << "not a new segment";
  const long f0 = MinorFaults();
  std::memset(t.data_ptr(), 7, t.nbytes());
  const long creator_faults = MinorFaults() - f0;
  EXPECT_LT(creator_faults, 64) << "the creator's first write of a new 20 MiB segment took "
                                << creator_faults << " page faults (5,120 pages)";
  in.put(t);
  const int64_t receiver_faults = out.get<int64_t>(true, 60.0);
  ASSERT_NE(receiver_faults, -1) << "the receiver read wrong values";
  EXPECT_LT(receiver_faults, 64) << "the receiver's first read of an imported 20 MiB tensor took "
                                 << receiver_faults << " page faults (5,120 pages)";
  ASSERT_TRUE(p.join(60s));
  EXPECT_EQ(p.exitcode(), 0);
}

}  // namespace
}  // namespace forksafe::mp
