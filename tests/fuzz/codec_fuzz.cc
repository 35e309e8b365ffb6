// tests/fuzz/codec_fuzz.cc: mp::Decode (the value codec, mp/codec.h) on bytes from another
// process. Input: one byte that picks the types to decode (a "schema"), then the message bytes.
// The message carries three descriptor slots: /dev/null, an empty slot, /dev/null again, so that
// descriptor indices in the bytes are checked against a real list.
#include <fcntl.h>
#include <unistd.h>

#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "forksafe/mp/codec.h"
#include "tests/fuzz/fuzz_target.h"

namespace forksafe::fuzz {
namespace {

using mp::FileDescriptor;
using mp::Message;

// ---- printing decoded values --------------------------------------------------------------------
void Put(std::ostream& o, int32_t v) { o << v; }
void Put(std::ostream& o, int16_t v) { o << v; }
void Put(std::ostream& o, uint8_t v) { o << static_cast<int>(v); }
void Put(std::ostream& o, uint64_t v) { o << v; }
void Put(std::ostream& o, int64_t v) { o << v; }
void Put(std::ostream& o, double v) { o << v; }
void Put(std::ostream& o, bool v) { o << (v ? "true" : "false"); }
void Put(std::ostream& o, const std::string& v) { o << '"' << v << '"'; }
void Put(std::ostream& o, const FileDescriptor& f) { o << (f ? "fd" : "nofd"); }
template <class T>
void Put(std::ostream& o, const std::vector<T>& v) {
  o << '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) o << ',';
    Put(o, v[i]);
  }
  o << ']';
}
template <class K, class V>
void Put(std::ostream& o, const std::map<K, V>& m) {
  o << '{';
  bool first = true;
  for (const auto& [k, v] : m) {
    if (!first) o << ',';
    first = false;
    Put(o, k);
    o << ':';
    Put(o, v);
  }
  o << '}';
}
template <class A, class B>
void Put(std::ostream& o, const std::pair<A, B>& p) {
  o << '(';
  Put(o, p.first);
  o << ',';
  Put(o, p.second);
  o << ')';
}
template <class... Ts>
void Put(std::ostream& o, const std::tuple<Ts...>& t) {
  o << '(';
  std::apply(
      [&](const auto&... x) {
        size_t i = 0;
        ((o << (i++ ? "," : ""), Put(o, x)), ...);
      },
      t);
  o << ')';
}
template <class T>
void Put(std::ostream& o, const std::optional<T>& v) {
  if (v) {
    Put(o, *v);
  } else {
    o << "none";
  }
}

// Decodes the types of `Schema` from `msg` and prints them separated by spaces.
template <class... Ts>
std::string DecodePrint(Message& msg) {
  std::tuple<Ts...> values;
  std::apply([&](auto&... v) { mp::Decode(msg, v...); }, values);
  std::ostringstream o;
  std::apply(
      [&](const auto&... v) {
        size_t i = 0;
        ((o << (i++ ? " " : ""), Put(o, v)), ...);
      },
      values);
  return o.str();
}

// The schemas: what a Process argument, a Pipe or Queue message typically holds.
constexpr int kSchemas = 8;
std::string DecodeSchema(int schema, Message& msg) {
  switch (schema) {
    case 0: return DecodePrint<int32_t, uint64_t, double, bool>(msg);
    case 1: return DecodePrint<std::string>(msg);
    case 2: return DecodePrint<std::vector<int64_t>>(msg);
    case 3: return DecodePrint<std::map<std::string, std::vector<double>>>(msg);
    case 4: return DecodePrint<std::optional<std::tuple<int32_t, std::string, bool>>>(msg);
    case 5: return DecodePrint<std::vector<std::string>, std::pair<uint8_t, int16_t>>(msg);
    case 6: return DecodePrint<FileDescriptor, std::vector<FileDescriptor>>(msg);
    default: return DecodePrint<std::vector<std::vector<uint8_t>>, std::map<int32_t, bool>>(msg);
  }
}

template <class... Ts>
Seed MakeSeed(const std::string& name, int schema, const std::string& expected,
              const Ts&... values) {
  Message m = MessageWithSlots("", {true, false, true});
  mp::EncodeInto(m, values...);
  return Seed{name, std::string(1, static_cast<char>(schema)) + m.bytes, expected};
}

}  // namespace

std::string Describe(std::string_view input) {
  if (input.empty()) return "error: empty";
  const int schema = static_cast<uint8_t>(input[0]) % kSchemas;
  Message msg = MessageWithSlots(std::string(input.substr(1)), {true, false, true});
  try {
    return DecodeSchema(schema, msg);
  } catch (const runtime::Error& e) {
    return ErrorText(e);
  }
}

std::vector<Seed> Seeds() {
  std::vector<Seed> s;
  s.push_back(MakeSeed("scalars", 0, "-7 42 2.5 true", int32_t{-7}, uint64_t{42}, 2.5, true));
  s.push_back(MakeSeed("string", 1, "\"hello, child\"", std::string("hello, child")));
  s.push_back(MakeSeed("vector", 2, "[1,-2,3]", std::vector<int64_t>{1, -2, 3}));
  s.push_back(MakeSeed("map", 3, "{\"a\":[1.5],\"b\":[]}",
                       std::map<std::string, std::vector<double>>{{"a", {1.5}}, {"b", {}}}));
  s.push_back(MakeSeed("optional", 4, "(3,\"x\",false)",
                       std::optional<std::tuple<int32_t, std::string, bool>>(
                           std::make_tuple(3, std::string("x"), false))));
  s.push_back(MakeSeed("optional_none", 4, "none",
                       std::optional<std::tuple<int32_t, std::string, bool>>()));
  s.push_back(MakeSeed("strings_pair", 5, "[\"\",\"ab\"] (9,-300)",
                       std::vector<std::string>{"", "ab"},
                       std::make_pair(uint8_t{9}, int16_t{-300})));
  {
    // Descriptors: index 0 and 2 of the message's slots, and an absent one (-1).
    std::string bytes(1, '\x06');
    std::ostringstream os(std::ios::binary);
    {
      cereal::BinaryOutputArchive ar(os);
      ar(int32_t{0}, uint64_t{2}, int32_t{2}, int32_t{-1});
    }
    s.push_back(Seed{"descriptors", bytes + os.str(), "fd [fd,nofd]"});
  }
  s.push_back(MakeSeed("nested", 7, "[[1,2],[]] {-1:true,5:false}",
                       std::vector<std::vector<uint8_t>>{{1, 2}, {}},
                       std::map<int32_t, bool>{{-1, true}, {5, false}}));
  return s;
}

}  // namespace forksafe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int schema = data[0] % forksafe::fuzz::kSchemas;
  forksafe::mp::Message msg = forksafe::fuzz::MessageWithSlots(
      std::string(reinterpret_cast<const char*>(data) + 1, size - 1), {true, false, true});
  try {
    (void)forksafe::fuzz::DecodeSchema(schema, msg);
  } catch (const forksafe::runtime::Error& e) {
    // The decoder's only way to refuse input: a malformed message is kInvalidArgument.
    if (e.code() != forksafe::runtime::ErrorCode::kInvalidArgument) __builtin_trap();
  }
  return 0;
}
