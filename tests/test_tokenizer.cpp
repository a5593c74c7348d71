// Tokenizers and preprocess_data with SentencePiece. A separate test executable without LibTorch
// (Debian's libsentencepiece and libtorch cannot share a process: clashing protobuf registrations).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include "trainer/data/indexed_dataset.h"
#include "trainer/data/tokenizer.h"
#include "trainer/util/error.h"

namespace fs = std::filesystem;
using namespace trainer;

namespace {
// This process's own folder, removed at exit (no fixed /tmp path shared with another suite).
struct TemporaryRoot {
  std::string path = "/tmp/trainer-tests-tokenizer-XXXXXX";
  TemporaryRoot() {
    if (!mkdtemp(path.data())) throw std::runtime_error("mkdtemp failed");
  }
  ~TemporaryRoot() { fs::remove_all(path); }
};
const TemporaryRoot kRoot;
const std::string kDir = kRoot.path;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<std::string> texts() {
  std::vector<std::string> out;
  const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "trainer", "loss", "gradient"};
  for (int i = 0; i < 400; ++i) {
    std::string t;
    for (int w = 0; w < 8 + i % 5; ++w) t += std::string(words[(i * 7 + w * 3) % 11]) + (w % 4 == 3 ? ". " : " ");
    out.push_back(t);
  }
  return out;
}
// texts() under kDir as plain lines (a SentencePiece training input) and as JSON lines.
void write_texts(const std::string& raw_name, const std::string& jsonl_name) {
  fs::create_directories(kDir);
  std::ofstream raw(kDir + "/" + raw_name), jsonl(kDir + "/" + jsonl_name);
  for (const auto& t : texts()) {
    raw << t << "\n";
    jsonl << nlohmann::json({{"text", t}}).dump() << "\n";
  }
}
}  // namespace

TEST_CASE("byte tokenizer: UTF-8 bytes, <eod> 256, vocabulary 258", "[tokenizer]") {
  const auto tok = tokenizer_create("byte", "");
  CHECK(tok->tokenizer_encode("a\xc3\xa9") == std::vector<int64_t>{97, 0xc3, 0xa9});
  CHECK(tok->tokenizer_eod() == 256);
  CHECK(tok->tokenizer_vocab_size() == 258);
  try {
    tokenizer_create("wordpiece", "");
    FAIL("accepted an unknown tokenizer");
  } catch (const Error& e) {
    CHECK(e.exit_code() == kExitUsage);
  }
}

