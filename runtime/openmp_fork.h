// runtime/openmp_fork.h: keeps OpenMP usable across fork().
//
// What it offers
//   GNU libgomp (gcc -fopenmp; PyTorch's intra-op pool on Debian, numpy's BLAS in many builds)
//   has no fork handling: its worker threads do not exist in a forked child, but the team of the
//   thread that forked still lists them, so the child's first parallel region waits for them for
//   ever. forksafe installs one at-fork handler, "openmp", whose prepare calls the OpenMP 5 routine
//   omp_pause_resource_all(omp_pause_hard) on the forking thread: libgomp ends that thread's
//   worker threads, and starts fresh ones at the next region, in the parent and in the child.
//   forksafe does not link OpenMP: the runtime is looked for at each fork among the objects
//   loaded in the process (see "Finding the runtime").
//
// Place in the prepare order (prepare runs in reverse registration order; runtime/at_fork.h)
//   The handler is registered at load time, and InstallTbbForkHandler() registers it just before
//   the oneTBB handler ("onetbb"), which every ThreadPool installs before registering itself. So
//   it is prepared last of forksafe's handlers, after the pools drained (a pool task that runs a
//   region has finished it, and the worker that ran it has ended, taking its OpenMP team with
//   it) and after oneTBB was finalized (a oneTBB task inside a region likewise); only the
//   framework lock is taken after it.
//
// Finding the runtime
//   At each prepare, the loaded objects are walked with dl_iterate_phdr and the OpenMP entry
//   points are read from each object's own symbol table (runtime/internal/loaded_objects.h): a
//   runtime dlopen'ed later, even RTLD_LOCAL as Python extensions are, is found. While no object
//   is loaded or unloaded, a process without OpenMP pays one short dl_iterate_phdr call, and one
//   with OpenMP a walk that looks up symbols in the runtimes' objects only. Not
//   dlsym(RTLD_DEFAULT) nor dlopen(RTLD_NOLOAD): both take the loader's lock, which a thread
//   inside dlopen holds while a constructor of what it loads waits for this fork to end (any
//   constructor that registers an at-fork handler does): a deadlock. An object that defines
//   __kmpc_fork_call is LLVM's libomp (Intel's libiomp5 when its path says "iomp5"); one that
//   defines GOMP_parallel and not __kmpc_fork_call is libgomp.
//
// Calling a runtime that another thread is loading or unloading (the rule)
//   forksafe calls into a libgomp only (1) once the loader has relocated it: dl_iterate_phdr
//   lists an object from the moment it is mapped, while dlopen on another thread may still be
//   relocating it, and _dl_find_object (glibc >= 2.35; lock-free) learns of it only after its
//   relocation; a libgomp not yet relocated has not been used by anyone, so it has no threads
//   to pause (counted in OpenMpForkStats::not_ready); and (2) where it cannot vanish while it is
//   called: a libgomp linked -z nodelete (GCC's is; dlclose never unmaps it) after the walk,
//   outside the loader's lock, since the pause joins the team's threads and a thread that ends
//   may need that lock (an unwinder without _dl_find_object walks the loaded objects at
//   pthread_exit; the first unwinding pthread_exit of a process dlopens libgcc_s): joining it
//   under the lock would deadlock; any other libgomp from inside the dl_iterate_phdr walk, whose
//   list lock dlclose needs to unmap an object. Never dlsym, dladdr or dlopen from prepare (the
//   loader's main lock, above). On a glibc without _dl_find_object no libgomp is called: each
//   fork is then as without forksafe.
// Guarantees
//   - libgomp: in prepare, on the forking thread, omp_pause_resource_all(omp_pause_hard). The
//     child runs regions (with fresh threads), and so does the parent. Another thread that is
//     inside its own region at the fork keeps running it in the parent (libgomp's teams belong to
//     the thread that started them; pausing ends only the forking thread's idle threads), and
//     does not exist in the child. A pause that fails (non-zero) makes prepare say "not yet"; on
//     the last attempt the fork goes ahead, ForkEventKind::kSubsystemUnusable is reported for
//     "openmp", and OpenMpUsableInThisProcess() is false in that child.
//   - The forking thread is itself inside a parallel region (omp_get_level() > 0, which covers
//     a task or a nested region inside it): the pause is not called (the OpenMP specification
//     forbids it there, libgomp refuses it), the fork goes ahead at once, kSubsystemUnusable is
//     reported, and OpenMpUsableInThisProcess() is false in the child: the child's region is
//     the parent's, whose other threads do not exist there; the child must _exit before the
//     region would end. An explicit task at level 0 (outside any region) is not inside a team:
//     the pause runs and the child is usable. The same for LLVM libomp and Intel libiomp5 once
//     forksafe is ordered before their handlers (below); the report, the counters and
//     OpenMpUsableInThisProcess() are the same.
//   - Counted and reported once per fork: a fork whose prepare took several attempts (another
//     handler said "not yet") counts one pause, one fork from inside a region, one event.
//   - Nested parallelism: the nested teams belong to the outer team's threads; pausing the
//     forking thread ends its threads, which end theirs. The child's nested regions work.
//   - OpenMP threads blocked waiting (on an omp_lock_t, a barrier or a critical section inside
//     another thread's region) do not stop the pause, which ends only the forking thread's
//     idle team; they do not exist in the child.
//   - LLVM libomp and Intel libiomp5 register their own pthread_atfork handlers when they start
//     (at their first use): prepare takes the runtime's init and fork/join locks, the child's
//     handler resets the runtime, which then starts afresh at the next region (children of
//     children included: it registers once per process tree). forksafe pauses nothing in them.
//     But glibc prepares the newest registration first: a runtime that started after forksafe
//     loaded took its locks before forksafe's registry ran, and a pool drain that waited for a
//     task inside one of its regions (which needs the fork/join lock) stalled every fork for the
//     whole prepare deadline (3 s; tests/runtime/openmp_dlopen_test, a pool task in regions).
//     The rule: forksafe's registry is prepared before every OpenMP runtime's own handlers.
//     forksafe renews its pthread_atfork registration after the runtime's
//     (runtime/internal/fork_registration.h; one registration acts per fork), having made the
//     runtime start first: OrderForkHandlersAfterOpenMp() does it, and forksafe's pool workers
//     call it before their tasks (at most once a millisecond each, a clock read in between), as
//     does the first fork that finds the runtime (from then on). Once ordered, a fork asks the
//     runtime for the forking thread's omp_get_level() (its locks are free then; a thread that
//     never used OpenMP registers with it), and a fork from inside one of its regions is
//     reported and leaves the child unusable as with libgomp. Before that the runtime is asked
//     nothing (asking, with its locks held by its own prepare, would wait for ever: measured
//     with libomp 14, 5 of 5 forks hung), counted in OpenMpForkStats::not_asked.
//   - In a child where OpenMP is unusable, it stays unusable in that child's own children.
//
// Hazards
//   - Locks held inside OpenMP by another thread at the fork (an omp_lock_t, a `critical`
//     section) are held for ever in the child, as any mutex is: the child must not take them.
//   - libgomp older than GCC 9 has no omp_pause_resource_all: each fork then reports
//     kSubsystemUnusable and the child must not use OpenMP.
//   - An OpenMP runtime linked statically into a program is not handled.
//   - An LLVM or Intel runtime that starts after forksafe loaded and is used by threads that are
//     not forksafe's pool workers, with no call of OrderForkHandlersAfterOpenMp() before the
//     next fork, is prepared before forksafe in that fork: a prepare of forksafe's that waits
//     for a thread inside one of its regions (a oneTBB task, a holder of the framework lock or
//     of a HoldAcrossFork mutex) waits until the deadline, and a fork from inside one of its
//     regions is not detected. forksafe orders itself at that fork, for the next ones.
//   - An Intel libiomp5 unloaded (dlclose) by another thread during a fork is not handled
//     (LLVM's libomp is never unloaded: it is linked NODELETE). A runtime unloaded and loaded
//     again between two ordering passes keeps its old ordering: call
//     OrderForkHandlersAfterOpenMp() after loading it again.
//   - With more than one LLVM-family runtime loaded (libomp next to libiomp5), the pool workers'
//     automatic ordering starts none of them: starting one makes it look for the others and
//     abort the process ("OMP: Error #15") unless KMP_DUPLICATE_LIB_OK is set. A program that
//     uses one of them calls OrderForkHandlersAfterOpenMp() itself (that call starts them all).
//   - On a glibc older than 2.36 a renewal waits for a fork running on another thread (glibc
//     holds its at-fork lock across the whole fork there): a pool worker renewing while a fork
//     drains its pool stalls that fork until the drain deadline.
//   - Pausing costs the forking thread's next region in the parent the start of its threads
//     again (about as much as the process's first region).
#ifndef FORKSAFE_RUNTIME_OPENMP_FORK_H_
#define FORKSAFE_RUNTIME_OPENMP_FORK_H_

