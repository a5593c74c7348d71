// Megatron data as a SampleSource: dataset/blend parsing, cached GPTDataset indices, and rows
// with Megatron's loss mask, positions and segments (see data.h, docs/data.md).
#include <unistd.h>

#include <cerrno>
#include <csignal>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <spdlog/spdlog.h>

#include "trainer/data/data.h"
#include "trainer/data/gpt_dataset.h"
#include "trainer/data/indexed_dataset.h"
#include "trainer/train/memory_plan.h"
#include "trainer/util/crc32c.h"
#include "trainer/util/error.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

// "prefix" or "w1 prefix1 w2 prefix2 ...". Weighted, even one prefix ("1.0 prefix", a common
// Megatron spelling) takes Megatron's blend path: its dataset is built for the blend's 0.5% surplus.
struct DatasetBlend {
  std::vector<std::pair<double, std::string>> parts;  // (weight, prefix)
  bool weighted = false;
};

DatasetBlend parse_dataset_path(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  if (words.size() == 1) return {{{1.0, words[0]}}, false};
  if (words.empty() || words.size() % 2 != 0)
    throw config_error("config key 'dataset_path': '" + text + "' must be a prefix or \"w1 prefix1 w2 prefix2 ...\"");
  std::vector<std::pair<double, std::string>> out;
  double total = 0;
  for (size_t i = 0; i < words.size(); i += 2) {
    char* end = nullptr;
    const double w = std::strtod(words[i].c_str(), &end);
    // Hexadecimal too: strtod reads "0x10" as 16, Megatron's float() refuses it.
    if (*end != '\0' || !(w > 0) || !std::isfinite(w) || words[i].find_first_of("xX") != std::string::npos)
      throw config_error("config key 'dataset_path': weight '" + words[i] + "' before " + words[i + 1] +
                         " is not a positive finite number");
    out.emplace_back(w, words[i + 1]);
    total += w;
  }
  if (!std::isfinite(total))  // each weight is divided by the sum: infinity would zero them all
    throw config_error("config key 'dataset_path': the weights in '" + text + "' sum past the largest double; scale them down");
  // The blend's per-sample dataset index is int16, as Megatron's (whose BlendedDataset asserts
  // fewer than 32767 datasets): more would wrap negative and read outside the list.
  if (out.size() >= 32767)
    throw config_error("config key 'dataset_path': a blend of " + std::to_string(out.size()) +
                       " datasets; at most 32766 (Megatron's limit); merge some first (merge_datasets)");
  return {out, true};
}

// A cache file: magic, counts, the CRC32C of what follows, the description of the key (what the
// indices were built from), then the three arrays. Written to a temp file and renamed. A file that
// is not a regular file, short, long, of another version, fails its checksum, was built from
// something else (another corpus copied under this name) or holds ids outside this corpus is not
// trusted: a warning says why, the indices are rebuilt and the file replaced.
constexpr char kCacheMagic[8] = {'T', 'R', 'G', 'P', 'T', 'I', 'X', '3'};

uint32_t cache_checksum(const std::string& description, const GptIndices& ix) {
  uint32_t crc = crc32c_update(0, description.data(), description.size());
  crc = crc32c_update(crc, ix.document_index.data(), 4 * ix.document_index.size());
  crc = crc32c_update(crc, ix.sample_index.data(), 8 * ix.sample_index.size());
  return crc32c_update(crc, ix.shuffle_index.data(), 8 * ix.shuffle_index.size());
}

