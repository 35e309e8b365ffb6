// forksafe/version.h: the macros agree with each other and with the library's Version().
#include <cstdio>
#include <string>

#include "forksafe/version.h"
#include "gtest/gtest.h"

namespace forksafe {
namespace {

TEST(VersionTest, MacrosAndLibraryAgree) {
  char expected[32];
  std::snprintf(expected, sizeof(expected), "%d.%d.%d", FORKSAFE_VERSION_MAJOR,
                FORKSAFE_VERSION_MINOR, FORKSAFE_VERSION_PATCH);
  EXPECT_EQ(std::string(FORKSAFE_VERSION_STRING), expected);
  EXPECT_EQ(std::string(Version()), FORKSAFE_VERSION_STRING)
      << "the library this test links is the release its headers describe";
  EXPECT_EQ(FORKSAFE_VERSION,
            FORKSAFE_VERSION_MAJOR * 10000 + FORKSAFE_VERSION_MINOR * 100 + FORKSAFE_VERSION_PATCH);
  static_assert(FORKSAFE_VERSION_MINOR < 100 && FORKSAFE_VERSION_PATCH < 100,
                "FORKSAFE_VERSION packs minor and patch into two digits each");
}

}  // namespace
}  // namespace forksafe
