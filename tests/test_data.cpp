// Megatron data: .bin/.idx bytes, numpy-compatible shuffles, GPTDataset samples against a numpy
// reference (tests/fixtures/make_fixtures.py), blending, masks, corrupt inputs, cache, tools.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "test_support.h"
#include "trainer/data/data.h"
#include "trainer/data/gpt_dataset.h"
#include "trainer/data/indexed_dataset.h"
#include "trainer/train/train.h"
#include "trainer/util/crc32c.h"
#include "trainer/util/error.h"

using namespace trainer;
using namespace trainer::testing;
namespace fs = std::filesystem;

namespace {

const std::string kDir = test_root() + "/data";

const nlohmann::json& reference() {
  static const nlohmann::json j = nlohmann::json::parse(read_file(source_path("tests/fixtures/numpy_reference.json")));
  return j;
}

std::vector<std::vector<int64_t>> fixture_corpus(const nlohmann::json& g) {
  std::vector<std::vector<int64_t>> docs;
  int64_t d = 0;
  for (int64_t size : g["sizes"].get<std::vector<int64_t>>()) {
    std::vector<int64_t> doc;
    for (int64_t t = 0; t < size; ++t) doc.push_back(d * 100 + t);
    docs.push_back(doc);
    ++d;
  }
  return docs;
}

// The error a callable throws (its exit code and message).
template <typename F>
Error error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  FAIL("no trainer::Error thrown");
  return Error(kExitOk, "");
}

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

template <typename T>
void append(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

}  // namespace

TEST_CASE("indexed dataset round trip: uint16 and int32, odd and even S, empty documents", "[data]") {
  fs::create_directories(kDir);
  const std::vector<std::vector<std::vector<int64_t>>> corpora = {
      {{1, 2, 3}},                                   // one document, S odd
      {{1, 2, 3}, {}, {65535, 0, 7, 9}, {4}},        // an empty document, S even
      {{5}, {6, 7}, {}},                             // S odd, empty last
  };
  for (uint8_t code : {uint8_t{8}, uint8_t{4}}) {
    for (size_t c = 0; c < corpora.size(); ++c) {
      auto docs = corpora[c];
      if (code == 4) docs.push_back({70000, -5, 2147483647});
      const std::string prefix = kDir + "/rt-" + std::to_string(code) + "-" + std::to_string(c);
      indexed_dataset_write(prefix, docs, code);
      IndexedDataset data(prefix);
      INFO("dtype " << int(code) << " corpus " << c);
      REQUIRE(data.num_sequences() == static_cast<int64_t>(docs.size()));
      CHECK(data.num_documents() == static_cast<int64_t>(docs.size()));
      CHECK(data.dtype_code() == code);
      for (size_t i = 0; i < docs.size(); ++i) {
        std::vector<int64_t> got;
        data.read(static_cast<int64_t>(i), 0, data.sequence_length(static_cast<int64_t>(i)), got);
        CHECK(got == docs[i]);
        CHECK(data.document_index(static_cast<int64_t>(i)) == static_cast<int64_t>(i));
      }
      if (!docs.back().empty()) {
        std::vector<int64_t> tail;
        data.read(static_cast<int64_t>(docs.size() - 1), 1, 1, tail);
        CHECK(tail == std::vector<int64_t>{docs.back()[1]});
      }
    }
  }
}

TEST_CASE("rewriting a dataset leaves a reader of the old files intact (the writer renames new files into place)", "[data]") {
  fs::create_directories(kDir);
  const std::string prefix = kDir + "/rewritten";
  std::vector<std::vector<int64_t>> old_docs;
  for (int d = 0; d < 64; ++d) old_docs.push_back(std::vector<int64_t>(1000, d));
  indexed_dataset_write(prefix, old_docs, 8);
  const IndexedDataset reader(prefix);  // maps the files
  indexed_dataset_write(prefix, {{7, 8}}, 8);  // a much smaller dataset under the same name
  std::vector<int64_t> tokens;
  reader.read(63, 0, 1000, tokens);  // in place, this page would be gone (SIGBUS)
  CHECK(tokens == old_docs[63]);
  CHECK(IndexedDataset(prefix).num_sequences() == 1);
  for (const auto& entry : fs::directory_iterator(kDir))
    CHECK(entry.path().filename().string().find(".partial-") == std::string::npos);
}

TEST_CASE("golden bytes written by hand from the format spec read back correctly", "[data]") {
  // S = 3 (odd: the int64 arrays start at 34 + 12 = 46, not 8-aligned), int16 tokens (code 3).
  std::string idx("MMIDIDX\0\0", 9);
  append<uint64_t>(idx, 1);
  idx.push_back(3);
  append<uint64_t>(idx, 3);
  append<uint64_t>(idx, 3);  // D = 2 documents + 1
  for (int32_t len : {2, 1, 3}) append(idx, len);
  for (int64_t ptr : {0, 4, 6}) append(idx, ptr);
  for (int64_t doc : {0, 2, 3}) append(idx, doc);
  std::string bin;
  for (int16_t t : {10, -2, 300, 7, 8, 9}) append(bin, t);
  fs::create_directories(kDir);
  write_bytes(kDir + "/golden.idx", idx);
  write_bytes(kDir + "/golden.bin", bin);
  IndexedDataset data(kDir + "/golden");
  CHECK(data.num_sequences() == 3);
  CHECK(data.num_documents() == 2);
  CHECK(data.sequence_pointer(2) == 6);
  CHECK(data.document_index(1) == 2);
  std::vector<int64_t> all;
  for (int64_t s = 0; s < 3; ++s) data.read(s, 0, data.sequence_length(s), all);
  CHECK(all == std::vector<int64_t>{10, -2, 300, 7, 8, 9});
}

TEST_CASE("corrupt .idx/.bin files fail with exit code 3 naming the problem", "[data]") {
  fs::create_directories(kDir);
  const std::string prefix = kDir + "/good";
  indexed_dataset_write(prefix, {{1, 2, 3}, {4, 5}, {6}}, 8);
  const std::string idx = read_file(prefix + ".idx"), bin = read_file(prefix + ".bin");
  auto open_with = [&](const std::string& new_idx, const std::string& new_bin) {
    write_bytes(kDir + "/bad.idx", new_idx);
    write_bytes(kDir + "/bad.bin", new_bin);
    return error_of([&] { IndexedDataset d(kDir + "/bad"); });
  };
  for (size_t cut : {size_t{0}, size_t{5}, size_t{20}, size_t{33}, size_t{40}, idx.size() - 1}) {
    const Error e = open_with(idx.substr(0, cut), bin);
    INFO("truncated at " << cut << ": " << e.what());
    CHECK(e.exit_code() == kExitData);
    CHECK_THAT(e.what(), Catch::Contains("bad.idx"));
  }
  std::string magic = idx;
  magic[0] = 'X';
  CHECK_THAT(open_with(magic, bin).what(), Catch::Contains("bad magic at offset 0"));
  std::string version = idx;
  version[9] = 2;
  CHECK_THAT(open_with(version, bin).what(), Catch::Contains("version 2 at offset 9"));
  std::string dtype = idx;
  dtype[17] = 9;
  CHECK_THAT(open_with(dtype, bin).what(), Catch::Contains("unknown dtype code 9 at offset 17"));
  CHECK_THAT(open_with(idx, bin.substr(0, bin.size() - 2)).what(), Catch::Contains("points past the end of"));
  // A dtype code that does not match the tokens (uint8 over uint16: every token read as two) or
  // a .bin with bytes no sequence holds: the tokens do not fill the .bin.
  std::string uint8 = idx;
  uint8[17] = 1;
  CHECK_THAT(open_with(uint8, bin).what(), Catch::Contains("sequences hold 6 bytes of 1-byte tokens (dtype code 1 at offset 17), "
                                                           "but " + kDir + "/bad.bin has 12"));
  const Error longer = open_with(idx, bin + std::string(4, '\0'));
  CHECK(longer.exit_code() == kExitData);
  CHECK_THAT(longer.what(), Catch::Contains("has 16: the dtype code does not match the tokens, or the two files are not one pair"));
  std::string pointer = idx;
  const int64_t far = 1000;
  std::memcpy(pointer.data() + 34 + 12 + 8, &far, 8);  // sequence 1's pointer (S = 3: pointers at 46)
  CHECK_THAT(open_with(pointer, bin).what(), Catch::Contains("sequence 1") && Catch::Contains("past the end"));
  // A negative pointer or length is named as such (it used to read "points past the end").
  std::string negative = idx;
  const int64_t minus_two = -2;
  std::memcpy(negative.data() + 34 + 12 + 8, &minus_two, 8);
  CHECK_THAT(open_with(negative, bin).what(), Catch::Contains("sequence 1 has a negative byte offset into " + kDir +
                                                              "/bad.bin (-2 at byte 54 of the .idx): the index is corrupt"));
  std::string negative_length = idx;
  const int32_t minus_one = -1;
  std::memcpy(negative_length.data() + 34 + 4 * 2, &minus_one, 4);
  CHECK_THAT(open_with(negative_length, bin).what(), Catch::Contains("sequence 2 has a negative length (-1 at byte 42 of the .idx)"));
  // Counts so large that 34 + 12*S + 8*D passes 2^64: no "overflow" for a size, the counts are named.
  std::string huge = idx;
  const uint64_t huge_count = uint64_t{1} << 62;
  std::memcpy(huge.data() + 18, &huge_count, 8);
  CHECK_THAT(open_with(huge, bin).what(), Catch::Contains("header says S = 4611686018427387904") &&
                                              Catch::Contains("the count at offset 18 is corrupt"));
  // Megatron's multimodal index: one int8 mode per sequence after the document index.
  CHECK_THAT(open_with(idx + std::string(3, '\1'), bin).what(),
             Catch::Contains("the S extra bytes look like a multimodal index's sequence modes"));
  // 2^31 sequences, sizes consistent (a sparse file of 25.8 GB that takes no disk): more than
  // Megatron's int32 sequence numbers address (it wrapped to negative ids, read out of bounds).
  {
    std::string header = idx.substr(0, 34);
    const uint64_t S = uint64_t{1} << 31, D = 2;
    std::memcpy(header.data() + 18, &S, 8);
    std::memcpy(header.data() + 26, &D, 8);
    write_bytes(kDir + "/many.idx", header);
    fs::resize_file(kDir + "/many.idx", 34 + 12 * S + 8 * D);
    write_bytes(kDir + "/many.bin", bin);
    const Error e = error_of([&] { IndexedDataset d(kDir + "/many"); });
    fs::remove(kDir + "/many.idx");
    CHECK(e.exit_code() == kExitData);
    CHECK_THAT(e.what(), Catch::Contains("S = 2147483648 sequences at offset 18, more than the 2^31 - 1"));
  }
  // A pointer inside the file but between two tokens: Megatron's writer never makes one.
  std::string odd = idx;
  const int64_t one_byte_in = 1;
  std::memcpy(odd.data() + 34 + 12 + 8, &one_byte_in, 8);
  CHECK_THAT(open_with(odd, bin).what(),
             Catch::Contains("sequence 1 starts at byte 1") && Catch::Contains("not a multiple of the 2-byte token size"));
  // Sequences that overlap (the same tokens read twice, others never) or leave a gap: the total
  // size matches, so this used to train on the wrong tokens silently.
  for (const auto& [at, what] : {std::pair<int64_t, std::string>{0, "overlap"}, {8, "gap"}}) {
    std::string moved = idx;
    std::memcpy(moved.data() + 34 + 12 + 8, &at, 8);
    const Error e = open_with(moved, bin);
    CHECK(e.exit_code() == kExitData);
    CHECK_THAT(e.what(), Catch::Contains("sequence 1 starts at byte " + std::to_string(at) + " of " + kDir +
                                         "/bad.bin, not at byte 6 where the one before it ends (" + what));
  }
  // Float token files (codes 6 and 7) would be cut to integers: refused.
  for (const auto& [code, name] : {std::pair<char, std::string>{6, "float64"}, {7, "float32"}}) {
    std::string floats = idx;
    floats[17] = code;
    const Error e = open_with(floats, bin + bin + bin + bin);
    CHECK(e.exit_code() == kExitData);
    CHECK_THAT(e.what(), Catch::Contains("(" + name + ") at offset 17") && Catch::Contains("token files hold integers"));
  }
  std::string docs = idx;
  const int64_t two = 2;
  std::memcpy(docs.data() + idx.size() - 8, &two, 8);  // document index must end at S = 3
  CHECK_THAT(open_with(docs, bin).what(), Catch::Contains("document index runs from 0 to 2 (expected 0 to S = 3)"));
  CHECK(error_of([&] { IndexedDataset d(kDir + "/missing"); }).exit_code() == kExitData);
  // A directory read "cannot map ...: No such device"; a FIFO's open waited for a writer forever.
  fs::remove_all(kDir + "/dir.idx");
  fs::create_directories(kDir + "/dir.idx");
  CHECK_THAT(error_of([&] { IndexedDataset d(kDir + "/dir"); }).what(), Catch::Contains(kDir + "/dir.idx is a directory"));
  write_bytes(kDir + "/fifo.idx", idx);
  fs::remove(kDir + "/fifo.bin");
  REQUIRE(mkfifo((kDir + "/fifo.bin").c_str(), 0600) == 0);
  const Error fifo = error_of([&] { IndexedDataset d(kDir + "/fifo"); });
  CHECK(fifo.exit_code() == kExitData);
  CHECK_THAT(fifo.what(), Catch::Contains(kDir + "/fifo.bin is not a regular file"));
}

