// Metrics sinks: TensorBoard event files checked with an independent decoder of the record
// format (length, masked CRC32C, protobuf fields), Megatron's log line, MFU and memory metrics.
// LibTorch first: its glog headers define CHECK, and Catch's definition must come last (this file
// is built without the shared PCH, which otherwise puts LibTorch first).
#include "trainer/train/device.h"
#include "trainer/train/train.h"

#include <catch2/catch.hpp>

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>

#include "test_support.h"

using namespace trainer;
using namespace trainer::testing;
namespace fs = std::filesystem;

namespace {

const std::string kOut = test_root() + "/metrics";

// Bitwise CRC32C (no table), independent of trainer/util/crc32c.cpp.
uint32_t crc32c_bitwise(const std::string& data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}
uint32_t masked(const std::string& data) {
  const uint32_t crc = crc32c_bitwise(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

struct Reader {
  const std::string& s;
  size_t pos = 0;
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto b = static_cast<unsigned char>(s.at(pos++));
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
  }
  std::string bytes(size_t n) {
    const std::string out = s.substr(pos, n);
    pos += n;
    return out;
  }
};

struct Event {
  double wall_time = 0;
  int64_t step = -1;
  std::string file_version;
  int64_t session_status = -1;  // SessionLog.status (START = 1), -1 when the event has none
  std::map<std::string, float> scalars;
};

Event decode_event(const std::string& data) {
  Event e;
  Reader r{data};
  while (r.pos < data.size()) {
    const uint64_t key = r.varint();
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    if (field == 1 && wire == 1) {
      const auto b = r.bytes(8);
      std::memcpy(&e.wall_time, b.data(), 8);
    } else if (field == 2 && wire == 0) {
      e.step = static_cast<int64_t>(r.varint());
    } else if (field == 3 && wire == 2) {
      e.file_version = r.bytes(r.varint());
    } else if (field == 7 && wire == 2) {  // SessionLog {status = 1}
      const std::string log = r.bytes(r.varint());
      Reader lr{log};
      REQUIRE(lr.varint() == (1 << 3 | 0));
      e.session_status = static_cast<int64_t>(lr.varint());
      REQUIRE(lr.pos == log.size());
    } else if (field == 5 && wire == 2) {
      const std::string summary = r.bytes(r.varint());
      Reader sr{summary};
      while (sr.pos < summary.size()) {
        REQUIRE(sr.varint() == (1 << 3 | 2));  // Summary.value
        const std::string value = sr.bytes(sr.varint());
        Reader vr{value};
        std::string tag;
        float simple = 0;
        while (vr.pos < value.size()) {
          const uint64_t vkey = vr.varint();
          if (vkey == (1 << 3 | 2)) tag = vr.bytes(vr.varint());
          else if (vkey == (2 << 3 | 5)) std::memcpy(&simple, vr.bytes(4).data(), 4);
          else FAIL("unexpected Summary.Value field " << vkey);
        }
        e.scalars[tag] = simple;
      }
    } else {
      FAIL("unexpected Event field " << field << " wire type " << wire);
    }
  }
  return e;
}

// Every record of an event file, its two CRCs checked.
std::vector<Event> read_events(const std::string& path) {
  const std::string bytes = read_file(path);
  std::vector<Event> events;
  size_t pos = 0;
  while (pos < bytes.size()) {
    REQUIRE(pos + 12 <= bytes.size());
    const std::string length_bytes = bytes.substr(pos, 8);
    uint64_t length;
    uint32_t length_crc, data_crc;
    std::memcpy(&length, length_bytes.data(), 8);
    std::memcpy(&length_crc, bytes.data() + pos + 8, 4);
    CHECK(length_crc == masked(length_bytes));
    const std::string data = bytes.substr(pos + 12, length);
    std::memcpy(&data_crc, bytes.data() + pos + 12 + length, 4);
    CHECK(data_crc == masked(data));
    events.push_back(decode_event(data));
    pos += 12 + length + 4;
  }
  return events;
}

// The event files of a run's tensorboard/ directory, in name order (TensorBoard's reading order).
std::vector<std::string> event_files(const std::string& run_dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(run_dir + "/tensorboard")) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

TEST_CASE("TensorBoard event files decode with an independent reader and match metrics.jsonl", "[metrics][cli]") {
  fs::remove_all(kOut + "/tb");
  REQUIRE(run_trainer("model_name=test-tiny max_target_length=16 steps=3 enable_tensorboard=true base_output_directory=" +
                      kOut + " run_name=tb").exit_code == 0);
  const auto files = event_files(kOut + "/tb");
  REQUIRE(files.size() == 1);
  CHECK(fs::path(files[0]).filename().string().rfind("events.out.tfevents.", 0) == 0);
  const auto events = read_events(files[0]);
  REQUIRE(events.size() == 5);
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK((events[1].session_status == 1 && events[1].step == 0 && events[1].scalars.empty()));  // START at step 0
  const auto lines = read_lines(kOut + "/tb/metrics.jsonl");
  for (int step = 0; step < 3; ++step) {
    const Event& e = events[static_cast<size_t>(step) + 2];
    CHECK(e.step == step);
    CHECK(e.wall_time > 1.7e9);
    CHECK(e.scalars.size() >= 17);
    for (const char* name : {"learning/loss", "learning/grad_norm", "learning/total_weights", "perf/step_time_seconds"})
      CHECK(e.scalars.at(name) == static_cast<float>(json_metric(lines[static_cast<size_t>(step)], name)));
  }
}

TEST_CASE("TensorBoard: evaluations are written, and a resume marks its step so the re-run steps are not shown twice",
          "[metrics][cli]") {
  // The first run saves after 2 steps and runs step 2 (and its final evaluation) too; the resume
  // runs steps 2..4. TensorBoard drops what earlier files hold at steps >= a START's step.
  fs::remove_all(kOut + "/tb-resume");
  const std::string args = "model_name=test-tiny max_target_length=16 enable_tensorboard=true checkpoint_period=2 "
                           "save_checkpoint_on_completion=false eval_interval=2 eval_steps=1 base_output_directory=" +
                           kOut + " run_name=tb-resume";
  REQUIRE(run_trainer(args + " steps=3").exit_code == 0);
  REQUIRE(run_trainer(args + " steps=5").exit_code == 0);  // within the same second: a second file all the same
  const auto files = event_files(kOut + "/tb-resume");
  REQUIRE(files.size() == 2);
  const auto first = read_events(files[0]), second = read_events(files[1]);
  REQUIRE(first.size() >= 2);
  REQUIRE(second.size() >= 2);
  CHECK((first[1].session_status == 1 && first[1].step == 0));
  CHECK((second[1].session_status == 1 && second[1].step == 2));
  // What TensorBoard shows: the first file's events before step 2, then the second file's.
  std::vector<Event> shown;
  for (const Event& e : first)
    if (!e.scalars.empty() && e.step < 2) shown.push_back(e);
  for (const Event& e : second)
    if (!e.scalars.empty()) shown.push_back(e);
  // Exactly metrics.jsonl, evaluation lines included, in its order.
  const auto lines = read_lines(kOut + "/tb-resume/metrics.jsonl");
  REQUIRE(shown.size() == lines.size());
  int evaluations = 0, tests = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    INFO(lines[i]);
    CHECK(shown[i].step == static_cast<int64_t>(json_metric(lines[i], "step")));
    const bool eval = lines[i].find("\"eval/lm_loss\"") != std::string::npos;
    const bool test = lines[i].find("\"test/lm_loss\"") != std::string::npos;
    evaluations += eval;
    tests += test;
    const char* name = eval ? "eval/lm_loss" : test ? "test/lm_loss" : "learning/loss";
    REQUIRE(shown[i].scalars.count(name) == 1);
    CHECK(shown[i].scalars.at(name) == static_cast<float>(json_metric(lines[i], name)));
  }
  CHECK(evaluations == 3);  // after steps 1 and 3, and the final one after step 4
  CHECK(tests == 1);        // the test split's, after that
}

TEST_CASE("TensorBoard writers of the same second get names that sort in the order they were made", "[metrics]") {
  const std::string dir = kOut + "/tb-same-second";
  fs::remove_all(dir);
  std::vector<std::string> made;
  for (int i = 0; i < 12; ++i) made.push_back(TensorBoardWriter(dir, i).path());  // a file each, none truncated
  std::vector<std::string> sorted = made;
  std::sort(sorted.begin(), sorted.end());
  // Within a second .001 ... .011 follow the plain name; a later second's name sorts after all of them.
  CHECK(sorted == made);
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == static_cast<long>(made.size()));
  for (size_t i = 0; i < made.size(); ++i) {
    const auto events = read_events(made[i]);
    REQUIRE(events.size() == 2);
    CHECK((events[1].session_status == 1 && events[1].step == static_cast<int64_t>(i)));
  }
}

