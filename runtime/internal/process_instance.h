// runtime/internal/process_instance.h: NOT FOR USERS. How the copies of forksafe in one process
// find each other (runtime/at_fork.h, "One registry per process, even with several copies of
// forksafe").
//
// Finding a copy. Every copy (a program that links forksafe statically, each shared object that
// does, and libforksafe.so) defines the C table `forksafe_process_instance_v1`, exported from its
// object, and also points at it from an ELF note (section .note.forksafe, name "forksafe", type
// FORKSAFE_INSTANCE_NOTE_TYPE, descriptor: the table's address minus the descriptor's, an int64),
// which the linker puts in a PT_NOTE segment and no version script can hide.
// At load time (a static initializer: the runtime library is alwayslink), each copy looks the
// symbol up in every loaded object's own dynamic symbol table (runtime/internal/loaded_objects.h,
// read from memory), and, when no object exports a primary's table, walks every object's PT_NOTE
// segments for the note; it elects itself and publishes its role, all inside ONE dl_iterate_phdr
// callback: glibc holds its process-wide (recursive) dl_load_write_lock for the whole walk, so
// two copies elected at once on two threads (a constructor that starts a thread that dlopens a
// plugin while the loader runs other constructors without its main lock) are serialized, and
// the second sees the first's role. The first copy becomes the primary; every later one nests its
// registry in the primary's through `nest` (called after the walk: it registers a handler and
// pins objects, which must not happen under the loader's lock).
// Other objects are never dlopen'ed for the lookup (at program start-up a dlopen(RTLD_NOLOAD) of
// an object not initialized yet runs its constructors out of order). The one dlopen made at load
// time is PinThisCopy's dlopen(RTLD_NOLOAD | RTLD_NODELETE) of the copy's OWN object (and the
// primary's, when it accepts a nested copy): glibc marks an object initialized before it runs
// its constructors, and that object's dependencies are initialized before it, so that call runs
// no constructor.
//
// The ABI (version 1, not released yet: its layout may still change until the first release
// that ships it). Plain C, no C++ type crosses it. A copy ignores a table whose magic,
// abi_version or struct_size does not match (a future incompatible layout gets a new symbol name,
// forksafe_process_instance_v2, and a copy may publish both). Times are steady-clock
// (CLOCK_MONOTONIC) nanoseconds: the same clock in every copy. Event kinds are the values of
// ForkEventKind, which are fixed for that reason; a kind the primary does not know (a newer
// nested copy) is recorded as kSubsystemUnusable, the conservative reading, and its detail says
// so. Every struct starts with its size; field order never changes and fields are only appended
// (a reader checks struct_size before it reads a field).
//
// Visibility and interposition. Only `forksafe_process_instance_v1` must be exported. Everything
// a copy calls on another copy goes through the tables' C function pointers; the helpers below
// and the nested-copy entry points are hidden, so each copy runs its own. forksafe's C++ API
// (AtForkRegistry::Get(), ...) is exported from libforksafe.so, though, and a shared object that
// links forksafe statically WITH default visibility calls its own copy's C++ functions through
// the PLT: when another copy's are in the global scope (libforksafe.so linked by the program, a
// program linked with -rdynamic, an object loaded RTLD_GLOBAL), those calls bind to that copy,
// the object never elects, and it runs a mix of both copies' code. A hidden constructor detects
// it (CheckThisCopyIsNotInterposed: a call of InterposableCopyIdentity() that does not return this
// copy's table) and says so on stderr; see at_fork.h for the remedy.
//
// The symbol is still exported (libforksafe.so's version script keeps it; runtime/BUILD.bazel
// exports it from every Bazel-built executable with -Wl,--export-dynamic-symbol), but a copy whose
// symbol is hidden (`local: *;` in a version script, -Wl,--exclude-libs,ALL) is found through its
// note. What hides a copy for good: a linker script that discards .note.* sections, a strip of
// the note, or an object that is not in dl_iterate_phdr's list (a program linked fully
// statically).
#ifndef FORKSAFE_RUNTIME_INTERNAL_PROCESS_INSTANCE_H_
#define FORKSAFE_RUNTIME_INTERNAL_PROCESS_INSTANCE_H_

#include <stddef.h>
#include <stdint.h>

