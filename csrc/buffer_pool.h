// Large scratch buffers kept between writers. A save of a small model makes a new ShardWriter every few
// seconds; each of its files stages rows in two 8 MiB buffers. Fresh buffers cost a page fault and a
// page clear for every 4 KiB on their first fill: about a fifth of the CPU of a 40 MB save. Buffers that a
// writer gives back are kept, up to kIdleBytes in all, for the next writer of the process.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

namespace recckpt {

class PooledBuffer {
 public:
  PooledBuffer() = default;
  ~PooledBuffer() { give_back(); }
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  // Holds a buffer of exactly `bytes`: a kept one, else a new one (throws bad_alloc).
  void acquire(size_t bytes);
  // Back to the pool (the oldest idle buffers freed to make room), or freed when larger than the pool.
  void give_back();
  uint8_t* get() const { return data_.get(); }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t bytes_ = 0;
};

// Most bytes of idle buffers the process keeps: four files' two staging buffers.
constexpr size_t kIdleBytes = size_t(64) << 20;

struct PoolStats {
  size_t idle_bytes = 0;  // held now
  uint64_t fresh = 0;     // buffers allocated, since the process started
  uint64_t reused = 0;    // buffers handed out again
};
PoolStats pool_stats();
// Frees every idle buffer (a process that wants its memory back between saves).
void release_pooled_buffers();
// Creates the pool (and registers its fork handlers) now. Called when the module loads, before any writer
// thread exists: a fork while another thread was still creating it would leave the child's copy of the
// half-made static waiting forever.
void init_buffer_pool();
// Tests: holds the pool's lock on a thread of its own for `ms` milliseconds; returns once it is held.
void hold_pool_lock_for(int ms);

}  // namespace recckpt
