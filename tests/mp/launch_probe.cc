// A rank for launchers_test.py: run by mpirun, MPICH's mpiexec and torchrun (--no_python), it
// prints what it sees and does one of:
//   info                 "LAUNCH ..." and a Pool.map over 1..10 ("POOL sum=385").
//   spawn N METHOD       "LAUNCH ..." for itself and "CHILD ..." from each of its N spawn()
//   children. fail                 spawn() of 2 whose child 1 throws; exits 3 (the failure is in
//                        TORCHELASTIC_ERROR_FILE when the launcher set it).
//   hold DIR             a tensor in /dev/shm (file_system strategy) held by itself and 2 forked
//                        children; writes DIR/rank<R> with its pid, the children's, its shm
//                        manager's and its /dev/shm names, then sleeps (at most 300 s) until the
//                        launcher ends it.
#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/device/tensor.h"
#include "forksafe/mp/internal/shm_manager.h"
#include "forksafe/mp/launch.h"
#include "forksafe/mp/pool.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/sharing.h"
#include "forksafe/mp/spawn.h"
#include "forksafe/runtime/cpu_budget.h"

namespace fmp = forksafe::mp;

namespace {

void PrintInfo(const char* tag) {
  const fmp::LaunchInfo i = fmp::GetLaunchInfo();
  std::printf(
      "%s rank=%d local_rank=%d world=%d local_world=%d node=%d launcher=%s master=%s:%d "
      "pid=%d ppid=%d\n",
      tag, i.rank, i.local_rank, i.world_size, i.local_world_size, i.node_rank,
      fmp::LauncherName(i.launcher), i.master_addr.c_str(), i.master_port, getpid(), getppid());
  std::fflush(stdout);
}

int Square(int x) { return x * x; }
FORKSAFE_ENTRY_POINT(Square);

void Child(int i) { PrintInfo("CHILD"); }
FORKSAFE_ENTRY_POINT(Child);

void FailSecond(int i, int rank) {
  PrintInfo("CHILD");
  if (i == 1) throw std::runtime_error("probe failure in rank " + std::to_string(rank));
}
FORKSAFE_ENTRY_POINT(FailSecond);

void Hold(forksafe::device::Tensor t) { std::this_thread::sleep_for(std::chrono::seconds(300)); }

}  // namespace

int main(int argc, char** argv) {
  fmp::InitMain(argc, argv);
  const std::string mode = argc > 1 ? argv[1] : "info";
  PrintInfo("LAUNCH");
  if (mode == "info") {
    fmp::Pool pool(fmp::PoolOptions{2});
    std::vector<int> xs;
    for (int x = 1; x <= 10; ++x) xs.push_back(x);
    int sum = 0;
    for (int r : pool.map(&Square, xs)) sum += r;
    std::printf("POOL sum=%d default_threads=%d\n", sum, forksafe::runtime::DefaultThreadCount());
    return 0;
  }
  if (mode == "spawn" && argc > 3) {
    fmp::SpawnOptions o;
    o.nprocs = std::atoi(argv[2]);
    o.start_method = argv[3];
    fmp::spawn(&Child, std::make_tuple(), o);
    return 0;
  }
  if (mode == "fail") {
    fmp::SpawnOptions o;
    o.nprocs = 2;
    o.start_method = "fork";
    try {
      fmp::spawn(&FailSecond, std::make_tuple(fmp::GetLaunchInfo().rank), o);
    } catch (const fmp::ProcessRaisedException& e) {
      std::fprintf(stderr, "probe: %s\n", e.what());
      return 3;
    }
    return 0;
  }
  if (mode == "hold" && argc > 2) {
    fmp::set_sharing_strategy("file_system");
    forksafe::device::Tensor t = fmp::SharedEmpty({1 << 20});
    fmp::Process a(&Hold, t), b(&Hold, t);
    a.start();
    b.start();
    std::string names;
    const std::string prefix = "forksafe_" + std::to_string(getpid()) + "_";
    if (DIR* d = opendir("/dev/shm")) {
      while (dirent* e = readdir(d)) {
        if (std::string(e->d_name).rfind(prefix, 0) == 0) names += std::string(" ") + e->d_name;
      }
      closedir(d);
    }
    const std::string path =
        std::string(argv[2]) + "/rank" + std::to_string(fmp::GetLaunchInfo().rank);
    {
      std::ofstream f(path + ".tmp");
      f << getpid() << " " << a.pid() << " " << b.pid() << " " << fmp::internal::ShmManagerPid()
        << "\n"
        << names << "\n";
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
    std::this_thread::sleep_for(std::chrono::seconds(300));
    return 0;
  }
  std::fprintf(stderr, "usage: launch_probe info | spawn N METHOD | fail | hold DIR\n");
  return 2;
}
