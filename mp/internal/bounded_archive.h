// mp/internal/bounded_archive.h: NOT FOR USERS. The cereal input archive that mp::Decode reads
// with: the byte format of cereal's BinaryInputArchive (so it decodes whatever
// cereal::BinaryOutputArchive wrote), but hardened for bytes that came from another process.
//
// Guarantees
//   - Reads never go past the end of the bytes (a short read throws cereal::Exception).
//   - A container length (cereal's SizeTag) larger than the bytes left is refused before the
//     container is resized, so a forged length cannot make the decoder allocate more than a small
//     multiple of the message's own size. (A container of zero-byte elements longer than the
//     bytes left is refused too; no forksafe message has one.)
//   - A bool must be encoded as 0 or 1: any other byte is refused (loading it would be undefined
//     behaviour).
//   - Thread safety: one archive per decode; it reads from borrowed bytes that must outlive it.
#ifndef FORKSAFE_MP_INTERNAL_BOUNDED_ARCHIVE_H_
#define FORKSAFE_MP_INTERNAL_BOUNDED_ARCHIVE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "cereal/archives/binary.hpp"
#include "cereal/cereal.hpp"

namespace forksafe::mp::internal {

/// A cereal input archive over a byte range, with the checks above.
class BoundedInputArchive
    : public cereal::InputArchive<BoundedInputArchive, cereal::AllowEmptyClassElision> {
 public:
  /// Reads from `bytes` (not copied).
  explicit BoundedInputArchive(std::string_view bytes)
      : cereal::InputArchive<BoundedInputArchive, cereal::AllowEmptyClassElision>(this),
        data_(bytes.data()),
        left_(bytes.size()) {}

  /// Copies the next `size` bytes to `out`; throws cereal::Exception if fewer are left.
  void loadBinary(void* out, std::streamsize size) {
    const auto n = static_cast<size_t>(size);
    if (size < 0 || n > left_) {
      throw cereal::Exception("truncated: " + std::to_string(size) + " bytes wanted, " +
                              std::to_string(left_) + " left");
    }
    if (n > 0) std::memcpy(out, data_, n);
    data_ += n;
    left_ -= n;
  }

  /// Bytes not read yet.
  size_t remaining() const { return left_; }

 private:
  const char* data_;
  size_t left_;
};

/// Arithmetic values: their bytes, as BinaryOutputArchive wrote them.
template <class T>
inline typename std::enable_if<std::is_arithmetic<T>::value && !std::is_same<T, bool>::value,
                               void>::type
CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, T& t) {
  ar.loadBinary(std::addressof(t), sizeof(t));
}

/// bool: one byte, 0 or 1.
template <class T>
inline typename std::enable_if<std::is_same<T, bool>::value, void>::type CEREAL_LOAD_FUNCTION_NAME(
    BoundedInputArchive& ar, T& t) {
  static_assert(sizeof(bool) == 1, "a bool is one byte in cereal's binary format here");
  uint8_t b = 0;
  ar.loadBinary(&b, 1);
  if (b > 1) throw cereal::Exception("a bool is " + std::to_string(b) + ", not 0 or 1");
  t = b != 0;
}

/// Names are not stored in the binary format.
template <class T>
inline void CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, cereal::NameValuePair<T>& t) {
  ar(t.value);
}

/// Container lengths: at most one element per byte left.
template <class T>
inline void CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, cereal::SizeTag<T>& t) {
  ar(t.size);
  if (static_cast<uint64_t>(t.size) > ar.remaining()) {
    throw cereal::Exception("a length field says " + std::to_string(t.size) +
                            " elements but only " + std::to_string(ar.remaining()) +
                            " bytes are left");
  }
}

/// Contiguous arithmetic data (the elements of strings and vectors of numbers).
template <class T>
inline void CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, cereal::BinaryData<T>& bd) {
  ar.loadBinary(bd.data, static_cast<std::streamsize>(bd.size));
}

}  // namespace forksafe::mp::internal

// Pairs the archive with BinaryOutputArchive, so that types with separate save/load are
// recognised (cereal checks that a load has a matching save).
namespace cereal::traits::detail {
template <>
struct get_output_from_input<forksafe::mp::internal::BoundedInputArchive> {
  using type = cereal::BinaryOutputArchive;
};
}  // namespace cereal::traits::detail

#endif  // FORKSAFE_MP_INTERNAL_BOUNDED_ARCHIVE_H_
