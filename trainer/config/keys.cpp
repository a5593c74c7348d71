// The key registry: one entry per TRAINER_CONFIG_KEYS item, with strict, lossless coercion.
#include "trainer/config/keys.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>

#include "trainer/util/error.h"

namespace trainer::config_detail {
namespace {

// Values a key may take, where the set is closed.
const std::map<std::string, std::vector<std::string>>& allowed_values() {
  static const std::map<std::string, std::vector<std::string>> table = {
      {"hardware", {"cpu", "gpu"}},
      {"dist_backend", {"auto", "gloo", "nccl"}},
      {"data_parallel_sharding", {"none", "optim", "optim_grads", "optim_grads_params", "no_shard"}},  // no_shard: Megatron's none
      {"remat_policy", {"none", "full", "minimal"}},
      {"log_format", {"maxtext", "megatron"}},
      {"dtype", {"float32", "bfloat16"}},
      {"cpu_bf16_gemm", {"auto", "fp32", "native"}},
      {"dataset_type", {"synthetic", "megatron", "grain"}},
      {"grain_file_type", {"", "mmap_npy"}},
      {"lr_schedule_type", {"cosine", "constant", "wsd"}},
      {"wsd_decay_style", {"linear", "cosine"}},
      {"debug_inject_nonfinite_kind", {"loss_nan", "loss_inf", "grad_nan", "grad_inf"}},
      {"mlp_activations", {"silu", "linear"}},
      {"routed_score_func", {"softmax", "sigmoid"}},
      {"moe_dispatch", {"grouped", "loop"}},
      {"moe_aux_loss_over_layers", {"mean", "sum"}},
      {"attention_type", {"global", "mla", "gla"}},
      {"rope_type", {"default", "yarn", "llama3"}},
  };
  return table;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

}  // namespace

// YAML's escapes for what would end the quotes or the line, so the file loads back to the same
// value (`run_name=x"y` used to print a line no YAML parser reads); quoted, so "" and values like
// "1e3" stay strings.
std::string yaml_double_quoted(const std::string& value) {
  std::string out = "\"";
  for (const char ch : value) {
    const auto byte = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (byte < 0x20 || byte == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      out += escaped;
    } else {
      out += ch;  // UTF-8 as it is
    }
  }
  return out + "\"";
}

namespace {

[[noreturn]] void bad_value(const std::string& key, const YAML::Node& node,
                            const std::string& source, const std::string& expected) {
  // A YAML null (`null`, `~` or nothing) is named as such: '' read as an empty value typed in.
  const std::string value = node.IsNull() ? std::string("null") : "'" + node_text(node) + "'";
  throw config_error("config key '" + key + "': value " + value + " (from " + source + ") is not allowed: expected " + expected);
}

std::string scalar_of(const std::string& key, const YAML::Node& node, const std::string& source,
                      const std::string& expected) {
  if (node.IsNull()) return "";
  if (!node.IsScalar()) bad_value(key, node, source, expected);
  return node.Scalar();
}

template <typename T>
struct Codec;

template <>
struct Codec<bool> {
  static constexpr const char* type_name = "bool";
  static bool parse(const std::string& key, const YAML::Node& node, const std::string& source) {
    const std::string s = scalar_of(key, node, source, "true or false");
    if (s == "true" || s == "True" || s == "TRUE") return true;
    if (s == "false" || s == "False" || s == "FALSE") return false;
    bad_value(key, node, source, "true or false");
  }
  static std::string format(bool v) { return v ? "true" : "false"; }
};

// The integer a decimal literal denotes exactly, as a digit string with its sign, or "" when it
// denotes none: "12.0" and "1.5e1" are whole numbers, "1.5" and "2.0000000000000001" are not (the
// decision is on the digits, not on a rounded double). YAML 1.1 digit separators ("150_001", as
// MaxText's base.yml writes its larger integers) are read between digits.
std::string whole_number_digits(std::string s) {
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] == '_' && (i == 0 || i + 1 == s.size() || !std::isdigit(static_cast<unsigned char>(s[i - 1])) ||
                        !(std::isdigit(static_cast<unsigned char>(s[i + 1])) || s[i + 1] == '_')))
      return "";
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  std::string sign;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) sign = s[0] == '-' ? "-" : "", s.erase(0, 1);
  const size_t e = s.find_first_of("eE");
  std::string mantissa = s.substr(0, e), exponent = e == std::string::npos ? "" : s.substr(e + 1);
  const size_t dot = mantissa.find('.');
  std::string digits = mantissa.substr(0, dot), fraction = dot == std::string::npos ? "" : mantissa.substr(dot + 1);
  const auto all_digits = [](const std::string& t) {
    return std::all_of(t.begin(), t.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)) != 0; });
  };
  if (digits.empty() && fraction.empty()) return "";
  if (!all_digits(digits) || !all_digits(fraction) || (e != std::string::npos && exponent.empty())) return "";
  long shift = 0;
  if (!exponent.empty()) {
    const bool negative = exponent[0] == '-';
    if (exponent[0] == '+' || exponent[0] == '-') exponent.erase(0, 1);
    if (exponent.empty() || !all_digits(exponent) || exponent.size() > 4) return "";
    shift = std::stol(exponent) * (negative ? -1 : 1);
  }
  digits += fraction;  // the value is digits x 10^(shift - |fraction|)
  shift -= static_cast<long>(fraction.size());
  if (shift < 0) {
    const size_t cut = static_cast<size_t>(-shift);
    const std::string dropped = cut >= digits.size() ? digits : digits.substr(digits.size() - cut);
    if (dropped.find_first_not_of('0') != std::string::npos) return "";  // a fractional part
    digits = cut >= digits.size() ? "0" : digits.substr(0, digits.size() - cut);
  } else {
    digits.append(static_cast<size_t>(std::min<long>(shift, 40)), '0');  // past 19 digits it is out of range anyway
  }
  digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size() - 1));
  return sign + digits;
}

