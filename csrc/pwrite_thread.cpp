#include "pwrite_thread.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

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
      throw OsError(errno, path,
                    "ShardWriter: pwrite of " + std::to_string(n) + " bytes at offset " + std::to_string(off));
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
    const void* d = data_;
    const size_t n = n_;
    const int64_t off = off_;
    lk.unlock();
    std::optional<OsError> err;
    try {
      pwrite_all(fd_, path_, d, n, off);
#ifdef SYNC_FILE_RANGE_WRITE
      // Advice only: a failure to start the writeback (or of the writeback itself) is the final fsync's to report.
      if (writeback_) (void)::sync_file_range(fd_, (off_t)off, (off_t)n, SYNC_FILE_RANGE_WRITE);
#endif
    } catch (const OsError& e) {
      err.emplace(e);
    }
    lk.lock();
    if (err && !error_) error_ = std::move(err);
    busy_ = false;
    cv_.notify_all();
  }
}

void PwriteThread::write(const void* data, size_t n, int64_t off) {
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return !busy_; });
    rethrow_error_locked();
    data_ = data;
    n_ = n;
    off_ = off;
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
  if (!error_) return;
  OsError e = *error_;
  error_.reset();
  throw e;
}

}  // namespace recckpt
