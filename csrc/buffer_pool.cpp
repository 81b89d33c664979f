#include "buffer_pool.h"

#include <pthread.h>

#include <chrono>
#include <future>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace recckpt {
namespace {

struct Idle {
  std::unique_ptr<uint8_t[]> data;
  size_t bytes;
};

// Never destroyed: a writer thread may give a buffer back while the process exits.
struct Pool {
  std::mutex mu;
  std::vector<Idle> idle;  // most recently given back last
  size_t idle_bytes = 0;
  uint64_t fresh = 0, reused = 0;
  Pool() {
    // A fork while another thread holds the lock would leave the child's copy locked forever.
    pthread_atfork([] { get().mu.lock(); }, [] { get().mu.unlock(); }, [] { get().mu.unlock(); });
  }
  static Pool& get() {
    static Pool* p = new Pool;
    return *p;
  }
};

}  // namespace

void PooledBuffer::acquire(size_t bytes) {
  give_back();
  bytes_ = bytes;
  Pool& p = Pool::get();
  {
    std::lock_guard<std::mutex> lk(p.mu);
    for (size_t i = p.idle.size(); i-- > 0;)
      if (p.idle[i].bytes == bytes) {
        data_ = std::move(p.idle[i].data);
        p.idle.erase(p.idle.begin() + (std::ptrdiff_t)i);
        p.idle_bytes -= bytes;
        p.reused++;
        return;
      }
  }
  data_.reset(new uint8_t[bytes]);
  std::lock_guard<std::mutex> lk(p.mu);
  p.fresh++;
}

void PooledBuffer::give_back() {
  if (!data_) return;
  if (bytes_ > kIdleBytes) {
    data_.reset();
    return;
  }
  Pool& p = Pool::get();
  std::vector<Idle> dropped;  // freed after the lock is released
  std::lock_guard<std::mutex> lk(p.mu);
  try {
    while (p.idle_bytes + bytes_ > kIdleBytes && !p.idle.empty()) {
      dropped.push_back(std::move(p.idle.front()));
      p.idle_bytes -= dropped.back().bytes;
      p.idle.erase(p.idle.begin());
    }
    p.idle.push_back({std::move(data_), bytes_});
    p.idle_bytes += bytes_;
  } catch (const std::bad_alloc&) {
    // No memory to keep it: freed instead. This runs in ~PooledBuffer as a writer thread ends, where an
    // exception would std::terminate the process.
    data_.reset();
  }
}

PoolStats pool_stats() {
  Pool& p = Pool::get();
  std::lock_guard<std::mutex> lk(p.mu);
  return {p.idle_bytes, p.fresh, p.reused};
}

void release_pooled_buffers() {
  std::vector<Idle> drop;
  Pool& p = Pool::get();
  std::lock_guard<std::mutex> lk(p.mu);
  drop.swap(p.idle);
  p.idle_bytes = 0;
}

void init_buffer_pool() { (void)Pool::get(); }

void hold_pool_lock_for(int ms) {
  std::promise<void> held;
  std::future<void> ready = held.get_future();
  std::thread([ms, held = std::move(held)]() mutable {  // the promise lives on the thread that sets it
    Pool& p = Pool::get();
    std::lock_guard<std::mutex> lk(p.mu);
    held.set_value();
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  }).detach();
  ready.wait();
}

}  // namespace recckpt
