// Config: layering, coercion, errors with exit code 2, derived values, parameter counts.
// LibTorch (through test_support.h) before Catch: else a failing CHECK is glog's and aborts.
#include "test_support.h"
#include "trainer/model/model_size.h"
#include "trainer/train/schedule.h"
#include "trainer/train/run_dir.h"
#include "trainer/util/error.h"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

using namespace trainer;
using namespace trainer::testing;

namespace {
// Loads base.yml with `overrides`; returns the error (exit code and message) it throws.
Error load_error(std::vector<std::string> overrides, std::vector<std::string> env = {}) {
  try {
    config_load(source_path("configs/base.yml"), overrides, env);
  } catch (const Error& e) {
    return e;
  }
  FAIL("config_load accepted an invalid config");
  return Error(kExitOk, "");
}
}  // namespace

TEST_CASE("base.yml defines every key, each with a comment, and nothing else", "[config]") {
  std::set<std::string> in_file;
  const std::regex key_line(R"(^([a-z_0-9]+):\s*(.*)$)");
  for (const auto& line : read_lines(source_path("configs/base.yml"))) {
    std::smatch m;
    if (!std::regex_match(line, m, key_line)) continue;
    in_file.insert(m[1]);
    INFO("key " << m[1]);
    CHECK(m[2].str().find('#') != std::string::npos);
  }
  const auto& names = config_key_names();
  CHECK(in_file == std::set<std::string>(names.begin(), names.end()));
}

TEST_CASE("layering: base -> model file -> CLI -> environment, and derived values", "[config]") {
  const Config c = config_load(source_path("configs/base.yml"),
                               {"model_name=test-tiny", "dataset_type=synthetic", "pad_id=0", "steps=7", "gradient_accumulation_steps=3",
                                "per_device_batch_size=2", "run_name=abc", "base_output_directory=/tmp/x"},
                               {"M_LEARNING_RATE=0.5", "M_STEPS=9", "PATH=/bin"});
  CHECK(c.base_emb_dim == 32);  // from models/test-tiny.yml, overriding base.yml's 128
  CHECK(c.steps == 9);          // environment beats CLI
  CHECK(c.learning_rate == 0.5);
  CHECK(c.learning_rate_schedule_steps == 9);  // defaults to steps
  CHECK(c.global_batch_size == 6);
  CHECK(c.run_dir == "/tmp/x/abc");
  CHECK(c.metrics_file == "/tmp/x/abc/metrics.jsonl");
  const Config d = tiny_config({"steps=-1", "learning_rate_schedule_steps=11", "run_name="});
  CHECK(d.steps == 11);
  CHECK(d.run_name.rfind("test-tiny_", 0) == 0);
}

TEST_CASE("resolved config round-trips through --print-config's YAML", "[config]") {
  const Config a = tiny_config({"learning_rate=1.25e-4", "dtype=bfloat16", "z_loss_multiplier=1e-4"});
  const std::string path = test_root() + "/roundtrip.yml";
  std::ofstream(path) << config_to_yaml(a);
  // The dumped file lives outside configs/ (no models/ beside it): model_name="" loads no model file.
  const Config b = config_load(path, {"model_name="}, {});
  CHECK(b.learning_rate == a.learning_rate);
  CHECK(b.dtype == "bfloat16");
  CHECK(b.z_loss_multiplier == a.z_loss_multiplier);
  CHECK(b.base_emb_dim == a.base_emb_dim);
  // Every key, not only those four: the two dumps agree line for line but for model_name.
  std::istringstream dump_a(config_to_yaml(a)), dump_b(config_to_yaml(b));
  size_t lines = 0, differing = 0;
  for (std::string x, y; std::getline(dump_a, x) && std::getline(dump_b, y); ++lines) {
    if (x == y) continue;
    ++differing;
    CHECK(x.rfind("model_name:", 0) == 0);
  }
  CHECK(differing == 1);
  CHECK(lines >= 100);  // every key of base.yml was compared (100 today)
}

TEST_CASE("string values with quotes, backslashes and control bytes round-trip through the YAML", "[config]") {
  // Written between quotes unescaped, `run_name=x"y` gave a line no YAML parser reads, and `b\\n`
  // loaded back as another value.
  // (A newline in a key=value override is folded to a space by YAML; a tab and \x01 stay.)
  const std::string odd = "x\"y\\z\\n\ttab\x01 \xc3\xa9";
  const Config a = tiny_config({"run_name=" + odd, "dataset_path=a\"b\\c"});
  REQUIRE(a.run_name == odd);
  const std::string yaml = config_to_yaml(a);
  CHECK_THAT(yaml, Catch::Contains("run_name: \"x\\\"y\\\\z\\\\n\\x09tab\\x01 \xc3\xa9\"\n"));
  const std::string path = test_root() + "/odd-strings.yml";
  std::ofstream(path) << yaml;
  const Config b = config_load(path, {"model_name="}, {});
  CHECK(b.run_name == odd);
  CHECK(b.dataset_path == "a\"b\\c");
  CHECK(b.run_dir == a.run_dir);
  // Every line but the derived comments is a key: the run_dir comment stays on one line.
  std::istringstream lines(yaml);
  for (std::string line; std::getline(lines, line);) CHECK((line.empty() || line[0] == '#' || line.find(": ") != std::string::npos));
}

