#include "shard_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <set>
#include <utility>

#include "crc32c.h"
#include "fault.h"
#include "gather.h"
#include "hash.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "recckpt's shard format is little-endian; big-endian hosts are not supported"
#endif

namespace recckpt {
namespace {

constexpr size_t kStagingBytes = size_t(8) << 20;  // per-worker gather buffer
constexpr int64_t kCrcBlock = 256 << 10;           // gather this much, then checksum it while hot
constexpr size_t kMaxIo = size_t(1) << 30;         // largest single pwrite

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

ShardWriter::ShardWriter(const std::vector<std::string>& paths, int64_t num_buckets,
                         int64_t chunk_bytes, int64_t max_inflight_bytes)
    : num_buckets_(num_buckets), chunk_bytes_(chunk_bytes), max_inflight_(max_inflight_bytes) {
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

  std::set<std::pair<dev_t, ino_t>> inodes;
  auto close_all = [&] {
    for (auto& f : files_)
      if (f->fd >= 0) ::close(f->fd);
  };
  for (const auto& p : paths) {
    auto f = std::make_unique<File>();
    f->path = p;
    f->fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f->fd < 0) {
      int e = errno;
      close_all();
      throw OsError(e, p, "ShardWriter: cannot create file");
    }
    struct stat st;
    if (::fstat(f->fd, &st) == 0 && !inodes.insert({st.st_dev, st.st_ino}).second) {
      ::close(f->fd);
      close_all();
      throw std::invalid_argument("ShardWriter: path '" + p + "' is the same file as an earlier path");
    }
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
  int64_t b = 8 * (num_buckets_ + 1) + 8 * seg.n;
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

void ShardWriter::fail(File& f, const OsError& e) {
  f.failed = true;
  if (!error_) error_.emplace(e);
}

void ShardWriter::check_stopping() const {
  if (stop_.load(std::memory_order_relaxed)) throw StopRequested{};
}

void ShardWriter::write_all(File& f, const void* data, size_t n, int64_t off) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const int injected = fault::check(fault::kWrite);
    ssize_t w = injected ? (errno = injected, -1) : ::pwrite(f.fd, p, std::min(n, kMaxIo), (off_t)off);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw OsError(errno, f.path,
                    "ShardWriter: pwrite of " + std::to_string(n) + " bytes at offset " + std::to_string(off));
    }
    if (w == 0)
      throw OsError(EIO, f.path, "ShardWriter: pwrite wrote nothing at offset " + std::to_string(off));
    p += w;
    n -= (size_t)w;
    off += w;
  }
}

void ShardWriter::worker(File* f) {
  for (;;) {
    Job job;
    bool failed;
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] { return stop_ || closing_ || !f->queue.empty(); });
      if (stop_ || f->queue.empty()) break;
      job = std::move(f->queue.front());
      f->queue.pop_front();
      failed = f->failed;
    }
    if (!failed) {
      try {
        write_segment(*f, job);
      } catch (const OsError& e) {
        std::lock_guard<std::mutex> lk(mu_);
        fail(*f, e);
      } catch (const StopRequested&) {
      } catch (const std::bad_alloc&) {
        std::lock_guard<std::mutex> lk(mu_);
        fail(*f, OsError(ENOMEM, f->path,
                         "ShardWriter: allocating scratch for segment " + std::to_string(job.id)));
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(mu_);
        fail(*f, OsError(EIO, f->path, std::string("ShardWriter: ") + e.what()));
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
  // Exit: fsync (finish with fsync=True) and close, here so that files are synced in parallel.
  bool sync, failed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    sync = !stop_ && do_fsync_;
    failed = f->failed;
  }
  int injected = 0;
  if (sync && !failed && ((injected = fault::check(fault::kFsync)) != 0 || ::fsync(f->fd) != 0)) {
    int e = injected ? injected : errno;
    std::lock_guard<std::mutex> lk(mu_);
    fail(*f, OsError(e, f->path, "ShardWriter: fsync"));
  }
  if (::close(f->fd) != 0) {
    int e = errno;
    std::lock_guard<std::mutex> lk(mu_);
    if (!stop_) fail(*f, OsError(e, f->path, "ShardWriter: close"));
  }
  f->fd = -1;
}

