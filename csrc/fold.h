// Folding a chain of checkpoint links (a full base, then increments) for one bucket range: for every
// id the newest event wins, a row or a removal (docs/FORMAT.md, "Incremental checkpoints"). The fold
// works on ids only; it says where each winning row goes, and the caller moves the row bytes
// (copy_rows) straight into their final place.
#pragma once
#include <cstdint>
#include <vector>

namespace recckpt {

struct FoldLink {
  const int64_t* rows = nullptr;          // ids of the link's rows in the range, in read order
  int64_t n_rows = 0;
  const uint8_t* skip_rows = nullptr;     // optional: nonzero = ignore that row (not owned, lost a duplicate)
  const int64_t* removed = nullptr;       // ids the link records as removed (increments only)
  int64_t n_removed = 0;
  const uint8_t* skip_removed = nullptr;
};

struct FoldResult {
  // Output layout: positions [0, base_rows) hold the base's rows in read order (a caller reads them
  // there whole); positions [base_rows, base_rows + new_rows) the winning rows of ids the base lacks.
  int64_t new_rows = 0;
  std::vector<std::vector<int64_t>> src;  // per link (index 0 unused): winning row indices, ascending
  std::vector<std::vector<int64_t>> dst;  // their output positions
  std::vector<int64_t> holes;             // base positions whose row does not survive (ascending is not promised)
  std::vector<int64_t> hole_ids;          // the base id at each hole
  std::vector<int64_t> dup_link;          // ids stored more than once within one link: the link ...
  std::vector<int64_t> dup_ids;           // ... and the id (once per extra copy)
};

// links[0] is the base (its removed ids are ignored); at most kMaxFoldLinks links and kMaxFoldBase base
// rows (the caller checks). Runs in O(total events): the events are split by a keyed hash of their id
// into cache-sized partitions, each folded with its own small table, on up to `threads` threads (the
// result does not depend on how many).
constexpr int64_t kMaxFoldLinks = 32000;
constexpr int64_t kMaxFoldBase = ((int64_t)1 << 31) - 1;
void fold_links(const std::vector<FoldLink>& links, FoldResult& out, int threads = 1);

// dst[dst_idx[k]] = src[src_idx[k]] for rows of row_bytes bytes, on up to `threads` threads (each a
// range of k; the rows written must be distinct). threads == 1 copies in order of k, which is what
// moving rows forward within one buffer needs. Indices are checked by the caller.
void copy_rows(const uint8_t* src, const int64_t* src_idx, uint8_t* dst, const int64_t* dst_idx, int64_t n,
               int64_t row_bytes, int threads);

}  // namespace recckpt
