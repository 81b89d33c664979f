// PwriteThread: one background pwrite at a time, so a worker can gather the next staging buffer
// while the previous one is being written. A background write's exception (an OsError, or std::bad_alloc
// where building one ran out of memory) is thrown by the next write()/wait(), on the caller's thread.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "os_error.h"

namespace recckpt {

// Writes all n bytes at off (retrying short writes and EINTR); throws OsError naming `path`.
void pwrite_all(int fd, const std::string& path, const void* data, size_t n, int64_t off);

class PwriteThread {
 public:
  // writeback: once a write is done, start writing its range back to the device (sync_file_range with
  // SYNC_FILE_RANGE_WRITE, which does not wait for it), so that a final fsync finds little left to write:
  // a save then takes about as long as the device needs, not the writes plus the device. For files that
  // are fsynced at the end anyway; without a final fsync it would only make the kernel write earlier.
  PwriteThread(int fd, std::string path, bool writeback = false);
  ~PwriteThread();  // waits for the write in progress
  PwriteThread(const PwriteThread&) = delete;
  PwriteThread& operator=(const PwriteThread&) = delete;

  struct Op {
    const void* data;
    size_t n;
    int64_t off;
  };
  // Waits for the previous write, then starts writing [data, data+n) at off in the background. The
  // caller keeps the bytes unchanged until the next write() or wait() returns.
  void write(const void* data, size_t n, int64_t off);
  // The same for several pieces, written in order (column groups of one block of rows go to as many
  // places in the file).
  void write_many(std::vector<Op> ops);
  // Waits until no write is in progress; throws the first exception of a background write (once).
  void wait();

 private:
  void rethrow_error_locked();
  void run();

  const int fd_;
  const std::string path_;
  const bool writeback_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Op> ops_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace recckpt
