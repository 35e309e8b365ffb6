// The fault matrix (issue 7): for each start method (fork, spawn, forkserver) and each API
// (Process, spawn(), Pool), a child that throws, aborts, segfaults, is SIGKILLed, exits non-zero,
// hangs, or closes its pipe in the middle of a message; and, for each start method and API, a
// parent SIGKILLed while its children run. Every cell asserts what a user observes (exit codes,
// the exception raised and its text, timeouts, a torn message read as an error), that nothing
// hangs (every wait is bounded), and that nothing leaks: no process, descriptor or /dev/shm entry
// is left behind by the cell. The leak checks are local to this file (a snapshot per cell).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/mp/spawn.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---- the faults ---------------------------------------------------------------------------------

enum Fault : int {
  kThrow = 0,    // the target throws std::runtime_error
  kAbort,        // std::abort()
  kSegfault,     // a real SIGSEGV
  kSigkill,      // raise(SIGKILL)
  kExitNonZero,  // std::exit(3)
  kHang,         // sleeps far longer than the test waits
  kTornMessage,  // writes part of a message on its Connection, then exits
};
constexpr Fault kAllFaults[] = {kThrow,       kAbort, kSegfault,   kSigkill,
                                kExitNonZero, kHang,  kTornMessage};

const char* FaultName(Fault f) {
  switch (f) {
    case kThrow: return "Throws";
    case kAbort: return "Aborts";
    case kSegfault: return "Segfaults";
    case kSigkill: return "IsSigkilled";
    case kExitNonZero: return "ExitsNonZero";
    case kHang: return "Hangs";
    case kTornMessage: return "ClosesPipeMidMessage";
  }
  return "?";
}

enum class Api { kProcess, kSpawn, kPool };
const char* ApiName(Api a) {
  switch (a) {
    case Api::kProcess: return "Process";
    case Api::kSpawn: return "spawn";
    case Api::kPool: return "Pool";
  }
  return "?";
}

constexpr char kThrowMessage[] = "fault matrix: the child gave up";

// Not inlined, so that the child's stack trace names it.
[[gnu::noinline]] void ThrowFromDeep() { throw std::runtime_error(kThrowMessage); }

// Writes the first half of a real forksafe frame (header and part of the payload) on `out` and
// closes this process's copy: the reader sees a message that starts and never ends. The frame is
// produced by the library itself on a private socket pair, so the test does not depend on the
// wire format.
void WriteTornMessage(Connection& out, bool close_after = true) {
  auto [a, b] = Pipe();
  a.send(std::string(1000, 'x'));
  std::string frame(4096, '\0');
  const ssize_t n = ::read(b.fileno(), frame.data(), frame.size());
  if (n <= 0) std::abort();
  const size_t half = static_cast<size_t>(n) / 2;
  if (::write(out.fileno(), frame.data(), half) != static_cast<ssize_t>(half)) std::abort();
  if (close_after) out.close();
}

// What a faulty child does. `out` is the child's end of a Pipe: the hang reports its pid there
// first (so that the test can kill it), the torn message is written there.
void Misbehave(Fault f, Connection& out) {
  switch (f) {
    case kThrow: ThrowFromDeep(); break;
    case kAbort: std::abort();
    case kSegfault:
      raise(SIGSEGV);  // a real delivery (a null store would be reported by UBSan instead)
      break;
    case kSigkill: raise(SIGKILL); break;
    case kExitNonZero: std::exit(3);
    case kHang:
      out.send(static_cast<int>(getpid()));
      std::this_thread::sleep_for(60s);
      break;
    case kTornMessage: WriteTornMessage(out); break;
  }
}

// ---- entry points (registered: usable with every start method) ----------------------------------

void ProcessTarget(int fault, Connection out) { Misbehave(static_cast<Fault>(fault), out); }
FORKSAFE_ENTRY_POINT(ProcessTarget);

// spawn(): process 1 misbehaves; process 0 runs long (it must be terminated after the failure),
// except for the torn message, where it returns at once.
void SpawnTarget(int i, int fault, Connection out) {
  const Fault f = static_cast<Fault>(fault);
  if (i == 1) {
    Misbehave(f, out);
  } else if (f != kTornMessage) {
    std::this_thread::sleep_for(60s);
  }
}
FORKSAFE_ENTRY_POINT(SpawnTarget);

// Pool: the task with x == victim misbehaves (after a torn message its worker exits: a child that
// closed its pipe mid-message and left); the others return x * 10. Before a torn message the
// victim waits for the test's word on `out`: the test has closed its own copy of the writing end
// by then, so that the replacement worker (forked under "fork") cannot inherit it from the test.
int PoolTask(int x, int victim, int fault, Connection out) {
  if (x == victim) {
    const Fault f = static_cast<Fault>(fault);
    if (f == kTornMessage) out.recv<int>();
    Misbehave(f, out);
    if (f == kTornMessage) _exit(0);
  }
  return x * 10;
}
FORKSAFE_ENTRY_POINT(PoolTask);

int Square(int x) { return x * x; }
FORKSAFE_ENTRY_POINT(Square);

void ExitZero() {}
FORKSAFE_ENTRY_POINT(ExitZero);

// Fork-server cells: a child reports its parent (the server) and its own pid.
void ReportParent(Connection out, bool then_wait) {
  out.send(static_cast<int>(getppid()), static_cast<int>(getpid()));
  if (then_wait) std::this_thread::sleep_for(60s);
}
FORKSAFE_ENTRY_POINT(ReportParent);

// Sends half a message, then stalls with its end open.
void TornThenStall(Connection out) {
  WriteTornMessage(out, /*close_after=*/false);
  std::this_thread::sleep_for(60s);
}
FORKSAFE_ENTRY_POINT(TornThenStall);