void ShardWriter::write_segment(File& f, const Job& job) {
  SegmentRecord rec;
  rec.segment = job.id;
  rec.table = job.in.table;
  rec.rows = job.in.n;
  rec.offset = f.end;
  if ((uint64_t)job.in.n <= UINT32_MAX)
    write_sorted<uint32_t>(f, job, rec);
  else
    write_sorted<uint64_t>(f, job, rec);
  f.records.push_back(std::move(rec));
}

template <class Idx>
void ShardWriter::write_sorted(File& f, const Job& job, SegmentRecord& rec) {
  const int64_t B = num_buckets_, n = job.in.n;
  const int64_t* ids = job.in.ids;
  const Bucketer bucket((uint64_t)B);

  // Stable counting sort on bucket -> permutation (the bucket is recomputed rather than stored).
  std::vector<int64_t> offsets((size_t)B + 1, 0);
  for (int64_t i = 0; i < n; i++) offsets[bucket(ids[i]) + 1]++;
  for (int64_t b = 1; b <= B; b++) offsets[b] += offsets[b - 1];
  std::unique_ptr<Idx[]> perm(new Idx[(size_t)std::max<int64_t>(n, 1)]);
  {
    std::vector<int64_t> pos(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < n; i++) perm[pos[bucket(ids[i])]++] = (Idx)i;
  }

  int64_t off = f.end;
  rec.buckets_offset = off;
  rec.buckets_length = 8 * (B + 1);
  rec.buckets_crc = crc32c(0, offsets.data(), (size_t)rec.buckets_length);
  write_all(f, offsets.data(), (size_t)rec.buckets_length, off);
  off += rec.buckets_length;
  offsets = std::vector<int64_t>();

  std::unique_ptr<uint8_t[]> staging;
  const int64_t ncols = 1 + (int64_t)job.in.columns.size();
  rec.columns.resize((size_t)ncols);
  for (int64_t c = 0; c < ncols; c++) {
    check_stopping();
    const uint8_t* src = c == 0 ? reinterpret_cast<const uint8_t*>(ids) : job.in.columns[c - 1];
    const int64_t rb = c == 0 ? 8 : job.in.row_bytes[c - 1];
    ColumnRecord& col = rec.columns[c];
    col.offset = off;
    col.length = rb * n;
    if (col.length == 0) continue;
    col.crcs.reserve((size_t)((col.length + chunk_bytes_ - 1) / chunk_bytes_));
    ChunkCrc crc(chunk_bytes_, col.crcs);
    if ((size_t)rb > staging_bytes_) {
      // Rows larger than the staging buffer go straight from the source.
      for (int64_t i = 0; i < n; i++) {
        check_stopping();
        const uint8_t* row = src + (size_t)perm[i] * rb;
        crc.feed(row, rb);
        write_all(f, row, (size_t)rb, off);
        off += rb;
      }
    } else {
      if (!staging) staging.reset(new uint8_t[staging_bytes_]);
      const int64_t rows_per_stage = (int64_t)staging_bytes_ / rb;
      const int64_t rows_per_block = std::max<int64_t>(1, kCrcBlock / rb);
      for (int64_t i = 0; i < n;) {
        check_stopping();
        const int64_t k = std::min(rows_per_stage, n - i);
        for (int64_t j = 0; j < k; j += rows_per_block) {
          const int64_t m = std::min(rows_per_block, k - j);
          uint8_t* dst = staging.get() + j * rb;
          gather_rows(dst, src, rb, perm.get() + i + j, m);
          crc.feed(dst, m * rb);
        }
        write_all(f, staging.get(), (size_t)(k * rb), off);
        off += k * rb;
        i += k;
      }
    }
    crc.end();
  }
  f.end = off;
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

void ShardWriter::abort() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (ended_) return;
  }
  stop_and_join(true);
}

}  // namespace recckpt
