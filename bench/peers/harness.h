// bench/peers/harness.h: the measuring loop and the JSON-lines output shared by peers_floor and
// peers_forksafe. The Python peers (peerlib.py) implement the same loop and the same output, so
// that every system is timed under one rule (bench/peers/plan.txt).
//
// One line per (workload, param) on stdout:
//   {"system": "...", "round": 1, "workload": "w1_roundtrip", "param": "4 KiB", "bytes": 4096,
//    "unit": "us", "warmup": 10, "samples": [...], ...extra fields}
// or, when the workload failed its check or threw:
//   {"system": "...", "round": 1, "workload": "...", "param": "...", "error": "..."}
// Progress goes to stderr.
#ifndef FORKSAFE_BENCH_PEERS_HARNESS_H_
#define FORKSAFE_BENCH_PEERS_HARNESS_H_

#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace peers {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC, as Python's time.monotonic_ns()

inline double Us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

struct Plan {
  int warmup = 1, min_iters = 3, max_iters = 100;
  double max_s = 1.0, cap_s = 5.0;
};

inline std::map<std::string, Plan> LoadPlan(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read plan " + path);
  std::map<std::string, Plan> plans;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string name;
    Plan p;
    if (ls >> name >> p.warmup >> p.min_iters >> p.max_iters >> p.max_s >> p.cap_s) plans[name] = p;
  }
  return plans;
}

// Runs one workload under `plan`. `iter(i)` performs iteration i (warm-ups first) and returns the
// microseconds of its timed part; it throws when the iteration's result is wrong.
inline std::vector<double> Measure(const Plan& plan, const std::function<double(int)>& iter) {
  for (int i = 0; i < plan.warmup; ++i) iter(i);
  std::vector<double> samples;
  const auto start = Clock::now();
  // PEERS_TRACE_SAMPLES=1 prints each timed sample's CLOCK_MONOTONIC start and end (seconds) to
  // stderr, to line a slow sample up with what else the machine did then (a stall monitor's log).
  static const bool trace = getenv("PEERS_TRACE_SAMPLES") != nullptr;
  for (int i = 0; i < plan.max_iters; ++i) {
    const auto t0 = Clock::now();
    samples.push_back(iter(plan.warmup + i));
    if (trace) {
      const auto t1 = Clock::now();
      auto sec = [](Clock::time_point t) {
        return std::chrono::duration<double>(t.time_since_epoch()).count();
      };
      fprintf(stderr, "  sample %d: %.6f .. %.6f  %.1f us\n", i, sec(t0), sec(t1), samples.back());
    }
    const double s = Us(Clock::now() - start) / 1e6;
    if (static_cast<int>(samples.size()) >= plan.min_iters && s >= plan.max_s) break;
    if (s >= plan.cap_s) break;
  }
  return samples;
}

inline std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

class Emitter {
 public:
  // `suffix` is appended to every param (" [1 CPU]" for the pinned runs).
  Emitter(std::string system, int round, std::string suffix = "")
      : system_(std::move(system)), round_(round), suffix_(std::move(suffix)) {}

  // `extra` is a list of already-encoded JSON members ("\"hangs\": 0").
  void Samples(const std::string& workload, const std::string& param, int64_t bytes,
               const Plan& plan, const std::vector<double>& samples,
               const std::vector<std::string>& extra = {}) const {
    std::string line = Head(workload, param) + ", \"bytes\": " + std::to_string(bytes) +
                       ", \"unit\": \"us\", \"warmup\": " + std::to_string(plan.warmup) +
                       ", \"samples\": [";
    for (size_t i = 0; i < samples.size(); ++i) {
      char buf[32];
      snprintf(buf, sizeof buf, "%s%.2f", i ? ", " : "", samples[i]);
      line += buf;
    }
    line += "]";
    for (const auto& e : extra) line += ", " + e;
    line += "}";
    printf("%s\n", line.c_str());
    fflush(stdout);
    fprintf(stderr, "  [%s r%d] %-14s %-12s median %11.1f us  (n=%zu)\n", system_.c_str(), round_,
            workload.c_str(), (param + suffix_).c_str(), Median(samples), samples.size());
  }

  void Error(const std::string& workload, const std::string& param, const std::string& what) const {
    printf("%s, \"error\": %s}\n", Head(workload, param).c_str(), Quote(what).c_str());
    fflush(stdout);
    fprintf(stderr, "  [%s r%d] %s %s FAILED: %s\n", system_.c_str(), round_, workload.c_str(),
            param.c_str(), what.c_str());
  }

  // Workload name prefixes to run (empty: all); Guard skips the others.
  void set_only(std::vector<std::string> only) { only_ = std::move(only); }

