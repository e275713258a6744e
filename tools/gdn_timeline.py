#!/usr/bin/env python3
# Summarizes the delta rule's pieces-schedule timelines: the "[timeline] ..." lines a run prints with
# CARRY_GDN_TIMELINE=1 (layers/kernels/delta_rule/launch.h, Timeline). For the last forward and the last
# backward schedule of the log: each kernel kind's count, first start, last end and summed spans, then
# every launch in start order.
#   CARRY_GDN_TIMELINE=1 build-gpu/bin/carry bench kernels --families gated_deltanet --T 131072 \
#       --heads 16 --dk 128 --dv 128 --reps 1 > tl.log 2>&1
#   python3 tools/gdn_timeline.py tl.log
import collections
import sys

if len(sys.argv) != 2:
    sys.exit("usage: gdn_timeline.py LOG (a run's output with CARRY_GDN_TIMELINE=1)")
blocks = collections.defaultdict(list)
cur = None
with open(sys.argv[1], errors="replace") as f:
    for line in f:
        if not line.startswith("[timeline]"):
            continue
        parts = line.split()
        if len(parts) == 3 and parts[2] == "begin":
            cur = parts[1]
            blocks[cur].append([])
        elif len(parts) == 6 and cur is not None:
            blocks[cur][-1].append((parts[2], int(parts[3]), float(parts[4]), float(parts[5])))
if not blocks:
    sys.exit(f"gdn_timeline.py: no [timeline] lines in {sys.argv[1]} (was CARRY_GDN_TIMELINE=1 set, and did "
             "the delta rule's bf16 walk run in pieces?)")
for name in ("fwd", "bwd"):
    if not blocks.get(name) or not blocks[name][-1]:
        continue
    spans = blocks[name][-1]
    print(f"== {name}: {len(blocks[name])} schedules, the last ends at {max(s[3] for s in spans):.3f} ms")
    kinds = collections.defaultdict(list)
    for kind, piece, a, b in spans:
        kinds[kind].append((a, b))
    for kind, v in kinds.items():
        v.sort()
        print(f"  {kind:7s} n={len(v):3d}  first start {v[0][0]:.3f}  last end {v[-1][1]:.3f}  "
              f"sum of spans {sum(b - a for a, b in v):.3f}")
    for kind, piece, a, b in sorted(spans, key=lambda s: s[2]):
        print(f"    {kind:7s} {piece:3d} {a:8.3f} {b:8.3f} ({b - a:.3f})")
