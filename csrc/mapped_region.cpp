#include "mapped_region.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <limits>
#include <stdexcept>

#include "os_error.h"

namespace recckpt {

int64_t MappedRegion::page_size() {
  static const int64_t p = (int64_t)::sysconf(_SC_PAGESIZE);
  return p;
}

MappedRegion::MappedRegion(int64_t nbytes) {
  if (nbytes < 0) throw std::invalid_argument("MappedRegion: nbytes must be >= 0");
  const int64_t p = page_size();
  if (nbytes > std::numeric_limits<int64_t>::max() - p)
    throw std::invalid_argument("MappedRegion: nbytes is too large");
  const int64_t len = std::max<int64_t>(p, (nbytes + p - 1) / p * p);
  void* m = ::mmap(nullptr, (size_t)len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
  if (m == MAP_FAILED) throw OsError(errno, "", "MappedRegion: mmap of " + std::to_string(len) + " bytes");
  base_ = static_cast<uint8_t*>(m);
  size_ = nbytes;
  mapped_len_ = (size_t)len;
}

MappedRegion::~MappedRegion() {
  if (base_) ::munmap(base_, mapped_len_);  // also removes every file mapping placed inside
}

}  // namespace recckpt
