// Content digests (digest.h). The loops are written so the compiler vectorises them across the
// elements of a row; on x86-64 with GCC they are also compiled for AVX2 and AVX-512 (64-bit lane
// multiplies) and the best version is picked when the library loads.
#include "digest.h"

#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>

#include "hash.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define RECCKPT_DIGEST_X86 1
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
      xa += mix64((uint64_t)v ^ (ba + kStepTable.a[c]));
      xb += fmix64((uint64_t)v ^ (bb + kStepTable.b[c]));
    }
    sa += xa;
    sb += xb;
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
          sa += mix64((uint64_t)v ^ (ka[r] + ea));
          sb += fmix64((uint64_t)v ^ (kb[r] + eb));
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
    for (int64_t k = 0, j = 0; k < blocks; k++)
      for (int64_t c = 0; c < col.width; c++, j++) {
        const uint64_t e = element_of(col, k, c);
        ea[j] = e * kDigestStepA;
        eb[j] = e * kDigestStepB;
        acc_a[j] = 0;
        acc_b[j] = 0;
      }
    for (int64_t r = 0; r < m; r++) {
      const uint8_t* p = col.data + (r0 + r) * col.row_bytes;
      const uint64_t a = ka[r], b = kb[r];
      for (int64_t j = 0; j < len; j++) {
        T v;
        std::memcpy(&v, p + j * (int64_t)sizeof(T), sizeof(T));
        acc_a[j] += mix64((uint64_t)v ^ (a + ea[j]));
        acc_b[j] += fmix64((uint64_t)v ^ (b + eb[j]));
      }
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
