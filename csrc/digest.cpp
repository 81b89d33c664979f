// Content digests (digest.h). The loops are written so the compiler vectorises them across the
// elements of a row; on x86-64 with GCC they are also compiled for AVX2 and AVX-512 and the best
// version is picked when the library loads, and rows of 4-byte elements have an AVX2 loop by hand
// (rows_u32_avx2).
#include "digest.h"

#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>

#include "hash.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define RECCKPT_DIGEST_X86 1
#include <immintrin.h>
#endif

namespace recckpt {
namespace {

constexpr int64_t kBlockRows = 256;        // row keys are computed for this many rows at a time
constexpr int64_t kSteps = 256;            // elements hashed per inner loop (steps precomputed)
constexpr int64_t kShortRow = 4;          // rows of at most this many elements
constexpr int64_t kThreadBytes = 4 << 20;  // at least this much input per extra thread

struct StepTable {
  uint64_t a[kSteps], b[kSteps];  // c * step, for c in [0, kSteps)
  StepTable() {
    for (int64_t c = 0; c < kSteps; c++) {
      a[c] = (uint64_t)c * kDigestStepA;
      b[c] = (uint64_t)c * kDigestStepB;
    }
  }
};
const StepTable kStepTable;

// One element's terms in lanes a and b: `x` is the lane's row key plus the element's position times the
// lane's step. An element of at most 4 bytes is multiplied, exactly (32 x 32 -> 64 bits, one vpmuludq a
// lane on AVX2), by the key's high half made odd, after an xor with its low half: a function of the
// value (one-to-one) that costs a few instructions. An 8-byte element keeps two 64-bit finalizers (an exact product
// would need 128 bits).
template <class T, int Lane>
inline uint64_t term(uint64_t v, uint64_t x) {
  if constexpr (sizeof(T) < 8)
    return (uint64_t)(uint32_t)(v ^ x) * (uint64_t)((uint32_t)(x >> 32) | 1u);
  else
    return Lane == 0 ? mix64(v ^ x) : fmix64(v ^ x);
}
template <class T>
inline uint64_t term_a(uint64_t v, uint64_t x) { return term<T, 0>(v, x); }
template <class T>
inline uint64_t term_b(uint64_t v, uint64_t x) { return term<T, 1>(v, x); }

// The position in the logical row (docs/FORMAT.md, "Content digests") of held column c of block k of a row.
inline uint64_t element_of(const DigestColumn& col, int64_t k, int64_t c) {
  return (uint64_t)(k * col.full + col.first + c);
}

// Elements [0, m) of one run of a row, whose first element is element e0 of the logical row.
template <class T>
inline __attribute__((always_inline)) void run(const uint8_t* p, int64_t m, uint64_t ka, uint64_t kb,
                                               uint64_t e0, uint64_t& sa, uint64_t& sb) {
  for (int64_t c0 = 0; c0 < m; c0 += kSteps) {
    const int64_t len = std::min(kSteps, m - c0);
    const uint64_t ba = ka + (e0 + (uint64_t)c0) * kDigestStepA;
    const uint64_t bb = kb + (e0 + (uint64_t)c0) * kDigestStepB;
    const uint8_t* q = p + c0 * (int64_t)sizeof(T);
    uint64_t xa = 0, xb = 0;
    for (int64_t c = 0; c < len; c++) {
      T v;
      std::memcpy(&v, q + c * (int64_t)sizeof(T), sizeof(T));
      xa += term_a<T>((uint64_t)v, ba + kStepTable.a[c]);
      xb += term_b<T>((uint64_t)v, bb + kStepTable.b[c]);
    }
    sa += xa;
    sb += xb;
  }
}

#ifdef RECCKPT_DIGEST_X86
const bool kHaveAvx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));

