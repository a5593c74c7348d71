// Megatron .bin/.idx reader (memory-mapped, fully validated) and writer (see indexed_dataset.h).
#include "trainer/data/indexed_dataset.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <limits>

#include "trainer/util/error.h"

namespace trainer {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kHeaderSize = 34;

Error data_error(const std::string& message) { return Error(kExitData, message); }

template <typename T>
T read_le(const unsigned char* p) {  // unaligned little-endian load
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace

int64_t indexed_dtype_size(uint8_t code) {
  switch (code) {
    case 1: case 2: return 1;
    case 3: case 8: return 2;
    case 4: case 7: return 4;
    case 5: case 6: return 8;
    default: return 0;
  }
}

MappedFile::MappedFile(const std::string& path) {
  // O_NONBLOCK: a FIFO's open would wait for a writer forever; it is refused below instead.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw data_error("cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  if (!S_ISREG(st.st_mode)) {  // a directory read "cannot map: No such device"; a FIFO hung
    ::close(fd);
    throw data_error(path + " is " + (S_ISDIR(st.st_mode) ? "a directory" : "not a regular file") +
                     ", not a token file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw data_error("cannot map " + path + ": " + std::strerror(errno));
    }
    data_ = static_cast<const unsigned char*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<unsigned char*>(data_), size_);
}

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  idx_ = new MappedFile(idx_path);
  try {
    bin_ = new MappedFile(bin_path);
    const unsigned char* p = idx_->data();
    const uint64_t n = idx_->size();
    if (n < kHeaderSize)
      throw data_error(idx_path + ": truncated header (" + std::to_string(n) + " bytes, expected at least 34)");
    if (std::memcmp(p, kMagic, 9) != 0) throw data_error(idx_path + ": bad magic at offset 0 (expected \"MMIDIDX\\0\\0\")");
    const uint64_t version = read_le<uint64_t>(p + 9);
    if (version != 1) throw data_error(idx_path + ": version " + std::to_string(version) + " at offset 9 (expected 1)");
    dtype_code_ = p[17];
    item_size_ = indexed_dtype_size(dtype_code_);
    if (item_size_ == 0)
      throw data_error(idx_path + ": unknown dtype code " + std::to_string(dtype_code_) + " at offset 17 (expected 1-8)");
    if (dtype_code_ == 6 || dtype_code_ == 7)
      throw data_error(idx_path + ": dtype code " + std::to_string(dtype_code_) + (dtype_code_ == 6 ? " (float64)" : " (float32)") +
                       " at offset 17: token files hold integers (Megatron's preprocess_data writes uint16 or int32)");
    const uint64_t S = read_le<uint64_t>(p + 18), D = read_le<uint64_t>(p + 26);
    // Sizes first, with overflow-safe arithmetic, so a hostile S or D cannot wrap around.
    if (S > n / 4 || D > n / 8 || kHeaderSize + 12 * S + 8 * D != n)
      throw data_error(idx_path + ": " + std::to_string(n) + " bytes but header says S = " + std::to_string(S) +
                       " sequences and D = " + std::to_string(D) + " document entries (expected 34 + 12*S + 8*D = " +
                       (S <= n / 4 && D <= n / 8 ? std::to_string(kHeaderSize + 12 * S + 8 * D) + " bytes)"
                                                 : std::string("more bytes than the file has: the ") +
                                                       (S > n / 4 ? (D > n / 8 ? "counts at offsets 18 and 26 are" : "count at offset 18 is")
                                                                  : "count at offset 26 is") + " corrupt)") +
                       // Megatron's multimodal index appends one int8 mode per sequence.
                       (S <= n / 4 && D <= n / 8 && n == kHeaderSize + 13 * S + 8 * D
                            ? "; the S extra bytes look like a multimodal index's sequence modes, which this trainer does not read"
                            : ""));
    // Megatron indexes sequences as int32 (its numpy document arrays); so do the samplers here.
    if (S > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()))
      throw data_error(idx_path + ": S = " + std::to_string(S) + " sequences at offset 18, more than the 2^31 - 1 a "
                       "Megatron index can address: split the corpus into several prefixes and blend them");
    if (D < 1) throw data_error(idx_path + ": document index is empty at offset 26 (expected D >= 1)");
    num_sequences_ = static_cast<int64_t>(S);
    num_documents_ = static_cast<int64_t>(D) - 1;
    pointers_offset_ = kHeaderSize + 4 * S;
    documents_offset_ = pointers_offset_ + 8 * S;
    lengths_.resize(S);
    std::memcpy(lengths_.data(), p + kHeaderSize, 4 * S);
    const uint64_t bin_size = bin_->size();
    for (uint64_t i = 0; i < S; ++i) {
      const int64_t pointer = sequence_pointer(static_cast<int64_t>(i));
      if (lengths_[i] < 0 || pointer < 0)
        throw data_error(idx_path + ": sequence " + std::to_string(i) + " has a negative " +
                         (lengths_[i] < 0 ? "length (" + std::to_string(lengths_[i]) + " at byte " +
                                                std::to_string(kHeaderSize + 4 * i) + " of the .idx)"
                                          : "byte offset into " + bin_path + " (" + std::to_string(pointer) + " at byte " +
                                                std::to_string(pointers_offset_ + 8 * i) + " of the .idx)") +
                         ": the index is corrupt");
      if (static_cast<uint64_t>(pointer) + static_cast<uint64_t>(lengths_[i]) * item_size_ > bin_size)
        throw data_error(idx_path + ": sequence " + std::to_string(i) + " (length " + std::to_string(lengths_[i]) +
                         " at byte " + std::to_string(pointer) + ") points past the end of " + bin_path + " (" +
                         std::to_string(bin_size) + " bytes)");
      if (pointer % item_size_ != 0)
        throw data_error(idx_path + ": sequence " + std::to_string(i) + " starts at byte " + std::to_string(pointer) +
                         " of " + bin_path + ", not a multiple of the " + std::to_string(item_size_) +
                         "-byte token size (a Megatron writer never does that: the index is corrupt)");
    }
    // Megatron's writers put the sequences back to back, so their tokens fill the .bin exactly. A
    // dtype code that does not match the file (uint8 over uint16 tokens reads every token as two)
    // or a .bin of another .idx passes every check above and trains on garbage.
    uint64_t token_bytes = 0;
    for (const int32_t length : lengths_) token_bytes += static_cast<uint64_t>(length) * item_size_;
    if (token_bytes != bin_size)
      throw data_error(idx_path + ": its " + std::to_string(S) + " sequences hold " + std::to_string(token_bytes) + " bytes of " +
                       std::to_string(item_size_) + "-byte tokens (dtype code " + std::to_string(dtype_code_) +
                       " at offset 17), but " + bin_path + " has " + std::to_string(bin_size) +
                       ": the dtype code does not match the tokens, or the two files are not one pair");
    // Megatron's pointers are the running sum of the lengths: sequences that overlap (read the
    // same tokens twice, others never) or leave gaps pass the total above.
    uint64_t sequence_end = 0;  // where the sequence before i ends in the .bin
    for (uint64_t i = 0; i < S; ++i) {
      const auto pointer = static_cast<uint64_t>(sequence_pointer(static_cast<int64_t>(i)));
      if (pointer != sequence_end)
        throw data_error(idx_path + ": sequence " + std::to_string(i) + " starts at byte " + std::to_string(pointer) +
                         " of " + bin_path + ", not at byte " + std::to_string(sequence_end) + " where the one before it ends (" +
                         (pointer < sequence_end ? "overlap" : "gap") +
                         "; a Megatron writer puts them back to back: the index is corrupt)");
      sequence_end += static_cast<uint64_t>(lengths_[i]) * item_size_;
    }
    int64_t previous = 0;
    for (uint64_t i = 0; i < D; ++i) {
      const int64_t d = document_index(static_cast<int64_t>(i));
      if (d < previous || d > num_sequences_)
        throw data_error(idx_path + ": document index entry " + std::to_string(i) + " = " + std::to_string(d) +
                         " is not non-decreasing within [0, " + std::to_string(S) + "]");
      previous = d;
    }
    if (document_index(0) != 0 || document_index(num_documents_) != num_sequences_)
      throw data_error(idx_path + ": document index runs from " + std::to_string(document_index(0)) + " to " +
                       std::to_string(document_index(num_documents_)) + " (expected 0 to S = " + std::to_string(S) + ")");
  } catch (...) {
    delete idx_;
    delete bin_;
    throw;
  }
}