TEST_CASE("NumpyRandomState reproduces numpy.random.RandomState(seed).shuffle", "[data]") {
  for (const auto& c : reference()["shuffles"]) {
    NumpyRandomState rng(c["seed"].get<uint32_t>());
    if (c.contains("permutation")) {
      std::vector<int32_t> a(c["n"].get<size_t>());
      std::iota(a.begin(), a.end(), 0);
      rng.shuffle(a);
      INFO("seed " << c["seed"] << " n " << c["n"]);
      CHECK(a == c["permutation"].get<std::vector<int32_t>>());
    } else {
      std::vector<int32_t> a(50);
      std::vector<int64_t> b(70);
      std::iota(a.begin(), a.end(), 0);
      std::iota(b.begin(), b.end(), 0);
      rng.shuffle(a);
      rng.shuffle(b);
      CHECK(a == c["sequence"][0].get<std::vector<int32_t>>());
      CHECK(b == c["sequence"][1].get<std::vector<int64_t>>());
    }
  }
}

TEST_CASE("split boundaries: cumulative normalized weights, each rounded half to even, as Megatron's builder", "[data]") {
  for (const auto& c : reference()["splits"]) {
    INFO(c["split"] << " over " << c["n"]);
    CHECK(gpt_split_boundaries(c["split"], c["n"]) == c["indices"].get<std::vector<int64_t>>());
  }
  // Not finite, or not a number as a whole: refused (NaN and inf used to be cast to int64).
  // Hexadecimal was read as its value, where Megatron's regex [.0-9]+ reads "0x5a" as 0 and 5.
  for (const std::string bad : {"nan,1,0", "inf,1,0", "1,1e308,1e308", "90x,10,0", "90,,10", "0x5a,10,0"}) {
    INFO(bad);
    CHECK_THROWS_WITH(gpt_split_boundaries(bad, 100), Catch::Contains("config key 'split': '" + bad + "'"));
  }
  // Exponents and signs: Megatron's regex [.0-9]+ takes "1e2,1" as 1, 2, 1 (train 25%), where strtod
  // read 100, 1 (99%); only plain decimals are read alike, the rest is refused naming the rule.
  for (const std::string other : {"1e2,1", "9E2,1,0", "1e-320,1,0", "+5,1,0", "5,-1,0"}) {
    INFO(other);
    CHECK_THROWS_WITH(gpt_split_boundaries(other, 100), Catch::Contains("write each part as plain decimal digits"));
  }
  CHECK(gpt_split_boundaries(" 0.5, 1.5 ,0", 100) == std::vector<int64_t>{0, 25, 100, 100});
  CHECK(gpt_split_boundaries("\t0.5,1.5\t,0", 100) == std::vector<int64_t>{0, 25, 100, 100});
  // Parts that sum past a double are named as such (it was "must be non-negative with a positive sum").
  const std::string huge = "17" + std::string(307, '0');  // 1.7e308, finite
  CHECK_THROWS_WITH(gpt_split_boundaries(huge + "," + huge + ",0", 100), Catch::Contains("its parts sum past the largest double"));
}

TEST_CASE("dataset_path weights that are infinite, hexadecimal or sum past a double are refused with exit 2", "[data][cli]") {
  // An infinite weight left the other datasets 0 samples; two of 1e308 made every size 0 and the
  // sample lookup read out of bounds (SIGSEGV). Refused before any file is opened. A hexadecimal
  // weight was read as its value, where Megatron's float() refuses it.
  for (const std::string& path : {"1 a inf b", "1e308 a 1e308 b", "0x1 a 1 b"}) {
    const auto r = run_trainer("dataset_type=megatron \"dataset_path=" + path + "\" model_name=test-tiny vocab_size=258 override_model_config=true max_target_length=16 steps=1");
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains("config key 'dataset_path'"));
  }
  // The blend's per-sample dataset index is int16 (as Megatron's): 32767 datasets would wrap.
  std::string blend;
  for (int i = 0; i < 32767; ++i) blend += "1 p" + std::to_string(i) + " ";
  Config c = tiny_config();
  c.dataset_path = blend;
  CHECK_THROWS_WITH(megatron_dataset_path_check(c), Catch::Contains("a blend of 32767 datasets; at most 32766"));
  c.dataset_path = blend.substr(0, blend.rfind("1 p32766"));
  CHECK_NOTHROW(megatron_dataset_path_check(c));
}

TEST_CASE("a run whose data index arrays cannot fit in host memory exits 2 at once naming them", "[data][cli]") {
  // 1e12 steps of 8 sequences: the shuffle index alone would be 8 B x (8e12 + 2) samples (the
  // epochs of 40 tokens hold 2 more than asked); it used to count epochs one by one for minutes
  // and then die allocating (the --dry-run plan does not see the data).
  fs::create_directories(kDir);
  std::vector<std::vector<int64_t>> documents(4);  // 4 x 10 = 40 tokens per epoch
  for (int64_t d = 0; d < 4; ++d)
    for (int64_t t = 0; t < 10; ++t) documents[static_cast<size_t>(d)].push_back(1 + (d * 10 + t) % 60);
  indexed_dataset_write(kDir + "/index-memory", documents, 8);
  const auto start = std::chrono::steady_clock::now();
  const auto r = run_trainer("dataset_type=megatron dataset_path=" + kDir + "/index-memory split=1,0,0 model_name=test-tiny "
                             "pad_id=-1 eod_id=-1 max_target_length=16 per_device_batch_size=8 steps=1000000000000 "
                             "base_output_directory=" + kDir + " run_name=index-memory data_cache_path=" + kDir + "/cache-index-memory");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("the train split's data index arrays need at least") &&
                           Catch::Contains("8000000000000 samples over 3200000000001 epoch(s)") &&
                           Catch::Contains("shuffle index 59604.64 GiB") && Catch::Contains("lower steps or global_batch_size"));
  CHECK(seconds < 60);  // not a bound on speed: a hang guard (the estimate is arithmetic)
}

TEST_CASE("the dry run counts the validation split's index arrays, and grain's mmap_npy data as Megatron's", "[data][cli]") {
  // Both used to say "fits" for runs that then exit 2 on the index memory check: the validation
  // split's samples were left out, and grain's line was missing. 10 steps of 8 sequences with
  // eval_interval=1: 80 training and (10 / 1 + 1) x 1e10 x 8 = 8.8e11 validation samples, and
  // the test split's 1e10 x 8 = 8e10.
  const std::string base = "model_name=test-tiny pad_id=-1 eod_id=-1 per_device_batch_size=8 steps=10 --dry-run ";
  const auto eval = run_trainer("dataset_type=megatron " + base + "eval_interval=1 eval_steps=10000000000");
  INFO(eval.output);
  CHECK(eval.exit_code == 0);
  CHECK_THAT(eval.output, Catch::Contains("data index arrays (host memory, every rank): at least 21457.67 GiB for 80 "
                                          "training and 960000000000 validation and test samples") &&
                              Catch::Contains("does NOT fit"));  // 24 B x 960000000080 = 21457.67 GiB
  const auto grain = run_trainer("dataset_type=grain grain_file_type=mmap_npy " + base);
  INFO(grain.output);
  CHECK_THAT(grain.output, Catch::Contains("at least 0.0 MiB for 80 training samples"));
  // A malformed blend: --dry-run said "fits" for what training refuses (it needs no files to see it).
  for (const std::string blend : {"1 a -1 b", "0.5 a 0.5", "nan a", "a b"}) {
    const auto refused = run_trainer("dataset_type=megatron " + base + "\"dataset_path=" + blend + "\"");
    INFO(blend << ": " << refused.output);
    CHECK(refused.exit_code == 2);
    CHECK_THAT(refused.output, Catch::Contains("config key 'dataset_path'"));
  }
}

TEST_CASE("a Megatron resume with steps that change the epochs warns that the sample order changes", "[data][cli]") {
  // 6 documents x 9 tokens = 54 tokens per epoch (6 samples); samples of 8 (+1) tokens, 2 per
  // step. steps=2: 4 samples, 1 epoch. steps=5: 10 samples, 2 epochs (the last gives 4 samples,
  // not fewer than 80% of 6: shuffled with the first). steps=6: 12 samples, the same 2 epochs:
  // the same index, the same samples. (8 samples: 2 epochs, the last separate.)
  fs::create_directories(kDir);
  std::vector<std::vector<int64_t>> documents(6);
  for (int64_t d = 0; d < 6; ++d)
    for (int64_t t = 0; t < 9; ++t) documents[static_cast<size_t>(d)].push_back(1 + (d * 9 + t) % 60);
  indexed_dataset_write(kDir + "/resume-steps", documents, 8);
  fs::remove_all(kDir + "/resume-steps-run");
  const std::string args = "dataset_type=megatron dataset_path=" + kDir + "/resume-steps split=1,0,0 model_name=test-tiny "
                           "pad_id=-1 eod_id=-1 max_target_length=8 per_device_batch_size=2 checkpoint_period=1 "
                           "async_checkpointing=false base_output_directory=" + kDir + " run_name=resume-steps-run "
                           "data_cache_path=" + kDir + "/cache-resume-steps ";
  REQUIRE(run_trainer(args + "steps=2").exit_code == 0);
  const auto same = run_trainer(args + "steps=2 log_period=5");  // nothing to do, and no warning
  CHECK(same.exit_code == 0);
  CHECK_THAT(same.output, !Catch::Contains("steps changed"));
  const auto longer = run_trainer(args + "steps=5");
  INFO(longer.output);
  CHECK(longer.exit_code == 0);
  CHECK_THAT(longer.output, Catch::Contains("steps changed from 2 to 5, and the data index built for 5 x global_batch_size") &&
                                Catch::Contains("from step 2 on the samples differ"));
  const auto same_epochs = run_trainer(args + "steps=6");
  INFO(same_epochs.output);
  CHECK(same_epochs.exit_code == 0);
  CHECK_THAT(same_epochs.output, Catch::Contains("resumed from checkpoint") && !Catch::Contains("steps changed"));
  // The estimate behind it: the epochs of each count, as the builder computes them.
  CHECK(gpt_epochs(54, 8, 4).num_epochs == 1);
  CHECK(gpt_epochs(54, 8, 10) == gpt_epochs(54, 8, 12));
  CHECK_FALSE(gpt_epochs(54, 8, 10).separate_final_epoch);
  CHECK(gpt_epochs(54, 8, 8).separate_final_epoch);
  CHECK_FALSE(gpt_epochs(54, 8, 8) == gpt_epochs(54, 8, 10));
  CHECK_FALSE(gpt_epochs(54, 8, 4) == gpt_epochs(54, 8, 10));
  // ... and the same epochs are the same samples: built for 10 and for 12, samples 0..9 agree.
  const std::vector<int32_t> sizes(6, 9), ids = {0, 1, 2, 3, 4, 5};
  const auto ten = gpt_build_indices(sizes, ids, 8, 10, 1234), twelve = gpt_build_indices(sizes, ids, 8, 12, 1234);
  for (int64_t i = 0; i < 10; ++i) {
    const auto a = gpt_sample_pieces(ten, sizes, i), b = gpt_sample_pieces(twelve, sizes, i);
    REQUIRE(a.size() == b.size());
    for (size_t p = 0; p < a.size(); ++p)
      CHECK((a[p].document == b[p].document && a[p].offset == b[p].offset && a[p].length == b[p].length));
  }
  // More tokens than an int64 counts (steps=1e18): a config error, not a wrapped epoch count.
  CHECK_THROWS_WITH(gpt_epochs(54, 8, int64_t{2} << 60), Catch::Contains("more tokens than an int64 counts"));

  // The validation split holds (steps / eval_interval + 1) x eval_steps x global batch samples.
  // 12 documents split 50/50: 54 tokens each way. With eval_steps=3 and a batch of 1, steps=2 asks
  // for 9 validation samples (2 epochs) and steps=4 for 15 (3 epochs); the training split's 2
  // and 4 samples are 1 epoch either way: only the validation warning fires.
  std::vector<std::vector<int64_t>> halves(12);
  for (int64_t d = 0; d < 12; ++d)
    for (int64_t t = 0; t < 9; ++t) halves[static_cast<size_t>(d)].push_back(1 + (d * 9 + t) % 60);
  indexed_dataset_write(kDir + "/resume-eval", halves, 8);
  fs::remove_all(kDir + "/resume-eval-run");
  const std::string eval_args = "dataset_type=megatron dataset_path=" + kDir + "/resume-eval split=50,50,0 model_name=test-tiny "
                                "pad_id=-1 eod_id=-1 max_target_length=8 per_device_batch_size=1 eval_interval=1 eval_steps=3 "
                                "checkpoint_period=1 async_checkpointing=false base_output_directory=" + kDir +
                                " run_name=resume-eval-run data_cache_path=" + kDir + "/cache-resume-eval ";
  REQUIRE(run_trainer(eval_args + "steps=2").exit_code == 0);
  const auto eval_longer = run_trainer(eval_args + "steps=4");
  INFO(eval_longer.output);
  CHECK(eval_longer.exit_code == 0);
  CHECK_THAT(eval_longer.output, Catch::Contains("steps changed from 2 to 4, and the validation index built for 15 samples") &&
                                     Catch::Contains("(9 samples)") && !Catch::Contains("the data index built for"));

  // load_full_state_path of a run with another global batch: checkpoint 1 of a batch of 3 has read
  // 3 validation samples, and the evaluations continue at the next whole batch of 2 (samples 4-5,
  // 6-7, then 8-9 after training): the index must hold 10 samples, not 3 + 3 x 2.
  fs::remove_all(kDir + "/resume-eval-gbs3");
  fs::remove_all(kDir + "/resume-eval-gbs2");
  const std::string gbs_args = "dataset_type=megatron dataset_path=" + kDir + "/resume-eval split=50,50,0 model_name=test-tiny "
                               "pad_id=-1 eod_id=-1 max_target_length=8 eval_interval=1 eval_steps=1 async_checkpointing=false "
                               "base_output_directory=" + kDir + " data_cache_path=" + kDir + "/cache-resume-eval-gbs ";
  const auto gbs3 = run_trainer(gbs_args + "run_name=resume-eval-gbs3 per_device_batch_size=3 steps=2 checkpoint_period=1");
  INFO(gbs3.output);
  REQUIRE(gbs3.exit_code == 0);
  CHECK_THAT(read_file(kDir + "/resume-eval-gbs3/checkpoints/1/state.json"), Catch::Contains("\"consumed_valid_samples\": 3,"));
  const auto gbs2 = run_trainer(gbs_args + "run_name=resume-eval-gbs2 per_device_batch_size=2 steps=3 load_full_state_path=" + kDir +
                                "/resume-eval-gbs3/checkpoints/1");
  INFO(gbs2.output);
  CHECK(gbs2.exit_code == 0);
  const auto evals = read_lines(kDir + "/resume-eval-gbs2/metrics.jsonl");
  std::vector<double> consumed;
  for (const auto& line : evals)
    if (line.find("eval/lm_loss") != std::string::npos) consumed.push_back(json_metric(line, "eval/consumed_samples"));
  CHECK(consumed == std::vector<double>{6, 8, 10});
}