extern "C" {

#define FORKSAFE_INSTANCE_MAGIC 0x6b73726f66ULL  // "forks" in little-endian ASCII
#define FORKSAFE_INSTANCE_ABI 1
/// The type of the ELF note ("forksafe") that also locates the table (see "Finding a copy").
#define FORKSAFE_INSTANCE_NOTE_TYPE 0x31736b66

/// Values of forksafe_instance_v1::role (read and written with __atomic builtins).
enum {
  FORKSAFE_ROLE_UNDECIDED = 0,
  FORKSAFE_ROLE_PRIMARY = 1,   // makes the process's pthread_atfork registration
  FORKSAFE_ROLE_NESTED = 2,    // runs as one handler of the primary's registry
  FORKSAFE_ROLE_SEPARATE = 3,  // could not nest: its own pthread_atfork registration
};

/// What the primary passes to a nested copy's prepare (one PrepareAttempt).
typedef struct forksafe_attempt_v1 {
  uint32_t struct_size;   // sizeof(forksafe_attempt_v1) of the primary
  int32_t number;         // 1-based attempt of the primary
  int32_t last;           // nonzero on the last attempt: the nested copy must not refuse then
  uint64_t fork_number;   // the primary's fork number
  int64_t deadline_ns;    // the fork's prepare deadline
  int64_t wait_until_ns;  // how long this prepare may block
} forksafe_attempt_v1;

/// A nested copy's entry points, called by the primary on the forking thread; none of them throws
/// or blocks without bound. `prepare` runs one round of the nested copy's handlers and returns 1
/// when it is prepared (then its registry stays held until `roll_back`, `parent` or `child`) or
/// 0 for "not yet" (nothing held; on the primary's last attempt the primary records that as
/// kPrepareGaveUp for the copy's handler and calls `parent`/`child`, which then run the nested
/// copy's child phase with every handler unprepared). `lock_framework` takes the nested copy's
/// framework lock, waiting at most until `deadline_ns`: the primary calls it after its own
/// framework lock, once every handler of every copy is prepared ("the framework lock is taken
/// last"); `parent`/`child` release or reset it. `entering`/`entered` are the nested copy's
/// fork-entry hooks (runtime/internal/fork_entry.h); `parent_done` runs in the parent after the
/// primary released its registry (the nested copy calls its event listener there, on the same
/// thread).
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
  void (*lock_framework)(int64_t deadline_ns);
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
/// copy is the primary. The lookup and the role's store happen inside one dl_iterate_phdr
/// callback (see above).
const forksafe_instance_v1* ElectProcessInstance();

/// This copy's table.
forksafe_instance_v1& ThisInstance();

/// Marks this copy SEPARATE (its nest call was refused).
void MarkSeparate();

/// The primary's table when this copy is nested, else nullptr.
const forksafe_instance_v1* PrimaryInstance();

/// Keeps this copy's object loaded for the life of the process (dlopen RTLD_NOLOAD | RTLD_NODELETE
/// of its own file; nothing to do for the program). Called once a copy calls or is called by
/// another copy. Returns false when the object could not be pinned (then the two copies must not
/// be joined: a dlclose could unmap code the other calls).
bool PinThisCopy();

/// For tests only: when `reason` is not null, this copy (as a primary) refuses every copy that
/// asks to nest, with `reason` as the message (the refused copy runs separately and says so on
/// stderr). `reason` must outlive the calls.
void RefuseNestingForTest(const char* reason);
const char* NestingRefusedForTest();

/// Defined in runtime/internal/nested_copy.cc: the entry points of the table.
int NestInThisCopy(const forksafe_nested_v1* nested, char* error, size_t error_size) noexcept;
void ReportEventFromNestedCopy(int32_t kind, const char* subsystem, const char* detail) noexcept;

}  // namespace forksafe::runtime::internal
#pragma GCC visibility pop

namespace forksafe::runtime::internal {
/// This copy's table, returned by a function that is NOT hidden on purpose: it has the visibility
/// of forksafe's C++ API in this build, so a call of it binds to another copy exactly when this
/// copy's API calls do (ELF interposition). Defined in at_fork.cc, apart from its caller, so that
/// the compiler cannot bind the call locally. See "Visibility and interposition" above.
const forksafe_instance_v1* InterposableCopyIdentity();
}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_PROCESS_INSTANCE_H_
