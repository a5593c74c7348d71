// Safetensors reader/writer, CRC32C, and durable file writes (see safetensors.h).
#include "trainer/ckpt/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <stdexcept>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/util/json_integer.h"

namespace trainer {
namespace {

[[noreturn]] void io_error(const std::string& what, const std::string& path) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

// Writes all of [data, data+n) to fd, updating crc.
void write_all(int fd, const void* data, size_t n, const std::string& path, uint32_t& crc) {
  const char* p = static_cast<const char*>(data);
  crc = crc32c_update(crc, data, n);
  while (n > 0) {
    const ssize_t written = ::write(fd, p, n);
    if (written < 0) {
      if (errno == EINTR) continue;
      io_error("cannot write", path);
    }
    p += written;
    n -= static_cast<size_t>(written);
  }
}

size_t dtype_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64") return 8;
  if (dtype == "F32" || dtype == "I32") return 4;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16") return 2;
  if (dtype == "U8" || dtype == "I8" || dtype == "BOOL") return 1;
  throw std::runtime_error("unsupported safetensors dtype " + dtype);
}

// An ifstream opens a directory and then reads nothing ("short read"), and a FIFO with no writer
// blocks forever: name them instead.
std::ifstream open_input(const std::string& path, std::ios::openmode mode) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) throw std::runtime_error(path + " is a directory, not a file");
  file_require_regular(path);
  std::ifstream in(path, mode);
  if (!in) io_error("cannot open", path);
  return in;
}

}  // namespace

void file_require_regular(const std::string& path) {
  std::error_code error;
  if (std::filesystem::exists(path, error) && !std::filesystem::is_regular_file(path, error))
    throw std::runtime_error(path + " is not a regular file (a FIFO, socket or device)");
}

uint32_t crc32c_file(const std::string& path, uint64_t* size) {
  std::ifstream in = open_input(path, std::ios::binary);
  std::vector<char> buf(1 << 20);
  uint32_t crc = 0;
  uint64_t total = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto got = static_cast<size_t>(in.gcount());
    crc = crc32c_update(crc, buf.data(), got);
    total += got;
  }
  if (size) *size = total;
  return crc;
}

uint32_t safetensors_write(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                           const std::map<std::string, std::string>& metadata) {
  SafetensorsStreamWriter writer(path, entries, metadata);
  for (const auto& e : entries) writer.append(e.name, e.data, e.nbytes);
  return writer.finish();
}

SafetensorsStreamWriter::SafetensorsStreamWriter(std::string path, std::vector<SafetensorsEntry> entries,
                                                 const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), entries_(std::move(entries)) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& e : entries_) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.nbytes}}};
    offset += e.nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_size = text.size();
  unsigned char size_bytes[8];
  for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<unsigned char>(header_size >> (8 * i));
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) io_error("cannot create", path_);
  write_all(fd_, size_bytes, 8, path_, crc_);
  write_all(fd_, text.data(), text.size(), path_, crc_);
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsStreamWriter::append(const std::string& name, const void* data, size_t nbytes) {
  if (next_ >= entries_.size() || entries_[next_].name != name || entries_[next_].nbytes != nbytes)
    throw std::runtime_error("writing " + path_ + ": got tensor " + name + " (" + std::to_string(nbytes) +
                             " bytes), expected " +
                             (next_ < entries_.size() ? entries_[next_].name + " (" + std::to_string(entries_[next_].nbytes) + " bytes)"
                                                      : std::string("no more tensors")));
  write_all(fd_, data, nbytes, path_, crc_);
  ++next_;
}

uint32_t SafetensorsStreamWriter::finish() {
  if (!complete())
    throw std::runtime_error("writing " + path_ + ": finished after " + std::to_string(next_) + " of " +
                             std::to_string(entries_.size()) + " tensors");
  if (::fsync(fd_) != 0) io_error("cannot fsync", path_);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) io_error("cannot close", path_);
  return crc_;
}