TEST_CASE("log_format=megatron: a MoE model without the balancing loss logs load_balancing_loss 0, as Megatron", "[metrics][cli]") {
  // Megatron's router records no balancing loss when its coefficient is 0 and its tracker prints
  // 0.000000E+00; the statistic we compute anyway (the expert load) stays out of that column.
  fs::remove_all(kOut + "/megatron-no-balance");
  const auto r = run_trainer("model_name=moe-tiny override_model_config=true max_target_length=16 steps=1 log_format=megatron load_balance_loss_weight=0 "
                             "per_device_batch_size=2 base_output_directory=" + kOut + " run_name=megatron-no-balance");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  const auto lines = read_lines(kOut + "/megatron-no-balance/metrics.jsonl");
  REQUIRE(lines.size() == 1);
  CHECK(json_metric(lines[0], "megatron/load_balancing_loss") == 0.0);
  CHECK(json_metric(lines[0], "moe/expert_load_max_over_mean") >= 1.0);
  CHECK_THAT(r.output, Catch::Contains(" load_balancing_loss: 0.000000E+00 |"));
}

TEST_CASE("log_format=megatron prints Megatron-LM's training_log line", "[metrics][cli]") {
  fs::remove_all(kOut + "/megatron");
  const auto r = run_trainer("model_name=test-tiny max_target_length=16 steps=4 log_period=2 log_format=megatron "
                             "per_device_batch_size=3 base_output_directory=" + kOut + " run_name=megatron");
  REQUIRE(r.exit_code == 0);
  const auto lines = read_lines(kOut + "/megatron/metrics.jsonl");
  char expected_loss[32];
  std::snprintf(expected_loss, sizeof expected_loss, "%.6E",
                (json_metric(lines[2], "megatron/lm_loss") + json_metric(lines[3], "megatron/lm_loss")) / 2);
  const std::regex pattern(R"( iteration +4/ +4 \| consumed samples: +12 \| elapsed time per iteration \(ms\): [0-9.]+ \| )"
                           R"(learning rate: [0-9.]+E[-+][0-9]+ \| global batch size: +3 \| lm loss: ([0-9.]+E[-+][0-9]+) \| )"
                           R"(loss scale: 1\.0 \| grad norm: [0-9.]+ \| num zeros: [0-9]+ \| params norm: [0-9.]+ \| )"
                           R"(number of skipped iterations: +0 \| number of nan iterations: +0 \|)");
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, pattern));
  CHECK(m[1].str() == expected_loss);  // averaged over the interval, as Megatron does
  // Megatron prints iteration 1 too (a process's first), then every log_period-th.
  CHECK_THAT(r.output, Catch::Contains(" iteration        1/       4 |") && Catch::Contains(" iteration        2/       4 |"));
  CHECK_THAT(r.output, !Catch::Contains(" iteration        3/       4 |"));
}

