// CRC32C (Castagnoli), used by checkpoint manifests and data-index cache keys.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace trainer {

// Incremental: crc = crc32c_update(crc, data, n), starting from 0.
uint32_t crc32c_update(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(const std::string& s) { return crc32c_update(0, s.data(), s.size()); }

}  // namespace trainer
