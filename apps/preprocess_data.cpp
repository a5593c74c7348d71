// preprocess_data: JSON lines -> Megatron <prefix>_<key>_document.bin/.idx, byte for byte what
// Megatron-LM's tools/preprocess_data.py writes with the same tokens (its flags where they exist;
// the rules per case are in encode_document below and docs/data.md). Output is identical for any
// --workers. The input is streamed in batches: memory holds a batch, not the corpus.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "trainer/data/indexed_dataset.h"
#include "trainer/data/tokenizer.h"
#include "trainer/util/error.h"

namespace {

// Megatron's Encoder.encode for one key of one JSON line (tools/preprocess_data.py at d98e8a64):
// the value is a string (one sentence) or a list of strings (sentences); each sentence that
// tokenizes to at least one token becomes one sequence, empty ones are dropped; <eod> is appended
// to the last sequence only when the document has a token at all. So empty text gives a document
// with no sequence (the document index still advances), never a lone <eod>.
trainer::IndexedDocument encode_document(const nlohmann::json& value, const std::string& key,
                                         const trainer::Tokenizer& tokenizer, bool append_eod, size_t& bytes) {
  std::vector<const std::string*> sentences;
  if (value.is_string()) {
    sentences.push_back(&value.get_ref<const std::string&>());
  } else if (value.is_array()) {
    for (const auto& item : value) {
      if (!item.is_string()) throw std::runtime_error("field \"" + key + "\" is a list with a non-string element");
      sentences.push_back(&item.get_ref<const std::string&>());
    }
  } else {
    throw std::runtime_error("field \"" + key + "\" is " + value.type_name() + ", not a string or a list of strings");
  }
  trainer::IndexedDocument doc;
  for (const std::string* sentence : sentences) {
    bytes += sentence->size();
    const auto ids = tokenizer.tokenizer_encode(*sentence);
    if (ids.empty()) continue;
    doc.tokens.insert(doc.tokens.end(), ids.begin(), ids.end());
    doc.sequence_lengths.push_back(static_cast<int64_t>(ids.size()));
  }
  if (!doc.tokens.empty() && append_eod) {
    doc.tokens.push_back(tokenizer.tokenizer_eod());
    doc.sequence_lengths.back() += 1;
  }
  doc.tokens.shrink_to_fit();  // the <eod> push doubled the capacity: every document is held until written
  if (!doc.sequence_lengths.empty() &&
      *std::max_element(doc.sequence_lengths.begin(), doc.sequence_lengths.end()) > std::numeric_limits<int32_t>::max())
    throw std::runtime_error("field \"" + key + "\" has a sequence longer than 2^31 - 1 tokens (the .idx int32 length)");
  return doc;
}

// The next lines of the input, up to about kBatchBytes of text (at least one line, none at the
// end). Every line is a document, a blank one too: Megatron's json.loads fails on it, and so do
// we. Lines end as in Python's text mode (universal newlines), which Megatron reads the file in:
// at "\n", "\r\n" or a lone "\r" (old Mac files were one unparsable line here).
// Python's json.loads (Megatron's reader) also takes the bare words NaN, Infinity and -Infinity
// (json.dumps writes them for float scores) and numbers beyond double's range (read as inf),
// which nlohmann refuses. For a line the strict parse refused: outside strings those words become
// null and every number of JSON's grammar 0 (no field this tool tokenizes can be a number: a number or null there
// is refused as not a string, as Megatron's tokenizer refuses it).
// Whether `run` is one number of JSON's grammar, -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?: what
// Python takes (it reads 01, 1. and a lone - as errors; so must we).
bool json_number_grammar(const std::string& run) {
  size_t i = 0;
  const auto digits = [&] {
    const size_t start = i;
    while (i < run.size() && run[i] >= '0' && run[i] <= '9') ++i;
    return i > start;
  };
  if (i < run.size() && run[i] == '-') ++i;
  if (i < run.size() && run[i] == '0') ++i;
  else if (!digits()) return false;
  if (i < run.size() && run[i] == '.' && (++i, !digits())) return false;
  if (i < run.size() && (run[i] == 'e' || run[i] == 'E')) {
    ++i;
    if (i < run.size() && (run[i] == '+' || run[i] == '-')) ++i;
    if (!digits()) return false;
  }
  return i == run.size();
}

std::string json_relaxed_as_python(const std::string& line) {
  std::string out;
  out.reserve(line.size());
  bool in_string = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < line.size()) out += line[++i];
      else if (c == '"') in_string = false;
      continue;
    }
    const auto word = [&](const char* w) { return line.compare(i, std::strlen(w), w) == 0; };
    if (c == '"') {
      in_string = true;
      out += c;
    } else if (word("-Infinity") || word("Infinity") || word("NaN")) {
      const size_t length = word("NaN") ? 3 : word("Infinity") ? 8 : 9;
      i += length - 1;
      out += length == 3 ? "null" : "null" + std::string(length - 4, ' ');
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      const size_t start = i;
      while (i + 1 < line.size() && std::strchr("0123456789+-.eE", line[i + 1]) != nullptr) ++i;
      const std::string run = line.substr(start, i - start + 1);
      // Not a number: left for the parser to refuse. A number becomes 0 padded with spaces, so
      // that the parser's columns still point into the line as written (NaN's null adds one).
      out += json_number_grammar(run) ? "0" + std::string(run.size() - 1, ' ') : run;
    } else {
      out += c;
    }
  }
  return out;
}

