// mp/launch.h and runtime/launch_info.h: each launcher's variables read into one LaunchInfo, their
// order, the errors for malformed and contradictory values; spawn()'s children's variables (the
// nesting rule, under every start method, inside a made-up outer launcher); the torchelastic
// error file; a rank's share of the CPUs and its device. The real launchers run in
// launchers_test.py.
#include "forksafe/mp/launch.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>

#include "forksafe/device/registry.h"
#include "forksafe/mp/spawn.h"
#include "forksafe/runtime/cpu_budget.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/cpu_budget_parts.h"
#include "gtest/gtest.h"

namespace forksafe::mp {
namespace {

using runtime::ErrorCode;
using Env = std::map<std::string, std::string>;

LaunchInfo Parse(const Env& env) {
  return runtime::internal::ParseLaunchInfo([&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

// The message of the kInvalidArgument that `env` gives.
std::string ParseError(const Env& env) {
  try {
    Parse(env);
  } catch (const runtime::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    return e.message();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(LaunchInfoTest, NoLauncherIsOneProcess) {
  const LaunchInfo i = Parse({{"HOME", "/root"}, {"LOCAL_RANK", ""}});
  EXPECT_EQ(i.launcher, Launcher::kNone);
  EXPECT_FALSE(i.launched());
  EXPECT_EQ(i.rank, 0);
  EXPECT_EQ(i.world_size, 1);
  EXPECT_EQ(i.local_world_size, 1);
  EXPECT_EQ(i.master_addr, "");
  EXPECT_EQ(i.master_port, 0);
}

TEST(LaunchInfoTest, TorchrunVariables) {
  const LaunchInfo i = Parse({{"RANK", "5"},
                              {"WORLD_SIZE", "8"},
                              {"LOCAL_RANK", "1"},
                              {"LOCAL_WORLD_SIZE", "4"},
                              {"GROUP_RANK", "1"},
                              {"TORCHELASTIC_RUN_ID", "job7"},
                              {"MASTER_ADDR", "10.0.0.1"},
                              {"MASTER_PORT", "29500"}});
  EXPECT_EQ(i.launcher, Launcher::kTorchrun);
  EXPECT_EQ(i.rank, 5);
  EXPECT_EQ(i.world_size, 8);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 4);
  EXPECT_EQ(i.node_rank, 1);
  EXPECT_EQ(i.master_addr, "10.0.0.1");
  EXPECT_EQ(i.master_port, 29500);
  EXPECT_EQ(i.ToString(),
            "rank 5 of 8 (local 1 of 4, node 1; torchrun; rendezvous 10.0.0.1:29500)");
}

TEST(LaunchInfoTest, EnvConventionWithoutLocalRankIsOneNode) {
  const LaunchInfo i = Parse({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(i.launcher, Launcher::kEnv);
  EXPECT_EQ(i.local_rank, 2);
  EXPECT_EQ(i.local_world_size, 3);
  EXPECT_EQ(i.node_rank, 0);
}

TEST(LaunchInfoTest, OpenMpiVariables) {
  const LaunchInfo i = Parse({{"OMPI_COMM_WORLD_RANK", "6"},
                              {"OMPI_COMM_WORLD_SIZE", "8"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(i.launcher, Launcher::kOpenMpi);
  EXPECT_EQ(i.rank, 6);
  EXPECT_EQ(i.world_size, 8);
  EXPECT_EQ(i.local_rank, 2);
  EXPECT_EQ(i.local_world_size, 4);
  EXPECT_EQ(i.node_rank, 1);  // 6 / 4
}

TEST(LaunchInfoTest, MpichVariables) {
  const LaunchInfo i = Parse({{"PMI_RANK", "3"},
                              {"PMI_SIZE", "4"},
                              {"MPI_LOCALRANKID", "1"},
                              {"MPI_LOCALNRANKS", "2"},
                              {"PMI_FD", "6"}});
  EXPECT_EQ(i.launcher, Launcher::kMpich);
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.world_size, 4);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 2);
  EXPECT_EQ(i.node_rank, 1);
}

TEST(LaunchInfoTest, SlurmStepVariables) {
  const LaunchInfo i = Parse({{"SLURM_PROCID", "6"},
                              {"SLURM_NTASKS", "7"},
                              {"SLURM_STEP_ID", "0"},
                              {"SLURM_LOCALID", "0"},
                              {"SLURM_NODEID", "3"},
                              {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"}});
  EXPECT_EQ(i.launcher, Launcher::kSlurm);
  EXPECT_EQ(i.rank, 6);
  EXPECT_EQ(i.world_size, 7);
  EXPECT_EQ(i.local_world_size, 1);  // the fourth node has one task
  EXPECT_EQ(i.node_rank, 3);
  // SLURM_STEP_NUM_TASKS (the step) wins over SLURM_NTASKS (the allocation).
  EXPECT_EQ(Parse({{"SLURM_PROCID", "1"},
                   {"SLURM_NTASKS", "8"},
                   {"SLURM_STEP_NUM_TASKS", "2"},
                   {"SLURM_STEPID", "4"},
                   {"SLURM_LOCALID", "1"},
                   {"SLURM_NODEID", "0"},
                   {"SLURM_TASKS_PER_NODE", "2"}})
                .world_size,
            2);
}

TEST(LaunchInfoTest, PmiWithoutLocalRanksTakesThemFromTheSlurmStep) {
  // srun --mpi=pmi2 on two nodes of two tasks: PMI_RANK/PMI_SIZE only, and the step's variables.
  const LaunchInfo i = Parse({{"PMI_RANK", "3"},
                              {"PMI_SIZE", "4"},
                              {"SLURM_PROCID", "3"},
                              {"SLURM_STEP_ID", "0"},
                              {"SLURM_STEP_NUM_TASKS", "4"},
                              {"SLURM_LOCALID", "1"},
                              {"SLURM_NODEID", "1"},
                              {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}});
  EXPECT_EQ(i.launcher, Launcher::kMpich);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 2);
  EXPECT_EQ(i.node_rank, 1);
  // Without the step, one node is assumed.
  EXPECT_EQ(Parse({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}}).local_world_size, 4);
  // A huge run length is malformed, not an overflow.
  EXPECT_NE(ParseError({{"SLURM_PROCID", "0"},
                        {"SLURM_STEP_ID", "0"},
                        {"SLURM_NTASKS", "2"},
                        {"SLURM_NODEID", "5"},
                        {"SLURM_TASKS_PER_NODE",
                         "999999999(x999999999),999999999(x999999999),"
                         "999999999(x999999999)"}})
                .find("SLURM_TASKS_PER_NODE"),
            std::string::npos);
}

TEST(LaunchInfoTest, AnSbatchScriptIsNotAStep) {
  // The batch script of a job with 8 tasks is one process: no SLURM_STEP_ID there.
  const LaunchInfo i = Parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_JOB_ID", "9"}});
  EXPECT_EQ(i.launcher, Launcher::kNone);
  EXPECT_EQ(i.world_size, 1);
}

TEST(LaunchInfoTest, TorchrunVariablesWinOverTheOuterLauncher) {
  // A spawn() child inside an Open MPI rank sees both; its own are the torchrun-style ones.
  const LaunchInfo i = Parse({{"OMPI_COMM_WORLD_RANK", "1"},
                              {"OMPI_COMM_WORLD_SIZE", "2"},
                              {"RANK", "3"},
                              {"WORLD_SIZE", "4"},
                              {"LOCAL_RANK", "3"},
                              {"LOCAL_WORLD_SIZE", "4"},
                              {"FORKSAFE_LAUNCHER", "spawn"}});
  EXPECT_EQ(i.launcher, Launcher::kSpawn);
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.world_size, 4);
  // Open MPI comes before MPICH and Slurm.
  EXPECT_EQ(Parse({{"OMPI_COMM_WORLD_RANK", "0"},
                   {"OMPI_COMM_WORLD_SIZE", "2"},
                   {"PMI_RANK", "1"},
                   {"PMI_SIZE", "2"},
                   {"SLURM_PROCID", "1"},
                   {"SLURM_STEP_ID", "0"},
                   {"SLURM_NTASKS", "2"}})
                .launcher,
            Launcher::kOpenMpi);
}

TEST(LaunchInfoTest, MalformedAndContradictoryValuesNameTheVariables) {
  EXPECT_NE(ParseError({{"RANK", "1"}}).find("RANK is set but WORLD_SIZE is not"),
            std::string::npos);
  EXPECT_NE(ParseError({{"WORLD_SIZE", "4"}}).find("WORLD_SIZE is set but RANK is not"),
            std::string::npos);
  EXPECT_NE(ParseError({{"RANK", "x1"}, {"WORLD_SIZE", "4"}}).find("RANK=\"x1\" is not a whole"),
            std::string::npos);
  EXPECT_NE(ParseError({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}).find("RANK=\"-1\""),
            std::string::npos);
  EXPECT_NE(ParseError({{"RANK", " 1"}, {"WORLD_SIZE", "4"}}).find("not a whole number"),
            std::string::npos);
  EXPECT_NE(
      ParseError({{"RANK", "4"}, {"WORLD_SIZE", "4"}}).find("RANK=4 is not below WORLD_SIZE=4"),
      std::string::npos);
  EXPECT_NE(
      ParseError({{"RANK", "0"}, {"WORLD_SIZE", "0"}}).find("WORLD_SIZE=0 must be at least 1"),
      std::string::npos);
  EXPECT_NE(
      ParseError(
          {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "8"}})
          .find("LOCAL_WORLD_SIZE=8 is larger than WORLD_SIZE=4"),
      std::string::npos);
  EXPECT_NE(
      ParseError(
          {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}})
          .find("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
      std::string::npos);
  EXPECT_NE(
      ParseError(
          {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}})
          .find("LOCAL_RANK=1 is larger than RANK=0"),
      std::string::npos);
  EXPECT_NE(ParseError({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}})
                .find("LOCAL_RANK is not"),
            std::string::npos);
  EXPECT_NE(ParseError({{"OMPI_COMM_WORLD_RANK", "2"}}).find("Open MPI"), std::string::npos);
  EXPECT_NE(
      ParseError({{"PMI_RANK", "5"}, {"PMI_SIZE", "5"}}).find("PMI_RANK=5 is not below PMI_SIZE=5"),
      std::string::npos);
  EXPECT_NE(ParseError({{"SLURM_PROCID", "0"},
                        {"SLURM_STEP_ID", "0"},
                        {"SLURM_NTASKS", "2"},
                        {"SLURM_NODEID", "2"},
                        {"SLURM_TASKS_PER_NODE", "1(x2)"}})
                .find("has no task count"),
            std::string::npos);
  EXPECT_NE(ParseError({{"MASTER_PORT", "70000"}}).find("MASTER_PORT=70000 is not a port"),
            std::string::npos);
  EXPECT_NE(ParseError({{"MASTER_PORT", "http"}}).find("MASTER_PORT=http"), std::string::npos);
  // Every message says what to do.
  EXPECT_NE(ParseError({{"RANK", "1"}}).find("Fix the launch command"), std::string::npos);
}

TEST(SpawnChildEnvironmentTest, NestedRanksAreEachSeenOnce) {
  // W = 3 ranks on 2 nodes (2 + 1), each spawning N = 4: global ranks 0..11 once each, local
  // ranks unique within a node, world and local world sizes scaled.
  const int kN = 4;
  std::set<int> ranks;
  std::map<int, std::set<int>> local_by_node;
  const LaunchInfo outer[] = {
      {Launcher::kOpenMpi, 0, 0, 3, 2, 0, "", 0},
      {Launcher::kOpenMpi, 1, 1, 3, 2, 0, "", 0},
      {Launcher::kOpenMpi, 2, 0, 3, 1, 1, "", 0},
  };
  for (const LaunchInfo& parent : outer) {
    for (int i = 0; i < kN; ++i) {
      std::map<std::string, std::string> env;
      for (auto& [k, v] : SpawnChildEnvironment(parent, kN, i, 12345)) env[k] = v;
      const LaunchInfo child = Parse(env);
      EXPECT_EQ(child.launcher, Launcher::kSpawn);
      EXPECT_EQ(child.world_size, 12);
      EXPECT_EQ(child.local_world_size, parent.local_world_size * kN);
      EXPECT_EQ(child.node_rank, parent.node_rank);
      // Three parents could not agree on an invented rendezvous: none is set.
      EXPECT_EQ(child.master_addr, "");
      EXPECT_EQ(child.master_port, 0);
      EXPECT_TRUE(ranks.insert(child.rank).second) << "rank " << child.rank << " twice";
      EXPECT_TRUE(local_by_node[child.node_rank].insert(child.local_rank).second);
    }
  }
  EXPECT_EQ(ranks.size(), 12u);
  EXPECT_EQ(*ranks.rbegin(), 11);
  // A parent's rendezvous is passed on as it is.
  LaunchInfo with_master = outer[0];
  with_master.master_addr = "node0";
  with_master.master_port = 29500;
  std::map<std::string, std::string> env;
  for (auto& [k, v] : SpawnChildEnvironment(with_master, 2, 1, 1)) env[k] = v;
  EXPECT_EQ(env["MASTER_ADDR"], "node0");
  EXPECT_EQ(env["MASTER_PORT"], "29500");
  EXPECT_EQ(env["ROLE_RANK"], env["RANK"]);
  // A parent alone gets one on this machine.
  env.clear();
  for (auto& [k, v] : SpawnChildEnvironment(LaunchInfo{}, 2, 1, 4321)) env[k] = v;
  EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
  EXPECT_EQ(env["MASTER_PORT"], "4321");
  try {
    SpawnChildEnvironment(outer[0], 2, 2, 1);
    ADD_FAILURE() << "index 2 of 2 accepted";
  } catch (const runtime::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
}

// A spawn() child checks what it sees against what the rule says, and throws when it differs
// (the parent's spawn() then fails with the message).
void CheckMyPlace(int i, int parent_rank, int parent_world, int parent_local,
                  int parent_local_world, int nprocs, std::string env_probe) {
  const LaunchInfo me = GetLaunchInfo();
  std::ostringstream why;
  if (me.launcher != Launcher::kSpawn) why << "launcher " << LauncherName(me.launcher) << "; ";
  if (me.rank != parent_rank * nprocs + i) why << "rank " << me.rank << "; ";
  if (me.world_size != parent_world * nprocs) why << "world " << me.world_size << "; ";
  if (me.local_rank != parent_local * nprocs + i) why << "local rank " << me.local_rank << "; ";
  if (me.local_world_size != parent_local_world * nprocs)
    why << "local world " << me.local_world_size;
  // A rendezvous is invented only for the children of a parent that is alone.
  if ((me.master_addr.empty() || me.master_port == 0) == (parent_world == 1)) {
    why << "rendezvous \"" << me.master_addr << "\" for a parent of " << parent_world << "; ";
  }
  const char* probe = std::getenv("LAUNCH_TEST_PROBE");
  // (Under forkserver a child has the fork server's environment, as in Python: "" skips this.)
  if (!env_probe.empty() && (probe == nullptr || env_probe != probe)) {
    why << "the parent's environment was not inherited; ";
  }
  if (!why.str().empty()) throw std::runtime_error("child " + std::to_string(i) + ": " + why.str());
}
FORKSAFE_ENTRY_POINT(CheckMyPlace);

class SpawnEnvTest : public ::testing::TestWithParam<const char*> {};

TEST_P(SpawnEnvTest, ChildrenGetTorchrunVariablesNestedInTheOuterLauncher) {
  // This test process plays Open MPI's rank 1 of 2 (local 1 of 2): its children are 2 and 3 of 4.
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  setenv("LAUNCH_TEST_PROBE", "outer", 1);
  SpawnOptions o;
  o.nprocs = 2;
  o.start_method = GetParam();
  const std::string probe = std::string(GetParam()) == "forkserver" ? "" : "outer";
  EXPECT_NO_THROW(spawn(&CheckMyPlace, std::make_tuple(1, 2, 1, 2, 2, probe), o));
  // The parent's own environment is untouched.
  EXPECT_EQ(std::getenv("RANK"), nullptr);
  EXPECT_EQ(GetLaunchInfo().launcher, Launcher::kOpenMpi);
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"}) {
    unsetenv(v);
  }
  // Without a launcher: ranks 0..2 of 3.
  EXPECT_NO_THROW(spawn(&CheckMyPlace, std::make_tuple(0, 1, 0, 1, 3, probe),
                        SpawnOptions{3, true, false, GetParam()}));
  unsetenv("LAUNCH_TEST_PROBE");
}

INSTANTIATE_TEST_SUITE_P(StartMethods, SpawnEnvTest,
                         ::testing::Values("fork", "spawn", "forkserver"));

void ReadVariable(std::string name, std::string expected) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr || expected != v) {
    throw std::runtime_error(name + " is " + (v ? std::string("\"") + v + "\"" : "unset"));
  }
}
FORKSAFE_ENTRY_POINT(ReadVariable);

TEST(ProcessEnvTest, OptionsEnvReachesTheChildUnderEveryStartMethod) {
  setenv("LAUNCH_TEST_REPLACED", "parent", 1);
  for (const char* method : {"fork", "spawn", "forkserver"}) {
    for (const auto& [name, value] :
         {std::pair<std::string, std::string>{"LAUNCH_TEST_NEW", "a=b c"},
          {"LAUNCH_TEST_REPLACED", "child"},
          {"LAUNCH_TEST_EMPTY", ""}}) {
      ProcessOptions o{"", false, method, {{name, value}, {"LAUNCH_TEST_OTHER", "1"}}};
      Process p(o, &ReadVariable, name, value);
      p.start();
      ASSERT_TRUE(p.join(std::chrono::seconds(60))) << method;
      EXPECT_EQ(p.exitcode(), 0) << method << " " << name << ": "
                                 << (p.failure() ? p.failure()->message : "");
    }
  }
  EXPECT_STREQ(std::getenv("LAUNCH_TEST_REPLACED"), "parent");
  unsetenv("LAUNCH_TEST_REPLACED");
  // Bad names are refused before anything starts.
  for (const char* bad : {"", "A=B"}) {
    Process p(ProcessOptions{"bad-env", false, "fork", {{bad, "x"}}}, &ReadVariable,
              std::string("X"), std::string("x"));
    try {
      p.start();
      ADD_FAILURE() << "a variable named \"" << bad << "\" was accepted";
    } catch (const runtime::Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(e.message().find("ProcessOptions::env"), std::string::npos) << e.message();
    }
    EXPECT_EQ(p.pid(), 0);
  }
}

void FailAsRankOne(int i) {
  if (i == 1) throw std::runtime_error("rank one \"quoted\"\nsecond line");
}
FORKSAFE_ENTRY_POINT(FailAsRankOne);

void ExitThree(int i) { std::exit(3); }
FORKSAFE_ENTRY_POINT(ExitThree);

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(LauncherErrorFileTest, AFailedSpawnIsWrittenInTorchelasticsForm) {
  char dir[] = "/tmp/forksafe_launch_test_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/error.json";
  setenv("TORCHELASTIC_ERROR_FILE", path.c_str(), 1);
  try {
    spawn(&FailAsRankOne, std::make_tuple(), SpawnOptions{2, true, false, "fork"});
    ADD_FAILURE() << "spawn did not throw";
  } catch (const ProcessRaisedException& e) {
    EXPECT_EQ(e.error_index(), 1);
  }
  const std::string json = ReadFile(path);
  EXPECT_EQ(json.rfind("{\"message\": {\"message\": \"ProcessRaisedException: process 1", 0), 0u)
      << json;
  EXPECT_NE(json.find("std::runtime_error: rank one \\\"quoted\\\"\\nsecond line"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("\"extraInfo\": {\"py_callstack\": \"ProcessRaisedException: process 1"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("\"timestamp\": \""), std::string::npos) << json;
  EXPECT_EQ(json.find('\n'), json.size() - 1) << "raw newline inside the JSON: " << json;
  // An exit code is recorded too.
  unlink(path.c_str());
  try {
    spawn(&ExitThree, std::make_tuple(), SpawnOptions{1, true, false, "fork"});
  } catch (const ProcessExitedException&) {
  }
  EXPECT_NE(ReadFile(path).find("ProcessExitedException: process 0"), std::string::npos);
  unlink(path.c_str());
  // Bytes that are not UTF-8 become U+FFFD (torchrun could not read the file otherwise); valid
  // UTF-8 stays.
  EXPECT_TRUE(RecordFailureForLauncher("T", "bad \xff\xc3 byte, caf\xc3\xa9", ""));
  EXPECT_NE(ReadFile(path).find("bad \\ufffd\\ufffd byte, caf\xc3\xa9"), std::string::npos)
      << ReadFile(path);
  unlink(path.c_str());
  // Unset: nothing is written.
  unsetenv("TORCHELASTIC_ERROR_FILE");
  EXPECT_FALSE(RecordFailureForLauncher("T", "m", ""));
  EXPECT_THROW(spawn(&FailAsRankOne, std::make_tuple(), SpawnOptions{2, true, false, "fork"}),
               ProcessRaisedException);
  EXPECT_NE(access(path.c_str(), F_OK), 0);
  rmdir(dir);
}

TEST(RankDefaultsTest, ARanksPoolsGetItsShareOfTheMachine) {
  runtime::internal::CpuBudgetInputs in;
  in.affinity_cpus = 16;
  in.hardware_cpus = 16;
  in.ranks_on_node = 4;
  runtime::CpuBudget b = runtime::internal::ComputeCpuBudget(in);
  EXPECT_EQ(b.cpus, 4);
  EXPECT_EQ(b.source, runtime::CpuBudgetSource::kLauncherShare);
  EXPECT_NE(b.ToString().find("4 ranks on the node"), std::string::npos) << b.ToString();
  in.ranks_on_node = 32;  // more ranks than CPUs: one each
  EXPECT_EQ(runtime::internal::ComputeCpuBudget(in).cpus, 1);
  in.ranks_on_node = 4;
  in.affinity_cpus = 3;  // the launcher bound this rank to fewer CPUs than its share
  b = runtime::internal::ComputeCpuBudget(in);
  EXPECT_EQ(b.cpus, 3);
  EXPECT_EQ(b.source, runtime::CpuBudgetSource::kAffinity);
  in.affinity_cpus = 8;  // bound to a whole socket of a two-socket machine: still 16 / 4
  b = runtime::internal::ComputeCpuBudget(in);
  EXPECT_EQ(b.cpus, 4);
  EXPECT_EQ(b.source, runtime::CpuBudgetSource::kLauncherShare);
  in.affinity_cpus = 16;
  in.quota.cpus = 8;  // a cgroup quota for the whole node: its share of that
  EXPECT_EQ(runtime::internal::ComputeCpuBudget(in).cpus, 2);
  in.quota.cpus = 0;
  in.omp_num_threads = "2";  // an explicit count wins
  EXPECT_EQ(runtime::internal::ComputeCpuBudget(in).cpus, 2);
}

TEST(RankDefaultsTest, ARankDeviceIsItsLocalRankModuloTheDevices) {
  const int n = device::DeviceCount(device::DeviceType::kSimAccel);
  ASSERT_GE(n, 1);
  setenv("RANK", "5", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_RANK", "3", 1);
  setenv("LOCAL_WORLD_SIZE", "4", 1);
  EXPECT_EQ(device::RankDevice(device::DeviceType::kSimAccel),
            device::Device(device::DeviceType::kSimAccel, 3 % n));
  EXPECT_EQ(device::RankDevice(device::DeviceType::kCPU), device::kCPU);
  EXPECT_EQ(device::DefaultDevice(), device::kCPU);  // the default is not changed
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) unsetenv(v);
  EXPECT_EQ(device::RankDevice(device::DeviceType::kSimAccel),
            device::Device(device::DeviceType::kSimAccel, 0));
  if (device::DeviceCount(device::DeviceType::kCUDA) == 0) {
    try {
      device::RankDevice(device::DeviceType::kCUDA);
      ADD_FAILURE() << "a CUDA device without CUDA";
    } catch (const runtime::Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
      EXPECT_NE(e.message().find("CUDA_VISIBLE_DEVICES"), std::string::npos);
    }
  }
}

}  // namespace
}  // namespace forksafe::mp
