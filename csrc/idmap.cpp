#include "idmap.h"

#include <stdexcept>

#include "hash.h"

namespace recckpt {
namespace {
constexpr size_t kMinSlots = 16;
// Maximum load factor 5/8: linear probing stays short, and a presized map is at most ~0.63 full.
inline size_t max_load(size_t slots) { return slots / 8 * 5; }
constexpr int64_t kPrefetch = 16;  // hash this many ids ahead and prefetch their slots (a power of two)

// The keyed hashes of the next kPrefetch ids of a loop: each id is hashed once, when its home slot is
// prefetched, and the hash is kept for its turn (the hash does not depend on the table's size, so it
// survives a rehash; the home is taken from it with the current bits).
class HashAhead {
 public:
  HashAhead(const int64_t* ids, int64_t n, const HomeKey& key) : ids_(ids), n_(n), key_(key) {
    for (int64_t j = 0; j < n && j < kPrefetch; j++) ring_[j] = keyed_hash(ids[j], key);
  }
  // The hash of ids[j] (j = 0, 1, ... in turn); hashes ids[j + kPrefetch] and prefetches its home.
  uint64_t next(int64_t j, const int64_t* slots, int bits) {
    uint64_t& cell = ring_[j & (kPrefetch - 1)];
    const uint64_t h = cell;
    if (j + kPrefetch < n_) {
      cell = keyed_hash(ids_[j + kPrefetch], key_);
      __builtin_prefetch(slots + home_of(cell, bits));
    }
    return h;
  }

 private:
  const int64_t* ids_;
  int64_t n_;
  HomeKey key_;
  uint64_t ring_[kPrefetch];
};
}  // namespace

IdMap::IdMap(int64_t capacity) : key_(new_home_key()) {
  if (capacity < 0) throw std::invalid_argument("IdMap capacity must be >= 0");
  rehash(slots_for((size_t)capacity));
  keys_.reserve((size_t)capacity);
}

size_t IdMap::slots_for(size_t n) const {
  size_t s = kMinSlots;
  while (max_load(s) < n) {
    if (s > (SIZE_MAX >> 2)) throw std::length_error("IdMap capacity too large");
    s <<= 1;
  }
  return s;
}

void IdMap::rehash(size_t new_slots) {
  slots_.assign(new_slots, -1);
  mask_ = new_slots - 1;
  bits_ = 0;
  while (((size_t)1 << bits_) < new_slots) bits_++;
  grow_at_ = max_load(new_slots);
  const int64_t n = (int64_t)keys_.size();
  const int64_t* k = keys_.data();
  int64_t* s = slots_.data();
  for (int64_t r = 0; r < n; r++) {
    size_t i = home_slot(k[r], key_, bits_);
    while (s[i] >= 0) i = (i + 1) & mask_;
    s[i] = r;
  }
}

void IdMap::reserve(int64_t n) {
  if (n < 0) throw std::invalid_argument("IdMap.reserve: n must be >= 0");
  size_t want = slots_for((size_t)n);
  if (want > slots_.size()) rehash(want);
  keys_.reserve((size_t)n);
}

void IdMap::clear() {
  keys_.clear();
  std::fill(slots_.begin(), slots_.end(), -1);
}

void IdMap::lookup(const int64_t* ids, int64_t n, int64_t* rows) const {
  const int64_t* s = slots_.data();
  const int64_t* k = keys_.data();
  const size_t mask = mask_;
  const int bits = bits_;
  const HomeKey key = key_;
  HashAhead ahead(ids, n, key);
  for (int64_t j = 0; j < n; j++) {
    size_t i = home_of(ahead.next(j, s, bits), bits);
    const int64_t id = ids[j];
    int64_t r;
    while ((r = s[i]) >= 0 && k[r] != id) i = (i + 1) & mask;
    rows[j] = r;  // -1 when the probe reached an empty slot
  }
}

int64_t IdMap::probes(const int64_t* ids, int64_t n) const {
  const int64_t* s = slots_.data();
  const int64_t* k = keys_.data();
  int64_t total = 0;
  for (int64_t j = 0; j < n; j++) {
    size_t i = home_slot(ids[j], key_, bits_);
    total++;
    while (s[i] >= 0 && k[s[i]] != ids[j]) {
      i = (i + 1) & mask_;
      total++;
    }
  }
  return total;
}

void IdMap::insert(const int64_t* ids, int64_t n, int64_t* rows, uint8_t* is_new) {
  HashAhead ahead(ids, n, key_);
  for (int64_t j = 0; j < n; j++) {
    int64_t* s = slots_.data();
    const uint64_t h = ahead.next(j, s, bits_);
    const int64_t id = ids[j];
    const int64_t* k = keys_.data();
    size_t i = home_of(h, bits_);
    int64_t r;
    while ((r = s[i]) >= 0 && k[r] != id) i = (i + 1) & mask_;
    if (r >= 0) {
      rows[j] = r;
      is_new[j] = 0;
      continue;
    }
    if (keys_.size() + 1 > grow_at_) {
      rehash(slots_.size() * 2);
      s = slots_.data();
      i = home_of(h, bits_);
      while (s[i] >= 0) i = (i + 1) & mask_;
    }
    r = (int64_t)keys_.size();
    keys_.push_back(id);
    s[i] = r;
    rows[j] = r;
    is_new[j] = 1;
  }
}

int64_t IdMap::insert_new(const int64_t* ids, int64_t n) {
  if (n <= 0) return 0;
  reserve((int64_t)keys_.size() + n);  // one rehash at most, none inside the loop
  int64_t* s = slots_.data();
  const size_t mask = mask_;
  const int bits = bits_;
  const HomeKey key = key_;
  HashAhead ahead(ids, n, key);
  for (int64_t j = 0; j < n; j++) {
    size_t i = home_of(ahead.next(j, s, bits), bits);
    const int64_t id = ids[j];
    const int64_t* k = keys_.data();
    int64_t r;
    while ((r = s[i]) >= 0 && k[r] != id) i = (i + 1) & mask;
    if (r >= 0) return j;
    s[i] = (int64_t)keys_.size();
    keys_.push_back(id);  // capacity reserved above: never reallocates
  }
  return n;
}

}  // namespace recckpt
