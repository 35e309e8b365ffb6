// main() of test binaries that use forksafe::mp: InitMain first (spawned children and the fork
// server take over there), then GoogleTest with the watchdog of test_main.cc.
#include "forksafe/mp/process.h"

int ForksafeTestMain(int argc, char** argv);

int main(int argc, char** argv) {
  forksafe::mp::InitMain(argc, argv);
  return ForksafeTestMain(argc, argv);
}