TEST_CASE("config errors name the key and exit with code 2", "[config]") {
  SECTION("unknown key suggests the nearest known key") {
    const Error e = load_error({"stepz=3"});
    CHECK(e.exit_code() == kExitUsage);
    CHECK_THAT(e.what(), Catch::Contains("'stepz'") && Catch::Contains("did you mean 'steps'"));
    // A MaxText key with no counterpart of its name says what covers it (was "did you mean 'rope_type'?").
    CHECK_THAT(load_error({"weight_dtype=bfloat16"}).what(),
               Catch::Contains("unknown config key 'weight_dtype' (from command line): weights, gradients and AdamW "
                               "state are always float32 here; 'dtype' sets the compute dtype"));
    CHECK_THAT(load_error({"global_batch_size=64"}).what(), Catch::Contains("it is derived: per_device_batch_size x"));
    CHECK_THAT(load_error({"adam_eps_root=1e-8"}).what(), Catch::Contains("'adam_eps' is added outside the square root"));
    CHECK_THAT(load_error({"ici_expert_parallelism=2"}).what(), Catch::Contains("use 'expert_parallelism'"));
  }
  SECTION("unknown environment key") {
    const Error e = load_error({}, {"M_LERNING_RATE=1"});
    CHECK_THAT(e.what(), Catch::Contains("M_LERNING_RATE") && Catch::Contains("learning_rate"));
  }
  SECTION("lossy integer") {
    const Error e = load_error({"steps=1.5"});
    CHECK(e.exit_code() == kExitUsage);
    CHECK_THAT(e.what(), Catch::Contains("'steps'") && Catch::Contains("'1.5'") && Catch::Contains("integer"));
    // Decided on the digits, not on a rounded double (strtod reads 2.0000000000000001 as 2).
    for (const std::string bad : {"steps=0x10", "steps=1e-1", "steps=inf", "steps=1.0.0", "steps=2.0000000000000001",
                                  "steps=.", "steps=e5", "steps=1e", "steps=_1", "steps=1_", "steps=1._0", "steps=1e1.5"})
      CHECK_THAT(load_error({bad}).what(), Catch::Contains("expected an integer") && !Catch::Contains("from -9223"));
    for (const std::string big : {"steps=10000000000000000000", "steps=1e19", "steps=1e400", "steps=-9223372036854775809"})
      CHECK_THAT(load_error({big}).what(), Catch::Contains("expected an integer from -9223372036854775808 to 9223372036854775807"));
  }
  SECTION("a YAML null is named as null (was value ''), and an empty text where a key takes text") {
    CHECK_THAT(load_error({"rope_factor=null"}).what(),
               Catch::Contains("config key 'rope_factor': value null (from command line) is not allowed: expected a number"));
    CHECK_THAT(load_error({"rope_type=~"}).what(), Catch::Contains("config key 'rope_type': value null (from command line)"));
    CHECK_THAT(load_error({"steps="}).what(), Catch::Contains("config key 'steps': value null"));
    CHECK_THAT(load_error({"dtype=''"}).what(), Catch::Contains("config key 'dtype': value '' (from command line)"));
    CHECK(tiny_config({"load_parameters_path=null"}).load_parameters_path.empty());
  }
  SECTION("lossless integer: whole numbers in any decimal spelling (MaxText writes 12.0 and 150_001)") {
    const Config c = tiny_config({"per_device_batch_size=2.0", "steps=1e2", "gradient_accumulation_steps=+3.",
                                  "eval_steps=20E-1", "checkpoint_period=1_000", "eval_interval=0.5e1"});
    CHECK(c.per_device_batch_size == 2);
    CHECK(c.steps == 100);
    CHECK(c.gradient_accumulation_steps == 3);
    CHECK(c.eval_steps == 2);
    CHECK(c.checkpoint_period == 1000);
    CHECK(c.eval_interval == 5);
    CHECK(tiny_config({"init_weights_seed=9007199254740993.0"}).init_weights_seed == 9007199254740993);  // 2^53 + 1, exact
  }
  SECTION("metrics_file among the run's own files (config.yml was moved aside as an earlier run's metrics)") {
    const std::string run_dir = test_root() + "/own-files/r";
    for (const std::string& own : {run_dir + "/config.yml", run_dir + "/checkpoints/m.jsonl", run_dir + "/./tensorboard/",
                                   run_dir + "/../r/.lock"}) {
      INFO(own);
      const Error e = load_error({"base_output_directory=" + test_root() + "/own-files", "run_name=r", "metrics_file=" + own});
      CHECK(e.exit_code() == kExitUsage);
      CHECK_THAT(e.what(), Catch::Contains("metrics_file " + own + " is ") && Catch::Contains("the run's own") &&
                               Catch::Contains("name another file"));
    }
    CHECK_NOTHROW(config_load(source_path("configs/base.yml"),
                              {"base_output_directory=" + test_root() + "/own-files", "run_name=r",
                               "metrics_file=" + run_dir + "/config.yml.jsonl"},
                              {}));
  }
  SECTION("run_name outside one directory below base_output_directory (.. wrote into the shared folder)") {
    for (const std::string name : {"..", ".", "a/b", "/tmp/elsewhere", "../sibling"}) {
      INFO(name);
      const Error e = load_error({"base_output_directory=" + test_root() + "/names", "run_name=" + name});
      CHECK(e.exit_code() == kExitUsage);
      CHECK_THAT(e.what(), Catch::Contains("'run_name'") && Catch::Contains("one directory below base_output_directory"));
    }
    CHECK(tiny_config({"run_name=..a.b"}).run_name == "..a.b");
  }
  SECTION("metrics_file naming a directory (DIR/ was created, then failed to open as the file)") {
    for (const std::string& dir : {test_root() + "/metrics-dir/", test_root() + "/metrics-dir/.", std::string("..")}) {
      INFO(dir);
      CHECK_THAT(load_error({"metrics_file=" + dir}).what(), Catch::Contains("metrics_file " + dir + " names a directory, not a file"));
    }
    CHECK_FALSE(std::filesystem::exists(test_root() + "/metrics-dir"));
  }
  SECTION("an eod_id below -1 (it was taken as none, silently; pad_id=-2 was refused)") {
    const Error e = load_error({"eod_id=-2"});
    CHECK(e.exit_code() == kExitUsage);
    CHECK_THAT(e.what(), Catch::Contains("eod_id (-2) must be >= 0, or -1 for none"));
  }
  SECTION("an empty run_name names a new directory, also for a second run within the same second") {
    const std::string base = test_root() + "/stamped";
    const Config first = config_load(source_path("configs/base.yml"), {"run_name=", "base_output_directory=" + base}, {});
    CHECK(first.run_name.rfind(first.model_name + "_", 0) == 0);
    std::filesystem::create_directories(first.run_dir);
    const Config second = config_load(source_path("configs/base.yml"), {"run_name=", "base_output_directory=" + base}, {});
    CHECK(second.run_dir != first.run_dir);
    CHECK_FALSE(std::filesystem::exists(second.run_dir));
    // Two runs resolved at the same moment pick the same name; the directory decides. The one
    // that finds it taken (here: created after its config was resolved) takes the next suffix,
    // with its default metrics_file (both used to go on, and the second failed on the run lock).
    Config racing = second;  // resolved alongside it
    std::filesystem::create_directories(second.run_dir);  // the other run's claim
    run_dir_claim_generated(racing);
    const std::string& stem = second.run_name_stem;
    const int taken = second.run_name == stem ? 0 : std::stoi(second.run_name.substr(stem.size() + 1));
    const std::string expected = stem + "_" + std::to_string(taken + 1);
    CHECK(racing.run_name == expected);
    CHECK(racing.run_dir == base + "/" + expected);
    CHECK(racing.metrics_file == racing.run_dir + "/metrics.jsonl");
    CHECK(std::filesystem::is_directory(racing.run_dir));
    // A name the user gave is never changed (its directory being there means: resume).
    Config named = config_load(source_path("configs/base.yml"), {"run_name=mine", "base_output_directory=" + base}, {});
    std::filesystem::create_directories(named.run_dir);
    run_dir_claim_generated(named);
    CHECK(named.run_name == "mine");
  }
  SECTION("document flags on synthetic data (they were accepted and changed nothing)") {
    for (const std::string key : {"eod_mask_loss", "reset_position_ids", "reset_attention_mask"}) {
      INFO(key);
      const Error e = load_error({"dataset_type=synthetic", "pad_id=0", key + "=true"});
      CHECK(e.exit_code() == kExitUsage);
      CHECK_THAT(e.what(), Catch::Contains(key + "=true needs documents that end in eod_id (dataset_type=megatron)"));
    }
    CHECK_NOTHROW(config_load(source_path("configs/base.yml"), {"dataset_type=megatron", "reset_attention_mask=true"}, {}));
  }
  SECTION("a renormalized single sigmoid score (every weight routed_scaling_factor; Megatron and Ling do not renormalize it)") {
    const Error e = load_error({"model_name=ling-mini-tiny", "pad_id=0", "eod_id=-1", "num_experts_per_tok=1",
                                "n_routing_groups=-1", "topk_routing_group=-1", "override_model_config=true"});
    CHECK(e.exit_code() == kExitUsage);
    CHECK_THAT(e.what(), Catch::Contains("norm_topk_prob=true with routed_score_func=sigmoid and num_experts_per_tok=1") &&
                             Catch::Contains("set norm_topk_prob=false"));
    CHECK_NOTHROW(config_load(source_path("configs/base.yml"), {"model_name=ling-mini-tiny", "pad_id=0", "eod_id=-1",
                                                                "num_experts_per_tok=1", "n_routing_groups=-1", "topk_routing_group=-1",
                                                                "override_model_config=true", "norm_topk_prob=false"}, {}));
    // Softmax renormalized over one expert is 1 in Megatron too (softmax of the top-k logits).
    CHECK_NOTHROW(config_load(source_path("configs/base.yml"), {"model_name=moe-tiny", "pad_id=0", "eod_id=-1",
                                                                "num_experts_per_tok=1", "norm_topk_prob=true",
                                                                "override_model_config=true"}, {}));
  }
  SECTION("a real value past float32's range (routed_scaling_factor=1e40 ended step 0 as a numerical abort)") {
    const Error e = load_error({"model_name=moe-tiny", "routed_scaling_factor=1e40"});
    CHECK(e.exit_code() == kExitUsage);
    CHECK_THAT(e.what(), Catch::Contains("'routed_scaling_factor'") && Catch::Contains("'1e40'") &&
                             Catch::Contains("float32 can hold"));
    CHECK_THAT(load_error({"learning_rate=-4e38"}).what(), Catch::Contains("float32 can hold"));
    // Below float32's smallest a nonzero value would be 0 there (adam_eps > 0 held in double).
    CHECK_THAT(load_error({"adam_eps=1e-50"}).what(), Catch::Contains("'adam_eps'") && Catch::Contains("float32 can hold"));
    CHECK_THAT(load_error({"adam_eps=1e-320"}).what(), Catch::Contains("float32 can hold"));  // was "a finite number"
    // strtod reads hexadecimal: learning_rate=0x10 was 16, 0x1p-8 2^-8.
    for (const std::string hex : {"learning_rate=0x10", "learning_rate=0x1p-8", "learning_rate=0X1"})
      CHECK_THAT(load_error({hex}).what(), Catch::Contains("'learning_rate'") && Catch::Contains("a finite decimal number"));
    CHECK_THAT(load_error({"collective_timeout_seconds=1e10"}).what(), Catch::Contains("collective_timeout_seconds must be in [0.001, 1e9]"));
    // Below a millisecond it was a 0 ms timeout: the rendezvous failed at once, exit 5.
    CHECK_THAT(load_error({"collective_timeout_seconds=0.0001"}).what(),
               Catch::Contains("collective_timeout_seconds must be in [0.001, 1e9] (whole milliseconds; 1e9 s is 31 years; got 0.0001)"));
    CHECK_NOTHROW(config_load(source_path("configs/base.yml"), {"pad_id=0", "collective_timeout_seconds=0.001"}, {}));
    // The debug_* step and rank keys take -1 for never: -5 was accepted and meant never too.
    for (const std::string key : {"debug_inject_nonfinite_step", "debug_block_checkpoint_shard_rank", "debug_pause_checkpoint_save_step",
                                  "debug_kill_rank_before_parameter_gather", "debug_kill_rank_in_expert_dispatch"}) {
      CHECK_THAT(load_error({key + "=-5"}).what(), Catch::Contains(key + " must be >= -1 (-1 = never; got -5)"));
      CHECK_NOTHROW(config_load(source_path("configs/base.yml"), {"pad_id=0", key + "=-1"}, {}));
    }
    // Its size in elements overflowed: an internal error at level optim, a 1-element bucket (a
    // step of minutes) at optim_grads.
    CHECK_THAT(load_error({"gradient_bucket_size_mb=9223372036854775807"}).what(),
               Catch::Contains("gradient_bucket_size_mb must be in [1, 1048576]"));
    CHECK_NOTHROW(config_load(source_path("configs/base.yml"), {"pad_id=0", "gradient_bucket_size_mb=1048576"}, {}));
    CHECK_NOTHROW(config_load(source_path("configs/base.yml"), {"model_name=moe-tiny", "pad_id=0", "eod_id=-1", "routed_scaling_factor=3e38"}, {}));
  }
  SECTION("sample and token counts past int64 (steps x global batch wrapped negative)") {
    const Error e = load_error({"steps=1000000000000000000", "per_device_batch_size=16"});
    CHECK(e.exit_code() == kExitUsage);
    CHECK_THAT(e.what(), Catch::Contains("steps=1000000000000000000 x global_batch_size (per_device_batch_size=16") &&
                             Catch::Contains("does not fit in 64 bits"));
    // 1e17 steps x 1 sample x (128 + 1) tokens: the sample count fits, the tokens do not.
    CHECK_THAT(load_error({"steps=100000000000000000", "per_device_batch_size=1"}).what(), Catch::Contains("does not fit in 64 bits"));
    CHECK_THAT(load_error({"steps=1000", "eval_interval=1", "eval_steps=1000000000000000", "per_device_batch_size=1"}).what(),
               Catch::Contains("evaluation tokens do not fit in 64 bits"));
  }
  SECTION("a top-k on a dense model (it was ignored)") {
    const Error e = load_error({"model_name=test-tiny", "num_experts_per_tok=4"});
    CHECK(e.exit_code() == kExitUsage);
    CHECK_THAT(e.what(), Catch::Contains("num_experts_per_tok=4 on a dense model (num_experts=1)"));
  }
  SECTION("value outside the allowed set lists the allowed values") {
    const Error e = load_error({"dtype=float33"});
    CHECK_THAT(e.what(), Catch::Contains("'dtype'") && Catch::Contains("float33") &&
                             Catch::Contains("float32, bfloat16"));
  }
  SECTION("bad bool") {
    CHECK_THAT(load_error({"use_qk_norm=maybe"}).what(), Catch::Contains("use_qk_norm"));
  }
  SECTION("model-file key overridden without override_model_config") {
    const Error e = load_error({"model_name=test-tiny", "base_emb_dim=64"});
    CHECK(e.exit_code() == kExitUsage);
    CHECK_THAT(e.what(), Catch::Contains("base_emb_dim") && Catch::Contains("override_model_config"));
    // The same value is not a conflict, and the flag allows a different one.
    CHECK(tiny_config({"base_emb_dim=32"}).base_emb_dim == 32);
    CHECK(tiny_config({"base_emb_dim=64", "override_model_config=true"}).base_emb_dim == 64);
  }
  SECTION("cross-field error names every field involved") {
    const Error e = load_error({"model_name=test-tiny", "override_model_config=true", "base_num_kv_heads=3"});
    CHECK(e.exit_code() == kExitUsage);
    CHECK_THAT(e.what(), Catch::Contains("base_num_kv_heads") && Catch::Contains("base_num_query_heads"));
  }
  SECTION("sharding levels: the old boolean is read as optim; contradictions and ZeRO-3 without full remat are refused") {
    CHECK(tiny_config({"shard_optimizer_over_data=true"}).data_parallel_sharding == "optim");
    CHECK(tiny_config({"data_parallel_sharding=optim"}).shard_optimizer_over_data);
    CHECK_FALSE(tiny_config({}).shard_optimizer_over_data);
    CHECK(tiny_config({"data_parallel_sharding=no_shard"}).data_parallel_sharding == "none");  // Megatron's spelling
    CHECK(tiny_config({"data_parallel_sharding=no_shard", "shard_optimizer_over_data=true"}).data_parallel_sharding == "optim");
    const Error both = load_error({"shard_optimizer_over_data=true", "data_parallel_sharding=optim_grads_params"});
    CHECK(both.exit_code() == kExitUsage);
    CHECK_THAT(both.what(), Catch::Contains("shard_optimizer_over_data") && Catch::Contains("data_parallel_sharding"));
    CHECK(tiny_config({"data_parallel_sharding=optim_grads"}).data_parallel_sharding == "optim_grads");
    CHECK(tiny_config({"data_parallel_sharding=optim_grads", "remat_policy=minimal"}).remat_policy == "minimal");
    CHECK(tiny_config({"data_parallel_sharding=optim_grads_params", "remat_policy=full"}).data_parallel_sharding ==
          "optim_grads_params");
    for (const std::string remat : {"none", "minimal"}) {
      const Error e = load_error({"data_parallel_sharding=optim_grads_params", "remat_policy=" + remat});
      CHECK(e.exit_code() == kExitUsage);
      CHECK_THAT(e.what(), Catch::Contains("data_parallel_sharding=optim_grads_params needs remat_policy=full") &&
                               Catch::Contains("remat_policy=" + remat));
    }
    CHECK_THAT(load_error({"remat_policy=some"}).what(), Catch::Contains("remat_policy") && Catch::Contains("none, full, minimal"));
  }
  SECTION("unknown model") {
    CHECK_THAT(load_error({"model_name=llama9"}).what(), Catch::Contains("llama9") && Catch::Contains("qwen3-0.6b"));
  }
  SECTION("range rules found by a bad-input sweep: each names its key and its bound") {
    CHECK(tiny_config({"data_shuffle_seed=4294967295"}).data_shuffle_seed == 4294967295LL);  // numpy's largest
    for (const std::string seed : {"4294967296", "5000000000", "-1"})
      CHECK_THAT(load_error({"data_shuffle_seed=" + seed}).what(),
                 Catch::Contains("data_shuffle_seed (" + seed + ") must be in [0, 2^32)"));
    CHECK_THAT(load_error({"adam_eps=0"}).what(), Catch::Contains("adam_eps must be > 0"));
    CHECK(tiny_config({"num_threads=1024"}).num_threads == 1024);
    CHECK_THAT(load_error({"num_threads=100000"}).what(), Catch::Contains("num_threads must be in [0, 1024]"));
    CHECK_THAT(load_error({"mtp_num_layers=16", "max_target_length=16"}).what(),
               Catch::Contains("mtp_num_layers (16) must be in [0, max_target_length (16))"));
    CHECK_THAT(load_error({"model_name=ling2-tiny", "override_model_config=true", "inhomogeneous_layer_cycle_interval=9",
                           "mtp_num_layers=0"}).what(),
               Catch::Contains("inhomogeneous_layer_cycle_interval (9) must be <= base_num_decoder_layers (5)"));
    // With an MTP layer it is the way to a GLA-only decoder whose MTP layer has full attention.
    CHECK(tiny_config({"model_name=ling2-tiny", "override_model_config=true", "inhomogeneous_layer_cycle_interval=9",
                       "mtp_num_layers=1"}).inhomogeneous_layer_cycle_interval == 9);
    // 2^58-wide MLP: the parameter count would wrap int64 (the dry run printed negative counts).
    CHECK_THAT(load_error({"model_name=test-tiny", "override_model_config=true", "base_mlp_dim=288230376151711744"}).what(),
               Catch::Contains("over 1e17 parameters"));
    // The largest real shapes stay far below the ceiling.
    for (const std::string model : {"llama3.1-8b", "ling-flash-2.0", "ling2"}) CHECK_NOTHROW(tiny_config({"model_name=" + model}));
    // A non-positive steps is named as such, not as "unset".
    const std::string steps = load_error({"steps=-5"}).what();
    CHECK_THAT(steps, Catch::Contains("steps must be > 0, or -1"));
    CHECK_THAT(steps, !Catch::Contains("both unset"));
  }
  SECTION("a value's canonical text: two spellings of one value are equal, others are not") {
    // A checkpoint written before reals were printed with their fewest digits holds the 17-digit
    // expansion; resuming compares values, not spellings (it warned that learning_rate changed).
    CHECK(config_value_canonical("learning_rate", "0.00029999999999999997") == "0.0003");
    CHECK(config_value_canonical("learning_rate", "3e-4") == config_value_canonical("learning_rate", "0.0003"));
    CHECK(config_value_canonical("learning_rate", "0.0003") != config_value_canonical("learning_rate", "0.0004"));
    CHECK(config_value_canonical("rope_max_timescale", "10000") == "10000.0");
    CHECK(config_value_canonical("steps", "1e3") == "1000");
    CHECK(config_value_canonical("mlp_activations", "[silu, linear]") == "[\"silu\", \"linear\"]");
    CHECK(config_value_canonical("no_such_key", "x y") == "x y");     // unknown key: the text
    CHECK(config_value_canonical("steps", "not a number") == "not a number");  // unparsable: the text
  }
  SECTION("a range error repeats the value, as the key prints it, inside the rule's note if it has one") {
    CHECK_THAT(load_error({"adam_b1=1.5"}).what(), Catch::Contains("adam_b1 must be in [0, 1) (got 1.5)"));
    CHECK_THAT(load_error({"learning_rate=-3e-4"}).what(), Catch::Contains("learning_rate must be >= 0 (got -0.0003)"));
    CHECK_THAT(load_error({"max_num_checkpoints_to_keep=-2"}).what(),
               Catch::Contains("max_num_checkpoints_to_keep must be >= 0 (0 = keep all; got -2)"));
    CHECK_THAT(load_error({"per_device_batch_size=0"}).what(), Catch::Contains("per_device_batch_size must be > 0 (got 0)"));
    CHECK_THAT(load_error({"steps=-5"}).what(), Catch::Contains("(got -5)"));
    // Every violated rule is listed, each with its own value.
    const std::string both = load_error({"adam_b2=1", "warmup_steps_fraction=2"}).what();
    CHECK_THAT(both, Catch::Contains("adam_b2 must be in [0, 1) (got 1.0)") &&
                         Catch::Contains("warmup_steps_fraction must be in [0, 1] (got 2.0)"));
  }
}

