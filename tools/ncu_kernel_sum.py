#!/usr/bin/env python3
# Per-kernel totals from ncu's CSV, to compare stages side by side (carry's kernels, or an anchor's):
#   ncu --clock-control none --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
#     build-gpu/bin/carry bench kernels --families scalar_decay --T 131072 --heads 16 --dk 128 --dv 128 --reps 1 > k.csv
#   python3 tools/ncu_kernel_sum.py k.csv [--per N] [--top K]
# Prints a markdown table, one row per kernel (its name without the argument list), the longest first:
# launches, milliseconds (all launches; divided by N with --per N), milliseconds a launch, DRAM gigabytes
# (divided by N too) and the DRAM rate. `carry bench kernels --reps 1` runs each forward kernel 8 times
# (3 warm-ups and the timed run, of the forward and of forward+backward) and each backward kernel 4 times;
# a walk in pieces launches once a piece. Kernels are serialized under ncu.
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_csv import read_rows  # noqa: E402


def usage(msg):
    sys.stderr.write(f"ncu_kernel_sum: {msg}\n"
                     "usage: tools/ncu_kernel_sum.py NCU.csv [--per N] [--top K]\n")
    sys.exit(2)


def main(argv):
    path, per, top = None, 1.0, 40
    it = iter(argv)
    for a in it:
        if a in ('--per', '--top'):
            v = next(it, None)
            try:
                n = float(v) if a == '--per' else int(v)
            except (TypeError, ValueError):
                usage(f"{a} expects a positive number, got {v!r}")
            if n <= 0:
                usage(f"{a} expects a positive number, got {v!r}")
            per, top = (n, top) if a == '--per' else (per, n)
        elif path is None:
            path = a
        else:
            usage(f"unexpected argument {a!r}")
    if path is None:
        usage("expected the CSV file of an ncu --csv run")
    ms, gb, launches = collections.Counter(), collections.Counter(), collections.Counter()
    for kernel, metric, v in read_rows(path, 'ncu_kernel_sum'):
        name = re.sub(r'\(.*', '', kernel).strip()
        if metric == 'gpu__time_duration.sum':
            ms[name] += v
            launches[name] += 1
        elif metric.startswith('dram__bytes'):
            gb[name] += v / 1e9
    if not ms:
        sys.stderr.write(f"ncu_kernel_sum: no gpu__time_duration.sum rows in {path}\n")
        return 1
    total = sum(ms.values()) / per
    scaled = f" / {per:g}" if per != 1 else ""
    print(f"| kernel | launches | ms{scaled} | ms a launch | DRAM GB{scaled} | TB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, t in sorted(ms.items(), key=lambda kv: -kv[1])[:top]:
        one = t / launches[name]
        dram = f"{gb[name] / per:.2f} | {gb[name] / t:.2f}" if name in gb and t > 0 else " | "
        print(f"| {name} | {launches[name]} | {t / per:.3f} | {one:.3f} | {dram} |")
    print(f"| total (serialized) | {sum(launches.values())} | {total:.3f} | | | |")
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