const unsigned char* IndexedDataset::bin_bytes() const { return bin_->data(); }
uint64_t IndexedDataset::bin_size() const { return bin_->size(); }

namespace {
// Filled before the handlers are installed and not changed while they are, so the handler only
// reads it (unlink is async-signal-safe).
std::vector<std::string> g_temporary_paths;
constexpr int kStopSignals[2] = {SIGINT, SIGTERM};

void remove_temporary_files_and_die(int signal_number) {
  for (const auto& path : g_temporary_paths) ::unlink(path.c_str());
  std::signal(signal_number, SIG_DFL);
  std::raise(signal_number);
}
}  // namespace

TemporaryFilesOnSignal::TemporaryFilesOnSignal(const std::vector<std::string>& paths) {
  g_temporary_paths = paths;
  struct sigaction action {};
  action.sa_handler = remove_temporary_files_and_die;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < 2; ++i) {
    ::sigaction(kStopSignals[i], nullptr, &previous_[i]);
    if (previous_[i].sa_handler != SIG_IGN) ::sigaction(kStopSignals[i], &action, nullptr);
  }
}

TemporaryFilesOnSignal::~TemporaryFilesOnSignal() {
  for (size_t i = 0; i < 2; ++i) ::sigaction(kStopSignals[i], &previous_[i], nullptr);
}

