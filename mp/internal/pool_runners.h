// mp/internal/pool_runners.h: NOT FOR USERS. How a pool worker finds the code of a task sent by
// name (mp/internal/pool_worker.cc) and how the pool names it (mp/pool.cc): the registry of
// chunk runners, keyed by type name, and the relocation of a registered function's address
// between two copies of this program.
//
// What it offers
//   RegisterPoolRunner (declared in mp/internal/pool_call.h, called at static initialization by
//   every ElementRunner the program instantiates) and FindPoolRunner(key). ModuleOffset(addr):
//   the offset of an address in its loaded module; RelocateEntry(name, offset): the address,
//   in this process, of the entry point `name` found at that offset in the parent.
//
// Guarantees
//   - RelocateEntry calls nothing but a registered entry point of that very name: every
//     candidate address is checked against the entry-point registry (mp/entry_point.h).
//   - Unknown keys and names are Error(kNotFound) saying the worker must run the parent's program.
//
// Hazards
//   - RelocateEntry caches without a lock: a worker runs its tasks on one thread.
#ifndef FORKSAFE_MP_INTERNAL_POOL_RUNNERS_H_
#define FORKSAFE_MP_INTERNAL_POOL_RUNNERS_H_

#include <cstdint>
#include <string>

#include "forksafe/mp/internal/pool_call.h"

namespace forksafe::mp::internal {

/// The runner registered under `key`. Throws kNotFound when there is none.
RawRunner FindPoolRunner(const std::string& key);

/// The offset of `addr` in its loaded module (relative to the module's load bias); the address
/// itself when no module holds it. Modules of a spawned copy of this program differ from ours
/// only by their bias (ASLR).
uint64_t ModuleOffset(const void* addr);

/// The address, in this process, of the entry point registered as `name`, given its module
/// offset in the parent. Throws kNotFound when no registered function of that name is there.
const void* RelocateEntry(const std::string& name, uint64_t offset);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_POOL_RUNNERS_H_
