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
#include <system_error>
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
constexpr int64_t kThreadEvents = 1 << 16;   // fewer events a thread than this are not worth its start

// A run of events of one kind from one link, in fold order (see fold_links).
struct Run {
  const int64_t* ids;
  const uint8_t* skip;
  int64_t n;
  size_t link;
  Kind kind;
};

// Runs fn(t) for t in [0, T) on T threads (t = 0 on the caller); if no more threads can be started,
// the caller runs the rest itself.
template <class F>
void on_threads(int64_t T, F&& fn) {
  std::vector<std::thread> pool;
  int64_t started = 1;
  try {
    for (; started < T; started++) pool.emplace_back(fn, started);
  } catch (const std::system_error&) {
  }
  fn(0);
  for (int64_t t = started; t < T; t++) fn(t);
  for (auto& th : pool) th.join();
}

// Calls f(id, meta) for the events with fold-order positions [g0, g1) (skipped events included in
// the positions, not passed to f).
template <class F>
void each_event_in(const std::vector<Run>& runs, int64_t g0, int64_t g1, F&& f) {
  int64_t at = 0;
  for (const Run& r : runs) {
    const int64_t lo = std::max<int64_t>(g0 - at, 0), hi = std::min<int64_t>(g1 - at, r.n);
    for (int64_t i = lo; i < hi; i++)
      if (!(r.skip && r.skip[i])) f(r.ids[i], pack(i, r.link, r.kind));
    at += r.n;
    if (at >= g1) break;
  }
}

// What one thread's partitions decided, merged in partition order afterwards so that the result does
// not depend on the number of threads.
struct PartOut {
  std::vector<int64_t> holes, hole_ids, dup_link, dup_ids;
  std::vector<uint64_t> new_ref;  // a winning row of an id the base lacks: its event's meta, in order
};

}  // namespace