namespace {
// Megatron-LM's training_log, transcribed from megatron/training/training.py at commit d98e8a64
// (the format strings, in order; Python's format specs map to printf's):
//   f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
//   ' iteration {:8d}/{:8d} |'  ' consumed samples: {:12d} |'  ' elapsed time per iteration (ms): {:.1f} |'
//   f' learning rate: {learning_rate:.6E} |'  f' global batch size: {batch_size:5d} |'
//   for key in total_loss_dict: ' {}: {:.6E} |'.format(key, total / advanced_iterations)
//     keys in order: 'lm loss', then the MoE tracker's 'load_balancing_loss', 'z_loss' (each
//     aux_loss / coeff, summed over layers / num_moe_layers), then 'mtp_{i+1} loss' per depth
//   f' loss scale: {loss_scale:.1f} |'  f' grad norm: {grad_norm:.3f} |'  f' num zeros: {num_zeros_in_grad} |'
//   f' params norm: {params_norm:.3f} |'  ' number of skipped iterations: {:3d} |'  ' number of nan iterations: {:3d} |'
std::string printf_string(const char* format, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, value);
  return buf;
}
}  // namespace

TEST_CASE("Megatron line: each label and number formatted as Megatron-LM's training_log", "[metrics]") {
  const Config c = tiny_config({"model_name=moe-tiny", "mtp_num_layers=2", "router_z_loss_weight=0.001", "steps=10",
                                "log_period=2", "per_device_batch_size=3", "gradient_accumulation_steps=2"});
  auto step_values = [](double lm, double lb, double z, double mtp1, double mtp2, double seconds, double skipped) {
    return MetricValues{{"megatron/lm_loss", lm},           {"megatron/load_balancing_loss", lb},
                        {"megatron/z_loss", z},             {"megatron/mtp_1_loss", mtp1},
                        {"megatron/mtp_2_loss", mtp2},      {"learning/lm_loss", 99.0},
                        {"learning/moe_lb_loss", 98.0},     {"learning/mtp_loss_raw", 97.0},
                        {"perf/step_time_seconds", seconds}, {"optim/step_skipped", skipped},
                        {"learning/is_nan", 0.0},           {"learning/is_inf", 0.0},
                        {"learning/current_learning_rate", 1.4e-4}, {"megatron/learning_rate", 1.5e-4},
                        {"learning/raw_grad_norm", 2.71828},
                        {"learning/num_zeros", 1234.0},     {"learning/param_norm", 31.4159}};
  };
  MegatronInterval interval;
  megatron_interval_add(interval, c, step_values(2.5, 1.25, 0.5, 3.0, 4.0, 1.0, 0));
  const MetricValues last = step_values(3.5, 1.75, 1.5, 5.0, 6.0, 2.0, 0);
  megatron_interval_add(interval, c, last);
  const std::string line = megatron_log_line(c, 4, interval, last, "2026-12-01 10:20:30.123456");
  std::string expected = " [2026-12-01 10:20:30.123456]";
  expected += " iteration        5/      10 |";
  expected += " consumed samples:           30 |";  // 5 iterations x global batch 6
  expected += " elapsed time per iteration (ms): 1500.0 |";
  expected += " learning rate: 1.500000E-04 |";
  expected += " global batch size:     6 |";
  expected += " lm loss: " + printf_string("%.6E", 3.0) + " |";  // means over the interval
  expected += " load_balancing_loss: " + printf_string("%.6E", 1.5) + " |";
  expected += " z_loss: " + printf_string("%.6E", 1.0) + " |";
  expected += " mtp_1 loss: " + printf_string("%.6E", 4.0) + " |";
  expected += " mtp_2 loss: " + printf_string("%.6E", 5.0) + " |";
  expected += " loss scale: 1.0 |";
  expected += " grad norm: 2.718 |";
  expected += " num zeros: 1234 |";  // an int64 count's .item(), printed by Python as 1234
  expected += " params norm: 31.416 |";
  expected += " number of skipped iterations:   0 |";
  expected += " number of nan iterations:   0 |";
  CHECK(line == expected);

  // A skipped iteration counts in the time and the skipped count, not in the loss means; without
  // log_num_zeros_in_grad there is no num zeros label (Megatron prints it only when computed).
  const Config quiet = tiny_config({"log_num_zeros_in_grad=false", "steps=10", "log_period=2"});
  MetricValues skipped_step = step_values(100.0, 100.0, 100.0, 100.0, 100.0, 2.0, 1);
  MegatronInterval with_skip;
  megatron_interval_add(with_skip, quiet, step_values(2.5, 1.25, 0.5, 3.0, 4.0, 1.0, 0));
  megatron_interval_add(with_skip, quiet, skipped_step);
  const std::string dense = megatron_log_line(quiet, 4, with_skip, skipped_step, "t");
  CHECK_THAT(dense, Catch::Contains(" lm loss: 2.500000E+00 | loss scale: 1.0 | grad norm: 2.718 | params norm: 31.416 |"
                                    " number of skipped iterations:   1 |"));
  CHECK_THAT(dense, !Catch::Contains("num zeros") && !Catch::Contains("load_balancing_loss"));
  // A MoE model without the balancing loss (the Ling recipes' coefficient 0) still has the
  // column, as Megatron's default aux_loss tracker prints it; z_loss only with its coefficient.
  const Config no_balance = tiny_config({"model_name=moe-tiny", "override_model_config=true", "load_balance_loss_weight=0", "router_z_loss_weight=0",
                                         "steps=10", "log_period=2"});
  MegatronInterval zero_balance;
  megatron_interval_add(zero_balance, no_balance, step_values(2.5, 0.0, 0.0, 3.0, 4.0, 1.0, 0));
  CHECK_THAT(megatron_log_line(no_balance, 4, zero_balance, skipped_step, "t"),
             Catch::Contains(" lm loss: 2.500000E+00 | load_balancing_loss: 0.000000E+00 | loss scale: 1.0 |"));

  // Megatron's MoE and MTP trackers add every iteration's losses, skipped ones too, and divide by
  // the applied iterations like the lm loss, which sums the applied ones only.
  MegatronInterval moe_skip;
  megatron_interval_add(moe_skip, c, step_values(2.5, 1.25, 0.5, 3.0, 4.0, 1.0, 0));
  megatron_interval_add(moe_skip, c, skipped_step);
  CHECK_THAT(megatron_log_line(c, 4, moe_skip, skipped_step, "t"),
             Catch::Contains(" lm loss: 2.500000E+00 | load_balancing_loss: 1.012500E+02 | z_loss: 1.005000E+02 |"
                             " mtp_1 loss: 1.030000E+02 | mtp_2 loss: 1.040000E+02 |") &&
                 Catch::Contains("number of skipped iterations:   1 | number of nan iterations:   0 |"));
  // A nan iteration is a skipped one whose lm loss is NaN or Inf; an applied NaN loss is not
  // counted there, and a mean that is not >= 0 is left out of the line (Megatron's `avg >= 0.0`).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  MegatronInterval nan_skipped, nan_applied, grad_only;
  megatron_interval_add(nan_skipped, quiet, step_values(nan, 0, 0, 0, 0, 1.0, 1));
  megatron_interval_add(nan_applied, quiet, step_values(nan, 0, 0, 0, 0, 1.0, 0));
  MetricValues nan_grad = step_values(2.0, 0, 0, 0, 0, 1.0, 1);
  for (auto& [name, value] : nan_grad)
    if (name == "learning/is_nan") value = 1.0;  // a skipped step with a NaN gradient, finite loss
  megatron_interval_add(grad_only, quiet, nan_grad);
  CHECK(nan_skipped.nan == 1);
  CHECK(nan_applied.nan == 0);
  CHECK(grad_only.nan == 0);
  const std::string applied_line = megatron_log_line(quiet, 0, nan_applied, step_values(nan, 0, 0, 0, 0, 1.0, 0), "t");
  CHECK_THAT(applied_line, !Catch::Contains("lm loss") && Catch::Contains("global batch size:     8 | loss scale: 1.0 |"));
}

