// read_ranges: verified parallel positioned reads of checksummed columns (see docs/ENGINE.md).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mapped_region.h"

namespace recckpt {

struct ReadRequest {
  std::string path;
  int64_t col_offset = 0, col_length = 0, chunk_bytes = 0;
  std::vector<uint32_t> crcs;
  int64_t lo = 0, hi = 0;
  uint8_t* dst = nullptr;
  int64_t dst_len = 0;
  int64_t pad_before = 0;  // zero padding that precedes the column (format v2), checked when lo == 0
  std::string invalid;  // set by the caller when an argument could not be used (reported, not raised)
};

struct ReadResult {
  int64_t bytes_read = 0;
  std::vector<std::pair<int64_t, std::string>> errors;  // (request index, message), sorted by index
};

// Validates every request, opens each path once, then reads [lo, hi) of each column with `threads`
// threads, checking the crc of every chunk touched. Never throws for data errors. Up to
// `readahead_bytes` beyond the piece being read are announced to the kernel (POSIX_FADV_WILLNEED);
// 0 turns that off.
//
// With `map_into`, a request that reads a whole column into memory inside that region, at an address
// congruent to the column's file offset modulo the page size, is *mapped*: its whole pages become a
// copy-on-write mapping of the file (MAP_PRIVATE|MAP_FIXED), the partial pages at either end are
// read, and the checksums are verified on the mapped memory (pages populated with
// MADV_POPULATE_READ first, so an I/O error or a file shortened meanwhile is reported, not SIGBUS).
//
// `direct` says when a piece is read with O_DIRECT, past the page cache, straight into the destination
// (or, where the destination is not block-aligned, through a reused aligned buffer per thread):
//   kDirectNever   never;
//   kDirectAuto    when its first page is not in the page cache (asked with preadv2(RWF_NOWAIT)): a cold
//                  load then neither fills the page cache nor copies out of it, which is most of its CPU
//                  time. Once a piece is found cold, no read-ahead hint is given (it would fill the cache);
//   kDirectAlways  whenever the file system allows it (tests, and loaders that must not fill the cache).
// A file system that refuses O_DIRECT (tmpfs, some network file systems) is read through the page cache.
enum DirectMode { kDirectNever = 0, kDirectAuto = 1, kDirectAlways = 2 };
constexpr int64_t kDefaultReadaheadBytes = int64_t(64) << 20;
ReadResult read_ranges(const std::vector<ReadRequest>& requests, int threads,
                       int64_t readahead_bytes = kDefaultReadaheadBytes, MappedRegion* map_into = nullptr,
                       int direct = kDirectAuto);

}  // namespace recckpt