TEST_CASE("base_config chains, YAML syntax and malformed overrides are errors naming the file or argument", "[config]") {
  const std::string dir = test_root() + "/configs";
  std::filesystem::create_directories(dir);
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  const auto error_of = [&](const std::string& path, std::vector<std::string> overrides = {}) -> std::string {
    try {
      config_load(path, overrides, {});
    } catch (const Error& e) {
      CHECK(e.exit_code() == kExitUsage);
      return e.what();
    }
    FAIL("config_load accepted " << path);
    return "";
  };
  // A two-level chain: the nearer file wins over what it inherits, and both over base.yml.
  write("middle.yml", "base_config: " + source_path("configs/base.yml") + "\nsteps: 7\nlearning_rate: 0.5\n");
  const auto child = write("child.yml", "base_config: middle.yml\nsteps: 9\n");
  // model_name="": these files have no models/ folder beside them.
  const Config c = config_load(child, {"model_name=", "dataset_type=synthetic", "pad_id=0"}, {});
  CHECK(c.steps == 9);
  CHECK(c.learning_rate == 0.5);
  // A cycle ends with the depth error, naming a file of it.
  write("loop-a.yml", "base_config: loop-b.yml\n");
  const auto loop = write("loop-b.yml", "base_config: loop-a.yml\n");
  CHECK_THAT(error_of(loop), Catch::Contains("base_config chain deeper than 16 files") && Catch::Contains("loop-"));
  CHECK_THAT(error_of(write("orphan.yml", "base_config: nowhere.yml\n")),
             Catch::Contains("config file not found") && Catch::Contains("nowhere.yml"));
  // YAML syntax: the parser's message with the file's name.
  CHECK_THAT(error_of(write("broken.yml", "base_config: middle.yml\nsteps: [1, 2\n")),
             Catch::Contains("cannot parse config file") && Catch::Contains("broken.yml"));
  CHECK_THAT(error_of(write("list.yml", "- a\n- b\n")), Catch::Contains("is not a key: value map"));
  // A key twice in one file (YAML forbids it; the parser keeps both), a directory, a list as base_config.
  CHECK_THAT(error_of(write("twice.yml", "base_config: middle.yml\nsteps: 2\nsteps: 3\n")),
             Catch::Contains("twice.yml") && Catch::Contains("key 'steps' appears twice"));
  std::filesystem::create_directories(dir + "/folder.yml");
  CHECK_THAT(error_of(dir + "/folder.yml"), Catch::Contains("folder.yml is a directory"));
  CHECK_THAT(error_of(write("listbase.yml", "base_config: [a]\n")),
             Catch::Contains("listbase.yml") && Catch::Contains("base_config must be a file name"));
  // Two YAML documents: the second's keys (an unknown one here) were dropped unread.
  CHECK_THAT(error_of(write("two-docs.yml", "base_config: middle.yml\nsteps: 5\n---\nstepz: 9\n")),
             Catch::Contains("two-docs.yml holds 2 YAML documents"));
  // Run keys in a model file: override_model_config there allowed no overrides (yet config.yml
  // said true), and a model_name there was dropped.
  std::filesystem::create_directories(dir + "/models");
  write("models/runkey.yml", "override_model_config: true\nvocab_size: 100\n");
  write("models/named.yml", "model_name: other\nvocab_size: 100\n");
  for (const std::string model : {"runkey", "named"})
    CHECK_THAT(error_of(child, {"model_name=" + model, "dataset_type=synthetic", "pad_id=0"}),
               Catch::Contains("in the model file " + dir + "/models/" + model + ".yml") &&
                   Catch::Contains("belongs to the run"));
  // A trailing "---" (an empty second document) is harmless.
  CHECK(config_load(write("trailing.yml", "base_config: middle.yml\nsteps: 5\n---\n"),
                    {"model_name=", "dataset_type=synthetic", "pad_id=0"}, {}).steps == 5);
  // On the command line the last of a repeated key wins (scripts append the user's overrides).
  CHECK(config_load(child, {"model_name=", "dataset_type=synthetic", "pad_id=0", "steps=1", "steps=2"}, {}).steps == 2);
  // Command-line overrides that are not key=value, or whose value is not a YAML scalar.
  CHECK_THAT(error_of(child, {"model_name=", "steps"}), Catch::Contains("override 'steps' is not of the form key=value"));
  CHECK_THAT(error_of(child, {"model_name=", "steps=[1"}), Catch::Contains("'steps'") && Catch::Contains("not valid YAML"));
  CHECK_THAT(error_of(child, {"model_name=", "=5"}), Catch::Contains("'=5' is not of the form key=value"));
}

