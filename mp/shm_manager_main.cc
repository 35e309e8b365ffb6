// mp/shm_manager_main.cc: forksafe-shm-manager, the file_system strategy's manager program.
//
// What it offers
//   A program that serves as the shm manager (mp/internal/shm_manager.h) of a process that cannot
//   serve it itself: a Python interpreter with the forksafe package, or a C++ program that did
//   not call forksafe::mp::InitMain. The library finds it beside libforksafe.so (the Python
//   package's folder) or in <libdir>/forksafe/ (tools/install.sh), or at $FORKSAFE_SHM_MANAGER.
//
// Guarantees
//   Started by the library with --forksafe-shm-manager, it is the manager (InitMain runs it and
//   never returns); it runs no other of the library's roles. Started any other way it does nothing,
//   says what it is on stderr and exits with status 2. It links forksafe statically: it needs no
//   libforksafe.so at run time, so one program serves every copy of the library of this version.

#include <cstdio>
#include <cstring>

#include "forksafe/mp/internal/shm_manager.h"
#include "forksafe/mp/process.h"

int main(int argc, char** argv) {
  // Only the manager's flag: never a spawned child's or the fork server's, whose code this
  // program does not have.
  if (argc >= 2 && std::strcmp(argv[1], forksafe::mp::internal::kShmManagerFlag) == 0) {
    forksafe::mp::InitMain(argc, argv);  // runs the manager; never returns
  }
  fprintf(stderr,
          "%s: the shm manager of forksafe's file_system sharing strategy. The library starts it "
          "when it needs one; it is not run by hand.\n",
          argc > 0 ? argv[0] : "forksafe-shm-manager");
  return 2;
}
