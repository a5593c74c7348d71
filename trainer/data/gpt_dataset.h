// Megatron GPTDataset sampling, reproduced exactly (docs/data.md): split, document / sample /
// shuffle indices with numpy's legacy RandomState shuffle, blending. Plain C++.
#pragma once
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace trainer {

// numpy.random.RandomState(seed) for the calls Megatron makes: MT19937 seeded by init_genrand
// (identical to std::mt19937(seed)), and shuffle = Fisher-Yates from the end with
// random_interval's masked rejection sampling.
class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : mt_(seed) {}
  uint64_t random_interval(uint64_t max);  // uniform in [0, max]
  template <typename T>
  void shuffle(T* values, size_t n) {
    for (size_t i = n; i-- > 1;) std::swap(values[i], values[random_interval(i)]);
  }
  template <typename T>
  void shuffle(std::vector<T>& values) {
    shuffle(values.data(), values.size());
  }

 private:
  std::mt19937 mt_;
};

// numpy.sum of a float64 array, bit for bit: pairwise in blocks of 8 from 8 values on. Megatron
// normalizes split and blend weights with it (utils.normalize), and the sum's last bit decides
// near ties.
double numpy_sum(const std::vector<double>& values);
// utils.normalize: each weight divided by numpy_sum of them.
std::vector<double> numpy_normalize(const std::vector<double>& weights);

// Megatron's split of n sequences: "969,30,1" -> 4 boundaries, each cumulative normalized weight
// times n rounded half to even (the builder's int(round(e * n))).
std::vector<int64_t> gpt_split_boundaries(const std::string& split, int64_t n);

struct GptIndices {
  std::vector<int32_t> document_index;  // document ids, tiled over epochs and shuffled
  std::vector<int64_t> sample_index;    // 2 * (samples + 1): (document_index position, offset) pairs
  std::vector<int64_t> shuffle_index;   // sample order
  int64_t num_epochs = 0;
  bool separate_final_epoch = false;
};

// How many epochs a GPTDataset of `num_samples` samples of seq_len tokens spans (the smallest E
// with E * tokens_per_epoch >= num_samples * seq_len + 1) and whether the last is shuffled on its
// own (Megatron: when it contributes fewer than 80% of an epoch's samples). The index arrays
// depend on num_samples through these alone: two sample counts with the same GptEpochs give the
// same sample at every index. config_error when the token count passes int64.
struct GptEpochs {
  int64_t num_epochs = 1;
  bool separate_final_epoch = false;
  int64_t samples_before_final = 0;  // samples of the first num_epochs - 1 epochs
  bool operator==(const GptEpochs& o) const {
    return num_epochs == o.num_epochs && separate_final_epoch == o.separate_final_epoch;
  }
};
GptEpochs gpt_epochs(int64_t tokens_per_epoch, int64_t seq_len, int64_t num_samples);
// The tokens of `documents` (exit 3 when fewer than 2).
int64_t gpt_tokens_per_epoch(const std::vector<int32_t>& sizes, const std::vector<int32_t>& documents);

// Builds the indices of one GPTDataset: `documents` are the document ids of the split,
// `sizes` the token count of every document, `num_samples` the samples requested.
GptIndices gpt_build_indices(const std::vector<int32_t>& sizes, const std::vector<int32_t>& documents,
                             int64_t seq_len, int64_t num_samples, uint32_t seed);

// What gpt_build_indices would allocate, computed without building anything: a run of 1e9 steps
// asks for arrays far past the host's memory and must be refused before they are allocated.
struct GptIndicesSize {
  int64_t num_epochs = 0;
  double document_bytes = 0, sample_bytes = 0, shuffle_bytes = 0;  // the three arrays
  double total_bytes() const { return document_bytes + sample_bytes + shuffle_bytes; }
};
GptIndicesSize gpt_indices_size(const std::vector<int32_t>& sizes, const std::vector<int32_t>& documents, int64_t seq_len,
                                int64_t num_samples);

// Token positions of sample `i` (through the shuffle index): a list of (document id, offset,
// length) pieces whose lengths sum to seq_len + 1.
struct GptPiece {
  int64_t document, offset, length;
};
std::vector<GptPiece> gpt_sample_pieces(const GptIndices& indices, const std::vector<int32_t>& sizes, int64_t i);

// Megatron's blend sizes: ceil(ceil(target * w) * 1.005) samples per dataset, weights normalized
// once (numpy_normalize).
std::vector<int64_t> gpt_blend_sizes(const std::vector<double>& weights, int64_t target);

// Megatron's build_blending_indices: sample s goes to the dataset with the largest
// w_d * max(s, 1) - count_d (first on ties), w the raw weights normalized twice as Megatron's
// builder and BlendedDataset do. Fills dataset ids and per-dataset sample ids.
void gpt_blend_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>& dataset_index,
                       std::vector<int64_t>& dataset_sample_index);

}  // namespace trainer
