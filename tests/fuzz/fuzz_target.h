// tests/fuzz/fuzz_target.h: what every fuzz target in tests/fuzz/ defines.
//
// Each target is one .cc file with
//   - LLVMFuzzerTestOneInput: the libFuzzer entry point; decodes the input as bytes that came
//     from another process and must return normally for every input (a decoder error is a
//     runtime::Error, caught there);
//   - Seeds(): a few small valid inputs with the value each decodes to, which become the seed
//     corpus tests/fuzz/corpus/<target>/ (replay_test.cc writes them when asked);
//   - Describe(): decodes an input and prints the result in the form Seeds() gives as expected,
//     or "error: <code name>".
// The same file links into a libFuzzer binary (tools/fuzz.sh) and into a gtest (replay_test.cc)
// that replays the corpus and tests/fuzz/regressions/<target>/ through the entry point.
#ifndef FORKSAFE_TESTS_FUZZ_FUZZ_TARGET_H_
#define FORKSAFE_TESTS_FUZZ_FUZZ_TARGET_H_

#include <fcntl.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/runtime/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace forksafe::fuzz {

/// A seed input: its corpus file name, its bytes and what Describe() says of it.
struct Seed {
  std::string name;
  std::string bytes;
  std::string expected;
};

/// The target's valid seeds.
std::vector<Seed> Seeds();

/// Decodes `input` as the target does and describes the value (or "error: <code>").
std::string Describe(std::string_view input);

/// A fresh descriptor on /dev/null, opened per input (and closed with it), so that nothing stays
/// open between inputs.
inline mp::FileDescriptor DevNull() {
  return mp::FileDescriptor(open("/dev/null", O_RDONLY | O_CLOEXEC));
}

/// A message of `bytes` whose descriptor slots are, in order, a fresh /dev/null descriptor
/// (true) or an empty slot (false): what a decoder finds when a peer sent descriptors.
inline mp::Message MessageWithSlots(std::string bytes, std::initializer_list<bool> slots) {
  mp::Message m;
  m.bytes = std::move(bytes);
  for (bool real : slots) {
    if (real) {
      m.fds.push_back(DevNull());
    } else {
      m.fds.emplace_back();
    }
  }
  return m;
}

/// An input of the targets that start with a control byte (which decoder, which slots): that byte,
/// then the codec bytes of `values`.
template <class... Ts>
std::string ControlByteInput(uint8_t control, const Ts&... values) {
  return std::string(1, static_cast<char>(control)) + mp::Encode(values...).bytes;
}

/// "error: <code name>" for `e`.
inline std::string ErrorText(const runtime::Error& e) {
  return std::string("error: ") + runtime::ErrorCodeName(e.code());
}

}  // namespace forksafe::fuzz

#endif  // FORKSAFE_TESTS_FUZZ_FUZZ_TARGET_H_
