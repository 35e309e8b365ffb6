#include "mp/internal/shm_manager.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "mp/connection.h"
#include "mp/internal/server_auth.h"
#include "runtime/at_fork.h"
#include "runtime/internal/kept_resources.h"

namespace forksafe::mp::internal {

namespace {

struct Client {
  std::mutex mu;
  pid_t pid = 0;
  Connection conn;
};

Client& TheClient() {
  static auto* c = new Client();
  return *c;
}

// A forked child must not hold its parent's manager connection (the manager would not see the
// parent's end-of-file while the child lives): close it; the child starts its own manager.
const bool g_handler = [] {
  runtime::HoldAcrossFork(&TheClient().mu, "mp_shm_manager", [] {
    Client& c = TheClient();
    c.conn.close();
    c.conn = Connection();
    c.pid = 0;
  });
  runtime::internal::RegisterKeptResources("mp_shm_manager", [](runtime::internal::KeptResources& k) {
    Client& c = TheClient();
    std::lock_guard<std::mutex> lk(c.mu);
    k.AddChild(c.pid, "mp shm manager");
    if (!c.conn.closed()) k.AddFd(c.conn.fileno(), "mp shm manager socket");
  });
  return true;
}();

// Creator pid encoded in "forksafe_<pid>_<hex>" (a /dev/shm entry name), or 0.
pid_t CreatorOf(const std::string& entry) {
  if (entry.rfind("forksafe_", 0) != 0) return 0;
  const size_t us = entry.find('_', 9);
  if (us == std::string::npos) return 0;
  return static_cast<pid_t>(std::atoi(entry.substr(9, us - 9).c_str()));
}

bool Alive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

// Names ("forksafe_...") of /dev/shm entries that some process maps right now.
std::set<std::string> MappedNames() {
  std::set<std::string> out;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return out;
  while (dirent* e = readdir(proc)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::ifstream maps(absl::StrCat("/proc/", e->d_name, "/maps"));
    std::string line;
    while (std::getline(maps, line)) {
      const size_t at = line.find("/dev/shm/forksafe_");
      if (at == std::string::npos) continue;
      std::string name = line.substr(at + 9);
      const size_t sp = name.find(' ');
      if (sp != std::string::npos) name.resize(sp);
      out.insert(name);
    }
  }
  closedir(proc);
  return out;
}

// The start of a segment (see shared_arena.cc's SegmentHeader).
struct Header {
  uint64_t magic, size, id;
  int32_t creator;
  int32_t live_refs;
  uint64_t pid_ns;
};
constexpr uint64_t kSegmentMagic = 0x66736172656e6131ull;  // "fsarena1"

// Maps the header page of segment `entry` read-only; nullptr when it has none (yet).
const Header* MapHeader(const std::string& entry) {
  const int fd = shm_open(("/" + entry).c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  struct stat st;
  void* p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && st.st_size >= 4096) {  // a shorter one would SIGBUS on reading
    p = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
  }
  ::close(fd);
  return p == MAP_FAILED ? nullptr : static_cast<const Header*>(p);
}

// The segment's count of live references, or -1.
int32_t LiveRefs(const std::string& entry) {
  const Header* h = MapHeader(entry);
  if (h == nullptr) return -1;
  const int32_t refs = __atomic_load_n(&h->live_refs, __ATOMIC_ACQUIRE);
  munmap(const_cast<Header*>(h), 4096);
  return refs;
}

// Whether a forksafe process of this pid namespace made segment `entry` (its creator pid means
// something here).
bool MadeInThisNamespace(const std::string& entry) {
  const Header* h = MapHeader(entry);
  if (h == nullptr) return false;
  const bool ours = h->magic == kSegmentMagic && h->pid_ns == PidNamespaceId();
  munmap(const_cast<Header*>(h), 4096);
  return ours;
}

bool Exists(const std::string& entry) {
  struct stat st;
  return stat(("/dev/shm/" + entry).c_str(), &st) == 0;
}

}  // namespace

uint64_t PidNamespaceId() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

int SweepOrphanedSegments() {
  std::set<std::string> candidates;
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    const pid_t creator = CreatorOf(n);
    if (creator > 0 && !Alive(creator)) candidates.insert(n);
  }
  closedir(d);
  if (candidates.empty()) return 0;
  const std::set<std::string> mapped = MappedNames();
  int removed = 0;
  for (const std::string& n : candidates) {
    if (mapped.count(n) == 0 && MadeInThisNamespace(n) && shm_unlink(("/" + n).c_str()) == 0) {
      ++removed;
    }
  }
  return removed;
}

