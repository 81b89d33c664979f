#include "shard_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <set>
#include <type_traits>
#include <utility>

#include "buffer_pool.h"
#include "crc32c.h"
#include "fault.h"
#include "gather.h"
#include "hash.h"
#include "pwrite_thread.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "recckpt's shard format is little-endian; big-endian hosts are not supported"
#endif

namespace recckpt {
namespace {

constexpr size_t kStagingBytes = size_t(8) << 20;  // per-worker gather buffer (two of them)
constexpr int64_t kCrcBlock = 256 << 10;           // gather this much, then checksum it while hot
constexpr int64_t kAsyncMin = 1 << 20;             // smaller pieces are written inline
constexpr int64_t kDirectMin = 4 << 20;            // in-order columns of at least this are written in place
constexpr int64_t kDirectBlock = 4 << 20;          // ... in blocks of this (checksummed, then written)
constexpr int64_t kGroupsBlockedMin = 1 << 20;     // a grouped slot of at least this is written by row blocks
constexpr int64_t kGatherSubBytes = 64 << 10;      // source rows gathered into every group before moving on

struct StopRequested {};

// Streams bytes through fixed-size chunks, collecting one crc32c per chunk.
class ChunkCrc {
 public:
  ChunkCrc(int64_t chunk, std::vector<uint32_t>& out) : chunk_(chunk), out_(out) {}
  void feed(const uint8_t* p, int64_t len) {
    while (len > 0) {
      int64_t m = std::min(len, chunk_ - fill_);
      cur_ = crc32c(cur_, p, (size_t)m);
      fill_ += m;
      p += m;
      len -= m;
      if (fill_ == chunk_) {
        out_.push_back(cur_);
        cur_ = 0;
        fill_ = 0;
      }
    }
  }
  void end() {
    if (fill_ > 0) out_.push_back(cur_);
    cur_ = 0;
    fill_ = 0;
  }

 private:
  const int64_t chunk_;
  std::vector<uint32_t>& out_;
  uint32_t cur_ = 0;
  int64_t fill_ = 0;
};

}  // namespace

int64_t column_step(int64_t length, int64_t chunk_bytes) {
  const int64_t q = (length + 63) / 64;
  if (q >= chunk_bytes) return chunk_bytes;
  int64_t p = 512;
  while (p < q) p <<= 1;
  return std::min(p, chunk_bytes);
}

ShardWriter::ShardWriter(const std::vector<std::string>& paths, int64_t num_buckets,
                         int64_t chunk_bytes, int64_t max_inflight_bytes, bool writeback)
    : num_buckets_(num_buckets), chunk_bytes_(chunk_bytes), max_inflight_(max_inflight_bytes), writeback_(writeback) {
  if (paths.empty()) throw std::invalid_argument("ShardWriter: paths must not be empty");
  if (num_buckets <= 0) throw std::invalid_argument("ShardWriter: num_buckets must be > 0");
  if (chunk_bytes <= 0) throw std::invalid_argument("ShardWriter: chunk_bytes must be > 0");
  if (max_inflight_bytes < 0) throw std::invalid_argument("ShardWriter: max_inflight_bytes must be >= 0");
  if ((uint64_t)num_buckets > (uint64_t(1) << 40))
    throw std::invalid_argument("ShardWriter: num_buckets is unreasonably large");
  {
    std::set<std::string> seen;
    for (const auto& p : paths)
      if (!seen.insert(p).second) throw std::invalid_argument("ShardWriter: duplicate path '" + p + "'");
  }
  staging_bytes_ = (size_t)chunk_bytes <= kStagingBytes ? kStagingBytes / chunk_bytes * chunk_bytes
                                                        : kStagingBytes;

  // A throw below leaves every file opened so far to its File's destructor (files_ and `f`).
  std::set<std::pair<dev_t, ino_t>> inodes;
  for (const auto& p : paths) {
    auto f = std::make_unique<File>();
    f->path = p;
    f->oom.emplace(ENOMEM, p, "ShardWriter: out of memory");
    f->fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f->fd < 0) {
      const int e = errno;
      throw OsError(e, p, "ShardWriter: cannot create file");
    }
    struct stat st;
    if (::fstat(f->fd, &st) == 0 && !inodes.insert({st.st_dev, st.st_ino}).second)
      throw std::invalid_argument("ShardWriter: path '" + p + "' is the same file as an earlier path");
    if (fault::check(fault::kSetup)) throw std::bad_alloc();  // test hook: as the allocations here can
    files_.push_back(std::move(f));
  }
  try {
    for (auto& f : files_) f->thread = std::thread(&ShardWriter::worker, this, f.get());
  } catch (...) {
    stop_and_join(true);
    throw;
  }
}

