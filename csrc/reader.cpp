#include "reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

#include "crc32c.h"
#include "fault.h"
#include "read_files.h"
#include "workers.h"

namespace recckpt {
namespace {

constexpr int64_t kPieceBytes = 8 << 20;  // a worker takes about this many bytes of chunks at a time

// Direct reads (read_files.h): through the bounce buffer at most kDirectBlock bytes a read, checked and
// copied in kCheckBlock steps while they are in the CPU's cache. kDirectThreads: reads in flight on a cold
// load (each thread waits on the device, using little CPU).
constexpr int64_t kCheckBlock = 256 << 10;
constexpr int kDirectThreads = 4;
// Pieces smaller than this (a model of many small tables has thousands) skip the per-piece system calls
// that pay off only on large ones: the page-cache probe for a direct read and the destination prefault.
// Each costs a few microseconds; four per piece were most of a 1000-table verify's read time.
constexpr int64_t kSmallPieceBytes = 256 << 10;

struct Piece {
  int64_t req;
  int64_t j0, j1;  // chunk range [j0, j1)
  int64_t begin;   // bytes of all pieces before this one (read-ahead bookkeeping)
};

// Pages [a, b) of a request's destination that map its file (a == b: the request is copied).
struct MappedSpan {
  uint8_t* a = nullptr;
  uint8_t* b = nullptr;
};

uint8_t* page_down(const uint8_t* p) {
  const uintptr_t P = (uintptr_t)MappedRegion::page_size();
  return (uint8_t*)((uintptr_t)p / P * P);
}
uint8_t* page_up(const uint8_t* p) { return page_down(p + MappedRegion::page_size() - 1); }

class Reader {
 public:
  Reader(const std::vector<ReadRequest>& reqs, MappedRegion* region, int direct)
      : reqs_(reqs), region_(region), direct_(direct), fds_(reqs.size(), -1), file_of_(reqs.size(), nullptr),
        mapped_(reqs.size()), err_chunk_(reqs.size()), err_msg_(reqs.size()) {
    for (auto& c : err_chunk_) c = std::numeric_limits<int64_t>::max();
  }
  ReadResult run(int threads, int64_t readahead_bytes) {
    std::vector<char> ok(reqs_.size(), 0);
    for (size_t i = 0; i < reqs_.size(); i++) ok[i] = validate(i);
    for (size_t i = 0; i < reqs_.size(); i++)
      if (ok[i] && (!region_ || map_request(i))) plan(i);
    readahead_ = std::max<int64_t>(0, readahead_bytes);
    // A cold start (the first piece is not in the page cache) reads directly: hints would only fill the
    // cache that the direct reads go past, and a few more threads keep the device's queue full.
    bool direct_start = direct_ == kDirectAlways;
    if (direct_ == kDirectAuto && !pieces_.empty() && !piece_cached(pieces_[0])) direct_start = true;
    if (direct_start) readahead_ = 0;
    advise_up_to(0);
    const int want_threads = direct_start ? std::max(threads, kDirectThreads) : threads;
    const int64_t nthreads = std::min<int64_t>(std::max(want_threads, 1), (int64_t)pieces_.size());
    run_workers(nthreads, [this] { work(); });
    ReadResult r;
    r.bytes_read = bytes_read_.load();
    if (region_) region_->bytes_mapped.fetch_add(bytes_mapped_);
    for (size_t i = 0; i < reqs_.size(); i++)
      if (!err_msg_[i].empty()) r.errors.emplace_back((int64_t)i, err_msg_[i]);
    return r;
  }

 private:
  void report(size_t i, int64_t chunk, std::string msg) {
    std::lock_guard<std::mutex> lk(mu_);
    if (chunk < err_chunk_[i] || err_msg_[i].empty()) {
      err_chunk_[i] = chunk;
      err_msg_[i] = std::move(msg);
    }
  }

