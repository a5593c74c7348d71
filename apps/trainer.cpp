// trainer: parse the config, build the Trainer, train, exit with the documented code.
#include <execinfo.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "trainer/config/config.h"
#include "trainer/data/data.h"
#include "trainer/data/gpt_dataset.h"
#include "trainer/metrics/perf_counters.h"
#include "trainer/model/model_size.h"
#include "trainer/dist/dist.h"
#include "trainer/train/memory_plan.h"
#include "trainer/train/run_dir.h"
#include "trainer/train/train.h"
#include "trainer/util/error.h"

namespace {

// Host memory the Megatron index arrays take at least (CPU: beside the plan): the sample and
// shuffle indices, 16 + 8 B per sample; the data decide the rest. Both splits' are held, the
// validation split's with evaluation on. Synthetic data has none.
struct DryRunIndex {
  double train_samples = 0, valid_samples = 0, bytes = 0;
};
DryRunIndex dry_run_index(const trainer::Config& c) {
  if (c.dataset_type == "synthetic") return {};  // .bin/.idx: dataset_type megatron, or grain with mmap_npy
  if (c.dataset_type == "megatron") trainer::megatron_dataset_path_check(c);
  DryRunIndex index;
  index.train_samples = static_cast<double>(c.steps) * static_cast<double>(c.global_batch_size);
  // The validation split's, and the test split's eval_steps global batches where `split` gives
  // it a weight (boundaries over 2^40 sequences: nonzero weights leave the test range nonempty).
  const auto bounds = trainer::gpt_split_boundaries(c.split, int64_t{1} << 40);
  const int64_t test_samples = bounds[3] > bounds[2] ? c.eval_steps * c.global_batch_size : 0;
  index.valid_samples =
      c.eval_interval > 0 ? static_cast<double>(trainer::config_eval_samples(c, c.steps) + test_samples) : 0.0;
  index.bytes = 24.0 * (index.train_samples + index.valid_samples);
  return index;
}

// Whether this machine holds the plan and the index arrays beside what the process already uses
// (CPU), judged alike on every rank.
struct DryRunFit {
  trainer::HostMemory host;
  double needed = 0;
  bool fits() const { return needed <= host.available_bytes; }
};
DryRunFit dry_run_fit(const trainer::MemoryPlan& plan, double index_bytes, const trainer::DistEnv& env) {
  DryRunFit fit;
  fit.host = trainer::host_memory_available(env.local_world_size);
  fit.needed = plan.total_bytes - fit.host.resident_bytes + index_bytes;
  return fit;
}

void print_dry_run(const trainer::Config& c, const trainer::DistEnv& env) {
  const auto s = trainer::model_size(c);
  std::printf("model_name: %s\n", c.model_name.c_str());
  // Published counts leave MTP out (Ling-mini-2.0: 16,255,638,528 total, 1,432,968,192 active).
  auto count = [](const char* what, int64_t all, int64_t mtp) {
    if (mtp > 0)
      std::printf("%s: %lld (without MTP: %lld; MTP adds %lld)\n", what, static_cast<long long>(all),
                  static_cast<long long>(all - mtp), static_cast<long long>(mtp));
    else
      std::printf("%s: %lld\n", what, static_cast<long long>(all));
  };
  count("parameters", s.total_params, s.mtp_params);
  count("active parameters per token", s.active_params, s.mtp_active_params);
  std::printf("  embedding and output head: %lld\n", static_cast<long long>(s.embedding_params));
  std::printf("  active non-embedding%s: %lld\n", s.mtp_params > 0 ? " without MTP" : "",
              static_cast<long long>(s.active_params - s.mtp_active_params - s.embedding_params));
  if (c.num_experts <= 1 && c.attention_type == "global" && c.inhomogeneous_layer_cycle_interval == 0)
    std::printf("  per decoder layer: %lld x %lld layers\n", static_cast<long long>(s.per_layer_params),
                static_cast<long long>(c.base_num_decoder_layers));
  if (c.attention_type != "global" || c.inhomogeneous_layer_cycle_interval > 0) {
    std::map<std::string, int64_t> kinds;  // decoder layers by attention
    for (int64_t i = 0; i < c.base_num_decoder_layers; ++i) ++kinds[trainer::model_layer_attention(c, i)];
    std::string text;
    for (const auto& [kind, n] : kinds) text += (text.empty() ? "" : ", ") + std::to_string(n) + " " + kind;
    if (c.mtp_num_layers > 0) text += "; MTP layers: " + trainer::model_layer_attention(c, c.base_num_decoder_layers);
    std::printf("  attention by decoder layer: %s (formulas: docs/model.md)\n", text.c_str());
  }
  std::printf("training FLOPs per step per device: %.6e (%.3f TFLOP)\n", s.flops_per_step_per_device,
              s.flops_per_step_per_device / 1e12);
  std::printf("  learnable weights: %.6e, attention (QK^T and AV, causal at half; GLA: its chunked core): %.6e\n", s.learnable_weight_flops,
              s.attention_flops);
  std::printf("global batch: %lld sequences x %lld tokens\n", static_cast<long long>(c.global_batch_size),
              static_cast<long long>(c.max_target_length));
  // The plan for this launch's layout (world size from the launcher's variables, if any).
  const bool cuda = c.hardware == "gpu";
  const auto context = trainer::memory_plan_context(c, env.world_size, env.local_world_size, cuda);
  const trainer::MemoryPlan plan = trainer::memory_plan(c, context);
  std::printf("memory plan per rank (%s, %s, %lld rank%s%s):\n%s", cuda ? "GPU" : "CPU", c.dtype.c_str(),
              static_cast<long long>(env.world_size), env.world_size > 1 ? "s" : "",
              context.assumed_build.empty() ? "" : ("; " + context.assumed_build).c_str(),
              trainer::memory_plan_format(plan).c_str());
  const DryRunIndex index = dry_run_index(c);
  const double index_bytes = index.bytes;
  if (index_bytes > 0) {
    const std::string valid_text =
        index.valid_samples > 0 ? " and " + std::to_string(static_cast<int64_t>(index.valid_samples)) + " validation and test" : "";
    std::printf("data index arrays (host memory, every rank): at least %s for %.0f training%s samples (24 B each; "
                "with the document index, checked against host memory when training starts)\n",
                trainer::memory_bytes_text(index_bytes).c_str(), index.train_samples, valid_text.c_str());
  }
  if (cuda) {
    std::printf("this machine: checked against the GPU's free memory when training starts\n");
    return;
  }
  const DryRunFit fit = dry_run_fit(plan, index_bytes, env);
  std::printf("this machine: %s available per rank (%s): %s%s\n", trainer::memory_bytes_text(fit.host.available_bytes).c_str(),
              fit.host.source.c_str(), fit.fits() ? "fits" : "does NOT fit",
              index_bytes > 0 ? " (the plan and the data index arrays)" : "");
  if (fit.fits()) return;
  // What training would suggest when it refuses, here before it is started.
  const auto suggestions =
      trainer::memory_plan_suggestions(c, context, fit.host.available_bytes - index_bytes, fit.host.resident_bytes);
  for (size_t i = 0; i < suggestions.size(); ++i)
    std::printf("%s%s\n", i == 0 ? "would fit: " : "       or: ", suggestions[i].c_str());
}

// The other ranks of a launch print nothing on stdout, but each checks its own machine (another
// node may have less memory than rank 0's) and says so on stderr, naming itself, when it does not fit.
void dry_run_check_other_rank(const trainer::Config& c, const trainer::DistEnv& env) {
  if (c.hardware == "gpu") return;
  const trainer::MemoryPlan plan =
      trainer::memory_plan(c, trainer::memory_plan_context(c, env.world_size, env.local_world_size, false));
  const double index_bytes = dry_run_index(c).bytes;
  const DryRunFit fit = dry_run_fit(plan, index_bytes, env);
  if (fit.fits()) return;
  char name[256] = "?";
  gethostname(name, sizeof name - 1);
  spdlog::warn("--dry-run: rank {} (host {}): this machine does NOT fit: {} available per rank ({}), {} {}",
               env.rank, name, trainer::memory_bytes_text(fit.host.available_bytes), fit.host.source,
               index_bytes > 0 ? "the plan and the data index arrays need" : "the plan needs",
               trainer::memory_bytes_text(fit.needed));
}

// "1,5,9" -> {1, 5, 9}; exit 2 naming the entry that is not a token id of this vocabulary.
std::vector<int64_t> parse_token_list(const std::string& text, int64_t vocab_size) {
  std::vector<int64_t> tokens;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || item.empty() || !std::isdigit(static_cast<unsigned char>(item[0])) || id < 0 || id >= vocab_size)
      throw trainer::config_error("--dump-logits-tokens: '" + item + "' is not a token id in [0, " +
                                  std::to_string(vocab_size) + ")");
    tokens.push_back(id);
  }
  if (!text.empty() && text.back() == ',')  // getline yields no empty last item: "1," read as "1"
    throw trainer::config_error("--dump-logits-tokens: '" + text + "' ends with a comma; give token ids like 1,5,9");
  if (tokens.empty()) throw trainer::config_error("--dump-logits needs --dump-logits-tokens, e.g. 1,5,9");
  return tokens;
}