template <>
struct Codec<int64_t> {
  static constexpr const char* type_name = "integer";
  static int64_t parse(const std::string& key, const YAML::Node& node, const std::string& source) {
    const std::string s = scalar_of(key, node, source, "an integer");
    if (s.empty()) bad_value(key, node, source, "an integer");
    // Whole numbers in any decimal spelling (MaxText's configs write per_device_batch_size: 12.0
    // and steps: 150_001); never 1.5, 0x10 or inf.
    const std::string digits = whole_number_digits(s);
    if (digits.empty()) bad_value(key, node, source, "an integer");
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(digits.c_str(), &end, 10);
    if (errno == ERANGE || digits.size() > 20)
      bad_value(key, node, source, "an integer from -9223372036854775808 to 9223372036854775807");
    return static_cast<int64_t>(v);
  }
  static std::string format(int64_t v) { return std::to_string(v); }
};

template <>
struct Codec<double> {
  static constexpr const char* type_name = "float";
  static double parse(const std::string& key, const YAML::Node& node, const std::string& source) {
    const std::string s = scalar_of(key, node, source, "a number");
    if (s.empty()) bad_value(key, node, source, "a number");
    errno = 0;
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    // strtod also reads hexadecimal ("0x10" = 16, "0x1p-8"): refused, as for integer keys.
    if (end != s.c_str() + s.size() || !std::isfinite(v) || (errno == ERANGE && std::fabs(v) > 1) ||
        s.find_first_of("xX") != std::string::npos)
      bad_value(key, node, source, "a finite decimal number");
    // Real-valued keys are scales, weights, rates and epsilons that meet float32 arithmetic:
    // past its largest value one would be Inf there (routed_scaling_factor=1e40 ended step 0 as a
    // numerical abort), below its smallest a nonzero one would be 0 (adam_eps=1e-50 divides by
    // it). The others (timeouts, peak FLOP/s) have no use for such magnitudes either.
    if (std::fabs(v) > std::numeric_limits<float>::max() ||
        (v != 0 && std::fabs(v) < std::numeric_limits<float>::denorm_min()) || (errno == ERANGE && v == 0))
      bad_value(key, node, source, "a number float32 can hold (magnitude 0, or from 1.41e-45 to 3.4e38)");
    return v;
  }
  // The fewest significant digits that read back as the same double: 3e-4 prints as 0.0003, not
  // as its 17-digit expansion 0.00029999999999999997 (the printed config and error messages show
  // it); whole numbers below 1e17 keep their digits (10000, not %g's 1e+04).
  static std::string format(double v) {
    char buf[64];
    int digits = 1;
    for (; digits < 17; ++digits) {
      std::snprintf(buf, sizeof buf, "%.*g", digits, v);
      if (std::strtod(buf, nullptr) == v) break;
    }
    const int exponent = v == 0 ? 0 : static_cast<int>(std::floor(std::log10(std::fabs(v))));
    if (exponent >= digits && exponent < 17) digits = exponent + 1;
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    std::string s = buf;
    // Keep it a float when read back as YAML (1 -> 1.0).
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
    return s;
  }
};