#include <cstdint>
#include <string>
#include <vector>

namespace forksafe::runtime {

/// Registers the OpenMP at-fork handler if it is not yet registered. Idempotent, thread-safe.
/// Called at load time; InstallTbbForkHandler() calls it first (see the prepare order above).
void InstallOpenMpForkHandler();

/// Orders forksafe's at-fork registration after the own at-fork handlers of the LLVM and Intel
/// OpenMP runtimes loaded now, starting any of them that has not started (they register their
/// handlers then): from the next fork on, forksafe is prepared before them (see "LLVM libomp
/// and Intel libiomp5" above). forksafe's pool workers call it before their tasks; call it
/// yourself after loading such a runtime (dlopen) when the process may fork before a forksafe
/// pool runs a task. Cheap when nothing was loaded since the last call (one short
/// dl_iterate_phdr). Thread-safe; does nothing inside a fork handler or in a nested copy of
/// forksafe. Throws nothing.
void OrderForkHandlersAfterOpenMp();

/// False in a child forked while OpenMP could not be quiesced (the fork came from inside a
/// parallel region, or the pause failed until the last attempt), and in that child's children.
/// Such a child must not start an OpenMP region: run the work serially, or on a forksafe pool.
bool OpenMpUsableInThisProcess();

/// Which OpenMP runtime a loaded object is.
enum class OpenMpRuntimeKind {
  kGnu,    ///< GNU libgomp: paused before each fork.
  kLlvm,   ///< LLVM libomp: left to its own at-fork handlers.
  kIntel,  ///< Intel libiomp5: left to its own at-fork handlers.
};

/// One OpenMP runtime loaded in this process.
struct OpenMpRuntime {
  OpenMpRuntimeKind kind;
  std::string path;  ///< The path it was loaded from.
};

/// The OpenMP runtimes loaded in this process now, in load order (none when OpenMP is absent).
/// For diagnostics; not for use inside an at-fork handler (it allocates).
std::vector<OpenMpRuntime> LoadedOpenMpRuntimes();

/// Counters, for tests and diagnostics.
/// Each counts forks (once per fork, however many prepare attempts it took), except
/// pause_refused and not_ready, which count prepare attempts.
struct OpenMpForkStats {
  uint64_t paused = 0;           ///< Forks before which libgomp was paused.
  uint64_t pause_refused = 0;    ///< Attempts at which omp_pause_resource_all failed.
  uint64_t gave_up = 0;          ///< Forks that went ahead with libgomp not paused.
  uint64_t in_region = 0;        ///< Forks made from inside a parallel region.
  uint64_t left_to_runtime = 0;  ///< Forks with libomp or libiomp5 loaded (their handlers act).
  /// Forks at which libomp or libiomp5 was prepared before forksafe (not yet ordered), so it
  /// was asked nothing (a fork from inside its region then goes unreported).
  uint64_t not_asked = 0;
  /// Attempts that found a libgomp still being loaded (not relocated) and left it alone.
  uint64_t not_ready = 0;
};
OpenMpForkStats GetOpenMpForkStats();

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_OPENMP_FORK_H_
