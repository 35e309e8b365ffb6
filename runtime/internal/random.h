// runtime/internal/random.h: NOT FOR USERS. The one source of random identifiers in forksafe.
//
// What it offers
//   - RandomBytes(n), RandomHex128() and RandomId(): bytes from getrandom(), the kernel's CSPRNG.
//     Every random name or id the library makes (/dev/shm names, secrets, device memory ids, IPC
//     handle ids) comes from here.
//
// Guarantees
//   - Never a seeded generator: a forked child does not repeat its parent's values, and a value
//     cannot be guessed from earlier ones (names of shared memory and secrets rely on it).
//   - Errors: a getrandom() failure other than EINTR throws Error(kInternal) with errno; there is
//     no weaker fallback (an id that another process could predict or repeat is worse than an
//     error).
//   - Thread safety: every function may be called from any thread, also in a forked child.
#ifndef FORKSAFE_RUNTIME_INTERNAL_RANDOM_H_
#define FORKSAFE_RUNTIME_INTERNAL_RANDOM_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace forksafe::runtime::internal {

/// `n` random bytes from getrandom().
std::string RandomBytes(size_t n);

/// 128 random bits as 32 lowercase hex digits (names of shared memory, sockets).
std::string RandomHex128();

/// 64 random bits, never 0 (0 is left free to mean "no id").
uint64_t RandomId();

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_RANDOM_H_
