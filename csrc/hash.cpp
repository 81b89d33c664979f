#include "hash.h"

namespace recckpt {

void bucket_of(const int64_t* ids, int64_t n, uint64_t num_buckets, int64_t* out) {
  const Bucketer b(num_buckets);
  for (int64_t i = 0; i < n; i++) out[i] = (int64_t)b(ids[i]);
}

void row_range_bucket_of(const int64_t* ids, int64_t n, uint64_t num_buckets, uint64_t num_rows, int64_t* out) {
  const RowRangeBucketer b(num_buckets, num_rows);
  for (int64_t i = 0; i < n; i++) out[i] = b.contains(ids[i]) ? (int64_t)b(ids[i]) : -1;
}

}  // namespace recckpt