TEST_CASE("the resolved config is logged at start-up (log_config), the same YAML as --print-config", "[config][cli]") {
  const std::string args = "model_name=test-tiny max_target_length=16 steps=1 base_output_directory=" + test_root() +
                           "/log-config run_name=";
  const auto printed = run_trainer("--print-config " + args + "on", "M_LOG_PERIOD=3");
  REQUIRE(printed.exit_code == 0);
  REQUIRE_THAT(printed.output, Catch::Contains("log_period: 3") && Catch::Contains("log_config: true"));
  const auto on = run_trainer(args + "on", "M_LOG_PERIOD=3");
  INFO(on.output);
  REQUIRE(on.exit_code == 0);
  const std::string header = "resolved config (--print-config prints it, <run_dir>/config.yml keeps it):\n";
  const auto at = on.output.find(header);
  REQUIRE(at != std::string::npos);
  // The logged block is --print-config's output whole (the environment override included), before
  // anything else is logged, and is what config.yml keeps.
  const std::string logged = on.output.substr(at + header.size(), printed.output.size());
  CHECK(logged == printed.output);
  CHECK(on.output.rfind("] [", at) == on.output.find("] ["));  // the first log line
  std::ifstream kept(test_root() + "/log-config/on/config.yml");
  std::stringstream kept_text;
  kept_text << kept.rdbuf();
  CHECK(kept_text.str() == printed.output);
  const auto off = run_trainer(args + "off log_config=false");
  CHECK(off.exit_code == 0);
  CHECK_THAT(off.output, !Catch::Contains("resolved config") && Catch::Contains("completed step: 0"));
}