  bool validate(size_t i) {
    const ReadRequest& r = reqs_[i];
    if (!r.invalid.empty()) return report(i, -1, r.invalid), false;
    if (r.chunk_bytes <= 0)
      return report(i, -1, "invalid request: chunk_bytes must be > 0, got " + std::to_string(r.chunk_bytes)), false;
    if (r.col_offset < 0 || r.col_length < 0)
      return report(i, -1, "invalid request: col_offset and col_length must be >= 0, got " +
                               std::to_string(r.col_offset) + " and " + std::to_string(r.col_length)),
             false;
    if (r.pad_before < 0 || r.pad_before > r.col_offset)
      return report(i, -1, "invalid request: pad_before must be in [0, col_offset], got " +
                               std::to_string(r.pad_before)), false;
    if (r.col_length > std::numeric_limits<int64_t>::max() - r.col_offset)
      return report(i, -1, "invalid request: col_offset + col_length overflows"), false;
    if (!(0 <= r.lo && r.lo <= r.hi && r.hi <= r.col_length))
      return report(i, -1, "invalid request: need 0 <= lo <= hi <= col_length, got lo=" +
                               std::to_string(r.lo) + " hi=" + std::to_string(r.hi) +
                               " col_length=" + std::to_string(r.col_length)),
             false;
    const int64_t k = r.col_length / r.chunk_bytes + (r.col_length % r.chunk_bytes != 0);
    if ((int64_t)r.crcs.size() != k)
      return report(i, -1, "invalid request: crcs has " + std::to_string(r.crcs.size()) +
                               " entries, expected ceil(col_length / chunk_bytes) = " + std::to_string(k)),
             false;
    if (r.dst_len != r.hi - r.lo)
      return report(i, -1, "invalid request: dst has " + std::to_string(r.dst_len) +
                               " bytes, expected hi - lo = " + std::to_string(r.hi - r.lo)),
             false;
    OpenFile& f = files_.open(r.path);
    file_of_[i] = &f;
    if (f.fd < 0) return report(i, -1, f.open_error()), false;
    if (f.size < r.col_offset + r.col_length)
      return report(i, -1, "file too small: " + std::to_string(f.size) +
                               " bytes, the column needs col_offset + col_length = " +
                               std::to_string(r.col_offset + r.col_length)),
             false;
    fds_[i] = f.fd;
    return true;
  }

  void plan(size_t i) {
    const ReadRequest& r = reqs_[i];
    if (r.lo == r.hi) return;
    const int64_t cb = r.chunk_bytes;
    const int64_t j0 = r.lo / cb, j1 = (r.hi - 1) / cb + 1;
    const int64_t per = std::max<int64_t>(1, kPieceBytes / cb);
    for (int64_t j = j0; j < j1; j += per) {
      const int64_t e = std::min(j1, j + per);
      pieces_.push_back({(int64_t)i, j, e, planned_bytes_});
      planned_bytes_ += piece_bytes(i, j, e);
    }
  }

  int64_t piece_bytes(size_t i, int64_t j0, int64_t j1) const {
    const ReadRequest& r = reqs_[i];
    return std::min(j1 * r.chunk_bytes, r.col_length) - j0 * r.chunk_bytes;
  }

  // Read-ahead: the workers read pieces in order with synchronous preads, which keeps only one
  // request per thread in flight at the device; a cold load then waits on the disk's latency
  // instead of its bandwidth. Before piece k is read, every piece that starts within
  // `readahead_` bytes after it is handed to the kernel (POSIX_FADV_WILLNEED starts the reads
  // without waiting for them). On pages already cached this is a cheap no-op; a failure of the
  // hint is ignored because the pread that follows reports any real error.
  void advise_up_to(size_t k) {
    if (readahead_ <= 0 || pieces_.empty()) return;
    const int64_t limit = pieces_[k].begin + readahead_;
    // A thread already advising moves the window on; waiting for it would only delay this read.
    std::unique_lock<std::mutex> lk(ahead_mu_, std::try_to_lock);
    if (!lk.owns_lock()) return;
    // Pieces next to each other in one file (many small tables' columns) are announced in one call.
    int fd = -1;
    int64_t a = 0, b = 0;   // the file range to announce
    while (ahead_ < pieces_.size()) {
      const Piece& p = pieces_[ahead_];
      if (p.begin >= limit) break;
      const ReadRequest& r = reqs_[(size_t)p.req];
      const int64_t s = r.col_offset + p.j0 * r.chunk_bytes, e = s + piece_bytes((size_t)p.req, p.j0, p.j1);
      if (fd != fds_[(size_t)p.req] || s > b + kAlign || s < a) {
        if (fd >= 0) ::posix_fadvise(fd, (off_t)a, (off_t)(b - a), POSIX_FADV_WILLNEED);
        fd = fds_[(size_t)p.req];
        a = s;
        b = e;
      } else {
        b = std::max(b, e);
      }
      ahead_++;
    }
    if (fd >= 0) ::posix_fadvise(fd, (off_t)a, (off_t)(b - a), POSIX_FADV_WILLNEED);
  }