TEST_CASE("Megatron format: validation blocks every eval_interval and after training, that one after the final checkpoint, then the test split's", "[metrics][cli]") {
  fs::remove_all(kOut + "/megatron-eval");
  const auto r = run_trainer("model_name=test-tiny max_target_length=16 steps=4 log_period=2 log_format=megatron "
                             "eval_interval=2 eval_steps=2 per_device_batch_size=2 base_output_directory=" + kOut +
                             " run_name=megatron-eval");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::vector<std::string> evals;
  for (const auto& line : read_lines(kOut + "/megatron-eval/metrics.jsonl"))
    if (line.find("eval/lm_loss") != std::string::npos) evals.push_back(line);
  REQUIRE(evals.size() == 3);  // after iterations 2 and 4, and after training
  size_t previous = 0;
  for (size_t g = 0; g < 3; ++g) {
    CHECK(json_metric(evals[g], "eval/group") == static_cast<double>(g));
    const double ce = json_metric(evals[g], "eval/lm_loss") - json_metric(evals[g], "eval/z_loss");
    const std::string block = megatron_validation_block(g < 2 ? 2 * (g + 1) : 4, ce, g == 2 ? EvalPhase::kValidAfterTraining : EvalPhase::kInLoop);
    const size_t at = r.output.find(block);
    REQUIRE(at != std::string::npos);
    CHECK(at >= previous);
    previous = at;
  }
  // Megatron's verbose lines for the evaluations after training (validation, then test), which
  // follow the final checkpoint (a stop signal during them loses nothing).
  const std::string verbose_lines = "Evaluating on 4 samples\nEvaluating iter 1/2\nEvaluating iter 2/2\n";
  const size_t verbose = r.output.find(verbose_lines);
  REQUIRE(verbose != std::string::npos);
  const size_t test_verbose = r.output.find(verbose_lines, verbose + 1);
  REQUIRE(test_verbose != std::string::npos);
  CHECK(r.output.find("Evaluating on", test_verbose + 1) == std::string::npos);
  const size_t saved = r.output.find("checkpoints/4 in ");
  REQUIRE(saved != std::string::npos);
  CHECK(saved < verbose);
  CHECK(verbose < r.output.find("on validation set"));
  // Then the test split's evaluation (synthetic data has one; Megatron's when `split` gives it
  // sequences): Megatron's "on test set" block, its loss the test/ line of the metrics file.
  std::vector<std::string> tests;
  for (const auto& line : read_lines(kOut + "/megatron-eval/metrics.jsonl"))
    if (line.find("test/lm_loss") != std::string::npos) tests.push_back(line);
  REQUIRE(tests.size() == 1);
  CHECK(json_metric(tests[0], "step") == 3);
  CHECK(json_metric(tests[0], "test/total_weights") > 32);  // of eval_steps x batch x L = 64 targets, EOD masked
  CHECK(json_metric(tests[0], "test/total_weights") <= 2 * 2 * 16);
  const double test_ce = json_metric(tests[0], "test/lm_loss") - json_metric(tests[0], "test/z_loss");
  CHECK(test_ce != json_metric(evals[2], "eval/lm_loss") - json_metric(evals[2], "eval/z_loss"));
  const size_t test_block = r.output.find(megatron_validation_block(4, test_ce, EvalPhase::kTestAfterTraining));
  REQUIRE(test_block != std::string::npos);
  CHECK(test_block > test_verbose);
  CHECK(test_verbose > r.output.find("on validation set"));
}

