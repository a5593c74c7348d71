// Safetensors files (https://github.com/huggingface/safetensors, format section): an 8-byte
// little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__":
// {...}} padded with spaces to a multiple of 8, then the raw little-endian tensor bytes.
// Plain C++ (no LibTorch), plus the CRC32C checksums used by checkpoint manifests.
#pragma once
#include <cstdint>
#include <istream>
#include <map>
#include <string>
#include <vector>

#include "trainer/util/crc32c.h"

namespace trainer {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;           // "F32", "F64", "I64", "BF16", "U8"
  std::vector<int64_t> shape;
  const void* data = nullptr;  // nbytes little-endian bytes
  size_t nbytes = 0;
};

// Writes `path` and fsyncs it. Returns the CRC32C of the whole file. Throws std::runtime_error
// naming the path and errno text on any I/O failure (disk full included).
uint32_t safetensors_write(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                           const std::map<std::string, std::string>& metadata = {});

// A safetensors file whose tensors arrive one at a time: the header (names, dtypes, shapes and
// sizes of `entries`, whose data pointers are not read) is written at construction, then each
// append() writes the next entry's bytes, in the order of `entries`. finish() fsyncs and closes
// and returns the file's CRC32C; a writer destroyed unfinished closes the file and leaves it
// (the caller writes to a temporary name). I/O failures and out-of-order or wrongly sized
// appends throw std::runtime_error naming the path.
class SafetensorsStreamWriter {
 public:
  SafetensorsStreamWriter(std::string path, std::vector<SafetensorsEntry> entries,
                          const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;
  void append(const std::string& name, const void* data, size_t nbytes);
  bool complete() const { return next_ == entries_.size(); }
  uint32_t finish();

 private:
  std::string path_;
  std::vector<SafetensorsEntry> entries_;
  size_t next_ = 0;  // the entry the next append() writes
  int fd_ = -1;
  uint32_t crc_ = 0;
};

struct SafetensorsTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  size_t offset = 0;  // into SafetensorsFile::data
  size_t nbytes = 0;
};

struct SafetensorsFile {
  std::map<std::string, SafetensorsTensor> tensors;
  std::map<std::string, std::string> metadata;
  std::vector<char> data;  // the byte buffer after the header (empty when read without data)
  uint64_t data_start = 0; // where that buffer starts in the file
};

// What safetensors_read throws for a file it opened whose contents are not valid safetensors
// (truncated, damaged, another format): input data (exit 3), where a path that cannot be opened
// is the caller's to judge.
class SafetensorsFormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Reads and validates a file (header bounds, offsets inside the buffer, sizes matching shapes);
// without data only the header (then safetensors_read_bytes reads one tensor at a time from
// `in`, the file opened once by its caller; `path` names it in errors).
// Throws std::runtime_error (SafetensorsFormatError for the contents) naming the path and the problem.
SafetensorsFile safetensors_read(const std::string& path, bool with_data = true);
std::vector<char> safetensors_read_bytes(std::istream& in, const std::string& path, const SafetensorsFile& header,
                                         const SafetensorsTensor& tensor);

// CRC32C of a whole file; throws std::runtime_error if it cannot be read.
uint32_t crc32c_file(const std::string& path, uint64_t* size = nullptr);

// Throws std::runtime_error "<path> is not a regular file ..." when path exists as something else
// (a FIFO with no writer would block its reader for ever, a device never end). Missing: no throw.
void file_require_regular(const std::string& path);

// Writes `bytes` to `path` and fsyncs it (throws std::runtime_error on failure).
void file_write_durable(const std::string& path, const std::string& bytes);
// fsync of a directory, so a rename inside it is durable.
void directory_sync(const std::string& path);

}  // namespace trainer
