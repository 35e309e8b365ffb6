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
//   runtime dlopen'ed later, even RTLD_LOCAL as Python extensions are, is found, and a process
//   without OpenMP pays one short walk (cached until an object is loaded or unloaded). Not
//   dlsym(RTLD_DEFAULT) nor dlopen(RTLD_NOLOAD): both take the loader's lock, which a thread
//   inside dlopen holds while a constructor of what it loads waits for this fork to end (any
//   constructor that registers an at-fork handler does): a deadlock. An object that defines
//   __kmpc_fork_call is LLVM's libomp (Intel's libiomp5 when its path says "iomp5"); one that
//   defines GOMP_parallel and not __kmpc_fork_call is libgomp.
//
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
//     the pause runs and the child is usable.
//   - Nested parallelism: the nested teams belong to the outer team's threads; pausing the
//     forking thread ends its threads, which end theirs. The child's nested regions work.
//   - OpenMP threads blocked waiting (on an omp_lock_t, a barrier or a critical section inside
//     another thread's region) do not stop the pause, which ends only the forking thread's
//     idle team; they do not exist in the child.
//   - LLVM libomp and Intel libiomp5 register their own pthread_atfork handlers: prepare takes
//     the runtime's bootstrap locks, the child's handler resets the runtime, which then starts
//     afresh at the next region. forksafe calls nothing in them: their prepare has usually run
//     before ours (the runtime registers at its first use, after forksafe) and holds those locks,
//     and omp_pause_resource_all, omp_get_level or omp_in_parallel on a thread the runtime does
//     not know would wait for them for ever (measured with libomp 14: pausing in a prepare hung
//     5 of 5 forks; left to libomp, 20 of 20 children ran regions).
//   - In a child where OpenMP is unusable, it stays unusable in that child's own children.
//
// Hazards
//   - Locks held inside OpenMP by another thread at the fork (an omp_lock_t, a `critical`
//     section) are held for ever in the child, as any mutex is: the child must not take them.
//   - libgomp older than GCC 9 has no omp_pause_resource_all: each fork then reports
//     kSubsystemUnusable and the child must not use OpenMP.
//   - An OpenMP runtime linked statically into a program, or one unloaded (dlclose) by another
//     thread during a fork, is not handled.
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
struct OpenMpForkStats {
  uint64_t paused = 0;          ///< Forks before which libgomp was paused.
  uint64_t pause_refused = 0;   ///< Attempts at which omp_pause_resource_all failed.
  uint64_t gave_up = 0;         ///< Forks that went ahead with libgomp not paused.
  uint64_t in_region = 0;       ///< Forks made from inside a parallel region.
  uint64_t left_to_runtime = 0; ///< Forks with libomp or libiomp5 loaded (their handlers act).
};
OpenMpForkStats GetOpenMpForkStats();

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_OPENMP_FORK_H_
