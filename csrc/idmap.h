// IdMap: int64 id -> dense row (the i-th distinct id ever inserted gets row i).
// Open addressing with linear probing; the slot table holds row indices (-1 = empty) and the keys
// live in a row-ordered vector, so every int64 value is a valid key (no sentinel key).
#pragma once
#include <cstdint>
#include <mutex>
#include <vector>

#include "hash.h"

namespace recckpt {

class IdMap {
 public:
  explicit IdMap(int64_t capacity = 0);

  int64_t size() const { return (int64_t)keys_.size(); }
  int64_t capacity() const { return (int64_t)slots_.size(); }  // slot count (power of two)

  void lookup(const int64_t* ids, int64_t n, int64_t* rows) const;
  // rows[i] = row of ids[i]; is_new[i] = 1 only where ids[i] was inserted by this call (first occurrence).
  void insert(const int64_t* ids, int64_t n, int64_t* rows, uint8_t* is_new);
  // Bulk load of ids expected to be absent (a table being filled from a checkpoint): inserts ids in
  // order, growing at most once up front, with no per-id output. Stops at the first id that is
  // already present (or repeated) and returns its index; returns n when every id was new. Ids
  // before the returned index stay inserted.
  int64_t insert_new(const int64_t* ids, int64_t n);
  // Slots visited to look up ids (n when every probe ends at once): how clustered the table is.
  int64_t probes(const int64_t* ids, int64_t n) const;
  const std::vector<int64_t>& keys() const { return keys_; }
  void reserve(int64_t n);
  void clear();

  // Calls from several threads on one map are serialised with this lock (taken by the bindings).
  std::mutex& mutex() const { return mu_; }

 private:
  void rehash(size_t new_slots);
  size_t slots_for(size_t n) const;

  std::vector<int64_t> slots_;  // row index or -1
  std::vector<int64_t> keys_;   // keys_[row] = id
  size_t mask_ = 0;
  int bits_ = 0;        // slots_.size() == 1 << bits_ (home slots are the top bits of the hash)
  size_t grow_at_ = 0;  // grow when size would exceed this
  HomeKey key_;         // random per map: ids cannot be chosen to share homes (hash.h)
  mutable std::mutex mu_;
};

}  // namespace recckpt
