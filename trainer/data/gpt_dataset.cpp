// Megatron GPTDataset index construction (see gpt_dataset.h), following
// megatron/core/datasets/gpt_dataset.py, helpers.cpp and blended_megatron_dataset_builder.py.
#include "trainer/data/gpt_dataset.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include "trainer/util/error.h"

namespace trainer {

uint64_t NumpyRandomState::random_interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;  // smallest all-ones mask >= max
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xffffffffULL) {
    while ((value = (static_cast<uint64_t>(mt_()) & mask)) > max) {
    }
  } else {
    auto next64 = [this] {
      const uint64_t hi = mt_();
      return (hi << 32) | static_cast<uint64_t>(mt_());
    };
    while ((value = (next64() & mask)) > max) {
    }
  }
  return value;
}

namespace {

// numpy's pairwise_sum (the DOUBLE add reduction), from 0: under 8 values in order, up to 128 in
// eight interleaved sums, above that split at a multiple of 8 below half.
double pairwise_sum(const double* values, size_t n) {
  if (n < 8) {
    double sum = 0;
    for (size_t i = 0; i < n; ++i) sum += values[i];
    return sum;
  }
  if (n <= 128) {
    double r[8];
    for (size_t j = 0; j < 8; ++j) r[j] = values[j];
    size_t i = 8;
    for (; i < n - n % 8; i += 8)
      for (size_t j = 0; j < 8; ++j) r[j] += values[i + j];
    double sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) sum += values[i];
    return sum;
  }
  size_t half = n / 2;
  half -= half % 8;
  return pairwise_sum(values, half) + pairwise_sum(values + half, n - half);
}

}  // namespace

double numpy_sum(const std::vector<double>& values) { return pairwise_sum(values.data(), values.size()); }

std::vector<double> numpy_normalize(const std::vector<double>& weights) {
  const double total = numpy_sum(weights);
  std::vector<double> out;
  for (double w : weights) out.push_back(w / total);
  return out;
}

std::vector<int64_t> gpt_split_boundaries(const std::string& split, int64_t n) {
  std::vector<double> weights;
  std::stringstream ss(split);
  for (std::string part; std::getline(ss, part, split.find(',') != std::string::npos ? ',' : '/');) {
    // Megatron reads the numbers with the regex [.0-9]+, so any other character separates two:
    // "1e2,1" is 1, 2, 1 there (train 25%), 100, 1 for strtod (99%); "0x10" is 0 and 10. Only plain
    // decimals mean the same to both.
    const char* const blank = " \t\n\v\f\r";  // what strtod skipped, and Megatron's regex
    const size_t first = part.find_first_not_of(blank), last = part.find_last_not_of(blank);
    if (first == std::string::npos || part.substr(first, last - first + 1).find_first_not_of("0123456789.") != std::string::npos)
      throw config_error("config key 'split': '" + split + "': write each part as plain decimal digits like \"969,30,1\" "
                         "(Megatron's parser reads only [.0-9]+: \"1e2\" would be the two numbers 1 and 2 there)");
    char* end = nullptr;
    weights.push_back(std::strtod(part.c_str(), &end));
    const size_t used = static_cast<size_t>(end - part.c_str());
    if (used == 0 || part.find_first_not_of(blank, used) != std::string::npos || !std::isfinite(weights.back()))
      throw config_error("config key 'split': '" + split + "' is not a list of finite numbers like \"969,30,1\"");
  }
  while (weights.size() < 3) weights.push_back(0.0);
  if (weights.size() != 3) throw config_error("config key 'split': '" + split + "' must have at most 3 parts");
  const double total = numpy_sum(weights);
  if (std::isinf(total))
    throw config_error("config key 'split': '" + split + "': its parts sum past the largest double; scale them down");
  if (!(total > 0) || weights[0] < 0 || weights[1] < 0 || weights[2] < 0)
    throw config_error("config key 'split': '" + split + "' must be non-negative with a positive sum");
  // Megatron (parse_and_normalize_split, convert_split_vector_to_split_matrix, the builder's
  // split): the normalized weights are summed into book-ends 0, w0, w0 + w1, w0 + w1 + w2 (Python
  // floats, left to right), and each book-end is rounded on its own: int(round(e * n)), half to
  // even, which std::nearbyint does by default. Rounding each part and shifting the total back to
  // n (the legacy get_split_indices) gives other ranges: "1,1,1" over 10 is 0,3,7,10 here, 0,4,7,10
  // there.
  const std::vector<double> normalized = numpy_normalize(weights);
  std::vector<int64_t> bounds = {0};
  double edge = 0;
  for (double w : normalized) {
    edge += w;
    bounds.push_back(static_cast<int64_t>(std::nearbyint(edge * static_cast<double>(n))));
  }
  return bounds;
}