void ShmManagerTrack(const std::string& name) {
  Client& c = TheClient();
  std::lock_guard<std::mutex> lk(c.mu);
  try {
    if (c.pid == 0) {
      auto [ours, theirs] = Pipe(true);
      std::string secret = NewServerSecret();
      FileDescriptor secret_pipe = SecretPipe(secret);
      c.pid = SpawnExecutable(kShmManagerFlag, theirs.fileno(), secret_pipe.get());
      secret_pipe.reset();
      theirs.close();
      c.conn = ours;
      SendServerHello(c.conn, secret);
      explicit_bzero(secret.data(), secret.size());
    }
    c.conn.send(std::string("track"), name.substr(1));  // without the leading '/'
  } catch (const std::exception& e) {
    fprintf(stderr, "forksafe: the shm manager is unavailable (%s); named segments are removed "
                    "only when freed\n", e.what());
  }
}

pid_t ShmManagerPid() {
  std::lock_guard<std::mutex> lk(TheClient().mu);
  return TheClient().pid;
}

std::optional<std::string> DecodeTrackRequest(Message& msg) {
  std::string kind, name;
  Decode(msg, kind, name);
  // The name is unlinked later as "/" + name: it must stay inside forksafe's names (a NUL would
  // cut it short to another segment's name).
  if (kind != "track" || name.rfind("forksafe_", 0) != 0 || name.size() > 255 ||
      name.find('/') != std::string::npos || name.find('\0') != std::string::npos) {
    return std::nullopt;
  }
  return name;
}

void RunShmManager(int fd) {
  signal(SIGINT, SIG_IGN);  // a Ctrl-C for the program must not stop the cleanup
  setsid();                 // nor a signal to its process group
  // Nothing is done, not even the sweep, before the creator proved it holds the secret it handed
  // us on kSecretFd (threat model: mp/internal/server_auth.h). A refused connection is closed
  // unread and, being the only one this manager has, ends it without touching /dev/shm.
  Connection client(FileDescriptor(fd), true, true);
  if (!CheckServerHello(client, ReadInheritedSecret(kSecretFd), "the shm manager")) _exit(0);
  SweepOrphanedSegments();
  std::set<std::string> names;
  for (;;) {  // while the client lives: collect its names
    std::optional<std::string> name;
    try {
      Message m = client.RecvMessage(std::nullopt);
      name = DecodeTrackRequest(m);
    } catch (...) {
      break;  // end-of-file: the client exited or was killed
    }
    if (name) names.insert(std::move(*name));
  }
  // The client is gone: remove each of its segments once nobody references or maps it.
  auto last_scan = std::chrono::steady_clock::now() - std::chrono::seconds(10);
  while (!names.empty()) {
    std::set<std::string> mapped;
    const auto now = std::chrono::steady_clock::now();
    const bool scan = now - last_scan >= std::chrono::seconds(1);
    if (scan) {
      mapped = MappedNames();
      last_scan = now;
    }
    for (auto it = names.begin(); it != names.end();) {
      const bool gone = !Exists(*it);
      const bool unused = LiveRefs(*it) == 0 || (scan && mapped.count(*it) == 0);
      if (gone || unused) {
        shm_unlink(("/" + *it).c_str());
        it = names.erase(it);
      } else {
        ++it;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  _exit(0);
}

}  // namespace forksafe::mp::internal
