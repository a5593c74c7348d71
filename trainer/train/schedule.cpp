// Learning-rate schedules, as a plain function of the number of updates applied so far, so a
// skipped step freezes the schedule. The indexing is Megatron-LM's (OptimizerParamScheduler.get_lr):
// update s of a warmup of W uses peak * s / W, the peak is first used at s = W (MaxText too), and
// the decay reaches the final rate at s = S (MaxText's at S - 1: docs/training.md).
#include <cmath>

#include "trainer/train/schedule.h"

namespace trainer {

double learning_rate_at(const Config& c, int64_t update_count) {
  const double peak = c.learning_rate;
  const double final_lr = peak * c.learning_rate_final_fraction;
  const double total = static_cast<double>(c.learning_rate_schedule_steps);
  const double warmup = std::floor(c.warmup_steps_fraction * total);
  const double s = static_cast<double>(update_count);
  if (s < warmup) return peak * s / warmup;  // linear from 0 (constant too, as Megatron's)
  if (c.lr_schedule_type == "constant") return peak;
  if (s >= total) return final_lr;
  if (c.lr_schedule_type == "cosine") {
    const double progress = (s - warmup) / std::max(total - warmup, 1.0);
    return final_lr + (peak - final_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  // wsd: warmup, stable at the peak, then decay over the last wsd_decay_steps_fraction.
  const double decay = std::floor(c.wsd_decay_steps_fraction * total);
  const double decay_start = total - decay;
  if (s < decay_start) return peak;
  const double progress = (s - decay_start) / std::max(decay, 1.0);
  const double shape = c.wsd_decay_style == "cosine" ? 0.5 * (1.0 + std::cos(M_PI * progress))
                                                     : 1.0 - progress;
  return final_lr + (peak - final_lr) * shape;
}

}  // namespace trainer
