// Multiprocessing benchmarks, in one run beside a bare AF_UNIX socketpair ping-pong between two
// processes, so every figure reads as a ratio on the same machine at the same time.
//
//   bazel run //bench:mp_benchmark
//
// - BM_BarePingPong: 64 bytes there and back over a socketpair, raw read/write.
// - BM_PipeRoundTrip: the same through mp::Pipe (framing + codec).
// - BM_QueueRoundTrip: the same through two mp::Queues (shared ring, robust lock, futex wake-ups).
// - BM_ProcessStartJoin/<method>: Process start + join of a function that returns at once.
// - BM_Spawn2/<method>: spawn(nprocs=2) of a trivial entry point, end to end.
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>

#include "benchmark/benchmark.h"
#include "mp/connection.h"
#include "mp/process.h"
#include "mp/queue.h"
#include "mp/spawn.h"

namespace {

using namespace forksafe::mp;

constexpr int kMsg = 64;

void Nothing(int) {}
FORKSAFE_ENTRY_POINT(Nothing);

void NothingAtAll() {}
FORKSAFE_ENTRY_POINT(NothingAtAll);

void QueueEcho(Queue in, Queue out) {
  for (;;) {
    std::string s = in.get<std::string>();
    if (s.empty()) return;
    out.put(s);
  }
}
FORKSAFE_ENTRY_POINT(QueueEcho);

void PipeEcho(Connection c) {
  for (;;) {
    std::string s = c.recv_bytes();
    if (s.empty()) return;
    c.send_bytes(s);
  }
}
FORKSAFE_ENTRY_POINT(PipeEcho);

void BM_BarePingPong(benchmark::State& state) {
  int sv[2];
  socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
  const pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    char buf[kMsg];
    for (;;) {
      size_t got = 0;
      while (got < kMsg) {
        const ssize_t n = read(sv[1], buf + got, kMsg - got);
        if (n <= 0) _exit(0);
        got += static_cast<size_t>(n);
      }
      if (write(sv[1], buf, kMsg) != kMsg) _exit(1);
    }
  }
  close(sv[1]);
  char buf[kMsg] = {};
  for (auto _ : state) {
    if (write(sv[0], buf, kMsg) != kMsg) state.SkipWithError("write");
    size_t got = 0;
    while (got < kMsg) {
      const ssize_t n = read(sv[0], buf + got, kMsg - got);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
  }
  close(sv[0]);
  waitpid(pid, nullptr, 0);
}
BENCHMARK(BM_BarePingPong)->UseRealTime()->MinTime(0.5)->Repetitions(3);

void BM_PipeRoundTrip(benchmark::State& state) {
  auto [a, b] = Pipe();
  Process p(ProcessOptions{"", false, "fork"}, &PipeEcho, b);
  p.start();
  b.close();
  const std::string msg(kMsg, 'x');
  for (auto _ : state) {
    a.send_bytes(msg);
    benchmark::DoNotOptimize(a.recv_bytes());
  }
  a.send_bytes("");
  p.join(10.0);
}
BENCHMARK(BM_PipeRoundTrip)->UseRealTime()->MinTime(0.5)->Repetitions(3);

void BM_QueueRoundTrip(benchmark::State& state) {
  Queue to, from;
  Process p(ProcessOptions{"", false, "fork"}, &QueueEcho, to, from);
  p.start();
  const std::string msg(kMsg, 'x');
  for (auto _ : state) {
    to.put(msg);
    benchmark::DoNotOptimize(from.get<std::string>());
  }
  to.put(std::string());
  p.join(10.0);
}
BENCHMARK(BM_QueueRoundTrip)->UseRealTime()->MinTime(0.5)->Repetitions(3);

const char* kMethods[] = {"fork", "spawn", "forkserver"};

void BM_ProcessStartJoin(benchmark::State& state) {
  const std::string method = kMethods[state.range(0)];
  state.SetLabel(method);
  for (auto _ : state) {
    Process p(ProcessOptions{"", false, method}, &NothingAtAll);
    p.start();
    p.join();
    if (p.exitcode() != 0) state.SkipWithError("child failed");
  }
}
BENCHMARK(BM_ProcessStartJoin)->DenseRange(0, 2)->UseRealTime()->MinTime(0.5)->Repetitions(3);

void BM_Spawn2(benchmark::State& state) {
  const std::string method = kMethods[state.range(0)];
  state.SetLabel(method);
  SpawnOptions o;
  o.nprocs = 2;
  o.start_method = method;
  for (auto _ : state) spawn(&Nothing, std::make_tuple(), o);
}
BENCHMARK(BM_Spawn2)->DenseRange(0, 2)->UseRealTime()->MinTime(0.5)->Repetitions(3);

class MedianReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name == "median") {
        std::string key = r.run_name.function_name;
        if (!r.run_name.args.empty()) key += "/" + r.report_label;
        us_[key] = r.GetAdjustedRealTime() / 1e3;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
  std::map<std::string, double> us_;
};

}  // namespace

int main(int argc, char** argv) {
  forksafe::mp::InitMain(argc, argv);
  benchmark::Initialize(&argc, argv);
  MedianReporter r;
  benchmark::RunSpecifiedBenchmarks(&r);
  const double bare = r.us_["BM_BarePingPong"];
  printf("\nmedians (us):\n");
  for (const auto& [k, v] : r.us_) printf("  %-32s %10.1f\n", k.c_str(), v);
  if (bare > 0) {
    printf("ratio queue round trip / bare ping-pong = %.2f (target <= 2)\n",
           r.us_["BM_QueueRoundTrip"] / bare);
    printf("ratio pipe round trip / bare ping-pong  = %.2f\n", r.us_["BM_PipeRoundTrip"] / bare);
  }
  benchmark::Shutdown();
  return 0;
}
