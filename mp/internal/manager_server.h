// mp/internal/manager_server.h: NOT FOR USERS. The manager process of mp/manager.h.
//
// The server binds an abstract AF_UNIX socket (nothing on disk) under the name its creator chose,
// says "ready" on its control connection, then accepts clients: each accepted connection must
// come from the same uid (SO_PEERCRED) and present the manager's secret first
// (CheckServerHello); it is then served by a thread of its own, one request at a time. Every
// object lives in one table guarded by one mutex, so each operation is atomic; blocking
// operations wait on a condition variable, in slices, and give up when their client hangs up.
// A request that does not decode drops that connection only. The server ends when its control
// connection says "shutdown" or reaches end-of-file (its owner is gone), and dies with its owner
// in any case (the lifeline of mp/process.h).
#ifndef FORKSAFE_MP_INTERNAL_MANAGER_SERVER_H_
#define FORKSAFE_MP_INTERNAL_MANAGER_SERVER_H_

#include <string>

#include "forksafe/mp/connection.h"

namespace forksafe::mp::internal {

/// The manager process's main (registered with FORKSAFE_ENTRY_POINT for spawn/forkserver).
/// Sends "ready" (or "error", message) on `ctl` once it listens, then serves until told to stop.
void ForksafeManagerMain(Connection ctl, std::string secret, std::string socket_name,
                         std::string name);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_MANAGER_SERVER_H_
