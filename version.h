// forksafe/version.h: which forksafe this is.
//
// What it offers
//   The version of the headers being compiled (macros), and of the library the program runs
//   with (forksafe::Version()). They differ when a program built against one release runs with
//   another's libforksafe.so: the shared library's SONAME carries the major version
//   (libforksafe.so.0), so only releases of the same major version are ever mixed.
//
// Guarantees
//   - FORKSAFE_VERSION is MAJOR * 10000 + MINOR * 100 + PATCH, for `#if FORKSAFE_VERSION >= ...`.
//   - Version() is thread-safe, never throws and returns a string that lives for the process.
#ifndef FORKSAFE_VERSION_H_
#define FORKSAFE_VERSION_H_

#define FORKSAFE_VERSION_MAJOR 0
#define FORKSAFE_VERSION_MINOR 1
#define FORKSAFE_VERSION_PATCH 0
#define FORKSAFE_VERSION_STRING "0.1.0"
#define FORKSAFE_VERSION \
  (FORKSAFE_VERSION_MAJOR * 10000 + FORKSAFE_VERSION_MINOR * 100 + FORKSAFE_VERSION_PATCH)

namespace forksafe {

/// The version of the forksafe library this program runs with ("0.1.0").
const char* Version() noexcept;

}  // namespace forksafe

#endif  // FORKSAFE_VERSION_H_
