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
#include "forksafe/mp/internal/child.h"

namespace forksafe::mp::internal {

constexpr int kMaxFrames = 48;

struct ThrowTrace {
  bool enabled = false;
  int depth = 0;
  void* frames[kMaxFrames];
  // The stack of whoever turned capture on (the child's launcher, RunChildBody): these frames
  // end every trace, and are neither symbolized nor shown.
  int base_depth = 0;
  void* base[kMaxFrames];
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
  ThrowTrace& t = Trace();
  t.enabled = on;
  t.depth = 0;
  // base[0] is the caller's own frame, base[1..] its callers' (GetStackTrace starts at the
  // caller of the function that calls it).
  t.base_depth = on ? absl::GetStackTrace(t.base, kMaxFrames, 0) : 0;
}

namespace {

// How many frames of the last trace belong to the code run under capture: the trace without the
// frame of the function that turned capture on and that function's callers (the launcher's
// frames, down to main and _start, which every child's trace would repeat). Symbolizing is the
// slow part of a report (a scan of the symbol table per frame), so those frames are not even
// looked up. When the trace's tail does not match the recorded stack (a truncated trace, an
// unwinder that saw the frames differently) every frame is kept.
int FramesToShow(const ThrowTrace& t) {
  const int common = t.base_depth - 1;  // the callers of the capturing function
  if (common < 1 || t.depth >= kMaxFrames || t.base_depth >= kMaxFrames || t.depth <= common + 1) {
    return t.depth;
  }
  for (int k = 1; k <= common; ++k) {
    if (t.frames[t.depth - k] != t.base[t.base_depth - k]) return t.depth;
  }
  return t.depth - common - 1;  // also without the capturing function's own frame
}

}  // namespace

std::string LastThrowTrace() {
  const ThrowTrace& t = Trace();
  std::string out;
  int shown = 0;
  bool in_hook = true;
  const int depth = FramesToShow(t);
  for (int i = 0; i < depth; ++i) {
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