// A crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) prints the signal and the native stack to
// stderr, then dies of the same signal, so the exit status still says what happened (139 for
// SIGSEGV). Addresses inside trainer resolve with `addr2line -f -C -e build/trainer 0x...`.
extern "C" void on_fatal_signal(int signo) {
  const char* name = signo == SIGSEGV ? "SIGSEGV" : signo == SIGBUS ? "SIGBUS" : signo == SIGFPE ? "SIGFPE"
                   : signo == SIGILL  ? "SIGILL"  : "SIGABRT";
  const char* parts[] = {"trainer: fatal signal ", name, ", native stack:\n"};
  for (const char* part : parts) (void)!write(STDERR_FILENO, part, std::strlen(part));
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  std::raise(signo);  // SA_RESETHAND restored the default action: this ends the process
}

void install_fatal_signal_handlers() {
  void* warm_up[1];
  backtrace(warm_up, 1);  // loads libgcc's unwinder now: not inside the handler, where malloc may be broken
  struct sigaction action {};
  action.sa_handler = on_fatal_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND;
  for (int signo : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigaction(signo, &action, nullptr);
  // A write to a socket whose peer has died raises SIGPIPE, whose default action ends the process
  // without a word. Ignored, the write fails with EPIPE instead: Gloo turns that into an error and
  // the rank exits 5 naming the collective, as when its read fails first (which of the two a rank
  // sees depends on timing). A closed stdout (`trainer ... | head`) then fails writes, not the run.
  std::signal(SIGPIPE, SIG_IGN);
}

// What the command line asks for besides training (the config and its overrides aside).
struct CommandLine {
  std::string config_path;
  std::vector<std::string> overrides;
  bool print_config = false, dry_run = false, dump_gradients = false;
  int64_t dump_samples = 0;
  std::string export_path, export_hf_dir, export_hf_dtype = "float32", dump_logits_path, dump_logits_tokens;
  int64_t export_hf_max_shard_mb = 5000;
  bool exports() const { return !export_path.empty() || !export_hf_dir.empty() || !dump_logits_path.empty(); }
};

void command_line_declare(CLI::App& app, CommandLine& cl) {
  app.add_option("config", cl.config_path, "base config file, e.g. configs/base.yml")->required();
  app.add_option("overrides", cl.overrides, "key=value overrides (YAML scalars)");
  app.add_flag("--print-config", cl.print_config, "print the resolved config and exit");
  app.add_flag("--dry-run", cl.dry_run, "validate, print parameter count, FLOPs per step and the memory plan, exit");
  app.add_option("--dump-samples", cl.dump_samples,
                 "write the first N training samples in global order as JSON lines {\"index\", \"tokens\", \"loss_mask\"} and exit")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {  // CLI11 read a number past 2^63 - 1 as 2^63 - 1
            int64_t count = 0;
            const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), count);
            return error == std::errc() && end == text.data() + text.size() ? "" : text + " is not a number of samples in [1, 2^63)";
          },
          "", "whole number"))
      ->check(CLI::Range(int64_t{1}, std::numeric_limits<int64_t>::max()));
  app.add_option("--export-safetensors", cl.export_path,
                 "write the model weights (newest checkpoint of run_dir, or load_*_path) to PATH (a new file) and exit");
  app.add_option("--export-hf", cl.export_hf_dir,
                 "write those weights as a Hugging Face model directory DIR (config.json, safetensors) and exit");
  app.add_option("--export-hf-dtype", cl.export_hf_dtype, "dtype of the exported tensors")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_option("--export-hf-max-shard-mb", cl.export_hf_max_shard_mb, "largest safetensors file of --export-hf (MiB)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));  // shifted to bytes below: no overflow
  app.add_option("--dump-logits", cl.dump_logits_path,
                 "write the model's fp32 logits for --dump-logits-tokens to PATH (safetensors) and exit");
  app.add_option("--dump-logits-tokens", cl.dump_logits_tokens, "token ids for --dump-logits, e.g. 1,5,9");
  app.add_flag("--dump-gradients", cl.dump_gradients,
               "with --dump-logits: also write \"loss\" (next-token cross-entropy of those tokens, main head) and "
               "\"grad.<name>\", its gradient for every weight (one process)");
}