TEST_CASE("preprocess_data with a SentencePiece model matches the library's encoding", "[tokenizer]") {
  write_texts("train.txt", "docs.jsonl");
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + kDir + "/train.txt --model_prefix=" + kDir + "/spm --vocab_size=60 --model_type=bpe "
      "--minloglevel=2");
  REQUIRE(status.ok());
  const std::string cmd = std::string(PREPROCESS_BINARY) + " --input " + kDir + "/docs.jsonl --output-prefix " + kDir +
                          "/sp --tokenizer-type sentencepiece --tokenizer-model " + kDir +
                          "/spm.model --append-eod --workers 2 2>&1";
  const int rc = std::system(cmd.c_str());
  REQUIRE(WEXITSTATUS(rc) == 0);
  sentencepiece::SentencePieceProcessor sp;
  REQUIRE(sp.Load(kDir + "/spm.model").ok());
  IndexedDataset data(kDir + "/sp_text_document");
  REQUIRE(data.num_documents() == 400);
  CHECK(data.dtype_code() == 8);  // vocabulary 60 < 65500: uint16
  for (int64_t d : {0, 17, 399}) {
    std::vector<int> ids;
    REQUIRE(sp.Encode(texts()[static_cast<size_t>(d)], &ids).ok());
    std::vector<int64_t> expected(ids.begin(), ids.end());
    expected.push_back(sp.eos_id());
    std::vector<int64_t> got;
    data.read(d, 0, data.sequence_length(d), got);
    CHECK(got == expected);
  }
  const int missing = std::system((std::string(PREPROCESS_BINARY) + " --input " + kDir + "/docs.jsonl --output-prefix " +
                                   kDir + "/x --tokenizer-type sentencepiece --tokenizer-model " + kDir +
                                   "/nope.model 2>/dev/null").c_str());
  CHECK(WEXITSTATUS(missing) == 2);
  // Megatron's other names for the same SentencePiece encoding write the same bytes.
  for (const std::string type : {"GPTSentencePieceTokenizer", "Llama2Tokenizer"}) {
    const int alias = std::system((std::string(PREPROCESS_BINARY) + " --input " + kDir + "/docs.jsonl --output-prefix " +
                                   kDir + "/" + type + " --tokenizer-type " + type + " --tokenizer-model " + kDir +
                                   "/spm.model --append-eod 2>&1").c_str());
    REQUIRE(WEXITSTATUS(alias) == 0);
    CHECK(read_file(kDir + "/" + type + "_text_document.bin") == read_file(kDir + "/sp_text_document.bin"));
    CHECK(read_file(kDir + "/" + type + "_text_document.idx") == read_file(kDir + "/sp_text_document.idx"));
  }
  // An output directory that does not exist is the command line's error (it was exit 1).
  const int no_dir = std::system((std::string(PREPROCESS_BINARY) + " --input " + kDir + "/docs.jsonl --output-prefix " +
                                  kDir + "/no-such-dir/x 2>/dev/null").c_str());
  CHECK(WEXITSTATUS(no_dir) == 2);
  // A directory for the model, and a model without --tokenizer-type (the byte tokenizer would
  // have ignored it and written byte ids): exit 2 naming the flag.
  for (const std::string flags : {"--tokenizer-type sentencepiece --tokenizer-model " + kDir,
                                  "--tokenizer-model " + kDir + "/spm.model"}) {
    const std::string cmd = std::string(PREPROCESS_BINARY) + " --input " + kDir + "/docs.jsonl --output-prefix " + kDir +
                            "/y " + flags + " 2>&1";
    std::string output;
    FILE* pipe = popen(cmd.c_str(), "r");
    REQUIRE(pipe != nullptr);
    for (char buffer[512]; std::fgets(buffer, sizeof buffer, pipe);) output += buffer;
    const int status = pclose(pipe);
    INFO(flags << ": " << output);
    CHECK(WEXITSTATUS(status) == 2);
    CHECK_THAT(output, Catch::Contains("--tokenizer-model " + kDir));
    CHECK_FALSE(fs::exists(kDir + "/y_text_document.bin"));
  }
}

TEST_CASE("preprocess_data: a SentencePiece model without </s> serves unless --append-eod needs it", "[tokenizer]") {
  write_texts("noeos.txt", "noeos.jsonl");
  REQUIRE(sentencepiece::SentencePieceTrainer::Train("--input=" + kDir + "/noeos.txt --model_prefix=" + kDir +
                                                     "/noeos --vocab_size=60 --model_type=bpe --eos_id=-1 --minloglevel=2")
              .ok());
  sentencepiece::SentencePieceProcessor sp;
  REQUIRE(sp.Load(kDir + "/noeos.model").ok());
  REQUIRE(sp.eos_id() < 0);
  const auto run = [](const std::string& prefix, const std::string& more) {
    const std::string cmd = std::string(PREPROCESS_BINARY) + " --input " + kDir + "/noeos.jsonl --output-prefix " + kDir +
                            "/" + prefix + " --tokenizer-type sentencepiece --tokenizer-model " + kDir + "/noeos.model" +
                            more + " 2>&1";
    std::string output;
    FILE* pipe = popen(cmd.c_str(), "r");
    REQUIRE(pipe != nullptr);
    for (char buffer[512]; std::fgets(buffer, sizeof buffer, pipe);) output += buffer;
    return std::make_pair(WEXITSTATUS(pclose(pipe)), output);
  };
  // It was refused whether or not <eod> was asked for.
  const auto plain = run("noeos", "");
  INFO(plain.second);
  REQUIRE(plain.first == 0);
  IndexedDataset data(kDir + "/noeos_text_document");
  std::vector<int> ids;
  REQUIRE(sp.Encode(texts()[5], &ids).ok());
  std::vector<int64_t> got;
  data.read(5, 0, data.sequence_length(5), got);
  CHECK(got == std::vector<int64_t>(ids.begin(), ids.end()));
  const auto eod = run("noeos-eod", " --append-eod");
  CHECK(eod.first == 2);
  CHECK_THAT(eod.second, Catch::Contains("--append-eod: --tokenizer-model " + kDir + "/noeos.model has no </s> (eos) piece"));
  CHECK_FALSE(fs::exists(kDir + "/noeos-eod_text_document.bin"));
}

