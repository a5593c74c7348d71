// Learning-rate schedules (plain C++, no LibTorch): warmup + cosine, constant, wsd.
#pragma once
#include <cstdint>

#include "trainer/config/config.h"

namespace trainer {

// Learning rate after `update_count` applied updates. Skipped steps do not advance it.
double learning_rate_at(const Config& config, int64_t update_count);

}  // namespace trainer
