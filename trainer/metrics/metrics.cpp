// Metric sinks: JSON lines (every step) and the MaxText-style console line (every log_period).
#include "trainer/metrics/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include <spdlog/spdlog.h>

#include "trainer/util/error.h"

namespace trainer {

double metric_get(const MetricValues& values, const std::string& name) {
  for (const auto& [key, value] : values)
    if (key == name) return value;
  throw std::out_of_range("no metric named " + name);
}

namespace {
std::string json_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
}  // namespace

std::string metrics_file_of_rank(const std::string& run_dir, int64_t rank) {
  return (std::filesystem::path(run_dir) / ("metrics.rank" + std::to_string(rank) + ".jsonl")).string();
}

std::string metrics_to_json(int64_t step, const MetricValues& values) {
  std::string out = "{\"step\": " + std::to_string(step);
  for (const auto& [name, value] : values) out += ", \"" + name + "\": " + json_number(value);
  return out + "}";
}

namespace {
// A free name beside `path` for an earlier file kept aside: <path>.earlier-<time>-<pid>[.n].
std::string metrics_aside_name(const std::filesystem::path& path) {
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%Y%m%d_%H%M%S", std::localtime(&now));
  std::string aside = path.string() + ".earlier-" + stamp + "-" + std::to_string(::getpid());
  for (int n = 1; std::filesystem::exists(aside); ++n)  // two runs of one process in one second
    aside = path.string() + ".earlier-" + stamp + "-" + std::to_string(::getpid()) + "." + std::to_string(n);
  return aside;
}
}  // namespace

MetricsLogger::MetricsLogger(const Config& config, int64_t first_step, bool evaluation_only)
    : config_(config), first_step_(first_step) {
  std::error_code ec;
  // A symbolic link is followed: the file it names is the one kept, rewritten or moved aside (the
  // rename used to replace the link by a regular file, its target left with the old lines).
  std::filesystem::path path(config.metrics_file);
  if (std::filesystem::is_symlink(path, ec)) {
    const auto target = std::filesystem::weakly_canonical(path, ec);
    if (!ec) path = target;  // a loop (ELOOP) keeps the name: opening it then says why
  }
  if (path.has_parent_path() && (std::filesystem::create_directories(path.parent_path(), ec), ec))
    throw Error(kExitFailure, "cannot create the directory of metrics_file " + path.string() + ": " + ec.message());
  // A directory would fail below as a rename or an empty read; named as a fresh run names it.
  if (std::filesystem::is_directory(path, ec))
    throw Error(kExitFailure, "cannot open metrics_file " + path.string() + ": it is a directory");
  // A device or a FIFO (/dev/null, a pipe to a consumer) is written as it is: nothing to keep,
  // rewrite or move aside (a resume replaced /dev/null by a regular file, run as root).
  const bool regular = !std::filesystem::exists(path, ec) || std::filesystem::is_regular_file(path, ec);
  if (!regular) spdlog::info("metrics_file {} is not a regular file: written to as it is", path.string());
  if (regular && !evaluation_only && first_step > 0 && std::filesystem::exists(path)) {
    // Resuming: keep the lines of steps before first_step. The kept lines go to a temporary
    // file that replaces the old one by rename, so a kill at any moment loses nothing. Lines
    // dropped (steps run after the last checkpoint, or another run's file named by mistake) stay
    // in the whole earlier file, kept aside under a second name.
    std::string kept;
    int64_t dropped = 0, first_dropped = -1;
    std::ifstream in(path);
    int64_t number = 0;
    for (std::string line; std::getline(in, line);) {
      ++number;
      const auto at = line.find("\"step\": ");
      if (at == std::string::npos || line.empty() || line.back() != '}') continue;  // a torn last line
      int64_t step = 0;
      const char* digits = line.c_str() + at + 8;
      const auto [end, error] = std::from_chars(digits, line.c_str() + line.size(), step);
      if (error != std::errc() || end == digits)
        throw Error(kExitFailure, "metrics_file " + path.string() + " line " + std::to_string(number) +
                                      ": \"step\" is not an integer step; the file is not this trainer's (or was edited)");
      if (step < first_step) {
        kept += line + "\n";
      } else if (dropped++ == 0) {
        first_dropped = step;
      }
    }
    const std::string tmp = path.string() + ".tmp";
    std::FILE* out = std::fopen(tmp.c_str(), "w");
    if (!out || std::fputs(kept.c_str(), out) < 0 || std::fflush(out) != 0 || ::fsync(fileno(out)) != 0)
      throw Error(kExitFailure, "cannot rewrite metrics_file " + tmp + ": " + std::strerror(errno));
    std::fclose(out);
    if (dropped > 0) {
      const std::string aside = metrics_aside_name(path);
      std::filesystem::create_hard_link(path, aside, ec);
      if (ec) std::filesystem::copy_file(path, aside, ec);
      if (ec) throw Error(kExitFailure, "cannot keep the earlier metrics_file " + path.string() + " as " + aside + ": " + ec.message());
      spdlog::warn("metrics_file {}: {} lines from step {} on are past the resumed step {} (run after the last checkpoint, "
                   "or another run's file); dropped here, the whole earlier file kept as {}",
                   path.string(), dropped, first_dropped, first_step, aside);
    }
    std::filesystem::rename(tmp, path);
  }
  if (regular && !evaluation_only && first_step == 0 && std::filesystem::file_size(path, ec) > 0 && !ec) {
    // A fresh run whose metrics file holds an earlier run's lines (one that left no checkpoint,
    // or metrics_file shared by mistake): moved aside, not overwritten.
    const std::string aside = metrics_aside_name(path);
    std::filesystem::rename(path, aside, ec);
    if (ec) throw Error(kExitFailure, "cannot move the earlier metrics_file " + path.string() + " aside: " + ec.message());
    spdlog::warn("metrics_file {} held the lines of an earlier run, and this run starts at step 0; moved them to {}",
                 path.string(), aside);
  }
  file_ = std::fopen(path.c_str(), first_step > 0 || !regular || evaluation_only ? "a" : "w");
  if (!file_)
    throw Error(kExitFailure, "cannot open metrics_file " + path.string() + ": " + std::strerror(errno));
  if (config.enable_tensorboard && !evaluation_only)
    tensorboard_ = std::make_unique<TensorBoardWriter>((std::filesystem::path(config.run_dir) / "tensorboard").string(),
                                                       first_step);
}

MetricsLogger::~MetricsLogger() {
  if (file_) std::fclose(file_);
}

void MetricsLogger::log(int64_t step, const MetricValues& values) {
  const std::string line = metrics_to_json(step, values) + "\n";
  // Flushed per line so a crash or kill loses nothing already reported.
  if (std::fputs(line.c_str(), file_) < 0 || std::fflush(file_) != 0)
    throw Error(kExitFailure, "cannot write metrics_file " + config_.metrics_file + ": " + std::strerror(errno));
  if (tensorboard_) tensorboard_->tensorboard_add_scalars(step, values);
  history_.emplace_back(step, values);
  while (history_.size() > kHistoryLength) history_.pop_front();
  // The console line at steps 0, log_period, ... (current MaxText prints every step: log_period=1).
  // Megatron logs iterations log_period, 2*log_period, ... and the first iteration of each process
  // (a start or a resume: its startup cost shows there), that one without starting a new interval
  // (training_log's should_reset); nothing extra at the last iteration.
  if (config_.log_format == "megatron") {
    megatron_interval_add(megatron_interval_, config_, values);
    const bool first = step == first_step_;
    if ((step + 1) % config_.log_period == 0 || first) megatron_line(step, /*reset=*/!first);
  } else if (step % config_.log_period == 0 || step + 1 == config_.steps) {
    console_line(step, values);
  }
}

namespace {
// (metric, label) of each loss Megatron prints, in its order.
std::vector<std::pair<std::string, std::string>> megatron_loss_columns(const Config& config) {
  std::vector<std::pair<std::string, std::string>> columns = {{"megatron/lm_loss", "lm loss"}};
  // Megatron tracks load_balancing_loss for its default --moe-router-load-balancing-type aux_loss
  // whatever the coefficient: with 0 (the Ling recipes) it prints 0.000000E+00.
  if (config.num_experts > 1) columns.emplace_back("megatron/load_balancing_loss", "load_balancing_loss");
  if (config.num_experts > 1 && config.router_z_loss_weight > 0) columns.emplace_back("megatron/z_loss", "z_loss");
  for (int64_t k = 1; k <= config.mtp_num_layers; ++k)
    columns.emplace_back("megatron/mtp_" + std::to_string(k) + "_loss", "mtp_" + std::to_string(k) + " loss");
  return columns;
}
}  // namespace

void megatron_interval_add(MegatronInterval& interval, const Config& config, const MetricValues& v) {
  const auto columns = megatron_loss_columns(config);
  interval.loss_sums.resize(columns.size(), 0.0);
  ++interval.iterations;
  interval.time_sum += metric_get(v, "perf/step_time_seconds");
  const bool skipped = metric_get(v, "optim/step_skipped") != 0;
  interval.skipped += skipped;
  // training_log: a NaN iteration is a skipped one whose loss dict (lm loss) is NaN or Inf; the
  // lm loss sums the applied iterations only, while the MoE and MTP trackers add every
  // iteration's losses, all divided by the applied count.
  interval.nan += skipped && !std::isfinite(metric_get(v, "megatron/lm_loss"));
  interval.counted += !skipped;
  for (size_t i = skipped ? 1 : 0; i < columns.size(); ++i) interval.loss_sums[i] += metric_get(v, columns[i].first);
}

// Megatron-LM's training_log line, label for label as megatron/training/training.py prints it at
// commit d98e8a64 (docs/metrics.md): a timestamp, iteration (1-based), consumed samples, time per
// iteration, learning rate (after the scheduler's step: the next update's), global batch size,
// then each loss summed over the interval and divided by its applied iterations -- `lm loss`
// (applied iterations only; token-weighted over the global batch, in both normalization modes),
// `load_balancing_loss` and `z_loss` (divided by their coefficients, mean over MoE layers),
// `mtp_<k> loss` per depth (unscaled) (these three over every iteration, as Megatron's trackers)
// -- each left out when its mean is not >= 0 (NaN), as Megatron does; then loss scale (1.0: no
// fp16 scaler), grad norm (before clipping), num zeros (with log_num_zeros_in_grad), params norm,
// and the interval's skipped and nan iteration counts. Printed to stdout without a logger prefix.
std::string megatron_log_line(const Config& config, int64_t step, const MegatronInterval& interval,
                              const MetricValues& v, const std::string& timestamp) {
  const auto columns = megatron_loss_columns(config);
  const int64_t iterations = interval.iterations, counted = interval.counted;
  const double time_sum = interval.time_sum;
  std::string line = fmt::format(
      " [{}] iteration {:8d}/{:8d} | consumed samples: {:12d} | elapsed time per iteration (ms): {:.1f} | "
      "learning rate: {:.6E} | global batch size: {:5d} |",
      timestamp, step + 1, config.steps, (step + 1) * config.global_batch_size,
      1000.0 * time_sum / static_cast<double>(std::max<int64_t>(iterations, 1)),
      metric_get(v, "megatron/learning_rate"), config.global_batch_size);
  for (size_t i = 0; i < columns.size(); ++i) {
    const double sum = i < interval.loss_sums.size() ? interval.loss_sums[i] : 0.0;
    const double mean = sum / static_cast<double>(std::max<int64_t>(counted, 1));
    if (mean >= 0.0) line += fmt::format(" {}: {:.6E} |", columns[i].second, mean);
  }
  line += fmt::format(" loss scale: 1.0 | grad norm: {:.3f} |", metric_get(v, "learning/raw_grad_norm"));
  // An integer: Megatron counts zeros into an int64 tensor and prints its .item().
  if (config.log_num_zeros_in_grad)
    line += fmt::format(" num zeros: {} |", static_cast<int64_t>(std::llround(metric_get(v, "learning/num_zeros"))));
  line += fmt::format(" params norm: {:.3f} | number of skipped iterations: {:3d} | number of nan iterations: {:3d} |",
                      metric_get(v, "learning/param_norm"), interval.skipped, interval.nan);
  return line;
}

void MetricsLogger::megatron_line(int64_t step, bool reset) {
  const auto now = std::chrono::system_clock::now();
  const auto micros = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  std::tm local{};
  localtime_r(&seconds, &local);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S", &local);
  const std::string line =
      megatron_log_line(config_, step, megatron_interval_, history_.back().second, fmt::format("{}.{:06d}", date, micros));
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
  if (reset) megatron_interval_ = MegatronInterval{};  // Megatron zeroes its totals after each line but the first
}

void MetricsLogger::log_eval(int64_t step, const MetricValues& values, EvalPhase phase) {
  const std::string line = metrics_to_json(step, values) + "\n";
  if (std::fputs(line.c_str(), file_) < 0 || std::fflush(file_) != 0)
    throw Error(kExitFailure, "cannot write metrics_file " + config_.metrics_file + ": " + std::strerror(errno));
  if (tensorboard_) tensorboard_->tensorboard_add_scalars(step, values);
  const std::string split = phase == EvalPhase::kTestAfterTraining ? "test" : "eval";
  const auto get = [&](const std::string& name) { return metric_get(values, split + "/" + name); };
  if (config_.log_format == "megatron") {
    const std::string block = megatron_validation_block(step + 1, get("lm_loss") - get("z_loss"), phase);
    std::fputs(block.c_str(), stdout);
    std::fflush(stdout);
    return;
  }
  spdlog::info("{} {}after step {}: lm_loss {:.4f}, perplexity {:.3f} ({:.0f} tokens)", split,
               phase == EvalPhase::kInLoop ? "" : "(after training) ", step, get("lm_loss"), get("perplexity"),
               get("total_weights"));
}

void MetricsLogger::log_eval_progress(int64_t done, int64_t steps, int64_t samples) {
  if (config_.log_format != "megatron") return;
  const std::string text = (done == 0 ? fmt::format("Evaluating on {} samples\n", samples) : std::string()) +
                           fmt::format("Evaluating iter {}/{}\n", done + 1, steps);
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
}

// Megatron-LM's evaluate_and_print_results (d98e8a64): the line between two rules of dashes one
// longer than it, the loss and exp(min(20, loss)) in %.6E, the trailing " | " included; prefix
// "iteration N" inside the loop, "iteration N on validation set" and "iteration N on test set"
// after training.
std::string megatron_validation_block(int64_t iteration, double lm_loss, EvalPhase phase) {
  const char* split = phase == EvalPhase::kValidAfterTraining ? " on validation set"
                      : phase == EvalPhase::kTestAfterTraining ? " on test set"
                                                               : "";
  const std::string text = fmt::format(" validation loss at iteration {}{} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ",
                                       iteration, split, lm_loss, std::exp(std::min(20.0, lm_loss)));
  const std::string rule(text.size() + 1, '-');
  return rule + "\n" + text + "\n" + rule + "\n";
}

void MetricsLogger::console_line(int64_t step, const MetricValues& v) {
  std::string line = fmt::format(
      "completed step: {}, seconds: {:.3f}, TFLOP/s/device: {:.3f}, Tokens/s/device: {:.1f}, "
      "total_weights: {:.0f}, loss: {:.4f}, lm_loss: {:.4f}, grad_norm: {:.3f} (raw {:.3f}), lr: {:.3e}",
      step, metric_get(v, "perf/step_time_seconds"), metric_get(v, "perf/per_device_tflops_per_sec"),
      metric_get(v, "perf/per_device_tokens_per_sec"), metric_get(v, "learning/total_weights"),
      metric_get(v, "learning/loss"), metric_get(v, "learning/lm_loss"), metric_get(v, "learning/grad_norm"),
      metric_get(v, "learning/raw_grad_norm"), metric_get(v, "learning/current_learning_rate"));
  if (config_.num_experts > 1) line += fmt::format(", moe_lb_loss: {:.4f}", metric_get(v, "learning/moe_lb_loss"));
  if (config_.mtp_num_layers > 0) line += fmt::format(", mtp_loss: {:.4f}", metric_get(v, "learning/mtp_loss"));
  if (config_.z_loss_multiplier > 0) line += fmt::format(", z_loss: {:.4f}", metric_get(v, "learning/z_loss"));
  if (metric_get(v, "optim/step_skipped") > 0) line += ", step skipped";
  // ETA from the median step time of the recent history.
  std::vector<double> times;
  for (const auto& [s, values] : history_) times.push_back(metric_get(values, "perf/step_time_seconds"));
  std::nth_element(times.begin(), times.begin() + static_cast<long>(times.size() / 2), times.end());
  const double eta = times[times.size() / 2] * static_cast<double>(config_.steps - step - 1);
  line += fmt::format(", ETA {:02d}:{:02d}:{:02d}", static_cast<int>(eta / 3600), static_cast<int>(eta / 60) % 60,
                      static_cast<int>(eta) % 60);
  if (metric_get(v, "learning/is_nan") > 0) line += ", NaN";
  if (metric_get(v, "learning/is_inf") > 0) line += ", Inf";
  spdlog::info("{}", line);
}

}  // namespace trainer
