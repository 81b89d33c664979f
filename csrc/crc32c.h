// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78). `crc` continues an earlier result the way
// zlib.crc32 does (pass 0 to start).
#pragma once
#include <cstddef>
#include <cstdint>

namespace recckpt {

uint32_t crc32c(uint32_t crc, const void* data, size_t n);           // best available backend
uint32_t crc32c_software(uint32_t crc, const void* data, size_t n);  // slice-by-8 tables
uint32_t crc32c_hardware(uint32_t crc, const void* data, size_t n);  // SSE4.2; only if available
bool crc32c_hardware_available();
const char* crc32c_backend();  // "sse4.2" or "software"

// CRC of A||B from crc(A), crc(B) and len(B).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace recckpt