ShardWriter::~ShardWriter() {
  bool ended;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ended = ended_;
  }
  if (!ended) abort();
}

int64_t ShardWriter::segment_bytes(const SegmentInput& seg) const {
  int64_t b = 8 * std::min(num_buckets_, seg.n) + 8 * seg.n;
  for (int64_t rb : seg.row_bytes) b += rb * seg.n;
  return b;
}

int64_t ShardWriter::submit(SegmentInput seg) {
  const int64_t bytes = segment_bytes(seg);
  std::unique_lock<std::mutex> lk(mu_);
  auto reject = [&] {
    if (seg.done) seg.done->store(true, std::memory_order_release);
  };
  space_cv_.wait(lk, [&] {
    return error_ || ended_ || closing_ || inflight_ == 0 || inflight_ + bytes <= max_inflight_;
  });
  if (ended_ || closing_) {
    reject();
    throw std::logic_error("ShardWriter: submit() after finish() or abort()");
  }
  if (error_) {
    reject();
    throw OsError(*error_);
  }
  // The file with the fewest queued bytes; ties go round-robin so idle files share the work.
  File* best = nullptr;
  const size_t nf = files_.size();
  size_t best_i = 0;
  for (size_t k = 0; k < nf; k++) {
    const size_t i = (next_file_ + k) % nf;
    if (!best || files_[i]->queued_bytes < best->queued_bytes) {
      best = files_[i].get();
      best_i = i;
    }
  }
  next_file_ = (best_i + 1) % nf;
  Job job;
  job.in = std::move(seg);
  job.id = next_segment_++;
  job.bytes = bytes;
  const int64_t id = job.id;
  best->queue.push_back(std::move(job));
  best->queued_bytes += bytes;
  inflight_ += bytes;
  lk.unlock();
  work_cv_.notify_all();
  return id;
}

// An OsError as it is, std::bad_alloc as the file's ENOMEM error, another exception as EIO with its what().
static_assert(std::is_nothrow_move_constructible<OsError>::value, "moving f.oom into error_ must not allocate");
void ShardWriter::fail_current(File& f) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  f.failed = true;
  if (error_) return;
  try {
    try {
      throw;
    } catch (const OsError& e) {
      error_.emplace(e);
    } catch (const std::bad_alloc&) {
      throw;
    } catch (const std::exception& e) {
      error_.emplace(EIO, f.path, std::string("ShardWriter: ") + e.what());
    }
  } catch (...) {  // std::bad_alloc, thrown or met copying or making the error: f.oom needs no memory
    error_ = std::move(f.oom);
  }
}

// An error the worker finds itself (fsync, close, ...): errno `err` of `op`.
void ShardWriter::fail_errno(File& f, int err, const char* op) noexcept {
  try {
    throw OsError(err, f.path, op);
  } catch (...) {  // that OsError, or std::bad_alloc making it
    fail_current(f);
  }
}

void ShardWriter::check_stopping() const {
  if (stop_.load(std::memory_order_relaxed)) throw StopRequested{};
}

// A worker's output stream: segments are appended to a staging buffer that is written (by the
// pwrite thread, double-buffered) when full, or when the worker runs out of queued segments. Many
// small segments thus become few large writes, and a segment's arrays are released as soon as they
// are copied.
struct ShardWriter::WorkerCtx {
  File& f;
  const size_t cap;
  // Given back to the pool (buffer_pool.h) for the process's next writer when this one ends; declared
  // before io, so that io (its thread joined) is destroyed first and never writes from a given-back buffer.
  PooledBuffer buf[2];
  PwriteThread io;
  int cur = 0;
  size_t fill = 0;  // bytes staged in buf[cur]
  int64_t off = 0;  // file offset of buf[cur][0]

  WorkerCtx(File& file, size_t capacity, bool writeback) : f(file), cap(capacity), io(file.fd, file.path, writeback) {}

