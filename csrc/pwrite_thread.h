// PwriteThread: one background pwrite at a time, so a worker can gather the next staging buffer
// while the previous one is being written. Errors surface (as OsError) at the next write()/wait().
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

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

  // Waits for the previous write, then starts writing [data, data+n) at off in the background. The
  // caller keeps the bytes unchanged until the next write() or wait() returns.
  void write(const void* data, size_t n, int64_t off);
  // Waits until no write is in progress; throws the first error of a background write (once).
  void wait();

 private:
  void rethrow_error_locked();
  void run();

  const int fd_;
  const std::string path_;
  const bool writeback_;
  std::mutex mu_;
  std::condition_variable cv_;
  const void* data_ = nullptr;
  size_t n_ = 0;
  int64_t off_ = 0;
  bool busy_ = false, stop_ = false;
  std::optional<OsError> error_;
  std::thread thread_;
};

}  // namespace recckpt
