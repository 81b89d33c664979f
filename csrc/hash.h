// mix64 (splitmix64 finalizer) and bucket = mix64(id) mod B, as specified in docs/ENGINE.md.
#pragma once
#include <cstddef>
#include <cstdint>

namespace recckpt {

inline uint64_t mix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Key of one in-memory hash table (IdMap, the chain fold's table): where its ids' home slots lie.
// mix64 is invertible, so with homes taken from mix64(id) alone anyone can pick ids that share one
// home (mix64^-1(k * 4096) for k = 0, 1, ...: every insert probes past all earlier ones, quadratic).
// Each table therefore draws a random key (from a per-process random seed, see new_home_key), and
// its homes are the top bits of multiply-shift over a keyed mix: (mix64(id + add) * mul) >> (64 - bits)
// with mul odd. For any two distinct ids, random mul makes them share a home with probability about
// 2 / 2^bits (Dietzfelbinger et al., multiply-shift is universal), whatever ids an attacker chose
// without knowing the key; the add defeats precomputed structure for the same cost. The on-disk bucket
// (mix64(id) mod B) stays unkeyed: it is the format.
// Homes come from the TOP bits of the product. The ids of one bucket range (a rank's share of a
// table, a group of a chain fold) share the low bits of mix64(id); homes taken from low bits would
// crowd a fraction of the table into long probe runs (30-60x slower lookups on 8 ranks).
struct HomeKey {
  uint64_t add = 0;
  uint64_t mul = 1;  // odd
};

// A fresh key: a per-process seed drawn once from the OS, stepped for every call (each table its own).
HomeKey new_home_key();

// The keyed 64-bit hash of an id; its home in a table of 2^bits slots is home_of(hash, bits). Loops
// keep the hash (it does not change when a table grows) so that each id is hashed once.
inline uint64_t keyed_hash(int64_t id, const HomeKey& key) { return mix64((uint64_t)id + key.add) * key.mul; }
inline size_t home_of(uint64_t hash, int bits) { return bits ? (size_t)(hash >> (64 - bits)) : 0; }
inline size_t home_slot(int64_t id, const HomeKey& key, int bits) { return home_of(keyed_hash(id, key), bits); }

// n mod d for a fixed divisor d >= 1 without a hardware divide per call (Granlund & Montgomery,
// "Division by invariant integers using multiplication", fig. 4.1, N = 64). Exact for all uint64 n.
class FastMod {
 public:
  explicit FastMod(uint64_t d = 1) : d_(d) {
    if ((d & (d - 1)) == 0) {  // power of two (d >= 1)
      pow2_ = true;
      mask_ = d - 1;
      return;
    }
    int l = 64 - __builtin_clzll(d - 1);  // ceil(log2 d), 1 <= l <= 64
    unsigned __int128 two_l = (unsigned __int128)1 << l;
    m_ = (uint64_t)((((two_l - d) << 64) / d) + 1);
    sh1_ = 1;
    sh2_ = l - 1;
  }
  inline uint64_t operator()(uint64_t n) const {
    if (pow2_) return n & mask_;
    uint64_t t1 = (uint64_t)(((unsigned __int128)m_ * n) >> 64);
    uint64_t q = (t1 + ((n - t1) >> sh1_)) >> sh2_;
    return n - q * d_;
  }
  uint64_t divisor() const { return d_; }

 private:
  uint64_t d_;
  bool pow2_ = false;
  uint64_t mask_ = 0, m_ = 0;
  int sh1_ = 0, sh2_ = 0;
};

// bucket(id) = mix64(id) mod B, the id reinterpreted as uint64.
class Bucketer {
 public:
  explicit Bucketer(uint64_t num_buckets) : mod_(num_buckets) {}
  inline uint64_t operator()(int64_t id) const { return mod_(mix64((uint64_t)id)); }
  uint64_t num_buckets() const { return mod_.divisor(); }

 private:
  FastMod mod_;
};

// Format version 4's "row_range" bucket function of a fixed-size table of N rows (ids are row
// indices): bucket(row) = floor(row * B / N) for 0 <= row < N, so a row range is a bucket range.
class RowRangeBucketer {
 public:
  RowRangeBucketer(uint64_t num_buckets, uint64_t num_rows) : b_(num_buckets), n_(num_rows) {}
  inline uint64_t operator()(int64_t row) const {
    return (uint64_t)(((unsigned __int128)(uint64_t)row * b_) / n_);
  }
  bool contains(int64_t row) const { return row >= 0 && (uint64_t)row < n_; }

 private:
  uint64_t b_, n_;
};

// Format version 4's "id_range" bucket function of a table keyed by ids in [0, H) (TorchRec's managed-
// collision tables, H = input_hash_size, routed to ranks by id range): bucket(id) = floor(id * (B-1) / H)
// for 0 <= id < H, so an id range is a bucket range; every other id (negative, >= H) goes to the reserved
// last bucket B-1, which every loader reads. With B = 1 every id is in bucket 0.
class IdRangeBucketer {
 public:
  IdRangeBucketer(uint64_t num_buckets, uint64_t input_size) : b_(num_buckets), h_(input_size) {}
  inline uint64_t operator()(int64_t id) const {
    if (id < 0 || (uint64_t)id >= h_) return b_ - 1;
    return (uint64_t)(((unsigned __int128)(uint64_t)id * (b_ - 1)) / h_);
  }

 private:
  uint64_t b_, h_;
};

// Largest N a row_range table may have (docs/FORMAT.md): N < 2^40, so row * B < 2^64 for B < 2^24.
constexpr int64_t kMaxRowRangeRows = int64_t(1) << 40;

void bucket_of(const int64_t* ids, int64_t n, uint64_t num_buckets, int64_t* out);
// row_range buckets; an id outside [0, num_rows) gets -1.
void row_range_bucket_of(const int64_t* ids, int64_t n, uint64_t num_buckets, uint64_t num_rows, int64_t* out);
// id_range buckets over [0, input_size) (every id has one).
void id_range_bucket_of(const int64_t* ids, int64_t n, uint64_t num_buckets, uint64_t input_size, int64_t* out);

}  // namespace recckpt