TEST_CASE("the binary exits 2 on config errors and 0 on --print-config / --dry-run", "[config][cli]") {
  auto r = run_trainer("stepz=3");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("stepz") && Catch::Contains("steps"));
  r = run_trainer("steps=1.5");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("1.5"));
  r = run_trainer("model_name=test-tiny base_mlp_dim=7");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("base_mlp_dim") && Catch::Contains("override_model_config"));
  r = run_trainer("--print-config steps=5", "M_LOG_PERIOD=3");
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.output, Catch::Contains("steps: 5") && Catch::Contains("log_period: 3"));
  r = run_trainer("--dry-run model_name=llama2-7b");
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.output, Catch::Contains("parameters: 6738415616"));
  // The rules that need the number of ranks: --dry-run approved layouts that training refuses.
  r = run_trainer("--dry-run model_name=moe-tiny expert_parallelism=2");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("expert_parallelism=2 must divide the number of ranks (1)"));
  r = run_trainer("--dry-run model_name=moe-tiny data_parallel_sharding=optim_grads data_parallel_shard_degree=2",
                  "OMPI_COMM_WORLD_SIZE=3 OMPI_COMM_WORLD_RANK=0");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("data_parallel_shard_degree=2 must divide the number of ranks (3)"));
  r = run_trainer("--dry-run model_name=moe-tiny expert_parallelism=2", "OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=0");
  CHECK(r.exit_code == 0);
  r = run_trainer("--no-such-flag");
  CHECK(r.exit_code == 2);
  // Export and dump flags that are empty (an unset shell variable), orphaned, or with nothing to
  // export: refused, where each used to fall through to a training run or export random weights.
  const std::string fresh = "model_name=test-tiny base_output_directory=" + test_root() + "/cli-flags run_name=none ";
  for (const std::string flags : std::vector<std::string>{"--export-hf ''", "--export-safetensors ''", "--dump-logits ''",
                                  "--dump-logits-tokens 1,2", "--export-hf-dtype bfloat16", "--export-hf " + test_root() + "/x"}) {
    r = run_trainer(fresh + flags);
    INFO(flags << ": " << r.output);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("empty value") || Catch::Contains("need --") || Catch::Contains("needs --") ||
                             Catch::Contains("nothing to export"));
  }
  CHECK_FALSE(std::filesystem::exists(test_root() + "/cli-flags/none/checkpoints"));
  // An export target that exists is refused before the model is built, and left as it was
  // (--export-safetensors used to replace the file).
  const std::string existing = test_root() + "/cli-flags-existing.safetensors";
  { std::ofstream(existing) << "keep me"; }
  r = run_trainer(fresh + "--export-safetensors " + existing);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--export-safetensors " + existing + ": the path exists"));
  CHECK(read_file(existing) == "keep me");
  r = run_trainer(fresh + "--export-hf " + test_root());  // a directory that is not empty
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--export-hf " + test_root() + ": the path exists and is not an empty directory"));
  // Under a file: refused before the model is built (it used to fail at the write, "cannot remove").
  for (const std::string flag : {"--export-hf", "--export-safetensors", "--dump-logits"}) {
    r = run_trainer(fresh + flag + " " + existing + "/sub/out");
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains(flag + " " + existing + "/sub/out: " + existing + " is a file, not a directory"));
  }
  r = run_trainer("--dump-samples -3");  // not a count: refused, where it used to start a training run
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--dump-samples") && Catch::Contains("not in range"));
  r = run_trainer("--dump-samples 99999999999999999999999");  // was read as 2^63 - 1, and quoted so
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--dump-samples: 99999999999999999999999 is not a number of samples in [1, 2^63)"));
  // Two modes at once: the first used to end the run and drop the other silently (exit 0, no export).
  const std::string hf_dir = test_root() + "/cli-flags-hf";
  for (const auto& [flags, named] : std::vector<std::pair<std::string, std::string>>{
           {"--dry-run --export-hf " + hf_dir, "--dry-run and --export-safetensors/--export-hf/--dump-logits"},
           {"--print-config --export-safetensors " + hf_dir + ".safetensors", "--print-config and --export-"},
           {"--print-config --dry-run", "--print-config and --dry-run"},
           {"--dump-samples 2 --dry-run", "--dry-run and --dump-samples"}}) {
    r = run_trainer(fresh + flags);
    INFO(flags << ": " << r.output);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains(named) && Catch::Contains("cannot be combined"));
  }
  CHECK_FALSE(std::filesystem::exists(hf_dir));
  // An export file inside the other export's directory would replace one of its files.
  r = run_trainer(fresh + "--export-hf " + hf_dir + " --export-safetensors " + hf_dir + "/sub/../model.safetensors");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("lies inside --export-hf " + hf_dir));
  // --dump-logits over an existing file (a checkpoint's model.safetensors was replaced by logits),
  // and two outputs under one name (the second replaced the first, or failed after it).
  r = run_trainer(fresh + "--dump-logits " + existing + " --dump-logits-tokens 1,2");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--dump-logits " + existing + ": the path exists"));
  CHECK(read_file(existing) == "keep me");
  for (const auto& [flags, named] : std::vector<std::pair<std::string, std::string>>{
           {"--export-hf " + hf_dir + " --export-safetensors " + hf_dir, "--export-hf and --export-safetensors"},
           {"--export-safetensors " + hf_dir + " --dump-logits " + hf_dir + " --dump-logits-tokens 1",
            "--export-safetensors and --dump-logits"}}) {
    r = run_trainer(fresh + flags);
    INFO(flags << ": " << r.output);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains(named + " name the same path " + hf_dir));
  }
  CHECK_FALSE(std::filesystem::exists(hf_dir));
  // Token lists: "1," and "+3" used to be read as 1 and 3.
  for (const std::string tokens : {"1,", "+3", "1,,5", "-1", "1 ,2"}) {
    r = run_trainer(fresh + "--dump-logits " + test_root() + "/logits-out --dump-logits-tokens '" + tokens + "'");
    INFO(tokens << ": " << r.output);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("--dump-logits-tokens"));
  }
  CHECK_FALSE(std::filesystem::exists(test_root() + "/logits-out"));
}