// short_rows for 4-byte elements and len a multiple of 8, by hand: compilers vectorise the exact
// 32 x 32 -> 64-bit products with a shuffle per element. Eight elements are one load; each 64-bit lane
// holds an even element in its low half (vpmuludq reads only that half) and the next, odd, element
// in its high half (shifted down for the second product). The element sums are kept per position as
// in short_rows (acc[j]), so the result is the same.
__attribute__((target("avx2"))) void rows_u32_avx2(const uint8_t* rows, int64_t row_bytes, int64_t m, int64_t len,
                                                    const uint64_t* ka, const uint64_t* kb, const uint64_t* ea,
                                                    const uint64_t* eb, uint64_t* acc_a, uint64_t* acc_b) {
  const __m256i one = _mm256_set1_epi64x(1);
  for (int64_t g = 0; g < len; g += 8) {
    // the keys' element offsets of elements g, g+2, g+4, g+6 (even) and g+1, g+3, g+5, g+7 (odd)
    const __m256i ea_e = _mm256_setr_epi64x((long long)ea[g], (long long)ea[g + 2], (long long)ea[g + 4],
                                            (long long)ea[g + 6]);
    const __m256i ea_o = _mm256_setr_epi64x((long long)ea[g + 1], (long long)ea[g + 3], (long long)ea[g + 5],
                                            (long long)ea[g + 7]);
    const __m256i eb_e = _mm256_setr_epi64x((long long)eb[g], (long long)eb[g + 2], (long long)eb[g + 4],
                                            (long long)eb[g + 6]);
    const __m256i eb_o = _mm256_setr_epi64x((long long)eb[g + 1], (long long)eb[g + 3], (long long)eb[g + 5],
                                            (long long)eb[g + 7]);
    __m256i sa_e = _mm256_setzero_si256(), sa_o = sa_e, sb_e = sa_e, sb_o = sa_e;
    const uint8_t* p = rows + g * 4;
    for (int64_t r = 0; r < m; r++, p += row_bytes) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i v_o = _mm256_srli_epi64(v, 32);
      const __m256i a = _mm256_set1_epi64x((long long)ka[r]), b = _mm256_set1_epi64x((long long)kb[r]);
      __m256i x = _mm256_add_epi64(a, ea_e);
      sa_e = _mm256_add_epi64(sa_e, _mm256_mul_epu32(_mm256_xor_si256(v, x),
                                                     _mm256_or_si256(_mm256_srli_epi64(x, 32), one)));
      x = _mm256_add_epi64(a, ea_o);
      sa_o = _mm256_add_epi64(sa_o, _mm256_mul_epu32(_mm256_xor_si256(v_o, x),
                                                     _mm256_or_si256(_mm256_srli_epi64(x, 32), one)));
      x = _mm256_add_epi64(b, eb_e);
      sb_e = _mm256_add_epi64(sb_e, _mm256_mul_epu32(_mm256_xor_si256(v, x),
                                                     _mm256_or_si256(_mm256_srli_epi64(x, 32), one)));
      x = _mm256_add_epi64(b, eb_o);
      sb_o = _mm256_add_epi64(sb_o, _mm256_mul_epu32(_mm256_xor_si256(v_o, x),
                                                     _mm256_or_si256(_mm256_srli_epi64(x, 32), one)));
    }
    alignas(32) uint64_t lanes[4][4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), sa_e);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[1]), sa_o);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[2]), sb_e);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[3]), sb_o);
    for (int i = 0; i < 4; i++) {
      acc_a[g + 2 * i] += lanes[0][i];
      acc_a[g + 2 * i + 1] += lanes[1][i];
      acc_b[g + 2 * i] += lanes[2][i];
      acc_b[g + 2 * i + 1] += lanes[3][i];
    }
  }
}
#endif

// m rows of `len` elements (L > 0: len == L, known to the compiler, so that a row's loop is unrolled),
// adding element j's terms to acc_a[j], acc_b[j].
template <class T, int64_t L>
inline __attribute__((always_inline)) void short_rows(const uint8_t* rows, int64_t row_bytes, int64_t m,
                                                      int64_t len_rt, const uint64_t* ka, const uint64_t* kb,
                                                      const uint64_t* ea, const uint64_t* eb, uint64_t* acc_a,
                                                      uint64_t* acc_b) {
  const int64_t len = L ? L : len_rt;
  for (int64_t r = 0; r < m; r++) {
    const uint8_t* p = rows + r * row_bytes;
    const uint64_t a = ka[r], b = kb[r];
    for (int64_t j = 0; j < len; j++) {
      T v;
      std::memcpy(&v, p + j * (int64_t)sizeof(T), sizeof(T));
      acc_a[j] += term_a<T>((uint64_t)v, a + ea[j]);
      acc_b[j] += term_b<T>((uint64_t)v, b + eb[j]);
    }
  }
}