// Flags that would otherwise fall through to a training run, be dropped, or fail after the model
// is loaded: two modes at once (--dry-run used to exit before --export-hf ran), an empty value (an
// unset shell variable), a flag without the one it belongs to, an export target that exists or
// lies inside the other export. Exit 2 naming the flag.
void command_line_check(const CLI::App& app, const CommandLine& cl) {
  std::vector<std::string> modes;
  for (const char* flag : {"--print-config", "--dry-run", "--dump-samples"})
    if (app.count(flag) > 0) modes.push_back(flag);
  if (cl.exports()) modes.push_back("--export-safetensors/--export-hf/--dump-logits");
  if (modes.size() > 1)
    throw trainer::config_error(modes[0] + " and " + modes[1] + " cannot be combined: each ends the run; give one");
  for (const char* flag : {"--export-hf", "--export-safetensors", "--dump-logits", "--dump-logits-tokens"})
    if (app.count(flag) > 0 && app.get_option(flag)->as<std::string>().empty())
      throw trainer::config_error(std::string(flag) + " was given an empty value");
  if (app.count("--dump-logits-tokens") > 0 && cl.dump_logits_path.empty())
    throw trainer::config_error("--dump-logits-tokens needs --dump-logits PATH");
  if (cl.dump_gradients && cl.dump_logits_path.empty()) throw trainer::config_error("--dump-gradients needs --dump-logits PATH");
  if ((app.count("--export-hf-dtype") > 0 || app.count("--export-hf-max-shard-mb") > 0) && cl.export_hf_dir.empty())
    throw trainer::config_error("--export-hf-dtype and --export-hf-max-shard-mb need --export-hf DIR");
  std::error_code ec;
  // A file output named as a directory ("out/", ".") failed at the write, after the model was built.
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--export-safetensors", cl.export_path},
                                   {"--dump-logits", cl.dump_logits_path}}) {
    const std::string name = std::filesystem::path(path).filename().string();
    if (!path.empty() && (name.empty() || name == "." || name == ".."))
      throw trainer::config_error(std::string(flag) + " " + path + " names a directory; give the file's name");
  }
  // An output under a file ("model.bin/out") would fail only at the write, after the model is built.
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--export-hf", cl.export_hf_dir},
                                   {"--export-safetensors", cl.export_path},
                                   {"--dump-logits", cl.dump_logits_path}}) {
    if (path.empty()) continue;
    for (auto above = std::filesystem::absolute(path).parent_path();; above = above.parent_path()) {
      if (std::filesystem::exists(above, ec)) {
        if (!std::filesystem::is_directory(above, ec))
          throw trainer::config_error(std::string(flag) + " " + path + ": " + above.string() + " is a file, not a directory");
        break;
      }
      if (above == above.parent_path()) break;
    }
  }
  // No output replaces a file (--dump-logits over a checkpoint's model.safetensors destroyed it).
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--export-safetensors", cl.export_path},
                                   {"--dump-logits", cl.dump_logits_path}})
    if (!path.empty() && std::filesystem::exists(path, ec))
      throw trainer::config_error(std::string(flag) + " " + path +
                                  ": the path exists; remove it or choose another (an export never replaces a file)");
  // Two outputs under one name: the second would replace the first (or fail after the first is written).
  {
    const std::vector<std::pair<const char*, const std::string*>> outputs = {
        {"--export-hf", &cl.export_hf_dir}, {"--export-safetensors", &cl.export_path}, {"--dump-logits", &cl.dump_logits_path}};
    for (size_t i = 0; i < outputs.size(); ++i)
      for (size_t j = i + 1; j < outputs.size(); ++j)
        if (!outputs[i].second->empty() && !outputs[j].second->empty() &&
            std::filesystem::weakly_canonical(std::filesystem::absolute(*outputs[i].second), ec) ==
                std::filesystem::weakly_canonical(std::filesystem::absolute(*outputs[j].second), ec))
          throw trainer::config_error(std::string(outputs[i].first) + " and " + outputs[j].first + " name the same path " +
                                      *outputs[j].second + "; give each its own");
  }
  if (!cl.export_hf_dir.empty() && std::filesystem::exists(cl.export_hf_dir, ec) &&
      !(std::filesystem::is_directory(cl.export_hf_dir, ec) && std::filesystem::is_empty(cl.export_hf_dir, ec)))
    throw trainer::config_error("--export-hf " + cl.export_hf_dir +
                                ": the path exists and is not an empty directory; remove it or choose another");
  if (!cl.export_path.empty() && !cl.export_hf_dir.empty()) {
    const auto file = std::filesystem::weakly_canonical(std::filesystem::absolute(cl.export_path), ec);
    const auto dir = std::filesystem::weakly_canonical(std::filesystem::absolute(cl.export_hf_dir), ec);
    const std::string inside = file.lexically_relative(dir).string();
    if (!inside.empty() && inside != "." && inside.rfind("..", 0) != 0)
      throw trainer::config_error("--export-safetensors " + cl.export_path + " lies inside --export-hf " + cl.export_hf_dir +
                                  ", whose files it could replace; write it elsewhere");
  }
}