TEST_CASE("parameter counts from the config alone", "[config][model]") {
  const auto count = [](const std::string& model) {
    return model_size(config_load(source_path("configs/base.yml"), {"model_name=" + model}, {})).total_params;
  };
  CHECK(count("llama2-7b") == 6738415616LL);
  CHECK(count("qwen3-0.6b") == 596049920LL);
  CHECK(count("llama3.1-8b") == 8030261248LL);
  // Qwen3-30B-A3B: its model card says 30.5B in total and 3.3B activated.
  CHECK(count("qwen3-30b-a3b") == 30532122624LL);
  CHECK(model_size(config_load(source_path("configs/base.yml"), {"model_name=qwen3-30b-a3b"}, {})).active_params ==
        3353032704LL);
  // Ling 2.0 as published by inclusionAI (total and active, without the MTP depth), and what the
  // MoE MTP depth adds. (`ling2`, the RFC's hybrid, is counted by hand in test_hybrid_attention.cpp.)
  const auto without_mtp = [](const std::string& model) {
    return model_size(config_load(source_path("configs/base.yml"),
                                  {"model_name=" + model, "override_model_config=true", "mtp_num_layers=0",
                                   "mtp_moe_mlp=false"},
                                  {}));
  };
  CHECK(without_mtp("ling-mini-2.0").total_params == 16255638528LL);
  CHECK(without_mtp("ling-mini-2.0").active_params == 1432968192LL);
  CHECK(without_mtp("ling-flash-2.0").total_params == 102889697280LL);
  CHECK(count("ling-mini-2.0") == 16255638528LL + 827861248LL);
}