IndexedDataset::~IndexedDataset() {
  delete idx_;
  delete bin_;
}

int32_t IndexedDataset::sequence_length(int64_t i) const { return lengths_[static_cast<size_t>(i)]; }

int64_t IndexedDataset::sequence_pointer(int64_t i) const {
  return read_le<int64_t>(idx_->data() + pointers_offset_ + 8 * static_cast<uint64_t>(i));
}

int64_t IndexedDataset::document_index(int64_t i) const {
  return read_le<int64_t>(idx_->data() + documents_offset_ + 8 * static_cast<uint64_t>(i));
}

void IndexedDataset::read(int64_t sequence, int64_t offset, int64_t length, std::vector<int64_t>& out) const {
  const unsigned char* p = bin_->data() + sequence_pointer(sequence) + offset * item_size_;
  for (int64_t i = 0; i < length; ++i, p += item_size_) {
    switch (dtype_code_) {
      case 1: out.push_back(*p); break;
      case 2: out.push_back(static_cast<int8_t>(*p)); break;
      case 3: out.push_back(read_le<int16_t>(p)); break;
      case 4: out.push_back(read_le<int32_t>(p)); break;
      case 5: out.push_back(read_le<int64_t>(p)); break;
      case 8: out.push_back(read_le<uint16_t>(p)); break;
    }
  }
}

