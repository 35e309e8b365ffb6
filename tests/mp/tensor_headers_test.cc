// A tensor crosses a Queue, a Pipe and a Process argument with only the header that carries it
// (issue 13): this file includes neither mp/sharing.h nor any internal header. Before the codec
// declared the tensor hooks (mp/codec.h), `Queue::put(tensor)` here failed to compile deep inside
// cereal with a static assertion, and whether a Process's tensor argument could be encoded for
// spawn depended on which headers the translation unit happened to include.
#include <string>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "gtest/gtest.h"

namespace forksafe::mp {
namespace {

using device::Tensor;
using namespace std::chrono_literals;

// Adds `delta` to every element in place (the parent sees it: no copy) and reports the sum back.
void AddInPlace(Tensor t, float delta, Connection back) {
  float* p = static_cast<float*>(t.data_ptr());
  double sum = 0;
  for (int64_t i = 0; i < t.numel(); ++i) sum += (p[i] += delta);
  back.send(sum);
}
FORKSAFE_ENTRY_POINT(AddInPlace);

TEST(TensorHeadersTest, QueueCarriesATensorWithoutTheSharingHeader) {
  Queue q;
  Tensor t = Tensor::Full({64}, 3.0);
  q.put(t);
  Tensor got = q.get<Tensor>(true, 10s);
  EXPECT_TRUE(t.is_shared()) << "put() moved the tensor to shared memory";
  EXPECT_EQ(got.storage(), t.storage()) << "same process: the same storage comes back";
  EXPECT_EQ(got.item<float>({63}), 3.f);
}

TEST(TensorHeadersTest, PipeCarriesATensorWithoutTheSharingHeader) {
  auto [a, b] = Pipe();
  a.send(Tensor::Full({8}, 2.5));
  Tensor got = b.recv<Tensor>();
  EXPECT_TRUE(got.is_shared());
  EXPECT_EQ(got.item<float>({7}), 2.5f);
}

class TensorArgumentTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TensorArgumentTest, ProcessArgumentIsSharedNotCopied) {
  Tensor t = Tensor::Full({100}, 1.0);
  auto [here, there] = Pipe();
  Process p(ProcessOptions{"add", false, GetParam()}, &AddInPlace, t, 4.f, there);
  p.start();
  ASSERT_TRUE(here.poll(30s)) << "the child did not report within 30 s";
  EXPECT_EQ(here.recv<double>(), 500.0);
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
  EXPECT_EQ(t.item<float>({99}), 5.f) << "the child's write is visible in the parent";
}

INSTANTIATE_TEST_SUITE_P(StartMethods, TensorArgumentTest,
                         ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace forksafe::mp
