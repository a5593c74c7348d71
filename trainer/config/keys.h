// Internal to config/: the key registry (type, allowed values, parse and format per key).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "trainer/config/config.h"

namespace trainer::config_detail {

struct KeyInfo {
  std::string name;
  std::string type_name;               // "integer", "float", "bool", "string", "list of strings"
  std::vector<std::string> allowed;    // non-empty: the value must be one of these
  // Coerces `node` into the field of `config`; throws config_error naming key, value, source.
  std::function<void(Config&, const YAML::Node&, const std::string& source)> assign;
  // The field's value as a YAML flow scalar or sequence (round-trippable).
  std::function<std::string(const Config&)> format;
};

const std::vector<KeyInfo>& key_registry();
const KeyInfo* find_key(const std::string& name);

// The known key closest to `name` by edit distance (for "did you mean").
std::string nearest_key(const std::string& name);

// Text of a node for messages: a scalar as written, anything else in YAML flow style.
std::string node_text(const YAML::Node& node);

// `value` as a YAML double-quoted scalar that loads back to it (", \ and control bytes escaped).
std::string yaml_double_quoted(const std::string& value);

}  // namespace trainer::config_detail
