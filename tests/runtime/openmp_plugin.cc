// tests/runtime/openmp_plugin.cc: a shared object that uses OpenMP, loaded by
// openmp_dlopen_test with dlopen(RTLD_LOCAL) the way a Python extension is, so that its OpenMP
// runtime arrives after forksafe and outside the global symbol scope. Compiled with gcc
// -fopenmp and linked twice (tests/runtime/BUILD.bazel): against GNU libgomp, and against LLVM's
// libomp, which implements libgomp's GOMP_ entry points that gcc's code calls.
#include <omp.h>

extern "C" {

// The sum of [0, n) by a region of `threads` threads.
long openmp_plugin_sum(long n, int threads) {
  long s = 0;
#pragma omp parallel for reduction(+ : s) num_threads(threads)
  for (long i = 0; i < n; ++i) s += i;
  return s;
}

// Runs a region of two threads in which thread `who` (0: the primary) calls fn(arg).
void openmp_plugin_in_region(int who, void (*fn)(void*), void* arg) {
#pragma omp parallel num_threads(2)
  {
    if (omp_get_thread_num() == who) fn(arg);
  }
}

// Ends this thread's OpenMP threads (before the plugin, and with it the runtime, is unloaded).
int openmp_plugin_release() { return omp_pause_resource_all(omp_pause_hard); }

}  // extern "C"
