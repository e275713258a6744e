"""What tools/fla_kernel_profile.py and tools/fla_kernel_memory.py share: FLA's chunk ops imported (with
FLA 0.6.0's Triton-version guard lifted), and their inputs as FLA's own benchmarks make them (bf16 q, k, v, B = 1;
g fp32, gk and beta bf16)."""
import sys


def load(tool):
    """torch, torch.nn.functional and FLA's ops {name: function}, or exit with one line naming `tool`."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        sys.exit(f'{tool}: no python3 with torch here (run it on the GPU machine)')
    try:
        import fla  # noqa: F401
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gla import chunk_gla
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:
        sys.exit(f'{tool}: FLA is not importable ({e}); install its wheels to a folder on PYTHONPATH '
                 '(pip install --target DIR flash_linear_attention-0.6.0 fla_core-0.6.0, then PYTHONPATH=DIR)')
    # FLA 0.6.0 refuses its gated backward under Triton < 3.7.1 on Hopper;
    # lifting the guard runs the same kernels (a speed and memory anchor only).
    chunk_o.TRITON_ABOVE_3_7_1 = True
    if not torch.cuda.is_available():
        sys.exit(f'{tool}: no CUDA device here')
    fns = {'gated_delta_rule': chunk_gated_delta_rule, 'delta_rule': chunk_delta_rule, 'simple_gla': chunk_simple_gla,
           'gla': chunk_gla, 'linear_attn': chunk_linear_attn}
    return torch, F, fns


def inputs(torch, F, T, H, K, V):
    """The anchor's inputs, each requiring its gradient: {q, k, v, g, gk, beta}."""
    dev, dt = 'cuda', torch.bfloat16
    return {'q': torch.randn(1, T, H, K, device=dev, dtype=dt, requires_grad=True),
            'k': F.normalize(torch.randn(1, T, H, K, device=dev), p=2, dim=-1).to(dt).requires_grad_(),
            'v': torch.randn(1, T, H, V, device=dev, dtype=dt, requires_grad=True),
            'g': F.logsigmoid(torch.randn(1, T, H, device=dev)).requires_grad_(),
            'gk': F.logsigmoid(torch.randn(1, T, H, K, device=dev)).to(dt).requires_grad_(),
            'beta': torch.rand(1, T, H, device=dev, dtype=dt).sigmoid().requires_grad_()}


def ops(fns, x):
    """{name: (a forward returning o, the inputs it reads)} over the inputs x."""
    q, k, v, g, gk, beta = (x[n] for n in ('q', 'k', 'v', 'g', 'gk', 'beta'))
    return {'gated_delta_rule': (lambda: fns['gated_delta_rule'](q, k, v, g, beta)[0], (q, k, v, g, beta)),
            'delta_rule': (lambda: fns['delta_rule'](q, k, v, beta)[0], (q, k, v, beta)),
            'simple_gla': (lambda: fns['simple_gla'](q, k, v, g)[0], (q, k, v, g)),
            'gla': (lambda: fns['gla'](q, k, v, gk)[0], (q, k, v, gk)),
            'linear_attn': (lambda: fns['linear_attn'](q, k, v, normalize=False)[0], (q, k, v))}