  int64_t pos() const { return off + (int64_t)fill; }  // file offset of the next byte
  uint8_t* space(size_t& avail) {
    if (!buf[cur]) buf[cur].acquire(cap);
    avail = cap - fill;
    return buf[cur].get() + fill;
  }
  void commit(size_t n) {
    fill += n;
    if (fill == cap) flush();
  }
  void flush() {
    if (fill == 0) return;
    if ((int64_t)fill >= kAsyncMin) {
      io.write(buf[cur].get(), fill, off);  // waits for the other buffer's write first
      cur ^= 1;
    } else {
      pwrite_all(f.fd, f.path, buf[cur].get(), fill, off);
    }
    off += (int64_t)fill;
    fill = 0;
  }
  // Zero bytes up to the next multiple of `align` (format version 2: slot columns start on a page
  // boundary, so that a load can map them; docs/FORMAT.md).
  void pad_to(int64_t align) {
    static const uint8_t zeros[kColumnAlign] = {};
    const int64_t pad = (align - pos() % align) % align;
    append(zeros, (size_t)pad);
  }
  void append(const void* data, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      size_t avail;
      uint8_t* dst = space(avail);
      const size_t m = std::min(avail, n);
      std::memcpy(dst, p, m);
      commit(m);
      p += m;
      n -= m;
    }
  }
  // Writes caller memory in place (it must stay valid until io.wait()).
  void write_direct(const void* data, size_t n) {
    flush();
    io.write(data, n, off);
    off += (int64_t)n;
    direct_pending = true;
  }
  // Waits until no caller memory is being written (before a segment's arrays may be released).
  void wait_direct() {
    if (!direct_pending) return;
    direct_pending = false;
    io.wait();
  }
  bool direct_pending = false;
  void discard() { fill = 0; }
  // Writes pieces of buf[cur] (filled through space(), fill == 0) that go to several places in the file
  // (the column groups of a block of rows), then switches buffers as flush() does. The file offset of the
  // next staged byte is not moved: the caller sets it with skip_to() once every piece is written.
  void write_pieces(std::vector<PwriteThread::Op> ops) {
    io.write_many(std::move(ops));
    cur ^= 1;
  }
  void skip_to(int64_t end) {
    off = end;
    fill = 0;
  }
};

void ShardWriter::worker(File* f) {
  std::unique_ptr<WorkerCtx> ctx;
  try {
    ctx = std::make_unique<WorkerCtx>(*f, staging_bytes_, writeback_);
  } catch (...) {  // std::system_error (no thread to be had), or std::bad_alloc
    fail_errno(*f, EAGAIN, "ShardWriter: cannot start the pwrite thread");
  }
  // Writes out what is staged and waits for it; false (and the file marked failed) on error. Any error:
  // the last flush of a save runs here, outside write_segment's handlers.
  auto drain = [&]() {
    try {
      ctx->flush();
      ctx->io.wait();
      return true;
    } catch (...) {
      ctx->discard();
      fail_current(*f);
      return false;
    }
  };
  for (;;) {
    Job job;
    bool failed, idle_flush = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (ctx && ctx->fill > 0 && f->queue.empty() && !stop_ && !f->failed) {
        idle_flush = true;  // nothing queued: write out the staged bytes before sleeping
      } else {
        work_cv_.wait(lk, [&] { return stop_ || closing_ || !f->queue.empty(); });
        if (stop_ || f->queue.empty()) break;
        job = std::move(f->queue.front());
        f->queue.pop_front();
      }
      failed = f->failed;
    }
    if (idle_flush) {
      drain();
      continue;
    }
    if (!failed && ctx) {
      try {
        write_segment(*f, job, *ctx);
      } catch (const StopRequested&) {
      } catch (...) {
        fail_current(*f);
      }
      try {
        ctx->wait_direct();
      } catch (...) {
        fail_current(*f);
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (f->failed) ctx->discard();
      }
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      f->queued_bytes -= job.bytes;
      inflight_ -= job.bytes;
      if (job.in.done) job.in.done->store(true, std::memory_order_release);
    }
    space_cv_.notify_all();
  }
  bool stopping, failed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping = stop_;
    failed = f->failed;
  }
  if (ctx) {
    if (!stopping && !failed) drain();
    try {
      ctx->io.wait();
    } catch (...) {  // the file has failed already, or the writer is stopping
    }
    ctx.reset();  // joins the pwrite thread
  }
  // fsync (finish with fsync=True) and close here, so that files are synced in parallel.
  bool sync;
  {
    std::lock_guard<std::mutex> lk(mu_);
    sync = !stop_ && do_fsync_;
    failed = f->failed;
  }
  int injected = 0;
  if (sync && !failed && ((injected = fault::check(fault::kFsync)) != 0 || ::fsync(f->fd) != 0))
    fail_errno(*f, injected ? injected : errno, "ShardWriter: fsync");
  if (::close(f->fd) != 0 && !stop_) fail_errno(*f, errno, "ShardWriter: close");
  f->fd = -1;
}

