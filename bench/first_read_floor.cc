// bench/first_read_floor.cc: what a process pays the first time it reads shared memory that
// another process wrote, with no forksafe code at all, and how the way the writer reserved the
// memory and the way the reader maps it change that (docs/peers.md, "Workload 3's tail").
//
//   bazel run -c opt //bench:first_read_floor            # 500 x 1 MiB, as workload 3
//   bazel run -c opt //bench:first_read_floor -- 125     # fewer tensors
//
// For each way of reserving a memfd (fallocate, as forksafe's arena did until 2026-11-28, or
// MADV_POPULATE_READ through the writer's mapping, as it does now), the writer fills N tensors of
// 1 MiB (a Pool's inputs), then forks two readers (a Pool(2)'s workers) that each sum every tensor
// twice: a first read, then a read again. Readers map the memfd:
//   read-only             a fresh PROT_READ mapping;
//   read-write            a fresh PROT_READ | PROT_WRITE mapping (a receiver of a shared tensor,
//                         which may write into it);
//   inherited             the writer's own mapping, which fork gave them (forked Pool workers);
//   read-write + populate-write / populate-read
//                         a fresh read-write mapping whose page tables are built first with
//                         MADV_POPULATE_WRITE / MADV_POPULATE_READ (time included).
// On a machine where a page fault is cheap all rows look alike; on a VM that pages the guest's
// page tables, first reads cost several times more than later ones, and up to 7x more again for
// the combinations that writable mappings meet (the figures are in docs/peers.md).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace {

constexpr size_t kTensorBytes = size_t{1} << 20;

enum class Reserve { kFallocate, kPopulateRead };
enum class Reader { kReadOnly, kReadWrite, kInherited, kPopulateWrite, kPopulateRead };

const char* Name(Reserve r) { return r == Reserve::kFallocate ? "fallocate" : "populate-read"; }
const char* Name(Reader r) {
  switch (r) {
    case Reader::kReadOnly: return "read-only";
    case Reader::kReadWrite: return "read-write";
    case Reader::kInherited: return "inherited";
    case Reader::kPopulateWrite: return "read-write + populate-write";
    case Reader::kPopulateRead: return "read-write + populate-read";
  }
  return "?";
}

double Sum(const float* p, size_t n) {
  float a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i + 3 < n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  return static_cast<double>(a) + b + c + d;
}

double Ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// One reader: sums every tensor twice and writes "first again" (ms) to `out`. Exits 0 when
// every sum was right.
int Read(int fd, float* inherited, int tensors, Reader how, int out) {
  const size_t bytes = kTensorBytes * tensors;
  const auto t0 = std::chrono::steady_clock::now();
  void* m = inherited;
  if (how != Reader::kInherited) {
    const int prot = how == Reader::kReadOnly ? PROT_READ : PROT_READ | PROT_WRITE;
    m = mmap(nullptr, bytes, prot, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return 2;
    if (how == Reader::kPopulateWrite && madvise(m, bytes, MADV_POPULATE_WRITE) != 0) return 3;
    if (how == Reader::kPopulateRead && madvise(m, bytes, MADV_POPULATE_READ) != 0) return 3;
  }
  const auto* base = static_cast<const float*>(m);
  const size_t floats = kTensorBytes / sizeof(float);
  double ms[2];
  for (int pass = 0; pass < 2; ++pass) {
    const auto p0 = pass == 0 ? t0 : std::chrono::steady_clock::now();
    for (int k = 0; k < tensors; ++k) {
      if (Sum(base + floats * k, floats) != static_cast<double>(floats) * (k % 7)) return 4;
    }
    ms[pass] = Ms(p0);
  }
  return write(out, ms, sizeof ms) == sizeof ms ? 0 : 5;
}

// Returns false when something failed (said on stderr).
bool Row(int tensors, Reserve reserve, Reader reader) {
  const size_t bytes = kTensorBytes * tensors;
  const int fd = memfd_create("first_read_floor", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    perror("memfd");
    return false;
  }
  if (reserve == Reserve::kFallocate && posix_fallocate(fd, 0, static_cast<off_t>(bytes)) != 0) {
    perror("fallocate");
    return false;
  }
  auto* m = static_cast<float*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  if (m == MAP_FAILED) {
    perror("mmap");
    return false;
  }
  if (reserve == Reserve::kPopulateRead && madvise(m, bytes, MADV_POPULATE_READ) != 0) {
    perror("madvise(MADV_POPULATE_READ): this kernel may be older than 5.14");
    return false;
  }
  const size_t floats = kTensorBytes / sizeof(float);
  for (int k = 0; k < tensors; ++k) {
    for (size_t i = 0; i < floats; ++i) m[floats * k + i] = static_cast<float>(k % 7);
  }
  int fds[2];
  if (pipe(fds) != 0) return false;
  fflush(stdout);
  pid_t pids[2];
  for (pid_t& pid : pids) {
    pid = fork();
    if (pid == 0) _exit(Read(fd, m, tensors, reader, fds[1]));
  }
  close(fds[1]);
  bool ok = true;
  double first[2] = {0, 0}, again[2] = {0, 0};
  for (int r = 0; r < 2; ++r) {
    double ms[2];
    if (read(fds[0], ms, sizeof ms) == sizeof ms) {
      first[r] = ms[0];
      again[r] = ms[1];
    }
  }
  for (pid_t pid : pids) {
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0) {
      fprintf(stderr, "a reader failed (status %d)\n", status);
      ok = false;
    }
  }
  close(fds[0]);
  munmap(m, bytes);
  close(fd);
  printf("| %-13s | %-27s | %7.0f, %7.0f | %5.1f, %5.1f |\n", Name(reserve), Name(reader), first[0],
         first[1], again[0], again[1]);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const int tensors = argc > 1 ? atoi(argv[1]) : 500;
  if (tensors < 1 || tensors > 4096 || argc > 2) {
    fprintf(stderr, "usage: first_read_floor [tensors of 1 MiB: 1..4096, default 500]\n");
    return 2;
  }
  printf("%d tensors of 1 MiB in a memfd; two forked readers at once, each summing all of them\n",
         tensors);
  printf(
      "| writer's reservation | reader's mapping | first read, ms (each reader) | read again, ms "
      "|\n");
  printf("|---|---|---:|---:|\n");
  bool ok = true;
  for (Reserve reserve : {Reserve::kFallocate, Reserve::kPopulateRead}) {
    for (Reader reader : {Reader::kReadOnly, Reader::kReadWrite, Reader::kInherited,
                          Reader::kPopulateWrite, Reader::kPopulateRead}) {
      ok = Row(tensors, reserve, reader) && ok;
    }
  }
  return ok ? 0 : 1;
}
