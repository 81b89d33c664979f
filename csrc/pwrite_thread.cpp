#include "pwrite_thread.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <new>
#include <utility>

#include "fault.h"

namespace recckpt {

void pwrite_all(int fd, const std::string& path, const void* data, size_t n, int64_t off) {
  constexpr size_t kMaxIo = size_t(1) << 30;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const int injected = fault::check(fault::kWrite);  // test hook; one relaxed load when off
    ssize_t w = injected ? (errno = injected, -1) : ::pwrite(fd, p, std::min(n, kMaxIo), (off_t)off);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      if (fault::check(fault::kAlloc)) throw std::bad_alloc();  // test hook: the message needs memory
      throw OsError(e, path, "ShardWriter: pwrite of " + std::to_string(n) + " bytes at offset " + std::to_string(off));
    }
    if (w == 0) throw OsError(EIO, path, "ShardWriter: pwrite wrote nothing at offset " + std::to_string(off));
    p += w;
    n -= (size_t)w;
    off += w;
  }
}

PwriteThread::PwriteThread(int fd, std::string path, bool writeback)
    : fd_(fd), path_(std::move(path)), writeback_(writeback) {
  thread_ = std::thread(&PwriteThread::run, this);
}

PwriteThread::~PwriteThread() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return !busy_; });
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void PwriteThread::run() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || busy_; });
    if (!busy_) return;  // stop_ and idle
    std::vector<Op> ops = std::move(ops_);
    lk.unlock();
    std::exception_ptr err;
    try {
      for (const Op& op : ops) {
        pwrite_all(fd_, path_, op.data, op.n, op.off);
#ifdef SYNC_FILE_RANGE_WRITE
        // Advice only: a failure to start the writeback (or of the writeback itself) is the final fsync's to report.
        if (writeback_) (void)::sync_file_range(fd_, (off_t)op.off, (off_t)op.n, SYNC_FILE_RANGE_WRITE);
#endif
      }
    } catch (...) {
      // Anything, not only OsError: one leaving this thread would std::terminate the process (the training
      // job) instead of failing the save. Taking it needs no memory; the caller makes it the file's error.
      err = std::current_exception();
    }
    lk.lock();
    if (err && !error_) error_ = std::move(err);
    busy_ = false;
    cv_.notify_all();
  }
}

void PwriteThread::write(const void* data, size_t n, int64_t off) {
  if (fault::check(fault::kAlloc)) throw std::bad_alloc();  // test hook: as making the vector can
  write_many({Op{data, n, off}});
}

void PwriteThread::write_many(std::vector<Op> ops) {
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return !busy_; });
    rethrow_error_locked();
    ops_ = std::move(ops);
    busy_ = true;
  }
  cv_.notify_all();
}

void PwriteThread::wait() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return !busy_; });
  rethrow_error_locked();
}

// The error of the last write, reported once (to the next write() or wait()); mu_ is held.
void PwriteThread::rethrow_error_locked() {
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

}  // namespace recckpt