void ShardWriter::write_segment(File& f, const Job& job, WorkerCtx& ctx) {
  SegmentRecord rec;
  rec.segment = job.id;
  rec.table = job.in.table;
  rec.rows = job.in.n;
  rec.offset = ctx.pos();
  if ((uint64_t)job.in.n <= UINT32_MAX)
    write_sorted<uint32_t>(job, ctx, rec);
  else
    write_sorted<uint64_t>(job, ctx, rec);
  f.records.push_back(std::move(rec));
}

template <class Idx>
void ShardWriter::write_sorted(const Job& job, WorkerCtx& ctx, SegmentRecord& rec) {
  if (job.in.num_rows > 0) {
    const RowRangeBucketer b((uint64_t)num_buckets_, (uint64_t)job.in.num_rows);
    write_sorted_by<Idx>(job, ctx, rec, b);
  } else if (job.in.id_range > 0) {
    const IdRangeBucketer b((uint64_t)num_buckets_, (uint64_t)job.in.id_range);
    write_sorted_by<Idx>(job, ctx, rec, b);
  } else {
    const Bucketer b((uint64_t)num_buckets_);
    write_sorted_by<Idx>(job, ctx, rec, b);
  }
}

template <class Idx, class Bucket>
void ShardWriter::write_sorted_by(const Job& job, WorkerCtx& ctx, SegmentRecord& rec, const Bucket& bucket) {
  const int64_t B = num_buckets_, n = job.in.n;
  const int64_t* ids = job.in.ids;

  // Stable counting sort on bucket -> permutation (the bucket is recomputed rather than stored).
  std::vector<int64_t> offsets((size_t)B + 1, 0);
  // Already in bucket order (a fixed-size table's row ranges under "row_range" buckets): the columns are
  // written from the caller's memory as they are, without gathering them into the staging buffer.
  bool in_order = true;
  // Format version 5: ids [id0, id0 + n) in order (every full save of a fixed-size table) need not be
  // stored, nor the directory, which follows from them.
  bool run = job.in.runs && job.in.num_rows > 0;
  for (int64_t i = 0, prev = 0; i < n; i++) {
    const int64_t b = (int64_t)bucket(ids[i]);
    in_order = in_order && b >= prev;
    run = run && ids[i] == ids[0] + i;
    prev = b;
    offsets[b + 1]++;
  }
  // Format version 4's directory: the non-empty buckets (uint32), then their first rows (uint32).
  std::vector<uint32_t> dir;
  for (int64_t b = 0; b < B; b++)
    if (offsets[b + 1] > 0) dir.push_back((uint32_t)b);
  const size_t k = dir.size();
  for (int64_t b = 1; b <= B; b++) offsets[b] += offsets[b - 1];
  dir.resize(2 * k);
  for (size_t j = 0; j < k; j++) dir[k + j] = (uint32_t)offsets[dir[j]];
  rec.first_bucket = k ? dir[0] : 0;
  rec.last_bucket = k ? dir[k - 1] : 0;
  std::unique_ptr<Idx[]> perm(new Idx[(size_t)std::max<int64_t>(n, 1)]);
  {
    std::vector<int64_t> pos(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < n; i++) perm[pos[bucket(ids[i])]++] = (Idx)i;
  }
  offsets = std::vector<int64_t>();

  rec.buckets_offset = ctx.pos();
  if (run) {
    rec.id0 = ids[0];
    rec.dir_entries = 0;
    rec.buckets_length = 0;
  } else {
    rec.dir_entries = (int64_t)k;
    rec.buckets_length = (int64_t)(8 * k);
    rec.buckets_crc = crc32c(0, dir.data(), (size_t)rec.buckets_length);
    ctx.append(dir.data(), (size_t)rec.buckets_length);
  }

  int64_t seg_bytes = 8 * n;
  for (int64_t rb : job.in.row_bytes) seg_bytes += rb * n;
  rec.packed = seg_bytes < kPackBelow;

  // Column 0, the ids (a run stores none), then each slot: one column, or one per column group.
  rec.columns.emplace_back();
  rec.columns[0].offset = ctx.pos();
  if (!run) write_column(ctx, reinterpret_cast<const uint8_t*>(ids), 8, 8, perm.get(), n, in_order, rec.columns[0]);
  for (size_t c = 0; c < job.in.columns.size(); c++) {
    check_stopping();
    const uint8_t* src = job.in.columns[c];
    const int64_t rb = job.in.row_bytes[c];
    const int64_t gb = c < job.in.group_bytes.size() ? job.in.group_bytes[c] : 0;
    // A slot begins aligned (unless packed); its other column groups follow directly (docs/FORMAT.md).
    if (rb * n > 0 && !rec.packed) ctx.pad_to(kColumnAlign);
    if (gb <= 0 || gb >= rb) {
      rec.columns.emplace_back();
      rec.columns.back().offset = ctx.pos();
      write_column(ctx, src, rb, rb, perm.get(), n, in_order, rec.columns.back());
    } else if (rb * n >= kGroupsBlockedMin && rb <= (int64_t)staging_bytes_) {
      // Blocks of whole rows, each gathered into one staging buffer: a row larger than the buffer would
      // overrun it, so such a slot goes group by group below.
      write_groups_blocked(ctx, src, rb, gb, perm.get(), n, rec.columns);
    } else {
      for (int64_t g0 = 0; g0 < rb; g0 += gb) {
        rec.columns.emplace_back();
        rec.columns.back().offset = ctx.pos();
        write_column(ctx, src + g0, rb, std::min(gb, rb - g0), perm.get(), n, in_order, rec.columns.back());
      }
    }
  }
  ctx.wait_direct();
}