// The arrays index each other and the corpus: every id in range, so that a sample never reads
// outside the .idx or .bin (a checksum-valid file of another corpus ended a run with SIGSEGV).
// As gpt_build_indices writes them: sample boundaries are (document_index position, offset)
// pairs with positions that never decrease and an offset inside that sequence (0 for an empty
// one, which only the first boundary can sit on).
bool cache_indices_in_range(const GptIndices& ix, const std::vector<int32_t>& sizes) {
  const int64_t num_sequences = static_cast<int64_t>(sizes.size());
  for (const int32_t d : ix.document_index)
    if (d < 0 || d >= num_sequences) return false;
  if (ix.sample_index.size() < 2 || ix.sample_index.size() % 2 != 0) return false;
  const int64_t positions = static_cast<int64_t>(ix.document_index.size());
  for (size_t i = 0; i < ix.sample_index.size(); i += 2) {
    const int64_t position = ix.sample_index[i], offset = ix.sample_index[i + 1];
    if (position < 0 || position >= positions || (i > 0 && position < ix.sample_index[i - 2])) return false;
    const int64_t size = sizes[static_cast<size_t>(ix.document_index[static_cast<size_t>(position)])];
    if (offset < 0 || (offset >= size && offset != 0)) return false;
  }
  const int64_t samples = static_cast<int64_t>(ix.sample_index.size() / 2) - 1;
  for (const int64_t s : ix.shuffle_index)
    if (s < 0 || s >= samples) return false;
  return true;
}

bool read_cache(const std::string& path, const std::string& description, const std::vector<int32_t>& sizes,
                GptIndices& ix) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!fs::exists(status)) return false;
  const auto reject = [&](const std::string& why) {
    spdlog::warn("data index cache {} {}: not used, rebuilt", path, why);
    return false;
  };
  // A FIFO would block the open (every rank, past the collective timeout); a directory reads nothing.
  if (!fs::is_regular_file(status)) return reject("is not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return reject(std::string("cannot be opened (") + std::strerror(errno) + ")");
  char magic[8];
  uint64_t counts[6];  // document, sample, shuffle array lengths, epochs, separate final epoch, description bytes
  uint32_t checksum = 0;
  in.read(magic, 8);
  in.read(reinterpret_cast<char*>(counts), sizeof counts);
  in.read(reinterpret_cast<char*>(&checksum), sizeof checksum);
  if (!in) return reject("is shorter than its header");
  if (std::memcmp(magic, kCacheMagic, 8) != 0) return reject("is not a cache file of this version");
  const uint64_t file_size = fs::file_size(path, ec);
  const uint64_t header = 8 + sizeof counts + sizeof checksum;
  // Each count bounded by the file before it is multiplied or allocated.
  if (ec || counts[0] > file_size || counts[1] > file_size || counts[2] > file_size || counts[5] > file_size ||
      file_size != header + counts[5] + 4 * counts[0] + 8 * counts[1] + 8 * counts[2])
    return reject("does not have the size its header gives");
  std::string stored(counts[5], '\0');
  in.read(stored.data(), static_cast<std::streamsize>(stored.size()));
  ix.document_index.resize(counts[0]);
  ix.sample_index.resize(counts[1]);
  ix.shuffle_index.resize(counts[2]);
  ix.num_epochs = static_cast<int64_t>(counts[3]);
  ix.separate_final_epoch = counts[4] != 0;
  in.read(reinterpret_cast<char*>(ix.document_index.data()), static_cast<std::streamsize>(4 * counts[0]));
  in.read(reinterpret_cast<char*>(ix.sample_index.data()), static_cast<std::streamsize>(8 * counts[1]));
  in.read(reinterpret_cast<char*>(ix.shuffle_index.data()), static_cast<std::streamsize>(8 * counts[2]));
  if (!in || in.peek() != EOF) return reject("could not be read whole");
  if (cache_checksum(stored, ix) != checksum) return reject("fails its checksum");
  if (stored != description) return reject("was built from something else (" + stored + ")");
  if (!cache_indices_in_range(ix, sizes)) return reject("holds ids outside this corpus");
  return true;
}

// A cache file is written as <file>.tmp.<host>.<pid> and renamed. What a process killed while
// writing left (SIGKILL, a start-up SIGTERM) is deleted by the next write in that directory from
// the same host, once its pid is gone: another host's may still be writing on a shared disk.
std::string cache_temporary_suffix() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  return ".tmp." + std::string(host) + ".";
}

void cache_remove_stale_temporaries(const fs::path& dir, const std::string& suffix) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const size_t at = name.find(".gptidx" + suffix);
    if (at == std::string::npos) continue;
    const std::string pid_text = name.substr(at + 7 + suffix.size());
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    std::error_code ignored;
    if (fs::remove(it->path(), ignored)) spdlog::info("deleted {}, left by a process that ended while writing it", it->path().string());
  }
}