template <>
struct Codec<std::string> {
  static constexpr const char* type_name = "string";
  static std::string parse(const std::string& key, const YAML::Node& node,
                           const std::string& source) {
    return scalar_of(key, node, source, "a string");
  }
  static std::string format(const std::string& v) { return yaml_double_quoted(v); }
};

template <>
struct Codec<StringList> {
  static constexpr const char* type_name = "list of strings";
  static StringList parse(const std::string& key, const YAML::Node& node,
                          const std::string& source) {
    if (!node.IsSequence()) bad_value(key, node, source, "a list like [a, b]");
    StringList out;
    for (const auto& item : node) {
      if (!item.IsScalar()) bad_value(key, node, source, "a list of strings");
      out.push_back(item.Scalar());
    }
    return out;
  }
  // Each item quoted, so a printed list loads back to the same items (a regex of adamw_mask may
  // hold ',', ']' or a leading '*').
  static std::string format(const StringList& v) {
    std::string out;
    for (const auto& item : v) out += (out.empty() ? "" : ", ") + yaml_double_quoted(item);
    return "[" + out + "]";
  }
};

// A value another trainer spells differently: what to write here instead.
std::string value_note(const std::string& key, const std::string& value) {
  if (key == "rope_type" && value == "llama3.1")
    return " (MaxText's llama3.1 is rope_type=llama3 with rope_factor=8, original_max_position_embeddings=8192, "
           "rope_low_freq_factor=1, rope_high_freq_factor=4: Llama 3.1's numbers, which it fixes)";
  return "";
}

template <typename T>
KeyInfo make_key(const std::string& name, T Config::*member) {
  KeyInfo info;
  info.name = name;
  info.type_name = Codec<T>::type_name;
  const auto it = allowed_values().find(name);
  if (it != allowed_values().end()) info.allowed = it->second;
  const auto allowed = info.allowed;
  info.assign = [name, member, allowed](Config& c, const YAML::Node& node,
                                        const std::string& source) {
    T value = Codec<T>::parse(name, node, source);
    if constexpr (std::is_same_v<T, std::string>) {
      if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), value) == allowed.end())
        bad_value(name, node, source, "one of: " + join(allowed) + value_note(name, value));
    }
    if constexpr (std::is_same_v<T, StringList>) {
      for (const auto& item : value)
        if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), item) == allowed.end())
          bad_value(name, node, source, "a list of: " + join(allowed));
    }
    c.*member = std::move(value);
  };
  info.format = [member](const Config& c) { return Codec<T>::format(c.*member); };
  return info;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

}  // namespace

const std::vector<KeyInfo>& key_registry() {
  static const std::vector<KeyInfo> registry = [] {
    std::vector<KeyInfo> keys;
#define TRAINER_REGISTER_KEY(type, name) keys.push_back(make_key<type>(#name, &Config::name));
    TRAINER_CONFIG_KEYS(TRAINER_REGISTER_KEY)
#undef TRAINER_REGISTER_KEY
    return keys;
  }();
  return registry;
}

const KeyInfo* find_key(const std::string& name) {
  for (const auto& key : key_registry())
    if (key.name == name) return &key;
  return nullptr;
}

std::string nearest_key(const std::string& name) {
  std::string best;
  size_t best_distance = std::string::npos;
  for (const auto& key : key_registry()) {
    const size_t d = edit_distance(name, key.name);
    if (d < best_distance) best_distance = d, best = key.name;
  }
  return best;
}

std::string node_text(const YAML::Node& node) {
  if (node.IsScalar()) return node.Scalar();
  if (node.IsNull()) return "";
  YAML::Emitter out;
  out << YAML::Flow << node;
  return out.c_str();
}

}  // namespace trainer::config_detail

namespace trainer {
const std::vector<std::string>& config_key_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& key : config_detail::key_registry()) out.push_back(key.name);
    return out;
  }();
  return names;
}
}  // namespace trainer
