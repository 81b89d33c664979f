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

// Strided gather: dst row i (w bytes) = bytes [0, w) of src row perm[i], src rows `stride` bytes apart
// (one column group of a row-major slot: src points at the group's first byte in row 0).
template <int W, class Idx>
void gather_cols_fixed(uint8_t* __restrict dst, const uint8_t* __restrict src, int64_t stride, const Idx* perm,
                       int64_t k) {
  for (int64_t i = 0; i < k; i++) std::memcpy(dst + i * W, src + (size_t)perm[i] * stride, W);
}

template <class Idx>
void gather_cols(uint8_t* dst, const uint8_t* src, int64_t stride, int64_t w, const Idx* perm, int64_t k) {
  if (stride == w) return gather_rows(dst, src, w, perm, k);
  switch (w) {
    case 2: return gather_cols_fixed<2>(dst, src, stride, perm, k);
    case 4: return gather_cols_fixed<4>(dst, src, stride, perm, k);
    case 8: return gather_cols_fixed<8>(dst, src, stride, perm, k);
    case 16: return gather_cols_fixed<16>(dst, src, stride, perm, k);
    case 32: return gather_cols_fixed<32>(dst, src, stride, perm, k);
    default:
      for (int64_t i = 0; i < k; i++) std::memcpy(dst + i * w, src + (size_t)perm[i] * stride, (size_t)w);
  }
}

}  // namespace recckpt