// What a mode printed reached stdout, or the reader went away (`| head`: EPIPE, exit 0 as
// documented); anything else (a full disk) is exit 1, not a truncated file and success.
void stdout_check_written(const char* mode) {
  errno = 0;
  if ((std::fflush(stdout) == 0 && !std::ferror(stdout)) || errno == EPIPE) return;
  throw trainer::Error(trainer::kExitFailure, std::string(mode) + ": cannot write to stdout: " +
                                                  (errno != 0 ? std::strerror(errno) : "write error"));
}

// Every rank checks it (and exits alike); rank 0 alone prints.
void check_samples_count(const trainer::Config& config, int64_t count) {
  const int64_t samples = config.steps * config.global_batch_size;  // what the run's data index holds
  if (count > samples)
    throw trainer::config_error("--dump-samples " + std::to_string(count) + ": the run reads " + std::to_string(samples) +
                                " samples (steps " + std::to_string(config.steps) + " x global_batch_size " +
                                std::to_string(config.global_batch_size) + "); raise steps to see more");
}

void print_samples(const trainer::Config& config, int64_t count) {
  const trainer::DataLoader loader(config, /*rank=*/0);
  for (int64_t i = 0; i < count; ++i) {
    const auto b = loader.data_loader_sample(i);
    // L + 1 tokens as the model reads them (Megatron's sample, a pad id as 0), then the L masks.
    std::string line = "{\"index\": " + std::to_string(i) + ", \"tokens\": [";
    for (int64_t t = 0; t < b.seq_len; ++t) line += std::to_string(b.inputs[t]) + ", ";
    line += std::to_string(b.targets[b.seq_len - 1]) + "], \"loss_mask\": [";
    for (int64_t t = 0; t < b.seq_len; ++t) line += (t > 0 ? ", " : "") + std::to_string(b.loss_mask[t] != 0 ? 1 : 0);
    line += "]}\n";
    errno = 0;
    if (std::fputs(line.c_str(), stdout) < 0) {
      if (errno == EPIPE) {  // the reader has what it wanted: exit 0 (stdout_check_written would see the error flag)
        std::clearerr(stdout);
        return;
      }
      stdout_check_written("--dump-samples");
    }
  }
}

