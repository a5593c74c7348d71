// Tokenizers for apps/preprocess_data: byte-level (256 byte ids + <eod> + <pad>) and
// SentencePiece (Debian's libsentencepiece).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace trainer {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int64_t> tokenizer_encode(const std::string& text) const = 0;
  virtual int64_t tokenizer_vocab_size() const = 0;
  virtual int64_t tokenizer_eod() const = 0;  // -1: the model has none (only --append-eod needs it)
};

// type "byte": ids 0-255 are the UTF-8 bytes, 256 = <eod>, 257 = <pad>; vocabulary 258.
// type "sentencepiece": `model` is a SentencePiece .model file; <eod> is its </s> (eos) id.
// Throws trainer::Error (exit 2) for an unknown type or an unreadable model.
std::unique_ptr<Tokenizer> tokenizer_create(const std::string& type, const std::string& model);

}  // namespace trainer
