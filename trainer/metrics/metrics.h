// Public face of metrics/: named scalar metrics per step, written to the console (every
// log_period steps, MaxText style) and to the JSON-lines metrics file (every step).
#pragma once
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "trainer/config/config.h"
#include "trainer/metrics/tensorboard.h"

namespace trainer {

using MetricValues = std::vector<std::pair<std::string, double>>;  // name -> value, in log order

double metric_get(const MetricValues& values, const std::string& name);  // throws if absent

// One JSON object: {"step": N, "name": value, ...}, floats with 17 significant digits
// (round-trippable); NaN and infinities as NaN / Infinity / -Infinity (Python's json reads them).
std::string metrics_to_json(int64_t step, const MetricValues& values);

// Where rank `rank` > 0 writes its metrics with log_all_ranks: <run_dir>/metrics.rank<rank>.jsonl.
std::string metrics_file_of_rank(const std::string& run_dir, int64_t rank);

using MetricHistory = std::deque<std::pair<int64_t, MetricValues>>;  // (step, values), oldest first

// What Megatron-LM's training_log accumulates between two log lines: the steps since the last
// line (or since the run started or resumed), however many (log_period may exceed any history).
struct MegatronInterval {
  int64_t iterations = 0;        // steps in the interval
  int64_t counted = 0;           // of them not skipped: the loss means' denominator
  int64_t skipped = 0, nan = 0;  // skipped steps; of them, those whose lm loss is NaN or Inf
  double time_sum = 0;           // seconds
  std::vector<double> loss_sums;  // per megatron_loss_columns entry: lm loss over the counted steps, the rest over all
};
void megatron_interval_add(MegatronInterval& interval, const Config& config, const MetricValues& step_values);

// Megatron-LM's training_log line for iteration step + 1 over `interval`, with the learning rate
// and norms of `last` (that step's values); format and sources in metrics.cpp and docs/metrics.md.
// `timestamp` goes between the leading brackets ("2026-12-01 10:00:00.123456").
std::string megatron_log_line(const Config& config, int64_t step, const MegatronInterval& interval,
                              const MetricValues& last, const std::string& timestamp);

// Which evaluation: one every eval_interval steps, or one of the two Megatron runs after the
// last step (the validation split's, then the test split's).
enum class EvalPhase { kInLoop, kValidAfterTraining, kTestAfterTraining };

// Megatron-LM's validation print for `iteration` (1-based): three lines, the loss and its
// perplexity between two rules of dashes (metrics.cpp).
std::string megatron_validation_block(int64_t iteration, double lm_loss, EvalPhase phase);

class MetricsLogger {
 public:
  static constexpr size_t kHistoryLength = 128;  // bounded in-memory history

  // Opens metrics_file. When resuming at `first_step` > 0, lines of steps >= first_step (written
  // after the checkpoint by an interrupted run) are dropped and the rest kept; TensorBoard is told
  // to drop its points of those steps too (tensorboard.h). `evaluation_only` (no step will run:
  // skip_train, a finished run launched again): lines are appended, none dropped or moved aside,
  // and no TensorBoard events are written (Megatron's --skip-train writes none).
  MetricsLogger(const Config& config, int64_t first_step = 0, bool evaluation_only = false);
  ~MetricsLogger();
  void log(int64_t step, const MetricValues& values);
  // An evaluation after `step`: one JSON line {"step": step, "eval/...": ...} ("test/..." for the
  // test split's) and a console line, or Megatron's validation block.
  void log_eval(int64_t step, const MetricValues& values, EvalPhase phase);
  // Before evaluation step `done` of `steps` (over `samples` samples): with log_format megatron,
  // Megatron's verbose evaluation lines "Evaluating on N samples" (first) and "Evaluating iter i/n".
  void log_eval_progress(int64_t done, int64_t steps, int64_t samples);
  const MetricHistory& history() const { return history_; }

 private:
  void console_line(int64_t step, const MetricValues& values);
  void megatron_line(int64_t step, bool reset);

  Config config_;
  int64_t first_step_;  // this process's first step (Megatron prints its line)
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::FILE* file_ = nullptr;
  MetricHistory history_;            // the last kHistoryLength steps (the console line's ETA)
  MegatronInterval megatron_interval_;  // steps since the last Megatron line
};

}  // namespace trainer
