// mp/launch.cc: spawn()'s children's variables, and failures recorded for torchelastic.
#include "forksafe/mp/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp {

using runtime::Error;
using runtime::ErrorCode;

LaunchInfo GetLaunchInfo() { return runtime::GetLaunchInfo(); }

std::vector<std::pair<std::string, std::string>> SpawnChildEnvironment(const LaunchInfo& parent,
                                                                       int nprocs, int index,
                                                                       int master_port) {
  if (nprocs < 1 || index < 0 || index >= nprocs) {
    throw Error(ErrorCode::kInvalidArgument, absl::StrCat("SpawnChildEnvironment: index ", index,
                                                          " is not in [0, nprocs = ", nprocs, ")"));
  }
  const long long world = static_cast<long long>(parent.world_size) * nprocs;
  if (world > INT_MAX) {
    throw Error(ErrorCode::kResourceExhausted,
                absl::StrCat("spawn: ", nprocs, " processes in each of ", parent.world_size,
                             " ranks make a world too large to number"));
  }
  const std::string rank = std::to_string(static_cast<long long>(parent.rank) * nprocs + index);
  const std::string world_size = std::to_string(world);
  std::vector<std::pair<std::string, std::string>> env = {
      {"RANK", rank},
      {"WORLD_SIZE", world_size},
      {"LOCAL_RANK", std::to_string(static_cast<long long>(parent.local_rank) * nprocs + index)},
      {"LOCAL_WORLD_SIZE",
       std::to_string(static_cast<long long>(parent.local_world_size) * nprocs)},
      {"GROUP_RANK", std::to_string(parent.node_rank)},
      {"ROLE_RANK", rank},
      {"ROLE_WORLD_SIZE", world_size},
      {"FORKSAFE_LAUNCHER", "spawn"},
  };
  if (!parent.master_addr.empty()) {
    env.emplace_back("MASTER_ADDR", parent.master_addr);
    if (parent.master_port > 0) env.emplace_back("MASTER_PORT", std::to_string(parent.master_port));
  } else if (parent.world_size == 1 && master_port > 0) {
    // One parent: its children are the whole world, on this machine.
    env.emplace_back("MASTER_ADDR", "127.0.0.1");
    env.emplace_back("MASTER_PORT", std::to_string(master_port));
  }
  return env;
}

int FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) runtime::ThrowSystemError("FreeLoopbackPort: socket", errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    runtime::ThrowSystemError("FreeLoopbackPort: bind to 127.0.0.1:0", err);
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

namespace {

// The length of the valid UTF-8 sequence at s[i], or 0 when it is not one.
size_t Utf8Length(const std::string& s, size_t i) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  size_t n = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  }
  return n;
}

// JSON string contents: quotes, backslashes and control characters escaped, valid UTF-8 as it
// is, and any other byte as U+FFFD (torchrun refuses an error file it cannot decode, and a C++
// what() may hold any bytes).
std::string JsonEscape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 16);
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t n = Utf8Length(s, i);
      if (n == 0) {
        out += "\\ufffd";
      } else {
        out.append(s, i, n);
        i += n - 1;
      }
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

}  // namespace

bool RecordFailureForLauncher(const std::string& type, const std::string& message,
                              const std::string& traceback) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr || *path == '\0') return false;
  const std::string json =
      absl::StrCat("{\"message\": {\"message\": \"", JsonEscape(absl::StrCat(type, ": ", message)),
                   "\", \"extraInfo\": {\"py_callstack\": \"",
                   JsonEscape(traceback.empty() ? absl::StrCat(type, ": ", message) : traceback),
                   "\", \"timestamp\": \"", static_cast<long long>(std::time(nullptr)), "\"}}}\n");
  std::FILE* f = std::fopen(path, "w");
  bool ok = f != nullptr && std::fwrite(json.data(), 1, json.size(), f) == json.size();
  if (f != nullptr && std::fclose(f) != 0) ok = false;
  if (!ok) {
    std::fprintf(stderr,
                 "forksafe: could not write the failure to TORCHELASTIC_ERROR_FILE=%s (%s); the "
                 "launcher will report the exit code only\n",
                 path, std::strerror(errno));
  }
  return ok;
}

}  // namespace forksafe::mp
