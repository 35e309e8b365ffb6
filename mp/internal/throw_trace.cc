// Records the stack at every `throw` on threads that asked for it, by interposing __cxa_throw
// (the C++ ABI entry every throw expression calls): forksafe's own definition, linked into the
// executable, runs first and then forwards to the C++ runtime's. Capture is off by default and
// costs one thread-local check per throw when off.
#include <cxxabi.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <typeinfo>

#include "absl/debugging/stacktrace.h"
#include "absl/debugging/symbolize.h"
#include "absl/strings/str_cat.h"
#include "mp/internal/child.h"

namespace forksafe::mp::internal {

constexpr int kMaxFrames = 48;

struct ThrowTrace {
  bool enabled = false;
  int depth = 0;
  void* frames[kMaxFrames];
};

ThrowTrace& Trace() {
  thread_local ThrowTrace t;
  return t;
}

void EnableThrowTraceCapture(bool on) {
  static const bool symbolizer_ready = [] {
    absl::InitializeSymbolizer("/proc/self/exe");
    return true;
  }();
  (void)symbolizer_ready;
  Trace().enabled = on;
  Trace().depth = 0;
}

std::string LastThrowTrace() {
  const ThrowTrace& t = Trace();
  std::string out;
  int shown = 0;
  bool in_hook = true;
  for (int i = 0; i < t.depth; ++i) {
    char name[512];
    // Frames are return addresses; the call is the instruction before. A throw is often the last
    // call of its function, so pc itself can already belong to the next function.
    void* pc = static_cast<char*>(t.frames[i]) - 1;
    const char* sym = absl::Symbolize(pc, name, sizeof(name)) ? name : "(unknown)";
    if (in_hook && (std::strstr(sym, "__cxa_throw") != nullptr ||
                    std::strstr(sym, "GetStackTrace") != nullptr)) {
      continue;  // the capture machinery itself
    }
    in_hook = false;
    absl::StrAppend(&out, "  #", shown++, " ", absl::Hex(reinterpret_cast<uintptr_t>(t.frames[i])),
                    " ", sym, "\n");
  }
  return out;
}

}  // namespace forksafe::mp::internal

namespace __cxxabiv1 {
extern "C" {

using CxaThrow = void (*)(void*, std::type_info*, void (*)(void*));

// Same declaration as <cxxabi.h>'s; this definition, in the executable, is found first.
void __cxa_throw(void* obj, std::type_info* type, void (*dest)(void*)) {
  auto& t = forksafe::mp::internal::Trace();
  // Skip nothing here: how many frames the unwinder itself shows varies with inlining. Frames
  // of this hook are dropped when the trace is formatted.
  if (t.enabled) t.depth = absl::GetStackTrace(t.frames, forksafe::mp::internal::kMaxFrames, 0);
  static CxaThrow real = reinterpret_cast<CxaThrow>(dlsym(RTLD_NEXT, "__cxa_throw"));
  if (real == nullptr) {
    fprintf(stderr, "forksafe: cannot find the C++ runtime's __cxa_throw\n");
    abort();
  }
  real(obj, type, dest);
  __builtin_unreachable();
}

}  // extern "C"
}  // namespace __cxxabiv1