// One column of n rows of w bytes, row i taken from src + perm[i] * stride (stride > w: one column group
// of a row-major slot); col.offset is set by the caller (after any padding).
template <class Idx>
void ShardWriter::write_column(WorkerCtx& ctx, const uint8_t* src, int64_t stride, int64_t w, const Idx* perm,
                               int64_t n, bool in_order, ColumnRecord& col) {
  col.length = w * n;
  col.step = column_step(col.length, chunk_bytes_);
  if (col.length == 0) return;
  col.crcs.reserve((size_t)((col.length + col.step - 1) / col.step));
  ChunkCrc crc(col.step, col.crcs);
  if (in_order && stride == w && col.length >= kDirectMin) {
    // One pass over the source for the checksums, block by block, each block written while the next
    // is checksummed (write_direct waits for the previous write).
    const uint8_t* p = src;
    for (int64_t left = col.length; left > 0;) {
      check_stopping();
      const int64_t m = std::min(left, kDirectBlock);
      crc.feed(p, m);
      ctx.write_direct(p, (size_t)m);
      p += m;
      left -= m;
    }
  } else if ((size_t)w > staging_bytes_) {
    // Rows larger than the staging buffer are written straight from the source.
    for (int64_t i = 0; i < n; i++) {
      check_stopping();
      const uint8_t* row = src + (size_t)perm[i] * stride;
      crc.feed(row, w);
      ctx.write_direct(row, (size_t)w);
    }
  } else {
    const int64_t rows_per_block = std::max<int64_t>(1, kCrcBlock / w);
    for (int64_t i = 0; i < n;) {
      check_stopping();
      size_t avail;
      uint8_t* stage = ctx.space(avail);
      const int64_t k = std::min<int64_t>(n - i, (int64_t)avail / w);
      if (k == 0) {  // the next row does not fit: write out what is staged
        ctx.flush();
        continue;
      }
      for (int64_t j = 0; j < k; j += rows_per_block) {
        const int64_t m = std::min(rows_per_block, k - j);
        uint8_t* dst = stage + j * w;
        gather_cols(dst, src, stride, w, perm + i + j, m);
        crc.feed(dst, m * w);
      }
      ctx.commit((size_t)(k * w));
      i += k;
    }
  }
  crc.end();
}

