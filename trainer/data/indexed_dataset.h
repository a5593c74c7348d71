// Megatron's MMap indexed dataset (.idx + .bin), read and written byte-exactly (docs/data.md):
//   .idx: "MMIDIDX\0\0" | u64 version = 1 | u8 dtype code | u64 S (sequences) | u64 D (document
//         index entries = documents + 1) | int32[S] lengths | int64[S] byte offsets into .bin |
//         int64[D] document index. Little-endian, unaligned (the int64 arrays start at 34 + 4S).
//   .bin: the concatenated token arrays.
// dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16; the
// float codes are refused on reading (tokens are integers).
#pragma once
#include <signal.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace trainer {

// A read-only memory map of one file.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws trainer::Error (exit 3)
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const unsigned char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  const unsigned char* data_ = nullptr;
  uint64_t size_ = 0;
};

class IndexedDataset {
 public:
  // Opens <prefix>.idx and <prefix>.bin and validates every header field and pointer.
  // Any problem throws trainer::Error with exit code 3 naming the file, field or offset.
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();

  const std::string& prefix() const { return prefix_; }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_documents() const { return num_documents_; }  // D - 1
  uint8_t dtype_code() const { return dtype_code_; }
  int32_t sequence_length(int64_t i) const;   // tokens in sequence i
  int64_t sequence_pointer(int64_t i) const;  // byte offset of sequence i in .bin
  int64_t document_index(int64_t i) const;    // i in [0, D)
  const std::vector<int32_t>& sequence_lengths() const { return lengths_; }
  // The whole .bin (the sequences back to back, as validated on open).
  const unsigned char* bin_bytes() const;
  uint64_t bin_size() const;
  // Appends tokens [offset, offset + length) of sequence i to `out`.
  void read(int64_t sequence, int64_t offset, int64_t length, std::vector<int64_t>& out) const;

 private:
  std::string prefix_;
  MappedFile* idx_ = nullptr;
  MappedFile* bin_ = nullptr;
  uint8_t dtype_code_ = 0;
  int64_t item_size_ = 0;
  int64_t num_sequences_ = 0, num_documents_ = 0;
  uint64_t pointers_offset_ = 0, documents_offset_ = 0;
  std::vector<int32_t> lengths_;  // (S) copied: read per sample by the index builder
};

// Bytes per token of a dtype code (0 if unknown).
int64_t indexed_dtype_size(uint8_t code);

// One document as Megatron's IndexedDatasetBuilder.add_document receives it: its tokens and the
// lengths of the sequences they split into (sum = tokens.size()). No sequence at all is allowed:
// the document index still advances (an empty document, as Megatron writes for empty text).
struct IndexedDocument {
  std::vector<int64_t> tokens;
  std::vector<int64_t> sequence_lengths;
};

// Streams documents into <prefix>.bin and <prefix>.idx, as Megatron's IndexedDatasetBuilder:
// add_document in order (its tokens go to disk at once; only the .idx arrays, 12 bytes per
// sequence and 8 per document, stay in memory), then finish(), which writes the .idx and renames
// both files into place. dtype code 8 (uint16) or 4 (int32). add_document throws trainer::Error
// (exit 3) naming the document when a token does not fit the dtype or a sequence is longer than
// the int32 length field allows. A writer destroyed before finish() (an error, an exception)
// removes its temporary files and leaves any earlier <prefix>.bin/.idx untouched. finish() blocks
// SIGINT and SIGTERM in the calling thread across the two renames, so that a handler never sees
// a half-renamed pair; that holds for the process only when no other thread can take the signal
// (preprocess_data calls it with its workers joined).
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(const std::string& prefix, uint8_t dtype_code);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;
  void add_document(const IndexedDocument& document);  // dtype code 8 or 4
  // A whole dataset of the writer's dtype, as Megatron's IndexedDatasetBuilder.add_index
  // (tools/merge_datasets.py): its sequences and documents after those written so far, its .bin
  // copied. Exit 3 naming both for another dtype.
  void add_index(const IndexedDataset& dataset);
  void finish();
  int64_t num_documents() const { return static_cast<int64_t>(document_index_.size()) - 1; }
  int64_t num_sequences() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t num_tokens() const { return tokens_; }
  // The two temporary names (.bin, .idx) until finish(): a tool that is interrupted removes them.
  std::vector<std::string> temporary_paths() const { return {bin_path_, idx_path_}; }

 private:
  std::string prefix_, bin_path_, idx_path_;  // the two temporary names until finish()
  uint8_t dtype_code_;
  int64_t item_size_;
  std::ofstream bin_;
  std::vector<int32_t> lengths_;                  // (S) tokens per sequence
  std::vector<int64_t> pointers_;                 // (S) byte offset of each sequence in .bin
  std::vector<int64_t> document_index_ = {0};     // (D) sequences before each document, then the total
  int64_t pointer_ = 0, tokens_ = 0;
  std::vector<char> bytes_;  // one document's tokens in the dtype, reused
  bool finished_ = false;
};

// Removes `paths` (writers' temporary files) when SIGINT or SIGTERM ends the process, then dies
// of the signal as usual (130, 143 in a shell): a long run stopped with Ctrl-C left gigabytes of
// .partial-<pid> files. Installed for its lifetime; the earlier dispositions come back when it
// goes, and a signal the caller ignores stays ignored (a shell starts background jobs with SIGINT
// ignored). One at a time per process.
class TemporaryFilesOnSignal {
 public:
  explicit TemporaryFilesOnSignal(const std::vector<std::string>& paths);
  ~TemporaryFilesOnSignal();
  TemporaryFilesOnSignal(const TemporaryFilesOnSignal&) = delete;
  TemporaryFilesOnSignal& operator=(const TemporaryFilesOnSignal&) = delete;

 private:
  struct sigaction previous_[2] {};  // SIGINT, SIGTERM
};

// The whole corpus at once (tests, fixtures): an IndexedDatasetWriter fed every document.
void indexed_dataset_write(const std::string& prefix, const std::vector<IndexedDocument>& documents,
                           uint8_t dtype_code);
// The same with one sequence per document (fixtures and tests).
void indexed_dataset_write(const std::string& prefix, const std::vector<std::vector<int64_t>>& documents,
                           uint8_t dtype_code);

}  // namespace trainer
