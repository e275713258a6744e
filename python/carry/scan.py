"""State summaries, for splitting a sequence yourself: the effect of a slice of tokens on a family's
recurrent state is an affine map S_out = A·S_in + B (layers/mixer.h, docs/design.md). `summarize` gives
a slice's map without its outputs, `compose` chains two maps (first, then second), and `apply` runs a map
on a state. With them, ranks (or any pieces of work) that each hold one slice find their incoming states
by a scan of the summaries, then run their slice from that state:

    s0, s1 = carry.scan.summarize("gated_deltanet", q0, k0, v0, g=g0, beta=beta0), ...
    state_in_1 = carry.scan.apply("gated_deltanet", s0, h0)         # the state after slice 0
    o1, _ = carry.ops.chunk_gated_delta_rule(q1, k1, v1, g1, beta1, initial_state=state_in_1[0], ...)

These take carry's family names (carry.families()) and its state tuples (lists of tensors, as the
family's state names say: gated_deltanet, deltanet, gla and scalar_decay hold S [B, H, K, V];
linear_attn holds S and z [B, H, K]); inputs and gates as in carry.ops ([B, T, H, D], log gates; GLA's
per-key gate is `gk`). Any T works (the slice is padded as in carry.ops). Everything is differentiable.
"""
from collections import namedtuple

import torch
import torch.nn.functional as F

from carry import _library

_library.load()
_ops = torch.ops.carry

Summary = namedtuple("Summary", ["transport", "state"])  # lists of tensors, the family's own layout


def _pad(x, pad):
    return x if x is None or pad == 0 else F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))


def summarize(family, q, k, v, *, g=None, gk=None, beta=None, scale=None, normalize=False, eps=1e-6,
              chunk_size=64):
    """The slice's map (transport A, state B: the slice's final state from the zero state)."""
    pad = (-q.shape[1]) % chunk_size
    q, k, v, g, gk, beta = (_pad(x, pad) for x in (q, k, v, g, gk, beta))
    scale = 0.0 if scale is None else float(scale)
    transport, state = _ops.mixer_summarize(family, q, k, v, g, gk, beta, None, scale, normalize, eps, chunk_size, 0)
    return Summary(list(transport), list(state))


def compose(family, first, second):
    """The map of `first` then `second`: (A2∘A1, A2·B1 + B2)."""
    transport, state = _ops.mixer_compose(family, list(first.transport), list(first.state),
                                          list(second.transport), list(second.state))
    return Summary(list(transport), list(state))


def apply(family, summary, state):
    """The state after the summarized slice, from `state` (a list of tensors, or one tensor)."""
    state = [state] if isinstance(state, torch.Tensor) else list(state)
    return list(_ops.mixer_apply(family, list(summary.transport), list(summary.state), state))