TEST_CASE("GPTDataset samples equal the numpy reference (epochs, separate final epoch, splits)", "[data]") {
  int separate = 0, multi_epoch = 0;
  for (const auto& g : reference()["gpt"]) {
    const auto sizes = g["sizes"].get<std::vector<int32_t>>();
    const auto bounds = gpt_split_boundaries(g["split"], static_cast<int64_t>(sizes.size()));
    CHECK(bounds == g["split_indices"].get<std::vector<int64_t>>());
    std::vector<int32_t> documents;
    for (int64_t d = bounds[g["which"].get<int>()]; d < bounds[g["which"].get<int>() + 1]; ++d)
      documents.push_back(static_cast<int32_t>(d));
    const int64_t L = g["seq_length"], N = g["num_samples"];
    const auto ix = gpt_build_indices(sizes, documents, L, N, g["seed"].get<uint32_t>());
    INFO("corpus of " << sizes.size() << " documents, L " << L << ", N " << N);
    CHECK(ix.num_epochs == g["num_epochs"].get<int64_t>());
    CHECK(ix.separate_final_epoch == g["separate_final_epoch"].get<bool>());
    separate += ix.separate_final_epoch;
    multi_epoch += ix.num_epochs > 1;
    // The size estimate the memory check uses equals what was built.
    const GptIndicesSize size = gpt_indices_size(sizes, documents, L, N);
    CHECK(size.num_epochs == ix.num_epochs);
    CHECK(size.document_bytes == 4.0 * static_cast<double>(ix.document_index.size()));
    CHECK(size.sample_bytes == 8.0 * static_cast<double>(ix.sample_index.size()));
    CHECK(size.shuffle_bytes == 8.0 * static_cast<double>(ix.shuffle_index.size()));
    const auto docs = fixture_corpus(g);
    for (int64_t i = 0; i < N; ++i) {
      std::vector<int64_t> text;
      for (const auto& p : gpt_sample_pieces(ix, sizes, i))
        text.insert(text.end(), docs[p.document].begin() + p.offset, docs[p.document].begin() + p.offset + p.length);
      INFO("sample " << i);
      REQUIRE(text == g["samples"][i].get<std::vector<int64_t>>());
    }
    // Before shuffling, consecutive samples overlap by exactly one token.
    for (size_t s = 0; s + 2 < ix.sample_index.size() / 2; ++s) {
      const int64_t doc_end = ix.document_index[ix.sample_index[2 * s + 2]], off_end = ix.sample_index[2 * s + 3];
      CHECK(off_end < sizes[doc_end]);  // the shared token exists in its document
    }
  }
  CHECK(separate >= 1);
  CHECK(multi_epoch >= 3);
}

TEST_CASE("numpy_sum adds as numpy.sum does (pairwise from 8 values), bit for bit", "[data]") {
  int differs_from_in_order = 0;
  for (const auto& c : reference()["sums"]) {
    const auto values = c["values"].get<std::vector<double>>();
    INFO(values.size() << " values");
    CHECK(numpy_sum(values) == c["sum"].get<double>());  // exact: the last bit decides blend ties
    double in_order = 0;
    for (double v : values) in_order += v;
    differs_from_in_order += in_order != c["sum"].get<double>();
  }
  CHECK(differs_from_in_order >= 1);  // the fixture can tell the two apart
}

TEST_CASE("blending follows Megatron's error rule (weights normalized twice) and 0.5% surplus", "[data]") {
  for (const auto& b : reference()["blends"]) {
    const auto weights = b["weights"].get<std::vector<double>>();
    std::vector<int16_t> dataset;
    std::vector<int64_t> sample;
    gpt_blend_indices(weights, b["size"], dataset, sample);
    CHECK(std::vector<int64_t>(dataset.begin(), dataset.end()) == b["dataset_index"].get<std::vector<int64_t>>());
    CHECK(sample == b["dataset_sample_index"].get<std::vector<int64_t>>());
    CHECK(gpt_blend_sizes(weights, b["size"]) == b["sizes"].get<std::vector<int64_t>>());
  }
}

namespace {
// Writes a fixture corpus as .bin/.idx and returns a config reading it.
Config corpus_config(const nlohmann::json& g, const std::string& name, std::vector<std::string> extra = {}) {
  fs::create_directories(kDir);
  indexed_dataset_write(kDir + "/" + name, fixture_corpus(g), 8);
  std::vector<std::string> o = {"dataset_type=megatron", "dataset_path=" + kDir + "/" + name,
                                "split=" + g["split"].get<std::string>(), "override_model_config=true",
                                "vocab_size=4096", "eod_id=-1", "pad_id=-1",
                                "max_target_length=" + std::to_string(g["seq_length"].get<int64_t>()),
                                "data_shuffle_seed=" + std::to_string(g["seed"].get<int64_t>()),
                                "data_cache_path=" + kDir + "/cache-" + name};
  o.insert(o.end(), extra.begin(), extra.end());
  return tiny_config(o);
}
}  // namespace

TEST_CASE("the loader serves reference samples in the global order for any (K, batch) split", "[data]") {
  const auto& g = reference()["gpt"][1];  // train split, 4 epochs, L = 16, 60 samples
  const Config a_cfg = corpus_config(g, "order", {"gradient_accumulation_steps=4", "per_device_batch_size=1", "steps=15"});
  const Config b_cfg = corpus_config(g, "order", {"gradient_accumulation_steps=1", "per_device_batch_size=4", "steps=15"});
  const DataLoader a(a_cfg, 0), b(b_cfg, 0);
  for (int64_t step = 0; step < 15; ++step) {
    const auto big = b.data_loader_next(step, 0);
    for (int64_t m = 0; m < 4; ++m) {
      const auto small = a.data_loader_next(step, m);
      const int64_t global = step * 4 + m;
      CHECK(small.sample_indices[0] == global);
      CHECK(std::vector<int64_t>(big.inputs.begin() + m * 16, big.inputs.begin() + (m + 1) * 16) == small.inputs);
      // inputs = text[:-1], targets = text[1:] of the reference sample
      const auto text = g["samples"][global].get<std::vector<int64_t>>();
      CHECK(small.inputs == std::vector<int64_t>(text.begin(), text.end() - 1));
      CHECK(small.targets == std::vector<int64_t>(text.begin() + 1, text.end()));
    }
  }
  // Two data-parallel ranks with batch 1 see what one rank with batch 2 sees.
  Config r2 = a_cfg;
  r2.gradient_accumulation_steps = 2;
  r2.data_parallel_size = 2;
  r2.global_batch_size = 4;
  Config r1 = a_cfg;
  r1.per_device_batch_size = 2;
  r1.gradient_accumulation_steps = 2;
  r1.global_batch_size = 4;
  const DataLoader rank0(r2, 0), rank1(r2, 1), single(r1, 0);
  for (int64_t m = 0; m < 2; ++m) {
    const auto both = single.data_loader_next(3, m);
    CHECK(rank0.data_loader_next(3, m).sample_indices[0] == both.sample_indices[0]);
    CHECK(rank1.data_loader_next(3, m).sample_indices[0] == both.sample_indices[1]);
  }
}

TEST_CASE("a blended dataset_path serves each component's own GPT samples in Megatron's blend order", "[data]") {
  // Two corpora with the fixture's shapes (B's tokens shifted so every sample says where it came
  // from), blended 0.3 / 0.7. Sample i of the blend must be sample dataset_sample_index[i] of
  // component dataset_index[i], each component built for its blend size (Megatron's BlendedDataset
  // over GPTDatasets; the blend indices and the GPT samples are each checked against numpy above).
  const auto& g = reference()["gpt"][0];
  const Config a = corpus_config(g, "blend-a");
  auto shifted = fixture_corpus(g);
  for (auto& doc : shifted)
    for (auto& t : doc) t += 1000;
  indexed_dataset_write(kDir + "/blend-b", shifted, 8);
  auto with_path = [&](const std::string& path, const std::string& cache) {
    Config c = a;
    c.dataset_path = path;
    c.data_cache_path = kDir + "/" + cache;
    c.vocab_size = 8192;  // B's shifted ids
    return c;
  };
  const Config blend = with_path("0.3 " + kDir + "/blend-a 0.7 " + kDir + "/blend-b", "cache-blend");
  const int64_t N = 40;
  const std::vector<double> weights = {0.3, 0.7};
  const auto sizes = gpt_blend_sizes(weights, N);
  std::vector<int16_t> dataset;
  std::vector<int64_t> sample;
  gpt_blend_indices(weights, N, dataset, sample);
  const DataLoader blended(blend, 0, megatron_source(blend, DataSplit::kTrain, N));
  const Config only_a = with_path(kDir + "/blend-a", "cache-blend-a"), only_b = with_path(kDir + "/blend-b", "cache-blend-b");
  const DataLoader component_a(only_a, 0, megatron_source(only_a, DataSplit::kTrain, sizes[0]));
  const DataLoader component_b(only_b, 0, megatron_source(only_b, DataSplit::kTrain, sizes[1]));
  int64_t from_b = 0;
  for (int64_t i = 0; i < N; ++i) {
    const auto& component = dataset[static_cast<size_t>(i)] == 0 ? component_a : component_b;
    from_b += dataset[static_cast<size_t>(i)];
    INFO("blended sample " << i);
    CHECK(blended.data_loader_sample(i).inputs == component.data_loader_sample(sample[static_cast<size_t>(i)]).inputs);
  }
  CHECK(from_b == Approx(0.7 * N).margin(1));  // the weights are honoured
}

