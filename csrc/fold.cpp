// Chain fold: see fold.h. One open-addressing table keyed by id; links are visited newest first, so the
// first event met for an id is its newest and wins, and every later (older) event for it loses.
#include "fold.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>
#include <vector>

#include "hash.h"

namespace recckpt {
namespace {

constexpr int16_t kEmpty = INT16_MIN;  // last_seen of a free slot (every int64 is a valid id)

struct Entry {        // 16 bytes: four to a cache line
  int64_t id;
  int32_t base_pos;   // position of the id's row in the base, -1 if the base lacks it
  int16_t claimed;    // link whose event won for this id, -1 while none did
  int16_t last_seen;  // newest link met so far for this id (a second event in it is a duplicate)
};

// Open addressing with the entries in the slots themselves (one cache miss per id, four entries to a
// line); the slots of ids a few positions ahead are prefetched while the current one is handled.
class Table {
 public:
  explicit Table(int64_t n) {
    size_t cap = 16;
    while (cap < (size_t)n + (size_t)n / 4 + 16) cap <<= 1;  // load <= 0.8: short probes, a smaller table
    mask_ = cap - 1;
    while (((size_t)1 << bits_) < cap) bits_++;
    slots_.assign(cap, Entry{0, -1, -1, kEmpty});
  }
  void prefetch(int64_t id) const { __builtin_prefetch(&slots_[home(id)]); }
  // The entry of `id`, created (base_pos -1, unclaimed, last_seen -1) if absent; `fresh` says which.
  Entry& get(int64_t id, bool& fresh) {
    size_t h = home(id);
    while (true) {
      Entry& e = slots_[h];
      if (e.last_seen == kEmpty) {
        e = Entry{id, -1, -1, -1};
        fresh = true;
        return e;
      }
      if (e.id == id) {
        fresh = false;
        return e;
      }
      h = (h + 1) & mask_;
    }
  }

 private:
  size_t home(int64_t id) const { return home_slot(id, key_, bits_); }
  size_t mask_ = 0;
  int bits_ = 0;
  HomeKey key_ = new_home_key();  // random per table: ids cannot be chosen to share homes (hash.h)
  std::vector<Entry> slots_;
};

constexpr int64_t kAhead = 16;  // ids prefetched ahead of the one being folded

}  // namespace

void fold_links(const std::vector<FoldLink>& links, FoldResult& out) {
  const size_t L = links.size();
  int64_t total = 0;
  for (const FoldLink& l : links) total += l.n_rows + l.n_removed;
  Table t(total);
  out = FoldResult();
  out.src.resize(L);
  out.dst.resize(L);
  if (L == 0) return;
  const FoldLink& base = links[0];
  for (int64_t i = 0; i < base.n_rows; i++) {
    if (i + kAhead < base.n_rows) t.prefetch(base.rows[i + kAhead]);
    const int64_t id = base.rows[i];
    if (base.skip_rows && base.skip_rows[i]) {
      out.holes.push_back(i);
      out.hole_ids.push_back(id);
      continue;
    }
    bool fresh;
    Entry& e = t.get(id, fresh);
    if (!fresh) {  // the base stores the id twice: the first copy keeps its place, this one is dropped
      out.dup_link.push_back(0);
      out.dup_ids.push_back(id);
      out.holes.push_back(i);
      out.hole_ids.push_back(id);
      continue;
    }
    e.base_pos = (int32_t)i;
    e.last_seen = 0;
  }
  const int64_t n_base = base.n_rows;
  for (size_t j = L - 1; j >= 1; j--) {
    const FoldLink& l = links[j];
    const int16_t jj = (int16_t)j;
    for (int64_t i = 0; i < l.n_removed; i++) {
      if (i + kAhead < l.n_removed) t.prefetch(l.removed[i + kAhead]);
      if (l.skip_removed && l.skip_removed[i]) continue;
      bool fresh;
      Entry& e = t.get(l.removed[i], fresh);
      if (e.last_seen == jj) {
        out.dup_link.push_back(jj);
        out.dup_ids.push_back(e.id);
        continue;
      }
      e.last_seen = jj;
      if (e.claimed >= 0) continue;  // a newer link decided this id
      e.claimed = jj;
      if (e.base_pos >= 0) {
        out.holes.push_back(e.base_pos);
        out.hole_ids.push_back(e.id);
      }
    }
    std::vector<int64_t>& src = out.src[j];
    std::vector<int64_t>& dst = out.dst[j];
    for (int64_t i = 0; i < l.n_rows; i++) {
      if (i + kAhead < l.n_rows) t.prefetch(l.rows[i + kAhead]);
      if (l.skip_rows && l.skip_rows[i]) continue;
      bool fresh;
      Entry& e = t.get(l.rows[i], fresh);
      if (e.last_seen == jj) {
        out.dup_link.push_back(jj);
        out.dup_ids.push_back(e.id);
        continue;
      }
      e.last_seen = jj;
      if (e.claimed >= 0) continue;
      e.claimed = jj;
      src.push_back(i);
      dst.push_back(e.base_pos >= 0 ? e.base_pos : n_base + out.new_rows++);
    }
  }
}

void copy_rows(const uint8_t* src, const int64_t* src_idx, uint8_t* dst, const int64_t* dst_idx, int64_t n,
               int64_t row_bytes, int threads) {
  const size_t rb = (size_t)row_bytes;
  auto run = [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; k++) std::memcpy(dst + (size_t)dst_idx[k] * rb, src + (size_t)src_idx[k] * rb, rb);
  };
  // Scattered rows cost a cache miss each: spread big copies over threads. Small ones are not worth a
  // thread start.
  const int64_t per_thread_bytes = 8 << 20;
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, n * row_bytes / per_thread_bytes));
  if (t == 1) {
    run(0, n);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < t; i++) pool.emplace_back(run, n * i / t, n * (i + 1) / t);
  run(0, n / t);
  for (auto& th : pool) th.join();
}

}  // namespace recckpt