void write_cache(const std::string& path, const std::string& description, const GptIndices& ix) {
  const std::string suffix = cache_temporary_suffix();
  cache_remove_stale_temporaries(fs::path(path).parent_path(), suffix);
  const std::string tmp = path + suffix + std::to_string(::getpid());
  try {
    std::ofstream out(tmp, std::ios::binary);
    const uint64_t counts[6] = {ix.document_index.size(), ix.sample_index.size(), ix.shuffle_index.size(),
                                static_cast<uint64_t>(ix.num_epochs), ix.separate_final_epoch ? 1u : 0u,
                                description.size()};
    const uint32_t checksum = cache_checksum(description, ix);
    out.write(kCacheMagic, 8);
    out.write(reinterpret_cast<const char*>(counts), sizeof counts);
    out.write(reinterpret_cast<const char*>(&checksum), sizeof checksum);
    out.write(description.data(), static_cast<std::streamsize>(description.size()));
    out.write(reinterpret_cast<const char*>(ix.document_index.data()), static_cast<std::streamsize>(4 * counts[0]));
    out.write(reinterpret_cast<const char*>(ix.sample_index.data()), static_cast<std::streamsize>(8 * counts[1]));
    out.write(reinterpret_cast<const char*>(ix.shuffle_index.data()), static_cast<std::streamsize>(8 * counts[2]));
    out.close();
    if (!out) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
    fs::rename(tmp, path);
  } catch (...) {
    std::error_code ignored;
    fs::remove(tmp, ignored);  // a failed write (a full disk) leaves nothing behind
    throw;
  }
}

struct Component {
  std::unique_ptr<IndexedDataset> data;
  GptIndices indices;
  int64_t num_samples = 0;
  int64_t tokens_per_epoch = 0;  // of its split's documents
};

const std::vector<std::string> kSplitNames = {"train", "valid", "test"};  // by DataSplit

class MegatronSource : public SampleSource {
 public:
  MegatronSource(const Config& c, DataSplit split, int64_t num_samples, int64_t rank, const DataIndexSync& sync,
                 int64_t ranks_on_host)
      : rank_(rank), ranks_on_host_(ranks_on_host), sync_(sync), seq_len_(c.max_target_length), vocab_size_(c.vocab_size), eod_(c.eod_id), pad_(c.pad_id),
        eod_mask_loss_(c.eod_mask_loss), reset_positions_(c.reset_position_ids), reset_attention_(c.reset_attention_mask),
        num_samples_(num_samples) {
    // Megatron (MegatronDataset.__init__) drops a pad id that collides with the EOD id: masking
    // every EOD target as padding would change the loss. (A tokenizer whose pad is its EOS is common.)
    if (pad_ >= 0 && pad_ == eod_) {
      if (rank_ == 0)
        spdlog::warn("pad_id {} equals eod_id: as Megatron's GPTDataset, no token is treated as padding "
                     "(EOD targets keep their loss); set pad_id=-1 to say so", pad_);
      pad_ = -1;
    }
    const DatasetBlend parsed = parse_dataset_path(c.dataset_path);
    const auto& blend = parsed.parts;
    weighted_ = parsed.weighted;
    for (const auto& [w, prefix] : blend) weights_.push_back(w);
    const std::vector<int64_t> sizes = component_sizes(num_samples);
    const int s = static_cast<int>(split);
    std::vector<std::vector<int32_t>> documents(blend.size());  // per dataset: sequence ids; Megatron calls them documents
    std::vector<GptIndicesSize> index_sizes;
    // Files only some ranks can open or split (a node without the mount, a relative dataset_path
    // under another working directory): every rank learns it at the first vote, and all exit with
    // such an error's code, instead of the others exiting 5 in that vote when the rank is gone.
    std::optional<Error> failure;
    try {
      open_components(c, blend, sizes, s, documents, index_sizes);
    } catch (const Error& e) {
      failure = e;
    }
    const int64_t ranks_failing = sync_.vote ? sync_.vote(failure.has_value(), "opening the data files") : 0;
    if (failure) throw *failure;
    if (ranks_failing > 0)
      throw Error(kExitData, "rank " + std::to_string(rank_) + ": " + std::to_string(ranks_failing) +
                                 " other rank(s) could not open or split the " + kSplitNames[s] + " split's files of "
                                 "dataset_path (their messages say why): every rank must read the same files");
    if (!c.allow_memory_overcommit) index_memory_check(blend, index_sizes, split);
    for (size_t d = 0; d < blend.size(); ++d)
      components_[d].indices = cached_indices(c, *components_[d].data, documents[d], s, d, components_[d].num_samples);
    if (blend.size() > 1) gpt_blend_indices(weights_, num_samples, blend_dataset_, blend_sample_);
  }

