// Security checks (issue 7, "Security"): every shared-memory file the library makes is
// owner-only; no socket it makes has a name; named segments carry 128 bits from getrandom()
// (which a forked child does not repeat); and the fork server and the shm manager serve nothing
// to a connection that does not present their secret, while the real clients still work.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/mp/connection.h"
#include "forksafe/mp/internal/child.h"
#include "forksafe/mp/internal/server_auth.h"
#include "forksafe/mp/internal/shared_arena.h"
#include "forksafe/mp/internal/shared_segment.h"
#include "forksafe/mp/internal/shm_manager.h"
#include "forksafe/mp/process.h"
#include "forksafe/mp/queue.h"
#include "forksafe/mp/synchronize.h"
#include "forksafe/runtime/error.h"
#include "forksafe/runtime/internal/random.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using namespace std::chrono_literals;
using internal::SegmentKind;
using internal::SharedArena;

// ---- helpers ----

struct OpenFile {
  int fd;
  std::string target;  // readlink of /proc/self/fd/N
};

std::vector<OpenFile> OpenFiles() {
  std::vector<OpenFile> out;
  for (int fd = 0; fd < 4096; ++fd) {
    char link[64], buf[512];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    const ssize_t n = readlink(link, buf, sizeof(buf) - 1);
    if (n <= 0) continue;
    buf[n] = '\0';
    out.push_back({fd, buf});
  }
  return out;
}