TEST_CASE("a finished run launched again evaluates its final state as Megatron, and skip_train evaluates without training", "[metrics][cli][checkpoint]") {
  // Megatron runs its evaluations after training after an empty training loop too: a relaunch of
  // a finished run, or --skip-train. The final checkpoint precedes the evaluation after training,
  // so a relaunch reads the same validation batches with the same weights: the same losses.
  const std::string dir = kOut + "/evaluate-again";
  fs::remove_all(dir);
  const std::string common = "model_name=test-tiny max_target_length=16 per_device_batch_size=2 eval_steps=1 "
                             "base_output_directory=" + kOut + " run_name=evaluate-again ";
  const auto values = [&](const std::string& name) {
    std::vector<double> found;
    for (const auto& line : read_lines(dir + "/metrics.jsonl"))
      if (line.find("\"" + name + "\"") != std::string::npos) found.push_back(json_metric(line, name));
    return found;
  };
  REQUIRE(run_trainer(common + "steps=4 eval_interval=2").exit_code == 0);
  REQUIRE(values("eval/lm_loss").size() == 3);  // after steps 2 and 4, and after training
  REQUIRE(values("test/lm_loss").size() == 1);
  const auto again = run_trainer(common + "steps=4 eval_interval=2 log_format=megatron");
  INFO(again.output);
  REQUIRE(again.exit_code == 0);
  CHECK_THAT(again.output, Catch::Contains("no training (steps reached): evaluating the state after step 4") &&
                               Catch::Contains("validation loss at iteration 4 on validation set") &&
                               Catch::Contains("validation loss at iteration 4 on test set"));
  auto evals = values("eval/lm_loss");
  auto tests = values("test/lm_loss");
  REQUIRE(evals.size() == 4);
  REQUIRE(tests.size() == 2);
  CHECK(evals[3] == evals[2]);
  CHECK(evals[3] != evals[1]);
  CHECK(tests[1] == tests[0]);
  // skip_train: the state of a steps the run has not reached, with no step and no checkpoint, on
  // the validation split's first batch (Megatron's --skip-train loader starts at 0).
  const auto skip = run_trainer(common + "steps=8 eval_interval=0 skip_train=true");
  INFO(skip.output);
  REQUIRE(skip.exit_code == 0);
  CHECK_THAT(skip.output, Catch::Contains("no training (skip_train): evaluating the state after step 4") &&
                              Catch::Contains("eval (after training) after step 3") &&
                              Catch::Contains("done: evaluated the state after step 4 (no training)"));
  evals = values("eval/lm_loss");
  REQUIRE(evals.size() == 5);
  CHECK(evals[4] != evals[2]);
  CHECK(values("eval/group").back() == 0);
  CHECK(values("eval/consumed_samples").back() == 2);
  CHECK(values("eval/consumed_samples")[2] == 6);  // the first run's after training: batch 2
  tests = values("test/lm_loss");
  REQUIRE(tests.size() == 3);
  CHECK(tests[2] == tests[0]);
  CHECK(values("learning/loss").size() == 4);
  CHECK(checkpoint_list_steps(dir + "/checkpoints") == std::vector<int64_t>{4});
  CHECK_THAT(read_file(dir + "/config.yml"), Catch::Contains("skip_train: false"));  // the config that trained

  // A run whose metrics go past its newest checkpoint: an evaluation alone drops none of them (a
  // resume would, as it runs those steps again).
  const std::string keep = kOut + "/evaluate-keep";
  fs::remove_all(keep);
  const std::string keep_args = "model_name=test-tiny max_target_length=16 checkpoint_period=4 save_checkpoint_on_completion=false "
                                "base_output_directory=" + kOut + " run_name=evaluate-keep ";
  REQUIRE(run_trainer(keep_args + "steps=6").exit_code == 0);
  const auto before = read_lines(keep + "/metrics.jsonl");
  REQUIRE(before.size() == 6);
  const auto keep_skip = run_trainer(keep_args + "steps=6 skip_train=true eval_steps=1");
  INFO(keep_skip.output);
  REQUIRE(keep_skip.exit_code == 0);
  CHECK_THAT(keep_skip.output, Catch::Contains("evaluating the state after step 4"));
  const auto after = read_lines(keep + "/metrics.jsonl");
  REQUIRE(after.size() == 8);  // and the validation and test lines
  CHECK(std::equal(before.begin(), before.end(), after.begin()));
  CHECK(json_metric(after[6], "step") == 3);
}