// Appends the UTF-8 encoding of code point `cp` to `out`.
static void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

TEST_CASE("preprocess_data with a vocabulary of 66000 writes int32 tokens, as Megatron", "[tokenizer]") {
  // A character-level SentencePiece model over 70000 distinct CJK characters (basic block,
  // extensions A and B): 66000 pieces, so ids above 65535 occur and Megatron's rule
  // (vocab >= 65500 -> int32) must pick int32, with every id stored unclipped.
  std::vector<uint32_t> code_points;
  for (uint32_t cp = 0x4E00; cp <= 0x9FFF; ++cp) code_points.push_back(cp);
  for (uint32_t cp = 0x3400; cp <= 0x4DBF; ++cp) code_points.push_back(cp);
  for (uint32_t cp = 0x20000; code_points.size() < 70000; ++cp) code_points.push_back(cp);
  std::vector<std::string> lines;  // 140 lines of 500 characters, every character once
  for (size_t i = 0; i < code_points.size(); i += 500) {
    std::string line;
    for (size_t j = i; j < i + 500; ++j) append_utf8(line, code_points[j]);
    lines.push_back(line);
  }
  const std::string dir = kDir + "/int32";
  fs::create_directories(dir);
  {
    std::ofstream raw(dir + "/train.txt"), jsonl(dir + "/docs.jsonl");
    for (const auto& line : lines) raw << line << "\n";
    for (const auto& line : lines) jsonl << nlohmann::json({{"text", line}}).dump() << "\n";
  }
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + dir + "/train.txt --model_prefix=" + dir + "/spm --vocab_size=66000 --model_type=char "
      "--character_coverage=1.0 --minloglevel=2");
  REQUIRE(status.ok());
  sentencepiece::SentencePieceProcessor sp;
  REQUIRE(sp.Load(dir + "/spm.model").ok());
  REQUIRE(sp.GetPieceSize() == 66000);
  const std::string cmd = std::string(PREPROCESS_BINARY) + " --input " + dir + "/docs.jsonl --output-prefix " + dir +
                          "/sp --tokenizer-type sentencepiece --tokenizer-model " + dir + "/spm.model --append-eod 2>&1";
  REQUIRE(WEXITSTATUS(std::system(cmd.c_str())) == 0);
  IndexedDataset data(dir + "/sp_text_document");
  REQUIRE(data.num_documents() == static_cast<int64_t>(lines.size()));
  CHECK(data.dtype_code() == 4);  // int32
  int largest = 0;
  for (int64_t d = 0; d < data.num_documents(); ++d) {
    std::vector<int> ids;
    REQUIRE(sp.Encode(lines[static_cast<size_t>(d)], &ids).ok());
    std::vector<int64_t> expected(ids.begin(), ids.end());
    expected.push_back(sp.eos_id());
    for (int id : ids) largest = std::max(largest, id);
    std::vector<int64_t> got;
    data.read(d, 0, data.sequence_length(d), got);
    INFO("document " << d);
    REQUIRE(got == expected);
  }
  CHECK(largest > 65535);  // the ids a uint16 file would have wrapped
  // The .bin is 4 bytes per token.
  int64_t tokens = 0;
  for (int64_t d = 0; d < data.num_documents(); ++d) tokens += data.sequence_length(d);
  CHECK(static_cast<int64_t>(fs::file_size(dir + "/sp_text_document.bin")) == 4 * tokens);
}
