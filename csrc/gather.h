// Row gather: dst row i = src row perm[i]. Fixed row sizes get a copy the compiler can inline.
#pragma once
#include <cstdint>
#include <cstring>

namespace recckpt {

template <int RB, class Idx>
void gather_fixed(uint8_t* __restrict dst, const uint8_t* __restrict src, const Idx* perm, int64_t k) {
  constexpr int64_t kAhead = 16;
  int64_t i = 0;
  for (; i + kAhead < k; i++) {
    if (RB >= 64) __builtin_prefetch(src + (size_t)perm[i + kAhead] * RB);
    std::memcpy(dst + i * RB, src + (size_t)perm[i] * RB, RB);
  }
  for (; i < k; i++) std::memcpy(dst + i * RB, src + (size_t)perm[i] * RB, RB);
}

template <class Idx>
void gather_any(uint8_t* __restrict dst, const uint8_t* __restrict src, int64_t rb, const Idx* perm,
                int64_t k) {
  constexpr int64_t kAhead = 8;
  for (int64_t i = 0; i < k; i++) {
    if (i + kAhead < k) __builtin_prefetch(src + (size_t)perm[i + kAhead] * rb);
    std::memcpy(dst + i * rb, src + (size_t)perm[i] * rb, (size_t)rb);
  }
}

template <class Idx>
void gather_rows(uint8_t* dst, const uint8_t* src, int64_t rb, const Idx* perm, int64_t k) {
  switch (rb) {
    case 1: return gather_fixed<1>(dst, src, perm, k);
    case 2: return gather_fixed<2>(dst, src, perm, k);
    case 4: return gather_fixed<4>(dst, src, perm, k);
    case 8: return gather_fixed<8>(dst, src, perm, k);
    case 12: return gather_fixed<12>(dst, src, perm, k);
    case 16: return gather_fixed<16>(dst, src, perm, k);
    case 32: return gather_fixed<32>(dst, src, perm, k);
    case 64: return gather_fixed<64>(dst, src, perm, k);
    case 128: return gather_fixed<128>(dst, src, perm, k);
    case 256: return gather_fixed<256>(dst, src, perm, k);
    case 512: return gather_fixed<512>(dst, src, perm, k);
    default: return gather_any(dst, src, rb, perm, k);
  }
}

}  // namespace recckpt
