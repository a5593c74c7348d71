// Byte and SentencePiece tokenizers (see tokenizer.h).
#include "trainer/data/tokenizer.h"

#if TRAINER_WITH_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

#include <filesystem>
#include <stdexcept>

#include "trainer/util/error.h"

namespace trainer {
namespace {

class ByteTokenizer : public Tokenizer {
 public:
  std::vector<int64_t> tokenizer_encode(const std::string& text) const override {
    std::vector<int64_t> ids;
    ids.reserve(text.size());
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  int64_t tokenizer_vocab_size() const override { return 258; }
  int64_t tokenizer_eod() const override { return 256; }
};

#if TRAINER_WITH_SENTENCEPIECE
class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& model) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(model, ec))
      throw config_error("--tokenizer-model " + model + ": " + (std::filesystem::exists(model, ec) ? "not a file" : "no such file"));
    std::string failure;
    try {
      const auto status = processor_.Load(model);
      if (!status.ok()) failure = status.ToString();
    } catch (const std::exception& e) {  // the library's stream errors
      failure = std::string("cannot read it as a SentencePiece model: ") + e.what();
    }
    if (!failure.empty()) throw config_error("--tokenizer-model " + model + ": " + failure);
  }
  std::vector<int64_t> tokenizer_encode(const std::string& text) const override {
    std::vector<int> ids;
    // A failed Encode leaves ids empty: unchecked, the document would vanish from the output.
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok()) throw std::runtime_error("SentencePiece cannot encode it: " + status.ToString());
    return std::vector<int64_t>(ids.begin(), ids.end());
  }
  int64_t tokenizer_vocab_size() const override { return processor_.GetPieceSize(); }
  int64_t tokenizer_eod() const override { return processor_.eos_id(); }

 private:
  sentencepiece::SentencePieceProcessor processor_;
};
#endif

}  // namespace

std::unique_ptr<Tokenizer> tokenizer_create(const std::string& type, const std::string& model) {
  if (type == "byte" || type == "ByteTokenizer") {
    // Most likely a forgotten --tokenizer-type: tokenizing by bytes would silently ignore the model.
    if (!model.empty())
      throw config_error("--tokenizer-model " + model + " was given, but the tokenizer is '" + type +
                         "', which has no model; add --tokenizer-type sentencepiece");
    return std::make_unique<ByteTokenizer>();
  }
  // Megatron's three SentencePiece types encode alike (megatron/core/tokenizers: one wrapper,
  // encode_as_ids, no BOS, eod = eos_id(); the pre-2025 megatron/training/tokenizer classes differed).
  if (type == "sentencepiece" || type == "SentencePieceTokenizer" || type == "GPTSentencePieceTokenizer" ||
      type == "Llama2Tokenizer") {
    if (model.empty()) throw config_error("--tokenizer-type sentencepiece needs --tokenizer-model");
#if TRAINER_WITH_SENTENCEPIECE
    return std::make_unique<SentencePieceTokenizer>(model);
#else
    throw config_error("--tokenizer-type sentencepiece: this build has no SentencePiece (TRAINER_WITH_SENTENCEPIECE=OFF)");
#endif
  }
  throw config_error("--tokenizer-type '" + type + "' is not supported (byte, or sentencepiece = SentencePieceTokenizer, "
                     "GPTSentencePieceTokenizer, Llama2Tokenizer)");
}

}  // namespace trainer