  bool same_samples_as_built_for(int64_t other_num_samples) const override {
    // The blend's dataset choice for sample s depends on s and the weights alone; each dataset's
    // samples depend on its sample count through its epochs alone (gpt_epochs).
    const std::vector<int64_t> other_sizes = component_sizes(other_num_samples);
    for (size_t d = 0; d < components_.size(); ++d)
      if (!(gpt_epochs(components_[d].tokens_per_epoch, seq_len_, components_[d].num_samples) ==
            gpt_epochs(components_[d].tokens_per_epoch, seq_len_, other_sizes[d])))
        return false;
    return true;
  }

  double index_bytes() const override {
    double bytes = static_cast<double>(blend_dataset_.capacity() * sizeof(int16_t) + blend_sample_.capacity() * sizeof(int64_t));
    for (const auto& comp : components_)
      bytes += static_cast<double>(comp.indices.document_index.capacity() * sizeof(int32_t) +
                                   comp.indices.sample_index.capacity() * sizeof(int64_t) +
                                   comp.indices.shuffle_index.capacity() * sizeof(int64_t));
    return bytes;
  }

  void fill_row(int64_t index, MicroBatch& b, int64_t row) const override {
    if (index >= num_samples_)
      throw Error(kExitData, "global sample " + std::to_string(index) + " is past the " + std::to_string(num_samples_) +
                                 " samples this split was built for");
    const size_t d = blend_dataset_.empty() ? 0 : static_cast<size_t>(blend_dataset_[static_cast<size_t>(index)]);
    const int64_t j = blend_dataset_.empty() ? index : blend_sample_[static_cast<size_t>(index)];
    const Component& comp = components_[d];
    std::vector<int64_t> text;
    text.reserve(static_cast<size_t>(seq_len_ + 1));
    for (const auto& piece : gpt_sample_pieces(comp.indices, comp.data->sequence_lengths(), j)) {
      const size_t before = text.size();
      comp.data->read(piece.document, piece.offset, piece.length, text);
      for (size_t t = before; t < text.size(); ++t)
        if (text[t] < 0 || text[t] >= vocab_size_) {
          // piece.document is a sequence (Megatron samples sequences); name its document too, the
          // input line preprocess_data wrote it from: the last whose first sequence is <= it.
          int64_t low = 0, high = comp.data->num_documents() - 1;
          while (low < high) {
            const int64_t mid = (low + high + 1) / 2;
            if (comp.data->document_index(mid) <= piece.document) low = mid;
            else high = mid - 1;
          }
          throw Error(kExitData, comp.data->prefix() + ".bin: token id " + std::to_string(text[t]) + " in sequence " +
                                     std::to_string(piece.document) + " (document " + std::to_string(low) +
                                     ") at token offset " + std::to_string(piece.offset + static_cast<int64_t>(t - before)) +
                                     " of that sequence is outside [0, vocab_size = " + std::to_string(vocab_size_) + ")");
        }
    }
    const int64_t L = seq_len_, base = row * L;
    int64_t segment = 1, position = 0;
    for (int64_t t = 0; t < L; ++t) {
      const int64_t input = text[static_cast<size_t>(t)], target = text[static_cast<size_t>(t + 1)];
      // Megatron (GPTDataset.__getitem__): pad ids become token 0 after the masks are made from
      // them, so that the embedding never sees the pad id.
      b.inputs[base + t] = input == pad_ ? 0 : input;
      b.targets[base + t] = target == pad_ ? 0 : target;
      // Megatron: no loss on pad targets, nor (eod_mask_loss) where the input is EOD.
      b.loss_mask[base + t] = (target == pad_ || (eod_mask_loss_ && input == eod_)) ? 0.0f : 1.0f;
      b.segment_ids[base + t] = segment;
      b.positions[base + t] = reset_positions_ ? position : t;
      ++position;
      if (input == eod_) {  // the EOD closes its document; the next token starts a new one
        if (reset_attention_) ++segment;
        position = 0;
      }
    }
    b.sample_indices[row] = index;
  }