void SpawnOk(int) {}
FORKSAFE_ENTRY_POINT(SpawnOk);

int ParentPid(int) { return static_cast<int>(getppid()); }
FORKSAFE_ENTRY_POINT(ParentPid);

// Parent-killed cells: each grandchild maps a named shared segment, reports its pid, then waits.
void HoldTensorAndWait(device::Tensor t, Connection report) {
  report.send(std::string("child"), static_cast<int>(getpid()));
  std::this_thread::sleep_for(60s);
  (void)t;
}
FORKSAFE_ENTRY_POINT(HoldTensorAndWait);

void SpawnHoldTensorAndWait(int, device::Tensor t, Connection report) {
  HoldTensorAndWait(std::move(t), std::move(report));
}
FORKSAFE_ENTRY_POINT(SpawnHoldTensorAndWait);

int PoolHoldTensorAndWait(device::Tensor t, Connection report) {
  HoldTensorAndWait(std::move(t), std::move(report));
  return 0;
}
FORKSAFE_ENTRY_POINT(PoolHoldTensorAndWait);

// ---- local leak checks --------------------------------------------------------------------------

// Children of `pid` (every thread's), from /proc/<pid>/task/*/children.
std::set<pid_t> ChildrenOf(pid_t pid) {
  std::set<pid_t> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(dir + "/" + e->d_name + "/children");
    pid_t c;
    while (f >> c) out.insert(c);
  }
  closedir(d);
  return out;
}

// Every descendant of this process.
std::set<pid_t> Descendants() {
  std::set<pid_t> out;
  std::vector<pid_t> todo = {getpid()};
  while (!todo.empty()) {
    const pid_t p = todo.back();
    todo.pop_back();
    for (pid_t c : ChildrenOf(p)) {
      if (out.insert(c).second) todo.push_back(c);
    }
  }
  return out;
}

int CountOpenFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n - 1;  // the directory's own descriptor
}

// /dev/shm entries of forksafe segments ("forksafe_<creator pid>_..."), of one creator or (pid 0)
// of all. Tests in other PID namespaces (Bazel's sandboxes) share /dev/shm, and their pids repeat
// ours: a cell judges only entries that appeared during the cell, or names it was told.
std::set<std::string> ShmEntriesOf(pid_t pid) {
  std::set<std::string> out;
  const std::string prefix = pid == 0 ? "forksafe_" : "forksafe_" + std::to_string(pid) + "_";
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (std::string(e->d_name).rfind(prefix, 0) == 0) out.insert(e->d_name);
  }
  closedir(d);
  return out;
}

bool ShmEntryExists(const std::string& name) {
  return access(("/dev/shm/" + name).c_str(), F_OK) == 0;
}

// The head of a segment (mp/internal/shared_arena.cc's SegmentHeader).
struct SegmentHead {
  uint64_t magic, size, id;
  int32_t creator;
  int32_t live_refs;
  uint64_t pid_ns;
};
constexpr uint64_t kSegmentMagic = 0x66736172656e6131ull;