TEST_CASE("a resume evaluates from its checkpoint's validation position (Megatron's consumed_valid_samples), whatever eval_interval is now", "[metrics][cli][checkpoint]") {
  // learning_rate=0 keeps the weights at their initial values, so an evaluation's loss names the
  // validation batch it read. Reference: eval_interval=2 over 8 steps reads batches 0, 1, 2, 3 after
  // steps 2, 4, 6, 8 and batch 4 after training. The other run: 4 steps at eval_interval=2 (batches
  // 0 and 1 before checkpoint 4), resumed to 8 steps at eval_interval=4: Megatron continues at
  // batch 2 after step 8 and batch 3 after training (recomputing the position from the step and
  // the new interval gave batch 1 again).
  const std::string common = "model_name=test-tiny max_target_length=16 per_device_batch_size=2 learning_rate=0 "
                             "eval_steps=1 base_output_directory=" + kOut;
  const auto eval_lines = [](const std::string& run) {
    std::vector<std::string> evals;
    for (const auto& line : read_lines(kOut + "/" + run + "/metrics.jsonl"))
      if (line.find("eval/lm_loss") != std::string::npos) evals.push_back(line);
    return evals;
  };
  fs::remove_all(kOut + "/valpos-ref");
  fs::remove_all(kOut + "/valpos");
  const auto ref = run_trainer(common + " run_name=valpos-ref steps=8 eval_interval=2");
  INFO(ref.output);
  REQUIRE(ref.exit_code == 0);
  const auto first = run_trainer(common + " run_name=valpos steps=4 eval_interval=2");
  INFO(first.output);
  REQUIRE(first.exit_code == 0);
  CHECK_THAT(read_file(kOut + "/valpos/checkpoints/4/state.json"), Catch::Contains("\"consumed_valid_samples\": 4"));
  const auto resumed = run_trainer(common + " run_name=valpos steps=8 eval_interval=4");
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  const auto a = eval_lines("valpos-ref"), b = eval_lines("valpos");
  REQUIRE(a.size() == 5);
  REQUIRE(b.size() == 5);  // 2 + after training, then 1 + after training
  for (size_t i = 0; i < 5; ++i) CHECK(json_metric(a[i], "eval/group") == static_cast<double>(i));
  CHECK(json_metric(a[1], "eval/lm_loss") != json_metric(a[2], "eval/lm_loss"));  // the batches tell apart
  CHECK(json_metric(b[0], "eval/lm_loss") == json_metric(a[0], "eval/lm_loss"));
  CHECK(json_metric(b[1], "eval/lm_loss") == json_metric(a[1], "eval/lm_loss"));
  CHECK(json_metric(b[3], "step") == 7);
  CHECK(json_metric(b[3], "eval/group") == 2);
  CHECK(json_metric(b[3], "eval/consumed_samples") == 6);
  CHECK(json_metric(b[3], "eval/lm_loss") == json_metric(a[2], "eval/lm_loss"));
  CHECK(json_metric(b[4], "eval/lm_loss") == json_metric(a[3], "eval/lm_loss"));
  CHECK_THAT(read_file(kOut + "/valpos/checkpoints/8/state.json"), Catch::Contains("\"consumed_valid_samples\": 6"));
  // The test split's evaluation reads its first batch after either run: the same loss.
  const auto test_loss = [](const std::string& run) {
    for (const auto& line : read_lines(kOut + "/" + run + "/metrics.jsonl"))
      if (line.find("test/lm_loss") != std::string::npos) return json_metric(line, "test/lm_loss");
    return -1.0;
  };
  CHECK(test_loss("valpos") > 0);
  CHECK(test_loss("valpos") == test_loss("valpos-ref"));
}

TEST_CASE("Megatron validation block: Megatron-LM's evaluate_and_print_results, rules and all", "[metrics]") {
  // Transcribed from megatron/training/training.py at d98e8a64:
  //   string = f' validation loss at {prefix} | '; string += '{} value: {:.6E} | '.format(key, loss)
  //   ppl = math.exp(min(20, loss)); string += '{} PPL: {:.6E} | '.format(key, ppl)
  //   print('-' * (len(string) + 1)); print(string); print('-' * (len(string) + 1))
  // with prefix 'iteration N' in the loop and 'iteration N on validation set' after training.
  const std::string in_loop = " validation loss at iteration 20 | lm loss value: 4.400000E+00 | lm loss PPL: 8.145087E+01 | ";
  CHECK(megatron_validation_block(20, 4.4, EvalPhase::kInLoop) ==
        std::string(in_loop.size() + 1, '-') + "\n" + in_loop + "\n" + std::string(in_loop.size() + 1, '-') + "\n");
  const std::string after = " validation loss at iteration 7 on validation set | lm loss value: 2.500000E+01 | "
                            "lm loss PPL: 4.851652E+08 | ";  // exp(min(20, 25))
  CHECK(megatron_validation_block(7, 25.0, EvalPhase::kValidAfterTraining) ==
        std::string(after.size() + 1, '-') + "\n" + after + "\n" + std::string(after.size() + 1, '-') + "\n");
}

TEST_CASE("Megatron line: each interval starts after the previous line, however long log_period is", "[metrics][cli]") {
  // Step 1 is made non-finite and skipped. The line of iteration 1 (a process's first, which
  // Megatron prints without starting a new interval) covers step 0; the line of iteration 3 covers
  // steps 0..2, the skipped one counted; nothing is printed for iteration 4 (not a multiple of
  // log_period: Megatron prints no extra line at the end). It used to look back log_period steps
  // through the history, counting step 1 twice, and a log_period past the 128 kept steps saw only
  // those.
  const auto run = [](const std::string& name, const std::string& more) {
    fs::remove_all(kOut + "/" + name);
    const auto r = run_trainer("model_name=test-tiny max_target_length=16 per_device_batch_size=1 log_format=megatron "
                               "skip_step_on_spikes=true abort_on_nan_loss=false debug_inject_nonfinite_step=1 " + more +
                               " base_output_directory=" + kOut + " run_name=" + name);
    REQUIRE(r.exit_code == 0);
    return std::make_pair(r.output, read_lines(kOut + "/" + name + "/metrics.jsonl"));
  };
  const auto loss_text = [](double loss) { return printf_string("lm loss: %.6E |", loss); };
  {
    const auto [output, lines] = run("megatron-interval", "steps=4 log_period=3");
    REQUIRE(lines.size() == 4);
    CHECK(json_metric(lines[1], "optim/step_skipped") == 1.0);
    const auto first = output.find(" iteration        1/       4 |"), third = output.find(" iteration        3/       4 |");
    REQUIRE(first != std::string::npos);
    REQUIRE(third != std::string::npos);
    CHECK(output.find(" iteration        4/       4 |") == std::string::npos);
    const std::string line1 = output.substr(first, output.find('\n', first) - first);
    const std::string line3 = output.substr(third, output.find('\n', third) - third);
    CHECK_THAT(line1, Catch::Contains(loss_text(json_metric(lines[0], "megatron/lm_loss"))) &&
                          Catch::Contains("number of skipped iterations:   0 | number of nan iterations:   0 |"));
    CHECK_THAT(line3, Catch::Contains(loss_text((json_metric(lines[0], "megatron/lm_loss") +
                                                 json_metric(lines[2], "megatron/lm_loss")) / 2)) &&
                          Catch::Contains("number of skipped iterations:   1 | number of nan iterations:   1 |"));
    // The learning rate is the one Megatron holds after its scheduler's step: the next update's.
    // Cosine over 4 updates from 3e-3 to 3e-4, no warmup (floor(0.1 x 4) = 0); step 1 was skipped,
    // so after steps 0..3 the updates applied are 1, 1, 2, 3.
    const auto cosine = [](double s) { return 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + std::cos(M_PI * s / 4)); };
    const double applied[4] = {1, 1, 2, 3};
    for (size_t i = 0; i < 4; ++i) CHECK(json_metric(lines[i], "megatron/learning_rate") == Approx(cosine(applied[i])).epsilon(1e-12));
    CHECK(json_metric(lines[3], "learning/current_learning_rate") == Approx(cosine(2)).epsilon(1e-12));
    CHECK_THAT(line1, Catch::Contains(printf_string("learning rate: %.6E |", cosine(1))));
    CHECK_THAT(line3, Catch::Contains(printf_string("learning rate: %.6E |", cosine(2))));
  }
  {
    const auto [output, lines] = run("megatron-long", "steps=140 log_period=140");
    REQUIRE(lines.size() == 140);
    double sum = 0;
    for (const auto& line : lines)
      if (json_metric(line, "optim/step_skipped") == 0) sum += json_metric(line, "megatron/lm_loss");
    CHECK_THAT(output, Catch::Contains(" iteration      140/     140 |") && Catch::Contains(loss_text(sum / 139)) &&
                           Catch::Contains("number of skipped iterations:   1 | number of nan iterations:   1 |"));
  }
}

