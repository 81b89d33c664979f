// A call's worker threads: `work` run on up to n threads, this one included. A thread that cannot be
// started (system_error) leaves its share to those running: work() must take its items from a shared
// queue (the readers' atomic next item), so that any number of threads finishes it.
#pragma once
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace recckpt {

template <class Work>
void run_workers(int64_t n, Work&& work) {
  if (n <= 1) {
    work();
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve((size_t)n - 1);
  try {
    for (int64_t t = 1; t < n; t++) pool.emplace_back([&work] { work(); });
  } catch (const std::system_error&) {
    // could not start more threads: the ones running (and this one) do the work
  }
  work();
  for (auto& t : pool) t.join();
}

}  // namespace recckpt
