// CRC-32C: SSE4.2 `crc32` instruction (chosen at run time, three interleaved streams recombined with
// a precomputed crc shift) with a slice-by-8 software fallback.
#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define RECCKPT_X86 1
#endif

namespace recckpt {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// a * b mod P in the reflected representation (bit 31 is x^0). `a` must be non-zero. (zlib's multmodp)
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(8 * nbytes) mod P: the operator that appends nbytes zero bytes to a raw crc state.
uint32_t x8nmodp(uint64_t nbytes) {
  uint32_t sq = 1u << 30;  // x^1
  uint32_t p = 1u << 31;   // x^0
  // x^(8n) = prod over set bits of 8n of x^(2^k)
  uint64_t e = nbytes;
  // x^8 first: square x three times
  for (int i = 0; i < 3; i++) sq = multmodp(sq, sq);
  while (e) {
    if (e & 1) p = multmodp(sq, p);
    e >>= 1;
    if (e) sq = multmodp(sq, sq);
  }
  return p;
}

constexpr size_t kLong = 8192;  // bytes per stream in the long interleaved loop
constexpr size_t kShort = 256;  // bytes per stream in the short interleaved loop

struct Tables {
  uint32_t sw[8][256];        // slice-by-8
  uint32_t shift_long[4][256];   // multiply a raw crc by x^(8*kLong)
  uint32_t shift_short[4][256];  // multiply a raw crc by x^(8*kShort)
  bool hw = false;

  Tables() {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      sw[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
      for (int k = 1; k < 8; k++) sw[k][i] = (sw[k - 1][i] >> 8) ^ sw[0][sw[k - 1][i] & 0xff];
    uint32_t kl = x8nmodp(kLong), ks = x8nmodp(kShort);
    for (uint32_t i = 0; i < 256; i++)
      for (int k = 0; k < 4; k++) {
        shift_long[k][i] = multmodp(kl, i << (8 * k));
        shift_short[k][i] = multmodp(ks, i << (8 * k));
      }
#if RECCKPT_X86
    __builtin_cpu_init();
    hw = __builtin_cpu_supports("sse4.2");
#endif
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}
// Force initialisation at load time so the first crc call in a worker thread is not the one to pay.
const Tables& g_init = tables();

inline uint32_t shift(const uint32_t (&t)[4][256], uint32_t c) {
  return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

}  // namespace

uint32_t crc32c_software(uint32_t crc, const void* data, size_t n) {
  const Tables& t = tables();
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = t.sw[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    n--;
  }
  while (n >= 8) {
    uint64_t w = load64(p) ^ c;
    c = t.sw[7][w & 0xff] ^ t.sw[6][(w >> 8) & 0xff] ^ t.sw[5][(w >> 16) & 0xff] ^
        t.sw[4][(w >> 24) & 0xff] ^ t.sw[3][(w >> 32) & 0xff] ^ t.sw[2][(w >> 40) & 0xff] ^
        t.sw[1][(w >> 48) & 0xff] ^ t.sw[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = t.sw[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

#if RECCKPT_X86
__attribute__((target("sse4.2"))) uint32_t crc32c_hardware(uint32_t crc, const void* data,
                                                            size_t n) {
  const Tables& t = tables();
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t c0 = (uint32_t)~crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    n--;
  }
  // Three independent streams hide the instruction's 3-cycle latency; the partial crcs are joined
  // by shifting (appending zeros to) the earlier ones.
  while (n >= 3 * kLong) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* end = p + kLong;
    do {
      c0 = _mm_crc32_u64(c0, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + kLong));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * kLong));
      p += 8;
    } while (p < end);
    c0 = shift(t.shift_long, (uint32_t)c0) ^ (uint32_t)c1;
    c0 = shift(t.shift_long, (uint32_t)c0) ^ (uint32_t)c2;
    p += 2 * kLong;
    n -= 3 * kLong;
  }
  while (n >= 3 * kShort) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* end = p + kShort;
    do {
      c0 = _mm_crc32_u64(c0, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + kShort));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * kShort));
      p += 8;
    } while (p < end);
    c0 = shift(t.shift_short, (uint32_t)c0) ^ (uint32_t)c1;
    c0 = shift(t.shift_short, (uint32_t)c0) ^ (uint32_t)c2;
    p += 2 * kShort;
    n -= 3 * kShort;
  }
  while (n >= 8) {
    c0 = _mm_crc32_u64(c0, load64(p));
    p += 8;
    n -= 8;
  }
  while (n--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
  return ~(uint32_t)c0;
}
#else
uint32_t crc32c_hardware(uint32_t crc, const void* data, size_t n) {
  return crc32c_software(crc, data, n);
}
#endif

bool crc32c_hardware_available() { return tables().hw; }

const char* crc32c_backend() { return tables().hw ? "sse4.2" : "software"; }

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  return tables().hw ? crc32c_hardware(crc, data, n) : crc32c_software(crc, data, n);
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  if (len_b == 0) return crc_a;
  return multmodp(x8nmodp(len_b), crc_a) ^ crc_b;
}

}  // namespace recckpt