 private:

  // Opens each prefix of the blend and takes its split: this rank's work alone (no collective).
  void open_components(const Config& c, const std::vector<std::pair<double, std::string>>& blend,
                       const std::vector<int64_t>& sizes, int s, std::vector<std::vector<int32_t>>& documents,
                       std::vector<GptIndicesSize>& index_sizes) {
    for (size_t d = 0; d < blend.size(); ++d) {
      Component comp;
      comp.data = std::make_unique<IndexedDataset>(blend[d].second);
      comp.num_samples = sizes[d];
      // Megatron's GPT splits and samples sequences, not documents (numel_low_level_dataset is
      // sequence_lengths.shape[0]): they differ once a document is empty or holds several sequences.
      const auto bounds = gpt_split_boundaries(c.split, comp.data->num_sequences());
      for (int64_t seq = bounds[s]; seq < bounds[s + 1]; ++seq) documents[d].push_back(static_cast<int32_t>(seq));
      if (documents[d].empty())
        throw Error(kExitData, blend[d].second + ": split \"" + c.split + "\" leaves no sequences for the " +
                                   kSplitNames[s] + " split (" + std::to_string(comp.data->num_sequences()) + " sequences)");
      try {  // the message names the file and the split (empty documents can leave it without tokens)
        comp.tokens_per_epoch = gpt_tokens_per_epoch(comp.data->sequence_lengths(), documents[d]);
      } catch (const Error& e) {
        throw Error(e.exit_code(), blend[d].second + ": the " + kSplitNames[s] + " split (split \"" + c.split + "\", " +
                                       std::to_string(documents[d].size()) + " sequences): " + e.what());
      }
      index_sizes.push_back(gpt_indices_size(comp.data->sequence_lengths(), documents[d], c.max_target_length, sizes[d]));
      components_.push_back(std::move(comp));
    }
  }

  // The index arrays (and a blend's two arrays) live in host memory on every rank: a run whose
  // arrays cannot fit (steps=1000000000 asks for hundreds of GiB) stops here with exit 2 instead
  // of building them for minutes and dying in an allocation.
  void index_memory_check(const std::vector<std::pair<double, std::string>>& blend,
                          const std::vector<GptIndicesSize>& index_sizes, DataSplit split) const {
    double needed = blend.size() > 1 ? 10.0 * static_cast<double>(num_samples_) : 0.0;  // int16 + int64 per sample
    std::string parts = needed > 0 ? "\n  the blend's dataset and sample ids: " + memory_bytes_text(needed) : "";
    for (size_t d = 0; d < blend.size(); ++d) {
      const GptIndicesSize& size = index_sizes[d];
      needed += size.total_bytes();
      parts += "\n  " + blend[d].second + ": " + memory_bytes_text(size.total_bytes()) + " (" +
               std::to_string(components_[d].num_samples) + " samples over " + std::to_string(size.num_epochs) +
               " epoch(s): document index " + memory_bytes_text(size.document_bytes) + ", sample index " +
               memory_bytes_text(size.sample_bytes) + ", shuffle index " + memory_bytes_text(size.shuffle_bytes) + ")";
    }
    const HostMemory host = host_memory_available(ranks_on_host_);
    const double available = host.available_bytes;
    const bool fits = needed <= available;
    // Before any rank builds its arrays (which would shrink what the others see), all agree.
    const int64_t ranks_failing = sync_.vote ? sync_.vote(!fits, "the data index memory check") : 0;
    if (fits && ranks_failing > 0)
      throw config_error("the " + kSplitNames[static_cast<int>(split)] + " split's data index arrays do not fit in host memory on " +
                         std::to_string(ranks_failing) + " other rank(s) (their message names the arrays); "
                         "allow_memory_overcommit=true skips this check");
    if (fits) return;
    const std::string per_rank = ranks_on_host_ > 1 ? " per rank (each rank holds a copy)" : "";
    const std::string covers = split == DataSplit::kTrain
                                   ? "every training sample of the run (steps x global_batch_size): lower steps or global_batch_size"
                               : split == DataSplit::kValid
                                   ? "every evaluation sample of the run (at least (steps / eval_interval + 1) x "
                                     "eval_steps x global_batch_size): lower eval_steps, or raise eval_interval"
                                   : "the test evaluation after training (eval_steps x global_batch_size): lower eval_steps";
    throw config_error("the " + kSplitNames[static_cast<int>(split)] + " split's data index arrays need at least " +
                       memory_bytes_text(needed) + " of host memory for " + std::to_string(num_samples_) + " samples, and " +
                       memory_bytes_text(available) + " is available" + per_rank + " (" + host.source + "):" + parts +
                       "\nthe index covers " + covers + "; allow_memory_overcommit=true skips this check");
  }

