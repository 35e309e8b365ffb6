#include "forksafe/runtime/internal/random.h"

#include <errno.h>
#include <sys/random.h>
#include <sys/types.h>

#include "absl/strings/escaping.h"
#include "forksafe/runtime/error.h"

namespace forksafe::runtime::internal {

namespace {

void FillRandom(void* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(static_cast<char*>(out) + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      ThrowSystemError("getrandom", errno);
    }
    got += static_cast<size_t>(r);
  }
}

}  // namespace

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  FillRandom(out.data(), n);
  return out;
}

std::string RandomHex128() { return absl::BytesToHexString(RandomBytes(16)); }

uint64_t RandomId() {
  uint64_t id = 0;
  while (id == 0) FillRandom(&id, sizeof id);
  return id;
}

}  // namespace forksafe::runtime::internal
