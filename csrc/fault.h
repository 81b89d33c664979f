// Test-only fault injection for the engine: "fail the N-th pwrite (or fsync, or column mmap, or O_DIRECT
// read) from now with errno E". Lets tests prove that a full disk or an I/O error in the middle of writing
// shard files fails the save cleanly, that a mapped load whose mmap fails falls back to reading, and that a
// direct read the file system refuses falls back to the page cache (and, with "cachestat", that a kernel
// without the cachestat system call is asked with mincore instead). "sweep" counts (and fails) the sequential
// reads that bring a cold strided read's files into the page cache ahead of its workers. "alloc" throws
// std::bad_alloc at the writer's allocation points: where a pwrite's error message is built (in the pwrite
// thread, or in the worker for small writes) and where PwriteThread::write makes its vector of one write;
// it proves that running out of memory in a writer thread fails the save instead of ending the process.
// "setup" throws std::bad_alloc in a ShardWriter's constructor right after it opened its N-th file, as its
// allocations there could: it proves a constructor that fails midway closes every file it opened.
// Off by default; when off, a check is one relaxed atomic load and increment.
#pragma once
#include <atomic>
#include <cstdint>

namespace recckpt {
namespace fault {

enum Op { kWrite = 0, kFsync = 1, kMmap = 2, kDirect = 3, kCachestat = 4, kSweep = 5, kAlloc = 6, kSetup = 7,
          kNumOps = 8 };

struct Slot {
  std::atomic<int64_t> seen{0};     // operations of this kind since the last arm() (always counted)
  std::atomic<int64_t> fail_at{0};  // 1-based operation number to fail; 0 = off
  std::atomic<int> err{0};          // errno to fail with
};

inline Slot* slots() {
  static Slot s[kNumOps];
  return s;
}

// Counts one operation; returns the errno it must fail with, or 0.
inline int check(Op op) {
  Slot& s = slots()[op];
  const int64_t n = s.seen.fetch_add(1, std::memory_order_relaxed) + 1;
  const int64_t at = s.fail_at.load(std::memory_order_relaxed);
  return (at != 0 && n == at) ? s.err.load(std::memory_order_relaxed) : 0;
}

inline void arm(Op op, int64_t fail_at, int err) {
  Slot& s = slots()[op];
  s.fail_at.store(0, std::memory_order_relaxed);
  s.seen.store(0, std::memory_order_relaxed);
  s.err.store(err, std::memory_order_relaxed);
  s.fail_at.store(fail_at, std::memory_order_relaxed);
}

inline int64_t seen(Op op) { return slots()[op].seen.load(std::memory_order_relaxed); }

}  // namespace fault
}  // namespace recckpt
