#include "forksafe/runtime/internal/random.h"

#include <errno.h>
#include <sys/random.h>
#include <sys/types.h>

#include <cstring>

#include "absl/strings/escaping.h"
#include "forksafe/runtime/error.h"

namespace forksafe::runtime::internal {

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      ThrowSystemError("getrandom", errno);
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

std::string RandomHex128() { return absl::BytesToHexString(RandomBytes(16)); }

uint64_t RandomId() {
  uint64_t id = 0;
  while (id == 0) {
    const std::string bytes = RandomBytes(sizeof id);
    std::memcpy(&id, bytes.data(), sizeof id);
  }
  return id;
}

}  // namespace forksafe::runtime::internal