template <class T>
inline __attribute__((always_inline)) void column_rows(const DigestColumn& col, int64_t r0, int64_t m,
                                                       const uint64_t* ka, const uint64_t* kb, Digest128& out) {
  const int64_t blocks = col.width ? col.row_bytes / (int64_t)sizeof(T) / col.width : 0;
  uint64_t sa = 0, sb = 0;
  if (blocks * col.width <= kShortRow) {  // few elements a row: vectorise across rows instead
    for (int64_t k = 0; k < blocks; k++)
      for (int64_t c = 0; c < col.width; c++) {
        const uint64_t e = element_of(col, k, c);
        const uint64_t ea = e * kDigestStepA, eb = e * kDigestStepB;
        const uint8_t* p = col.data + r0 * col.row_bytes + (k * col.width + c) * (int64_t)sizeof(T);
        for (int64_t r = 0; r < m; r++) {
          T v;
          std::memcpy(&v, p + r * col.row_bytes, sizeof(T));
          sa += term_a<T>((uint64_t)v, ka[r] + ea);
          sb += term_b<T>((uint64_t)v, kb[r] + eb);
        }
      }
    out.a += sa;
    out.b += sb;
    return;
  }
  const int64_t len = blocks * col.width;  // elements a held row
  if (len <= kSteps) {
    // Rows of at most kSteps elements: one sum per element position, kept across the rows and added up
    // once, so that no row ends in a reduction of vector lanes (a row of 16 floats is only four vectors).
    uint64_t ea[kSteps], eb[kSteps], acc_a[kSteps], acc_b[kSteps];
    bool switch_done = false;
    for (int64_t k = 0, j = 0; k < blocks; k++)
      for (int64_t c = 0; c < col.width; c++, j++) {
        const uint64_t e = element_of(col, k, c);
        ea[j] = e * kDigestStepA;
        eb[j] = e * kDigestStepB;
        acc_a[j] = 0;
        acc_b[j] = 0;
      }
    const uint8_t* rows = col.data + r0 * col.row_bytes;
#ifdef RECCKPT_DIGEST_X86
    if constexpr (sizeof(T) == 4) {
      if (kHaveAvx2 && len % 8 == 0) {
        rows_u32_avx2(rows, col.row_bytes, m, len, ka, kb, ea, eb, acc_a, acc_b);
        switch_done = true;
      }
    }
#endif
    if (!switch_done) switch (len) {  // the usual embedding widths get a loop the compiler unrolls whole
      case 8: short_rows<T, 8>(rows, col.row_bytes, m, len, ka, kb, ea, eb, acc_a, acc_b); break;
      case 16: short_rows<T, 16>(rows, col.row_bytes, m, len, ka, kb, ea, eb, acc_a, acc_b); break;
      case 32: short_rows<T, 32>(rows, col.row_bytes, m, len, ka, kb, ea, eb, acc_a, acc_b); break;
      case 64: short_rows<T, 64>(rows, col.row_bytes, m, len, ka, kb, ea, eb, acc_a, acc_b); break;
      default: short_rows<T, 0>(rows, col.row_bytes, m, len, ka, kb, ea, eb, acc_a, acc_b); break;
    }
    for (int64_t j = 0; j < len; j++) {
      sa += acc_a[j];
      sb += acc_b[j];
    }
    out.a += sa;
    out.b += sb;
    return;
  }
  for (int64_t r = 0; r < m; r++) {
    const uint8_t* p = col.data + (r0 + r) * col.row_bytes;
    for (int64_t k = 0; k < blocks; k++)
      run<T>(p + k * col.width * (int64_t)sizeof(T), col.width, ka[r], kb[r],
             element_of(col, k, 0), sa, sb);
  }
  out.a += sa;
  out.b += sb;
}

