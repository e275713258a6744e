// The slice context of a sequence split over an sp group (see the header).
#include "parallel/slice_context.h"

#include "layers/layout.h"
#include "layers/core/nvtx.h"
#include "parallel/halo.h"
#include "parallel/relay.h"

namespace carry::parallel {

namespace {

// The layout is agreed here, once: every rank must run the same sequence length, scan mode and head
// groups; the per-call scans then send no agreement messages.
void agree_layout(Communicator* sp, ScanMode mode, int head_groups, int64_t sequence_length) {
  if (!sp || sp->size() == 1) return;
  const int64_t P = sp->size();
  {
    CommContext cc("slice context: agreeing on the sequence layout");
    auto all = sp->all_gather(at::tensor({sequence_length, static_cast<int64_t>(mode), int64_t{head_groups}}, at::kLong));
    auto text = [](const Tensor& t) {
      auto c = t.contiguous();
      return "(" + join(std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel())) + ")";
    };
    for (int i = 1; i < P; ++i)
      TORCH_CHECK(at::equal(all[i], all[0]), "slice context: sp rank ", i, " runs (sequence length, scan mode, "
                  "head groups) = ", text(all[i]), " but sp rank 0 runs ", text(all[0]));
  }
}

// The context of slice sp->rank() of sp->size(), its layout agreed.
MixerLayerContext route_over(std::shared_ptr<Communicator> sp, ScanMode mode, int head_groups,
                             int64_t sequence_length) {
  MixerLayerContext ctx;
  const int64_t P = sp->size();
  TORCH_CHECK(sequence_length % P == 0, "slice context: a sequence of ", sequence_length,
              " tokens does not split evenly into ", P, " slices");
  ctx.offset = sp->rank() * (sequence_length / P);
  ctx.sequence_length = sequence_length;
  ctx.run_mixer = [sp, mode, head_groups](const Mixer& mixer, const MixerInputs& in, const State& s,
                                          const MixerOptions& o) -> MixerOutput {
    if (mixer.has_summary()) {
      NvtxRange range(std::string("scan ") + scan_mode_name(mode) + " " + mixer.name());
      MixerOptions whole = o;
      whole.offset = 0;  // sp_mixer_forward wants the sequence's first position; rank r runs at r·T/P
      return sp_mixer_forward(mixer, *sp, in, s, whole, mode, head_groups, /*layout_agreed=*/true);
    }
    // Softmax attention: local, its sliding window reaches the previous rank through the halo.
    TORCH_CHECK(o.window > 0, "a full causal softmax attention layer cannot run sequence-parallel (sp = ",
                sp->size(), "); give it a window (mixer_options { kind: \"softmax_attn\" window: ... }) or use sp = 1");
    return mixer.forward(in, s, o);
  };
  // The tokens before this slice (sp rank 0 receives zeros: the sequence's start for a convolution;
  // a sliding window at offset 0 ignores them, see MixerLayer).
  ctx.halo = [sp](const Tensor& x, int64_t n) { return halo_exchange(*sp, x, n); };
  ctx.halo_owned_gradient = [sp](const Tensor& x, int64_t n) { return halo_exchange(*sp, x, n, true); };
  // Rows passed on from rank to rank (softmax attention's sparse patterns with their window's halo).
  ctx.relay = [sp](const Tensor& rows, const Tensor& index, int64_t n) { return relay_exchange(*sp, rows, index, n); };
  return ctx;
}

}  // namespace

MixerLayerContext make_slice_context(std::shared_ptr<Communicator> sp, ScanMode mode, int head_groups,
                                     int64_t sequence_length) {
  if (!sp || sp->size() == 1) return {};
  agree_layout(sp.get(), mode, head_groups, sequence_length);
  return route_over(std::move(sp), mode, head_groups, sequence_length);
}

MixerLayerContext make_segment_context(std::shared_ptr<SegmentCommunicator> segments, int head_groups,
                                       int64_t sequence_length) {
  agree_layout(segments->sp(), ScanMode::ordered, head_groups, sequence_length);
  MixerLayerContext ctx = route_over(segments, ScanMode::ordered, head_groups, sequence_length);
  ctx.serial_states = true;
  return ctx;
}

}  // namespace carry::parallel