// A slot of rb bytes a row stored as column groups of gb bytes (the last narrower), large enough that one
// pass over the source per group would fetch every source row from memory once per group: instead blocks of
// rows are gathered into every group at once (a small run of source rows stays in cache across the groups),
// checksummed while hot, and each group's piece is written at its place in the file.
template <class Idx>
void ShardWriter::write_groups_blocked(WorkerCtx& ctx, const uint8_t* src, int64_t rb, int64_t gb, const Idx* perm,
                                       int64_t n, std::vector<ColumnRecord>& cols) {
  const int64_t ng = (rb + gb - 1) / gb;
  ctx.flush();  // what is staged goes first: the slot's bytes start at ctx.pos()
  const int64_t start = ctx.pos();
  auto width = [&](int64_t g) { return std::min(gb, rb - g * gb); };
  const size_t first = cols.size();
  cols.resize(first + (size_t)ng);
  std::vector<ChunkCrc> crcs;
  crcs.reserve((size_t)ng);
  for (int64_t g = 0; g < ng; g++) {
    ColumnRecord& col = cols[first + (size_t)g];
    col.offset = start + n * g * gb;
    col.length = width(g) * n;
    col.step = column_step(col.length, chunk_bytes_);
    col.crcs.reserve((size_t)((col.length + col.step - 1) / col.step));
    crcs.emplace_back(col.step, col.crcs);
  }
  const int64_t rows_per = std::max<int64_t>(1, (int64_t)staging_bytes_ / rb);
  const int64_t sub = std::max<int64_t>(1, kGatherSubBytes / rb);
  for (int64_t i0 = 0; i0 < n; i0 += rows_per) {
    check_stopping();
    const int64_t m = std::min(rows_per, n - i0);
    size_t avail;
    uint8_t* buf = ctx.space(avail);  // a whole free buffer: group g's m rows at buf + m * g * gb
    for (int64_t j = 0; j < m; j += sub) {
      const int64_t k = std::min(sub, m - j);
      for (int64_t g = 0; g < ng; g++) {
        const int64_t w = width(g);
        uint8_t* d = buf + m * g * gb + j * w;
        gather_cols(d, src + g * gb, rb, w, perm + i0 + j, k);
        crcs[(size_t)g].feed(d, k * w);
      }
    }
    std::vector<PwriteThread::Op> ops;
    ops.reserve((size_t)ng);
    for (int64_t g = 0; g < ng; g++)
      ops.push_back({buf + m * g * gb, (size_t)(m * width(g)), start + n * g * gb + i0 * width(g)});
    ctx.write_pieces(std::move(ops));
  }
  for (auto& c : crcs) c.end();
  ctx.skip_to(start + n * rb);
}

void ShardWriter::stop_and_join(bool discard) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (discard) stop_ = true;
    else closing_ = true;
  }
  work_cv_.notify_all();
  space_cv_.notify_all();
  for (auto& f : files_)
    if (f->thread.joinable()) f->thread.join();
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& f : files_) {
    for (auto& j : f->queue) {
      inflight_ -= j.bytes;
      if (j.in.done) j.in.done->store(true, std::memory_order_release);
    }
    f->queue.clear();
    f->queued_bytes = 0;
    if (f->fd >= 0) {  // a worker that never started
      ::close(f->fd);
      f->fd = -1;
    }
  }
  ended_ = true;
  space_cv_.notify_all();  // wait_done() callers see the dropped segments' flags
}

std::vector<std::vector<SegmentRecord>> ShardWriter::finish(bool fsync) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (ended_ || closing_) throw std::logic_error("ShardWriter: finish() after finish() or abort()");
    do_fsync_ = fsync;
  }
  stop_and_join(false);
  if (error_) throw OsError(*error_);
  std::vector<std::vector<SegmentRecord>> out;
  out.reserve(files_.size());
  for (auto& f : files_) out.push_back(std::move(f->records));
  return out;
}

void ShardWriter::wait_done(const std::atomic<bool>& done) {
  std::unique_lock<std::mutex> lk(mu_);
  // A failed writer may stop before it reaches a queued segment: report the failure rather than wait.
  space_cv_.wait(lk, [&] { return done.load(std::memory_order_acquire) || error_ || ended_; });
  if (error_) throw OsError(*error_);
  if (done.load(std::memory_order_acquire)) return;
  throw std::logic_error("ShardWriter: wait_done() on a segment that was never written");
}

void ShardWriter::abort() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (ended_) return;
  }
  stop_and_join(true);
}

}  // namespace recckpt