void fold_links(const std::vector<FoldLink>& links, FoldResult& out, int threads) {
  const size_t L = links.size();
  out = FoldResult();
  out.src.resize(L);
  out.dst.resize(L);
  if (L == 0) return;
  const FoldLink& base = links[0];
  // Every event in fold order: base rows, then per link from the newest, its removed ids, then its rows.
  // The base's skipped rows are holes at once; other links' skipped events are left out.
  std::vector<Run> runs;
  runs.push_back({base.rows, base.skip_rows, base.n_rows, 0, kBaseRow});
  for (size_t j = L - 1; j >= 1; j--) {
    runs.push_back({links[j].removed, links[j].skip_removed, links[j].n_removed, j, kRemoved});
    runs.push_back({links[j].rows, links[j].skip_rows, links[j].n_rows, j, kRow});
  }
  int64_t total = 0;
  for (const Run& r : runs) total += r.n;
  int pbits = 0;
  while (pbits < 16 && (total >> pbits) > kPartitionEvents) pbits++;
  const size_t P = (size_t)1 << pbits;
  const HomeKey key = new_home_key();  // random per fold: ids cannot be chosen to share homes (hash.h)
  auto part = [&](int64_t id) { return home_of(keyed_hash(id, key), pbits); };
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, total / kThreadEvents, (int64_t)P}));

  if (base.skip_rows)
    for (int64_t i = 0; i < base.n_rows; i++)
      if (base.skip_rows[i]) {
        out.holes.push_back(i);
        out.hole_ids.push_back(base.rows[i]);
      }
  // Split the events by partition, keeping their order: thread t counts, then places, the events of
  // the t-th slice of the fold order after those of the slices before it.
  std::vector<std::vector<int64_t>> count((size_t)T, std::vector<int64_t>(P, 0));
  on_threads(T, [&](int64_t t) {
    std::vector<int64_t>& c = count[(size_t)t];
    each_event_in(runs, total * t / T, total * (t + 1) / T, [&](int64_t id, uint64_t) { c[part(id)]++; });
  });
  std::vector<int64_t> start(P + 1, 0);
  for (size_t p = 0; p < P; p++) {
    int64_t at = start[p];
    for (int64_t t = 0; t < T; t++) {
      const int64_t n = count[(size_t)t][p];
      count[(size_t)t][p] = at;  // now: where slice t's events of partition p go
      at += n;
    }
    start[p + 1] = at;
  }
  std::vector<Event> ev((size_t)start[P]);
  on_threads(T, [&](int64_t t) {
    std::vector<int64_t>& at = count[(size_t)t];
    each_event_in(runs, total * t / T, total * (t + 1) / T,
                  [&](int64_t id, uint64_t meta) { ev[(size_t)at[part(id)]++] = Event{id, meta}; });
  });
  std::vector<std::vector<int64_t>>().swap(count);

  // Winners by link and row index, one flat array (link j's rows from at[j]): dst of the row, -1 where it
  // lost (made ascending by src afterwards).
  std::vector<int64_t> at(L + 1, 0);
  for (size_t j = 1; j < L; j++) at[j + 1] = at[j] + links[j].n_rows;
  std::vector<int64_t> won((size_t)at[L], -1);
  const int64_t n_base = base.n_rows;
  // Partitions are independent: thread t folds the partitions [q[t], q[t + 1]), about a T-th of the events.
  std::vector<size_t> q((size_t)T + 1, P);
  q[0] = 0;
  for (int64_t t = 1, p = 0; t < T; t++) {
    while ((size_t)p < P && start[(size_t)p] < start[P] * t / T) p++;
    q[(size_t)t] = (size_t)p;
  }
  std::vector<PartOut> parts((size_t)T);
  on_threads(T, [&](int64_t t) {
    PartOut& o = parts[(size_t)t];
    Table tab;
    for (size_t p = q[(size_t)t]; p < q[(size_t)t + 1]; p++) {
      const int64_t lo = start[p], hi = start[p + 1];
      if (lo == hi) continue;
      tab.reset(hi - lo, pbits);
      for (int64_t k = lo; k < hi; k++) {
        const Event& v = ev[(size_t)k];
        const int64_t idx = (int64_t)(v.meta >> 17);
        const int16_t jj = (int16_t)((v.meta >> 2) & 0x7FFF);
        const Kind kind = (Kind)(v.meta & 3);
        bool fresh;
        Entry& e = tab.get(v.id, keyed_hash(v.id, key), fresh);
        if (kind == kBaseRow) {
          if (!fresh) {  // the base stores the id twice: the first copy keeps its place, this one is dropped
            o.dup_link.push_back(0);
            o.dup_ids.push_back(v.id);
            o.holes.push_back(idx);
            o.hole_ids.push_back(v.id);
            continue;
          }
          e.base_pos = (int32_t)idx;
          e.last_seen = 0;
          continue;
        }
        if (e.last_seen == jj) {  // within one link: removed ids come before rows, so this is a repeat
          o.dup_link.push_back(jj);
          o.dup_ids.push_back(v.id);
          continue;
        }
        e.last_seen = jj;
        if (e.claimed >= 0) continue;  // a newer link decided this id
        e.claimed = jj;
        if (kind == kRemoved) {
          if (e.base_pos >= 0) {
            o.holes.push_back(e.base_pos);
            o.hole_ids.push_back(e.id);
          }
        } else if (e.base_pos >= 0) {
          won[(size_t)(at[(size_t)jj] + idx)] = e.base_pos;
        } else {  // placed after the base once every thread is done, in partition order
          o.new_ref.push_back(v.meta);
        }
      }
    }
  });
  std::vector<Event>().swap(ev);
  for (const PartOut& o : parts) {
    out.holes.insert(out.holes.end(), o.holes.begin(), o.holes.end());
    out.hole_ids.insert(out.hole_ids.end(), o.hole_ids.begin(), o.hole_ids.end());
    out.dup_link.insert(out.dup_link.end(), o.dup_link.begin(), o.dup_link.end());
    out.dup_ids.insert(out.dup_ids.end(), o.dup_ids.begin(), o.dup_ids.end());
    for (const uint64_t meta : o.new_ref)
      won[(size_t)(at[(size_t)((meta >> 2) & 0x7FFF)] + (int64_t)(meta >> 17))] = n_base + out.new_rows++;
  }
  std::vector<PartOut>().swap(parts);
  const int64_t TL = std::max<int64_t>(1, std::min<int64_t>(T, (int64_t)L - 1));
  on_threads(TL, [&](int64_t t) {
    for (size_t j = 1 + (size_t)t; j < L; j += (size_t)TL) {
      std::vector<int64_t>& src = out.src[j];
      std::vector<int64_t>& dst = out.dst[j];
      const int64_t* w = won.data() + at[j];
      for (int64_t i = 0; i < at[j + 1] - at[j]; i++)
        if (w[i] >= 0) {
          src.push_back(i);
          dst.push_back(w[i]);
        }
    }
  });
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