nlohmann::json json_parse_as_python(const std::string& line) {
  try {
    return nlohmann::json::parse(line);
  } catch (const nlohmann::json::out_of_range&) {
    // A number past double's range, which Python reads: the line's error, if any, is elsewhere,
    // and the relaxed parse names it (its columns are the line's, but for one per NaN before it).
    return nlohmann::json::parse(json_relaxed_as_python(line));
  } catch (const nlohmann::json::exception&) {
    try {
      return nlohmann::json::parse(json_relaxed_as_python(line));
    } catch (const nlohmann::json::exception&) {
    }
    throw;  // the strict parser's message describes the line as written
  }
}

constexpr size_t kBatchBytes = 8 << 20;  // tokens held per batch: 8 bytes each (int64) per key
constexpr size_t kBatchLines = 1 << 16;

std::vector<std::string> read_batch(std::istream& in, const std::string& input) {
  std::vector<std::string> lines;
  size_t bytes = 0;
  for (std::string piece; bytes < kBatchBytes && lines.size() < kBatchLines && std::getline(in, piece);) {
    bytes += piece.size() + 1;
    if (!piece.empty() && piece.back() == '\r') piece.pop_back();  // "\r\n", or a last "\r"
    for (size_t begin = 0;;) {
      const size_t cr = piece.find('\r', begin);
      if (cr == std::string::npos) {
        lines.push_back(begin == 0 ? std::move(piece) : piece.substr(begin));
        break;
      }
      lines.push_back(piece.substr(begin, cr - begin));
      begin = cr + 1;
    }
  }
  if (in.bad()) throw trainer::Error(trainer::kExitData, "cannot read --input " + input);
  return lines;
}


}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"preprocess_data: JSON lines -> Megatron .bin/.idx"};
  std::string input, output_prefix, tokenizer_type = "byte", tokenizer_model;
  std::vector<std::string> json_keys = {"text"};
  bool append_eod = false, split_sentences = false;
  int workers = 1;
  app.add_option("--input", input, "JSON lines file, one document per line")->required();
  app.add_option("--output-prefix", output_prefix, "writes <prefix>_<key>_document.bin/.idx")->required();
  app.add_option("--json-keys", json_keys, "keys to extract (default: text)");
  app.add_option("--tokenizer-type", tokenizer_type, "byte | sentencepiece");
  app.add_option("--tokenizer-model", tokenizer_model, "SentencePiece .model file");
  app.add_flag("--append-eod", append_eod, "append <eod> to every document");
  app.add_option("--workers", workers, "tokenizer threads (1 to 1024)")->check(CLI::Range(1, 1024));
  app.add_flag("--split-sentences", split_sentences, "not implemented (Megatron splits with NLTK punkt)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : trainer::kExitUsage;
  }
  if (split_sentences) {
    std::fprintf(stderr, "preprocess_data: error: --split-sentences is not implemented (Megatron splits with NLTK's "
                         "punkt model); give each document's \"%s\" as a list of sentences instead\n",
                 json_keys.front().c_str());
    return trainer::kExitUsage;
  }
  try {
    const auto tokenizer = trainer::tokenizer_create(tokenizer_type, tokenizer_model);
    if (append_eod && tokenizer->tokenizer_eod() < 0)
      throw trainer::config_error("--append-eod: --tokenizer-model " + tokenizer_model + " has no </s> (eos) piece for <eod>");
    if (std::filesystem::is_directory(input)) throw trainer::Error(trainer::kExitData, "--input " + input + " is a directory");
    // "" or a directory ("out/") named files "_text_document.bin" with no stem, where no one looks.
    const std::string stem = std::filesystem::path(output_prefix).filename().string();
    if (stem.empty() || stem == "." || stem == "..")
      throw trainer::config_error("--output-prefix '" + output_prefix + "' must end in a file name stem (e.g. out/corpus)");
    for (size_t k = 0; k < json_keys.size(); ++k) {
      // Two writers of one key shared their temporary files: the run failed after writing.
      if (std::find(json_keys.begin(), json_keys.begin() + static_cast<std::ptrdiff_t>(k), json_keys[k]) !=
          json_keys.begin() + static_cast<std::ptrdiff_t>(k))
        throw trainer::config_error("--json-keys names \"" + json_keys[k] + "\" twice");
      // The input replaced by the output it is read into, silently.
      for (const char* extension : {".bin", ".idx"}) {
        const std::string output = output_prefix + "_" + json_keys[k] + "_document" + extension;
        std::error_code error;
        if (std::filesystem::equivalent(input, output, error))
          throw trainer::config_error("--output-prefix " + output_prefix + " would overwrite the --input " + input +
                                      " (as " + output + "); choose another prefix");
      }
    }
    std::ifstream in(input, std::ios::binary);
    if (!in) throw trainer::Error(trainer::kExitData, "cannot open --input " + input);
    std::error_code size_error;
    const auto input_size = std::filesystem::file_size(input, size_error);  // none for a pipe
    const uint8_t dtype = tokenizer->tokenizer_vocab_size() < 65500 ? 8 : 4;  // uint16 or int32, as Megatron
    // One output per key, streamed: a batch of lines is tokenized by the workers while the next
    // batch is read, then appended to the writers (documents keep input order because each
    // worker fills its own slots). Output files that cannot be created fail here, before any work.
    std::vector<std::unique_ptr<trainer::IndexedDatasetWriter>> writers;
    for (const auto& key : json_keys)
      writers.push_back(std::make_unique<trainer::IndexedDatasetWriter>(output_prefix + "_" + key + "_document", dtype));
    std::vector<std::string> temporary_paths;
    for (const auto& writer : writers)
      for (const auto& path : writer->temporary_paths()) temporary_paths.push_back(path);
    const trainer::TemporaryFilesOnSignal cleanup_on_signal(temporary_paths);
    const auto start = std::chrono::steady_clock::now();
    const auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
    size_t first_line = 0;  // of the batch, 0-based
    uint64_t read_bytes = 0, text_bytes = 0;
    double reported_at = 0;
    std::vector<std::string> lines = read_batch(in, input), next_lines;
    std::vector<std::vector<trainer::IndexedDocument>> docs(json_keys.size());
    while (!lines.empty()) {
      for (const auto& line : lines) read_bytes += line.size() + 1;
      auto reading = std::async(std::launch::async, [&] { return read_batch(in, input); });
      for (auto& d : docs) d.assign(lines.size(), {});
      std::atomic<size_t> next{0};
      std::atomic<uint64_t> bytes{0};
      std::atomic<bool> failed{false};
      size_t failed_line = 0;  // guarded by error_mutex
      std::string error;
      std::mutex error_mutex;
      auto work = [&] {
        for (size_t i; !failed && (i = next.fetch_add(1)) < lines.size();) {
          try {
            // Strict: invalid UTF-8 (Megatron opens the input with encoding='utf-8', errors strict),
            // a blank line, or anything but one JSON object fails, naming the line.
            // nlohmann's parser ends at a NUL byte and drops the rest of the line; Python's json.loads
            // refuses the byte (and a byte-order mark: "decode using utf-8-sig").
            if (const auto nul = lines[i].find('\0'); nul != std::string::npos)
              throw std::runtime_error("byte " + std::to_string(nul + 1) + " is a NUL byte, which JSON text cannot hold");
            if (lines[i].rfind("\xEF\xBB\xBF", 0) == 0)
              throw std::runtime_error("starts with a UTF-8 byte-order mark, which Megatron's json.loads refuses; "
                                       "save the file as UTF-8 without a BOM");
            const auto j = json_parse_as_python(lines[i]);
            if (!j.is_object()) throw std::runtime_error("not a JSON object");
            for (size_t k = 0; k < json_keys.size(); ++k) {
              if (!j.contains(json_keys[k])) throw std::runtime_error("no field \"" + json_keys[k] + "\"");
              size_t line_bytes = 0;
              docs[k][i] = encode_document(j[json_keys[k]], json_keys[k], *tokenizer, append_eod, line_bytes);
              bytes += line_bytes;
            }
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> lock(error_mutex);
            // The first failing line in input order is reported, whatever the thread timing (lines
            // are taken in order, so every earlier line is finished by some worker; batches are
            // written in order, so every earlier batch was clean).
            const std::string message = input + ": line " + std::to_string(first_line + i + 1) + ": " + e.what();
            if (!failed || i < failed_line) failed_line = i, error = message;
            failed = true;
          }
        }
      };
      std::vector<std::thread> threads;
      for (int w = 1; w < workers; ++w) threads.emplace_back(work);
      work();
      for (auto& t : threads) t.join();
      // This batch's bad line is reported before a read error further on (the reader is waited
      // for by the future's destructor).
      if (failed) throw trainer::Error(trainer::kExitData, error);
      next_lines = reading.get();
      for (size_t k = 0; k < json_keys.size(); ++k)
        for (const auto& d : docs[k]) writers[k]->add_document(d);
      text_bytes += bytes;
      first_line += lines.size();
      lines.swap(next_lines);
      if (seconds() - reported_at >= 5) {  // progress on long inputs
        reported_at = seconds();
        std::fprintf(stderr, "preprocess_data: %zu documents, %.1f MB of input%s, %.1f MB/s of text\n", first_line,
                     read_bytes / 1e6,
                     size_error ? "" : (" of " + std::to_string(static_cast<int64_t>(input_size / 1e6 + 0.5)) + " MB").c_str(),
                     text_bytes / 1e6 / seconds());
      }
    }
    for (size_t k = 0; k < json_keys.size(); ++k) {
      auto& writer = *writers[k];
      writer.finish();
      std::fprintf(stderr, "preprocess_data: wrote %s_%s_document.bin/.idx: %lld documents, %lld sequences, %lld tokens (%s), %.2f s, %.1f MB/s of text\n",
                   output_prefix.c_str(), json_keys[k].c_str(), static_cast<long long>(writer.num_documents()),
                   static_cast<long long>(writer.num_sequences()), static_cast<long long>(writer.num_tokens()),
                   dtype == 8 ? "uint16" : "int32", seconds(), text_bytes / 1e6 / seconds());
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