SafetensorsFile safetensors_read(const std::string& path, bool with_data) {
  std::ifstream in = open_input(path, std::ios::binary | std::ios::ate);
  const auto file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  auto fail = [&](const std::string& why) {
    return SafetensorsFormatError("invalid safetensors file " + path + ": " + why);
  };
  if (file_size < 8) throw fail("shorter than its 8-byte header length");
  unsigned char size_bytes[8];
  in.read(reinterpret_cast<char*>(size_bytes), 8);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | size_bytes[i];
  if (header_size > file_size - 8) throw fail("header length " + std::to_string(header_size) + " exceeds the file");
  std::string text(header_size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_size));
  SafetensorsFile file;
  file.data_start = 8 + header_size;
  const uint64_t data_size = file_size - 8 - header_size;
  if (with_data) {
    file.data.resize(data_size);
    in.read(file.data.data(), static_cast<std::streamsize>(file.data.size()));
  }
  if (!in) throw fail("short read");
  nlohmann::json header;
  std::set<std::string> names;
  std::string duplicate;  // a tensor named twice: JSON parsers keep one of the two silently
  try {
    header = nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (depth == 1 && event == nlohmann::json::parse_event_t::key && !names.insert(parsed.get<std::string>()).second &&
          duplicate.empty())
        duplicate = parsed.get<std::string>();
      return true;
    });
  } catch (const std::exception& e) {
    throw fail(std::string("header is not JSON: ") + e.what());
  }
  if (!duplicate.empty()) throw fail("the header names " + duplicate + " twice");
  if (!header.is_object()) throw fail("header is not a JSON object");
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) throw fail("__metadata__ is " + value.dump() + ", not an object of strings");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) throw fail("__metadata__ entry " + k + " is not a string");
        file.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    SafetensorsTensor t;
    try {
      t.dtype = value.at("dtype").get<std::string>();
      const auto& shape = value.at("shape");
      // get<int64_t>() would read 2.5 as 2: a shape entry must be a JSON integer.
      if (!shape.is_array()) throw fail("tensor " + name + ": \"shape\" is not an array");
      for (const auto& d : shape) {
        if (!d.is_number_integer()) throw fail("tensor " + name + ": shape entry " + d.dump() + " is not an integer");
        if (!json_is_int64(d))
          throw fail("tensor " + name + ": shape entry " + d.dump() + " is beyond the 64-bit integer range");
      }
      t.shape = shape.get<std::vector<int64_t>>();
      // get<uint64_t>() would read 0.9 as 0 and -1 as 2^64 - 1.
      const auto& offsets_json = value.at("data_offsets");
      if (!offsets_json.is_array() || offsets_json.size() != 2 || !offsets_json[0].is_number_unsigned() ||
          !offsets_json[1].is_number_unsigned())
        throw fail("tensor " + name + ": \"data_offsets\" is " + offsets_json.dump() + ", not two non-negative integers");
      const auto offsets = offsets_json.get<std::vector<uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size)
        throw fail("tensor " + name + " has data offsets outside the file");
      t.offset = offsets[0];
      t.nbytes = offsets[1] - offsets[0];
    } catch (const nlohmann::json::exception& e) {
      throw fail("tensor " + name + ": " + e.what());
    }
    size_t item = 0;
    try {
      item = dtype_size(t.dtype);
    } catch (const std::exception& e) {
      throw fail("tensor " + name + ": " + e.what());
    }
    // Checked products: a shape whose byte count wraps past 2^64 could otherwise match any size.
    uint64_t bytes = item;
    for (auto d : t.shape) {
      if (d < 0) throw fail("tensor " + name + " has a negative dimension");
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes))
        throw fail("tensor " + name + ": its shape holds more than 2^64 bytes");
    }
    if (bytes != t.nbytes) throw fail("tensor " + name + " size does not match its shape");
    file.tensors[name] = t;
  }
  // As the safetensors format requires (and its reference library checks): the tensors cover
  // the data exactly once, without gaps or overlaps, so no byte is read as two tensors.
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> by_offset;  // empty tensors first at an offset
  for (const auto& [name, t] : file.tensors) by_offset.emplace_back(t.offset, t.nbytes, name);
  std::sort(by_offset.begin(), by_offset.end());
  uint64_t covered = 0;
  for (const auto& [offset, nbytes, name] : by_offset) {
    if (offset != covered)
      throw fail("tensor " + name + " starts at data byte " + std::to_string(offset) + ", not at " +
                 std::to_string(covered) + " where the one before it ends (" + (offset < covered ? "overlap" : "gap") + ")");
    covered += nbytes;
  }
  if (covered != data_size)
    throw fail("the tensors cover " + std::to_string(covered) + " of the " + std::to_string(data_size) + " data bytes");
  return file;
}

std::vector<char> safetensors_read_bytes(std::istream& in, const std::string& path, const SafetensorsFile& header,
                                         const SafetensorsTensor& tensor) {
  std::vector<char> bytes(tensor.nbytes);
  in.clear();  // a failed read before does not stop this one
  in.seekg(static_cast<std::streamoff>(header.data_start + tensor.offset));
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!in) throw SafetensorsFormatError("invalid safetensors file " + path + ": short read");
  return bytes;
}

void file_write_durable(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_error("cannot create", path);
  uint32_t unused = 0;
  try {
    write_all(fd, bytes.data(), bytes.size(), path, unused);
    if (::fsync(fd) != 0) io_error("cannot fsync", path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) io_error("cannot close", path);
}

void directory_sync(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) io_error("cannot open directory", path);
  ::fsync(fd);
  ::close(fd);
}

}  // namespace trainer
