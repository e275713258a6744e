"""carry from Python: its mixer families as autograd functions with flash-linear-attention's arguments.

    import carry.ops
    o, final_state = carry.ops.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)

`carry.ops` holds the FLA-style functions (docs/python.md lists them and what each supports),
`carry.scan` the state summaries for splitting a sequence yourself, `carry.load(DIR)` an exported model (Gated
DeltaNet, DeltaNet) as a torch.nn.Module (carry.model), and `carry.families()` names every
mixer family of the operator library, which torch.ops.carry exposes with carry's own conventions
(python/csrc/ops.cpp).
"""
import torch

from carry import _library

_library.load()

from carry import ops, scan  # noqa: E402
from carry.model import CarryModel, load  # noqa: E402


def families():
    """The mixer families of carry's registry, by name (layers/mixer.h)."""
    return list(torch.ops.carry.families())


def cuda_kernels():
    """Whether this build holds carry's CUDA kernels (else every family runs its chunkwise form)."""
    return _library.cuda_kernels()


__all__ = ["ops", "scan", "load", "CarryModel", "families", "cuda_kernels"]
