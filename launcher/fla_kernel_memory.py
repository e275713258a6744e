"""The memory of flash-linear-attention's chunk ops, measured as `carry bench kernels` measures carry's (its
"f+b MiB" column): the bytes one forward+backward adds at its peak above the inputs and the output's
gradient (saved tensors, the output, workspaces, the inputs' gradients), from PyTorch's caching allocator,
after one warm-up forward+backward (Triton's autotuning) with the gradients cleared again. bf16 q, k, v, B = 1;
the gates as ../shared/anchors/fla_ops.py makes them (g fp32, gk and beta bf16).

usage (on the GPU machine, FLA's wheels on PYTHONPATH as for the anchors):
  python3 launcher/fla_kernel_memory.py [--heads 16] [--dk 128] [--dv 128] [--T 16384,131072]
                                        [--ops gated_delta_rule,delta_rule,simple_gla,gla,linear_attn]
Prints one markdown row per (op, T)."""
import argparse
import sys

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--heads', type=int, default=16)
    p.add_argument('--dk', type=int, default=128)
    p.add_argument('--dv', type=int, default=128)
    p.add_argument('--T', default='16384,131072')
    p.add_argument('--ops', default='gated_delta_rule,delta_rule,simple_gla,gla,linear_attn')
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit('fla_kernel_memory: no CUDA device here')
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gla import chunk_gla
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:
        sys.exit(f'fla_kernel_memory: flash-linear-attention is not importable ({e}); install the anchors\' '
                 'wheels to a folder on PYTHONPATH first (../shared/anchors/README.md)')
    # The anchors lift FLA 0.6.0's refusal of its gated backward under Triton < 3.7.1 the same way.
    chunk_o.TRITON_ABOVE_3_7_1 = True
    dev, dt, H, K, V = 'cuda', torch.bfloat16, a.heads, a.dk, a.dv
    mib = 1024.0 * 1024.0
    print(f'{torch.cuda.get_device_name()}, torch {torch.__version__}, B=1 H={H} dk={K} dv={V}, bf16')
    print('| op | T | f+b MiB (added at the peak) | inputs and d_o MiB |\n|---|---|---|---|')
    for T in [int(t) for t in a.T.split(',')]:
        q = torch.randn(1, T, H, K, device=dev, dtype=dt, requires_grad=True)
        k = F.normalize(torch.randn(1, T, H, K, device=dev), p=2, dim=-1).to(dt).requires_grad_()
        v = torch.randn(1, T, H, V, device=dev, dtype=dt, requires_grad=True)
        g = F.logsigmoid(torch.randn(1, T, H, device=dev)).requires_grad_()
        gk = F.logsigmoid(torch.randn(1, T, H, K, device=dev)).to(dt).requires_grad_()
        beta = torch.rand(1, T, H, device=dev, dtype=dt).sigmoid().requires_grad_()
        d_o = torch.randn(1, T, H, V, device=dev, dtype=dt)
        ops = {'gated_delta_rule': (lambda: chunk_gated_delta_rule(q, k, v, g, beta)[0], (q, k, v, g, beta)),
               'delta_rule': (lambda: chunk_delta_rule(q, k, v, beta)[0], (q, k, v, beta)),
               'simple_gla': (lambda: chunk_simple_gla(q, k, v, g)[0], (q, k, v, g)),
               'gla': (lambda: chunk_gla(q, k, v, gk)[0], (q, k, v, gk)),
               'linear_attn': (lambda: chunk_linear_attn(q, k, v, normalize=False)[0], (q, k, v))}
        for name in a.ops.split(','):
            if name not in ops:
                sys.exit(f'fla_kernel_memory: unknown op {name!r}; expected one of {", ".join(ops)}')
            fn, used = ops[name]
            held_inputs = sum(x.numel() * x.element_size() for x in used) + d_o.numel() * d_o.element_size()
            try:
                fn().backward(d_o)  # warm-up: autotuning allocates as it likes
                for x in (q, k, v, g, gk, beta):
                    x.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated()
                o = fn()
                o.backward(d_o)
                torch.cuda.synchronize()
                added = torch.cuda.max_memory_allocated() - held
                del o
                for x in (q, k, v, g, gk, beta):
                    x.grad = None
                print(f'| fla.{name} | {T} | {added / mib:.0f} | {held_inputs / mib:.0f} |', flush=True)
            except Exception as e:  # one op failing (out of memory, a Triton error) leaves the others' rows
                print(f'| fla.{name} | {T} | error: {repr(e)[:200]} | |', flush=True)
        del q, k, v, g, gk, beta, d_o
        torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
