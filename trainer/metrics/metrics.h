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

using MetricHistory = std::deque<std::pair<int64_t, MetricValues>>;  // (step, values), oldest first

// Megatron-LM's training_log line for iteration step + 1 over the last log_period steps of
// `history` (format and sources in metrics.cpp and docs/metrics.md); `timestamp` goes between
// the leading brackets ("2026-12-01 10:00:00.123456").
std::string megatron_log_line(const Config& config, int64_t step, const MetricHistory& history,
                              const std::string& timestamp);

class MetricsLogger {
 public:
  static constexpr size_t kHistoryLength = 128;  // bounded in-memory history

  // Opens metrics_file. When resuming at `first_step` > 0, lines of steps >= first_step (written
  // after the checkpoint by an interrupted run) are dropped and the rest kept.
  MetricsLogger(const Config& config, int64_t first_step = 0);
  ~MetricsLogger();
  void log(int64_t step, const MetricValues& values);
  // An evaluation after `step`: one JSON line {"step": step, "eval/...": ...} and a console line.
  void log_eval(int64_t step, const MetricValues& values);
  const MetricHistory& history() const { return history_; }

 private:
  void console_line(int64_t step, const MetricValues& values);
  void megatron_line(int64_t step);

  Config config_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::FILE* file_ = nullptr;
  MetricHistory history_;
};

}  // namespace trainer
