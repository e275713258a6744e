#!/usr/bin/env python3
"""FLA's Triton kernels one by one, to set beside carry's (tools/ncu_kernel_sum.py): on the GPU machine,
with FLA's wheels on PYTHONPATH (installed with pip --target; its autotuning cache,
tools/anchor_cache/, skips most of the tuning):

  python3 tools/fla_kernel_profile.py [--T 131072] [--heads 16] [--dk 128] [--dv 128]
                                         [--ops simple_gla,linear_attn,delta_rule,gated_delta_rule]

For each op, bf16, B = 1, the inputs of tools/fla_common.py: 3 warm-up forward+backward runs,
then 5 under torch.profiler; prints each CUDA kernel's time a run (all its launches in one run) and
its launches a run, the longest first. The backward's gradients are reset before each run, as
fla_ops.py's grad_to_none does."""
import argparse
import collections
import sys

import fla_common


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--T', type=int, default=131072)
    p.add_argument('--heads', type=int, default=16)
    p.add_argument('--dk', type=int, default=128)
    p.add_argument('--dv', type=int, default=128)
    p.add_argument('--ops', default='simple_gla,linear_attn,delta_rule,gated_delta_rule')
    a = p.parse_args()
    torch, F, fns = fla_common.load('fla_kernel_profile')
    T, H, K, V = a.T, a.heads, a.dk, a.dv
    x = fla_common.inputs(torch, F, T, H, K, V)
    ops = {name: fn for name, (fn, _) in fla_common.ops(fns, x).items()}
    from torch.profiler import ProfilerActivity, profile
    reps = 5
    for name in a.ops.split(','):
        if name not in ops:
            sys.exit(f"fla_kernel_profile: unknown op '{name}' (expected one of {', '.join(ops)})")
        fn = ops[name]

        def run():
            for t in x.values():
                t.grad = None
            o = fn()
            o.backward(torch.ones_like(o))
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                run()
            torch.cuda.synchronize()
        us, n = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type.name == 'CUDA':
                us[e.name[:90]] += e.device_time_total
                n[e.name[:90]] += 1
        print(f"\nfla.{name}, T={T}, H={H}, dk={K}, dv={V}, bf16, forward+backward, {torch.cuda.get_device_name()}")
        print("| kernel | launches a run | ms a run |\n| --- | --- | --- |")
        for kname, t in us.most_common():
            print(f"| {kname} | {n[kname] // reps} | {t / reps / 1e3:.3f} |")
        print(f"| total | {sum(n.values()) // reps} | {sum(us.values()) / reps / 1e3:.3f} |", flush=True)


if __name__ == '__main__':
    main()
