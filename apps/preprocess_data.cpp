// preprocess_data: JSON lines -> Megatron <prefix>_<key>_document.bin/.idx (Megatron-LM's
// tools/preprocess_data.py flags where they exist). Output is identical for any --workers.
#include <atomic>
#include <mutex>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "trainer/data/indexed_dataset.h"
#include "trainer/data/tokenizer.h"
#include "trainer/util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"preprocess_data: JSON lines -> Megatron .bin/.idx"};
  std::string input, output_prefix, tokenizer_type = "byte", tokenizer_model;
  std::vector<std::string> json_keys = {"text"};
  bool append_eod = false;
  int workers = 1;
  app.add_option("--input", input, "JSON lines file, one document per line")->required();
  app.add_option("--output-prefix", output_prefix, "writes <prefix>_<key>_document.bin/.idx")->required();
  app.add_option("--json-keys", json_keys, "keys to extract (default: text)");
  app.add_option("--tokenizer-type", tokenizer_type, "byte | sentencepiece");
  app.add_option("--tokenizer-model", tokenizer_model, "SentencePiece .model file");
  app.add_flag("--append-eod", append_eod, "append <eod> to every document");
  app.add_option("--workers", workers, "tokenizer threads")->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : trainer::kExitUsage;
  }
  try {
    const auto tokenizer = trainer::tokenizer_create(tokenizer_type, tokenizer_model);
    std::ifstream in(input);
    if (!in) throw trainer::Error(trainer::kExitData, "cannot open --input " + input);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) lines.push_back(std::move(line));
    const auto start = std::chrono::steady_clock::now();
    // One output per key; documents keep input order because each worker fills its own slots.
    std::vector<std::vector<std::vector<int64_t>>> docs(json_keys.size(), std::vector<std::vector<int64_t>>(lines.size()));
    std::atomic<size_t> next{0}, done{0}, bytes{0};
    std::atomic<bool> failed{false};
    std::string error;
    std::mutex error_mutex;
    auto work = [&] {
      for (size_t i; !failed && (i = next.fetch_add(1)) < lines.size();) {
        try {
          const auto j = nlohmann::json::parse(lines[i]);
          for (size_t k = 0; k < json_keys.size(); ++k) {
            if (!j.contains(json_keys[k]) || !j[json_keys[k]].is_string())
              throw std::runtime_error("no string field \"" + json_keys[k] + "\"");
            const std::string& text = j[json_keys[k]].get_ref<const std::string&>();
            bytes += text.size();
            auto ids = tokenizer->tokenizer_encode(text);
            if (append_eod) ids.push_back(tokenizer->tokenizer_eod());
            docs[k][i] = std::move(ids);
          }
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(error_mutex);
          failed = true;
          error = input + ": line " + std::to_string(i + 1) + ": " + e.what();
        }
        if (++done % 10000 == 0) {
          const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          std::fprintf(stderr, "preprocess_data: %zu / %zu documents, %.1f MB/s\n", done.load(), lines.size(),
                       bytes / 1e6 / s);
        }
      }
    };
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w) threads.emplace_back(work);
    for (auto& t : threads) t.join();
    if (failed) throw trainer::Error(trainer::kExitData, error);
    const uint8_t dtype = tokenizer->tokenizer_vocab_size() < 65500 ? 8 : 4;  // uint16 or int32, as Megatron
    for (size_t k = 0; k < json_keys.size(); ++k) {
      const std::string prefix = output_prefix + "_" + json_keys[k] + "_document";
      trainer::indexed_dataset_write(prefix, docs[k], dtype);
      size_t tokens = 0;
      for (const auto& d : docs[k]) tokens += d.size();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "preprocess_data: wrote %s.bin/.idx: %zu documents, %zu tokens (%s), %.2f s, %.1f MB/s of text\n",
                   prefix.c_str(), docs[k].size(), tokens, dtype == 8 ? "uint16" : "int32", s, bytes / 1e6 / s);
    }
    return trainer::kExitOk;
  } catch (const trainer::Error& e) {
    std::fprintf(stderr, "preprocess_data: error: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "preprocess_data: error: %s\n", e.what());
    return trainer::kExitFailure;
  }
}
