// bench/peers/peers_forksafe_openmp.cc: workload 6 with the pool that torch really runs, OpenMP
// (GNU libgomp), in a program that links forksafe's runtime (docs/peers.md).
//
//   bazel-bin/bench/peers/peers_forksafe_openmp --round 1 --plan bench/peers/plan.txt [--only w6]
//
// The same shape as torch's workload 6 (bench/peers/peers_torch.py, busy_fork): a team of two
// OpenMP threads (torch.set_num_threads(2)); the forking thread has run OpenMP regions; a second
// thread loops parallel element-wise adds over 2^20 floats; the fork is a plain fork(), so only
// forksafe's at-fork handlers (runtime/openmp_fork.h) stand between libgomp and the child. The
// child runs an OpenMP region (a parallel sum of 2^20 ones) and checks it. Without the handler a
// libgomp child hangs in that region (issue 14: 20 of 20); the row counts hangs as torch's does.
// A separate program from peers_forksafe so that libgomp is not loaded into the other workloads.
#include <omp.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/peers/harness.h"
#include "forksafe/runtime/openmp_fork.h"

namespace {

void BusyForkOpenMp(const peers::Emitter& out, const peers::Plan& plan) {
  if (!forksafe::runtime::OpenMpUsableInThisProcess()) {
    throw std::runtime_error("forksafe reports OpenMP unusable in this process");
  }
  omp_set_num_threads(2);
  constexpr int64_t kN = int64_t{1} << 20;
  std::vector<float> x(kN, 1.f), y(kN, 2.f), z(kN);
  auto add = [&] {
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < kN; ++k) z[k] = x[k] + y[k];
  };
  add();  // the forking thread has used the OpenMP pool
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> rounds{0};
  std::thread busy([&] {
    omp_set_num_threads(2);  // a per-thread setting in OpenMP
    while (!stop) {
      add();
      rounds.fetch_add(1, std::memory_order_relaxed);
    }
  });
  while (rounds.load() < 20) std::this_thread::yield();

  const peers::ForkTrials t = peers::MeasureForkTrials(plan, [&]() -> int {
    int64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
    for (int64_t k = 0; k < kN; ++k) sum += static_cast<int64_t>(x[k]);
    return sum == kN ? 0 : 1;
  });
  stop = true;
  busy.join();
  out.Samples("w6_busy_fork", "OpenMP region in the child", 0, plan, t.samples, t.extra);
}

}  // namespace

int main(int argc, char** argv) {
  const peers::Args args = peers::ParseArgs(argc, argv);
  const auto plans = peers::LoadPlan(args.plan);
  peers::Emitter out("forksafe", args.round, args.suffix);
  out.set_only(args.only);
  if (args.Wants("w6")) {
    out.Guard("w6_busy_fork", "OpenMP region in the child",
              [&] { BusyForkOpenMp(out, peers::PlanFor(plans, "w6_busy_fork")); });
  }
  return 0;
}