  // Runs `body`, turning an exception into an error line.
  void Guard(const std::string& workload, const std::string& param,
             const std::function<void()>& body) const {
    bool wanted = only_.empty();
    for (const auto& o : only_) wanted = wanted || workload.compare(0, o.size(), o) == 0;
    if (!wanted) return;
    try {
      body();
    } catch (const std::exception& e) {
      Error(workload, param, e.what());
    }
  }

 private:
  std::string Head(const std::string& workload, const std::string& param) const {
    return "{\"system\": " + Quote(system_) + ", \"round\": " + std::to_string(round_) +
           ", \"workload\": " + Quote(workload) + ", \"param\": " + Quote(param + suffix_);
  }
  std::string system_;
  int round_;
  std::string suffix_;
  std::vector<std::string> only_;
};

inline std::string SizeName(int64_t bytes) {
  if (bytes >= (1 << 20)) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (1 << 10)) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

// --round N --plan PATH --only a,b (workload name prefixes; empty: all) --suffix TEXT
// --size BYTES (workloads 1 and 2 at this size only, for profiling one size)
struct Args {
  int round = 1;
  int64_t size = 0;
  std::string suffix;
  bool WantsSize(int64_t bytes) const { return size == 0 || size == bytes; }
  std::string plan = "bench/peers/plan.txt";
  std::vector<std::string> only;
  // Whether a group of workloads ("w1", "bd") has any wanted member.
  bool Wants(const std::string& group) const {
    if (only.empty()) return true;
    for (const auto& o : only) {
      const size_t k = std::min(o.size(), group.size());
      if (o.compare(0, k, group, 0, k) == 0) return true;
    }
    return false;
  }
};

inline Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--round") {
      a.round = std::stoi(v);
    } else if (k == "--plan") {
      a.plan = v;
    } else if (k == "--size") {
      a.size = std::stoll(v);
    } else if (k == "--suffix") {
      a.suffix = v;
    } else if (k == "--only") {
      std::stringstream ss(v);
      std::string item;
      while (std::getline(ss, item, ',')) {
        if (!item.empty()) a.only.push_back(item);
      }
    } else {
      throw std::runtime_error("unknown argument " + k);
    }
  }
  return a;
}

inline const Plan& PlanFor(const std::map<std::string, Plan>& plans, const std::string& name) {
  auto it = plans.find(name);
  if (it == plans.end()) throw std::runtime_error("plan.txt has no line for " + name);
  return it->second;
}

// In the child of a ping-pong or round trip: pins it to CPU $PEERS_CHILD_CPU when that is set
// (run.sh pins the parent with taskset), to measure the cross-CPU case deterministically.
inline void PinChild() {
  const char* cpu = getenv("PEERS_CHILD_CPU");
  if (cpu == nullptr || *cpu == 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(atoi(cpu), &set);
  sched_setaffinity(0, sizeof set, &set);
}

// Waits for `pid` at most `timeout_ms` (pidfd + poll); kills it on timeout. Returns
// 0 (exited 0), 1 (failed: non-zero exit or signal) or 2 (hung: killed after the timeout).
inline int WaitBounded(pid_t pid, int timeout_ms) {
  const int pfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pfd < 0) throw std::runtime_error("pidfd_open failed");
  pollfd pf{pfd, POLLIN, 0};
  const int ready = poll(&pf, 1, timeout_ms);
  close(pfd);
  if (ready == 0) kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  if (ready == 0) return 2;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

// Workload 6's trials: each forks, runs `child` in the child (its return value is the exit
// code) and waits at most 2 s for it (a hang is killed). Every trial counts towards the trials,
// hangs and failures (warm-ups too); `status` holds the outcome of each timed one (0 ok,
// 1 failed, 2 hung), so that latencies are read from the good ones.
struct ForkTrials {
  std::vector<double> samples;
  std::vector<std::string> extra;  // the JSON members for Emitter::Samples
};
inline ForkTrials MeasureForkTrials(const Plan& plan, const std::function<int()>& child) {
  int trials = 0, hangs = 0, failures = 0;
  std::string status;
  ForkTrials out;
  out.samples = Measure(plan, [&](int i) {
    ++trials;
    const auto t0 = Clock::now();
    const pid_t pid = fork();
    if (pid == 0) _exit(child());
    if (pid < 0) throw std::runtime_error("fork failed");
    const int r = WaitBounded(pid, 2000);
    const double us = Us(Clock::now() - t0);
    if (r == 2) ++hangs;
    if (r == 1) ++failures;
    if (i >= plan.warmup) status += (status.empty() ? "" : ", ") + std::to_string(r);
    return us;
  });
  out.extra = {"\"trials\": " + std::to_string(trials), "\"hangs\": " + std::to_string(hangs),
               "\"failures\": " + std::to_string(failures), "\"status\": [" + status + "]"};
  return out;
}

inline const int64_t kSizes[] = {int64_t{4} << 10, int64_t{1} << 20, int64_t{64} << 20};

}  // namespace peers

#endif  // FORKSAFE_BENCH_PEERS_HARNESS_H_