TEST_CASE("training FLOPs follow MaxText's formula", "[config][model]") {
  // Hand-computed for test-tiny: D=32, F=64, V=64, Hq=4, Hkv=2, hd=8, 2 layers, L=16, 2 x 3 sequences.
  const Config c = tiny_config({"per_device_batch_size=2", "gradient_accumulation_steps=3"});
  const double T = 2 * 3 * 16;
  const double ffn = 2 * T * 3 * 32 * 64, qkv = 2 * T * 32 * (4 + 4) * 8, proj = 2 * T * 32 * 32;
  const double emb = 2 * T * 32 * 64, attn = 4 * T * 16 * 32 / 2.0;
  const double expected = 3 * ((ffn + qkv + proj) * 2 + emb) + 3 * attn * 2;
  CHECK(model_size(c).flops_per_step_per_device == Approx(expected).epsilon(1e-12));
}

TEST_CASE("learning-rate schedules", "[config][schedule]") {
  Config c = tiny_config({"steps=100", "learning_rate=1.0", "warmup_steps_fraction=0.1",
                          "learning_rate_final_fraction=0.1"});
  CHECK(learning_rate_at(c, 0) == 0.0);
  CHECK(learning_rate_at(c, 5) == Approx(0.5));
  CHECK(learning_rate_at(c, 10) == Approx(1.0));
  CHECK(learning_rate_at(c, 55) == Approx(0.1 + 0.9 * 0.5));  // cosine midpoint
  CHECK(learning_rate_at(c, 100) == Approx(0.1));
  c.lr_schedule_type = "wsd";
  c.wsd_decay_steps_fraction = 0.2;
  CHECK(learning_rate_at(c, 50) == Approx(1.0));
  CHECK(learning_rate_at(c, 90) == Approx(0.1 + 0.9 * 0.5));  // linear decay over 80..100
  c.lr_schedule_type = "constant";  // Megatron's constant warms up first (its warmup branch comes first)
  CHECK(learning_rate_at(c, 0) == 0.0);
  CHECK(learning_rate_at(c, 5) == Approx(0.5));
  for (const int64_t s : {10, 50, 99, 100}) CHECK(learning_rate_at(c, s) == 1.0);
  c.warmup_steps_fraction = 0;
  CHECK(learning_rate_at(c, 0) == 1.0);
}
