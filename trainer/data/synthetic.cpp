// Synthetic data, the global sample order, the DataLoader over a sample source and its prefetch
// thread (see data.h).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "trainer/data/data.h"

namespace trainer {
namespace {

// splitmix64: a counter-based generator, so sample i never depends on samples before it.
struct CounterRng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t uniform(int64_t lo, int64_t hi) {  // inclusive
    return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
};

}  // namespace

SyntheticDataset::SyntheticDataset(const Config& c)
    : seq_len_(c.max_target_length),
      vocab_size_(c.vocab_size),
      pad_id_(c.pad_id),
      seed_(static_cast<uint64_t>(c.data_shuffle_seed)),
      min_valid_fraction_(c.synthetic_min_valid_fraction) {}

void SyntheticDataset::fill_row(int64_t global_index, MicroBatch& b, int64_t row) const {
  CounterRng rng{seed_ * 0xD1B54A32D192ED03ull ^ (static_cast<uint64_t>(global_index) + 1) * 0x8CB92BA72F3D8DD7ull};
  const int64_t L = seq_len_;
  const int64_t min_valid = std::clamp<int64_t>(
      static_cast<int64_t>(std::ceil(min_valid_fraction_ * static_cast<double>(L))), 1, L);
  const int64_t valid = rng.uniform(min_valid, L);
  const int64_t symbols = vocab_size_ - 1;  // every id but pad_id
  auto token_of = [this](int64_t symbol) { return symbol < pad_id_ ? symbol : symbol + 1; };

  const int64_t base = row * L;
  int64_t pos = 0, segment = 0;
  while (pos < valid) {
    ++segment;
    // Documents of at least 8 tokens (or what is left), so most rows pack one to three.
    const int64_t doc_len = std::min(valid - pos, rng.uniform(std::min<int64_t>(8, L), L));
    const int64_t start = rng.uniform(0, symbols - 1);
    const int64_t stride = rng.uniform(1, std::min<int64_t>(7, symbols - 1));
    for (int64_t j = 0; j < doc_len; ++j) {
      const int64_t i = base + pos + j;
      b.inputs[i] = token_of((start + j * stride) % symbols);
      const bool has_next = j + 1 < doc_len;
      b.targets[i] = has_next ? token_of((start + (j + 1) * stride) % symbols) : pad_id_;
      b.loss_mask[i] = has_next ? 1.0f : 0.0f;
      b.segment_ids[i] = segment;
      b.positions[i] = j;
    }
    pos += doc_len;
  }
  for (int64_t j = valid; j < L; ++j) {
    const int64_t i = base + j;
    b.inputs[i] = pad_id_;
    b.targets[i] = pad_id_;
    b.loss_mask[i] = 0.0f;
    b.segment_ids[i] = 0;
    b.positions[i] = j;
  }
  b.sample_indices[row] = global_index;
}

int64_t data_first_sample_index(const Config& c, int64_t step, int64_t micro, int64_t rank) {
  const int64_t mbs = c.per_device_batch_size;
  return step * c.global_batch_size + micro * mbs * c.data_parallel_size + rank * mbs;
}

void MicroBatch::resize(int64_t batch, int64_t seq) {
  batch_size = batch;
  seq_len = seq;
  inputs.resize(batch * seq);
  targets.resize(batch * seq);
  loss_mask.resize(batch * seq);
  segment_ids.resize(batch * seq);
  positions.resize(batch * seq);
  sample_indices.resize(batch);
}

DataLoader::DataLoader(const Config& config, int64_t rank, const DataIndexSync& sync, int64_t ranks_on_host)
    : config_(config),
      rank_(rank),
      source_(config.dataset_type == "synthetic"
                  ? std::shared_ptr<SampleSource>(std::make_shared<SyntheticDataset>(config))
                  : std::shared_ptr<SampleSource>(
                        megatron_source(config, DataSplit::kTrain, config.steps * config.global_batch_size, rank, sync,
                                        ranks_on_host))) {}

DataLoader::DataLoader(const Config& config, int64_t rank, std::shared_ptr<SampleSource> source)
    : config_(config), rank_(rank), source_(std::move(source)) {}

MicroBatch DataLoader::data_loader_next(int64_t step, int64_t micro) const {
  MicroBatch b;
  b.resize(config_.per_device_batch_size, config_.max_target_length);
  const int64_t first = data_first_sample_index(config_, step, micro, rank_);
  for (int64_t row = 0; row < b.batch_size; ++row) source_->fill_row(first + row, b, row);
  return b;
}

MicroBatch DataLoader::data_loader_sample(int64_t index) const {
  MicroBatch b;
  b.resize(1, config_.max_target_length);
  source_->fill_row(index, b, 0);
  return b;
}

DataPrefetcher::DataPrefetcher(const DataLoader& loader, int64_t first_step, int64_t last_step,
                               int64_t micro_batches, size_t depth)
    : loader_(loader), first_step_(first_step), last_step_(last_step),
      micro_batches_(micro_batches), depth_(depth), thread_([this] { run(); }) {}

DataPrefetcher::~DataPrefetcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void DataPrefetcher::run() {
  int64_t step = first_step_, micro = 0;
  while (step < last_step_) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // Sleeps only once the queue is full, until it is down to half (data_prefetcher_next).
      if (queue_.size() >= depth_) changed_.wait(lock, [this] { return stop_ || queue_.size() <= depth_ / 2; });
      if (stop_) return;
    }
    MicroBatch batch;
    try {
      batch = loader_.data_loader_next(step, micro);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::current_exception();
      changed_.notify_all();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back({{step, micro}, std::move(batch)});
    }
    changed_.notify_all();
    if (++micro == micro_batches_) micro = 0, ++step;
  }
}

MicroBatch DataPrefetcher::data_prefetcher_next(int64_t step, int64_t micro, double* wait_seconds) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [this] { return !queue_.empty() || error_ != nullptr; });
  if (wait_seconds) *wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (queue_.empty()) std::rethrow_exception(error_);
  auto item = std::move(queue_.front());
  queue_.pop_front();
  const bool refill = queue_.size() <= depth_ / 2;
  lock.unlock();
  if (refill) changed_.notify_all();
  if (item.first != std::make_pair(step, micro))
    throw std::logic_error("DataPrefetcher: micro-batches must be requested in order");
  return std::move(item.second);
}

}  // namespace trainer