TEST_CASE("a weighted single dataset_path (\"1.0 prefix\") is Megatron's one-dataset blend: built for 0.5% more samples", "[data]") {
  // Megatron takes the blend path whenever weights are given, one prefix too: its GPTDataset is
  // built for ceil(N * 1.005) samples, which here needs a second epoch and so another shuffle.
  const auto& g = reference()["gpt"][0];
  const Config plain = corpus_config(g, "single");
  const auto sizes = g["sizes"].get<std::vector<int32_t>>();
  const auto bounds = gpt_split_boundaries(g["split"], static_cast<int64_t>(sizes.size()));
  int64_t tokens = 0;
  for (int64_t d = bounds[0]; d < bounds[1]; ++d) tokens += sizes[static_cast<size_t>(d)];
  const int64_t L = g["seq_length"], N = (tokens - 1) / L;  // the most samples one epoch gives
  const int64_t built = gpt_blend_sizes({1.0}, N)[0];
  REQUIRE(built == N + 1);
  Config weighted = plain;
  weighted.dataset_path = "1.0 " + plain.dataset_path;
  weighted.data_cache_path = kDir + "/cache-single-weighted";
  const DataLoader as_blend(weighted, 0, megatron_source(weighted, DataSplit::kTrain, N));
  const DataLoader built_for_more(plain, 0, megatron_source(plain, DataSplit::kTrain, built));
  const DataLoader unweighted(plain, 0, megatron_source(plain, DataSplit::kTrain, N));
  int64_t differ = 0;
  for (int64_t i = 0; i < N; ++i) {
    INFO("sample " << i);
    CHECK(as_blend.data_loader_sample(i).inputs == built_for_more.data_loader_sample(i).inputs);
    differ += as_blend.data_loader_sample(i).inputs != unweighted.data_loader_sample(i).inputs;
  }
  CHECK(differ > 0);
}

TEST_CASE("a re-created loader continues exactly, and the index cache is reused and keyed", "[data]") {
  const auto& g = reference()["gpt"][0];
  fs::remove_all(kDir + "/cache-cache");
  const Config c = corpus_config(g, "cache", {"steps=30", "per_device_batch_size=1"});
  const DataLoader first(c, 0);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(kDir + "/cache-cache")) files.push_back(e.path().string());
  REQUIRE(files.size() == 1);
  const auto stamp = fs::last_write_time(files[0]);
  const DataLoader again(c, 0);  // consumed = 12 samples: a new loader at step 12 continues
  CHECK(again.data_loader_next(12, 0).inputs == first.data_loader_next(12, 0).inputs);
  CHECK(fs::last_write_time(files[0]) == stamp);  // cache hit: not rewritten
  // Changing the seed, the sequence length or the split builds (and caches) new indices.
  corpus_config(g, "cache", {"steps=30", "per_device_batch_size=1", "data_shuffle_seed=1"});
  DataLoader seed(corpus_config(g, "cache", {"steps=30", "per_device_batch_size=1", "data_shuffle_seed=1"}), 0);
  DataLoader length(corpus_config(g, "cache", {"steps=30", "per_device_batch_size=1", "max_target_length=7"}), 0);
  DataLoader split(corpus_config(g, "cache", {"steps=30", "per_device_batch_size=1", "split=90,10,0"}), 0);
  size_t count = 0;
  for (const auto& e : fs::directory_iterator(kDir + "/cache-cache")) count += e.path().extension() == ".gptidx";
  CHECK(count == 4);
  CHECK(seed.data_loader_next(0, 0).inputs != first.data_loader_next(0, 0).inputs);

  // A corrupted cache file (same size, one byte changed) is not trusted: rebuilt and replaced.
  const std::string original = read_file(files[0]);
  std::string corrupted = original;
  corrupted[corrupted.size() / 2] = static_cast<char>(corrupted[corrupted.size() / 2] ^ 0x5a);
  std::ofstream(files[0], std::ios::binary) << corrupted;
  const DataLoader rebuilt(c, 0);
  for (int64_t step = 0; step < 30; ++step)
    CHECK(rebuilt.data_loader_next(step, 0).inputs == first.data_loader_next(step, 0).inputs);
  CHECK(read_file(files[0]) == original);
  // A truncated one too.
  std::ofstream(files[0], std::ios::binary) << original.substr(0, original.size() - 3);
  const DataLoader after_truncation(c, 0);
  CHECK(after_truncation.data_loader_next(29, 0).inputs == first.data_loader_next(29, 0).inputs);
  CHECK(read_file(files[0]) == original);
  // A sound cache file of other indices copied under this name (here the seed=1 one; another
  // corpus's crashed the run with SIGSEGV, one of equal size gave other samples silently) is not
  // trusted either: the file names what it was built from.
  std::string other_seed;
  for (const auto& e : fs::directory_iterator(kDir + "/cache-cache"))
    if (e.path() != files[0] && read_file(e.path().string()).find("|seed 1|") != std::string::npos)
      other_seed = e.path().string();
  REQUIRE_FALSE(other_seed.empty());
  fs::copy_file(other_seed, files[0], fs::copy_options::overwrite_existing);
  const DataLoader after_copy(c, 0);
  for (int64_t step = 0; step < 30; ++step)
    CHECK(after_copy.data_loader_next(step, 0).inputs == first.data_loader_next(step, 0).inputs);
  CHECK(read_file(files[0]) == original);
  // Ids outside the corpus under a valid checksum and key (a forged or buggy writer): rebuilt.
  // Layout: magic (8), six u64 counts, u32 CRC32C of the key text and the arrays, the key text,
  // then the int32 document ids.
  uint64_t counts[6];
  std::memcpy(counts, original.data() + 8, sizeof counts);
  const size_t header = 8 + sizeof counts + 4;
  std::string forged = original;
  const int32_t outside = 1 << 30;
  std::memcpy(forged.data() + header + counts[5], &outside, 4);
  const uint32_t crc = crc32c_update(0, forged.data() + header, forged.size() - header);
  std::memcpy(forged.data() + header - 4, &crc, 4);
  std::ofstream(files[0], std::ios::binary) << forged;
  const DataLoader after_forgery(c, 0);
  CHECK(after_forgery.data_loader_next(0, 0).inputs == first.data_loader_next(0, 0).inputs);
  CHECK(read_file(files[0]) == original);
  // A FIFO under the name blocked the open on every rank, past the collective timeout.
  fs::remove(files[0]);
  REQUIRE(mkfifo(files[0].c_str(), 0644) == 0);
  const DataLoader after_fifo(c, 0);
  CHECK(after_fifo.data_loader_next(5, 0).inputs == first.data_loader_next(5, 0).inputs);
  CHECK(read_file(files[0]) == original);
}

TEST_CASE("an index cache write deletes the temporaries killed writers on this host left, and no other", "[data]") {
  const auto& g = reference()["gpt"][0];
  const std::string dir = kDir + "/cache-stale";
  fs::remove_all(dir);
  fs::create_directories(dir);
  char host[256] = {};
  REQUIRE(gethostname(host, sizeof host - 1) == 0);
  const pid_t ended = fork();  // a pid that is gone once reaped
  if (ended == 0) _exit(0);
  REQUIRE(wait_exit_code(ended) == 0);
  const std::string mine = std::string(".gptidx.tmp.") + host + ".";
  const std::string dead = dir + "/old-1234abcd" + mine + std::to_string(ended);
  const std::string alive = dir + "/old-1234abcd" + mine + std::to_string(getppid());  // a writer still running
  const std::string other_host = dir + "/old-1234abcd.gptidx.tmp.some-other-host." + std::to_string(ended);
  for (const auto& path : {dead, alive, other_host}) std::ofstream(path) << "half";
  const DataLoader loader(corpus_config(g, "stale", {"steps=30", "per_device_batch_size=1"}), 0);  // builds, writes
  CHECK_FALSE(fs::exists(dead));
  CHECK(fs::exists(alive));
  CHECK(fs::exists(other_host));
  size_t caches = 0, temporaries = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    caches += e.path().extension() == ".gptidx";
    temporaries += e.path().string().find(".tmp.") != std::string::npos;
  }
  CHECK(caches == 1);
  CHECK(temporaries == 2);  // its own was renamed
  // The arrays the loader holds are the cache file's payload (after its 60-byte header and the
  // key text, whose length is the header's sixth count): the memory plan check counts them as
  // resident data, not as runtime.
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".gptidx") {
      uint64_t key_bytes = 0;
      std::memcpy(&key_bytes, read_file(e.path().string()).data() + 8 + 5 * 8, 8);
      CHECK(loader.data_loader_index_bytes() == static_cast<double>(fs::file_size(e.path()) - 60 - key_bytes));
    }
}

TEST_CASE("ranks meet per index file: rank 0 announces it, the others read it or, not seeing it, build it at once", "[data]") {
  const auto& g = reference()["gpt"][0];
  fs::remove_all(kDir + "/cache-sync");
  const Config c = corpus_config(g, "sync", {"steps=30", "per_device_batch_size=1"});
  auto cached_files = [&](const std::string& dir) {
    std::vector<std::string> files;
    if (fs::exists(dir))
      for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().string());
    return files;
  };
  // Rank 0 announces each file once it is on disk: after building it, and after a cache hit
  // (another node's rank may still miss it).
  std::vector<std::string> announced;
  DataIndexSync rank0{[&](const std::string& slot, const DataIndexSync::Announcement& mine) {
    CHECK_THAT(slot, Catch::Contains("train split, dataset 0"));
    CHECK(fs::exists(mine.file));
    CHECK(mine.cached);
    announced.push_back(mine.file);
    return mine;
  }};
  const DataLoader built(c, 0, rank0);
  const auto files = cached_files(kDir + "/cache-sync");
  REQUIRE(files.size() == 1);
  REQUIRE(announced == std::vector<std::string>{files[0]});
  const DataLoader hit(c, 0, rank0);
  CHECK(announced.size() == 2);

  // Rank 1 that finds the file hears rank 0 (to compare the data) and reads its own.
  int waits = 0;
  const auto rank0_says = [&](const DataIndexSync::Announcement&) {
    ++waits;
    return DataIndexSync::Announcement{files[0], true};
  };
  DataIndexSync rank1_shared{[&](const std::string&, const DataIndexSync::Announcement& mine) { return rank0_says(mine); }};
  const DataLoader shared(c, 1, rank1_shared);
  CHECK(waits == 1);
  CHECK(shared.data_loader_sample(3).inputs == built.data_loader_sample(3).inputs);

  // Rank 1 that misses it waits for rank 0, then reads what rank 0 wrote meanwhile (not rebuilt).
  const std::string bytes = read_file(files[0]);
  fs::remove(files[0]);
  fs::file_time_type stamp;
  DataIndexSync rank1_waits{[&](const std::string&, const DataIndexSync::Announcement& mine) {
    CHECK(mine.file == files[0]);
    CHECK_FALSE(mine.cached);  // a waiting rank has nothing to report
    std::ofstream(mine.file, std::ios::binary) << bytes;  // rank 0 finishes during the wait
    stamp = fs::last_write_time(mine.file);
    return rank0_says(mine);
  }};
  const DataLoader waited(c, 1, rank1_waits);
  CHECK(waits == 2);
  CHECK(fs::last_write_time(files[0]) == stamp);
  CHECK(waited.data_loader_sample(7).inputs == built.data_loader_sample(7).inputs);

  // Rank 1 on another node (the file never appears in its cache directory) builds it itself as
  // soon as rank 0 announces, with the same samples.
  fs::remove(files[0]);
  const DataLoader node_local(c, 1, rank1_shared);
  CHECK(waits == 3);
  CHECK(read_file(files[0]) == bytes);
  for (int64_t i = 0; i < 30; ++i) CHECK(node_local.data_loader_sample(i).inputs == built.data_loader_sample(i).inputs);

  // Rank 0 that could not write the file says so: rank 1 builds at once and does not read a
  // stale file of that name (here a leftover with other contents).
  std::ofstream(files[0], std::ios::binary) << "stale";
  DataIndexSync rank0_not_cached{[&](const std::string&, const DataIndexSync::Announcement&) {
    ++waits;
    return DataIndexSync::Announcement{files[0], false};
  }};
  const DataLoader uncached(c, 1, rank0_not_cached);
  CHECK(waits == 4);

  // Rank 0 indexing other data (its file has another key): exit 3 at once, naming both files.
  // Ranks reading differing node-local copies used to wait out the collective timeout (exit 5).
  // It votes on it first, so that every rank exits 3 (rank 0 below).
  std::vector<std::pair<std::string, bool>> agreement_votes;
  const auto record_votes = [&](bool mine, const std::string& what) {
    agreement_votes.emplace_back(what, mine);
    return int64_t{what == "the data index agreement" ? 1 : 0};  // one rank differs: this one, or rank 1
  };
  DataIndexSync rank0_other_data{[&](const std::string&, const DataIndexSync::Announcement&) {
                                   return DataIndexSync::Announcement{kDir + "/cache-sync/sync-00000000.gptidx", true};
                                 },
                                 record_votes};
  try {
    DataLoader(c, 1, rank0_other_data);
    FAIL("expected the data mismatch");
  } catch (const Error& e) {
    CHECK(e.exit_code() == kExitData);
    CHECK_THAT(e.what(), Catch::Contains("rank 1 reads other data than rank 0 for the train split, dataset 0") &&
                             Catch::Contains(fs::path(files[0]).filename().string() + " here and sync-00000000.gptidx on rank 0"));
  }
  CHECK(agreement_votes == std::vector<std::pair<std::string, bool>>{{"opening the data files", false},
                                                                      {"the data index memory check", false},
                                                                      {"the data index agreement", true}});
  // Rank 0 hears the vote: rank 1 differs (it used to see only rank 1 die in its next collective).
  agreement_votes.clear();
  DataIndexSync rank0_outvoted{[&](const std::string&, const DataIndexSync::Announcement& mine) { return mine; },
                               record_votes};
  try {
    DataLoader(c, 0, rank0_outvoted);
    FAIL("expected the data mismatch");
  } catch (const Error& e) {
    CHECK(e.exit_code() == kExitData);
    CHECK_THAT(e.what(), Catch::Contains("rank 0: 1 rank(s) read other data than rank 0 for the train split, dataset 0"));
  }
  CHECK(agreement_votes == std::vector<std::pair<std::string, bool>>{{"opening the data files", false},
                                                                      {"the data index memory check", false},
                                                                      {"the data index agreement", false}});
  CHECK(uncached.data_loader_sample(4).inputs == built.data_loader_sample(4).inputs);

  // Rank 0 never announcing (it failed, or a build outlasting the timeout) is the wait's error.
  fs::remove(files[0]);
  DataIndexSync times_out{[](const std::string& slot, const DataIndexSync::Announcement&) -> DataIndexSync::Announcement {
    throw Error(kExitDistributed, "no news of " + slot);
  }};
  try {
    DataLoader(c, 1, times_out);
    FAIL("expected the wait's error");
  } catch (const Error& e) {
    CHECK(e.exit_code() == kExitDistributed);
    CHECK_THAT(e.what(), Catch::Contains("no news of train split, dataset 0"));
  }

  // The index memory check is voted on before any rank builds: a rank whose arrays fit exits 2
  // with the others when another's do not, and builds nothing.
  fs::remove_all(kDir + "/cache-sync");
  std::vector<bool> votes;
  DataIndexSync other_rank_short{{}, [&](bool does_not_fit, const std::string& what) {
                                   if (what == "opening the data files") return int64_t{0};
                                   CHECK(what == "the data index memory check");
                                   votes.push_back(does_not_fit);
                                   return int64_t{1};
                                 }};
  try {
    DataLoader(c, 0, other_rank_short);
    FAIL("expected the vote's error");
  } catch (const Error& e) {
    CHECK(e.exit_code() == kExitUsage);
    CHECK_THAT(e.what(), Catch::Contains("the train split's data index arrays do not fit in host memory on 1 other rank(s)"));
  }
  CHECK(votes == std::vector<bool>{false});
  CHECK_FALSE(fs::exists(kDir + "/cache-sync"));

  // Files another rank could not open: this rank, which opened them, exits 3 at the first vote.
  DataIndexSync other_rank_cannot_open{{}, [&](bool mine, const std::string& what) {
                                         CHECK(what == "opening the data files");
                                         CHECK_FALSE(mine);
                                         return int64_t{1};
                                       }};
  try {
    DataLoader(c, 0, other_rank_cannot_open);
    FAIL("expected the vote's error");
  } catch (const Error& e) {
    CHECK(e.exit_code() == kExitData);
    CHECK_THAT(e.what(), Catch::Contains("rank 0: 1 other rank(s) could not open or split the train split's files of dataset_path"));
  }
  CHECK_FALSE(fs::exists(kDir + "/cache-sync"));
}

