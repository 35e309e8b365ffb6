#include "forksafe/mp/internal/shm_manager.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/child.h"
#include "forksafe/mp/internal/server_auth.h"
#include "forksafe/runtime/at_fork.h"
#include "forksafe/runtime/internal/kept_resources.h"
#include "forksafe/runtime/internal/mutex.h"
#include "forksafe/runtime/internal/process_liveness.h"

namespace forksafe::mp::internal {

namespace {

struct Client {
  runtime::internal::Mutex mu;
  pid_t pid FORKSAFE_GUARDED_BY(mu) = 0;  // the shm manager's (0: none started)
  Connection conn FORKSAFE_GUARDED_BY(mu);
  bool gave_up FORKSAFE_GUARDED_BY(mu) = false;  // no manager could be had: said once, not retried
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
    c.mu.AssertHeld();  // the child's only thread: held, or free after a fork made alone
    // Written only when set: each page the child writes costs it a copy-on-write fault.
    if (!c.conn.closed()) {
      c.conn.close();
      c.conn = Connection();
    }
    if (c.pid != 0) c.pid = 0;
    if (c.gave_up) c.gave_up = false;  // the child tries once for itself
  });
  runtime::internal::RegisterKeptResources("mp_shm_manager",
                                           [](runtime::internal::KeptResources& k) {
                                             Client& c = TheClient();
                                             runtime::internal::MutexLock lk(&c.mu);
                                             k.AddChild(c.pid, "mp shm manager");
                                             if (!c.conn.closed())
                                               k.AddFd(c.conn.fileno(), "mp shm manager socket");
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

// Maps the header page of segment `entry` read-only; nullptr when it has none (yet).
const SegmentHeader* MapHeader(const std::string& entry) {
  const int fd = shm_open(("/" + entry).c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  struct stat st;
  void* p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && st.st_size >= 4096) {  // a shorter one would SIGBUS on reading
    p = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
  }
  ::close(fd);
  return p == MAP_FAILED ? nullptr : static_cast<const SegmentHeader*>(p);
}

// What the manager decides about a segment of a dead creator.
enum class Verdict { kKeep, kRemove };

// What the manager knew of a segment before it scanned /proc: whether it had a forksafe header,
// and its counts then (the order matters, see RefSnapshot in shm_manager.h).
struct Before {
  bool exists = false;  // shm_open worked
  bool header = false;  // a complete forksafe header
  RefSnapshot refs;
};

Before Snapshot(const std::string& entry) {
  Before b;
  const SegmentHeader* h = MapHeader(entry);
  if (h == nullptr) return b;
  b.exists = true;
  b.header = h->magic == kSegmentMagic;
  if (b.header) b.refs = SnapshotRefs(h);
  munmap(const_cast<SegmentHeader*>(h), 4096);
  return b;
}

// A segment whose creator is gone goes when nothing references it; and, judged by `scan` (taken
// after `before`, and complete), when every reference left is in flight in queues that no
// process holds, or when no process maps it and no queue that still exists holds a message
// referring to it (the lifetime rule of shm_manager.h). Without `scan` only the count is used.
Verdict Judge(const std::string& entry, const Before* before, const ProcScan* scan) {
  const bool mapped = scan != nullptr && scan->mapped_names.count(entry) != 0;
  const SegmentHeader* h = MapHeader(entry);
  const uint64_t creator_start =
      h != nullptr && h->magic == kSegmentMagic ? h->creator_start : uint64_t{0};
  const bool judge_by_scan =
      before != nullptr && scan != nullptr && ScanJudges(*scan, creator_start);
  if (h == nullptr) return judge_by_scan && !mapped ? Verdict::kRemove : Verdict::kKeep;
  Verdict v = Verdict::kKeep;
  if (h->magic == kSegmentMagic) {
    const int32_t refs = h->live_refs.load(std::memory_order_acquire);
    if (refs == 0) {
      v = Verdict::kRemove;
    } else if (judge_by_scan && before->header) {
      // A reader that adopted its reference before the snapshot mapped the segment before it,
      // so the scan sees it (or its count dropped); one that adopts after found the reference
      // in a carrier the snapshot names, which the scan sees held (or the reader's mapping).
      if (OnlyDeadCarriersHold(h, before->refs, scan->live_carriers) ||
          (!mapped && !HeldInFlight(before->refs, scan->live_carriers) &&
           refs == before->refs.live_refs)) {
        v = Verdict::kRemove;
      }
    }
  } else if (judge_by_scan && before->exists && !before->header && !mapped) {
    v = Verdict::kRemove;  // killed before its header was written
  }
  munmap(const_cast<SegmentHeader*>(h), 4096);
  return v;
}

// Whether a forksafe process of this pid namespace made segment `entry` (its creator pid means
// something here).
bool MadeInThisNamespace(const std::string& entry) {
  const SegmentHeader* h = MapHeader(entry);
  if (h == nullptr) return false;
  const bool ours = h->magic == kSegmentMagic && h->pid_ns == PidNamespaceId();
  munmap(const_cast<SegmentHeader*>(h), 4096);
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

namespace {
uint64_t Count(uint64_t word) { return word & 0xffffff; }
uint64_t Id(uint64_t word) { return word >> 24; }
}  // namespace

void AddCarrierRef(SegmentHeader* h, uint64_t carrier) {
  if (carrier == 0) return;
  const uint64_t key = CarrierKey(carrier);
  for (int pass = 0; pass < 2; ++pass) {
    for (InFlightCarrier& slot : h->carriers) {
      uint64_t w = slot.load(std::memory_order_relaxed);
      for (;;) {
        const bool mine = Count(w) > 0 && Id(w) == key && Count(w) < 0xffffff;
        const bool take = pass == 1 && Count(w) == 0;  // a free slot, on the second pass
        if (!mine && !take) break;
        const uint64_t next = mine ? w + 1 : (key << 24) | 1;
        if (slot.compare_exchange_weak(w, next, std::memory_order_acq_rel)) return;
      }
    }
  }
  h->carrier_overflow.fetch_add(1, std::memory_order_acq_rel);
}

void DropCarrierRef(SegmentHeader* h, uint64_t carrier) {
  if (carrier == 0) return;
  const uint64_t key = CarrierKey(carrier);
  for (InFlightCarrier& slot : h->carriers) {
    uint64_t w = slot.load(std::memory_order_relaxed);
    while (Count(w) > 0 && Id(w) == key) {
      if (slot.compare_exchange_weak(w, w - 1, std::memory_order_acq_rel)) return;
    }
  }
  int32_t o = h->carrier_overflow.load(std::memory_order_relaxed);
  while (o > 0 && !h->carrier_overflow.compare_exchange_weak(o, o - 1)) {
  }
}

namespace {

// Adds what process `pid` maps to `out` (forksafe /dev/shm names, queue memfds). False when its
// maps could not be read although it exists.
bool ScanMapsOf(const std::string& pid, ProcScan& out) {
  FILE* f = fopen(("/proc/" + pid + "/maps").c_str(), "re");
  if (f == nullptr) return errno == ENOENT || errno == ESRCH;  // gone: holds nothing
  char buf[4096];
  while (fgets(buf, sizeof buf, f) != nullptr) {
    const std::string line = buf;
    if (const size_t at = line.find("/dev/shm/forksafe_"); at != std::string::npos) {
      std::string name = line.substr(at + 9);
      const size_t end = name.find_first_of(" \n");
      if (end != std::string::npos) name.resize(end);
      out.mapped_names.insert(name);
    } else if (line.find("/memfd:forksafe:queue") != std::string::npos) {
      // address perms offset dev inode path
      unsigned long long inode = 0;
      if (std::sscanf(line.c_str(), "%*s %*s %*s %*s %llu", &inode) == 1 && inode != 0) {
        out.live_carriers.insert(CarrierKey(inode));
      }
    }
  }
  fclose(f);
  return true;
}

// Adds the queues that process `pid` holds only as a descriptor (a Process argument kept by its
// parent, a queue received but not mapped yet). False when its descriptors could not be read.
bool ScanFdsOf(const std::string& pid, ProcScan& out) {
  const std::string dir = "/proc/" + pid + "/fd";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return errno == ENOENT || errno == ESRCH;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const std::string path = dir + "/" + e->d_name;
    char target[128];
    const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (std::strncmp(target, "/memfd:forksafe:queue", 21) != 0) continue;
    struct stat st;
    if (stat(path.c_str(), &st) == 0) out.live_carriers.insert(CarrierKey(st.st_ino));
  }
  closedir(d);
  return true;
}

}  // namespace

namespace {

// Process `pid`'s state letter and start time from /proc/<pid>/stat; false when unreadable.
bool ReadStat(pid_t pid, char* state, uint64_t* start) {
  FILE* f = fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "re");
  if (f == nullptr) return false;
  char buf[1024];
  const size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses; fields count from the last
  // ')'. starttime is field 22, the 20th after it.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return false;
  unsigned long long started = 0;
  if (std::sscanf(p + 1,
                  " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d "
                  "%*d %*d %llu",
                  state, &started) != 2) {
    return false;
  }
  *start = started;
  return true;
}

}  // namespace

uint64_t ProcessStartTicks(pid_t pid) {
  char state = 0;
  uint64_t start = 0;
  return ReadStat(pid, &state, &start) ? start : 0;
}

uint64_t SelfStartTicks() {
  // Keyed by pid: a forked child has a start time of its own.
  static std::atomic<pid_t> cached_pid{0};
  static std::atomic<uint64_t> cached_start{0};
  const pid_t self = getpid();
  if (cached_pid.load(std::memory_order_acquire) == self) {
    return cached_start.load(std::memory_order_relaxed);
  }
  const uint64_t start = ProcessStartTicks(self);
  cached_start.store(start, std::memory_order_relaxed);
  cached_pid.store(self, std::memory_order_release);
  return start;
}

ProcScan ScanProc() {
  // A queue is held by a process as long as that process maps its segment (a memfd named
  // "forksafe:queue", whose inode is the queue's identity, mp/queue.cc) or has a descriptor of it.
  ProcScan out;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) {
    out.complete = false;
    return out;
  }
  const uid_t me = geteuid();
  while (dirent* e = readdir(proc)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const std::string pid = e->d_name;
    const bool maps_ok = ScanMapsOf(pid, out);
    const bool fds_ok = ScanFdsOf(pid, out);
    if (maps_ok && fds_ok) continue;
    // Unreadable: what it holds is unknown. Processes of other users are unreadable by design
    // (and hold our queues only if given them); for one of ours, its start time decides which
    // segments the scan may judge (ScanJudges).
    struct stat st;
    if (stat(("/proc/" + pid).c_str(), &st) != 0 || st.st_uid != me) continue;  // gone, or not ours
    char state = 0;
    uint64_t started = 0;
    if (!ReadStat(std::stoi(pid), &state, &started)) {
      // No start time: unknown, unless the process has just gone (it holds nothing then).
      if (stat(("/proc/" + pid).c_str(), &st) == 0) out.complete = false;
      continue;
    }
    if (state == 'Z' || state == 'X') continue;  // exited: maps and holds nothing
    out.newest_unreadable = std::max(out.newest_unreadable, started);
  }
  closedir(proc);
  return out;
}

bool ScanJudges(const ProcScan& scan, uint64_t creator_start) {
  if (!scan.complete) return false;
  if (scan.newest_unreadable == 0) return true;
  return creator_start != 0 && scan.newest_unreadable < creator_start;
}

RefSnapshot SnapshotRefs(const SegmentHeader* h) {
  RefSnapshot s;
  // Carriers first, the total last: a reference adopted in between shows in neither or in the
  // total only (the reader maps the segment before adopting), never as a carrier's alone.
  for (int i = 0; i < kMaxCarriers; ++i)
    s.carriers[i] = h->carriers[i].load(std::memory_order_acquire);
  s.overflow = h->carrier_overflow.load(std::memory_order_acquire);
  s.live_refs = h->live_refs.load(std::memory_order_acquire);
  return s;
}

bool HeldInFlight(const RefSnapshot& s, const std::set<uint64_t>& live) {
  for (const uint64_t w : s.carriers) {
    if (Count(w) > 0 && live.count(Id(w)) != 0) return true;
  }
  return false;
}

bool OnlyDeadCarriersHold(const SegmentHeader* h, const RefSnapshot& before,
                          const std::set<uint64_t>& live) {
  int64_t dead = 0;
  for (const uint64_t w : before.carriers) {
    if (Count(w) == 0) continue;
    if (live.count(Id(w)) != 0) return false;
    dead += static_cast<int64_t>(Count(w));
  }
  // The references in dead carriers are frozen (nobody can get from a queue no process holds, nor
  // put into it): if the count now is theirs alone, no other reference exists.
  return dead > 0 && dead == h->live_refs.load(std::memory_order_acquire);
}

int SweepOrphanedSegments() {
  std::set<std::string> candidates;
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    const pid_t creator = CreatorOf(n);
    // A zombie creator counts as exited: it maps and holds nothing any more (the scan below
    // decides what its segments' other holders still need).
    if (creator > 0 && !runtime::internal::ProcessAlive(creator)) candidates.insert(n);
  }
  closedir(d);
  if (candidates.empty()) return 0;
  std::map<std::string, Before> before;  // the counts BEFORE the scan (see Judge)
  for (const std::string& n : candidates) {
    if (MadeInThisNamespace(n)) before[n] = Snapshot(n);
  }
  const ProcScan scan = ScanProc();
  int removed = 0;
  for (const auto& [n, b] : before) {
    if (scan.mapped_names.count(n) == 0 && Judge(n, &b, &scan) == Verdict::kRemove &&
        shm_unlink(("/" + n).c_str()) == 0)
      ++removed;
  }
  return removed;
}