// Rows [r0, r1): keys a block at a time, then every column over that block while its keys are hot.
inline __attribute__((always_inline)) void digest_range_body(const int64_t* ids, int64_t r0, int64_t r1, const std::vector<DigestColumn>* cols,
                  Digest128* out) {
  uint64_t ka[kBlockRows], kb[kBlockRows];
  for (int64_t b0 = r0; b0 < r1; b0 += kBlockRows) {
    const int64_t m = std::min(kBlockRows, r1 - b0);
    uint64_t ia = 0, ib = 0;
    for (int64_t r = 0; r < m; r++) {
      ka[r] = mix64((uint64_t)ids[b0 + r] ^ kDigestSeedA);
      kb[r] = fmix64((uint64_t)ids[b0 + r] ^ kDigestSeedB);
      ia += ka[r];
      ib += kb[r];
    }
    out[0].a += ia;
    out[0].b += ib;
    for (size_t k = 0; k < cols->size(); k++) {
      const DigestColumn& c = (*cols)[k];
      switch (c.itemsize) {
        case 1: column_rows<uint8_t>(c, b0, m, ka, kb, out[1 + k]); break;
        case 2: column_rows<uint16_t>(c, b0, m, ka, kb, out[1 + k]); break;
        case 4: column_rows<uint32_t>(c, b0, m, ka, kb, out[1 + k]); break;
        default: column_rows<uint64_t>(c, b0, m, ka, kb, out[1 + k]); break;
      }
    }
  }
}

using RangeFn = void (*)(const int64_t*, int64_t, int64_t, const std::vector<DigestColumn>*, Digest128*);

void digest_range_default(const int64_t* ids, int64_t r0, int64_t r1, const std::vector<DigestColumn>* cols,
                          Digest128* out) {
  digest_range_body(ids, r0, r1, cols, out);
}

#ifdef RECCKPT_DIGEST_X86
// The same loops compiled for wider vectors; AVX-512DQ has 64-bit lane multiplies (vpmullq).
__attribute__((target("avx2"))) void digest_range_avx2(const int64_t* ids, int64_t r0, int64_t r1,
                                                        const std::vector<DigestColumn>* cols, Digest128* out) {
  digest_range_body(ids, r0, r1, cols, out);
}
__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw"))) void digest_range_avx512(
    const int64_t* ids, int64_t r0, int64_t r1, const std::vector<DigestColumn>* cols, Digest128* out) {
  digest_range_body(ids, r0, r1, cols, out);
}
#endif

RangeFn pick_range_fn() {
#ifdef RECCKPT_DIGEST_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw"))
    return digest_range_avx512;
  if (__builtin_cpu_supports("avx2")) return digest_range_avx2;
#endif
  return digest_range_default;
}

const RangeFn digest_range = pick_range_fn();

}  // namespace

const char* digest_column_error(const DigestColumn& c) {
  if (c.itemsize != 1 && c.itemsize != 2 && c.itemsize != 4 && c.itemsize != 8)
    return "itemsize must be 1, 2, 4 or 8";
  if (c.row_bytes < 0 || c.row_bytes % c.itemsize) return "row bytes must be a multiple of the itemsize";
  if (c.width < 0 || c.full < 0 || c.first < 0 || c.first + c.width > c.full)
    return "the column window [first, first + width) must lie inside [0, full)";
  if (c.width == 0 ? c.row_bytes != 0 : (c.row_bytes / c.itemsize) % c.width != 0)
    return "a row must hold whole blocks of `width` elements";
  return nullptr;
}

void row_digests(const int64_t* ids, int64_t n, const std::vector<DigestColumn>& cols, Digest128* out,
                 int threads) {
  if (n <= 0) return;
  int64_t row = 8;
  for (const auto& c : cols) row += c.row_bytes;
  const int64_t by_size = std::max<int64_t>(1, n * row / kThreadBytes);
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, by_size, n}));
  if (t == 1) {
    digest_range(ids, 0, n, &cols, out);
    return;
  }
  // Sums are exact in any order, so each thread sums its rows into its own slots and they are added.
  std::vector<std::vector<Digest128>> parts((size_t)t, std::vector<Digest128>(cols.size() + 1));
  std::vector<std::thread> pool;
  pool.reserve((size_t)t - 1);
  int64_t started = 1;
  try {
    for (; started < t; started++)
      pool.emplace_back(digest_range, ids, n * started / t, n * (started + 1) / t, &cols,
                        parts[(size_t)started].data());
  } catch (const std::system_error&) {  // no more threads: this one does the rest
  }
  digest_range(ids, 0, n / t, &cols, parts[0].data());
  for (int64_t i = started; i < t; i++) digest_range(ids, n * i / t, n * (i + 1) / t, &cols, parts[(size_t)i].data());
  for (auto& th : pool) th.join();
  for (const auto& p : parts)
    for (size_t k = 0; k < p.size(); k++) out[k] += p[k];
}

}  // namespace recckpt
