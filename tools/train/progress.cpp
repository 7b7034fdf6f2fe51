#include "progress.h"

#include <unistd.h>

#include <cmath>

namespace roundpipe {
namespace train {

std::string human_count(double x) {
  char buf[32];
  if (x >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2fG", x / 1e9);
  else if (x >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", x / 1e6);
  else if (x >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fk", x / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", x);
  return buf;
}

std::string human_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.2fG", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024)
    std::snprintf(buf, sizeof buf, "%.1fM", b / (1024.0 * 1024));
  else if (b >= 1024.0)
    std::snprintf(buf, sizeof buf, "%.0fK", b / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%lldB", static_cast<long long>(bytes));
  return buf;
}

std::string human_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long long s = std::llround(seconds);
  char buf[32];
  if (s < 60)
    std::snprintf(buf, sizeof buf, "%llds", s);
  else if (s < 3600)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, (s % 3600) / 60);
  return buf;
}

Progress::Progress(std::FILE* out, bool quiet, int64_t every)
    : out_(out),
      quiet_(quiet),
      every_(every < 1 ? 1 : every),
      in_place_(isatty(fileno(out)) == 1) {}

Progress::~Progress() { finish(); }

void Progress::update(const ProgressLine& p) {
  if (quiet_) return;
  if (!in_place_ && !(p.step == 1 || p.step % every_ == 0 || p.step == p.total)) return;
  char head[160];
  std::snprintf(head, sizeof head, "step %lld/%lld  loss %.4f  %s tok/s  ETA %s",
                static_cast<long long>(p.step), static_cast<long long>(p.total), p.loss,
                human_count(p.tokens_per_s).c_str(), human_duration(p.eta_s).c_str());
  std::string line = head;
  if (!p.peak_memory.empty()) {
    line += "  peak";
    for (const auto& [device, bytes] : p.peak_memory)
      line += " " + device + " " + human_bytes(bytes);
  }
  if (in_place_) {
    // Pad over the previous line's tail; \r returns to the line's start.
    const size_t width = line.size();
    if (width < shown_width_) line.append(shown_width_ - width, ' ');
    std::fprintf(out_, "\r%s", line.c_str());
    shown_width_ = width;
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

void Progress::message(const std::string& text) {
  if (in_place_ && shown_width_ > 0) {
    std::fprintf(out_, "\r%s\r", std::string(shown_width_, ' ').c_str());
    shown_width_ = 0;
  }
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

void Progress::finish() {
  if (in_place_ && shown_width_ > 0) {
    std::fprintf(out_, "\n");
    std::fflush(out_);
    shown_width_ = 0;
  }
}

}  // namespace train
}  // namespace roundpipe
