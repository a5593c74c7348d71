// Host-read counter and startup timeline (see perf_counters.h).
#include "trainer/metrics/perf_counters.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

namespace trainer {
namespace {
std::atomic<int64_t> g_host_reads{0};
std::vector<std::pair<std::string, double>> g_marks;  // startup is single-threaded
}  // namespace

void perf_note_host_read() { g_host_reads.fetch_add(1, std::memory_order_relaxed); }
int64_t perf_host_reads() { return g_host_reads.load(std::memory_order_relaxed); }

// Age = system uptime - the process's start time (field 22 of /proc/self/stat, in clock ticks
// since boot), so the time the dynamic loader spends on LibTorch before main() is included.
double perf_process_age_seconds() {
  double uptime = 0;
  std::ifstream("/proc/uptime") >> uptime;
  std::ifstream stat_file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');  // the command name may contain spaces
  if (close == std::string::npos) return 0;
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
  }
  const double start = std::stod(field) / static_cast<double>(sysconf(_SC_CLK_TCK));
  return uptime - start;
}

void perf_startup_mark(const std::string& phase) { g_marks.emplace_back(phase, perf_process_age_seconds()); }

std::string perf_startup_summary() {
  std::string out;
  double previous = 0;
  char buf[96];
  for (const auto& [phase, age] : g_marks) {
    std::snprintf(buf, sizeof buf, "%s%s %.2f s", out.empty() ? "" : ", ", phase.c_str(), age - previous);
    out += buf;
    previous = age;
  }
  std::snprintf(buf, sizeof buf, " = %.2f s from launch", previous);
  return out + buf;
}

}  // namespace trainer