bool StartsWith(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

bool IsHex(const std::string& s) {
  return s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// Runs in a child process: creates `path` (the visible effect a served request would have).
void TouchMarker(std::string path) { std::ofstream(path) << "served\n"; }
FORKSAFE_ENTRY_POINT(TouchMarker);

void Quiet() {}
FORKSAFE_ENTRY_POINT(Quiet);

std::string TempPath(const std::string& name) {
  const char* dir = getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name + "_" + std::to_string(getpid());
}

bool FileExists(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

// The name of a named block's segment. Export() takes a reference in flight for a receiver that
// never comes here: import it back, so that it is adopted and dropped at once. Otherwise the
// segment's count never reaches zero and its name stays in /dev/shm until the process exits
// (found by the leak check).
std::string NameOf(const std::shared_ptr<internal::SharedBlock>& block) {
  internal::SharedBlock::Handle h = block->Export();
  const std::string name = h.name;
  SharedArena::Get().Import(std::move(h));
  return name;
}

// ---- (a) modes ----

TEST(SecurityModesTest, EverySharedMemoryFileIsOwnerOnly) {
  const mode_t old_umask = umask(0);  // the modes must not depend on the caller's umask
  Queue q;
  Lock lock;
  internal::SharedSegment seg = internal::SharedSegment::Create(4096, "security-test");
  auto memfd_block = SharedArena::Get().Allocate(1024, SegmentKind::kMemfd, false);
  auto named_block = SharedArena::Get().Allocate(1024, SegmentKind::kNamed, false);
  const int spill = internal::PrivateMemfd("forksafe:queue-item");
  umask(old_umask);
  ASSERT_GE(spill, 0);

  int memfds = 0, named = 0;
  for (const OpenFile& f : OpenFiles()) {
    const bool is_memfd = StartsWith(f.target, "/memfd:forksafe");
    const bool is_named = StartsWith(f.target, "/dev/shm/forksafe_");
    if (!is_memfd && !is_named) continue;
    struct stat st;
    ASSERT_EQ(fstat(f.fd, &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0600u)
        << f.target << " (fd " << f.fd << ") has mode " << std::oct << (st.st_mode & 07777);
    EXPECT_EQ(st.st_uid, geteuid()) << f.target;
    memfds += is_memfd;
    named += is_named;
  }
  EXPECT_GE(memfds, 5) << "queue ring, lock, segment, arena block and spill memfds";
  EXPECT_GE(named, 1);
  const std::string name = NameOf(named_block);
  struct stat st;
  ASSERT_EQ(stat(("/dev/shm" + name).c_str(), &st), 0) << name;
  EXPECT_EQ(st.st_mode & 07777, 0600u) << name;
  ::close(spill);
}

// No socket of this process has an address: the servers and every Connection/Queue use
// socketpairs, reachable only by holding a descriptor.
TEST(SecurityModesTest, NoSocketIsBoundToAName) {
  auto named = SharedArena::Get().Allocate(1024, SegmentKind::kNamed, false);  // starts the manager
  Process p(ProcessOptions{"quiet", false, "forkserver"}, &Quiet);  // starts the fork server
  p.start();
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
  Queue q;
  auto [a, b] = Pipe(true);
  ASSERT_GT(internal::ShmManagerPid(), 0);

  std::set<std::string> ours;
  for (const OpenFile& f : OpenFiles()) {
    if (StartsWith(f.target, "socket:[")) ours.insert(f.target.substr(8, f.target.size() - 9));
  }
  ASSERT_GE(ours.size(), 4u);
  std::ifstream unix_sockets("/proc/net/unix");
  std::string line;
  std::getline(unix_sockets, line);  // header
  int seen = 0;
  while (std::getline(unix_sockets, line)) {
    std::istringstream in(line);
    std::string num, refs, proto, flags, type, st, inode, path;
    in >> num >> refs >> proto >> flags >> type >> st >> inode >> path;
    if (ours.count(inode) == 0) continue;
    ++seen;
    EXPECT_EQ(path, "") << "socket inode " << inode << " is bound to " << path;
  }
  EXPECT_GE(seen, 1) << "none of this process's sockets were found in /proc/net/unix";
}

// ---- (b) names ----

TEST(SecurityNamesTest, NamedSegmentsCarry128RandomBits) {
  const std::string prefix = SharedArena::NamePrefix();
  std::vector<std::string> parts;
  std::vector<std::shared_ptr<internal::SharedBlock>> blocks;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(SharedArena::Get().Allocate(1024, SegmentKind::kNamed, false));
    const std::string name = NameOf(blocks.back());
    ASSERT_TRUE(StartsWith(name, prefix)) << name;
    const std::string random = name.substr(prefix.size());
    EXPECT_EQ(random.size(), 32u) << name << ": 128 bits in hex";
    EXPECT_TRUE(IsHex(random)) << name;
    for (const std::string& p : parts) EXPECT_NE(random, p);
    parts.push_back(random);
  }
  // The generator: 256 draws are distinct and every one of the 128 bits takes both values (a
  // counter, a pid or a time stamp would leave high bits fixed).
  std::set<std::string> seen;
  std::vector<int> ones(128, 0);
  for (int i = 0; i < 256; ++i) {
    const std::string h = runtime::internal::RandomHex128();
    ASSERT_EQ(h.size(), 32u);
    seen.insert(h);
    for (int bit = 0; bit < 128; ++bit) {
      const int nibble = std::stoi(h.substr(bit / 4, 1), nullptr, 16);
      ones[bit] += (nibble >> (3 - bit % 4)) & 1;
    }
  }
  EXPECT_EQ(seen.size(), 256u);
  for (int bit = 0; bit < 128; ++bit) {
    EXPECT_GT(ones[bit], 0) << "bit " << bit << " never 1";
    EXPECT_LT(ones[bit], 256) << "bit " << bit << " never 0";
  }
}

// A forked child names its segments with fresh randomness, not a copy of its parent's
// generator state (which would make the parent's next names predictable from the child's).
TEST(SecurityNamesTest, AForkedChildDoesNotRepeatItsParentsNames) {
  auto warm = SharedArena::Get().Allocate(1024, SegmentKind::kNamed, false);  // state exists
  auto pipe = Pipe(false);                                                    // (reader, writer)
  Connection& reader = pipe.first;
  Connection& writer = pipe.second;
  forksafe::testing::ChildResult r = forksafe::testing::RunInChild(
      [&] {
        auto b = SharedArena::Get().Allocate(1024, SegmentKind::kNamed, false);
        const std::string n = NameOf(b);
        writer.send(n.substr(SharedArena::NamePrefix().size()));
        return 0;
      },
      30s, 30);
  ASSERT_TRUE(r.ok()) << r.Describe();
  const std::string child_random = reader.recv<std::string>();
  auto mine = SharedArena::Get().Allocate(1024, SegmentKind::kNamed, false);
  const std::string my_random = NameOf(mine).substr(SharedArena::NamePrefix().size());
  EXPECT_EQ(child_random.size(), 32u);
  EXPECT_NE(child_random, my_random);
}

// A fork by another thread while a server's secret pipe exists (between its creation and the
// server's spawn) never hands the child a copy of it, nor of the server's end of its socket:
// held for 0.3 s, the fork waits for the handoff to end; held past the fork's 3 s prepare
// deadline, the fork goes on and the child closes every copy (dups included) before it runs.
void ExpectNoChildGetsAHandoff(std::chrono::milliseconds held) {
  std::atomic<bool> made{false};
  struct stat pipe_st {
  }, socket_st{};
  std::thread holder([&] {
    internal::SecretHandoff handoff(std::string(internal::kSecretBytes, 's'));
    auto [mine, theirs] = Pipe(true);
    handoff.Guard(theirs.fileno());
    FileDescriptor dup_of_pipe = FileDescriptor::Dup(handoff.fd());  // as SpawnExecutable does
    fstat(handoff.fd(), &pipe_st);
    fstat(theirs.fileno(), &socket_st);
    made = true;
    std::this_thread::sleep_for(held);
  });
  for (int i = 0; i < 2000 && !made; ++i) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(made);
  forksafe::testing::ChildResult r = forksafe::testing::RunInChild(
      [&] {
        for (int fd = 0; fd < 4096; ++fd) {
          struct stat st;
          if (fstat(fd, &st) != 0) continue;
          if ((st.st_dev == pipe_st.st_dev && st.st_ino == pipe_st.st_ino) ||
              (st.st_dev == socket_st.st_dev && st.st_ino == socket_st.st_ino)) {
            return 3;  // the child holds the secret pipe or the server's socket end
          }
        }
        return 0;
      },
      30s);
  holder.join();
  EXPECT_TRUE(r.ok()) << r.Describe() << " (held " << held.count() << " ms)";
}

TEST(ServerAuthTest, AForkWaitsForASecretHandoffToEnd) { ExpectNoChildGetsAHandoff(300ms); }

TEST(ServerAuthTest, AForkThatCannotWaitClosesTheHandoffInTheChild) {
  ExpectNoChildGetsAHandoff(4000ms);
}

// ---- (c) servers refuse connections without their secret ----

TEST(ServerAuthTest, CheckCountsRefusalsAndComparesWholeSecrets) {
  EXPECT_TRUE(internal::ConstantTimeEqual("abc", "abc"));
  EXPECT_FALSE(internal::ConstantTimeEqual("abc", "abd"));
  EXPECT_FALSE(internal::ConstantTimeEqual("abc", "abcd"));
  EXPECT_FALSE(internal::ConstantTimeEqual("", "a"));
  const std::string secret = internal::NewServerSecret();
  ASSERT_EQ(secret.size(), internal::kSecretBytes);
  EXPECT_NE(secret, internal::NewServerSecret());

  const uint64_t before = internal::RefusedConnections();
  {
    auto [client, server] = Pipe(true);
    internal::SendServerHello(client, secret);
    EXPECT_TRUE(internal::CheckServerHello(server, secret, "test server", 5s));
  }
  EXPECT_EQ(internal::RefusedConnections(), before);
  std::string wrong = secret;
  wrong[31] ^= 1;
  {
    auto [client, server] = Pipe(true);
    internal::SendServerHello(client, wrong);
    EXPECT_FALSE(internal::CheckServerHello(server, secret, "test server", 5s));
  }
  {
    auto [client, server] = Pipe(true);
    client.send(std::string("run"), std::string("no hello first"));
    EXPECT_FALSE(internal::CheckServerHello(server, secret, "test server", 5s));
  }
  {
    auto [client, server] = Pipe(true);
    client.send_bytes(std::string(64 << 10, 'x'));  // an oversized "hello" is refused unread
    EXPECT_FALSE(internal::CheckServerHello(server, secret, "test server", 5s));
  }
  {
    auto [client, server] = Pipe(true);
    client.close();  // nothing at all
    EXPECT_FALSE(internal::CheckServerHello(server, secret, "test server", 5s));
  }
  {
    auto [client, server] = Pipe(true);  // silent: the timeout refuses it
    EXPECT_FALSE(internal::CheckServerHello(server, secret, "test server", 0.2s));
  }
  {
    auto [client, server] = Pipe(true);  // the right secret cannot be empty
    internal::SendServerHello(client, "");
    EXPECT_FALSE(internal::CheckServerHello(server, "", "test server", 5s));
  }
  EXPECT_EQ(internal::RefusedConnections(), before + 6);
}

// A fork server started the library's way, with secret `real`; the test then speaks to it as a
// client that presents `presented` (nullptr: no hello at all) and asks it to run TouchMarker.
// Returns the server's reply (a pid), or -1 when the server closed the connection instead.
int AskForkServer(const std::string& real, const std::string* presented,
                  const std::string& marker) {
  auto [ours, theirs] = Pipe(true);
  FileDescriptor secret_pipe = internal::SecretPipe(real);
  const pid_t server =
      internal::SpawnExecutable(internal::kServerFlag, theirs.fileno(), secret_pipe.get());
  secret_pipe.reset();
  theirs.close();
  if (presented != nullptr) internal::SendServerHello(ours, *presented);
  auto [result_parent, result_child] = Pipe(true);
  FileDescriptor lifeline = internal::LifelineReadEnd();
  int reply = -1;
  try {
    ours.SendMessage(internal::EncodeRunRequest(
        internal::EntryPointName(reinterpret_cast<const void*>(&TouchMarker)), "marker",
        Encode(marker), result_child.fileno(), lifeline.get(), {}));
    Message m = ours.RecvMessage(20s);
    reply = DecodeAs<int32_t>(m);
  } catch (const runtime::Error& e) {
    EXPECT_NE(e.code(), runtime::ErrorCode::kDeadlineExceeded) << "the server neither served "
                                                                  "nor closed: "
                                                               << e.what();
  }
  if (reply > 0) {  // served: wait for the child's exit report
    for (int i = 0; i < 200 && !FileExists(marker); ++i) std::this_thread::sleep_for(10ms);
  }
  ours.close();  // the server ends on end-of-file
  const forksafe::testing::ChildResult r = forksafe::testing::WaitChild(server, 20s);
  EXPECT_TRUE(r.exited && r.exit_code == 0) << "fork server " << r.Describe();
  return reply;
}

TEST(ServerAuthTest, ForkServerRefusesAClientWithoutItsSecret) {
  const std::string real = internal::NewServerSecret();
  std::string wrong = real;
  wrong[0] ^= 0x80;
  const std::string refused_marker = TempPath("refused");
  ::unlink(refused_marker.c_str());
  EXPECT_EQ(AskForkServer(real, &wrong, refused_marker), -1) << "a wrong secret was served";
  EXPECT_EQ(AskForkServer(real, nullptr, refused_marker), -1) << "no secret was served";
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(FileExists(refused_marker)) << "a refused request ran";

  // The same request with the real secret is served (so the test can see an effect).
  const std::string served_marker = TempPath("served");
  ::unlink(served_marker.c_str());
  EXPECT_GT(AskForkServer(real, &real, served_marker), 0);
  EXPECT_TRUE(FileExists(served_marker));
  ::unlink(served_marker.c_str());

  // And the library's own fork server still works.
  Process p(ProcessOptions{"after", false, "forkserver"}, &TouchMarker, served_marker);
  p.start();
  ASSERT_TRUE(p.join(30s));
  EXPECT_EQ(p.exitcode(), 0);
  EXPECT_TRUE(FileExists(served_marker));
  ::unlink(served_marker.c_str());
}

// A manager started with secret `real`, told by a client presenting `presented` to track
// `name`; the client then leaves. Returns after the manager exited.
void TellShmManager(const std::string& real, const std::string& presented,
                    const std::string& name) {
  auto [ours, theirs] = Pipe(true);
  FileDescriptor secret_pipe = internal::SecretPipe(real);
  const pid_t manager =
      internal::SpawnExecutable(internal::kShmManagerFlag, theirs.fileno(), secret_pipe.get());
  secret_pipe.reset();
  theirs.close();
  internal::SendServerHello(ours, presented);
  try {
    ours.send(std::string("track"), name.substr(1));
  } catch (const runtime::Error&) {
    // The manager may already have closed the connection.
  }
  ours.close();
  const forksafe::testing::ChildResult r = forksafe::testing::WaitChild(manager, 20s);
  EXPECT_TRUE(r.exited && r.exit_code == 0) << "shm manager " << r.Describe();
}

TEST(ServerAuthTest, ShmManagerRefusesAClientWithoutItsSecret) {
  // A segment of this (live) process with no references: a manager told about it by its client
  // removes it when the client leaves.
  const std::string name = SharedArena::NamePrefix() + runtime::internal::RandomHex128();
  auto make = [&] {
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 4096), 0);
    ::close(fd);
  };
  make();
  const std::string real = internal::NewServerSecret();
  std::string wrong = real;
  wrong[7] ^= 1;
  TellShmManager(real, wrong, name);
  EXPECT_TRUE(FileExists("/dev/shm" + name)) << "a refused client made the manager remove it";

  TellShmManager(real, real, name);
  EXPECT_FALSE(FileExists("/dev/shm" + name)) << "the manager with the right secret did not act";
  shm_unlink(name.c_str());

  // The library's own manager still works: a file_system segment round trip.
  auto block = SharedArena::Get().Allocate(1024, SegmentKind::kNamed, false);
  EXPECT_GT(internal::ShmManagerPid(), 0);
  EXPECT_TRUE(FileExists("/dev/shm" + NameOf(block)));
}

// ---- (d) the sweep: a creator that exited, zombie or reaped, holds nothing ----

// The shm manager's sweep takes a segment's creator for gone by the one liveness rule
// (runtime/internal/process_liveness.h): a zombie has exited, maps nothing and holds nothing, so
// its unreferenced segments are removed as a reaped creator's would be; a live creator's stay.
TEST(ShmSweepTest, AZombieCreatorsUnreferencedSegmentIsSwept) {
  const pid_t zombie = fork();
  ASSERT_GE(zombie, 0);
  if (zombie == 0) _exit(0);
  siginfo_t si{};
  ASSERT_EQ(waitid(P_PID, zombie, &si, WEXITED | WNOWAIT), 0);  // exited, not reaped: a zombie
  auto make = [](pid_t creator) {
    const std::string name =
        "/forksafe_" + std::to_string(creator) + "_" + runtime::internal::RandomHex128();
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    EXPECT_GE(fd, 0) << name;
    EXPECT_EQ(ftruncate(fd, 4096), 0);
    internal::SegmentHeader h{};
    h.magic = internal::kSegmentMagic;
    h.size = 4096;
    h.id = 1;
    h.creator = creator;
    h.pid_ns = internal::PidNamespaceId();  // live_refs 0: nothing references it
    EXPECT_EQ(pwrite(fd, &h, sizeof(h), 0), static_cast<ssize_t>(sizeof(h)));
    ::close(fd);
    return name;
  };
  const std::string of_zombie = make(zombie);
  const std::string of_live = make(getpid());
  internal::SweepOrphanedSegments();
  EXPECT_FALSE(FileExists("/dev/shm" + of_zombie)) << "a zombie creator was taken for alive";
  EXPECT_TRUE(FileExists("/dev/shm" + of_live)) << "a live creator's segment was swept";
  shm_unlink(of_zombie.c_str());
  shm_unlink(of_live.c_str());
  ASSERT_EQ(waitpid(zombie, nullptr, 0), zombie);
}

}  // namespace
}  // namespace forksafe::mp