namespace {

// The documents tiled over the epochs and shuffled: the first E - 1 epochs together and the last
// on its own when it is separate. Built in place (no second array appended to the first: the
// memory check counts one array of each kind, docs/data.md).
std::vector<int32_t> build_document_index(const std::vector<int32_t>& documents, int64_t num_epochs,
                                          NumpyRandomState& rng, bool separate_final_epoch) {
  std::vector<int32_t> index;
  index.reserve(documents.size() * static_cast<size_t>(num_epochs));
  for (int64_t e = 0; e < num_epochs; ++e) index.insert(index.end(), documents.begin(), documents.end());
  const size_t together = separate_final_epoch && num_epochs > 1 ? index.size() - documents.size() : index.size();
  rng.shuffle(index.data(), together);
  rng.shuffle(index.data() + together, index.size() - together);
  return index;
}

// helpers.cpp build_sample_idx with drop_last_partial_sequence = true, add_extra_token = 1.
std::vector<int64_t> build_sample_index(const std::vector<int32_t>& sizes, const std::vector<int32_t>& document_index,
                                        int64_t seq_len, int64_t num_epochs, int64_t tokens_per_epoch) {
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_len;
  std::vector<int64_t> sample(2 * static_cast<size_t>(num_samples + 1));
  int64_t sample_pos = 0, doc_pos = 0, doc_offset = 0;
  sample[0] = doc_pos;
  sample[1] = doc_offset;
  ++sample_pos;
  while (sample_pos <= num_samples) {
    int64_t remaining = seq_len + 1;
    while (remaining != 0) {
      const int64_t doc_length = sizes[static_cast<size_t>(document_index[static_cast<size_t>(doc_pos)])] - doc_offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        doc_offset += remaining + doc_length - 1;
        remaining = 0;
      } else {
        if (doc_pos == static_cast<int64_t>(document_index.size()) - 1) {
          doc_offset = sizes[static_cast<size_t>(document_index[static_cast<size_t>(doc_pos)])] - 1;
          break;
        }
        ++doc_pos;
        doc_offset = 0;
      }
    }
    sample[2 * sample_pos] = doc_pos;
    sample[2 * sample_pos + 1] = doc_offset;
    ++sample_pos;
  }
  return sample;
}

// arange(total_size) with [0, num_samples) and [num_samples, total_size) shuffled apart.
std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size, NumpyRandomState& rng) {
  std::vector<int64_t> index(static_cast<size_t>(total_size));
  std::iota(index.begin(), index.end(), 0);
  rng.shuffle(index.data(), static_cast<size_t>(num_samples));
  rng.shuffle(index.data() + num_samples, static_cast<size_t>(total_size - num_samples));
  return index;
}

// Smallest E >= 1 with E * tokens >= num_samples * L + 1 (the +1: every sample reads L + 1 tokens).
// In double for the size estimate, where num_samples * L may pass int64 (a run of 1e18 steps).
double num_epochs_needed(int64_t tokens_per_epoch, int64_t seq_len, int64_t num_samples) {
  return std::max(1.0, std::ceil((static_cast<double>(num_samples) * static_cast<double>(seq_len) + 1.0) /
                                 static_cast<double>(tokens_per_epoch)));
}

}  // namespace

GptIndicesSize gpt_indices_size(const std::vector<int32_t>& sizes, const std::vector<int32_t>& documents, int64_t seq_len,
                                int64_t num_samples) {
  const int64_t tokens_per_epoch = gpt_tokens_per_epoch(sizes, documents);
  const double epochs = num_epochs_needed(tokens_per_epoch, seq_len, num_samples);
  const double total_samples = std::floor((epochs * static_cast<double>(tokens_per_epoch) - 1.0) / static_cast<double>(seq_len));
  GptIndicesSize out;
  out.num_epochs = epochs < 9e18 ? static_cast<int64_t>(epochs) : std::numeric_limits<int64_t>::max();
  out.document_bytes = 4.0 * static_cast<double>(documents.size()) * epochs;
  out.sample_bytes = 8.0 * 2.0 * (total_samples + 1.0);
  out.shuffle_bytes = 8.0 * total_samples;
  return out;
}

