// Ways to get a file's bytes into fresh memory of this process, timed in wall and CPU seconds (issue 28,
// benchmarks/README.md "What was tried" 10-12). Not part of the engine: a standalone program, so that
// each way runs alone in a fresh process with nothing else in its address space.
//
//   g++ -O2 -msse4.2 -pthread benchmarks/bench_read_paths.cpp -o /tmp/bench_read_paths
//   /tmp/bench_read_paths FILE MODE THREADS [CRC=1]        (COLD=1 drops the file's cached pages first)
//
// Each of THREADS threads takes 8 MiB pieces in order (as the engine's read_ranges does) and, with CRC,
// checks each 256 KiB of the destination with the SSE4.2 instruction (one stream: slower than the
// engine's three interleaved ones, so CRC shares here are upper bounds). Modes:
//   fill        memset of fresh memory: the fresh-memory floor (compare.py's)
//   popw        madvise(MADV_POPULATE_WRITE) of fresh memory: page faults and zeroing only
//   pread       pread into fresh memory (the engine's copying load)
//   preadra     pread with POSIX_FADV_WILLNEED 64 MiB ahead (the engine's read-ahead)
//   popwpread   populate the piece first (parallel first touch), then pread into it
//   smallpread  pread in SB-byte pieces (env SB, default 256 KiB), each checked while in cache
//   mapcopy     memcpy out of a shared read-only mapping of the file (what safetensors/torch mmap do)
//   privpop     MAP_PRIVATE mapping of the file populated for writing: each page copied from the page
//               cache into a private page by the kernel, no zeroing; truncation is an error, not SIGBUS
//   vmread      process_vm_readv out of a shared mapping of the file (a kernel copy that reports
//               a truncated file as a short count instead of SIGBUS)
//   direct      O_DIRECT pread (needs page-aligned sizes: the file's size must be a multiple of 4096)
//   popwdirect  populate the piece first, then O_DIRECT pread into it
//   bounce      O_DIRECT pread into a reused aligned 8 MiB buffer per thread, checked there, then memcpy
//               into the (populated) destination: for destinations that are not block-aligned
//   popwbounce  the same with the destination populated first (madvise) before the copy
//   dsttouched  (env) every mode: the destination is faulted in before the clock starts, as a live
//               table's storage is (a TorchRec kernel's weights); set DSTTOUCHED=1
#include <fcntl.h>
#include <nmmintrin.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace {
constexpr size_t kPiece = 8 << 20, kCrcBlock = 256 << 10, kAhead = 64 << 20;

double cpu_seconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

uint32_t crc32c(const uint8_t* p, size_t n) {
  uint64_t x = ~0u;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    x = _mm_crc32_u64(x, v);
  }
  for (; i < n; i++) x = _mm_crc32_u8((uint32_t)x, p[i]);
  return ~(uint32_t)x;
}

uint32_t check(const uint8_t* p, size_t n, bool on) {
  uint32_t c = 0;
  for (size_t s = 0; on && s < n; s += kCrcBlock) c ^= crc32c(p + s, std::min(kCrcBlock, n - s));
  return c;
}

void pread_exact(int fd, uint8_t* p, size_t n, size_t off) {
  for (size_t got = 0; got < n;) {
    ssize_t r = ::pread(fd, p + got, n - got, (off_t)(off + got));
    if (r <= 0) { std::perror("pread"); std::exit(1); }
    got += (size_t)r;
  }
}

