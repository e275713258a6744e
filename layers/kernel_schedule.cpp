// The kernel schedules' overrides (see kernel_schedule.h), handed to the kernels of each class.
#include "layers/kernel_schedule.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/decay/api.h"
#include "layers/kernels/delta_rule/api.h"
#include "layers/kernels/selective_scan/api.h"
#endif

namespace carry {

void set_kernel_schedule(const KernelSchedule& s) {
#ifdef CARRY_WITH_CUDA
  kernels::delta_rule::gdn_set_pieces(s.delta_rule_pieces, s.delta_rule_ramp);
  kernels::delta_rule::gdn_set_segments(s.delta_rule_segments);
  kernels::decay::decay_set_segments(s.decay_segments);
  kernels::decay::decay_set_pieces(s.decay_pieces);
  kernels::selective_scan::selective_scan_set_segments(s.scan_segments);
#else
  (void)s;
#endif
}

}  // namespace carry