// --dump-logits, --export-hf, --export-safetensors: from the newest checkpoint or load_*_path.
void run_exports(trainer::Trainer& trainer, const trainer::Config& config, const CommandLine& cl,
                 const std::vector<int64_t>& logits_tokens) {
  const int64_t step = trainer.load_initial_state(trainer::Trainer::StartingFor::kExport);
  // An export of a run that has no checkpoint and loads nothing would write the random initialization.
  // --dump-logits too: it wrote the random initialization's logits for a mistyped run_name.
  if (!trainer.restored_checkpoint() && config.load_parameters_path.empty())
    throw trainer::config_error("nothing to export: " + config.run_dir + " has no checkpoint, and neither "
                                "load_parameters_path nor load_full_state_path is set (check run_name)");
  if (!cl.dump_logits_path.empty()) {
    const auto logits = trainer.logits_for(logits_tokens, cl.dump_gradients);
    if (trainer.communicator().rank() == 0) trainer::checkpoint_write_tensors(cl.dump_logits_path, logits);
    spdlog::info("wrote the logits of {} tokens at step {} to {}", logits_tokens.size(), step, cl.dump_logits_path);
  }
  if (!cl.export_hf_dir.empty()) {
    trainer.export_hf(cl.export_hf_dir, cl.export_hf_max_shard_mb << 20,
                      cl.export_hf_dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat32);
    spdlog::info("wrote the weights at step {} as a Hugging Face directory {}", step, cl.export_hf_dir);
  }
  if (!cl.export_path.empty()) {
    trainer.export_model(cl.export_path);
    spdlog::info("wrote the weights at step {} to {}", step, cl.export_path);
  }
}

}  // namespace

