// Content digests of table rows (docs/FORMAT.md, "Content digests"): a sum mod 2^64, in two lanes
// with independent hash functions, of one hash per (id, element position, element value). A sum does
// not depend on the order of the rows, nor on how they are split between workers, segments or chunks,
// nor (with a column window) on which columns of a column-split slot each worker holds.
#pragma once
#include <cstdint>
#include <vector>

namespace recckpt {

struct Digest128 {
  uint64_t a = 0, b = 0;
  Digest128& operator+=(const Digest128& o) {
    a += o.a;
    b += o.b;
    return *this;
  }
};

// The row keys: lane a's by mix64 (splitmix64's finalizer, hash.h), lane b's by MurmurHash3's fmix64.
// The element terms are mulsum128's (digest.cpp, term_a/term_b).
constexpr uint64_t kDigestSeedA = 0x243F6A8885A308D3ull;  // row key of lane a: mix64(id ^ seed)
constexpr uint64_t kDigestSeedB = 0x13198A2E03707344ull;
constexpr uint64_t kDigestStepA = 0x9E3779B97F4A7C15ull;  // element e of a row: key + e * step
constexpr uint64_t kDigestStepB = 0xD6E8FEB86659FD93ull;

inline uint64_t fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  return x ^ (x >> 33);
}

// One slot column as the caller holds it: n rows of `row_bytes` bytes, elements of `itemsize` bytes
// (1, 2, 4 or 8; little-endian). The logical row is [..., full] elements; these rows hold elements
// [first, first + width) of its last dimension (width == full, first == 0: whole rows), so a held row
// is (row_bytes / itemsize / width) blocks of `width` elements.
struct DigestColumn {
  const uint8_t* data = nullptr;
  int64_t row_bytes = 0;
  int itemsize = 1;
  int64_t width = 0;
  int64_t full = 0;
  int64_t first = 0;
};

// Checks a column's geometry; returns an error message, empty when valid.
const char* digest_column_error(const DigestColumn& c);

// Adds the digests of rows [0, n) to out[0] (the ids) and out[1 + k] (column k), using up to `threads`
// threads for large inputs. Columns must be valid (digest_column_error) and hold n rows each.
void row_digests(const int64_t* ids, int64_t n, const std::vector<DigestColumn>& cols, Digest128* out,
                 int threads);

}  // namespace recckpt