TEST_CASE("Megatron masks: pad targets, eod_mask_loss, reset_position_ids, reset_attention_mask", "[data]") {
  // Documents end with EOD = 9; pad = 8. One sample of L = 9 spans three documents. No document
  // holds token 0, so a 0 can only be a pad id, which Megatron feeds as 0 (GPTDataset.__getitem__).
  fs::create_directories(kDir);
  indexed_dataset_write(kDir + "/masks", {{1, 2, 9}, {3, 9}, {4, 5, 8, 9}, {6, 7, 9}}, 8);
  auto rows = [&](std::vector<std::string> flags) {
    std::vector<std::string> o = {"dataset_type=megatron", "dataset_path=" + kDir + "/masks", "split=1,0,0",
                                  "max_target_length=9", "eod_id=9", "pad_id=8", "steps=3",
                                  "per_device_batch_size=1", "data_cache_path=" + kDir + "/cache-masks"};
    o.insert(o.end(), flags.begin(), flags.end());
    const DataLoader loader(tiny_config(o), 0);
    return std::vector<MicroBatch>{loader.data_loader_sample(0), loader.data_loader_sample(1), loader.data_loader_sample(2)};
  };
  int64_t pads = 0;
  for (const auto& plain : rows({})) {
    std::vector<int64_t> eods;
    for (int64_t t = 0; t < 9; ++t) {
      CHECK(plain.positions[t] == t);
      CHECK(plain.segment_ids[t] == 1);
      CHECK(plain.inputs[t] != 8);
      CHECK(plain.targets[t] != 8);
      CHECK(plain.loss_mask[t] == (plain.targets[t] == 0 ? 0.0f : 1.0f));
      pads += plain.targets[t] == 0;
      if (plain.inputs[t] == 9) eods.push_back(t);
    }
    REQUIRE(!eods.empty());
  }
  CHECK(pads >= 1);
  for (const auto& masked : rows({"eod_mask_loss=true", "reset_position_ids=true", "reset_attention_mask=true"})) {
    int64_t expected_position = 0, expected_segment = 1;
    for (int64_t t = 0; t < 9; ++t) {
      INFO("t " << t << " input " << masked.inputs[t]);
      CHECK(masked.positions[t] == expected_position);
      CHECK(masked.segment_ids[t] == expected_segment);
      CHECK(masked.loss_mask[t] == ((masked.inputs[t] == 9 || masked.targets[t] == 0) ? 0.0f : 1.0f));
      ++expected_position;
      if (masked.inputs[t] == 9) expected_position = 0, ++expected_segment;
    }
  }
  // A pad id equal to the EOD id is dropped, as Megatron does: EOD targets keep their loss and
  // their id (it masked every EOD target before).
  int64_t eod_targets = 0;
  for (const auto& same : rows({"pad_id=9"}))
    for (int64_t t = 0; t < 9; ++t) {
      CHECK(same.loss_mask[t] == 1.0f);
      CHECK(same.targets[t] != 0);
      eod_targets += same.targets[t] == 9;
    }
  CHECK(eod_targets >= 1);
}

TEST_CASE("pad_id=-1 with MTP layers trains: the MTP inputs past a row's end are token 0, as Megatron's roll", "[data][cli]") {
  // The shift filled them with pad_id, and embedding -1 ended step 0 with exit 1.
  fs::create_directories(kDir);
  std::vector<std::vector<int64_t>> docs;
  for (int d = 0; d < 40; ++d) docs.push_back({1 + d % 50, 2 + d % 50, 3 + d % 50, 4 + d % 50, 5 + d % 50});
  indexed_dataset_write(kDir + "/mtpcorpus", docs, 8);
  const auto r = run_trainer("dataset_type=megatron dataset_path=" + kDir + "/mtpcorpus split=1,0,0 model_name=test-tiny "
                             "override_model_config=true mtp_num_layers=2 pad_id=-1 eod_id=-1 max_target_length=8 "
                             "per_device_batch_size=2 steps=2 log_period=1 data_cache_path=" + kDir +
                             "/cache-mtp base_output_directory=" + kDir + " run_name=mtprun enable_checkpointing=false");
  REQUIRE(r.exit_code == 0);
  const auto lines = read_lines(kDir + "/mtprun/metrics.jsonl");
  REQUIRE(lines.size() == 2);
  for (const auto& line : lines) {
    CHECK(std::isfinite(json_metric(line, "learning/mtp_loss")));
    CHECK(json_metric(line, "learning/mtp_loss") > 0);
  }
}

TEST_CASE("token ids outside the vocabulary stop the run with exit code 3", "[data][cli]") {
  fs::create_directories(kDir);
  // Samples of 4 (+1) tokens: every token but the last reaches some sample. An empty document 0,
  // then document 1 of two sequences: 500 is token 2 of sequence 1 (it was named "document 1 at
  // token offset 2", the sequence's number and offset as a document's).
  indexed_dataset_write(kDir + "/bigids",
                        std::vector<IndexedDocument>{{{}, {}},
                                                     {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 500, 14, 15, 16, 17, 18, 19, 20},
                                                      {10, 10}}},
                        8);
  fs::remove_all(kDir + "/bigids");
  const auto r = run_trainer("dataset_type=megatron dataset_path=" + kDir + "/bigids split=1,0,0 model_name=test-tiny "
                             "max_target_length=4 per_device_batch_size=1 steps=4 pad_id=-1 eod_id=-1 "
                             "base_output_directory=" + kDir + " run_name=bigids data_cache_path=" + kDir + "/cache-big");
  CHECK(r.exit_code == 3);
  CHECK_THAT(r.output, Catch::Contains("token id 500") && Catch::Contains("bigids.bin") &&
                           Catch::Contains("in sequence 1 (document 1) at token offset 2 of that sequence") &&
                           Catch::Contains("vocab_size = 64"));
  const auto missing = run_trainer("dataset_type=megatron dataset_path=" + kDir + "/nothing-here model_name=test-tiny "
                                   "pad_id=-1 eod_id=-1 base_output_directory=" + kDir + " run_name=missing");
  CHECK(missing.exit_code == 3);
  CHECK_THAT(missing.output, Catch::Contains("nothing-here.idx"));
}

TEST_CASE("preprocess_data: JSON lines to .bin/.idx, same bytes for any --workers", "[data][cli]") {
  fs::create_directories(kDir);
  {
    std::ofstream jsonl(kDir + "/docs.jsonl");
    for (int i = 0; i < 500; ++i)
      jsonl << nlohmann::json({{"text", "document " + std::to_string(i) + " \xc3\xa9t\xc3\xa9"}, {"id", i}}).dump() << "\n";
  }
  auto run = [&](const std::string& args) {
    const auto r = run_command(std::string(PREPROCESS_BINARY) + " --input " + kDir + "/docs.jsonl " + args);
    return std::make_pair(r.exit_code, r.output);
  };
  REQUIRE(run("--output-prefix " + kDir + "/w1 --append-eod --workers 1").first == 0);
  const auto [code, log] = run("--output-prefix " + kDir + "/w3 --append-eod --workers 3");
  REQUIRE(code == 0);
  CHECK_THAT(log, Catch::Contains("500 documents") && Catch::Contains("uint16"));
  CHECK(read_file(kDir + "/w1_text_document.bin") == read_file(kDir + "/w3_text_document.bin"));
  CHECK(read_file(kDir + "/w1_text_document.idx") == read_file(kDir + "/w3_text_document.idx"));
  IndexedDataset data(kDir + "/w3_text_document");
  REQUIRE(data.num_documents() == 500);
  std::vector<int64_t> doc;
  data.read(7, 0, data.sequence_length(7), doc);
  const std::string text = "document 7 \xc3\xa9t\xc3\xa9";
  std::vector<int64_t> expected(text.begin(), text.end());
  for (auto& v : expected) v = static_cast<unsigned char>(v);
  expected.push_back(256);  // <eod>
  CHECK(doc == expected);
  CHECK(run("--output-prefix " + kDir + "/bad --tokenizer-type wordpiece").first == 2);
  CHECK(run("--output-prefix " + kDir + "/bad --json-keys missing").first == 3);
}

namespace {
// Megatron's tools/preprocess_data.py, transcribed for the cases below (commit d98e8a64):
//   Encoder.encode: for each sentence of data[key] ([text] for a string, the list itself for a
//   list): ids = tokenize(sentence); if len(ids) > 0: doc_ids.extend(ids); sentence_lens.append(len(ids))
//   then: if len(doc_ids) > 0 and append_eod: doc_ids.append(eod); sentence_lens[-1] += 1
//   IndexedDatasetBuilder.add_document(doc_ids, sentence_lens): writes the tokens, extends
//   sequence_lengths by sentence_lens, appends len(sequence_lengths) to document_indices ([0] first).
//   _IndexWriter: b"MMIDIDX\x00\x00", <Q 1, <B dtype code, <Q len(lengths), <Q len(document_indices),
//   int32 lengths, int64 pointers (byte offsets), int64 document_indices.
std::string megatron_idx_bytes(uint8_t code, const std::vector<int32_t>& lengths, const std::vector<int64_t>& documents) {
  std::string out("MMIDIDX\0\0", 9);
  auto put = [&](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); };
  const uint64_t version = 1, S = lengths.size(), D = documents.size();
  put(&version, 8);
  out.push_back(static_cast<char>(code));
  put(&S, 8);
  put(&D, 8);
  for (int32_t l : lengths) put(&l, 4);
  int64_t pointer = 0;
  for (int32_t l : lengths) put(&pointer, 8), pointer += 2 * l;  // uint16 tokens
  for (int64_t d : documents) put(&d, 8);
  return out;
}

