// Public face of data/: host-side micro-batches in the global sample order of DESIGN section 6.
// Only synthetic data exists so far; the Megatron .bin/.idx pipeline will plug in behind
// the same DataLoader interface.
#pragma once
#include <cstdint>
#include <vector>

#include "trainer/config/config.h"

namespace trainer {

// One micro-batch on the host, row-major. B = batch_size, L = seq_len.
struct MicroBatch {
  int64_t batch_size = 0;
  int64_t seq_len = 0;
  std::vector<int64_t> inputs;          // (B, L) token ids
  std::vector<int64_t> targets;         // (B, L) next-token ids
  std::vector<float> loss_mask;         // (B, L) 1 where the target counts, 0 for padding
  std::vector<int64_t> segment_ids;     // (B, L) document id within the row, 0 for padding
  std::vector<int64_t> positions;       // (B, L) RoPE positions, restarting per document
  std::vector<int64_t> sample_indices;  // (B) global sample index of each row
};

// Synthetic, learnable data: each sample is a pure function of (global index, seed), so any
// split of a global batch into micro-batches and ranks sees the same samples.
// A sample packs one or more documents; each document is an arithmetic progression of token
// ids (random start and stride, skipping pad_id), so the next token is predictable from the
// previous two. The valid length is drawn in [min_valid_fraction * L, L]; the rest is padding.
class SyntheticDataset {
 public:
  explicit SyntheticDataset(const Config& config);
  // Writes sample `global_index` into row `row` of `batch` (which must be sized).
  void fill_row(int64_t global_index, MicroBatch& batch, int64_t row) const;

 private:
  int64_t seq_len_, vocab_size_, pad_id_;
  uint64_t seed_;
  double min_valid_fraction_;
};

// Global sample order (DESIGN section 6): micro-batch m of data-parallel rank r in step k holds
// global samples k*GBS + m*mbs*R + r*mbs + [0, mbs).
int64_t data_first_sample_index(const Config& config, int64_t step, int64_t micro, int64_t rank);

class DataLoader {
 public:
  DataLoader(const Config& config, int64_t rank);
  // Micro-batch `micro` (0-based) of optimizer step `step` (0-based) for this rank.
  MicroBatch data_loader_next(int64_t step, int64_t micro) const;

 private:
  Config config_;
  int64_t rank_;
  SyntheticDataset dataset_;
};

}  // namespace trainer