GptEpochs gpt_epochs(int64_t tokens_per_epoch, int64_t seq_len, int64_t num_samples) {
  // num_samples * L + 1 tokens must be addressable (int64) with an epoch to spare.
  if (num_samples > (std::numeric_limits<int64_t>::max() - 2 * tokens_per_epoch) / seq_len)
    throw config_error(std::to_string(num_samples) + " samples of " + std::to_string(seq_len) +
                       " tokens are more tokens than an int64 counts: lower steps or global_batch_size");
  GptEpochs out;
  out.num_epochs = (num_samples * seq_len + tokens_per_epoch) / tokens_per_epoch;  // num_epochs_needed, in int64
  if (out.num_epochs > 1) {
    out.samples_before_final = ((out.num_epochs - 1) * tokens_per_epoch - 1) / seq_len;
    const int64_t from_final = num_samples - out.samples_before_final;
    const int64_t per_epoch = (tokens_per_epoch - 1) / seq_len;
    out.separate_final_epoch = from_final < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
  }
  return out;
}

int64_t gpt_tokens_per_epoch(const std::vector<int32_t>& sizes, const std::vector<int32_t>& documents) {
  int64_t tokens = 0;
  for (int32_t d : documents) tokens += sizes[static_cast<size_t>(d)];
  if (tokens <= 1) throw Error(kExitData, "the data split has " + std::to_string(tokens) + " tokens; at least 2 are needed");
  return tokens;
}

GptIndices gpt_build_indices(const std::vector<int32_t>& sizes, const std::vector<int32_t>& documents,
                             int64_t seq_len, int64_t num_samples, uint32_t seed) {
  const int64_t tokens_per_epoch = gpt_tokens_per_epoch(sizes, documents);
  const GptEpochs epochs = gpt_epochs(tokens_per_epoch, seq_len, num_samples);
  GptIndices out;
  out.num_epochs = epochs.num_epochs;
  out.separate_final_epoch = epochs.separate_final_epoch;
  NumpyRandomState rng(seed);
  out.document_index = build_document_index(documents, out.num_epochs, rng, out.separate_final_epoch);
  out.sample_index = build_sample_index(sizes, out.document_index, seq_len, out.num_epochs, tokens_per_epoch);
  const int64_t total = static_cast<int64_t>(out.sample_index.size() / 2) - 1;
  out.shuffle_index = build_shuffle_index(out.separate_final_epoch ? epochs.samples_before_final : total, total, rng);
  return out;
}

std::vector<GptPiece> gpt_sample_pieces(const GptIndices& ix, const std::vector<int32_t>& sizes, int64_t i) {
  const int64_t s = ix.shuffle_index[static_cast<size_t>(i)];
  const int64_t beg = ix.sample_index[2 * s], beg_offset = ix.sample_index[2 * s + 1];
  const int64_t end = ix.sample_index[2 * s + 2], end_offset = ix.sample_index[2 * s + 3];
  std::vector<GptPiece> pieces;
  auto doc = [&](int64_t pos) { return static_cast<int64_t>(ix.document_index[static_cast<size_t>(pos)]); };
  if (beg == end) {
    pieces.push_back({doc(beg), beg_offset, end_offset - beg_offset + 1});
  } else {
    for (int64_t p = beg; p <= end; ++p) {
      const int64_t offset = p > beg ? 0 : beg_offset;
      const int64_t length = p < end ? sizes[static_cast<size_t>(doc(p))] - offset : end_offset + 1;
      pieces.push_back({doc(p), offset, length});
    }
  }
  return pieces;
}

std::vector<int64_t> gpt_blend_sizes(const std::vector<double>& weights, int64_t target) {
  std::vector<int64_t> sizes;
  for (double w : numpy_normalize(weights))
    sizes.push_back(static_cast<int64_t>(std::ceil(std::ceil(static_cast<double>(target) * w) * 1.005)));
  return sizes;
}

void gpt_blend_indices(const std::vector<double>& raw_weights, int64_t size, std::vector<int16_t>& dataset_index,
                       std::vector<int64_t>& dataset_sample_index) {
  // Normalized twice, as Megatron does (the builder, then BlendedDataset.__init__): the second
  // pass moves the last bits, and with them which dataset wins a near tie ("0.7 A 0.2 B 0.1 C"
  // gives samples 6 and 7 the other way round with one pass).
  const std::vector<double> weights = numpy_normalize(numpy_normalize(raw_weights));
  std::vector<int64_t> current(weights.size(), 0);
  dataset_index.resize(static_cast<size_t>(size));
  dataset_sample_index.resize(static_cast<size_t>(size));
  for (int64_t s = 0; s < size; ++s) {
    const double s_double = std::max(static_cast<double>(s), 1.0);
    size_t best = 0;
    double best_error = weights[0] * s_double - static_cast<double>(current[0]);
    for (size_t d = 1; d < weights.size(); ++d) {
      const double error = weights[d] * s_double - static_cast<double>(current[d]);
      if (error > best_error) best_error = error, best = d;
    }
    dataset_index[static_cast<size_t>(s)] = static_cast<int16_t>(best);
    dataset_sample_index[static_cast<size_t>(s)] = current[best]++;
  }
}

}  // namespace trainer
