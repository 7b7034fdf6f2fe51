// The progress display of roundpipe-train: on a terminal, one line refreshed
// in place (carriage return); otherwise a plain line every `every` steps (and
// at the first and last step), so logs stay readable.
//
//   step 120/300  loss 2.4310  12.3k tok/s  ETA 1m05s  mem cpu:0 3.1M cpu:1 2.9M
//
// Thread-compatible: owned by the training loop's thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace roundpipe {
namespace train {

struct ProgressLine {
  int64_t step = 0;
  int64_t total = 0;
  double loss = 0;
  double tokens_per_s = 0;
  double eta_s = 0;
  std::vector<std::pair<std::string, int64_t>> peak_memory;  // (device, bytes)
};

class Progress {
 public:
  // `out` is stdout or stderr; in-place refresh when it is a terminal.
  // quiet: show nothing. every >= 1.
  Progress(std::FILE* out, bool quiet, int64_t every);
  ~Progress();

  bool in_place() const { return in_place_; }
  void update(const ProgressLine& line);
  // Prints a message on its own line (clearing an in-place line first); the
  // progress line comes back at the next update(). Shown even when quiet
  // (warnings and results).
  void message(const std::string& text);
  // As message(), but not when quiet: what the run is doing (evaluations,
  // checkpoints written).
  void note(const std::string& text) {
    if (!quiet_) message(text);
  }
  // Ends an in-place line with a newline.
  void finish();

 private:
  std::FILE* out_;
  bool quiet_;
  int64_t every_;
  bool in_place_;
  size_t shown_width_ = 0;  // width of the in-place line now on screen (0: none)
};

// "1.5k", "3.2M": a count with an SI suffix.
std::string human_count(double x);
// "12.0M", "1.50G": bytes in binary units (KiB, MiB, GiB written as K, M, G).
std::string human_bytes(int64_t bytes);
// "45s", "3m05s", "2h04m".
std::string human_duration(double seconds);

}  // namespace train
}  // namespace roundpipe
