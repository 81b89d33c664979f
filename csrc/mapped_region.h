// MappedRegion: private anonymous memory that a load may back with copy-on-write file mappings.
//
// A mapped load (docs/ENGINE.md, "Mapped reads") reads a column by mapping the checkpoint's pages
// MAP_PRIVATE|MAP_FIXED over part of a region instead of copying them: pages are shared with the
// page cache until someone writes them. MAP_FIXED replaces whatever was mapped at that address, so
// the engine only ever does it inside a region it allocated itself, never in caller memory.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace recckpt {

class MappedRegion {
 public:
  // Reserves `nbytes` (rounded up to whole pages, at least one) of zeroed, writable, private
  // anonymous memory; MAP_NORESERVE, so untouched pages cost neither memory nor commit charge.
  explicit MappedRegion(int64_t nbytes);
  ~MappedRegion();
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  uint8_t* data() const { return base_; }
  int64_t size() const { return size_; }  // as requested (the mapping itself is page-rounded)
  bool contains(const uint8_t* p, int64_t n) const {
    return n >= 0 && p >= base_ && p + n <= base_ + size_;
  }
  std::atomic<int64_t> bytes_mapped{0};  // file bytes mapped into the region so far

  static int64_t page_size();

 private:
  uint8_t* base_ = nullptr;
  int64_t size_ = 0;
  size_t mapped_len_ = 0;
};

}  // namespace recckpt