int main(int argc, char** argv) {
  trainer::perf_startup_mark("libraries");  // exec -> main: the dynamic loader (LibTorch)
  install_fatal_signal_handlers();  // and SIGPIPE ignored
  CLI::App app{"trainer: pretrain decoder-only language models (MaxText-style config)"};
  app.set_version_flag("--version", std::string("trainer ") + TRAINER_VERSION);
  CommandLine cl;
  command_line_declare(app, cl);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : trainer::kExitUsage;
  }

  // What the modes print goes to stdout alone (YAML, JSON lines, a table): the log goes to stderr.
  if (cl.print_config || cl.dry_run || cl.dump_samples > 0)
    spdlog::set_default_logger(spdlog::stderr_color_st("trainer"));
  try {
    // "DIR/" and "." name the directory itself (a trailing separator made the temporary copy
    // go inside it, and the export failed after the model was built).
    if (!cl.export_hf_dir.empty()) {
      std::string dir = std::filesystem::absolute(cl.export_hf_dir).lexically_normal().string();
      while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
      cl.export_hf_dir = dir;
    }
    command_line_check(app, cl);
    trainer::Config config = trainer::config_load(cl.config_path, cl.overrides);
    trainer::perf_startup_mark("config");
    // Under a launcher every rank checks and exits alike, and rank 0 alone prints (the copies of
    // all ranks interleaved in a pipe).
    const trainer::DistEnv env = trainer::dist_env_resolve();
    const bool prints = env.rank == 0;
    if (cl.print_config) {
      if (!prints) return trainer::kExitOk;
      std::fputs(trainer::config_to_yaml(config).c_str(), stdout);
      stdout_check_written("--print-config");
      return trainer::kExitOk;
    }
    if (cl.dry_run) {
      trainer::config_check_layout(config, config.data_parallel_size);  // the Trainer checks it against its group
      if (!prints) {
        dry_run_check_other_rank(config, env);
        return trainer::kExitOk;
      }
      print_dry_run(config, env);
      stdout_check_written("--dry-run");
      return trainer::kExitOk;
    }
    if (cl.dump_samples > 0) {
      check_samples_count(config, cl.dump_samples);
      if (!prints) return trainer::kExitOk;  // global samples: one copy, and one rank builds the index
      print_samples(config, cl.dump_samples);
      stdout_check_written("--dump-samples");
      return trainer::kExitOk;
    }
    // Checked before the model is built (minutes for a large one).
    const std::vector<int64_t> logits_tokens =
        cl.dump_logits_path.empty() ? std::vector<int64_t>{} : parse_token_list(cl.dump_logits_tokens, config.vocab_size);
    // A generated run name's directory, claimed here, goes again if the start fails before
    // anything is written into it (remove() leaves a directory that holds files).
    struct RemoveIfEmpty {
      std::string dir;
      ~RemoveIfEmpty() {
        std::error_code ignored;
        if (!dir.empty()) std::filesystem::remove(dir, ignored);
      }
    } claimed;
    if (!cl.exports()) {
      if (env.rank == 0 && !config.run_name_stem.empty()) {
        trainer::run_dir_claim_generated(config);
        claimed.dir = config.run_dir;
      }
      trainer::run_dir_check_writable(config.run_dir);
      trainer::stop_signals_install();
    }
    trainer::Trainer trainer(config);
    if (cl.exports())
      run_exports(trainer, config, cl, logits_tokens);
    else
      trainer.train();
    return trainer::kExitOk;
  } catch (const trainer::Error& e) {
    spdlog::error("{}", e.what());
    return e.exit_code();
  } catch (const c10::Error& e) {
    // LibTorch's message without its native stack (the stack names LibTorch internals, not the cause).
    const std::string what = e.what_without_backtrace();
    if (what.find("can't allocate memory") != std::string::npos || what.find("out of memory") != std::string::npos)
      spdlog::error("out of memory: {}\nThe memory plan (--dry-run, docs/memory.md) was checked at start unless "
                    "allow_memory_overcommit=true.", what);
    else
      spdlog::error("unexpected failure: {}", what);
    return trainer::kExitFailure;
  } catch (const std::bad_alloc&) {
    spdlog::error("out of memory (std::bad_alloc); see the memory plan: --dry-run, docs/memory.md");
    return trainer::kExitFailure;
  } catch (const std::exception& e) {
    spdlog::error("unexpected failure: {}", e.what());
    return trainer::kExitFailure;
  }
}
