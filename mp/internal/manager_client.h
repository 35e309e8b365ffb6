// mp/internal/manager_client.h: NOT FOR USERS. The client side of mp/manager.h: one round trip
// to a manager over a per-process pool of idle connections.
//
// Each call takes an idle connection to its manager (or connects a new one, presenting the
// secret first), sends one request, waits for the reply and puts the connection back. A thread
// blocked in a call (a Lock acquire) holds its connection alone, so other threads' calls use
// other connections. The pool belongs to the process that filled it: a forked child starts with
// an empty one (the at-fork handler closes the inherited idle connections in the child, and the
// pool is keyed by getpid() as well). ReleaseCachedResources() empties it.
//
// Failure rule: a manager that cannot be reached — its socket refuses connections, or the
// connection ends before the reply — is gone (shut down or died): Error(kClosed) naming it.
// A reply that does not come within the call's own wait plus kAnswerSlack is
// Error(kDeadlineExceeded) (a stopped or wedged manager); calls with no timeout wait for as long
// as the manager lives.
#ifndef FORKSAFE_MP_INTERNAL_MANAGER_CLIENT_H_
#define FORKSAFE_MP_INTERNAL_MANAGER_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "forksafe/mp/internal/manager_protocol.h"

namespace forksafe::mp::internal {

/// How long beyond a call's own wait the client waits for the reply (and for connect()).
inline constexpr std::chrono::seconds kAnswerSlack{30};

/// Sends `req` (its pid and tid are filled in here) and returns the reply. Throws the reply's
/// error (with `what` and the manager's name), Error(kClosed) when the manager is gone, and
/// Error(kDeadlineExceeded) as described above. `wait_s`: the call's own wait (nullopt: forever).
ManagerReply CallManager(const ManagerAddress& addr, ManagerRequest& req,
                         std::optional<double> wait_s, const std::string& what);

/// Closes this process's idle connections to the manager at `socket_name`; with `shut_down`,
/// later calls in this process say that it was shut down (rather than "gone").
void ForgetManager(const std::string& socket_name, bool shut_down);

/// Idle connections this process holds (for tests).
size_t IdleManagerConnections();

/// The calling thread's id (gettid), the owner of the manager locks it acquires.
int64_t CallerTid();

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_MANAGER_CLIENT_H_