  // Maps request i into the region when it can (see read_ranges); false when it failed (reported).
  // Runs on the calling thread before the workers start, so MAP_FIXED never races with a reader.
  bool map_request(size_t i) {
    const ReadRequest& r = reqs_[i];
    if (r.lo != 0 || r.hi != r.col_length || r.col_length == 0 || !region_->contains(r.dst, r.dst_len)) return true;
    if (((uintptr_t)r.dst - (uintptr_t)r.col_offset) % (uintptr_t)MappedRegion::page_size() != 0)
      return true;  // not congruent: copy
    uint8_t* a = page_up(r.dst);
    uint8_t* b = page_down(r.dst + r.col_length);
    if (b <= a) return true;  // less than one whole page: copy
    const int64_t foff = r.col_offset + (a - r.dst);
    void* m = MAP_FAILED;
    if (const int injected = fault::check(fault::kMmap)) {
      ::munmap(a, (size_t)(b - a));  // the worst a failed MAP_FIXED may leave behind
      errno = injected;
    } else {
      m = ::mmap(a, (size_t)(b - a), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fds_[i], (off_t)foff);
    }
    if (m == MAP_FAILED) {
      // E.g. vm.max_map_count reached, strict overcommit, a filesystem without mmap: copy instead.
      // A failed MAP_FIXED may already have unmapped the range, so put anonymous memory back first.
      const int err = errno;
      void* back = ::mmap(a, (size_t)(b - a), PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      if (back == MAP_FAILED) {
        report(i, 0, std::string("mmap error at file offset ") + std::to_string(foff) + ": " + std::strerror(err) +
                         ", and the region could not be restored: " + std::strerror(errno));
        return false;
      }
      return true;
    }
    mapped_[i] = {a, b};
    bytes_mapped_ += b - a;
    // The partial pages at either end stay anonymous: read their bytes (verified, and counted in
    // bytes_read, with the rest by verify_mapped).
    for (auto [p, q] : {std::make_pair(r.dst, a), std::make_pair(b, r.dst + r.col_length)})
      if (q > p && !read_exact(i, (p - r.dst) / r.chunk_bytes, p, q - p, r.col_offset + (p - r.dst), "a partial page"))
        return false;
    return true;
  }

  // Chunks [j0, j1) of a mapped request: fault the file pages in (errors reported, not SIGBUS), then
  // check the crcs on the memory itself.
  void verify_mapped(const Piece& p) {
    const size_t i = (size_t)p.req;
    const ReadRequest& r = reqs_[i];
    const int64_t cb = r.chunk_bytes, s = p.j0 * cb, e = std::min(p.j1 * cb, r.col_length);
    const MappedSpan& m = mapped_[i];
    uint8_t* pa = std::max(m.a, page_down(r.dst + s));
    uint8_t* pb = std::min(m.b, page_up(r.dst + e));
    if (pb > pa && populate_ok_.load(std::memory_order_relaxed)) {
      if (::madvise(pa, (size_t)(pb - pa), kPopulateRead) != 0) {
        const int err = errno;
        if (err == EINVAL) {
          populate_ok_.store(false, std::memory_order_relaxed);  // kernel < 5.14: plain faults
        } else {
          report(i, p.j0, "read error in chunks " + std::to_string(p.j0) + ".." + std::to_string(p.j1 - 1) +
                              " (mapped, file offset " + std::to_string(r.col_offset + s) + "): " +
                              std::strerror(err) + (err == EFAULT ? " (file truncated?)" : ""));
          return;
        }
      }
    }
    bytes_read_.fetch_add(e - s, std::memory_order_relaxed);
    check_crcs(i, p.j0, s, e, r.dst + s);
  }

  // Checks the crcs of column bytes [a, b) (chunk-aligned, starting with chunk jfirst) held at buf.
  bool check_crcs(size_t i, int64_t jfirst, int64_t a, int64_t b, const uint8_t* buf) {
    const ReadRequest& r = reqs_[i];
    int64_t j = jfirst;
    for (int64_t s = a; s < b; s += r.chunk_bytes, j++) {
      const int64_t e = std::min(s + r.chunk_bytes, b);
      const uint32_t c = crc32c(0, buf + (s - a), (size_t)(e - s));
      if (c != r.crcs[(size_t)j]) return report_crc(i, j, s, e, c);
    }
    return true;
  }

  // Reports chunk j (column bytes [s, e)) of request i as not matching its crc; returns false.
  bool report_crc(size_t i, int64_t j, int64_t s, int64_t e, uint32_t computed) {
    const ReadRequest& r = reqs_[i];
    report(i, j, "CRC mismatch in chunk " + std::to_string(j) + " (column bytes [" + std::to_string(s) + ", " +
                     std::to_string(e) + "), file offset " + std::to_string(r.col_offset + s) + "): expected " +
                     hex32(r.crcs[(size_t)j]) + ", computed " + hex32(computed));
    return false;
  }

  // Reads exactly n bytes at off into p, or reports why not (`what` names the bytes) and returns false.
  bool read_exact(size_t i, int64_t chunk, uint8_t* p, int64_t n, int64_t off, const char* what) {
    const int64_t got = pread_all(fds_[i], p, n, off);
    if (got == n) return true;
    report(i, chunk, (got < 0 ? std::string("read error in ") + what + ": " + std::strerror((int)-got)
                              : std::string("short read in ") + what + " (file truncated?)") +
                         " at file offset " + std::to_string(off));
    return false;
  }

  // Reads column bytes [a, b) (chunk-aligned: covering chunks jfirst..) into buf, checks crcs.
  bool read_checked(size_t i, int64_t jfirst, int64_t a, int64_t b, uint8_t* buf) {
    const ReadRequest& r = reqs_[i];
    const int64_t want = b - a;
    const int64_t got = pread_all(fds_[i], buf, want, r.col_offset + a);
    if (got > 0) bytes_read_.fetch_add(got, std::memory_order_relaxed);
    if (got < 0) {
      report(i, jfirst, "read error in chunk " + std::to_string(jfirst) + " at file offset " +
                            std::to_string(r.col_offset + a) + ": " + std::strerror((int)-got));
      return false;
    }
    if (got < want) {
      const int64_t jbad = jfirst + got / r.chunk_bytes;
      report(i, jbad, "short read in chunk " + std::to_string(jbad) + ": got " + std::to_string(got) +
                          " of " + std::to_string(want) + " bytes at file offset " +
                          std::to_string(r.col_offset + a) + " (file truncated?)");
      return false;
    }
    return check_crcs(i, jfirst, a, b, buf);
  }

  // The padding before a column belongs to no checksummed block, so it is checked to be zero
  // instead: a flipped byte anywhere in a shard file still fails the load that reads it.
  bool check_padding(size_t i) {
    const ReadRequest& r = reqs_[i];
    uint8_t pad[4096];
    for (int64_t done = 0; done < r.pad_before;) {
      const int64_t n = std::min<int64_t>((int64_t)sizeof pad, r.pad_before - done);
      const int64_t off = r.col_offset - r.pad_before + done;
      if (!read_exact(i, 0, pad, n, off, "the padding before the column")) return false;
      bytes_read_.fetch_add(n, std::memory_order_relaxed);
      for (int64_t k = 0; k < n; k++)
        if (pad[k] != 0) {
          report(i, 0, "non-zero byte in the padding before the column, at file offset " + std::to_string(off + k));
          return false;
        }
      done += n;
    }
    return true;
  }

  void do_piece(const Piece& p, std::vector<uint8_t>& scratch, AlignedBuffer& bounce) {
    const ReadRequest& r = reqs_[(size_t)p.req];
    if (p.j0 == 0 && r.lo == 0 && r.pad_before > 0 && !check_padding((size_t)p.req)) return;
    if (mapped_[(size_t)p.req].b != nullptr) return verify_mapped(p);
    const bool small = piece_bytes((size_t)p.req, p.j0, p.j1) < kSmallPieceBytes;
    if (direct_ != kDirectNever && (direct_ == kDirectAlways || (!small && !piece_cached(p))) && read_direct(p, bounce))
      return;
    const int64_t cb = r.chunk_bytes, L = r.col_length;
    int64_t j = p.j0;
    while (j < p.j1) {
      const int64_t s = j * cb, e = std::min(s + cb, L);
      if (s >= r.lo && e <= r.hi) {
        // A run of chunks wholly inside [lo, hi): one read straight into dst.
        int64_t k = j + 1;
        while (k < p.j1 && std::min((k + 1) * cb, L) <= r.hi) k++;
        const int64_t end = std::min(k * cb, L);
        if (!small) prefault(r.dst + (s - r.lo), end - s);
        if (!read_checked((size_t)p.req, j, s, end, r.dst + (s - r.lo))) return;
        j = k;
      } else {
        if ((int64_t)scratch.size() < e - s) scratch.resize((size_t)(e - s));
        if (!read_checked((size_t)p.req, j, s, e, scratch.data())) return;
        const int64_t a = std::max(s, r.lo), b = std::min(e, r.hi);
        std::memcpy(r.dst + (a - r.lo), scratch.data() + (a - s), (size_t)(b - a));
        j++;
      }
    }
  }

  // ----------------------------------------------------------------------------------- direct reads
  // Whether most of piece p's bytes are in the page cache (ReadFiles::cached: asked without touching the
  // device; every piece counts as cached where that cannot be told).
  bool piece_cached(const Piece& p) {
    const ReadRequest& r = reqs_[(size_t)p.req];
    const int64_t s = p.j0 * r.chunk_bytes, e = std::min(p.j1 * r.chunk_bytes, r.col_length);
    return files_.cached(*file_of_[(size_t)p.req], r.col_offset + s, e - s);
  }

  // Piece p with O_DIRECT: straight into the destination when its chunks lie inside [lo, hi) at a
  // block-aligned address and file offset, else through `bounce` in blocks, each checked and copied in
  // cache-sized steps. True when the piece was handled (read and checked, or its failure reported);
  // false when the file system refused direct reads (the caller reads the piece through the page cache).
  bool read_direct(const Piece& p, AlignedBuffer& bounce) {
    const size_t i = (size_t)p.req;
    const ReadRequest& r = reqs_[i];
    const int dfd = files_.direct_fd(*file_of_[i], r.path);
    if (dfd < 0) return false;
    const int64_t cb = r.chunk_bytes, L = r.col_length;
    const int64_t s = p.j0 * cb, e = std::min(p.j1 * cb, L);
    if (s >= r.lo && e <= r.hi && (r.col_offset + s) % kAlign == 0 && (uintptr_t)(r.dst + (s - r.lo)) % kAlign == 0) {
      uint8_t* d = r.dst + (s - r.lo);
      const int64_t body = (e - s) / kAlign * kAlign;
      prefault(d, e - s);
      if (body > 0) {
        const int64_t got = pread_direct(dfd, d, body, r.col_offset + s);
        if (direct_refused(got)) return files_.refuse_direct(*file_of_[i]), false;
        if (got != body) return short_or_failed(i, p.j0 + std::max<int64_t>(got, 0) / cb, got, r.col_offset + s), true;
      }
      if (e - s > body && !read_exact(i, p.j0 + body / cb, d + body, e - s - body, r.col_offset + s + body,
                                      "a chunk")) return true;
      bytes_read_.fetch_add(e - s, std::memory_order_relaxed);
      check_crcs(i, p.j0, s, e, d);
      return true;
    }
    uint8_t* bb = bounce.get();
    if (bb == nullptr) return false;
    {
      const int64_t a = std::max(s, r.lo), b = std::min(e, r.hi);
      if (b > a) prefault(r.dst + (a - r.lo), b - a);
    }
    int64_t j = p.j0;
    uint32_t crc = 0;  // of chunk j's bytes so far
    for (int64_t bs = s; bs < e;) {
      const int64_t fa = (r.col_offset + bs) / kAlign * kAlign;
      const int64_t be = std::min(e, bs + kDirectBlock - ((r.col_offset + bs) - fa));
      const int64_t fb = (r.col_offset + be + kAlign - 1) / kAlign * kAlign;
      const int64_t got = pread_direct(dfd, bb, fb - fa, fa);
      if (direct_refused(got)) return files_.refuse_direct(*file_of_[i]), false;
      if (got < (r.col_offset + be) - fa)
        return short_or_failed(i, j, got < 0 ? got : 0, fa), true;
      const uint8_t* src = bb + ((r.col_offset + bs) - fa);  // column byte bs
      for (int64_t x = bs; x < be;) {
        const int64_t chunk_end = std::min((j + 1) * cb, L);
        const int64_t y = std::min(std::min(be, x + kCheckBlock), chunk_end);
        crc = crc32c(crc, src + (x - bs), (size_t)(y - x));
        const int64_t a = std::max(x, r.lo), b = std::min(y, r.hi);
        if (b > a) std::memcpy(r.dst + (a - r.lo), src + (a - bs), (size_t)(b - a));
        if (y == chunk_end) {
          if (crc != r.crcs[(size_t)j]) return report_crc(i, j, j * cb, chunk_end, crc), true;
          crc = 0;
          j++;
        }
        x = y;
      }
      bytes_read_.fetch_add(be - bs, std::memory_order_relaxed);
      bs = be;
    }
    return true;
  }

  // A direct read that returned `got` (< 0: -errno; else short) at file offset off, in chunk j.
  void short_or_failed(size_t i, int64_t j, int64_t got, int64_t off) {
    if (got < 0)
      report(i, j, "read error in chunk " + std::to_string(j) + " at file offset " + std::to_string(off) +
                       " (direct read): " + std::strerror((int)-got));
    else
      report(i, j, "short read in chunk " + std::to_string(j) + " at file offset " + std::to_string(off) +
                       " (direct read; file truncated?)");
  }

  // Faults in the whole pages of [p, p + n) for writing before pread copies into them: one kernel loop
  // instead of a fault taken inside the copy for every fresh page (benchmarks/README.md, "What was
  // tried" 10). Contents are unchanged; a failure (kernel < 5.14, no memory) is left to the pread.
  void prefault(uint8_t* p, int64_t n) {
    if (!prefault_ok_.load(std::memory_order_relaxed)) return;
    uint8_t* a = page_up(p);
    uint8_t* b = page_down(p + n);
    if (b > a && ::madvise(a, (size_t)(b - a), kPopulateWrite) != 0 && errno == EINVAL)
      prefault_ok_.store(false, std::memory_order_relaxed);
  }

  void work() {
    std::vector<uint8_t> scratch;
    AlignedBuffer bounce;
    for (;;) {
      const size_t k = next_.fetch_add(1, std::memory_order_relaxed);
      if (k >= pieces_.size()) return;
      advise_up_to(k);
      try {
        do_piece(pieces_[k], scratch, bounce);
      } catch (const std::bad_alloc&) {
        report((size_t)pieces_[k].req, pieces_[k].j0,
               "out of memory for a chunk of " + std::to_string(reqs_[(size_t)pieces_[k].req].chunk_bytes) +
                   " bytes");
      }
    }
  }

#ifdef MADV_POPULATE_READ
  static constexpr int kPopulateRead = MADV_POPULATE_READ;
  static constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
  static constexpr int kPopulateRead = 22;  // Linux 5.14 values, for older headers
  static constexpr int kPopulateWrite = 23;
#endif
  std::atomic<bool> prefault_ok_{true};  // false once the kernel refused MADV_POPULATE_WRITE (EINVAL)

  const std::vector<ReadRequest>& reqs_;
  MappedRegion* region_;
  const int direct_;
  ReadFiles files_;
  std::vector<int> fds_;
  std::vector<OpenFile*> file_of_;
  std::vector<MappedSpan> mapped_;
  int64_t bytes_mapped_ = 0;  // written before the workers start
  std::atomic<bool> populate_ok_{true};
  std::vector<Piece> pieces_;
  int64_t planned_bytes_ = 0;  // bytes of pieces_
  std::atomic<size_t> next_{0};
  std::atomic<int64_t> bytes_read_{0};
  std::mutex mu_;
  int64_t readahead_ = 0;
  std::mutex ahead_mu_;
  size_t ahead_ = 0;  // pieces [0, ahead_) were advised (guarded by ahead_mu_)
  std::vector<int64_t> err_chunk_;
  std::vector<std::string> err_msg_;
};

}  // namespace

ReadResult read_ranges(const std::vector<ReadRequest>& requests, int threads, int64_t readahead_bytes,
                       MappedRegion* map_into, int direct) {
  Reader r(requests, map_into, direct);
  return r.run(threads, readahead_bytes);
}

}  // namespace recckpt