  GptIndices cached_indices(const Config& c, const IndexedDataset& data, const std::vector<int32_t>& documents,
                            int split, size_t dataset, int64_t num_samples) {
    // Everything the indices depend on goes into the key: the data (size and a checksum of the
    // index file), which documents, the seed, the sequence length and the sample count.
    const std::string idx_path = data.prefix() + ".idx";
    std::ifstream idx(idx_path, std::ios::binary);
    std::stringstream idx_bytes;
    idx_bytes << idx.rdbuf();
    std::ostringstream desc;
    desc << "GPTDataset v1|" << fs::path(data.prefix()).filename().string() << "|idx crc " << crc32c(idx_bytes.str())
         << "|bin " << fs::file_size(data.prefix() + ".bin") << "|split " << c.split << " #" << split << "|docs "
         << documents.front() << "-" << documents.back() << "|seed " << c.data_shuffle_seed << "|L " << c.max_target_length
         << "|samples " << num_samples;
    char key[16];
    std::snprintf(key, sizeof key, "%08x", crc32c(desc.str()));
    const fs::path dir = c.data_cache_path.empty() ? fs::path(data.prefix()).parent_path() / "cache" : fs::path(c.data_cache_path);
    const std::string file = (dir / (fs::path(data.prefix()).filename().string() + "-" + key + ".gptidx")).string();
    const auto start = std::chrono::steady_clock::now();
    auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
    GptIndices ix;
    // Rank 0 tells the others once the file is there, hit or built, so a rank waits exactly as
    // long as rank 0 takes, and one that still cannot see the file (a cache directory local to
    // its node) builds it at once: polling for the file with a timeout instead made such a rank
    // wait the whole collective timeout, and rank 0 then timed out in the next collective. Every
    // rank hears rank 0 (one that hit its own cache too): the file name holds the key of the
    // data, so ranks reading different files under the same dataset_path (node-local copies that
    // differ) are found here; they used to wait for a file rank 0 never announced, then blame it.
    const std::string slot = kSplitNames[static_cast<size_t>(split)] + " split, dataset " + std::to_string(dataset) +
                             " (" + data.prefix() + "), " + std::to_string(num_samples) + " samples";
    // The vote after the announcement makes a mismatch every rank's exit 3 (rank 0, which cannot
    // compare, used to learn of it only as a peer's death in its next collective, exit 5).
    const auto announce_and_agree = [&](bool cached) {
      const auto rank0 = sync_.announce(slot, {file, cached});
      const bool differs = fs::path(rank0.file).filename() != fs::path(file).filename();
      const int64_t ranks_differing = sync_.vote ? sync_.vote(differs, "the data index agreement") : 0;
      if (differs)
        throw Error(kExitData, "rank " + std::to_string(rank_) + " reads other data than rank 0 for the " + slot +
                                   ": its index is " + fs::path(file).filename().string() + " here and " +
                                   fs::path(rank0.file).filename().string() + " on rank 0 (the name's key covers the " +
                                   ".idx checksum, the .bin size, split, seed, max_target_length and sample count); "
                                   "every rank must read the same files");
      if (ranks_differing > 0)
        throw Error(kExitData, "rank " + std::to_string(rank_) + ": " + std::to_string(ranks_differing) +
                                   " rank(s) read other data than rank 0 for the " + slot +
                                   " (their messages name the index files); every rank must read the same files");
      return rank0;
    };
    const std::vector<int32_t>& sequences = data.sequence_lengths();
    const bool hit = read_cache(file, desc.str(), sequences, ix);
    if (hit) spdlog::info("data index cache hit: {} ({} samples, {:.3f} s)", file, num_samples, elapsed());
    if (rank_ > 0 && sync_.announce) {
      const auto rank0 = announce_and_agree(false);
      if (hit) return ix;
      if (!rank0.cached) {
        spdlog::info("rank {}: rank 0 could not cache the data index {} (see its log); building it on this rank", rank_, file);
      } else if (read_cache(file, desc.str(), sequences, ix)) {
        spdlog::info("data index from rank 0's cache: {} ({:.3f} s)", file, elapsed());
        return ix;
      } else {
        spdlog::warn("rank {}: rank 0's data index {} is not visible here (data_cache_path local to each node?); "
                     "building it on this rank", rank_, file);
      }
    } else if (hit) {
      if (rank_ == 0 && sync_.announce) announce_and_agree(true);
      return ix;
    }
    ix = gpt_build_indices(data.sequence_lengths(), documents, c.max_target_length, num_samples,
                           static_cast<uint32_t>(c.data_shuffle_seed));
    bool cached = false;
    try {
      fs::create_directories(dir);
      write_cache(file, desc.str(), ix);
      cached = true;
      spdlog::info("data index built and cached: {} ({} samples, {} epochs, {:.3f} s)", file, num_samples,
                   ix.num_epochs, elapsed());
    } catch (const std::exception& e) {
      spdlog::warn("data index built in {:.3f} s but not cached ({}); it will be rebuilt next time", elapsed(), e.what());
    }
    // Written or not: the others build what rank 0 could not cache or they cannot read.
    if (rank_ == 0 && sync_.announce) announce_and_agree(cached);
    return ix;
  }

