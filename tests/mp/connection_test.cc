// Pipe/Connection and the codec: framing, values, bytes, descriptors, timeouts, closed peers,
// size limits, malformed input.
#include "forksafe/mp/connection.h"

#include <fcntl.h>
#include <unistd.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/runtime/error.h"
#include "gtest/gtest.h"
#include "tests/support/child_process.h"

namespace forksafe::mp {
namespace {

using forksafe::testing::RunInChild;
using runtime::Error;
using runtime::ErrorCode;
using namespace std::chrono_literals;

struct Sample {
  int a = 0;
  std::string b;
  std::vector<double> c;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(a, b, c);
  }
  bool operator==(const Sample& o) const { return a == o.a && b == o.b && c == o.c; }
};

int OpenFdCount() {
  int n = 0;
  for (int fd = 0; fd < 1024; ++fd) n += fcntl(fd, F_GETFD) != -1;
  return n;
}

TEST(CodecTest, RoundTripsValues) {
  Sample s{7, "seven", {1.5, 2.5}};
  std::map<std::string, int> m{{"x", 1}, {"y", 2}};
  Message msg = Encode(s, m, std::string("tail"), 3.25);
  Sample s2;
  std::map<std::string, int> m2;
  std::string t;
  double d = 0;
  Decode(msg, s2, m2, t, d);
  EXPECT_EQ(s2, s);
  EXPECT_EQ(m2, m);
  EXPECT_EQ(t, "tail");
  EXPECT_EQ(d, 3.25);
}

TEST(CodecTest, MalformedInputIsAClearErrorNotACrash) {
  Message msg = Encode(std::string("hello"), 42);
  Message truncated;
  truncated.bytes = msg.bytes.substr(0, 5);
  std::string s;
  int i;
  try {
    Decode(truncated, s, i);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("malformed message"), std::string::npos);
  }
  Message huge;
  huge.bytes = std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8);  // string length 2^63
  EXPECT_THROW(Decode(huge, s), Error);
  Message extra = Encode(1, 2);
  int one;
  EXPECT_THROW(Decode(extra, one), Error);  // trailing bytes
  Message bad_fd = Encode(int32_t{5});      // a descriptor index with no descriptor
  FileDescriptor fd;
  EXPECT_THROW(Decode(bad_fd, fd), Error);
}

TEST(ConnectionTest, SendsValuesBytesAndDescriptorsBetweenProcesses) {
  auto [a, b] = Pipe();
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  FileDescriptor rd(p[0]), wr(p[1]);
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(30);
    Connection c = b;
    Sample s = c.recv<Sample>();
    c.send(s.a + 1, s.b + "!");
    std::string raw = c.recv_bytes();
    c.send_bytes(raw + raw);
    wr.reset();  // the child must hold no copy of the pipe's write end but the one it receives
    FileDescriptor got = c.recv<FileDescriptor>();
    const char msg[] = "through the passed fd";
    _exit(write(got.get(), msg, sizeof(msg)) == sizeof(msg) ? 0 : 1);
  }
  a.send(Sample{41, "v", {}});
  ASSERT_TRUE(a.poll(10s));
  Message m = a.RecvMessage(std::nullopt);
  int x;
  std::string y;
  Decode(m, x, y);
  EXPECT_EQ(x, 42);
  EXPECT_EQ(y, "v!");
  a.send_bytes(std::string("ab\0cd", 5));
  EXPECT_EQ(a.recv_bytes(), std::string("ab\0cdab\0cd", 10));
  a.send(wr);
  char buf[64] = {};
  ASSERT_GT(read(rd.get(), buf, sizeof(buf)), 0);
  EXPECT_STREQ(buf, "through the passed fd");
  auto child = forksafe::testing::WaitChild(pid, 30s);
  EXPECT_TRUE(child.ok()) << child.Describe();
}

TEST(ConnectionTest, LargeMessagesAreFramedWhole) {
  auto [a, b] = Pipe();
  std::string big(8 << 20, 'x');
  big[12345] = 'y';
  std::thread t([&, b = b]() mutable {
    b.send_bytes(big);
    b.send_bytes("small");
  });
  EXPECT_EQ(a.recv_bytes(), big);
  EXPECT_EQ(a.recv_bytes(), "small");
  t.join();
}

TEST(ConnectionTest, PollTimeoutsAndClosedPeers) {
  auto [a, b] = Pipe();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(a.poll(0.05));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 40ms);
  try {
    a.RecvMessage(0.01);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDeadlineExceeded);
  }
  EXPECT_THROW(a.poll(-1.0), Error);
  b.close();
  EXPECT_TRUE(a.poll(1.0)) << "end-of-stream is readable";
  try {
    a.recv_bytes();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kClosed);
    EXPECT_NE(std::string(e.what()).find("other end"), std::string::npos);
  }
  try {
    a.send(1);  // peer gone: EPIPE, not SIGPIPE
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kClosed);
  }
  a.close();
  a.close();  // idempotent
  try {
    a.send(1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kClosed);
    EXPECT_NE(std::string(e.what()).find("closed"), std::string::npos);
  }
}

TEST(ConnectionTest, PeerDyingMidMessageIsReported) {
  auto [a, b] = Pipe();
  auto child = RunInChild(
      [&, b = b] {
        // A frame header announcing 1000 bytes, then only 10, then exit.
        struct {
          uint32_t magic, nfds;
          uint64_t length;
        } h{0x464D5350, 0, 1000};
        if (write(b.fileno(), &h, sizeof(h)) != sizeof(h)) return 1;
        if (write(b.fileno(), "0123456789", 10) != 10) return 2;
        return 0;
      },
      10s);
  ASSERT_TRUE(child.ok());
  b.close();
  try {
    a.recv_bytes();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kClosed);
    EXPECT_NE(std::string(e.what()).find("10 of 1000"), std::string::npos) << e.what();
  }
}

TEST(ConnectionTest, SizeLimitsAndDirections) {
  auto [a, b] = Pipe();
  a.set_max_message_bytes(100);
  try {
    a.send_bytes(std::string(101, 'x'));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("set_max_message_bytes"), std::string::npos);
  }
  b.send_bytes(std::string(200, 'y'));
  try {
    a.recv_bytes();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kResourceExhausted);
  }
  EXPECT_TRUE(a.closed()) << "a stream with an oversized message cannot be trusted further";
  auto [r, w] = Pipe(false);
  EXPECT_TRUE(r.readable());
  EXPECT_FALSE(r.writable());
  EXPECT_THROW(r.send(1), Error);
  EXPECT_THROW(w.recv_bytes(), Error);
  w.send(5);
  EXPECT_EQ(r.recv<int>(), 5);
}

TEST(ConnectionTest, NoDescriptorLeaks) {
  const int before = OpenFdCount();
  for (int i = 0; i < 200; ++i) {
    auto [a, b] = Pipe();
    int p[2];
    ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
    FileDescriptor r(p[0]), w(p[1]);
    a.send(r, w);  // dup'ed into the message, received as new descriptors
    Message m = b.RecvMessage(1.0);
    EXPECT_EQ(m.fds.size(), 2u);
  }
  EXPECT_EQ(OpenFdCount(), before);
}

}  // namespace
}  // namespace forksafe::mp