TEST_CASE("Megatron-logged values: LB and router z-loss divided by their weights, MTP per depth", "[metrics]") {
  // K = 2 in Megatron mode: moe_lb_loss (the term of J) is the plain micro-batch mean of
  // lb_weight * LB + z_weight * Z, so it must equal lb_weight * load_balancing_loss + z_weight *
  // z_loss as logged for Megatron; mtp_loss_raw is the mean of the depth losses.
  Trainer t(tiny_config({"model_name=moe-tiny", "mtp_num_layers=2", "router_z_loss_weight=0.01",
                         "override_model_config=true", "load_balance_loss_weight=0.02", "calculate_per_token_loss=false",
                         "gradient_accumulation_steps=2", "per_device_batch_size=2", "synthetic_min_valid_fraction=0.3"}));
  const auto values = t.read_metrics(t.forward_backward(0));
  const double lb = metric_get(values, "megatron/load_balancing_loss"), z = metric_get(values, "megatron/z_loss");
  const double mtp1 = metric_get(values, "megatron/mtp_1_loss"), mtp2 = metric_get(values, "megatron/mtp_2_loss");
  CHECK(lb > 0.5);  // E * sum f P is ~1 near balance, far above its weighted 0.02x
  // 1e-6: the terms of J are formed in fp32 per micro-batch (a weight times a loss, rounded to
  // ~6e-8 relative) before the fp64 accumulation; the values logged for Megatron are not weighted.
  CHECK(0.02 * lb + 0.01 * z == Approx(metric_get(values, "learning/moe_lb_loss")).epsilon(1e-6));
  CHECK(0.01 * z == Approx(metric_get(values, "moe/router_z_loss")).epsilon(1e-6));
  CHECK((mtp1 + mtp2) / 2 == Approx(metric_get(values, "learning/mtp_loss_raw")).epsilon(1e-6));
  CHECK(mtp1 != mtp2);
  CHECK(mtp1 > 1.0);  // a cross-entropy over 256 classes, unscaled (mtp_loss_scaling_factor is 0.1)
}

TEST_CASE("MFU only against a known peak, peak RSS and ETA are reported", "[metrics][cli]") {
  fs::remove_all(kOut + "/mfu");
  fs::remove_all(kOut + "/nomfu");
  const std::string base = "model_name=test-tiny max_target_length=16 steps=2 base_output_directory=" + kOut;
  const auto unknown = run_trainer(base + " run_name=nomfu");
  CHECK_THAT(unknown.output, Catch::Contains("perf/mfu is not reported") && Catch::Contains(", ETA 00:00:0"));
  CHECK_THROWS(json_metric(read_lines(kOut + "/nomfu/metrics.jsonl")[1], "perf/mfu"));
  REQUIRE(run_trainer(base + " run_name=mfu peak_tflops_per_device=0.5").exit_code == 0);
  const auto line = read_lines(kOut + "/mfu/metrics.jsonl")[1];
  CHECK(json_metric(line, "perf/mfu") == Approx(json_metric(line, "perf/per_device_tflops_per_sec") / 0.5));
  CHECK(json_metric(line, "memory/peak_rss_bytes") > 10e6);
}

TEST_CASE("known GPU peaks are looked up by name, unknown devices get none", "[metrics]") {
  CHECK(device_known_peak_tflops("NVIDIA H200", "bfloat16") == Approx(989.4));
  CHECK(device_known_peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == Approx(989.4));
  CHECK(device_known_peak_tflops("NVIDIA H100 PCIe", "bfloat16") == Approx(756.5));
  CHECK(device_known_peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == Approx(19.5));
  CHECK(device_known_peak_tflops("cpu", "bfloat16") == 0.0);
  CHECK(device_known_peak_tflops("NVIDIA GeForce RTX 4090", "bfloat16") == 0.0);  // unknown: no guess
}

