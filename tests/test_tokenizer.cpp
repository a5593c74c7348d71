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
  fs::create_directories(kDir);
  {
    std::ofstream raw(kDir + "/train.txt"), jsonl(kDir + "/docs.jsonl");
    for (const auto& t : texts()) {
      raw << t << "\n";
      jsonl << nlohmann::json({{"text", t}}).dump() << "\n";
    }
  }
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
    sp.Encode(texts()[static_cast<size_t>(d)], &ids);
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
}
