#include "hash.h"

#include <atomic>
#include <random>

namespace recckpt {

namespace {
uint64_t process_seed() {
  std::random_device rd;  // getrandom(2) on Linux
  return ((uint64_t)rd() << 32) ^ (uint64_t)rd();
}
}  // namespace

HomeKey new_home_key() {
  static const uint64_t seed = process_seed();
  static std::atomic<uint64_t> counter{0};
  // Two outputs of splitmix64 from the seed: independent-looking words for distinct calls.
  const uint64_t n = counter.fetch_add(2, std::memory_order_relaxed);
  HomeKey k;
  k.add = mix64(seed + n * 0x9E3779B97F4A7C15ull);
  k.mul = mix64(seed + (n + 1) * 0x9E3779B97F4A7C15ull) | 1;
  return k;
}

void bucket_of(const int64_t* ids, int64_t n, uint64_t num_buckets, int64_t* out) {
  const Bucketer b(num_buckets);
  for (int64_t i = 0; i < n; i++) out[i] = (int64_t)b(ids[i]);
}

void row_range_bucket_of(const int64_t* ids, int64_t n, uint64_t num_buckets, uint64_t num_rows, int64_t* out) {
  const RowRangeBucketer b(num_buckets, num_rows);
  for (int64_t i = 0; i < n; i++) out[i] = b.contains(ids[i]) ? (int64_t)b(ids[i]) : -1;
}

void id_range_bucket_of(const int64_t* ids, int64_t n, uint64_t num_buckets, uint64_t input_size, int64_t* out) {
  const IdRangeBucketer b(num_buckets, input_size);
  for (int64_t i = 0; i < n; i++) out[i] = (int64_t)b(ids[i]);
}

}  // namespace recckpt
