// Public face of data/: host-side micro-batches in the global sample order of DESIGN section 6,
// from synthetic data or Megatron .bin/.idx datasets (docs/data.md), and a prefetching loader.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
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
  std::vector<int64_t> segment_ids;     // (B, L) document id within the row (from 1), 0 for padding
  std::vector<int64_t> positions;       // (B, L) RoPE positions, restarting per document
  std::vector<int64_t> sample_indices;  // (B) global sample index of each row

  void resize(int64_t batch, int64_t seq);
};

// Where samples come from: row `row` of `batch` becomes global sample `index`.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual void fill_row(int64_t index, MicroBatch& batch, int64_t row) const = 0;
  // Whether a source built for `other_num_samples` samples gives the same sample at every index
  // both have (a resume with another `steps`): Megatron's index is shuffled over whole epochs.
  virtual bool same_samples_as_built_for(int64_t other_num_samples) const {
    (void)other_num_samples;
    return true;
  }
  // Host bytes of the index arrays it holds (Megatron's document, sample, shuffle and blend ids).
  virtual double index_bytes() const { return 0; }
};

// Synthetic, learnable data: each sample is a pure function of (global index, seed), so any
// split of a global batch into micro-batches and ranks sees the same samples.
// A sample packs one or more documents; each document is an arithmetic progression of token
// ids (random start and stride, skipping pad_id), so the next token is predictable from the
// previous two. The valid length is drawn in [min_valid_fraction * L, L]; the rest is padding.
class SyntheticDataset : public SampleSource {
 public:
  explicit SyntheticDataset(const Config& config);
  void fill_row(int64_t global_index, MicroBatch& batch, int64_t row) const override;

 private:
  int64_t seq_len_, vocab_size_, pad_id_;
  uint64_t seed_;
  double min_valid_fraction_;
};

enum class DataSplit { kTrain = 0, kValid = 1, kTest = 2 };

// Megatron GPTDataset samples of one split (train/valid/test) of a dataset or a blend, with
// Megatron's masks and positions (eod_mask_loss, reset_position_ids, reset_attention_mask).
// Index arrays are cached on disk (docs/data.md, "Index cache"). With several ranks, rank 0 builds
// each missing file; `sync` is how the ranks meet (empty members: one process, every miss is
// built here). Errors in the data throw trainer::Error (exit code 3).
struct DataIndexSync {
  // One index file as a rank sees it: its name (which holds the key of the data it indexes) and
  // whether rank 0 wrote it.
  struct Announcement {
    std::string file;
    bool cached = false;
  };
  // Every rank calls announce(slot, its announcement) for each index (`slot` names the split,
  // dataset and sample count); all get rank 0's. Rank 0 calls it once its file is written or
  // found (cached = true) or could not be written (false). Another rank waits for it and
  // compares the file name; all then vote on that (a different name: the ranks read different
  // data, and every rank exits 3). Another rank then uses its own cache hit, reads rank 0's file,
  // or builds the index itself where rank 0 did not cache it or it cannot see rank 0's (a
  // node-local cache directory).
  std::function<Announcement(const std::string& slot, const Announcement& mine)> announce;
  // vote(mine, what) returns how many ranks report `mine`, so that all stop together on what
  // only some see: index arrays that do not fit in memory (voted on before any rank builds
  // them: all exit 2), and an index file other than rank 0's (all exit 3).
  std::function<int64_t(bool mine, const std::string& what)> vote;
};
// `ranks_on_host` processes of this machine each hold the index arrays (the memory check).
std::unique_ptr<SampleSource> megatron_source(const Config& config, DataSplit split, int64_t num_samples,
                                              int64_t rank = 0, const DataIndexSync& sync = {}, int64_t ranks_on_host = 1);
// Why dataset_path's `split` part is empty ("<prefix>: split \"969,30,1\" leaves ... no sequences"
// for the first file where it is), or "" when every file has sequences in it. Megatron builds no
// dataset for an empty split (and skips its evaluation: the test split's after training).
std::string megatron_split_empty(const Config& config, DataSplit split);
// Throws the config error (exit 2) a run would for a malformed `dataset_path` blend (odd word
// count, a weight that is not a positive finite decimal): what --dry-run checks without the files.
void megatron_dataset_path_check(const Config& config);

// Global sample order (DESIGN section 6): micro-batch m of data-parallel rank r in step k holds
// global samples k*GBS + m*mbs*R + r*mbs + [0, mbs).
int64_t data_first_sample_index(const Config& config, int64_t step, int64_t micro, int64_t rank);

class DataLoader {
 public:
  // The training split (synthetic data or Megatron's train split sized steps * GBS).
  DataLoader(const Config& config, int64_t rank, const DataIndexSync& sync = {}, int64_t ranks_on_host = 1);
  // An explicit source (e.g. the validation split).
  DataLoader(const Config& config, int64_t rank, std::shared_ptr<SampleSource> source);
  // Micro-batch `micro` (0-based) of optimizer step `step` (0-based) for this rank: a pure
  // function of (step, micro), so a loader re-created at any step continues exactly.
  MicroBatch data_loader_next(int64_t step, int64_t micro) const;
  // One row: global sample `index` (for --dump-samples).
  MicroBatch data_loader_sample(int64_t index) const;
  // SampleSource::same_samples_as_built_for of the source.
  bool data_loader_same_samples_as_built_for(int64_t other_num_samples) const {
    return source_->same_samples_as_built_for(other_num_samples);
  }
  // SampleSource::index_bytes of the source: host memory this loader holds.
  double data_loader_index_bytes() const { return source_->index_bytes(); }

 private:
  Config config_;
  int64_t rank_;
  std::shared_ptr<SampleSource> source_;
};

// Produces micro-batches in order on a background thread, up to `depth` ahead of the consumer, so
// a step does not wait for data in steady state. The thread refills in bursts: it sleeps until the
// queue is down to half, then fills it, so the trainer (depth 2K) wakes it once per step, not once
// per micro-batch (each wake is a syscall and a context switch on a core the BLAS threads use).
class DataPrefetcher {
 public:
  DataPrefetcher(const DataLoader& loader, int64_t first_step, int64_t last_step, int64_t micro_batches,
                 size_t depth);
  ~DataPrefetcher();
  // The next micro-batch; must be called in (step, micro) order. Adds the time spent waiting
  // to *wait_seconds.
  MicroBatch data_prefetcher_next(int64_t step, int64_t micro, double* wait_seconds);

 private:
  void run();
  const DataLoader& loader_;
  int64_t first_step_, last_step_, micro_batches_;
  size_t depth_;
  std::deque<std::pair<std::pair<int64_t, int64_t>, MicroBatch>> queue_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace trainer