TEST_CASE("host reads and allocations per step are counted where they happen", "[metrics][cli]") {
  const std::string base = "model_name=test-tiny max_target_length=16 steps=3 gradient_accumulation_steps=4 "
                           "base_output_directory=" + kOut;
  auto rows_of = [&](const std::string& run, const std::string& extra) {
    fs::remove_all(kOut + "/" + run);
    const auto r = run_trainer(base + " run_name=" + run + " " + extra);
    REQUIRE(r.exit_code == 0);
    const auto lines = read_lines(kOut + "/" + run + "/metrics.jsonl");
    REQUIRE(lines.size() == 3);  // the loops below check every step, and there are steps
    return std::make_pair(lines, r.output);
  };
  // Dense, one process, no spike guard: the step reads nothing back (the metrics are read once,
  // deferred, outside the step) and allocates no gradient-sized buffer.
  const auto [dense, dense_log] = rows_of("counts-dense", "skip_step_on_spikes=false");
  for (const auto& line : dense) {
    CHECK(json_metric(line, "perf/host_reads_in_step") == 0);
    CHECK(json_metric(line, "perf/grad_sized_allocations_in_step") == 0);
    CHECK(json_metric(line, "perf/host_allocations_in_step") > 0);  // activations: the counter is live
  }
  CHECK(json_metric(dense[0], "perf/launch_to_first_step_seconds") > 0);
  CHECK_THROWS(json_metric(dense[1], "perf/launch_to_first_step_seconds"));  // first step only
  CHECK_THAT(dense_log, Catch::Contains("startup: libraries") && Catch::Contains("s from launch"));
  {
    // The peaks the startup line reports: the process's own, so at least LibTorch's footprint,
    // never falling, and the first step's that step's metric (read moments apart; rounded to MiB).
    double before = 0, after = 0;
    const auto at = dense_log.find("; peak RSS ");
    REQUIRE(at != std::string::npos);
    REQUIRE(std::sscanf(dense_log.c_str() + at, "; peak RSS %lf MiB by the end of resume, %lf MiB by the end of first step",
                        &before, &after) == 2);
    CHECK(before > 20);
    CHECK(after >= before);
    CHECK(after == Approx(json_metric(dense[0], "memory/peak_rss_bytes") / (1 << 20)).epsilon(0.1));
  }
  // The spike guard reads loss and grad norm once per step.
  const auto [guarded, guarded_log] = rows_of("counts-guard", "skip_step_on_spikes=true");
  for (const auto& line : guarded) CHECK(json_metric(line, "perf/host_reads_in_step") == 1);
  // MoE: one read of the group sizes per MoE layer per micro-batch (moe-tiny: 1 dense layer, then
  // 2 MoE layers; K = 4).
  const auto [moe, moe_log] = rows_of("counts-moe", "model_name=moe-tiny skip_step_on_spikes=false");
  for (const auto& line : moe) CHECK(json_metric(line, "perf/host_reads_in_step") == 8);
}

TEST_CASE("a gradient-sized temporary would be counted", "[metrics]") {
  Trainer t(tiny_config());
  const auto before = host_allocations();
  REQUIRE(before.available);
  const auto copy = t.flat_grads().clone();
  const auto after = host_allocations();
  CHECK(after.watched - before.watched == 1);
  CHECK(after.allocations - before.allocations >= 1);
}

namespace {

// The VmFlags line of the mapping of this process that holds `address` (/proc/self/smaps).
std::string mapping_flags(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(address);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    // A mapping's first line: "begin-end perms offset dev inode path" (hex addresses, no colon
    // before the first space); its detail lines are "Key: value".
    unsigned long begin = 0, end = 0;
    const auto space = line.find(' ');
    if (space != std::string::npos && line.find(':') > space && std::sscanf(line.c_str(), "%lx-%lx", &begin, &end) == 2)
      inside = begin <= at && at < end;
    if (inside && line.rfind("VmFlags:", 0) == 0) return line;
  }
  return "";
}

// Whether this kernel accepts MADV_HUGEPAGE (asked directly: a chroot may lack /sys while the
// kernel has transparent huge pages).
bool kernel_accepts_huge_page_advice() {
  constexpr size_t bytes = 4 << 20;
  void* probe = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(probe != MAP_FAILED);
  const bool accepted = ::madvise(probe, bytes, MADV_HUGEPAGE) == 0;
  ::munmap(probe, bytes);
  return accepted;
}

}  // namespace

TEST_CASE("host_huge_pages advises fresh CPU blocks of 32 MiB and more, and only those", "[metrics]") {
  // The flag "hg" (MADV_HUGEPAGE) on the block's mapping, whatever the kernel's THP mode; blocks
  // below 32 MiB come from the heap, where they are reused, and are left alone.
  host_memory_keep_freed();
  host_memory_huge_pages();
  const auto large = torch::empty({(40 << 20) / 4});  // 40 MiB: its own mapping
  const auto small = torch::empty({(4 << 20) / 4});   // 4 MiB: heap
  // The middle of each block: its first partial page is not advised (the range starts at its first
  // 4 KiB boundary), which splits the mapping there.
  const auto middle = [](const torch::Tensor& t) { return static_cast<const char*>(t.data_ptr()) + t.nbytes() / 2; };
  const std::string large_flags = mapping_flags(middle(large)), small_flags = mapping_flags(middle(small));
  INFO(large_flags << " | " << small_flags);
  REQUIRE_FALSE(large_flags.empty());
  REQUIRE_FALSE(small_flags.empty());
  if (!kernel_accepts_huge_page_advice()) {
    WARN("this kernel has no transparent huge pages: madvise(MADV_HUGEPAGE) fails and nothing is advised");
    CHECK(large_flags.find(" hg") == std::string::npos);
  } else {
    CHECK(large_flags.find(" hg") != std::string::npos);
  }
  CHECK(small_flags.find(" hg") == std::string::npos);
  large.fill_(1.0f);  // usable
  CHECK(large.sum().item<double>() == (40 << 20) / 4);
}