void must(int rc, const char* what) {
  if (rc != 0) { std::perror(what); std::exit(1); }
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) { std::fprintf(stderr, "usage: %s FILE MODE THREADS [CRC]\n", argv[0]); return 2; }
  const std::string mode = argv[2];
  const int threads = std::atoi(argv[3]);
  const bool crc = argc > 4 && std::atoi(argv[4]);
  const int fd = ::open(argv[1], O_RDONLY);
  struct stat st;
  if (fd < 0 || ::fstat(fd, &st) != 0) { std::perror(argv[1]); return 1; }
  const size_t n = (size_t)st.st_size;
  if (std::getenv("COLD")) ::posix_fadvise(fd, 0, (off_t)n, POSIX_FADV_DONTNEED);
  const bool uses_direct = mode == "direct" || mode == "popwdirect" || mode == "bounce" || mode == "popwbounce";
  const int dfd = uses_direct ? ::open(argv[1], O_RDONLY | O_DIRECT) : -1;
  const bool touched = std::getenv("DSTTOUCHED") != nullptr;
  const size_t small = std::getenv("SB") ? (size_t)std::atol(std::getenv("SB")) : kCrcBlock;

  uint8_t* pre = nullptr;
  if (touched) {
    pre = (uint8_t*)::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    std::memset(pre, 0, n);
  }
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = cpu_seconds();
  auto* dst = touched ? pre : (uint8_t*)::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  const uint8_t* src = nullptr;
  if (mode == "privpop")
    dst = (uint8_t*)::mmap(dst, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0);
  if (mode == "mapcopy" || mode == "vmread") src = (const uint8_t*)::mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
  if (dst == MAP_FAILED || src == MAP_FAILED) { std::perror("mmap"); return 1; }

  std::atomic<size_t> next{0};
  std::atomic<uint32_t> sink{0};
  auto work = [&] {
    uint32_t c = 0;
    uint8_t* bounce = nullptr;
    if (mode == "bounce" || mode == "popwbounce")
      bounce = (uint8_t*)::mmap(nullptr, kPiece, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    for (;;) {
      const size_t off = next.fetch_add(1) * kPiece;
      if (off >= n) break;
      const size_t len = std::min(kPiece, n - off);
      uint8_t* d = dst + off;
      if (mode == "fill") {
        std::memset(d, 1, len);
      } else if (mode == "popw") {
        must(::madvise(d, len, MADV_POPULATE_WRITE), "madvise");
      } else if (mode == "pread" || mode == "preadra" || mode == "popwpread") {
        if (mode == "preadra" && off + kAhead < n)
          ::posix_fadvise(fd, (off_t)(off + kAhead), (off_t)std::min(kPiece, n - off - kAhead), POSIX_FADV_WILLNEED);
        if (mode == "popwpread") must(::madvise(d, len, MADV_POPULATE_WRITE), "madvise");
        pread_exact(fd, d, len, off);
        c ^= check(d, len, crc);
      } else if (mode == "smallpread") {
        for (size_t s = 0; s < len; s += small) {
          const size_t l = std::min(small, len - s);
          pread_exact(fd, d + s, l, off + s);
          c ^= check(d + s, l, crc);
        }
      } else if (mode == "mapcopy") {
        for (size_t s = 0; s < len; s += kCrcBlock) {
          const size_t l = std::min(kCrcBlock, len - s);
          std::memcpy(d + s, src + off + s, l);
          c ^= check(d + s, l, crc);
        }
      } else if (mode == "privpop") {
        must(::madvise(d, len, MADV_POPULATE_WRITE), "madvise");
        c ^= check(d, len, crc);
      } else if (mode == "vmread") {
        iovec to{d, len}, from{(void*)(src + off), len};
        if (::process_vm_readv(::getpid(), &to, 1, &from, 1, 0) != (ssize_t)len) { std::perror("process_vm_readv"); std::exit(1); }
        c ^= check(d, len, crc);
      } else if (mode == "direct" || mode == "popwdirect") {
        if (mode == "popwdirect") must(::madvise(d, len, MADV_POPULATE_WRITE), "madvise");
        pread_exact(dfd, d, len, off);
        c ^= check(d, len, crc);
      } else if (mode == "bounce" || mode == "popwbounce") {
        if (mode == "popwbounce") must(::madvise(d, len, MADV_POPULATE_WRITE), "madvise");
        pread_exact(dfd, bounce, len, off);
        for (size_t s = 0; s < len; s += kCrcBlock) {   // checked and copied block by block, while in cache
          const size_t l = std::min(kCrcBlock, len - s);
          c ^= check(bounce + s, l, crc);
          std::memcpy(d + s, bounce + s, l);
        }
      } else {
        std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
        std::exit(2);
      }
    }
    sink ^= c;
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; i++) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%-10s threads %d crc %d  wall %.3f s  cpu %.3f s  (%u)\n", mode.c_str(), threads, (int)crc, dt,
              cpu_seconds() - c0, (unsigned)sink.load() & 1u);
  return 0;
}