namespace {

bool IsExecutableFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

// The folder of the file that holds this code: libforksafe.so's, or the program's when forksafe
// is linked into it. Empty when unknown.
std::string FolderOfThisCode() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&ShmManagerExecutable), &info) == 0 ||
      info.dli_fname == nullptr) {
    return std::string();
  }
  char resolved[PATH_MAX];
  if (realpath(info.dli_fname, resolved) == nullptr) {
    // The program itself can be named as it was started (a relative argv[0]).
    const ssize_t n = readlink("/proc/self/exe", resolved, sizeof(resolved) - 1);
    if (n <= 0) return std::string();
    resolved[n] = '\0';
  }
  std::string path(resolved);
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

}  // namespace

std::optional<std::string> ShmManagerExecutable(std::string* why_none) {
  const char* env = getenv("FORKSAFE_SHM_MANAGER");
  if (env != nullptr && *env != '\0') {
    if (IsExecutableFile(env)) return std::string(env);
    *why_none = absl::StrCat("FORKSAFE_SHM_MANAGER=", env,
                             " is not an executable file: point it at forksafe-shm-manager, or "
                             "unset it");
    return std::nullopt;
  }
  if (InitMainCalled()) return std::string();
  const std::string folder = FolderOfThisCode();
  if (!folder.empty()) {
    for (const std::string& candidate : {absl::StrCat(folder, "/", kShmManagerProgram),
                                         absl::StrCat(folder, "/forksafe/", kShmManagerProgram)}) {
      if (IsExecutableFile(candidate)) return candidate;
    }
  }
  *why_none = absl::StrCat(
      "no forksafe-shm-manager beside ", folder.empty() ? "the library" : folder,
      ", this program did not call forksafe::mp::InitMain(argc, argv), and FORKSAFE_SHM_MANAGER "
      "is not set: do one of the three (tools/install.sh installs the manager)");
  return std::nullopt;
}

