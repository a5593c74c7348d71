// TensorBoard event files (see tensorboard.h).
#include "trainer/metrics/tensorboard.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "trainer/util/crc32c.h"
#include "trainer/util/error.h"

namespace trainer {
namespace {

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_tag(std::string& out, int field, int wire_type) { put_varint(out, static_cast<uint64_t>(field << 3 | wire_type)); }

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

template <typename T>
void put_fixed(std::string& out, int field, T value) {  // double (wire type 1) or float (5)
  put_tag(out, field, sizeof(T) == 8 ? 1 : 5);
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t tensorboard_masked_crc(const std::string& data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t first_step) {
  std::error_code ec;
  if (std::filesystem::create_directories(dir, ec), ec)
    throw Error(kExitFailure, "cannot create the TensorBoard directory " + dir + " (enable_tensorboard): " + ec.message());
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  // "wbx" never truncates: a resume within the same second used to overwrite the earlier file.
  const std::string stem = dir + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(now_seconds())) + "." + host;
  path_ = stem;
  for (int n = 1; !(file_ = std::fopen(path_.c_str(), "wbx")) && errno == EEXIST && n < 1000; ++n) {
    char suffix[8];
    std::snprintf(suffix, sizeof suffix, ".%03d", n);  // zero-padded: name order stays write order
    path_ = stem + suffix;
  }
  if (!file_) throw Error(kExitFailure, "cannot create " + path_ + ": " + std::strerror(errno));
  std::string version;
  put_fixed<double>(version, 1, now_seconds());
  put_bytes(version, 3, "brain.Event:2");
  write_record(version);
  std::string start, session_log;
  put_tag(session_log, 1, 0);
  put_varint(session_log, 1);  // SessionLog.START
  put_fixed<double>(start, 1, now_seconds());
  put_tag(start, 2, 0);
  put_varint(start, static_cast<uint64_t>(first_step));
  put_bytes(start, 7, session_log);
  write_record(start);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::tensorboard_add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;
  for (const auto& [tag, value] : values) {
    std::string v;
    put_bytes(v, 1, tag);
    put_fixed<float>(v, 2, static_cast<float>(value));
    put_bytes(summary, 1, v);
  }
  std::string event;
  put_fixed<double>(event, 1, now_seconds());
  put_tag(event, 2, 0);
  put_varint(event, static_cast<uint64_t>(step));
  put_bytes(event, 5, summary);
  write_record(event);
}

void TensorBoardWriter::write_record(const std::string& event) {
  std::string header(8, '\0');
  const uint64_t length = event.size();
  std::memcpy(header.data(), &length, 8);
  const uint32_t header_crc = tensorboard_masked_crc(header), data_crc = tensorboard_masked_crc(event);
  if (std::fwrite(header.data(), 1, 8, file_) != 8 || std::fwrite(&header_crc, 4, 1, file_) != 1 ||
      std::fwrite(event.data(), 1, event.size(), file_) != event.size() || std::fwrite(&data_crc, 4, 1, file_) != 1 ||
      std::fflush(file_) != 0)
    throw Error(kExitFailure, "cannot write " + path_ + ": " + std::strerror(errno));
}

}  // namespace trainer