// Written under temporary names and renamed at the end: a trainer that has the old files mapped
// keeps reading them (replacing them in place would pull the pages from under it: SIGBUS). The
// two renames are not one atomic step: a reader opening the pair between them may see the new
// .bin with the old .idx (a .bin shorter than the .idx says is caught; a longer one is not:
// rewriting a corpus while a run opens it is still the user's race).
IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, uint8_t dtype_code)
    : prefix_(prefix), dtype_code_(dtype_code), item_size_(indexed_dtype_size(dtype_code)) {
  if (item_size_ == 0 || dtype_code == 6 || dtype_code == 7)
    throw Error(kExitUsage, "IndexedDatasetWriter: dtype code " + std::to_string(dtype_code) + " is not an integer dtype");
  const std::string part = ".partial-" + std::to_string(::getpid());
  bin_path_ = prefix + ".bin" + part;
  idx_path_ = prefix + ".idx" + part;
  bin_.open(bin_path_, std::ios::binary);
  // A missing or unwritable output directory is the command line's (exit 2), not a failure.
  if (!bin_) throw Error(kExitUsage, "cannot create " + bin_path_ + ": " + std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (finished_) return;
  bin_.close();
  std::remove(bin_path_.c_str());
  std::remove(idx_path_.c_str());
}

// Megatron's builder: lengths and pointers per sequence, and after each document the number of
// sequences so far (document_indices starts at [0]).
void IndexedDatasetWriter::add_document(const IndexedDocument& document) {
  if (finished_) throw Error(kExitFailure, prefix_ + ": add_document after finish");
  if (dtype_code_ != 8 && dtype_code_ != 4) throw Error(kExitFailure, prefix_ + ": add_document writes uint16 or int32 tokens");
  const std::string name = prefix_ + ": document " + std::to_string(num_documents());
  const int64_t lowest = dtype_code_ == 8 ? 0 : std::numeric_limits<int32_t>::min();
  const int64_t highest = dtype_code_ == 8 ? std::numeric_limits<uint16_t>::max() : std::numeric_limits<int32_t>::max();
  int64_t total = 0;
  for (int64_t length : document.sequence_lengths) {
    if (length < 0 || length > std::numeric_limits<int32_t>::max())
      throw Error(kExitData, name + " has a sequence of " + std::to_string(length) + " tokens; the .idx length field is int32");
    total += length;
  }
  if (total != static_cast<int64_t>(document.tokens.size()))
    throw Error(kExitFailure, name + ": sequence lengths sum to " + std::to_string(total) + ", not its " +
                                  std::to_string(document.tokens.size()) + " tokens");
  bytes_.resize(document.tokens.size() * static_cast<size_t>(item_size_));
  for (size_t i = 0; i < document.tokens.size(); ++i) {
    const int64_t token = document.tokens[i];
    if (token < lowest || token > highest)
      throw Error(kExitData, name + ": token id " + std::to_string(token) + " does not fit the " +
                                 (dtype_code_ == 8 ? "uint16" : "int32") + " dtype");
    if (dtype_code_ == 8) {
      const uint16_t v = static_cast<uint16_t>(token);
      std::memcpy(bytes_.data() + 2 * i, &v, 2);
    } else {
      const int32_t v = static_cast<int32_t>(token);
      std::memcpy(bytes_.data() + 4 * i, &v, 4);
    }
  }
  // Checked all of the document before any of it is kept: a refused document leaves no trace.
  for (int64_t length : document.sequence_lengths) {
    lengths_.push_back(static_cast<int32_t>(length));
    pointers_.push_back(pointer_);
    pointer_ += length * item_size_;
  }
  document_index_.push_back(static_cast<int64_t>(lengths_.size()));
  tokens_ += total;
  bin_.write(bytes_.data(), static_cast<std::streamsize>(bytes_.size()));
  if (!bin_) throw Error(kExitFailure, "cannot write " + bin_path_ + ": " + std::strerror(errno));
}

void IndexedDatasetWriter::add_index(const IndexedDataset& dataset) {
  if (finished_) throw Error(kExitFailure, prefix_ + ": add_index after finish");
  if (dataset.dtype_code() != dtype_code_)
    throw Error(kExitData, dataset.prefix() + ".idx has dtype code " + std::to_string(dataset.dtype_code()) + ", but " +
                               prefix_ + " is written with " + std::to_string(dtype_code_) +
                               " (the first input's): merged files need one dtype");
  const int64_t before = static_cast<int64_t>(lengths_.size());
  for (int64_t i = 0; i < dataset.num_sequences(); ++i) {
    const int32_t length = dataset.sequence_length(i);
    lengths_.push_back(length);
    pointers_.push_back(pointer_);
    pointer_ += length * item_size_;
    tokens_ += length;
  }
  // Its document index without the leading 0, shifted past the sequences before it.
  for (int64_t d = 1; d <= dataset.num_documents(); ++d) document_index_.push_back(before + dataset.document_index(d));
  bin_.write(reinterpret_cast<const char*>(dataset.bin_bytes()), static_cast<std::streamsize>(dataset.bin_size()));
  if (!bin_) throw Error(kExitFailure, "cannot write " + bin_path_ + ": " + std::strerror(errno));
}

void IndexedDatasetWriter::finish() {
  if (finished_) return;
  std::ofstream idx(idx_path_, std::ios::binary);
  if (!idx) throw Error(kExitFailure, "cannot create " + idx_path_ + ": " + std::strerror(errno));
  const uint64_t version = 1, S = lengths_.size(), D = document_index_.size();
  idx.write(kMagic, 9);
  idx.write(reinterpret_cast<const char*>(&version), 8);
  idx.put(static_cast<char>(dtype_code_));
  idx.write(reinterpret_cast<const char*>(&S), 8);
  idx.write(reinterpret_cast<const char*>(&D), 8);
  idx.write(reinterpret_cast<const char*>(lengths_.data()), static_cast<std::streamsize>(4 * S));
  idx.write(reinterpret_cast<const char*>(pointers_.data()), static_cast<std::streamsize>(8 * S));
  idx.write(reinterpret_cast<const char*>(document_index_.data()), static_cast<std::streamsize>(8 * D));
  bin_.close();
  idx.close();
  if (!bin_ || !idx) throw Error(kExitFailure, "cannot write " + prefix_ + ".bin/.idx");
  // On disk before the names point at them: after a power loss the names hold the old files or
  // the complete new ones, never empty or short ones.
  for (const auto& path : {bin_path_, idx_path_}) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::fsync(fd) != 0) {
      const std::string reason = std::strerror(errno);
      if (fd >= 0) ::close(fd);
      throw Error(kExitFailure, "cannot write " + path + " to disk: " + reason);
    }
    ::close(fd);
  }
  // The .idx last: a reader that opens the new .idx finds the new .bin beside it. SIGINT and
  // SIGTERM wait until both names are moved: a Ctrl-C between the renames ended the run with the
  // new .bin beside the old .idx (a pair that reads as garbage, or as silently other samples).
  // The caller's threads are joined by now; a signal blocked here is delivered when unblocked.
  sigset_t stop_signals, previous_mask;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, &previous_mask);
  struct RestoreMask {
    const sigset_t& mask;
    ~RestoreMask() { pthread_sigmask(SIG_SETMASK, &mask, nullptr); }
  } restore_mask{previous_mask};
  if (std::rename(bin_path_.c_str(), (prefix_ + ".bin").c_str()) != 0)
    throw Error(kExitFailure, "cannot rename " + bin_path_ + " to " + prefix_ + ".bin: " + std::strerror(errno) +
                                  " (the earlier " + prefix_ + ".bin/.idx, if any, are unchanged)");
  finished_ = true;  // the .bin is in place: only the .idx partial is left to clean up on failure
  if (std::rename(idx_path_.c_str(), (prefix_ + ".idx").c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    std::remove(idx_path_.c_str());
    throw Error(kExitFailure, "cannot rename " + idx_path_ + " to " + prefix_ + ".idx: " + reason + "; " + prefix_ +
                                  ".bin is already the new one: run preprocess_data again before using the pair");
  }
}

void indexed_dataset_write(const std::string& prefix, const std::vector<IndexedDocument>& documents,
                           uint8_t dtype_code) {
  IndexedDatasetWriter writer(prefix, dtype_code);
  for (const auto& document : documents) writer.add_document(document);
  writer.finish();
}

void indexed_dataset_write(const std::string& prefix, const std::vector<std::vector<int64_t>>& documents,
                           uint8_t dtype_code) {
  IndexedDatasetWriter writer(prefix, dtype_code);
  IndexedDocument document;
  for (const auto& tokens : documents) {
    document.tokens = tokens;
    document.sequence_lengths = {static_cast<int64_t>(tokens.size())};
    writer.add_document(document);
  }
  writer.finish();
}

}  // namespace trainer
