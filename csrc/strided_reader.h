// read_strided: verified parallel reads of rows of several checksummed columns (the column groups of a
// slot, format version 5) into row-major destinations (see docs/ENGINE.md).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "reader.h"

namespace recckpt {

struct StridedPart {
  int64_t col_offset = 0, col_length = 0, chunk_bytes = 0;  // the column and its checksum step
  std::vector<uint32_t> crcs;                               // one per chunk_bytes of the column
  int64_t width = 0;                  // bytes of one row of the column
  int64_t src = 0, nbytes = 0;        // bytes [src, src + nbytes) of each of its rows ...
  int64_t dst = 0;                    // ... go to bytes [dst, dst + nbytes) of the destination row
  int64_t pad_before = 0;             // zero padding before the column, checked when a read starts at row 0
};

struct StridedRequest {
  std::string path;
  int64_t r0 = 0, r1 = 0;               // rows [r0, r1) of every part's column
  uint8_t* dst = nullptr;               // row r (r0 <= r < r1) lands at dst + (r - r0) * dst_stride
  int64_t dst_len = 0, dst_stride = 0;  // dst_len == (r1 - r0) * dst_stride
  std::vector<StridedPart> parts;
  std::string invalid;  // set by the caller when an argument could not be used (reported, not raised)
};

// Validates every request, opens each path once (regular files only, as read_ranges), then reads the rows
// in blocks of about `block_bytes` of every part together with `threads` threads: each block's chunks of every part
// are read, their CRCs checked, and only then are the block's rows placed in the destination, a few rows at
// a time across the parts, so a row-major destination is written while in cache. Bytes of a destination
// are written only from verified chunks. Never throws for data errors; errors name the part (column) and
// the file offset. `readahead_bytes` and `direct` as read_ranges: on a cold start (the first rows not in the
// page cache, or kDirectAlways) blocks are read with O_DIRECT (the whole kAlign blocks around each part's
// chunks, into an aligned scratch), in blocks of at least 8 MiB, by at least 8 threads, with no hints.
constexpr int64_t kStridedBlockBytes = int64_t(1) << 20;
ReadResult read_strided(const std::vector<StridedRequest>& requests, int threads,
                        int64_t readahead_bytes = kDefaultReadaheadBytes, int64_t block_bytes = kStridedBlockBytes,
                        int direct = kDirectAuto);

}  // namespace recckpt
