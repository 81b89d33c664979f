// Chain fold: see fold.h. The events (base rows, then every increment's removed ids and rows, newest link
// first) are first split by the top bits of a keyed hash of their id into partitions of a few thousand
// ids, keeping their order; each partition is then folded with its own small open-addressing table,
// which stays in cache. One table over all events (tens of MB for a million-row base) costs a cache miss
// per event; that was most of a long chain's fold. Within a partition the first event met for an id is
// its newest (the base's row is met first but only records where the id sits in the base) and wins.
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

// One event of the fold: an id and where it came from, packed in `meta` as index << 17 | link << 2 | kind.
struct Event {
  int64_t id;
  uint64_t meta;
};
enum Kind : uint64_t { kBaseRow = 0, kRemoved = 1, kRow = 2 };
inline uint64_t pack(int64_t idx, size_t link, Kind kind) { return ((uint64_t)idx << 17) | ((uint64_t)link << 2) | kind; }

// Open addressing with the entries in the slots themselves; reused (cleared) for every partition.
class Table {
 public:
  void reset(int64_t n, int skip_bits) {
    size_t cap = 16;
    while (cap < (size_t)n + (size_t)n / 4 + 16) cap <<= 1;  // load <= 0.8: short probes
    bits_ = 0;
    while (((size_t)1 << bits_) < cap) bits_++;
    mask_ = cap - 1;
    skip_ = skip_bits;
    slots_.assign(cap, Entry{0, -1, -1, kEmpty});
  }
  // The entry of `id` (keyed hash `h`), created (base_pos -1, unclaimed, last_seen -1) if absent.
  Entry& get(int64_t id, uint64_t h, bool& fresh) {
    size_t i = home_of(h << skip_, bits_);  // the bits below those that chose the partition
    while (true) {
      Entry& e = slots_[i];
      if (e.last_seen == kEmpty) {
        e = Entry{id, -1, -1, -1};
        fresh = true;
        return e;
      }
      if (e.id == id) {
        fresh = false;
        return e;
      }
      i = (i + 1) & mask_;
    }
  }

 private:
  size_t mask_ = 0;
  int bits_ = 0, skip_ = 0;
  std::vector<Entry> slots_;
};

constexpr int64_t kPartitionEvents = 8192;  // about 160 KiB of table per partition: in L2

}  // namespace

void fold_links(const std::vector<FoldLink>& links, FoldResult& out) {
  const size_t L = links.size();
  out = FoldResult();
  out.src.resize(L);
  out.dst.resize(L);
  if (L == 0) return;
  const FoldLink& base = links[0];
  int64_t total = 0;
  for (const FoldLink& l : links) total += l.n_rows + l.n_removed;
  int pbits = 0;
  while (pbits < 16 && (total >> pbits) > kPartitionEvents) pbits++;
  const size_t P = (size_t)1 << pbits;
  const HomeKey key = new_home_key();  // random per fold: ids cannot be chosen to share homes (hash.h)
  auto part = [&](int64_t id) { return home_of(keyed_hash(id, key), pbits); };

  // Every event in fold order: base rows, then per link from the newest, its removed ids, then its rows.
  // The base's skipped rows are holes at once; other links' skipped events are left out.
  auto each_event = [&](auto&& f) {
    for (int64_t i = 0; i < base.n_rows; i++)
      if (!(base.skip_rows && base.skip_rows[i])) f(base.rows[i], pack(i, 0, kBaseRow));
    for (size_t j = L - 1; j >= 1; j--) {
      const FoldLink& l = links[j];
      for (int64_t i = 0; i < l.n_removed; i++)
        if (!(l.skip_removed && l.skip_removed[i])) f(l.removed[i], pack(i, j, kRemoved));
      for (int64_t i = 0; i < l.n_rows; i++)
        if (!(l.skip_rows && l.skip_rows[i])) f(l.rows[i], pack(i, j, kRow));
    }
  };
  if (base.skip_rows)
    for (int64_t i = 0; i < base.n_rows; i++)
      if (base.skip_rows[i]) {
        out.holes.push_back(i);
        out.hole_ids.push_back(base.rows[i]);
      }
  std::vector<int64_t> start(P + 1, 0);
  each_event([&](int64_t id, uint64_t) { start[part(id) + 1]++; });
  for (size_t p = 0; p < P; p++) start[p + 1] += start[p];
  std::vector<Event> ev((size_t)start[P]);
  {
    std::vector<int64_t> at(start.begin(), start.end() - 1);
    each_event([&](int64_t id, uint64_t meta) { ev[(size_t)at[part(id)]++] = Event{id, meta}; });
  }

  // Winners per link, by row index: dst of row i, -1 where it lost (made ascending by src afterwards).
  std::vector<std::vector<int64_t>> won(L);
  for (size_t j = 1; j < L; j++)
    if (links[j].n_rows) won[j].assign((size_t)links[j].n_rows, -1);
  const int64_t n_base = base.n_rows;
  Table t;
  for (size_t p = 0; p < P; p++) {
    const int64_t lo = start[p], hi = start[p + 1];
    if (lo == hi) continue;
    t.reset(hi - lo, pbits);
    for (int64_t k = lo; k < hi; k++) {
      const Event& v = ev[(size_t)k];
      const int64_t idx = (int64_t)(v.meta >> 17);
      const int16_t jj = (int16_t)((v.meta >> 2) & 0x7FFF);
      const Kind kind = (Kind)(v.meta & 3);
      bool fresh;
      Entry& e = t.get(v.id, keyed_hash(v.id, key), fresh);
      if (kind == kBaseRow) {
        if (!fresh) {  // the base stores the id twice: the first copy keeps its place, this one is dropped
          out.dup_link.push_back(0);
          out.dup_ids.push_back(v.id);
          out.holes.push_back(idx);
          out.hole_ids.push_back(v.id);
          continue;
        }
        e.base_pos = (int32_t)idx;
        e.last_seen = 0;
        continue;
      }
      if (e.last_seen == jj) {  // within one link: removed ids come before rows, so this is a repeat
        out.dup_link.push_back(jj);
        out.dup_ids.push_back(v.id);
        continue;
      }
      e.last_seen = jj;
      if (e.claimed >= 0) continue;  // a newer link decided this id
      e.claimed = jj;
      if (kind == kRemoved) {
        if (e.base_pos >= 0) {
          out.holes.push_back(e.base_pos);
          out.hole_ids.push_back(e.id);
        }
      } else {
        won[(size_t)jj][(size_t)idx] = e.base_pos >= 0 ? e.base_pos : n_base + out.new_rows++;
      }
    }
  }
  for (size_t j = 1; j < L; j++) {
    std::vector<int64_t>& src = out.src[j];
    std::vector<int64_t>& dst = out.dst[j];
    const std::vector<int64_t>& w = won[j];
    for (size_t i = 0; i < w.size(); i++)
      if (w[i] >= 0) {
        src.push_back((int64_t)i);
        dst.push_back(w[i]);
      }
    std::vector<int64_t>().swap(won[j]);
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