std::string uint16_bytes(const std::vector<int>& tokens) {
  std::string out;
  for (int t : tokens) out.push_back(static_cast<char>(t & 0xff)), out.push_back(static_cast<char>(t >> 8));
  return out;
}

// Runs preprocess_data (byte tokenizer: ids are the UTF-8 bytes, <eod> = 256) on `jsonl` written
// to <kDir>/<name>.jsonl; returns {exit code, output}.
std::pair<int, std::string> preprocess(const std::string& name, const std::string& jsonl, const std::string& args) {
  fs::create_directories(kDir);
  std::ofstream(kDir + "/" + name + ".jsonl", std::ios::binary) << jsonl;
  const auto r = run_command(std::string(PREPROCESS_BINARY) + " --input " + kDir + "/" + name + ".jsonl --output-prefix " +
                             kDir + "/" + name + " " + args);
  return {r.exit_code, r.output};
}
}  // namespace

TEST_CASE("preprocess_data as Megatron: empty text adds no sequence and no EOD, but a document", "[data][cli]") {
  const auto [code, log] = preprocess("empty", "{\"text\": \"ab\"}\n{\"text\": \"\"}\n{\"text\": \"c\"}\n", "--append-eod");
  REQUIRE(code == 0);
  CHECK(read_file(kDir + "/empty_text_document.idx") == megatron_idx_bytes(8, {3, 2}, {0, 1, 1, 2}));
  CHECK(read_file(kDir + "/empty_text_document.bin") == uint16_bytes({97, 98, 256, 99, 256}));
  IndexedDataset data(kDir + "/empty_text_document");  // our reader accepts the empty document
  CHECK(data.num_documents() == 3);
  CHECK(data.num_sequences() == 2);
  // Without --append-eod the empty document is still a document.
  REQUIRE(preprocess("empty-noeod", "{\"text\": \"\"}\n{\"text\": \"ab\"}\n", "").first == 0);
  CHECK(read_file(kDir + "/empty-noeod_text_document.idx") == megatron_idx_bytes(8, {2}, {0, 0, 1}));
}

TEST_CASE("preprocess_data as Megatron: NaN, Infinity and numbers past double's range outside the text read as json.loads reads them", "[data][cli]") {
  // json.dumps writes NaN for a float score; nlohmann refused the line (exit 3), Megatron reads it.
  const std::string lines = "{\"text\": \"ab\", \"score\": NaN}\n"
                            "{\"score\": -Infinity, \"text\": \"c\", \"x\": [Infinity, 1e400, -2.5e-999]}\n"
                            "{\"text\": \"NaN 1e400 \\\" Infinity\", \"n\": 1E+400}\n";
  const auto [code, log] = preprocess("python-json", lines, "--append-eod");
  INFO(log);
  REQUIRE(code == 0);
  std::vector<int> expected = {97, 98, 256, 99, 256};
  for (const char c : std::string("NaN 1e400 \" Infinity")) expected.push_back(static_cast<unsigned char>(c));
  expected.push_back(256);
  CHECK(read_file(kDir + "/python-json_text_document.bin") == uint16_bytes(expected));
  // Such a value where the text is read is not text (Megatron's tokenizer raises), and a line
  // that is no JSON at all keeps the strict parser's message.
  const auto nan_text = preprocess("nan-text", "{\"text\": NaN}\n", "");
  CHECK(nan_text.first == 3);
  CHECK_THAT(nan_text.second, Catch::Contains("line 1: field \"text\" is null"));
  const auto broken = preprocess("broken", "{\"text\": \"a\", NaN}\n", "");
  CHECK(broken.first == 3);
  CHECK_THAT(broken.second, Catch::Contains("line 1: ") && Catch::Contains("parse error"));
  // What is not a JSON number stays an error beside a value json.loads takes only from Python
  // (1e400): 01, 1., a lone -, .5, 1e and 1e+ are refused by json.loads too (they read as 0).
  for (const std::string bad : {"01", "1.", "-", ".5", "1e", "1e+", "--1", "1.2.3"}) {
    const auto r = preprocess("bad-number", "{\"text\": \"a\", \"big\": 1e400, \"id\": " + bad + "}\n", "");
    INFO(bad << ": " << r.second);
    CHECK(r.first == 3);
    CHECK_THAT(r.second, Catch::Contains("line 1: ") && Catch::Contains("parse error"));
  }
}

TEST_CASE("merge_datasets as Megatron: a directory's pairs in sorted order equal preprocess_data of their lines concatenated", "[data][cli]") {
  // Megatron's tools/merge_datasets.py: prefixes sorted ("a10" < "a2" < "b"), documents and
  // sequences appended, .bin copied, pointers recomputed. An empty document and a document of two
  // sequences keep their shape.
  const std::vector<std::pair<std::string, std::string>> parts = {
      {"b", "{\"text\": \"bb\"}\n{\"text\": \"\"}\n"},
      {"a10", "{\"text\": [\"x\", \"yz\"]}\n"},
      {"a2", "{\"text\": \"q\"}\n{\"text\": \"rs\"}\n"}};
  const std::string in = kDir + "/merge-in";
  fs::remove_all(in);
  fs::create_directories(in);
  for (const auto& [name, lines] : parts) {
    REQUIRE(preprocess("part-" + name, lines, "--append-eod").first == 0);
    for (const char* suffix : {".bin", ".idx"})
      fs::copy_file(kDir + "/part-" + name + "_text_document" + suffix, in + "/" + name + suffix);
  }
  REQUIRE(preprocess("part-all", parts[1].second + parts[2].second + parts[0].second, "--append-eod").first == 0);
  const auto merge = [&](const std::string& input, const std::string& output) {
    return run_command(std::string(MERGE_BINARY) + " --input " + input + " --output-prefix " + output);
  };
  const auto merged = merge(in, kDir + "/merged");
  INFO(merged.output);
  REQUIRE(merged.exit_code == 0);
  CHECK_THAT(merged.output, Catch::Contains("3 inputs, 5 documents, 5 sequences"));
  CHECK(read_file(kDir + "/merged.bin") == read_file(kDir + "/part-all_text_document.bin"));
  CHECK(read_file(kDir + "/merged.idx") == read_file(kDir + "/part-all_text_document.idx"));
  // Bad inputs: named, nothing written.
  const std::string mixed = kDir + "/merge-mixed";
  fs::remove_all(mixed);
  fs::create_directories(mixed);
  indexed_dataset_write(mixed + "/a", {{1, 2}}, 8);
  indexed_dataset_write(mixed + "/b", std::vector<std::vector<int64_t>>{{3}}, 4);
  const auto dtypes = merge(mixed, kDir + "/merged-mixed");
  CHECK(dtypes.exit_code == 3);
  CHECK_THAT(dtypes.output, Catch::Contains(mixed + "/b.idx has dtype code 4, but " + kDir + "/merged-mixed is written with 8"));
  fs::remove(mixed + "/b.bin");
  const auto unpaired = merge(mixed, kDir + "/merged-mixed");
  CHECK(unpaired.exit_code == 3);
  CHECK_THAT(unpaired.output, Catch::Contains("b.idx has no b.bin beside it"));
  for (const std::string name : {"merged-mixed.bin", "merged-mixed.idx"}) CHECK_FALSE(fs::exists(kDir + "/" + name));
  for (const auto& entry : fs::directory_iterator(kDir)) CHECK(entry.path().string().find(".partial-") == std::string::npos);
  fs::create_directories(kDir + "/merge-empty");
  const auto empty = merge(kDir + "/merge-empty", kDir + "/merged-empty");
  CHECK(empty.exit_code == 3);
  CHECK_THAT(empty.output, Catch::Contains("holds no .bin/.idx pairs"));
  const auto over = merge(in, in + "/a2");
  CHECK(over.exit_code == 2);
  CHECK_THAT(over.output, Catch::Contains("would overwrite the input " + in + "/a2.bin"));
  const auto nowhere = merge(in, kDir + "/no-such-dir/merged");
  CHECK(nowhere.exit_code == 2);
  CHECK(merge(kDir + "/no-such-input", kDir + "/merged-none").exit_code == 2);
}

TEST_CASE("bench_data: usage errors exit 2, as every tool", "[data][cli]") {
  // CLI11_PARSE exited with CLI11's own codes (106 for a missing argument, 104 for a bad number).
  CHECK(run_command(std::string(BENCH_DATA_BINARY)).exit_code == 2);
  CHECK(run_command(std::string(BENCH_DATA_BINARY) + " " + source_path("configs/base.yml") + " --steps x").exit_code == 2);
  CHECK(run_command(std::string(BENCH_DATA_BINARY) + " --help").exit_code == 0);
}

TEST_CASE("preprocess_data as Megatron: lines end at LF, CRLF or a lone CR (Python's universal newlines)", "[data][cli]") {
  // Megatron reads the input in text mode, where each of the three ends a line; a lone "\r" (old
  // Mac files) made the whole file one line, which failed to parse.
  const std::string expected = uint16_bytes({97, 256, 98, 256, 99, 256, 100, 256});
  for (const std::string ending : {"\n", "\r\n", "\r"}) {
    const std::string name = "endings" + std::to_string(ending.size()) + (ending == "\r" ? "cr" : "");
    const auto [code, log] = preprocess(name, "{\"text\": \"a\"}" + ending + "{\"text\": \"b\"}" + ending + "{\"text\": \"c\"}" +
                                                  ending + "{\"text\": \"d\"}", "--append-eod");
    INFO(log);
    REQUIRE(code == 0);
    CHECK(read_file(kDir + "/" + name + "_text_document.bin") == expected);
  }
  // Mixed, as Python splits it; "\r\r\n" is a line end and then an empty line (json.loads fails).
  REQUIRE(preprocess("endings-mixed", "{\"text\": \"a\"}\r{\"text\": \"b\"}\r\n{\"text\": \"c\"}\n{\"text\": \"d\"}\r",
                     "--append-eod").first == 0);
  CHECK(read_file(kDir + "/endings-mixed_text_document.bin") == expected);
  const auto blank = preprocess("endings-blank", "{\"text\": \"a\"}\r\r\n{\"text\": \"b\"}\n", "");
  CHECK(blank.first == 3);
  CHECK_THAT(blank.second, Catch::Contains("line 2"));
}

TEST_CASE("preprocess_data as Megatron: a list of sentences is one document of several sequences", "[data][cli]") {
  // ["ab", "", "c"]: the empty sentence is dropped, EOD goes on the last sequence.
  const auto [code, log] =
      preprocess("sentences", "{\"text\": [\"ab\", \"\", \"c\"]}\n{\"text\": []}\n{\"text\": [\"d\"]}\n", "--append-eod");
  REQUIRE(code == 0);
  CHECK(read_file(kDir + "/sentences_text_document.idx") == megatron_idx_bytes(8, {2, 2, 2}, {0, 2, 2, 3}));
  CHECK(read_file(kDir + "/sentences_text_document.bin") == uint16_bytes({97, 98, 99, 256, 100, 256}));
  CHECK_THAT(log, Catch::Contains("3 documents, 3 sequences"));
  // --split-sentences needs NLTK's punkt model: refused, not silently ignored.
  const auto split = preprocess("split", "{\"text\": \"a. b.\"}\n", "--split-sentences");
  CHECK(split.first == 2);
  CHECK_THAT(split.second, Catch::Contains("--split-sentences is not implemented"));
}

TEST_CASE("preprocess_data as Megatron: several --json-keys give one file pair per key", "[data][cli]") {
  const auto [code, log] = preprocess(
      "keys", "{\"text\": \"ab\", \"title\": \"\"}\n{\"text\": \"\", \"title\": \"xyz\"}\n", "--json-keys text title --append-eod");
  REQUIRE(code == 0);
  CHECK(read_file(kDir + "/keys_text_document.idx") == megatron_idx_bytes(8, {3}, {0, 1, 1}));
  CHECK(read_file(kDir + "/keys_text_document.bin") == uint16_bytes({97, 98, 256}));
  CHECK(read_file(kDir + "/keys_title_document.idx") == megatron_idx_bytes(8, {4}, {0, 0, 1}));
  CHECK(read_file(kDir + "/keys_title_document.bin") == uint16_bytes({120, 121, 122, 256}));
}

