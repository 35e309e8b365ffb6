// runtime/internal/process_instance.h: NOT FOR USERS. How the copies of forksafe in one process
// find each other (runtime/at_fork.h, "One registry per process, even with several copies of
// forksafe").
//
// Every copy (a program that links forksafe statically, each shared object that does, and
// libforksafe.so) defines the C table `forksafe_process_instance_v1`, exported from its object.
// At load time (a static initializer: the runtime library is alwayslink), each copy walks the
// loaded objects (dl_iterate_phdr) and looks the symbol up in each one's dynamic symbol table,
// read from memory (not dlopen(RTLD_NOLOAD) + dlsym: from a constructor at program start-up, that
// runs the constructors of objects not initialized yet, out of order, and a registry could be
// re-entered while it is being built). The first copy becomes the primary, every later one nests
// its registry in the primary's through `nest`. Constructors of the program and of every dlopen'ed
// object run one at a time, under the dynamic loader's lock, so the election needs no lock.
//
// The ABI (version 1): plain C, no C++ type crosses it. A copy ignores a table whose magic,
// abi_version or struct_size does not match (a future incompatible layout gets a new symbol name,
// forksafe_process_instance_v2, and a copy may publish both). Times are steady-clock (CLOCK_MONOTONIC)
// nanoseconds: the same clock in every copy. Event kinds are the values of ForkEventKind, which
// are fixed for that reason. Field order never changes; fields are only appended (struct_size
// tells a reader how many there are).
//
// The rule: never hide `forksafe_process_instance_v1` (a linker version script keeps it global; a
// program linking forksafe statically exports it with -Wl,--export-dynamic-symbol, which
// runtime/BUILD.bazel adds to every Bazel-built executable). A copy that cannot see the others
// runs alone, as before.
#ifndef FORKSAFE_RUNTIME_INTERNAL_PROCESS_INSTANCE_H_
#define FORKSAFE_RUNTIME_INTERNAL_PROCESS_INSTANCE_H_

#include <stddef.h>
#include <stdint.h>

extern "C" {

#define FORKSAFE_INSTANCE_MAGIC 0x6b73726f66ULL  // "forks" in little-endian ASCII
#define FORKSAFE_INSTANCE_ABI 1

/// Values of forksafe_instance_v1::role (read and written with __atomic builtins).
enum {
  FORKSAFE_ROLE_UNDECIDED = 0,
  FORKSAFE_ROLE_PRIMARY = 1,   // makes the process's pthread_atfork registration
  FORKSAFE_ROLE_NESTED = 2,    // runs as one handler of the primary's registry
  FORKSAFE_ROLE_SEPARATE = 3,  // could not nest: its own pthread_atfork registration
};

/// What the primary passes to a nested copy's prepare (one PrepareAttempt).
typedef struct forksafe_attempt_v1 {
  int32_t number;        // 1-based attempt of the primary
  int32_t last;          // nonzero on the last attempt: the nested copy must not refuse then
  uint64_t fork_number;  // the primary's fork number
  int64_t deadline_ns;   // the fork's prepare deadline
  int64_t wait_until_ns; // how long this prepare may block
} forksafe_attempt_v1;

/// A nested copy's entry points, called by the primary on the forking thread. `prepare` runs one
/// round of the nested copy's handlers and returns 1 when it is prepared (then its registry and
/// framework lock stay held until `roll_back`, `parent` or `child`) or 0 for "not yet" (nothing
/// held). `entering`/`entered` are the nested copy's fork-entry hooks
/// (runtime/internal/fork_entry.h); `parent_done` runs in the parent after the primary released
/// its registry (the nested copy calls its event listener there).
typedef struct forksafe_nested_v1 {
  uint32_t struct_size;
  const char* name;  // "forksafe copy in <path>", the name of its handler in the primary
  void (*entering)(void);
  void (*entered)(void);
  int (*prepare)(const forksafe_attempt_v1* attempt);
  void (*roll_back)(void);
  void (*parent)(void);
  void (*child)(void);
  void (*parent_done)(void);
} forksafe_nested_v1;

/// The table every copy exports. Statically initialized; `role` and `object` are set by the
/// copy's load-time election (object before role, with release order).
typedef struct forksafe_instance_v1 {
  uint64_t magic;
  uint32_t abi_version;
  uint32_t struct_size;
  const char* version;  // FORKSAFE_VERSION_STRING of the copy (forksafe/version.h)
  int32_t role;         // FORKSAFE_ROLE_*
  const char* object;   // the file of the object holding this copy ("" until elected)
  /// Registers a nested copy in this (primary) copy's registry. Returns 0, or nonzero with a
  /// message in `error` (for instance when too many copies are nested already).
  int (*nest)(const forksafe_nested_v1* nested, char* error, size_t error_size);
  /// Records an event on the fork in progress (a nested copy's handlers' events).
  void (*report_event)(int32_t kind, const char* subsystem, const char* detail);
} forksafe_instance_v1;

}  // extern "C"

// Hidden: each copy must call its own functions even where another copy's are visible (a program
// linked with -rdynamic, a library loaded RTLD_GLOBAL).
#pragma GCC visibility push(hidden)
namespace forksafe::runtime::internal {

/// Decides this copy's role, once (later calls return the first answer). Runs at load time (a
/// static initializer of at_fork.cc calls AtForkRegistry::Get(), which calls it). Returns the
/// primary's table when this copy must nest in it (its role is then NESTED), nullptr when this
/// copy is the primary.
const forksafe_instance_v1* ElectProcessInstance();

/// This copy's table.
forksafe_instance_v1& ThisInstance();

/// Marks this copy SEPARATE (its nest call was refused).
void MarkSeparate();

/// The primary's table when this copy is nested, else nullptr.
const forksafe_instance_v1* PrimaryInstance();

/// Keeps this copy's object loaded for the life of the process (dlopen RTLD_NODELETE of its own
/// file; nothing to do for the program). Called once a copy calls or is called by another copy.
void PinThisCopy();

/// Defined in at_fork.cc: the entry points of the table.
int NestInThisCopy(const forksafe_nested_v1* nested, char* error, size_t error_size) noexcept;
void ReportEventFromNestedCopy(int32_t kind, const char* subsystem, const char* detail) noexcept;

}  // namespace forksafe::runtime::internal
#pragma GCC visibility pop

#endif  // FORKSAFE_RUNTIME_INTERNAL_PROCESS_INSTANCE_H_
