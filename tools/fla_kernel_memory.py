"""The memory of flash-linear-attention's chunk ops, measured as `carry bench kernels` measures carry's (its
"f+b MiB" column): the bytes one forward+backward adds at its peak above the inputs and the output's
gradient (saved tensors, the output, workspaces, the inputs' gradients), from PyTorch's caching allocator,
after one warm-up forward+backward (Triton's autotuning) with the gradients cleared again. bf16 q, k, v, B = 1;
the gates as tools/fla_common.py makes them (g fp32, gk and beta bf16).

usage (on the GPU machine, FLA's wheels on PYTHONPATH as for the anchors):
  python3 tools/fla_kernel_memory.py [--heads 16] [--dk 128] [--dv 128] [--T 16384,131072]
                                        [--ops gated_delta_rule,delta_rule,simple_gla,gla,linear_attn]
Prints one markdown row per (op, T)."""
import argparse
import sys

import fla_common


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--heads', type=int, default=16)
    p.add_argument('--dk', type=int, default=128)
    p.add_argument('--dv', type=int, default=128)
    p.add_argument('--T', default='16384,131072')
    p.add_argument('--ops', default='gated_delta_rule,delta_rule,simple_gla,gla,linear_attn')
    a = p.parse_args()
    torch, F, fns = fla_common.load('fla_kernel_memory')
    H, K, V = a.heads, a.dk, a.dv
    mib = 1024.0 * 1024.0
    print(f'{torch.cuda.get_device_name()}, torch {torch.__version__}, B=1 H={H} dk={K} dv={V}, bf16')
    print('| op | T | f+b MiB (added at the peak) | inputs and d_o MiB |\n|---|---|---|---|')
    for T in [int(t) for t in a.T.split(',')]:
        x = fla_common.inputs(torch, F, T, H, K, V)
        d_o = torch.randn(1, T, H, V, device='cuda', dtype=torch.bfloat16)
        ops = fla_common.ops(fns, x)
        for name in a.ops.split(','):
            if name not in ops:
                sys.exit(f'fla_kernel_memory: unknown op {name!r}; expected one of {", ".join(ops)}')
            fn, used = ops[name]
            held_inputs = sum(t.numel() * t.element_size() for t in used) + d_o.numel() * d_o.element_size()
            try:
                fn().backward(d_o)  # warm-up: autotuning allocates as it likes
                for t in x.values():
                    t.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated()
                o = fn()
                o.backward(d_o)
                torch.cuda.synchronize()
                added = torch.cuda.max_memory_allocated() - held
                del o
                for t in x.values():
                    t.grad = None
                print(f'| fla.{name} | {T} | {added / mib:.0f} | {held_inputs / mib:.0f} |', flush=True)
            except Exception as e:  # one op failing (out of memory, a Triton error) leaves the others' rows
                print(f'| fla.{name} | {T} | error: {repr(e)[:200]} | |', flush=True)
        del x, d_o, ops
        torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
