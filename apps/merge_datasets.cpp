// merge_datasets: every <prefix>.bin/.idx pair in a directory -> one pair, as Megatron-LM's
// tools/merge_datasets.py (the prefixes in sorted order, one dtype, documents and sequences
// appended, the .bin files copied): byte for byte the files preprocess_data writes for the inputs'
// JSON lines concatenated in that order. Each input is validated as the trainer reads it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "trainer/data/indexed_dataset.h"
#include "trainer/util/error.h"

namespace fs = std::filesystem;

namespace {

// The prefixes of `dir`, sorted as Python sorts strings (UTF-8 bytes compare in code point
// order). As Megatron, every regular file must have its pair: a.idx needs a.bin, and any other
// file x.y needs x.idx (Megatron asserts); subdirectories are skipped.
std::vector<std::string> merge_input_prefixes(const std::string& dir) {
  std::set<std::string> prefixes;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const fs::path path = entry.path();
    const std::string stem = path.stem().string(), pair = path.extension() == ".idx" ? ".bin" : ".idx";
    if (!fs::is_regular_file(path.parent_path() / (stem + pair)))
      throw trainer::Error(trainer::kExitData, "--input " + dir + ": " + path.filename().string() + " has no " + stem + pair +
                                                   " beside it (the directory must hold .bin/.idx pairs only)");
    prefixes.insert(stem);
  }
  if (prefixes.empty()) throw trainer::Error(trainer::kExitData, "--input " + dir + " holds no .bin/.idx pairs");
  return {prefixes.begin(), prefixes.end()};
}

int merge_datasets(const std::string& input, const std::string& output_prefix) {
  if (!fs::is_directory(input)) throw trainer::Error(trainer::kExitUsage, "--input " + input + " is not a directory");
  const fs::path output_dir = fs::absolute(output_prefix).parent_path();
  if (!fs::is_directory(output_dir))
    throw trainer::Error(trainer::kExitUsage, "--output-prefix " + output_prefix + ": " + output_dir.string() +
                                                  " is not a directory");
  const std::vector<std::string> prefixes = merge_input_prefixes(input);
  for (const auto& prefix : prefixes)
    for (const char* suffix : {".bin", ".idx"})
      if (fs::exists(output_prefix + suffix) && fs::equivalent(output_prefix + suffix, fs::path(input) / (prefix + suffix)))
        throw trainer::Error(trainer::kExitUsage, "--output-prefix " + output_prefix + " would overwrite the input " +
                                                      (fs::path(input) / (prefix + suffix)).string() + "; write it elsewhere");
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<trainer::IndexedDatasetWriter> writer;
  std::unique_ptr<trainer::TemporaryFilesOnSignal> cleanup_on_signal;
  for (const auto& prefix : prefixes) {
    const trainer::IndexedDataset dataset((fs::path(input) / prefix).string());
    if (!writer) {  // the first input's dtype, as Megatron
      writer = std::make_unique<trainer::IndexedDatasetWriter>(output_prefix, dataset.dtype_code());
      cleanup_on_signal = std::make_unique<trainer::TemporaryFilesOnSignal>(writer->temporary_paths());
    }
    writer->add_index(dataset);
    std::fprintf(stderr, "merge_datasets: %s: %lld documents, %lld sequences, %.1f MB\n", prefix.c_str(),
                 static_cast<long long>(dataset.num_documents()), static_cast<long long>(dataset.num_sequences()),
                 dataset.bin_size() / 1e6);
  }
  writer->finish();
  std::fprintf(stderr, "merge_datasets: wrote %s.bin/.idx: %zu inputs, %lld documents, %lld sequences, %lld tokens in %.1f s\n",
               output_prefix.c_str(), prefixes.size(), static_cast<long long>(writer->num_documents()),
               static_cast<long long>(writer->num_sequences()), static_cast<long long>(writer->num_tokens()),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return trainer::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Merge every <prefix>.bin/.idx pair of a directory into one, as Megatron's tools/merge_datasets.py"};
  std::string input, output_prefix;
  app.add_option("--input", input, "directory holding the .bin/.idx pairs to merge (in sorted prefix order)")->required();
  app.add_option("--output-prefix", output_prefix, "path of the merged pair without .bin/.idx")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? trainer::kExitOk : trainer::kExitUsage;
  }
  try {
    return merge_datasets(input, output_prefix);
  } catch (const trainer::Error& e) {
    std::fprintf(stderr, "merge_datasets: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "merge_datasets: %s\n", e.what());
    return trainer::kExitFailure;
  }
}