TEST_CASE("empty and multi-sequence documents: samples are drawn over sequences, as Megatron's GPTDataset", "[data][cli]") {
  // The same sequences, once with empty documents and sentence lists, once one per line: Megatron
  // splits and samples by sequence, so both give the same samples.
  std::string with_empty, flat;
  for (int d = 0; d < 40; ++d) {
    const std::string a = "doc " + std::to_string(d) + " first part", b = "and " + std::to_string(d * 7) + " second";
    with_empty += "{\"text\": [\"" + a + "\", \"" + b + "\"]}\n{\"text\": \"\"}\n";
    flat += "{\"text\": \"" + a + "\"}\n{\"text\": \"" + b + "\"}\n";
  }
  REQUIRE(preprocess("seq-empty", with_empty, "").first == 0);
  REQUIRE(preprocess("seq-flat", flat, "").first == 0);
  CHECK(IndexedDataset(kDir + "/seq-empty_text_document").num_documents() == 80);
  CHECK(IndexedDataset(kDir + "/seq-flat_text_document").num_documents() == 80);
  auto dump = [&](const std::string& name) {
    return run_trainer("dataset_type=megatron dataset_path=" + kDir + "/" + name + "_text_document model_name=test-tiny "
                       "override_model_config=true vocab_size=258 pad_id=-1 eod_id=-1 max_target_length=8 steps=20 "
                       "per_device_batch_size=2 data_cache_path=" + kDir + "/cache-" + name + " --dump-samples 30");
  };
  const auto a = dump("seq-empty"), b = dump("seq-flat");
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  CHECK(std::count(a.output.begin(), a.output.end(), '\n') >= 30);
  const auto samples = [](const std::string& out) { return out.substr(out.find("{\"index\": 0")); };
  CHECK(samples(a.output) == samples(b.output));
}

TEST_CASE("preprocess_data streams: a corpus of several batches gives Megatron's bytes, and a late bad line leaves no file", "[data][cli]") {
  // 150,000 lines: more than two of the tool's batches (65,536 lines each), so documents cross
  // batch boundaries; every 7th text is empty (a document without a sequence).
  constexpr int kLines = 150000;
  std::string jsonl, bin;
  std::vector<int32_t> lengths;
  std::vector<int64_t> documents = {0};
  for (int i = 0; i < kLines; ++i) {
    const std::string text = i % 7 == 3 ? "" : "d" + std::to_string(i);
    jsonl += "{\"text\": \"" + text + "\"}\n";
    if (!text.empty()) {
      std::vector<int> tokens(text.begin(), text.end());
      tokens.push_back(256);  // <eod>
      bin += uint16_bytes(tokens);
      lengths.push_back(static_cast<int32_t>(tokens.size()));
    }
    documents.push_back(static_cast<int64_t>(lengths.size()));
  }
  const auto [code, log] = preprocess("stream", jsonl, "--append-eod --workers 2");
  REQUIRE(code == 0);
  CHECK_THAT(log, Catch::Contains("150000 documents"));
  CHECK(read_file(kDir + "/stream_text_document.idx") == megatron_idx_bytes(8, lengths, documents));
  CHECK(read_file(kDir + "/stream_text_document.bin") == bin);
  // A bad line in the third batch, after two batches were written: the line is named, the earlier
  // output under the same prefix is untouched and no temporary file is left behind.
  const std::string good_idx = read_file(kDir + "/stream_text_document.idx");
  std::string bad = jsonl;
  size_t at = 0;
  for (int line = 1; line < 140000; ++line) at = bad.find('\n', at) + 1;
  bad.insert(at, "{\"txt\": \"x\"}\n");  // becomes line 140000
  std::ofstream(kDir + "/stream-bad.jsonl", std::ios::binary) << bad;
  const auto failed = run_command(std::string(PREPROCESS_BINARY) + " --input " + kDir + "/stream-bad.jsonl --output-prefix " +
                                  kDir + "/stream --append-eod --workers 2");
  CHECK(failed.exit_code == 3);
  CHECK_THAT(failed.output, Catch::Contains("line 140000: no field \"text\""));
  CHECK(read_file(kDir + "/stream_text_document.idx") == good_idx);
  for (const auto& entry : fs::directory_iterator(kDir))
    CHECK(entry.path().filename().string().find(".partial-") == std::string::npos);
}

// preprocess_data started on a FIFO this test holds open with one JSON line written: the tool has
// created its temporary .bin and waits for more input until the writer end is closed.
struct PreprocessOnFifo {
  std::string prefix;
  int writer = -1;
  pid_t pid = -1;

