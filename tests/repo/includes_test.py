#!/usr/bin/env python3
"""Includes flow down the floors (docs/design.md, "The floors"): framework/ → parallel/ → layers/.

Every `#include "..."` of the C++ and CUDA sources under layers/, parallel/ and framework/ is read:
- layers/ includes nothing from parallel/ or framework/;
- parallel/ includes nothing from framework/;
- parallel/ and framework/ include nothing under layers/kernels/: they reach the kernels through the
  host headers of layers/ (a family's mixer, layers/blocks/, layers/kernel_schedule.h).

usage: tests/repo/includes_test.py REPO_ROOT   (exit 0 when clean; else one line per fault, exit 1)
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
# (floor of the including file, prefix it must not include, why)
RULES = (
    ('layers/', 'parallel/', 'layers/ includes nothing from parallel/'),
    ('layers/', 'framework/', 'layers/ includes nothing from framework/'),
    ('parallel/', 'framework/', 'parallel/ includes nothing from framework/'),
    ('parallel/', 'layers/kernels/', 'parallel/ reaches the kernels through the host headers of layers/'),
    ('framework/', 'layers/kernels/', 'framework/ reaches the kernels through the host headers of layers/'),
)


def faults(root):
    found = []
    for top in ('layers', 'parallel', 'framework'):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith(('.h', '.cpp', '.cu', '.cuh')):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root).replace(os.sep, '/')
                for n, line in enumerate(open(path, encoding='utf-8', errors='replace'), 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    for floor, banned, why in RULES:
                        if rel.startswith(floor) and m.group(1).startswith(banned):
                            found.append(f'{rel}:{n} includes {m.group(1)}: {why}')
    return found


def main(root):
    found = faults(root)
    for f in found:
        print(f)
    print(f'includes_test: {len(found)} faults')
    return 1 if found else 0


if __name__ == '__main__':
    if len(sys.argv) != 2:
        sys.exit('usage: tests/repo/includes_test.py REPO_ROOT')
    sys.exit(main(sys.argv[1]))