  int64_t rank_, ranks_on_host_;
  DataIndexSync sync_;
  int64_t seq_len_, vocab_size_, eod_, pad_;
  bool eod_mask_loss_, reset_positions_, reset_attention_;
  int64_t num_samples_;
  std::vector<double> weights_;
  bool weighted_ = false;  // dataset_path gave weights (one prefix too): Megatron's blend sizes

  // The samples each dataset is built for: a weighted blend's with their surplus, else the split's.
  std::vector<int64_t> component_sizes(int64_t num_samples) const {
    return weighted_ ? gpt_blend_sizes(weights_, num_samples) : std::vector<int64_t>{num_samples};
  }
  std::vector<Component> components_;
  std::vector<int16_t> blend_dataset_;
  std::vector<int64_t> blend_sample_;
};

}  // namespace

std::unique_ptr<SampleSource> megatron_source(const Config& config, DataSplit split, int64_t num_samples, int64_t rank,
                                              const DataIndexSync& sync, int64_t ranks_on_host) {
  return std::make_unique<MegatronSource>(config, split, num_samples, rank, sync, ranks_on_host);
}

void megatron_dataset_path_check(const Config& config) { (void)parse_dataset_path(config.dataset_path); }

std::string megatron_split_empty(const Config& config, DataSplit split) {
  const int s = static_cast<int>(split);
  for (const auto& [weight, prefix] : parse_dataset_path(config.dataset_path).parts) {
    const IndexedDataset data(prefix);
    const auto bounds = gpt_split_boundaries(config.split, data.num_sequences());
    if (bounds[s] == bounds[s + 1])
      return prefix + ": split \"" + config.split + "\" leaves the " + kSplitNames[s] + " split no sequences (of " +
             std::to_string(data.num_sequences()) + ")";
  }
  return "";
}

}  // namespace trainer
