// runtime/internal/thread_annotations.h: NOT FOR USERS. The annotations of Clang's
// thread-safety analysis, under forksafe's own names.
//
// What it offers
//   FORKSAFE_GUARDED_BY(mu), FORKSAFE_PT_GUARDED_BY(mu), FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(...),
//   FORKSAFE_LOCKS_EXCLUDED(...), FORKSAFE_NO_THREAD_SAFETY_ANALYSIS and the capability
//   attributes that runtime/internal/mutex.h puts on Mutex and MutexLock. They mean what Abseil's
//   ABSL_* macros of the same names mean (Clang's -Wthread-safety attributes); under other
//   compilers they expand to nothing.
//
// Guarantees
//   - Self-contained: public headers that hold an internal::Mutex (runtime/at_fork.h,
//     runtime/thread_pool.h, mp/pool.h, ...) include this file, so an installed forksafe needs no
//     other library's headers for them, and a framework that vendors its own Abseil (of any
//     version) sees no second definition of Abseil's macros.
//   - No code: attributes only.
//
// Hazards
//   - The analysis runs only when the code is compiled by Clang with -Wthread-safety; CI does so
//     (tools/thread_safety.sh). g++ checks nothing.
#ifndef FORKSAFE_RUNTIME_INTERNAL_THREAD_ANNOTATIONS_H_
#define FORKSAFE_RUNTIME_INTERNAL_THREAD_ANNOTATIONS_H_

#if defined(__clang__)
#define FORKSAFE_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define FORKSAFE_THREAD_ANNOTATION_(x)
#endif

/// The member (or global) may be touched only with `x` held.
#define FORKSAFE_GUARDED_BY(x) FORKSAFE_THREAD_ANNOTATION_(guarded_by(x))
/// What the pointer points at may be touched only with `x` held.
#define FORKSAFE_PT_GUARDED_BY(x) FORKSAFE_THREAD_ANNOTATION_(pt_guarded_by(x))
/// The function must be called with every listed mutex held.
#define FORKSAFE_EXCLUSIVE_LOCKS_REQUIRED(...) \
  FORKSAFE_THREAD_ANNOTATION_(exclusive_locks_required(__VA_ARGS__))
/// The function must be called without the listed mutexes (it takes them, or would deadlock).
#define FORKSAFE_LOCKS_EXCLUDED(...) FORKSAFE_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
/// Turns the analysis off for one function: say in a comment why its accesses are safe.
#define FORKSAFE_NO_THREAD_SAFETY_ANALYSIS FORKSAFE_THREAD_ANNOTATION_(no_thread_safety_analysis)

// The capability attributes, for runtime/internal/mutex.h.
#define FORKSAFE_LOCKABLE FORKSAFE_THREAD_ANNOTATION_(lockable)
#define FORKSAFE_SCOPED_LOCKABLE FORKSAFE_THREAD_ANNOTATION_(scoped_lockable)
#define FORKSAFE_EXCLUSIVE_LOCK_FUNCTION(...) \
  FORKSAFE_THREAD_ANNOTATION_(exclusive_lock_function(__VA_ARGS__))
#define FORKSAFE_EXCLUSIVE_TRYLOCK_FUNCTION(...) \
  FORKSAFE_THREAD_ANNOTATION_(exclusive_trylock_function(__VA_ARGS__))
#define FORKSAFE_UNLOCK_FUNCTION(...) FORKSAFE_THREAD_ANNOTATION_(unlock_function(__VA_ARGS__))
#define FORKSAFE_ASSERT_EXCLUSIVE_LOCK(...) \
  FORKSAFE_THREAD_ANNOTATION_(assert_exclusive_lock(__VA_ARGS__))

#endif  // FORKSAFE_RUNTIME_INTERNAL_THREAD_ANNOTATIONS_H_
