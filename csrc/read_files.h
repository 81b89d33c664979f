// The files a verified read opens (read_ranges, read_strided; see docs/ENGINE.md): each path once and only
// if it is a regular file (docs/SAFETY.md), its O_DIRECT twin when a read wants it, and whether a range of
// it is in the page cache. One home for what both readers do with files, and for their direct reads.
#pragma once
#include <sys/types.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace recckpt {

// Direct reads (O_DIRECT): offsets, lengths and buffers aligned to kAlign (a multiple of every common
// logical block size); through a bounce buffer at most kDirectBlock bytes a read.
constexpr int64_t kAlign = 4096;
constexpr int64_t kDirectBlock = 8 << 20;

std::string hex32(uint32_t v);

// How open_error begins when the process ran out of descriptors or memory (then "<errno>: <text>)"):
// recckpt.format.sparse_io raises a StorageError for it, not a corrupt-checkpoint error.
constexpr const char* kNoResources = "cannot be opened for lack of resources (errno ";

struct OpenFile {
  int fd = -1;
  int err = 0;
  bool not_regular = false;
  int64_t size = 0;
  int dfd = -1;      // the same file opened with O_DIRECT, once a read wants it
  int dstate = 0;    // 0: not tried, 1: dfd usable, -1: no direct reads of this file (guarded by the table's lock)
  dev_t dev = 0;
  ino_t ino = 0;
  uint8_t* map = nullptr;   // for mincore (cached_pages), where cachestat is missing
  bool map_failed = false;

  // Why the file cannot be read ("" when it can), as read errors say it.
  std::string open_error() const;
};

class ReadFiles {
 public:
  ReadFiles() = default;
  ~ReadFiles();
  ReadFiles(const ReadFiles&) = delete;
  ReadFiles& operator=(const ReadFiles&) = delete;

  // The file at `path`, opened the first time it is asked for with O_NOFOLLOW | O_NONBLOCK and refused
  // unless the opened file is regular (a link is not followed, a FIFO does not block, a device is never
  // read): see OpenFile::open_error. Not thread-safe: the readers open their files before their threads start.
  OpenFile& open(const std::string& path);

  // The O_DIRECT descriptor of `f` (opened once, checked to be the same file), or -1.
  int direct_fd(OpenFile& f, const std::string& path);
  // The file system refused a direct read of `f`: read it through the page cache from now on.
  void refuse_direct(OpenFile& f);

  // Whether at least half of the pages of [off, off + n) of `f` are in the page cache, asked without
  // touching the device: the cachestat system call (Linux 6.5) counts them; older kernels answer with
  // mincore on a mapping of the file (never read through). Probing with a read would not do: even
  // preadv2(RWF_NOWAIT) starts the kernel's read-ahead of a page it does not find. Where neither works,
  // every range counts as cached (read through the page cache).
  bool cached(OpenFile& f, int64_t off, int64_t n);

 private:
  int64_t cached_pages(OpenFile& f, int64_t off, int64_t n);
  const uint8_t* probe_map(OpenFile& f);

  std::map<std::string, OpenFile> files_;
  std::mutex mu_;  // OpenFile::dfd / dstate / map
  std::atomic<bool> probe_ok_{true};      // false once the page cache could not be asked: no probes
  std::atomic<bool> cachestat_ok_{true};  // false once cachestat failed: mincore instead
};

// Reads n bytes at off into p; returns the bytes read (short only at the end of the file) or -errno.
int64_t pread_all(int fd, uint8_t* p, int64_t n, int64_t off);
// The same with O_DIRECT (n a multiple of kAlign, or fewer at the end of the file).
int64_t pread_direct(int fd, uint8_t* p, int64_t n, int64_t off);
// Whether a direct read failed because the file system refuses O_DIRECT (read through the cache instead).
inline bool direct_refused(int64_t err) { return err == -EINVAL || err == -EOPNOTSUPP || err == -ENOTSUP; }

// A thread's kAlign-aligned buffer of at least the bytes asked for, reused and grown (free on destruction).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  // nullptr when the memory cannot be had (the caller reads through the page cache).
  uint8_t* get(int64_t bytes = kDirectBlock + 2 * kAlign);

 private:
  uint8_t* p_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace recckpt
