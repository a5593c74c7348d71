// json_is_int64: whether a JSON value is an integer that get<int64_t>() reads exactly. nlohmann
// parses integers above 2^63 - 1 as unsigned, and get<int64_t>() would wrap them negative.
#pragma once

#include <cstdint>
#include <limits>

#include <nlohmann/json.hpp>

namespace trainer {

inline bool json_is_int64(const nlohmann::json& value) {
  return value.is_number_integer() &&
         !(value.is_number_unsigned() &&
           value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
}

}  // namespace trainer
