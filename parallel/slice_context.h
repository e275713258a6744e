// The slice context: how a layer on this rank reaches the rest of a sequence split over the ranks of
// an sp group (README.md, Design §3). Built here, once per layout, from (sp, scan mode, head groups,
// sequence length); the model hands it to every layer unchanged, so the slice offset is set in one
// place and no caller wraps closures around closures.
#pragma once

#include "layers/blocks/mixer_layer.h"
#include "parallel/process_group.h"
#include "parallel/segments.h"
#include "parallel/state_scan.h"

#include <memory>

namespace carry::parallel {

// This rank's slice of a sequence of `sequence_length` tokens over `sp` (rank r holds tokens
// [r·T/P, (r+1)·T/P)): the offset and length, a mixer runner that scans the state across the ranks
// in `mode` (softmax attention runs locally with its sliding window's halo), and the halo exchange for
// the short convolutions and sliding windows. With one rank: the default context (the whole sequence).
MixerLayerContext make_slice_context(std::shared_ptr<Communicator> sp, ScanMode mode, int head_groups,
                                     int64_t sequence_length);

// The same over ordered segments (parallel/segments.h): the layout agreed over their sp group, the
// layers' states and halos routed through `segments`. The offset is that of segment 0 of this rank;
// the caller sets it for each segment it runs (segment rank × its length).
MixerLayerContext make_segment_context(std::shared_ptr<SegmentCommunicator> segments, int head_groups,
                                       int64_t sequence_length);

}  // namespace carry::parallel
