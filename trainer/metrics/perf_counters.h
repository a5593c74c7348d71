// Process-wide performance counters the training loop reports: reads of device values by the
// host (each one a device->host synchronization on a GPU; counted where the code makes them) and
// the startup timeline (process age at named points, from /proc). Plain C++, no LibTorch.
#pragma once
#include <cstdint>
#include <string>

namespace trainer {

void perf_note_host_read();  // call at every .item() / .cpu() of a device value
int64_t perf_host_reads();   // since process start

double perf_process_age_seconds();             // seconds since this process was launched
void perf_startup_mark(const std::string& phase);  // "phase ended now"
// "libraries 0.21 s, config 0.01 s, ..., first step 0.81 s = 1.93 s from launch; peak RSS 310 MiB
// by the end of resume, 402 MiB by the end of first step" (each phase's own duration; the peak
// resident set size of the process so far).
std::string perf_startup_summary();

}  // namespace trainer
