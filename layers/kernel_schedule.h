// Overrides of the kernel forms' automatic schedules, for benchmarks and tests (`carry bench kernels
// --pieces/--ramp/--delta-segments/--decay-segments/--decay-pieces`): how many pieces the delta rule's bf16
// state walk is cut into (and whether its end pieces ramp), how many segments it walks at once, how many segments the decay class's state recurrence runs
// in, and how many pieces its bf16 walk takes. 0 everywhere = automatic (the default). Process-wide;
// a no-op in builds without CUDA. Callers outside layers/ set schedules here, never in the kernels' own
// headers.
#pragma once

namespace carry {

struct KernelSchedule {
  int delta_rule_pieces = 0;     // 1: one walk; 0: automatic
  bool delta_rule_ramp = false;  // forced pieces with shorter end pieces (needs delta_rule_pieces > 0)
  int decay_segments = 0;        // 1: the chunks in order; 0: automatic
  int decay_pieces = 0;          // 1: one walk; 0: automatic
  int scan_segments = 0;         // the selective scan's segments (Mamba-1): 1: in order; 0: automatic
  int delta_rule_segments = 0;   // the delta rule's walk segments at dk = 128: 1: one walk; 0: automatic
};

void set_kernel_schedule(const KernelSchedule& schedule);

}  // namespace carry
