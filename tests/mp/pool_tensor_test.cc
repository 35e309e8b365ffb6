// Pool over tensors: inputs and results cross as shared-memory handles, in every start method.
// Only the Pool's header is included: a tensor needs no other (issue 13).
#include <numeric>
#include <string>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/pool.h"
#include "gtest/gtest.h"

namespace forksafe::mp {
namespace {

using device::Tensor;
using namespace std::chrono_literals;

// Doubles the tensor in place (zero copy: the parent sees it) and returns a view of its first half.
Tensor DoubleInPlace(Tensor t) {
  float* p = static_cast<float*>(t.data_ptr());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] *= 2.f;
  return t.Slice(0, 0, t.numel() / 2);
}
FORKSAFE_ENTRY_POINT(DoubleInPlace);

double Sum(Tensor t) {
  double s = 0;
  for (float v : t.ToVector<float>()) s += v;
  return s;
}
FORKSAFE_ENTRY_POINT(Sum);

class PoolTensorTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PoolTensorTest, MapOverTensorsWithoutCopies) {
  PoolOptions o;
  o.processes = 2;
  o.start_method = GetParam();
  Pool pool(o);
  std::vector<Tensor> inputs;
  for (int i = 0; i < 40; ++i) inputs.push_back(Tensor::Full({256}, static_cast<double>(i)));
  std::vector<Tensor> halves = pool.map(&DoubleInPlace, inputs, 3);
  ASSERT_EQ(halves.size(), inputs.size());
  for (int i = 0; i < 40; ++i) {
    EXPECT_TRUE(inputs[i].is_shared());
    EXPECT_EQ(inputs[i].item<float>({255}), 2.f * i) << "the worker's write is visible here";
    EXPECT_EQ(halves[i].storage(), inputs[i].storage()) << "the result is a view of the input";
    EXPECT_EQ(halves[i].numel(), 128);
  }
  std::vector<double> sums = pool.map(&Sum, inputs);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(sums[i], 512.0 * i);
}

INSTANTIATE_TEST_SUITE_P(StartMethods, PoolTensorTest,
                         ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace forksafe::mp