  PreprocessOnFifo(const std::string& name, const std::string& json_line, bool ignore_sigint, ChildProcesses& children)
      : prefix(kDir + "/" + name) {
    const std::string fifo = prefix + ".fifo";
    fs::create_directories(kDir);
    fs::remove(fifo);
    REQUIRE(mkfifo(fifo.c_str(), 0644) == 0);
    writer = open(fifo.c_str(), O_RDWR | O_CLOEXEC);  // O_RDWR: does not wait for the reader
    REQUIRE(writer >= 0);
    REQUIRE(write(writer, json_line.data(), json_line.size()) == static_cast<ssize_t>(json_line.size()));
    pid = fork();
    if (pid == 0) {
      if (ignore_sigint) std::signal(SIGINT, SIG_IGN);  // inherited through exec
      const int log = open((prefix + ".log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(log, 1);
      dup2(log, 2);
      execl(PREPROCESS_BINARY, PREPROCESS_BINARY, "--input", fifo.c_str(), "--output-prefix", prefix.c_str(), nullptr);
      _exit(127);
    }
    children.add(pid);
  }
  ~PreprocessOnFifo() { end_input(); }
  std::string temporary(const char* extension) const {
    return prefix + "_text_document." + extension + ".partial-" + std::to_string(pid);
  }
  void end_input() {
    if (writer >= 0) close(writer);
    writer = -1;
  }
};

TEST_CASE("preprocess_data stopped by SIGINT or SIGTERM removes its temporary files", "[data][cli]") {
  // A long run stopped with Ctrl-C left .partial-<pid> files.
  for (const int signal_number : {SIGINT, SIGTERM}) {
    ChildProcesses children;
    PreprocessOnFifo run("interrupted-" + std::to_string(signal_number), "{\"text\": \"one line\"}\n", false, children);
    REQUIRE(wait_until([&] { return fs::exists(run.temporary("bin")); }, 60));
    kill(run.pid, signal_number);
    CHECK(children.wait(run.pid) == 128 + signal_number);  // ended by the signal, as without the handler
    run.end_input();
    CHECK_FALSE(fs::exists(run.temporary("bin")));
    CHECK_FALSE(fs::exists(run.temporary("idx")));
    CHECK_FALSE(fs::exists(run.prefix + "_text_document.bin"));
  }
  // A SIGINT the caller ignores (a shell starts background jobs so) stays ignored: the run goes on
  // and finishes when the input ends.
  ChildProcesses children;
  PreprocessOnFifo run("ignored", "{\"text\": \"kept\"}\n", true, children);
  REQUIRE(wait_until([&] { return fs::exists(run.temporary("bin")); }, 60));
  kill(run.pid, SIGINT);
  run.end_input();
  CHECK(children.wait(run.pid) == 0);
  CHECK(read_file(run.prefix + "_text_document.bin") == uint16_bytes({'k', 'e', 'p', 't'}));
}

TEST_CASE("a signal between the .bin and .idx renames still leaves a matching pair", "[data][cli]") {
  // The injector sends SIGTERM right after the .bin rename; it used to kill the run there, the
  // new .bin beside the old .idx. Now the signal waits for the .idx rename.
  fs::create_directories(kDir);
  write_bytes(kDir + "/pair-old.jsonl", "{\"text\": \"old\"}\n");
  write_bytes(kDir + "/pair-new.jsonl", "{\"text\": \"a longer new corpus\"}\n{\"text\": \"two\"}\n");
  const auto preprocess = [](const std::string& input, const std::string& prefix, const std::string& env) {
    return run_command("{ " + env + " " + PREPROCESS_BINARY + " --input " + kDir + "/" + input + " --output-prefix " +
                       kDir + "/" + prefix + "; echo exit=$?; }");
  };
  REQUIRE_THAT(preprocess("pair-new.jsonl", "pair-clean", "").output, Catch::Contains("exit=0"));
  REQUIRE_THAT(preprocess("pair-old.jsonl", "pair", "").output, Catch::Contains("exit=0"));
  const auto interrupted = preprocess("pair-new.jsonl", "pair", std::string("LD_PRELOAD=") + RENAME_THEN_SIGTERM_LIBRARY);
  CHECK_THAT(interrupted.output, Catch::Contains("exit=143"));  // still ended by the signal
  CHECK(read_file(kDir + "/pair_text_document.bin") == read_file(kDir + "/pair-clean_text_document.bin"));
  CHECK(read_file(kDir + "/pair_text_document.idx") == read_file(kDir + "/pair-clean_text_document.idx"));
  for (const auto& entry : fs::directory_iterator(kDir))
    CHECK(entry.path().filename().string().find("pair_text_document.idx.partial-") == std::string::npos);
}

TEST_CASE("preprocess_data fails with exit 3 naming the line where Megatron's script raises", "[data][cli]") {
  struct Case {
    const char* what;
    std::string jsonl;
    std::string args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"blank line (json.loads raises)", "{\"text\": \"a\"}\n\n{\"text\": \"b\"}\n", "", "line 2"},
      {"invalid UTF-8 (strict decoding)", "{\"text\": \"a\"}\n{\"text\": \"\xff\xfe\"}\n", "", "line 2"},
      {"missing key (KeyError)", "{\"text\": \"a\"}\n{\"body\": \"b\"}\n", "", "line 2: no field \"text\""},
      {"second key missing", "{\"text\": \"a\", \"t\": \"b\"}\n{\"text\": \"a\"}\n", "--json-keys text t",
       "line 2: no field \"t\""},
      {"a number, not text", "{\"text\": 7}\n", "", "line 1: field \"text\" is number"},
      {"a list holding a number", "{\"text\": [\"a\", 7]}\n", "", "line 1: field \"text\" is a list with a non-string"},
      {"not an object", "[1, 2]\n", "", "line 1: not a JSON object"},
      // nlohmann's parser stopped at the NUL and the rest of the line vanished, exit 0.
      {"a NUL byte", std::string("{\"text\": \"keep\"}") + '\0' + "{\"text\": \"lost\"}\n", "",
       "line 1: byte 17 is a NUL byte"},
      {"a byte-order mark", "{\"text\": \"a\"}\n\xEF\xBB\xBF{\"text\": \"b\"}\n", "", "line 2: starts with a UTF-8 byte-order mark"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    INFO(cases[i].what);
    const auto [code, log] = preprocess("bad" + std::to_string(i), cases[i].jsonl, cases[i].args + " --workers 2");
    CHECK(code == 3);
    CHECK_THAT(log, Catch::Contains(cases[i].message));
  }
  // A key named twice (both writers shared one temporary name: the files were written, then exit
  // 1) and an output that is the input (replaced silently): refused before any work.
  const auto twice = preprocess("twice", "{\"text\": \"a\"}\n", "--json-keys text text");
  CHECK(twice.first == 2);
  CHECK_THAT(twice.second, Catch::Contains("--json-keys names \"text\" twice"));
  CHECK_FALSE(fs::exists(kDir + "/twice_text_document.bin"));
  const std::string self = kDir + "/self_text_document.bin";
  std::ofstream(self) << "{\"text\": \"a\"}\n";
  const auto overwrite = run_command(std::string(PREPROCESS_BINARY) + " --input " + self + " --output-prefix " + kDir + "/self");
  CHECK(overwrite.exit_code == 2);
  CHECK_THAT(overwrite.output, Catch::Contains("would overwrite the --input " + self));
  CHECK(read_file(self) == "{\"text\": \"a\"}\n");
  // An output prefix with no file stem wrote "_text_document.*" into the working directory or the folder.
  for (const std::string prefix : {kDir + "/", kDir + "/."}) {
    const auto stemless = run_command(std::string(PREPROCESS_BINARY) + " --input " + self + " --output-prefix " + prefix);
    CHECK(stemless.exit_code == 2);
    CHECK_THAT(stemless.output, Catch::Contains("must end in a file name stem"));
  }
  CHECK_FALSE(fs::exists(kDir + "/_text_document.bin"));
  CHECK_FALSE(fs::exists(kDir + "/._text_document.bin"));
  // A directory as --input (it opens as a stream that reads nothing) and a thread count out of range.
  const auto dir = run_command(std::string(PREPROCESS_BINARY) + " --input " + kDir + " --output-prefix " + kDir + "/fromdir");
  CHECK(dir.exit_code == 3);
  CHECK_THAT(dir.output, Catch::Contains("--input " + kDir + " is a directory"));
  CHECK_FALSE(fs::exists(kDir + "/fromdir_text_document.idx"));
  for (const std::string workers : {"0", "100000"}) {
    const auto [code, log] = preprocess("workers" + workers, "{\"text\": \"a\"}\n", "--workers " + workers);
    CHECK(code == 2);
    CHECK_THAT(log, Catch::Contains("--workers") && Catch::Contains("not in range") && Catch::Contains("1024"));  // CLI11 words the range by version
  }
}

TEST_CASE("indexed_dataset_write refuses tokens that do not fit the dtype", "[data]") {
  fs::create_directories(kDir);
  try {
    indexed_dataset_write(kDir + "/toolarge", {{1, 2}, {3, 70000}}, 8);
    FAIL("wrote token 70000 as uint16");
  } catch (const Error& e) {
    CHECK(e.exit_code() == kExitData);
    CHECK_THAT(e.what(), Catch::Contains("document 1") && Catch::Contains("70000") && Catch::Contains("uint16"));
  }
  indexed_dataset_write(kDir + "/int32ok", {{1, 70000}}, 4);
  std::vector<int64_t> tokens;
  IndexedDataset(kDir + "/int32ok").read(0, 0, 2, tokens);
  CHECK(tokens == std::vector<int64_t>{1, 70000});
}

TEST_CASE("dump-samples prints the first samples in global order", "[data][cli]") {
  const auto& g = reference()["gpt"][0];
  corpus_config(g, "dump");
  const std::string args = "dataset_type=megatron dataset_path=" + kDir + "/dump split=969,30,1 model_name=test-tiny "
                           "override_model_config=true vocab_size=4096 pad_id=-1 eod_id=-1 max_target_length=8 "
                           "data_shuffle_seed=1234 steps=30 per_device_batch_size=1 data_cache_path=" + kDir + "/cache-dump ";
  // stdout alone: the samples and nothing else (the log goes to stderr), so it can be piped to a parser.
  const auto r = run_command("( " + std::string(TRAINER_BINARY) + " " + source_path("configs/base.yml") + " " + args +
                             "--dump-samples 5 2> /dev/null )");
  REQUIRE(r.exit_code == 0);
  std::istringstream lines(r.output);
  int64_t i = 0;
  for (std::string line; std::getline(lines, line); ++i) {
    INFO(line);
    const auto j = nlohmann::json::parse(line);
    CHECK(j["index"] == i);
    CHECK(j["tokens"] == g["samples"][i]);
    CHECK(j["loss_mask"] == std::vector<int>(8, 1));  // no pad, no EOD masking
  }
  CHECK(i == 5);
  // More samples than the run reads (steps x global_batch_size): a usage error before any is printed.
  const auto over = run_trainer(args + "--dump-samples 31");
  CHECK(over.exit_code == 2);
  CHECK_THAT(over.output, Catch::Contains("--dump-samples 31: the run reads 30 samples (steps 30 x global_batch_size 1); raise steps"));
  CHECK_THAT(over.output, !Catch::Contains("{\"index\""));
}

TEST_CASE("evaluation on the validation split: token-mean lm_loss and perplexity in the metrics file", "[data][cli]") {
  fs::create_directories(kDir);
  std::vector<std::vector<int64_t>> docs;
  for (int d = 0; d < 100; ++d) {
    std::vector<int64_t> doc;
    for (int t = 0; t < 20; ++t) doc.push_back((d + t) % 60);
    docs.push_back(doc);
  }
  indexed_dataset_write(kDir + "/evalcorpus", docs, 8);
  fs::remove_all(kDir + "/evalrun");
  const auto r = run_trainer("dataset_type=megatron dataset_path=" + kDir + "/evalcorpus split=80,20,0 model_name=test-tiny "
                             "pad_id=-1 eod_id=-1 max_target_length=8 per_device_batch_size=2 steps=6 eval_interval=3 "
                             "eval_steps=2 data_cache_path=" + kDir + "/cache-eval base_output_directory=" + kDir +
                             " run_name=evalrun");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.output, Catch::Contains("eval after step 2: lm_loss") && Catch::Contains("eval after step 5") &&
                          Catch::Contains("eval (after training) after step 5"));
  // split 80,20,0: no test split, so no test evaluation after training (as Megatron), and it says so.
  CHECK_THAT(r.output, Catch::Contains("no evaluation on the test split after training: " + kDir +
                                       "/evalcorpus: split \"80,20,0\" leaves the test split no sequences (of 100)"));
  CHECK_THAT(read_file(kDir + "/evalrun/metrics.jsonl"), !Catch::Contains("test/"));
  // As Megatron: one every eval_interval steps and one after training, each on the next
  // eval_steps global batches of the validation split (its (6 / 3 + 1) groups).
  std::vector<std::string> evals;
  for (const auto& line : read_lines(kDir + "/evalrun/metrics.jsonl"))
    if (line.find("eval/lm_loss") != std::string::npos) evals.push_back(line);
  REQUIRE(evals.size() == 3);
  CHECK(json_metric(evals[0], "step") == 2);
  CHECK(json_metric(evals[1], "step") == 5);
  CHECK(json_metric(evals[2], "step") == 5);
  for (size_t g = 0; g < 3; ++g) CHECK(json_metric(evals[g], "eval/group") == static_cast<double>(g));
  CHECK(json_metric(evals[2], "eval/lm_loss") != json_metric(evals[1], "eval/lm_loss"));  // other samples, same weights
  CHECK(json_metric(evals[0], "eval/total_weights") == 2 * 2 * 8);  // eval_steps x batch x L, no masks
  CHECK(json_metric(evals[1], "eval/perplexity") == Approx(std::exp(json_metric(evals[1], "eval/lm_loss"))));

  // In process: the evaluation from global batch 2 is the token mean of the CE over those batches,
  // recomputed here from the model's logits on the validation samples.
  Trainer t(tiny_config({"dataset_type=megatron", "dataset_path=" + kDir + "/evalcorpus", "split=80,20,0", "pad_id=-1",
                         "eod_id=-1", "max_target_length=8", "per_device_batch_size=2", "gradient_accumulation_steps=2",
                         "steps=6", "eval_interval=3", "eval_steps=2", "data_cache_path=" + kDir + "/cache-eval"}));
  const auto values = t.evaluate(DataSplit::kValid, 2).value();
  const DataLoader valid(t.config(), 0, megatron_source(t.config(), DataSplit::kValid, (6 / 3 + 1) * 2 * 4));
  torch::NoGradGuard no_grad;
  double ce = 0, count = 0;
  for (int64_t step = 2; step < 4; ++step)  // evaluation 1 reads global batches 2 and 3
    for (int64_t m = 0; m < 2; ++m) {
      const auto b = valid.data_loader_next(step, m);
      const auto shape = std::vector<int64_t>{b.batch_size, b.seq_len};
      const auto logits = t.model()->forward(torch::tensor(b.inputs).view(shape), torch::tensor(b.positions).view(shape),
                                             torch::tensor(b.segment_ids).view(shape)).logits.to(torch::kFloat64);
      const auto logp = torch::log_softmax(logits, -1).gather(-1, torch::tensor(b.targets).view(shape).unsqueeze(-1));
      ce -= logp.sum().item<double>();
      count += static_cast<double>(b.batch_size * b.seq_len);
    }
  CHECK(metric_get(values, "eval/lm_loss") == Approx(ce / count).epsilon(1e-5));
  CHECK(metric_get(values, "eval/total_weights") == count);

  // A split with no validation documents stops the run before its first step (it used to train
  // eval_interval steps first, and fail again after each resume).
  fs::remove_all(kDir + "/evalnone");
  const auto none = run_trainer("dataset_type=megatron dataset_path=" + kDir + "/evalcorpus split=100,0,0 model_name=test-tiny "
                                "pad_id=-1 eod_id=-1 max_target_length=8 per_device_batch_size=2 steps=6 eval_interval=3 "
                                "data_cache_path=" + kDir + "/cache-eval base_output_directory=" + kDir + " run_name=evalnone");
  INFO(none.output);
  CHECK(none.exit_code == 3);
  CHECK_THAT(none.output, Catch::Contains("valid split"));
  CHECK(read_lines(kDir + "/evalnone/metrics.jsonl").empty());
  // Validation sequences that are all empty documents: the message names the file and the split
  // (it read "the data split has 0 tokens", naming neither).
  std::vector<std::vector<int64_t>> empty_tail(docs.begin(), docs.begin() + 80);
  empty_tail.resize(100);
  indexed_dataset_write(kDir + "/evalempty", empty_tail, 8);
  const auto empty = run_trainer("dataset_type=megatron dataset_path=" + kDir + "/evalempty split=80,20,0 model_name=test-tiny "
                                 "pad_id=-1 eod_id=-1 max_target_length=8 per_device_batch_size=2 steps=6 eval_interval=3 "
                                 "data_cache_path=" + kDir + "/cache-eval base_output_directory=" + kDir + " run_name=evalempty");
  INFO(empty.output);
  CHECK(empty.exit_code == 3);
  CHECK_THAT(empty.output, Catch::Contains(kDir + "/evalempty: the valid split (split \"80,20,0\", 20 sequences): "
                                           "the data split has 0 tokens; at least 2 are needed"));
  // The same empty tail as the test split: only the test evaluation after training is lost, with
  // the reason; the run trains and evaluates on its validation split.
  const auto empty_test = run_trainer("dataset_type=megatron dataset_path=" + kDir + "/evalempty split=60,20,20 "
                                      "model_name=test-tiny pad_id=-1 eod_id=-1 max_target_length=8 per_device_batch_size=2 "
                                      "steps=6 eval_interval=3 data_cache_path=" + kDir + "/cache-eval base_output_directory=" +
                                      kDir + " run_name=evalemptytest");
  INFO(empty_test.output);
  CHECK(empty_test.exit_code == 0);
  CHECK_THAT(empty_test.output, Catch::Contains("no evaluation on the test split after training: " + kDir +
                                                "/evalempty: the test split (split \"60,20,20\", 20 sequences): the data "
                                                "split has 0 tokens"));
  const std::string metrics = read_file(kDir + "/evalemptytest/metrics.jsonl");
  CHECK_THAT(metrics, Catch::Contains("eval/lm_loss") && !Catch::Contains("test/"));
}

namespace {
// Synthetic samples, except that sample `bad` throws, as a corrupt file would.
class FailingSource : public SampleSource {
 public:
  FailingSource(const Config& c, int64_t bad) : synthetic_(c), bad_(bad) {}
  void fill_row(int64_t index, MicroBatch& batch, int64_t row) const override {
    if (index == bad_) throw Error(kExitData, "sample " + std::to_string(index) + " is unreadable");
    synthetic_.fill_row(index, batch, row);
  }

 private:
  SyntheticDataset synthetic_;
  int64_t bad_;
};
}  // namespace

TEST_CASE("the prefetcher serves the loader's micro-batches in order for any queue depth and passes errors on", "[data]") {
  // K = 3 micro-batches of 2 rows per step; steps 1..4 (a resume at step 1). Depths below, at and
  // above K, odd and even: the refill-at-half rule must neither reorder, skip nor stall.
  const Config c = tiny_config({"gradient_accumulation_steps=3", "per_device_batch_size=2", "steps=5"});
  const DataLoader loader(c, 0);
  for (size_t depth : {1, 2, 3, 5, 6, 7}) {
    INFO("depth " << depth);
    DataPrefetcher prefetcher(loader, 1, 5, 3, depth);
    double waited = 0;
    for (int64_t step = 1; step < 5; ++step)
      for (int64_t micro = 0; micro < 3; ++micro) {
        const MicroBatch got = prefetcher.data_prefetcher_next(step, micro, &waited);
        const MicroBatch want = loader.data_loader_next(step, micro);
        CHECK(got.sample_indices == want.sample_indices);
        CHECK(got.inputs == want.inputs);
        CHECK(got.targets == want.targets);
        CHECK(got.loss_mask == want.loss_mask);
        CHECK(got.positions == want.positions);
      }
  }
  {  // Out of order is a bug in the caller, not a silent wrong batch.
    DataPrefetcher prefetcher(loader, 0, 5, 3, 6);
    CHECK_THROWS_AS(prefetcher.data_prefetcher_next(0, 1, nullptr), std::logic_error);
  }
  {  // Destroyed with a full queue and a producer asleep, or before reading anything: returns.
    DataPrefetcher full(loader, 0, 5, 3, 2);
    CHECK(full.data_prefetcher_next(0, 0, nullptr).sample_indices == loader.data_loader_next(0, 0).sample_indices);
    DataPrefetcher unread(loader, 0, 5, 3, 4);
  }
  // A loader error reaches the consumer at the micro-batch that needs it, after the good ones.
  // Global sample 7 is row 1 of micro-batch 0 of step 1 (K * B = 6 samples per step).
  const DataLoader failing(c, 0, std::make_shared<FailingSource>(c, 7));
  DataPrefetcher prefetcher(failing, 0, 5, 3, 6);
  for (int64_t micro = 0; micro < 3; ++micro)
    CHECK(prefetcher.data_prefetcher_next(0, micro, nullptr).sample_indices == loader.data_loader_next(0, micro).sample_indices);
  try {
    prefetcher.data_prefetcher_next(1, 0, nullptr);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.exit_code() == kExitData);
    CHECK(std::string(e.what()).find("sample 7 is unreadable") != std::string::npos);
  }
}
