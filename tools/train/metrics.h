// The --metrics file of roundpipe-train: JSON Lines, one object per record,
// flushed after each line so a crashed or running job's file can be read.
//
// Thread-compatible: owned by the training loop's thread.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdio>
#include <string>

namespace roundpipe {
namespace train {

class MetricsWriter {
 public:
  // Disabled (write() does nothing) when `path` is empty. Otherwise creates
  // or truncates `path`; throws std::runtime_error naming it when it cannot.
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  bool enabled() const { return file_ != nullptr; }
  // Appends `record` as one line. Non-finite numbers must already be null
  // (JSON has no inf/NaN). Throws std::runtime_error when writing fails.
  void write(const nlohmann::json& record);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

// `x` as a JSON number, or null when it is not finite.
nlohmann::json finite_or_null(double x);

}  // namespace train
}  // namespace roundpipe
