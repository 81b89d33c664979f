#include "idmap.h"

#include <stdexcept>

#include "hash.h"

namespace recckpt {
namespace {
constexpr size_t kMinSlots = 16;
// Maximum load factor 5/8: linear probing stays short, and a presized map is at most ~0.63 full.
inline size_t max_load(size_t slots) { return slots / 8 * 5; }
constexpr int64_t kPrefetch = 16;  // hash this many ids ahead and prefetch their slots
}  // namespace

IdMap::IdMap(int64_t capacity) {
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
    size_t i = home_slot(mix64((uint64_t)k[r]), bits_);
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
  for (int64_t j = 0; j < n; j++) {
    if (j + kPrefetch < n)
      __builtin_prefetch(s + home_slot(mix64((uint64_t)ids[j + kPrefetch]), bits));
    const int64_t id = ids[j];
    size_t i = home_slot(mix64((uint64_t)id), bits);
    int64_t r;
    while ((r = s[i]) >= 0 && k[r] != id) i = (i + 1) & mask;
    rows[j] = r;  // -1 when the probe reached an empty slot
  }
}

void IdMap::insert(const int64_t* ids, int64_t n, int64_t* rows, uint8_t* is_new) {
  for (int64_t j = 0; j < n; j++) {
    if (j + kPrefetch < n)
      __builtin_prefetch(slots_.data() + home_slot(mix64((uint64_t)ids[j + kPrefetch]), bits_));
    const int64_t id = ids[j];
    int64_t* s = slots_.data();
    const int64_t* k = keys_.data();
    size_t i = home_slot(mix64((uint64_t)id), bits_);
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
      i = home_slot(mix64((uint64_t)id), bits_);
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
  for (int64_t j = 0; j < n; j++) {
    if (j + kPrefetch < n) __builtin_prefetch(s + home_slot(mix64((uint64_t)ids[j + kPrefetch]), bits));
    const int64_t id = ids[j];
    const int64_t* k = keys_.data();
    size_t i = home_slot(mix64((uint64_t)id), bits);
    int64_t r;
    while ((r = s[i]) >= 0 && k[r] != id) i = (i + 1) & mask;
    if (r >= 0) return j;
    s[i] = (int64_t)keys_.size();
    keys_.push_back(id);  // capacity reserved above: never reallocates
  }
  return n;
}

}  // namespace recckpt
