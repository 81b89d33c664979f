// ShardWriter: bucket-sorted segment writes, one worker thread per file (see docs/ENGINE.md).
// Pure C++: the caller keeps the input buffers alive until the segment's `done` flag is set.
#pragma once
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "os_error.h"

namespace recckpt {

// Format version 2: every non-empty slot column starts at a file offset that is a multiple of this,
// preceded by zero padding (docs/FORMAT.md). 4096 is the page size of the machines we map on.
constexpr int64_t kColumnAlign = 4096;
// Format version 4: a segment smaller than this (n * (8 + slot row bytes)) is packed: no alignment
// padding (layout.PACK_BELOW, which a test keeps equal).
constexpr int64_t kPackBelow = int64_t(64) << 10;
// Format version 4: the checksum step of a column of `length` bytes (layout.checksum_step):
// min(C, max(512, the power of two at or above ceil(length / 64))).
int64_t column_step(int64_t length, int64_t chunk_bytes);

struct ColumnRecord {
  int64_t offset = 0;  // absolute file offset of the column's first byte
  int64_t length = 0;  // bytes
  int64_t step = 0;    // bytes per checksum (column_step)
  std::vector<uint32_t> crcs;  // crc32c of each `step` piece of the column
};

struct SegmentRecord {
  int64_t segment = 0, table = 0, rows = 0, offset = 0;
  int64_t buckets_offset = 0, buckets_length = 0;  // the bucket directory: 8 * dir_entries bytes
  uint32_t buckets_crc = 0;
  int64_t dir_entries = 0, first_bucket = 0, last_bucket = 0;
  bool packed = false;
  int64_t id0 = -1;  // format version 5: >= 0 when the segment is a row run (no ids, no directory written)
  std::vector<ColumnRecord> columns;  // column 0 = the ids (empty in a run), then each column (group) in order
};

struct SegmentInput {
  int64_t table = 0;
  const int64_t* ids = nullptr;
  int64_t n = 0;
  std::vector<const uint8_t*> columns;  // each C-contiguous [n, row_bytes]
  std::vector<int64_t> row_bytes;
  int64_t num_rows = 0;  // > 0: the table's "row_range" bucket function over N rows; 0: "hash"
  int64_t id_range = 0;  // > 0 (num_rows 0): the "id_range" bucket function over ids [0, H)
  // Per column: > 0 stores it as column groups of this many bytes of each row (the last group narrower
  // when it does not divide the row; format version 5), 0 as one column of whole rows.
  std::vector<int64_t> group_bytes;
  // Format version 5: a "row_range" segment (num_rows > 0) whose ids are one run [id0, id0 + n) in
  // order is written as a row run: no ids column, no bucket directory.
  bool runs = false;
  // Set (release) once the writer no longer reads the buffers: written, discarded or rejected.
  std::shared_ptr<std::atomic<bool>> done;
};

class ShardWriter {
 public:
  // Creates (truncates) every path and starts one worker per path. Throws OsError.
  // writeback: start writing each staged block back to the device as soon as it is written (PwriteThread),
  // for writers that finish(fsync=true).
  ShardWriter(const std::vector<std::string>& paths, int64_t num_buckets, int64_t chunk_bytes,
              int64_t max_inflight_bytes, bool writeback = false);
  ~ShardWriter();  // aborts if neither finish() nor abort() was called
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Queues a segment (blocking while too many bytes are in flight) and returns its id. Throws the
  // first worker failure (OsError), or std::logic_error after finish()/abort().
  int64_t submit(SegmentInput seg);
  // Waits for every segment, fsyncs (optionally) and closes every file; records per file in file order.
  std::vector<std::vector<SegmentRecord>> finish(bool fsync);
  // Stops the workers (dropping queued segments) and closes the files, keeping them.
  void abort();
  // Blocks until `done` (a submitted segment's flag) is set: the writer no longer reads that segment's
  // buffers, which the caller may then reuse. Throws the first worker failure (OsError) instead, as
  // soon as there is one (the caller's output is lost then), and std::logic_error if the writer ended
  // without setting the flag.
  void wait_done(const std::atomic<bool>& done);

  int64_t segment_bytes(const SegmentInput& seg) const;
  int64_t num_buckets() const { return num_buckets_; }

 private:
  struct Job {
    SegmentInput in;
    int64_t id = 0;
    int64_t bytes = 0;
  };
  struct File {
    File() = default;
    File(const File&) = delete;
    File& operator=(const File&) = delete;
    ~File() {  // a constructor that throws midway closes what it opened (the writer closes and resets fd)
      if (fd >= 0) ::close(fd);
    }
    std::string path;
    int fd = -1;
    std::deque<Job> queue;
    int64_t queued_bytes = 0;  // queued + being written
    bool failed = false;
    std::optional<OsError> oom;  // made with the file: its error when there is no memory to make one
    std::vector<SegmentRecord> records;  // worker-owned until joined
    std::thread thread;
  };

  struct WorkerCtx;  // a worker's pwrite thread and staging buffers
  void worker(File* f);
  void write_segment(File& f, const Job& job, WorkerCtx& ctx);  // throws OsError
  template <class Idx>
  void write_sorted(const Job& job, WorkerCtx& ctx, SegmentRecord& rec);
  template <class Idx, class Bucket>
  void write_sorted_by(const Job& job, WorkerCtx& ctx, SegmentRecord& rec, const Bucket& bucket);
  template <class Idx>
  void write_column(WorkerCtx& ctx, const uint8_t* src, int64_t stride, int64_t w, const Idx* perm, int64_t n,
                    bool in_order, ColumnRecord& col);
  template <class Idx>
  void write_groups_blocked(WorkerCtx& ctx, const uint8_t* src, int64_t rb, int64_t gb, const Idx* perm,
                            int64_t n, std::vector<ColumnRecord>& cols);
  // Mark f failed, the writer's error (if it is the first) naming f. They take mu_ and never throw: the
  // worker calls them from its catch blocks, and an exception leaving a worker thread would std::terminate
  // the process (the training job) instead of failing the save.
  void fail_current(File& f) noexcept;  // with the exception being handled
  void fail_errno(File& f, int err, const char* op) noexcept;
  void stop_and_join(bool discard);
  void check_stopping() const;

  const int64_t num_buckets_, chunk_bytes_, max_inflight_;
  const bool writeback_;
  std::vector<std::unique_ptr<File>> files_;
  std::mutex mu_;
  std::condition_variable work_cv_, space_cv_;
  int64_t inflight_ = 0;
  int64_t next_segment_ = 0;
  size_t next_file_ = 0;  // round-robin start for ties
  bool closing_ = false;      // finish(): drain queues then exit
  bool do_fsync_ = false;
  std::atomic<bool> stop_{false};  // abort(): exit as soon as possible
  bool ended_ = false;        // finish() or abort() ran
  std::optional<OsError> error_;  // first failure
  size_t staging_bytes_ = 0;
};

}  // namespace recckpt
