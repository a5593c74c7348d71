// A minimal TensorBoard event-file writer (scalars only), plain C++: TFRecord framing
// (u64 length, masked CRC32C of the length, data, masked CRC32C of the data) around hand-encoded
// tensorflow.Event protobufs {wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
// summary = 5 {value = 1 {tag = 1 (string), simple_value = 2 (float)}}, session_log = 7 {status = 1
// (enum, START = 1)}}.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace trainer {

// TFRecord's masked CRC32C: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t tensorboard_masked_crc(const std::string& data);

class TensorBoardWriter {
 public:
  // Creates <dir>/events.out.tfevents.<seconds>.<host>[.<nnn>] (nnn: the first free number, 001
  // to 999, when a run of the same second left that name) and writes the file_version event, then a SessionLog
  // START at `first_step`: TensorBoard then drops the points of steps >= first_step that earlier
  // files hold (an interrupted run's steps after its checkpoint, or an earlier run's), as a
  // resume drops them from metrics_file. TensorBoard reads a directory's files in name order,
  // which is the order they were written.
  TensorBoardWriter(const std::string& dir, int64_t first_step);
  ~TensorBoardWriter();
  void tensorboard_add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace trainer