uint64_t ThisPidNamespaceId() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// Whether segment `name` was made in this PID namespace (its header says so). Segments of other
// namespaces (concurrent sandboxes, whose pids repeat ours) are not this test's to judge.
bool MadeInThisPidNamespace(const std::string& name) {
  const int fd = shm_open(("/" + name).c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return false;
  SegmentHead h{};
  const bool ok = pread(fd, &h, sizeof(h), 0) == static_cast<ssize_t>(sizeof(h));
  close(fd);
  return ok && h.magic == kSegmentMagic && h.pid_ns == ThisPidNamespaceId();
}

// Writes a segment named for creator `pid` whose header records `pid_ns`; returns its name.
std::string FakeSegment(pid_t pid, uint64_t pid_ns) {
  const SegmentHead h{kSegmentMagic, 4096, 1, static_cast<int32_t>(pid), 1, pid_ns};
  static int n = 0;
  const std::string name =
      "forksafe_" + std::to_string(pid) + "_fault_matrix_" + std::to_string(++n);
  const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return "";
  const bool ok = ftruncate(fd, 4096) == 0 && pwrite(fd, &h, sizeof(h), 0) == sizeof(h);
  close(fd);
  return ok ? name : "";
}

bool Gone(pid_t pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

// Gone within `limit`: for a process that is not our child, whose zombie its reaper (init, a
// subreaper) removes in its own time.
bool GoneWithin(pid_t pid, std::chrono::milliseconds limit) {
  const auto t0 = Clock::now();
  while (!Gone(pid)) {
    if (Clock::now() - t0 > limit) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

std::string Join(const std::set<pid_t>& s) {
  std::string out;
  for (pid_t p : s) out += (out.empty() ? "" : " ") + std::to_string(p);
  return out;
}

// A snapshot of what this process holds; Check() says what a cell left behind.
class LeakSnapshot {
 public:
  LeakSnapshot() : descendants_(Descendants()), fds_(CountOpenFds()), shm_(ShmEntriesOf(0)) {}

  // What was left since the snapshot, one line each: an unreaped child, a new descendant (child
  // or grandchild: a fork server's children count), a new descriptor, a new /dev/shm entry of
  // this process or of `children` (the cell's child processes). Reaps the zombie it reports.
  std::vector<std::string> Problems(const std::vector<pid_t>& children) const {
    std::vector<std::string> out;
    int status = 0;
    const pid_t zombie = waitpid(-1, &status, WNOHANG);
    if (zombie > 0)
      out.push_back("child " + std::to_string(zombie) + " exited but was never reaped");
    const std::set<pid_t> extra = NewDescendants();
    if (!extra.empty()) out.push_back("processes left behind: " + Join(extra));
    const int fds = CountOpenFds();
    if (fds != fds_) {
      out.push_back("descriptors: " + std::to_string(fds) + " open, " + std::to_string(fds_) +
                    " before");
    }
    std::vector<pid_t> creators = children;
    creators.push_back(getpid());
    for (pid_t c : creators) {
      for (const std::string& name : ShmEntriesOf(c)) {
        if (shm_.count(name) != 0) continue;          // there before the cell
        if (!MadeInThisPidNamespace(name)) continue;  // another sandbox's pid, not ours
        out.push_back("/dev/shm entry " + name + " left by " +
                      (c == getpid() ? std::string("this process") : "child " + std::to_string(c)));
      }
    }
    return out;
  }

  // Fails the test with every problem found, then kills and reaps the processes left behind, so
  // that a failing cell does not leave strays for the next one.
  void Check(const std::vector<pid_t>& children) const {
    for (const std::string& p : Problems(children)) ADD_FAILURE() << "leak: " << p;
    const std::set<pid_t> extra = NewDescendants();
    for (pid_t p : extra) kill(p, SIGKILL);
    for (pid_t p : extra) {
      for (int i = 0; i < 1000 && waitpid(p, nullptr, WNOHANG) == 0; ++i) {
        std::this_thread::sleep_for(1ms);  // our child: reap it; someone else's: not ours to wait
      }
    }
  }

  // Descendants that were not there at the snapshot.
  std::set<pid_t> NewDescendants() const {
    std::set<pid_t> extra;
    for (pid_t p : Descendants()) {
      if (descendants_.count(p) == 0) extra.insert(p);
    }
    return extra;
  }

 private:
  std::set<pid_t> descendants_;
  int fds_;
  std::set<std::string> shm_;
};

// Starts (once per start method) what lives as long as the process: the lifeline pipe and, for
// forkserver, the server. Cells then measure against a baseline that already includes them.
void WarmUp(const std::string& method) {
  static std::set<std::string> done;
  if (!done.insert(method).second) return;
  Process p(ProcessOptions{"warm-up", false, method}, &ExitZero);
  p.start();
  ASSERT_TRUE(p.join(30s));
}

// The torn message reads as an error that says so, promptly; never as a message, never a hang.
void ExpectTornMessage(Connection& in) {
  const auto t0 = Clock::now();
  try {
    Message m = in.RecvMessage(10.0);
    ADD_FAILURE() << "a torn message was returned as a message of " << m.bytes.size() << " bytes";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kClosed) << e.what();
    EXPECT_NE(std::string(e.what()).find("in the middle of a message"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(Clock::now() - t0, 5s);
  // The stream is over: the next read says the peer closed, it does not wait.
  try {
    in.RecvMessage(10.0);
    ADD_FAILURE() << "a message after the torn one";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kClosed) << e.what();
  }
}

// ---- the matrix ---------------------------------------------------------------------------------

using CellParam = std::tuple<std::string, Api, Fault>;

class FaultMatrixTest : public ::testing::TestWithParam<CellParam> {
 protected:
  void SetUp() override { WarmUp(method()); }
  const std::string& method() const { return std::get<0>(GetParam()); }
  Api api() const { return std::get<1>(GetParam()); }
  Fault fault() const { return std::get<2>(GetParam()); }

  void RunProcessCell(std::vector<pid_t>* pids);
  void RunSpawnCell(std::vector<pid_t>* pids);
  void RunPoolCell(std::vector<pid_t>* pids);
};

void FaultMatrixTest::RunProcessCell(std::vector<pid_t>* pids) {
  auto [ours, theirs] = Pipe();
  Process p(ProcessOptions{"faulty", false, method()}, &ProcessTarget, static_cast<int>(fault()),
            theirs);
  p.start();
  pids->push_back(p.pid());
  theirs.close();  // only the child holds the writing end now
  if (fault() == kHang) {
    ASSERT_TRUE(ours.poll(30s)) << "the hanging child never started";
    EXPECT_EQ(ours.recv<int>(), p.pid());
    const auto t0 = Clock::now();
    EXPECT_FALSE(p.join(0.2));
    EXPECT_LT(Clock::now() - t0, 2s) << "join(0.2) did not return in time";
    EXPECT_TRUE(p.is_alive());
    EXPECT_EQ(p.exitcode(), std::nullopt);
    EXPECT_THROW(p.close(), Error);  // still running
    p.terminate();
    ASSERT_TRUE(p.join(10s)) << "terminate() did not end a hanging child";
    EXPECT_EQ(p.exitcode(), -SIGTERM);
    EXPECT_FALSE(p.is_alive());
    EXPECT_FALSE(p.failure().has_value());
    return;
  }
  if (fault() == kTornMessage) ExpectTornMessage(ours);
  ASSERT_TRUE(p.join(20s)) << "the child did not end";
  EXPECT_FALSE(p.is_alive());
  switch (fault()) {
    case kThrow: {
      EXPECT_EQ(p.exitcode(), 1);
      const auto f = p.failure();
      ASSERT_TRUE(f.has_value());
      EXPECT_EQ(f->type, "std::runtime_error");
      EXPECT_EQ(f->message, kThrowMessage);
      EXPECT_NE(f->traceback.find("ThrowFromDeep"), std::string::npos) << f->traceback;
      break;
    }
    case kAbort: EXPECT_EQ(p.exitcode(), -SIGABRT); break;
    case kSegfault: EXPECT_EQ(p.exitcode(), -SIGSEGV); break;
    case kSigkill: EXPECT_EQ(p.exitcode(), -SIGKILL); break;
    case kExitNonZero: EXPECT_EQ(p.exitcode(), 3); break;
    case kTornMessage: EXPECT_EQ(p.exitcode(), 0); break;
    case kHang: break;
  }
  if (fault() != kThrow) {
    EXPECT_FALSE(p.failure().has_value());
  }
  p.close();
}

void FaultMatrixTest::RunSpawnCell(std::vector<pid_t>* pids) {
  auto [ours, theirs] = Pipe();
  SpawnOptions o;
  o.nprocs = 2;
  o.start_method = method();
  o.grace_period = 1s;
  const int f = static_cast<int>(fault());
  if (fault() == kHang) {
    o.join = false;
    auto ctx = spawn(&SpawnTarget, std::make_tuple(f, theirs), o);
    theirs.close();
    for (pid_t p : ctx->pids()) pids->push_back(p);
    ASSERT_TRUE(ours.poll(30s)) << "the hanging child never started";
    EXPECT_EQ(ours.recv<int>(), ctx->pids()[1]);
    const auto t0 = Clock::now();
    EXPECT_FALSE(ctx->join(0.2));
    EXPECT_LT(Clock::now() - t0, 2s) << "join(0.2) did not return in time";
    for (Process& p : ctx->processes()) EXPECT_TRUE(p.is_alive());
    ctx->processes()[1].kill();  // the user's way out of a hang
    try {
      ctx->join(20s);
      ADD_FAILURE() << "a killed child must fail the join";
    } catch (const ProcessExitedException& e) {
      EXPECT_EQ(e.error_index(), 1);
      EXPECT_EQ(e.error_pid(), ctx->pids()[1]);
      EXPECT_EQ(e.exit_code(), -SIGKILL);
      EXPECT_EQ(e.signal_name(), "SIGKILL (Killed)");
    }
    for (Process& p : ctx->processes()) EXPECT_FALSE(p.is_alive()) << "not terminated";
    return;
  }
  if (fault() == kTornMessage) {
    auto ctx = spawn(&SpawnTarget, std::make_tuple(f, theirs), o);  // joins: both exit with 0
    theirs.close();
    for (pid_t p : ctx->pids()) pids->push_back(p);
    for (Process& p : ctx->processes()) {
      EXPECT_EQ(p.exitcode(), 0);
      EXPECT_FALSE(p.is_alive());
    }
    ExpectTornMessage(ours);
    return;
  }
  const auto t0 = Clock::now();
  try {
    spawn(&SpawnTarget, std::make_tuple(f, theirs), o);
    ADD_FAILURE() << "spawn() must raise the child's failure";
  } catch (const ProcessRaisedException& e) {
    EXPECT_EQ(fault(), kThrow) << e.what();
    pids->push_back(e.error_pid());
    EXPECT_EQ(e.code(), ErrorCode::kProcessFailed);
    EXPECT_EQ(e.error_index(), 1);
    EXPECT_EQ(e.failure().type, "std::runtime_error");
    EXPECT_EQ(e.failure().message, kThrowMessage);
    EXPECT_NE(e.failure().traceback.find("ThrowFromDeep"), std::string::npos)
        << e.failure().traceback;
    const std::string what = e.what();
    EXPECT_NE(what.find("process 1"), std::string::npos) << what;
    EXPECT_NE(what.find(kThrowMessage), std::string::npos) << what;
    EXPECT_TRUE(Gone(e.error_pid()));
  } catch (const ProcessExitedException& e) {
    EXPECT_NE(fault(), kThrow) << e.what();
    pids->push_back(e.error_pid());
    EXPECT_EQ(e.code(), ErrorCode::kProcessFailed);
    EXPECT_EQ(e.error_index(), 1);
    const std::string what = e.what();
    int code = 0;
    std::string sig;
    switch (fault()) {
      case kAbort:
        code = -SIGABRT;
        sig = "SIGABRT (Aborted)";
        break;
      case kSegfault:
        code = -SIGSEGV;
        sig = "SIGSEGV (Segmentation fault)";
        break;
      case kSigkill:
        code = -SIGKILL;
        sig = "SIGKILL (Killed)";
        break;
      case kExitNonZero: code = 3; break;
      default: break;
    }
    EXPECT_EQ(e.exit_code(), code) << what;
    EXPECT_EQ(e.signal_name(), sig) << what;
    if (sig.empty()) {
      EXPECT_NE(what.find("exit code 3"), std::string::npos) << what;
    } else {
      EXPECT_NE(what.find(sig), std::string::npos) << what;
    }
    EXPECT_TRUE(Gone(e.error_pid()));
  }
  // Process 0 sleeps for a minute: it was terminated, not waited for.
  EXPECT_LT(Clock::now() - t0, 20s) << "the other process was not terminated after the failure";
}

void FaultMatrixTest::RunPoolCell(std::vector<pid_t>* pids) {
  PoolOptions po;
  po.processes = 2;
  po.start_method = method();
  Pool pool(po);
  const std::vector<pid_t> before = pool.pids();
  for (pid_t p : before) pids->push_back(p);
  auto [ours, theirs] = Pipe();  // after the workers: forked workers do not inherit it
  constexpr int kTasks = 6, kVictim = 3;
  const int f = static_cast<int>(fault());
  std::vector<AsyncResult<int>> rs;
  for (int i = 0; i < kTasks; ++i) rs.push_back(pool.apply_async(&PoolTask, i, kVictim, f, theirs));
  theirs.close();                             // the tasks carry their own copies
  if (fault() == kTornMessage) ours.send(1);  // the victim may go on
  pid_t hung = 0;
  if (fault() == kHang) {
    ASSERT_TRUE(ours.poll(30s)) << "the hanging task never started";
    hung = ours.recv<int>();
    const auto t0 = Clock::now();
    try {
      rs[kVictim].get(0.2);
      ADD_FAILURE() << "get(0.2) of a hanging task must time out";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kDeadlineExceeded) << e.what();
      EXPECT_NE(std::string(e.what()).find("not ready within 0.2 s"), std::string::npos)
          << e.what();
    }
    EXPECT_LT(Clock::now() - t0, 2s);
    EXPECT_FALSE(rs[kVictim].ready());
  }
  // Every other task is accounted for, whatever happened to the victim.
  for (int i = 0; i < kTasks; ++i) {
    if (i != kVictim) {
      EXPECT_EQ(rs[i].get(30s), i * 10) << "task " << i;
    }
  }
  if (fault() == kHang) {
    EXPECT_FALSE(rs[kVictim].ready());
    EXPECT_NE(std::find(before.begin(), before.end(), hung), before.end());
    ASSERT_EQ(kill(hung, SIGKILL), 0);  // the user's way out of a hung task
  }
  if (fault() == kTornMessage) ExpectTornMessage(ours);
  try {
    rs[kVictim].get(30s);
    ADD_FAILURE() << "the faulty task must fail";
  } catch (const RemoteError& e) {
    EXPECT_EQ(fault(), kThrow) << e.what();
    EXPECT_EQ(e.code(), ErrorCode::kProcessFailed);
    EXPECT_EQ(e.failure().type, "std::runtime_error");
    EXPECT_EQ(e.failure().message, kThrowMessage);
    EXPECT_NE(e.failure().traceback.find("ThrowFromDeep"), std::string::npos)
        << e.failure().traceback;
    EXPECT_NE(std::string(e.what()).find(kThrowMessage), std::string::npos) << e.what();
    EXPECT_NE(std::find(before.begin(), before.end(), e.worker_pid()), before.end());
    EXPECT_EQ(pool.pids(), before) << "a task that throws does not cost its worker";
  } catch (const WorkerLostError& e) {
    EXPECT_NE(fault(), kThrow) << e.what();
    EXPECT_EQ(e.code(), ErrorCode::kProcessFailed);
    int code = 0;
    std::string text;
    switch (fault()) {
      case kAbort:
        code = -SIGABRT;
        text = "SIGABRT (Aborted)";
        break;
      case kSegfault:
        code = -SIGSEGV;
        text = "SIGSEGV (Segmentation fault)";
        break;
      case kSigkill:
      case kHang:
        code = -SIGKILL;
        text = "SIGKILL (Killed)";
        break;
      case kExitNonZero:
        code = 3;
        text = "exited with code 3";
        break;
      case kTornMessage:
        code = 0;
        text = "exited with code 0";
        break;
      case kThrow: break;
    }
    EXPECT_EQ(e.exit_code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    if (fault() == kHang) {
      EXPECT_EQ(e.worker_pid(), hung);
    }
    EXPECT_NE(std::string(e.what()).find("while running apply_async"), std::string::npos)
        << e.what();
    EXPECT_NE(std::find(before.begin(), before.end(), e.worker_pid()), before.end());
    EXPECT_TRUE(Gone(e.worker_pid())) << "the dead worker was not reaped";
  }
  EXPECT_TRUE(rs[kVictim].ready());
  EXPECT_FALSE(rs[kVictim].successful());
  // The pool goes on: a replacement worker if one died, and later work runs.
  std::vector<int> in(10), expected(10);
  for (int i = 0; i < 10; ++i) {
    in[i] = i;
    expected[i] = i * i;
  }
  EXPECT_EQ(pool.map(&Square, in, 1), expected);
  const auto t0 = Clock::now();
  while (pool.pids().size() != 2 && Clock::now() - t0 < 20s) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(pool.pids().size(), 2u);
  for (pid_t p : pool.pids()) pids->push_back(p);
  pool.close();
  EXPECT_TRUE(pool.join(30s));
  for (pid_t p : *pids) EXPECT_TRUE(Gone(p)) << "worker " << p << " outlived its pool";
}

TEST_P(FaultMatrixTest, EndsWithTheRightErrorNoHangNoLeak) {
  const LeakSnapshot snapshot;
  std::vector<pid_t> pids;
  const auto t0 = Clock::now();
  switch (api()) {
    case Api::kProcess: RunProcessCell(&pids); break;
    case Api::kSpawn: RunSpawnCell(&pids); break;
    case Api::kPool: RunPoolCell(&pids); break;
  }
  EXPECT_LT(Clock::now() - t0, 30s);
  snapshot.Check(pids);
}

std::string CellName(const ::testing::TestParamInfo<CellParam>& info) {
  return std::get<0>(info.param) + "_" + ApiName(std::get<1>(info.param)) + "_" +
         FaultName(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Matrix, FaultMatrixTest,
                         ::testing::Combine(::testing::Values("fork", "spawn", "forkserver"),
                                            ::testing::Values(Api::kProcess, Api::kSpawn,
                                                              Api::kPool),
                                            ::testing::ValuesIn(kAllFaults)),
                         CellName);

// The leak checks are not vacuous: each kind of leak is seen.
TEST(LeakSnapshotTest, SeesWhatACellLeaves) {
  {
    const LeakSnapshot s;
    EXPECT_TRUE(s.Problems({}).empty());
    const int fd = dup(0);
    const std::vector<std::string> p = s.Problems({});
    ASSERT_EQ(p.size(), 1u);
    EXPECT_NE(p[0].find("descriptors"), std::string::npos) << p[0];
    close(fd);
  }
  {
    const LeakSnapshot s;
    const pid_t running = fork();
    if (running == 0) {
      alarm(30);
      pause();
      _exit(0);
    }
    ASSERT_GT(running, 0);
    const std::vector<std::string> p = s.Problems({});
    ASSERT_EQ(p.size(), 1u);
    EXPECT_EQ(p[0], "processes left behind: " + std::to_string(running));
    kill(running, SIGKILL);
    waitpid(running, nullptr, 0);
  }
  {
    const LeakSnapshot s;
    const pid_t exited = fork();
    if (exited == 0) _exit(0);
    ASSERT_GT(exited, 0);
    siginfo_t si;
    ASSERT_EQ(waitid(P_PID, exited, &si, WEXITED | WNOWAIT), 0);  // a zombie now, not reaped
    const std::vector<std::string> p = s.Problems({});
    ASSERT_GE(p.size(), 1u);
    EXPECT_EQ(p[0], "child " + std::to_string(exited) + " exited but was never reaped");
    EXPECT_TRUE(s.Problems({}).empty()) << "the report reaps it";
  }
  {
    const LeakSnapshot s;
    const std::string name = FakeSegment(getpid(), ThisPidNamespaceId());
    ASSERT_FALSE(name.empty());
    std::vector<std::string> p = s.Problems({});
    ASSERT_EQ(p.size(), 1u);
    EXPECT_EQ(p[0], "/dev/shm entry " + name + " left by this process");
    shm_unlink(("/" + name).c_str());
    EXPECT_TRUE(s.Problems({}).empty());
    // The same name made in another PID namespace (a sandbox whose pids repeat ours) is not ours.
    const std::string foreign = FakeSegment(getpid(), ThisPidNamespaceId() + 1);
    ASSERT_FALSE(foreign.empty());
    EXPECT_TRUE(s.Problems({}).empty());
    shm_unlink(("/" + foreign).c_str());
  }
}

// ---- a parent SIGKILLed mid-run -----------------------------------------------------------------

using ParentParam = std::tuple<std::string, Api>;

class ParentKilledTest : public ::testing::TestWithParam<ParentParam> {
 protected:
  void SetUp() override { WarmUp(std::get<0>(GetParam())); }
};

// The middle process (a RunInChild child of the test) shares a named segment ("file_system"),
// starts two children with the method and API under test, each holding the segment, and is
// SIGKILLed while they run. Its children (and its fork server, its shm manager) must exit by
// themselves, and its segment must leave /dev/shm, within a bounded time.
TEST_P(ParentKilledTest, ChildrenExitAndNothingIsLeftInDevShm) {
  const std::string method = std::get<0>(GetParam());
  const Api api = std::get<1>(GetParam());
  const LeakSnapshot snapshot;
  // Adopt orphans, so that they can be reaped and seen to have died.
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  struct NoSubreaperAtExit {
    ~NoSubreaperAtExit() { prctl(PR_SET_CHILD_SUBREAPER, 0); }
  } no_subreaper_at_exit;
  auto [ours, theirs] = Pipe();
  forksafe::testing::ChildResult middle_result;
  Connection report = theirs;  // the middle process's copy (inherited through the fork)
  std::thread runner([&] {
    middle_result = forksafe::testing::RunInChild(
        [&]() -> int {
          set_sharing_strategy("file_system");
          const std::set<std::string> before = ShmEntriesOf(getpid());
          device::Tensor t = SharedEmpty({1024});
          for (const std::string& name : ShmEntriesOf(getpid())) {
            if (before.count(name) == 0) report.send(std::string("segment:" + name), 0);
          }
          report.send(std::string("middle"), static_cast<int>(getpid()));
          std::vector<Process> procs;
          std::unique_ptr<ProcessContext> ctx;
          std::unique_ptr<Pool> pool;
          std::vector<AsyncResult<int>> rs;
          switch (api) {
            case Api::kProcess:
              for (int i = 0; i < 2; ++i) {
                procs.emplace_back(ProcessOptions{"", false, method}, &HoldTensorAndWait, t,
                                   report);
                procs.back().start();
              }
              break;
            case Api::kSpawn: {
              SpawnOptions o;
              o.nprocs = 2;
              o.join = false;
              o.start_method = method;
              ctx = spawn(&SpawnHoldTensorAndWait, std::make_tuple(t, report), o);
              break;
            }
            case Api::kPool: {
              PoolOptions po;
              po.processes = 2;
              po.start_method = method;
              pool = std::make_unique<Pool>(po);
              for (int i = 0; i < 2; ++i) {
                rs.push_back(pool->apply_async(&PoolHoldTensorAndWait, t, report));
              }
              break;
            }
          }
          std::this_thread::sleep_for(60s);  // killed long before
          return 0;
        },
        30s, 30);
  });
  pid_t middle = 0;
  // Whatever fails below, the runner thread is joined (RunInChild gives up after 30 s).
  struct JoinAtExit {
    std::thread& t;
    pid_t& middle;
    ~JoinAtExit() {
      if (!t.joinable()) return;
      if (middle > 0) kill(middle, SIGKILL);
      t.join();
    }
  } join_at_exit{runner, middle};
  std::set<pid_t> grandchildren;
  std::set<std::string> segments;  // the middle process's, by name
  auto any_segment_left = [&] {
    return std::any_of(segments.begin(), segments.end(), ShmEntryExists);
  };
  const auto t_start = Clock::now();
  while ((middle == 0 || grandchildren.size() < 2) && Clock::now() - t_start < 30s) {
    if (!ours.poll(1.0)) continue;
    std::string who;
    int pid = 0;
    Message m = ours.RecvMessage(std::nullopt);
    Decode(m, who, pid);
    if (who.rfind("segment:", 0) == 0) {
      segments.insert(who.substr(8));
    } else if (who == "middle") {
      middle = pid;
    } else {
      grandchildren.insert(pid);
    }
  }
  ASSERT_GT(middle, 0) << "the middle process never reported";
  ASSERT_EQ(grandchildren.size(), 2u) << "its children never reported";
  EXPECT_EQ(segments.size(), 1u) << "the middle process shares one named segment";
  EXPECT_TRUE(any_segment_left());

  const auto t0 = Clock::now();
  ASSERT_EQ(kill(middle, SIGKILL), 0);
  runner.join();  // RunInChild reaps the middle process
  EXPECT_EQ(middle_result.signal, SIGKILL) << middle_result.Describe();

  // Its children die by the lifeline; reap those we adopted.
  std::set<pid_t> left = grandchildren;
  while (!left.empty() && Clock::now() - t0 < 10s) {
    int st = 0;
    pid_t r;
    while ((r = waitpid(-1, &st, WNOHANG)) > 0) left.erase(r);
    for (auto it = left.begin(); it != left.end();) {
      it = Gone(*it) ? left.erase(it) : std::next(it);
    }
    if (!left.empty()) std::this_thread::sleep_for(2ms);
  }
  const auto children_gone = Clock::now() - t0;
  EXPECT_TRUE(left.empty()) << "children outlived their SIGKILLed parent: " << Join(left);
  EXPECT_LT(children_gone, 2s) << "the lifeline took too long";
  // Its fork server and shm manager exit too (reaped here: they were adopted), and the segment
  // leaves /dev/shm.
  while (Clock::now() - t0 < 10s) {
    while (waitpid(-1, nullptr, WNOHANG) > 0) {
    }
    if (!any_segment_left() && snapshot.NewDescendants().empty()) break;
    std::this_thread::sleep_for(20ms);
  }
  const auto all_gone = Clock::now() - t0;
  EXPECT_FALSE(any_segment_left()) << "the SIGKILLed parent's segment stayed in /dev/shm";
  RecordProperty(
      "children_gone_ms",
      std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(children_gone).count()));
  RecordProperty(
      "all_gone_ms",
      std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(all_gone).count()));
  ours.close();
  theirs.close();
  std::vector<pid_t> all(grandchildren.begin(), grandchildren.end());
  all.push_back(middle);
  snapshot.Check(all);
}

std::string ParentCellName(const ::testing::TestParamInfo<ParentParam>& info) {
  return std::get<0>(info.param) + "_" + ApiName(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Matrix, ParentKilledTest,
                         ::testing::Combine(::testing::Values("fork", "spawn", "forkserver"),
                                            ::testing::Values(Api::kProcess, Api::kSpawn,
                                                              Api::kPool)),
                         ParentCellName);

// ---- the fork server SIGKILLed -----------------------------------------------------------------

// The fork server is a child of this process too, and can be SIGKILLed (the OOM killer picks
// large processes, and a user may kill it). Its children keep running (they die with this process,
// not with the server); the start method keeps working with a new server; nothing is left.

// The fork server's pid, as seen by a fresh forkserver child.
pid_t CurrentForkServer() {
  auto [ours, theirs] = Pipe();
  Process p(ProcessOptions{"", false, "forkserver"}, &ReportParent, theirs, false);
  p.start();
  theirs.close();
  if (!ours.poll(10s)) return 0;
  Message m = ours.RecvMessage(std::nullopt);
  int server = 0, child = 0;
  Decode(m, server, child);
  p.join(10s);
  return server;
}

// What the snapshot may see after the server was replaced: exactly the new server, and nothing
// else (the old server reaped, its socket closed: the descriptor count is back too).
void ExpectOnlyTheNewServerLeft(const LeakSnapshot& snapshot, pid_t old_server) {
  const pid_t server = CurrentForkServer();
  ASSERT_GT(server, 0);
  EXPECT_NE(server, old_server) << "the dead server is still the server";
  const std::vector<std::string> problems = snapshot.Problems({});
  ASSERT_EQ(problems.size(), 1u) << problems[0];
  EXPECT_EQ(problems[0], "processes left behind: " + std::to_string(server));
  EXPECT_TRUE(Gone(old_server)) << "the dead server was not reaped";
}

TEST(ForkServerKilledTest, ProcessAndSpawnGoOnWithANewServer) {
  WarmUp("forkserver");
  const LeakSnapshot snapshot;
  auto [ours, theirs] = Pipe();
  Process p(ProcessOptions{"", false, "forkserver"}, &ReportParent, theirs, true);
  p.start();
  theirs.close();
  ASSERT_TRUE(ours.poll(10s));
  Message m = ours.RecvMessage(std::nullopt);
  int server = 0, child = 0;
  Decode(m, server, child);
  EXPECT_EQ(child, p.pid());
  ASSERT_EQ(kill(server, SIGKILL), 0);
  // Its child runs on: it belongs to this process (lifeline), not to the server.
  EXPECT_FALSE(p.join(0.2));
  EXPECT_TRUE(p.is_alive());
  p.kill();
  ASSERT_TRUE(p.join(10s));
  // Its status died with the server: unknown, and said so (never an invented SIGKILL).
  try {
    p.exitcode();
    ADD_FAILURE() << "a status nobody kept was made up";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition) << e.what();
    EXPECT_NE(e.message().find("fork server"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(GoneWithin(child, 5000ms)) << "an orphan of the server";
  // The start method still works: a new server.
  Process q(ProcessOptions{"", false, "forkserver"}, &ExitZero);
  q.start();
  ASSERT_TRUE(q.join(10s));
  EXPECT_EQ(q.exitcode(), 0);
  SpawnOptions o;
  o.nprocs = 2;
  o.start_method = "forkserver";
  auto ctx = spawn(&SpawnOk, std::make_tuple(), o);
  for (Process& x : ctx->processes()) EXPECT_EQ(x.exitcode(), 0);
  ctx.reset();
  p.close();
  q.close();
  ours.close();
  ExpectOnlyTheNewServerLeft(snapshot, server);
}

TEST(ForkServerKilledTest, PoolReplacesWorkersThroughANewServer) {
  WarmUp("forkserver");
  const LeakSnapshot snapshot;
  pid_t server = 0;
  {
    PoolOptions po;
    po.processes = 2;
    po.start_method = "forkserver";
    Pool pool(po);
    server = pool.apply(&ParentPid, 0);
    ASSERT_GT(server, 0);
    ASSERT_EQ(kill(server, SIGKILL), 0);
    // The workers run on; one that dies now is replaced through a new server.
    auto [ours, theirs] = Pipe();
    AsyncResult<int> lost = pool.apply_async(&PoolTask, 0, 0, static_cast<int>(kSigkill), theirs);
    theirs.close();
    try {
      lost.get(30s);
      ADD_FAILURE() << "the task killed its worker";
    } catch (const WorkerLostError& e) {
      // Its status died with the server: not invented, and the message says why.
      EXPECT_EQ(e.exit_code(), 0) << e.what();
      EXPECT_NE(std::string(e.what()).find("status is lost"), std::string::npos) << e.what();
    }
    std::vector<int> in = {1, 2, 3, 4, 5, 6};
    EXPECT_EQ(pool.map(&Square, in, 1), (std::vector<int>{1, 4, 9, 16, 25, 36}));
    const auto t0 = Clock::now();
    while (pool.pids().size() != 2 && Clock::now() - t0 < 20s) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(pool.pids().size(), 2u) << "no replacement worker";
    pool.close();
    EXPECT_TRUE(pool.join(30s));
  }
  ExpectOnlyTheNewServerLeft(snapshot, server);
}

// ---- more torn messages
// ---------------------------------------------------------------------------

class TornMessageTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { WarmUp(GetParam()); }
};

// A sender that stalls in the middle of a message: recv(timeout) ends at the timeout with an error
// that says so (not only when no byte came), and closes the connection it cannot resume.
TEST_P(TornMessageTest, AStalledSenderEndsTheReceiveAtItsTimeout) {
  const LeakSnapshot snapshot;
  std::vector<pid_t> pids;
  {
    auto [ours, theirs] = Pipe();
    Process p(ProcessOptions{"", false, GetParam()}, &TornThenStall, theirs);
    p.start();
    pids.push_back(p.pid());
    theirs.close();
    ASSERT_TRUE(ours.poll(10s));
    const auto t0 = Clock::now();
    try {
      ours.RecvMessage(0.3);
      ADD_FAILURE() << "half a message was returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kDeadlineExceeded) << e.what();
      EXPECT_NE(std::string(e.what()).find("started but did not finish within 0.3 s"),
                std::string::npos)
          << e.what();
    }
    EXPECT_LT(Clock::now() - t0, 2s) << "the timeout did not bound the whole message";
    EXPECT_TRUE(ours.closed());
    EXPECT_TRUE(p.is_alive());
    p.kill();
    ASSERT_TRUE(p.join(10s));
    EXPECT_EQ(p.exitcode(), -SIGKILL);
  }
  snapshot.Check(pids);
}

INSTANTIATE_TEST_SUITE_P(StartMethods, TornMessageTest,
                         ::testing::Values("fork", "spawn", "forkserver"),
                         [](const auto& info) { return info.param; });

// Under fork, a replacement worker is forked while other tasks wait in the parent with their
// inputs: it must not keep their descriptors (a Connection given to a task would then never read
// end-of-file at its other end).
TEST(PoolForkTest, AReplacementWorkerDoesNotHoldOtherTasksDescriptors) {
  WarmUp("fork");
  const LeakSnapshot snapshot;
  {
    PoolOptions po;
    po.processes = 1;
    po.start_method = "fork";
    Pool pool(po);
    auto [ours, theirs] = Pipe();
    auto [spare_r, spare_w] = Pipe();
    // The only worker dies (once told to: this process holds no writing end by then); the second
    // task waits with `theirs` until the replacement is forked.
    AsyncResult<int> lost =
        pool.apply_async(&PoolTask, 0, 0, static_cast<int>(kTornMessage), spare_w);
    AsyncResult<int> next = pool.apply_async(&PoolTask, 1, -1, static_cast<int>(kThrow), theirs);
    theirs.close();
    spare_w.close();
    spare_r.send(1);
    EXPECT_THROW(lost.get(30s), WorkerLostError);
    EXPECT_EQ(next.get(30s), 10);
    ASSERT_EQ(pool.pids().size(), 1u);
    // The task is done and nobody else holds the writing end: end-of-file, not a wait.
    try {
      ours.RecvMessage(5.0);
      ADD_FAILURE() << "a message from nowhere";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kClosed) << e.what() << " (the replacement worker "
                                              << pool.pids()[0] << " holds the task's descriptor)";
    }
    pool.close();
    EXPECT_TRUE(pool.join(30s));
  }
  snapshot.Check({});
}

}  // namespace
}  // namespace forksafe::mp
