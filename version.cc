#include "forksafe/version.h"

namespace forksafe {

const char* Version() noexcept { return FORKSAFE_VERSION_STRING; }

}  // namespace forksafe