void ShmManagerTrack(const std::string& name) {
  Client& c = TheClient();
  runtime::internal::MutexLock lk(&c.mu);
  if (c.gave_up) return;
  std::string why;
  try {
    if (c.pid == 0) {
      const std::optional<std::string> program = ShmManagerExecutable(&why);
      if (program) {
        c.conn = SpawnServer(kShmManagerFlag, &c.pid, program->empty() ? nullptr : &*program);
      }
    }
    // without the leading '/'
    if (c.pid != 0) c.conn.send(std::string("track"), name.substr(1));
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (why.empty()) return;
  c.gave_up = true;
  if (c.pid != 0) {
    // It started and died (or never served): reap it if it is gone, so no zombie stays.
    c.conn.close();
    c.conn = Connection();
    // Its end closed: it is exiting. Wait for it briefly (a bounded wait, on this failure only).
    int status = 0;
    for (int i = 0; i < 20 && waitpid(c.pid, &status, WNOHANG) == 0; ++i) usleep(5000);
    c.pid = 0;
  }
  fprintf(stderr,
          "forksafe: the file_system strategy's shm manager is unavailable (%s); this process's "
          "named segments are removed when freed, but not if it is killed\n",
          why.c_str());
}

pid_t ShmManagerPid() {
  Client& c = TheClient();
  runtime::internal::MutexLock lk(&c.mu);
  return c.pid;
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
  // Which processes may hold a segment is judged per segment, from the creator's start time in
  // its header (ScanJudges): not from getppid(), which is PID 1 once a creator died early.
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
  // Once a second the judgement uses a scan of /proc, taken AFTER a snapshot of each segment's
  // counts (a scan older than the counts could miss a reader that mapped the segment and let go
  // of the queue in between); in between, only a count of zero removes a segment.
  auto last_scan = std::chrono::steady_clock::now() - std::chrono::seconds(10);
  while (!names.empty()) {
    const auto now = std::chrono::steady_clock::now();
    std::map<std::string, Before> before;
    std::optional<ProcScan> scan;
    if (now - last_scan >= std::chrono::seconds(1)) {
      for (const std::string& n : names) before[n] = Snapshot(n);
      scan = ScanProc();
      last_scan = now;
    }
    for (auto it = names.begin(); it != names.end();) {
      const bool gone = !Exists(*it);
      const auto b = before.find(*it);
      if (gone || Judge(*it, b == before.end() ? nullptr : &b->second, scan ? &*scan : nullptr) ==
                      Verdict::kRemove) {
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
