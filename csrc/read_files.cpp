#include "read_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fault.h"

namespace recckpt {
namespace {
constexpr size_t kMaxIo = size_t(1) << 30;
}  // namespace

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

std::string OpenFile::open_error() const {
  if (fd >= 0) return "";
  if (not_regular) return "not a regular file (a link, FIFO or device)";
  // Out of descriptors or memory says nothing of the file: callers must not call it corrupt.
  if (err == EMFILE || err == ENFILE || err == ENOMEM)
    return std::string(kNoResources) + std::to_string(err) + ": " + std::strerror(err) + ")";
  return std::string("open error: ") + std::strerror(err);
}

ReadFiles::~ReadFiles() {
  for (auto& kv : files_) {
    if (kv.second.map != nullptr) ::munmap(kv.second.map, (size_t)kv.second.size);
    if (kv.second.fd >= 0) ::close(kv.second.fd);
    if (kv.second.dfd >= 0) ::close(kv.second.dfd);
  }
}

OpenFile& ReadFiles::open(const std::string& path) {
  auto it = files_.find(path);
  if (it != files_.end()) return it->second;
  OpenFile of;
  // Only regular files, checked on the opened file (docs/SAFETY.md): a link is not followed, a
  // FIFO does not block the open, and a device (/dev/zero) is refused before any read.
  of.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (of.fd < 0) {
    of.err = errno;
  } else {
    struct stat st;
    const bool stat_ok = ::fstat(of.fd, &st) == 0;
    if (!stat_ok || !S_ISREG(st.st_mode)) {
      of.err = stat_ok ? 0 : errno;
      of.not_regular = stat_ok;
      ::close(of.fd);
      of.fd = -1;
    } else {
      of.size = (int64_t)st.st_size;
      of.dev = st.st_dev;
      of.ino = st.st_ino;
    }
  }
  return files_.emplace(path, of).first->second;
}

int ReadFiles::direct_fd(OpenFile& f, const std::string& path) {
  std::lock_guard<std::mutex> lk(mu_);
  if (f.dstate == 0) {
    f.dstate = -1;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_DIRECT);
    struct stat st;
    if (fd >= 0 && ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_dev == f.dev && st.st_ino == f.ino) {
      f.dfd = fd;
      f.dstate = 1;
    } else if (fd >= 0) {
      ::close(fd);
    }
  }
  return f.dstate == 1 ? f.dfd : -1;
}

void ReadFiles::refuse_direct(OpenFile& f) {
  std::lock_guard<std::mutex> lk(mu_);
  f.dstate = -1;  // the descriptor stays open until the table ends: other threads may hold it
}

bool ReadFiles::cached(OpenFile& f, int64_t off, int64_t n) {
  if (!probe_ok_.load(std::memory_order_relaxed)) return true;
  const int64_t a = off / kAlign * kAlign;
  const int64_t pages = (off + n - a + kAlign - 1) / kAlign;
  const int64_t have = cached_pages(f, a, off + n - a);
  if (have < 0) {
    probe_ok_.store(false, std::memory_order_relaxed);
    return true;
  }
  return 2 * have >= pages;
}

int64_t ReadFiles::cached_pages(OpenFile& f, int64_t off, int64_t n) {
#ifdef __NR_cachestat
  static constexpr long kCachestat = __NR_cachestat;
#elif defined(__x86_64__) || defined(__aarch64__)
  static constexpr long kCachestat = 451;  // the same number on every architecture since Linux 6.5
#else
  static constexpr long kCachestat = -1;
#endif
  if (kCachestat > 0 && cachestat_ok_.load(std::memory_order_relaxed)) {
    struct { uint64_t off, len; } range{(uint64_t)off, (uint64_t)n};
    struct { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; } cs{};
    if (fault::check(fault::kCachestat) == 0 && ::syscall(kCachestat, f.fd, &range, &cs, 0) == 0)
      return (int64_t)cs.nr_cache;
    cachestat_ok_.store(false, std::memory_order_relaxed);  // ENOSYS, or a file system without it
  }
  const uint8_t* base = probe_map(f);
  if (base == nullptr) return -1;
  const int64_t a = off / kAlign * kAlign, pages = (off + n - a + kAlign - 1) / kAlign;
  std::vector<unsigned char> vec((size_t)pages);
  if (::mincore((void*)(base + a), (size_t)(off + n - a), vec.data()) != 0) return -1;
  int64_t have = 0;
  for (unsigned char v : vec) have += v & 1;
  return have;
}

// A read-only shared mapping of the whole file, for mincore only (never read through: a page of it is
// never touched), made once per file; nullptr when it cannot be made.
const uint8_t* ReadFiles::probe_map(OpenFile& f) {
  std::lock_guard<std::mutex> lk(mu_);
  if (f.map == nullptr && !f.map_failed) {
    void* m = f.size > 0 ? ::mmap(nullptr, (size_t)f.size, PROT_READ, MAP_SHARED, f.fd, 0) : MAP_FAILED;
    if (m == MAP_FAILED) f.map_failed = true;
    else f.map = (uint8_t*)m;
  }
  return f.map;
}

int64_t pread_all(int fd, uint8_t* p, int64_t n, int64_t off) {
  int64_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, p + got, (size_t)std::min<int64_t>(n - got, (int64_t)kMaxIo), (off_t)(off + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    got += r;
  }
  return got;
}

int64_t pread_direct(int fd, uint8_t* p, int64_t n, int64_t off) {
  if (const int injected = fault::check(fault::kDirect)) return -injected;
  int64_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, p + got, (size_t)std::min<int64_t>(n - got, (int64_t)kMaxIo), (off_t)(off + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    got += r;
    if (r == 0 || r % kAlign != 0) break;  // the end of the file
  }
  return got;
}

AlignedBuffer::~AlignedBuffer() { std::free(p_); }

uint8_t* AlignedBuffer::get(int64_t bytes) {
  if (p_ != nullptr && size_ >= bytes) return p_;
  std::free(p_);
  p_ = nullptr;
  size_ = 0;
  if (::posix_memalign((void**)&p_, (size_t)kAlign, (size_t)bytes) != 0) {
    p_ = nullptr;
    return nullptr;
  }
  size_ = bytes;
  return p_;
}

}  // namespace recckpt
