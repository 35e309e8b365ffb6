// tests/fuzz/replay_test.cc: every fuzz target as an ordinary gtest (built with the default
// toolchain, in the default suite). It replays the target's seed corpus and its regressions
// through LLVMFuzzerTestOneInput, and checks that the valid seeds decode to the expected values
// and that the committed corpus matches Seeds().
//
// FORKSAFE_FUZZ_TARGET (a compile definition) names the target. With the environment variable
// FORKSAFE_FUZZ_WRITE_CORPUS=<dir>, CommittedCorpusMatchesSeeds first writes Seeds() to
// <dir>/<target>/ (see tests/fuzz/README.md). The main is tests/support/test_main.cc: a watchdog
// and the leak check around every test (a decoder that leaks a descriptor fails here).
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/fuzz/fuzz_target.h"

#ifndef FORKSAFE_FUZZ_TARGET
#error "FORKSAFE_FUZZ_TARGET must name the fuzz target"
#endif

namespace forksafe::fuzz {
namespace {

constexpr const char* kTarget = FORKSAFE_FUZZ_TARGET;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Regular files of `dir` (none if it does not exist), sorted.
std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    const std::string path = dir + "/" + e->d_name;
    struct stat st;
    if (e->d_name[0] != '.' && stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      out.push_back(path);
    }
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::string CorpusDir() {
  if (const char* dir = std::getenv("FORKSAFE_FUZZ_WRITE_CORPUS")) {
    return std::string(dir) + "/" + kTarget;
  }
  return std::string("tests/fuzz/corpus/") + kTarget;
}
std::string RegressionDir() { return std::string("tests/fuzz/regressions/") + kTarget; }

TEST(FuzzReplay, SeedsDecodeToTheirValues) {
  const std::vector<Seed> seeds = Seeds();
  ASSERT_GE(seeds.size(), 3u) << "a target needs a few valid seeds";
  for (const Seed& s : seeds) {
    EXPECT_EQ(Describe(s.bytes), s.expected) << "seed " << s.name;
    EXPECT_EQ(
        LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.bytes.data()), s.bytes.size()),
        0);
  }
}

// Writes Seeds() to $FORKSAFE_FUZZ_WRITE_CORPUS/<target>/ when the variable is set.
void MaybeWriteCorpus() {
  const char* dir = std::getenv("FORKSAFE_FUZZ_WRITE_CORPUS");
  if (dir == nullptr) return;
  const std::string out = std::string(dir) + "/" + kTarget;
  mkdir(dir, 0755);
  mkdir(out.c_str(), 0755);
  for (const Seed& s : Seeds()) {
    std::ofstream(out + "/" + s.name, std::ios::binary) << s.bytes;
  }
  std::printf("wrote %zu seeds to %s\n", Seeds().size(), out.c_str());
}

TEST(FuzzReplay, CommittedCorpusMatchesSeeds) {
  MaybeWriteCorpus();
  for (const Seed& s : Seeds()) {
    const std::string path = CorpusDir() + "/" + s.name;
    struct stat st;
    ASSERT_EQ(stat(path.c_str(), &st), 0)
        << path << " is missing: regenerate the corpus (see tests/fuzz/README.md)";
    EXPECT_EQ(ReadFile(path), s.bytes)
        << path << " differs from Seeds(): regenerate the corpus (see tests/fuzz/README.md)";
  }
}

TEST(FuzzReplay, CorpusAndRegressionsRunCleanly) {
  size_t n = 0;
  for (const std::string& dir : {CorpusDir(), RegressionDir()}) {
    for (const std::string& path : FilesIn(dir)) {
      const std::string bytes = ReadFile(path);
      SCOPED_TRACE(path);
      EXPECT_EQ(
          LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 0);
      // Decoding must give a value or a runtime::Error, nothing else (Describe lets no other
      // exception through).
      EXPECT_FALSE(Describe(bytes).empty());
      ++n;
    }
  }
  EXPECT_GE(n, Seeds().size());
  std::printf("%s: replayed %zu inputs\n", kTarget, n);
}

}  // namespace
}  // namespace forksafe::fuzz
