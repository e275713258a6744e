#!/usr/bin/env python3
# Where a training step's GPU time goes, by part, from ncu's CSV of one step:
#   mpirun -np 1 ncu --clock-control none --cache-control none --csv --metrics gpu__time_duration.sum \
#     build-gpu/bin/carry train RUN.textproto --set optimizer.total_steps=1 ... > step.csv
#   python3 tools/ncu_step_breakdown.py step.csv
# Prints a markdown table: mixer kernels, the head + loss (the products next to each cross-entropy
# kernel of the chunked loss, and that kernel), the other matrix products, norms and SwiGLU,
# convolutions, the remaining ATen kernels, the optimizer. Kernels are serialized under ncu.
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_csv import read_rows  # noqa: E402


def category(name):
    n = name.lower()
    if any(s in n for s in ('kernels::delta_rule::', 'kernels::decay::', 'kernels::softmax_attn::')):
        return 'mixer kernels'
    if 'conv_fwd_kernel' in n or 'conv_bwd_kernel' in n or 'l2norm' in n:
        return 'short convolutions and L2 norm'
    if 'norm_fwd_kernel' in n or 'norm_bwd_kernel' in n or 'swiglu' in n or 'rows_sum_kernel' in n:
        return 'norms (with residual adds) and SwiGLU'
    if 'adam' in n or 'multi_tensor' in n:
        return 'AdamW and gradient norm'
    if any(s in n for s in ('gemm', 'cutlass', 'xmma', 'nvjet', 'cublas')):
        return 'projections and MLP matrix products'
    return 'remaining ATen kernels'


def is_product(name):
    return any(s in name for s in ('nvjet', 'splitK', 'cutlass', 'gemm'))


def main(path):
    seq = [(kernel, ms) for kernel, metric, ms in read_rows(path, 'ncu_step_breakdown')
           if metric == 'gpu__time_duration.sum']
    loss = set()
    for i, (name, _) in enumerate(seq):
        if not re.search(r'\bce_kernel\b', name):  # carry's loss kernel, not ATen's reduce_kernel
            continue
        loss.add(i)
        j = i - 1
        while j >= 0 and is_product(seq[j][0]):
            loss.add(j)
            j -= 1
        j = i + 1
        while j < len(seq) and is_product(seq[j][0]):
            loss.add(j)
            j += 1
    parts = collections.Counter()
    for i, (name, ms) in enumerate(seq):
        parts['head + loss' if i in loss else category(name)] += ms
    total = sum(parts.values())
    print('| part | ms | share |')
    print('| --- | --- | --- |')
    for part, ms in parts.most_common():
        print(f'| {part} | {ms:.1f} | {100 * ms / total:.0f}% |')
    print(f'| total (kernels, serialized) | {total:.1f} | |')


if __name__ == '__main__':
    if len(sys.argv) != 2:
        sys.exit('usage: tools/ncu_step_breakdown.py STEP.csv')
    main(sys.argv[1])
