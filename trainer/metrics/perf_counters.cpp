// Host-read counter and startup timeline (see perf_counters.h).
#include "trainer/metrics/perf_counters.h"

#include <sys/resource.h>
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
struct StartupMark {
  std::string phase;
  double age = 0;          // process age when the phase ended (s)
  double peak_bytes = 0;   // peak resident set size so far (getrusage)
};
std::vector<StartupMark> g_marks;  // startup is single-threaded

double peak_resident_bytes() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;
}
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

void perf_startup_mark(const std::string& phase) {
  g_marks.push_back({phase, perf_process_age_seconds(), peak_resident_bytes()});
}

std::string perf_startup_summary() {
  std::string out;
  double previous = 0;
  char buf[128];
  for (const auto& mark : g_marks) {
    std::snprintf(buf, sizeof buf, "%s%s %.2f s", out.empty() ? "" : ", ", mark.phase.c_str(), mark.age - previous);
    out += buf;
    previous = mark.age;
  }
  std::snprintf(buf, sizeof buf, " = %.2f s from launch", previous);
  out += buf;
  // The peak before the last phase (the first step) is what building and loading the model took.
  if (g_marks.size() >= 2) {
    const auto& before = g_marks[g_marks.size() - 2];
    std::snprintf(buf, sizeof buf, "; peak RSS %.0f MiB by the end of %s, %.0f MiB by the end of %s",
                  before.peak_bytes / (1 << 20), before.phase.c_str(), g_marks.back().peak_bytes / (1 << 20),
                  g_marks.back().phase.c_str());
    out += buf;
  }
  return out;
}

}  // namespace trainer
