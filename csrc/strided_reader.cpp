#include "strided_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>

#include "crc32c.h"
#include "fault.h"
#include "mapped_region.h"
#include "read_files.h"
#include "shard_writer.h"
#include "workers.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace recckpt {
namespace {

constexpr int64_t kPlaceBytes = 16 << 10;     // destination bytes placed part by part before the next rows
constexpr int64_t kStreamMin = 1 << 20;       // a destination of at least this is written with streaming stores
constexpr int64_t kAdviseBytes = 256 << 10;   // read-ahead asks for at least this much of each part at a time
constexpr int64_t kMaxAlignedBlock = 64 << 20;  // past this, blocks are not cut on every part's chunk edges
constexpr int64_t kDirectBlockBytes = 8 << 20;  // blocks of a direct (cold) read: >= 256 KiB of each of 32 groups
constexpr int kDirectThreads = 8;               // direct reads in flight (each thread waits on the device)
constexpr int64_t kSweepBytes = 1 << 20;        // one sequential read of a cold file's sweep (see plan_streams)
constexpr int64_t kMaxSweepLead = int64_t(1) << 30;  // a block needing bytes further ahead than this is not swept

// Rows [b0, b1) of request `req` (a work item); `begin`: bytes of the items before it (read-ahead).
struct Block {
  size_t req;
  int64_t b0, b1;
  int64_t begin;
};

// dst row i = bytes of src row i, `n` of them, rows `dst_stride` / `src_stride` apart.
template <int N>
void place_fixed(uint8_t* __restrict dst, int64_t ds, const uint8_t* __restrict src, int64_t ss, int64_t rows) {
  for (int64_t i = 0; i < rows; i++) std::memcpy(dst + i * ds, src + i * ss, N);
}

void place(uint8_t* dst, int64_t ds, const uint8_t* src, int64_t ss, int64_t n, int64_t rows) {
  if (ds == n && ss == n) return (void)std::memcpy(dst, src, (size_t)(n * rows));
  switch (n) {
    case 2: return place_fixed<2>(dst, ds, src, ss, rows);
    case 4: return place_fixed<4>(dst, ds, src, ss, rows);
    case 8: return place_fixed<8>(dst, ds, src, ss, rows);
    case 16: return place_fixed<16>(dst, ds, src, ss, rows);
    case 32: return place_fixed<32>(dst, ds, src, ss, rows);
    case 64: return place_fixed<64>(dst, ds, src, ss, rows);
    default:
      for (int64_t i = 0; i < rows; i++) std::memcpy(dst + i * ds, src + i * ss, (size_t)n);
  }
}

// Copies n bytes to dst with non-temporal (streaming) stores where the target is aligned: the rows of a large
// destination are written once and not read back soon, and an ordinary store of part of a cache line first
// reads the line from memory (for 0.5 GB of rows, 0.5 GB more memory traffic than the copy). The caller
// issues _mm_sfence() before the rows are used by another thread.
void stream_copy(uint8_t* dst, const uint8_t* src, int64_t n) {
#if defined(__SSE2__)
  const int64_t head = std::min<int64_t>(n, (int64_t)((16 - ((uintptr_t)dst & 15)) & 15));
  std::memcpy(dst, src, (size_t)head);
  dst += head;
  src += head;
  n -= head;
  for (; n >= 64; n -= 64, dst += 64, src += 64) {
    const __m128i a = _mm_loadu_si128((const __m128i*)src), b = _mm_loadu_si128((const __m128i*)(src + 16));
    const __m128i c = _mm_loadu_si128((const __m128i*)(src + 32)), d = _mm_loadu_si128((const __m128i*)(src + 48));
    _mm_stream_si128((__m128i*)dst, a);
    _mm_stream_si128((__m128i*)(dst + 16), b);
    _mm_stream_si128((__m128i*)(dst + 32), c);
    _mm_stream_si128((__m128i*)(dst + 48), d);
  }
  for (; n >= 16; n -= 16, dst += 16, src += 16) _mm_stream_si128((__m128i*)dst, _mm_loadu_si128((const __m128i*)src));
#endif
  std::memcpy(dst, src, (size_t)n);
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

class StridedReader {
 public:
  StridedReader(const std::vector<StridedRequest>& reqs, int64_t block_bytes, int direct)
      : reqs_(reqs), block_bytes_(std::max<int64_t>(1, block_bytes)), direct_(direct), fds_(reqs.size(), -1),
        file_of_(reqs.size(), nullptr), covers_(reqs.size(), 0),
        err_row_(reqs.size(), std::numeric_limits<int64_t>::max()), err_msg_(reqs.size()) {}

  ReadResult run(int threads, int64_t readahead_bytes) {
    std::vector<char> ok(reqs_.size(), 0);
    for (size_t i = 0; i < reqs_.size(); i++) ok[i] = validate(i);
    // As read_ranges: a cold start (the first rows not in the page cache) reads past the page cache
    // (O_DIRECT), with no read-ahead hints (they would fill the cache), more threads to keep the device
    // busy, and larger blocks (the device wants large reads, and a block reads a piece of every group).
    direct_start_ = direct_ == kDirectAlways || (direct_ == kDirectAuto && first_rows_cold(ok));
    if (direct_start_) block_bytes_ = std::max(block_bytes_, kDirectBlockBytes);
    for (size_t i = 0; i < reqs_.size(); i++)
      if (ok[i]) plan(i);
    // A cold start read through the page cache goes file by file, each file sequentially (plan_streams).
    if (!direct_start_ && blocks_.size() > 1 && first_rows_cold(ok)) plan_streams();
    readahead_ = direct_start_ || !streams_.empty() ? 0 : std::max<int64_t>(0, readahead_bytes);
    advise_up_to(0);
    const int want = direct_start_ ? std::max(threads, kDirectThreads) : threads;
    const size_t units = streams_.empty() ? blocks_.size() : streams_.size();
    const int64_t nthreads = std::min<int64_t>(std::max(want, 1), (int64_t)units);
    run_workers(nthreads, [this] { work(); });
    ReadResult r;
    r.bytes_read = bytes_read_.load();
    for (size_t i = 0; i < reqs_.size(); i++)
      if (!err_msg_[i].empty()) r.errors.emplace_back((int64_t)i, err_msg_[i]);
    return r;
  }

 private:
  void report(size_t i, int64_t row, std::string msg) {
    std::lock_guard<std::mutex> lk(mu_);
    if (row < err_row_[i] || err_msg_[i].empty()) {
      err_row_[i] = row;
      err_msg_[i] = std::move(msg);
    }
  }

  static std::string part_name(size_t k) { return "part " + std::to_string(k); }

  bool invalid(size_t i, const std::string& why) {
    report(i, -1, "invalid request: " + why);
    return false;
  }

  bool validate(size_t i) {
    const StridedRequest& r = reqs_[i];
    if (!r.invalid.empty()) return report(i, -1, r.invalid), false;
    if (!(0 <= r.r0 && r.r0 <= r.r1)) return invalid(i, "need 0 <= r0 <= r1");
    if (r.dst_stride <= 0) return invalid(i, "dst_stride must be > 0");
    if (r.r1 - r.r0 > std::numeric_limits<int64_t>::max() / r.dst_stride ||
        r.dst_len != (r.r1 - r.r0) * r.dst_stride)
      return invalid(i, "dst has " + std::to_string(r.dst_len) + " bytes, expected (r1 - r0) * dst_stride");
    if (r.parts.empty()) return invalid(i, "no parts");
    for (size_t k = 0; k < r.parts.size(); k++) {
      const StridedPart& p = r.parts[k];
      const std::string w = part_name(k) + ": ";
      if (p.chunk_bytes <= 0) return invalid(i, w + "chunk_bytes must be > 0");
      if (p.col_offset < 0 || p.col_length < 0 || p.col_length > std::numeric_limits<int64_t>::max() - p.col_offset)
        return invalid(i, w + "col_offset and col_length must be >= 0 and not overflow");
      if (p.pad_before < 0 || p.pad_before > p.col_offset) return invalid(i, w + "pad_before must be in [0, col_offset]");
      if (p.width <= 0 || p.col_length % p.width != 0)
        return invalid(i, w + "width must be > 0 and divide col_length (" + std::to_string(p.col_length) + ")");
      if (r.r1 > p.col_length / p.width)
        return invalid(i, w + "rows up to " + std::to_string(r.r1) + " asked of a column of " +
                              std::to_string(p.col_length / p.width));
      if (p.src < 0 || p.nbytes < 0 || p.src > p.width - p.nbytes)
        return invalid(i, w + "need 0 <= src <= src + nbytes <= width");
      if (p.dst < 0 || p.dst > r.dst_stride - p.nbytes) return invalid(i, w + "need 0 <= dst <= dst + nbytes <= dst_stride");
      const int64_t nc = p.col_length / p.chunk_bytes + (p.col_length % p.chunk_bytes != 0);
      if ((int64_t)p.crcs.size() != nc)
        return invalid(i, w + "crcs has " + std::to_string(p.crcs.size()) + " entries, expected " + std::to_string(nc));
    }
    OpenFile& f = files_.open(r.path);   // as read_ranges: regular files only (docs/SAFETY.md)
    file_of_[i] = &f;
    if (f.fd < 0) return report(i, -1, f.open_error()), false;
    for (size_t k = 0; k < r.parts.size(); k++) {
      const StridedPart& p = r.parts[k];
      if (f.size < p.col_offset + p.col_length)
        return report(i, -1, part_name(k) + ": file too small: " + std::to_string(f.size) +
                                 " bytes, the column needs col_offset + col_length = " +
                                 std::to_string(p.col_offset + p.col_length)), false;
    }
    fds_[i] = f.fd;
    return true;
  }

  // Blocks of rows whose edges fall on every part's chunk edges where that keeps blocks small (then no
  // chunk is read twice); the first and last block of a request may be partial.
  void plan(size_t i) {
    const StridedRequest& r = reqs_[i];
    // Whether the parts write every byte of a destination row, each once (whole rows: see do_block).
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (const StridedPart& p : r.parts) spans.emplace_back(p.dst, p.dst + p.nbytes);
    std::sort(spans.begin(), spans.end());
    int64_t end = 0;
    bool covers = true;
    for (const auto& sp : spans) {
      covers = covers && sp.first == end;
      end = sp.second;
    }
    covers_[i] = covers && end == r.dst_stride;
    if (r.r0 == r.r1) return;
    int64_t row_bytes = 0, align = 1;
    for (const StridedPart& p : r.parts) {
      row_bytes += p.width;
      const int64_t a = p.chunk_bytes / std::gcd(p.chunk_bytes, p.width);
      if (align <= kMaxAlignedBlock && a <= kMaxAlignedBlock) align = std::lcm(align, a);
      else align = kMaxAlignedBlock + 1;
    }
    int64_t rows = std::max<int64_t>(1, block_bytes_ / row_bytes);
    if (align > kMaxAlignedBlock || align * row_bytes > kMaxAlignedBlock) align = 1;  // edges need not align
    rows = (rows + align - 1) / align * align;
    for (int64_t b0 = r.r0; b0 < r.r1;) {
      const int64_t b1 = std::min(r.r1, (b0 / rows + 1) * rows);
      blocks_.push_back({i, b0, b1, planned_bytes_});
      for (const StridedPart& p : r.parts) planned_bytes_ += chunk_span(p, b0, b1).second - chunk_span(p, b0, b1).first;
      b0 = b1;
    }
  }

  // Column bytes [first, second) of the whole chunks holding rows [b0, b1) of part p.
  static std::pair<int64_t, int64_t> chunk_span(const StridedPart& p, int64_t b0, int64_t b1) {
    const int64_t s = b0 * p.width, e = b1 * p.width;
    return {s / p.chunk_bytes * p.chunk_bytes, std::min(p.col_length, (e + p.chunk_bytes - 1) / p.chunk_bytes * p.chunk_bytes)};
  }

  // Read-ahead, as read_ranges: the kernel is told to start reading what the next `readahead_` bytes of
  // blocks need. A block needs a small piece of every part (32 KiB of each of 32 groups for 1 MiB), and the
  // consecutive blocks of a request need consecutive pieces of each part: so the window is advanced in steps
  // of a quarter of it, and in bands of consecutive blocks of a request that need at least kAdviseBytes of
  // each part, one call per part and band, in the order the blocks are read. The device then sees large
  // reads in about the order they are waited for (not one small read per group and block, nor a whole
  // group column before the next group's first rows).
  void advise_up_to(size_t k) {
    if (readahead_ <= 0 || blocks_.empty()) return;
    const int64_t limit = blocks_[k].begin + readahead_;
    std::unique_lock<std::mutex> lk(ahead_mu_, std::try_to_lock);
    if (!lk.owns_lock()) return;
    if (ahead_ >= blocks_.size() || blocks_[ahead_].begin >= limit) return;
    if (ahead_ > k && blocks_[ahead_].begin - blocks_[k].begin > readahead_ - readahead_ / 4) return;
    size_t end = ahead_;
    while (end < blocks_.size() && blocks_[end].begin < limit) end++;
    for (size_t j = ahead_; j < end;) {
      const StridedRequest& r = reqs_[blocks_[j].req];
      int64_t narrow = std::numeric_limits<int64_t>::max();
      for (const StridedPart& p : r.parts) narrow = std::min(narrow, p.width);
      size_t e = j + 1;
      while (e < end && blocks_[e].req == blocks_[j].req && (blocks_[e].b0 - blocks_[j].b0) * narrow < kAdviseBytes) e++;
      for (const StridedPart& p : r.parts) {
        const int64_t a = chunk_span(p, blocks_[j].b0, blocks_[j].b1).first;
        const int64_t z = chunk_span(p, blocks_[e - 1].b0, blocks_[e - 1].b1).second;
        ::posix_fadvise(fds_[blocks_[j].req], (off_t)(p.col_offset + a), (off_t)(z - a), POSIX_FADV_WILLNEED);
      }
      j = e;
    }
    ahead_ = end;
  }

  bool check_padding(size_t i, size_t k, int64_t row) {
    const StridedPart& p = reqs_[i].parts[k];
    uint8_t pad[4096];
    for (int64_t done = 0; done < p.pad_before;) {
      const int64_t n = std::min<int64_t>((int64_t)sizeof pad, p.pad_before - done);
      const int64_t off = p.col_offset - p.pad_before + done;
      const int64_t got = pread_all(fds_[i], pad, n, off);
      if (got != n) {
        report(i, row, part_name(k) + ": " + (got < 0 ? std::string("read error in the padding before the column: ") +
                                                           std::strerror((int)-got)
                                                     : std::string("short read in the padding before the column")) +
                           " at file offset " + std::to_string(off));
        return false;
      }
      bytes_read_.fetch_add(n, std::memory_order_relaxed);
      for (int64_t j = 0; j < n; j++)
        if (pad[j] != 0) {
          report(i, row, part_name(k) + ": non-zero byte in the padding before the column, at file offset " +
                             std::to_string(off + j));
          return false;
        }
      done += n;
    }
    return true;
  }

  // Whether the first rows to read are not in the page cache (a cold load: see run()).
  bool first_rows_cold(const std::vector<char>& ok) {
    for (size_t i = 0; i < reqs_.size(); i++) {
      const StridedRequest& r = reqs_[i];
      if (!ok[i] || r.r0 == r.r1) continue;
      const StridedPart& p = r.parts[0];
      const auto span = chunk_span(p, r.r0, std::min(r.r1, r.r0 + std::max<int64_t>(1, (256 << 10) / p.width)));
      return !files_.cached(*file_of_[i], p.col_offset + span.first, span.second - span.first);
    }
    return false;
  }

  // Reads part k's chunks of block b (column bytes `span`) into `region` (kAlign-aligned, room for the whole
  // kAlign blocks around them), with O_DIRECT when `dfd` >= 0, else through the page cache; the column's first
  // byte of the span is then at the returned pointer; nullptr when it failed (reported). A file system that
  // refuses direct reads sets dfd to -1 (and is read through the cache from then on).
  const uint8_t* read_part(const Block& b, size_t k, std::pair<int64_t, int64_t> span, uint8_t* region, int& dfd) {
    const StridedRequest& r = reqs_[b.req];
    const StridedPart& p = r.parts[k];
    const int64_t lo = p.col_offset + span.first, hi = p.col_offset + span.second;
    const int64_t fa = lo / kAlign * kAlign;
    if (dfd >= 0) {
      const int64_t fb = (hi + kAlign - 1) / kAlign * kAlign;
      const int64_t got = pread_direct(dfd, region, fb - fa, fa);
      if (direct_refused(got)) {
        files_.refuse_direct(*file_of_[b.req]);
        dfd = -1;
      } else if (got < hi - fa) {
        report(b.req, b.b0, part_name(k) + ": " + (got < 0 ? std::string("read error: ") + std::strerror((int)-got)
                                                          : "short read (file truncated?)") +
                                " at file offset " + std::to_string(fa) + " (direct read)");
        return nullptr;
      } else {
        bytes_read_.fetch_add(hi - lo, std::memory_order_relaxed);
        return region + (lo - fa);
      }
    }
    uint8_t* buf = region + (lo - fa);   // the same place as a direct read would have put it
    const int64_t got = pread_all(fds_[b.req], buf, hi - lo, lo);
    if (got > 0) bytes_read_.fetch_add(got, std::memory_order_relaxed);
    if (got != hi - lo) {
      report(b.req, b.b0, part_name(k) + ": " + (got < 0 ? std::string("read error: ") + std::strerror((int)-got)
                                                        : "short read (file truncated?)") +
                              " at file offset " + std::to_string(lo));
      return nullptr;
    }
    return buf;
  }

  // Reads and checks every part's chunks of the block into scratch; then places its rows.
  void do_block(const Block& b, AlignedBuffer& scratch, std::vector<const uint8_t*>& data, std::vector<uint8_t>& tmp) {
    const StridedRequest& r = reqs_[b.req];
    const size_t np = r.parts.size();
    std::vector<int64_t> at(np + 1, 0);
    for (size_t k = 0; k < np; k++) {   // each part's region: the whole kAlign blocks around its chunks
      const auto span = chunk_span(r.parts[k], b.b0, b.b1);
      const int64_t lo = r.parts[k].col_offset + span.first, hi = r.parts[k].col_offset + span.second;
      at[k + 1] = at[k] + (hi + kAlign - 1) / kAlign * kAlign - lo / kAlign * kAlign;
    }
    uint8_t* region = scratch.get(std::max<int64_t>(at[np], kAlign));
    if (region == nullptr) return report(b.req, b.b0, "out of memory for the scratch of a block of rows");
    int dfd = -1;
    if (direct_ != kDirectNever) {
      const StridedPart& p = r.parts[0];
      const auto span = chunk_span(p, b.b0, b.b1);
      if (direct_ == kDirectAlways || !files_.cached(*file_of_[b.req], p.col_offset + span.first, span.second - span.first))
        dfd = files_.direct_fd(*file_of_[b.req], r.path);
    }
    data.assign(np, nullptr);
    for (size_t k = 0; k < np; k++) {
      const StridedPart& p = r.parts[k];
      if (b.b0 == 0 && p.pad_before > 0 && !check_padding(b.req, k, b.b0)) return;
      const auto span = chunk_span(p, b.b0, b.b1);
      const uint8_t* buf = read_part(b, k, span, region + at[k], dfd);
      if (buf == nullptr) return;
      int64_t j = span.first / p.chunk_bytes;
      for (int64_t s = span.first; s < span.second; s += p.chunk_bytes, j++) {
        const int64_t e = std::min(s + p.chunk_bytes, span.second);
        const uint32_t c = crc32c(0, buf + (s - span.first), (size_t)(e - s));
        if (c != p.crcs[(size_t)j]) {
          report(b.req, b.b0, part_name(k) + ": CRC mismatch in chunk " + std::to_string(j) + " (column bytes [" +
                                  std::to_string(s) + ", " + std::to_string(e) + "), file offset " +
                                  std::to_string(p.col_offset + s) + "): expected " + hex32(p.crcs[(size_t)j]) +
                                  ", computed " + hex32(c));
          return;
        }
      }
      data[k] = buf - span.first;   // column byte 0, as if the whole column were there
    }
    uint8_t* dst = r.dst + (b.b0 - r.r0) * r.dst_stride;
    prefault(dst, (b.b1 - b.b0) * r.dst_stride);
    // Rows whose every byte the parts write are assembled in a small buffer and streamed out whole (see
    // stream_copy; streaming each piece straight to its row was slower); other destinations (a wider row, a
    // small one) are written in place.
    const bool whole = covers_[b.req] && (r.r1 - r.r0) * r.dst_stride >= kStreamMin;
    const int64_t step = std::max<int64_t>(1, kPlaceBytes / r.dst_stride);
    if (whole && (int64_t)tmp.size() < step * r.dst_stride) tmp.resize((size_t)(step * r.dst_stride));
    for (int64_t s0 = b.b0; s0 < b.b1; s0 += step) {
      const int64_t rows = std::min(step, b.b1 - s0);
      uint8_t* out = r.dst + (s0 - r.r0) * r.dst_stride;
      uint8_t* d = whole ? tmp.data() : out;
      for (size_t k = 0; k < np; k++) {
        const StridedPart& p = r.parts[k];
        place(d + p.dst, r.dst_stride, data[k] + s0 * p.width + p.src, p.width, p.nbytes, rows);
      }
      if (whole) stream_copy(out, d, rows * r.dst_stride);
    }
    if (whole) stream_fence();
  }

  // As read_ranges: fault in the destination's whole pages for writing in one kernel call (a table's fresh
  // storage), instead of one fault per page inside the copy. A kernel that refuses is not asked again.
  void prefault(uint8_t* p, int64_t n) {
    if (!prefault_ok_.load(std::memory_order_relaxed)) return;
    const uintptr_t P = (uintptr_t)MappedRegion::page_size();
    uint8_t* a = (uint8_t*)(((uintptr_t)p + P - 1) / P * P);
    uint8_t* e = (uint8_t*)(((uintptr_t)(p + n)) / P * P);
#ifdef MADV_POPULATE_WRITE
    constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
    constexpr int kPopulateWrite = 23;  // Linux 5.14
#endif
    if (e > a && ::madvise(a, (size_t)(e - a), kPopulateWrite) != 0 && errno == EINVAL)
      prefault_ok_.store(false, std::memory_order_relaxed);
  }

  // A worker's memory, kept from block to block.
  struct WorkerScratch {
    AlignedBuffer scratch;
    std::vector<uint8_t> tmp, sink;
    std::vector<const uint8_t*> data;
  };

  // A cold read through the page cache, planned as one stream of blocks per file, in file order; a worker
  // takes a whole stream. A block reads a piece of every part (column group), and a segment's group columns
  // lie one after another, so a block's reads are far apart in the file. Measured on a virtual disk
  // (bench_torchrec.py, 2 ranks, cache dropped): the kernel's read-ahead serves a reader that goes through a
  // file sequentially about twice as fast as one that jumps between 16 columns, and several workers taking
  // interleaved blocks of one file, or read-ahead hints (POSIX_FADV_WILLNEED) for each part, were slower
  // still. So each stream's worker first reads the file sequentially (sweep) up to the end of the bytes the
  // next block needs, then reads, checks and places the block from the page cache as a warm read does.
  void plan_streams() {
    std::vector<std::pair<std::pair<uintptr_t, int64_t>, size_t>> order;
    order.reserve(blocks_.size());
    for (size_t k = 0; k < blocks_.size(); k++)
      order.push_back({{(uintptr_t)file_of_[blocks_[k].req], file_span(blocks_[k]).first}, k});
    std::sort(order.begin(), order.end());
    for (size_t j = 0; j < order.size(); j++) {
      if (j == 0 || order[j].first.first != order[j - 1].first.first) streams_.emplace_back();
      streams_.back().push_back(order[j].second);
    }
  }

  // The file bytes [first, second) that block b's chunks lie in (all its parts).
  std::pair<int64_t, int64_t> file_span(const Block& b) const {
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    for (const StridedPart& p : reqs_[b.req].parts) {
      const auto span = chunk_span(p, b.b0, b.b1);
      lo = std::min(lo, p.col_offset + span.first);
      hi = std::max(hi, p.col_offset + span.second);
    }
    return {lo, hi};
  }

  // Stream s: the bytes its blocks need (`needed`), read in file order ahead of the blocks, through a
  // descriptor of its own (the kernel keeps read-ahead state per open file, and the blocks' reads on the shared
  // one jump between columns). Before a block, everything needed below its last byte is read. A whole
  // segment's groups lie back to back, so that is one sequential read; a share of its rows (a resharding load)
  // is one sequential read per group, never the other rows between them. The sweep only fills the page cache:
  // the blocks are read, checked and placed as ever, so a sweep that fails or stops early costs time, not
  // correctness. A block needing bytes more than kMaxSweepLead ahead of its first byte is not swept (the
  // cache might not hold the sweep until the block reads it).
  void run_stream(size_t s, WorkerScratch& w) {
    const size_t req0 = blocks_[streams_[s][0]].req;
    char own[40];
    std::snprintf(own, sizeof own, "/proc/self/fd/%d", fds_[req0]);
    const int sfd = ::open(own, O_RDONLY | O_CLOEXEC);
    const int fd = sfd >= 0 ? sfd : fds_[req0];
    bool sweeping = true;
    std::vector<std::pair<int64_t, int64_t>> need;
    try {
      w.sink.resize((size_t)kSweepBytes);
      need = needed(streams_[s]);
    } catch (const std::bad_alloc&) {
      sweeping = false;
    }
    size_t j = 0;      // need[j]: the range being swept
    int64_t at = 0;    // where in it
    for (size_t k : streams_[s]) {
      const auto span = file_span(blocks_[k]);
      while (sweeping && span.second - span.first <= kMaxSweepLead && j < need.size() && need[j].first < span.second) {
        at = std::max(at, need[j].first);
        const int64_t end = std::min(need[j].second, span.second);
        if (at >= end) {
          if (at >= need[j].second) j++;
          else break;   // swept up to this block's last byte
          continue;
        }
        const int injected = fault::check(fault::kSweep);
        const ssize_t got = injected ? -1 : ::pread(fd, w.sink.data(), (size_t)std::min(kSweepBytes, end - at), (off_t)at);
        if (got <= 0) sweeping = false;   // the block's own reads report what is wrong
        else at += got;
      }
      block(k, w);
    }
    if (sfd >= 0) ::close(sfd);
  }

  // The file ranges the blocks `ks` read (every part's chunks), sorted and merged; ranges at most
  // kColumnAlign apart are merged too (the gap is the zero padding between two columns, which reading keeps
  // the sweep sequential), so the sweep reads no byte outside what docs/FORMAT.md says a rank reads.
  std::vector<std::pair<int64_t, int64_t>> needed(const std::vector<size_t>& ks) const {
    std::vector<std::pair<int64_t, int64_t>> r;
    for (size_t k : ks)
      for (const StridedPart& p : reqs_[blocks_[k].req].parts) {
        const auto span = chunk_span(p, blocks_[k].b0, blocks_[k].b1);
        r.emplace_back(p.col_offset + span.first, p.col_offset + span.second);
      }
    std::sort(r.begin(), r.end());
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const auto& x : r) {
      if (!out.empty() && x.first <= out.back().second + kColumnAlign) out.back().second = std::max(out.back().second, x.second);
      else out.push_back(x);
    }
    return out;
  }

  void block(size_t k, WorkerScratch& w) {
    try {
      do_block(blocks_[k], w.scratch, w.data, w.tmp);
    } catch (const std::bad_alloc&) {
      report(blocks_[k].req, blocks_[k].b0, "out of memory for the scratch of a block of rows");
    }
  }

  void work() {
    WorkerScratch w;
    for (;;) {
      const size_t k = next_.fetch_add(1, std::memory_order_relaxed);
      if (!streams_.empty()) {   // k: a stream
        if (k >= streams_.size()) return;
        run_stream(k, w);
        continue;
      }
      if (k >= blocks_.size()) return;
      advise_up_to(k);
      block(k, w);
    }
  }

  const std::vector<StridedRequest>& reqs_;
  int64_t block_bytes_;  // column bytes (all parts) a worker reads, checks and places at once
  const int direct_;     // kDirectNever / kDirectAuto / kDirectAlways (reader.h)
  bool direct_start_ = false;
  ReadFiles files_;
  std::vector<int> fds_;
  std::vector<OpenFile*> file_of_;
  std::vector<char> covers_;   // per request: its parts write every byte of a destination row
  std::vector<Block> blocks_;
  std::vector<std::vector<size_t>> streams_;   // a cold read's blocks, file by file (plan_streams); else empty
  int64_t planned_bytes_ = 0;
  std::atomic<size_t> next_{0};
  std::atomic<int64_t> bytes_read_{0};
  std::atomic<bool> prefault_ok_{true};
  std::mutex mu_;
  int64_t readahead_ = 0;
  std::mutex ahead_mu_;
  size_t ahead_ = 0;
  std::vector<int64_t> err_row_;
  std::vector<std::string> err_msg_;
};

}  // namespace

ReadResult read_strided(const std::vector<StridedRequest>& requests, int threads, int64_t readahead_bytes,
                        int64_t block_bytes, int direct) {
  StridedReader r(requests, block_bytes, direct);
  return r.run(threads, readahead_bytes);
}

}  // namespace recckpt
