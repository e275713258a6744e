#!/usr/bin/env python3
"""`carry env` lists exactly the environment variables the code reads, and docs/environment.md names each.

Every read goes through knob_value (layers/core/knobs.h): no C++ source but layers/core/knobs.cpp calls
getenv. Read by the sources: every string literal "CARRY_*", "MKL_*" or "ATEN_*" and every getenv("NAME") in the
C++ sources (layers/, parallel/, framework/), and every ${CARRY_*} or $NCCL_NVLS_ENABLE in the launcher
scripts. Listed: `carry env --names`. A variable read but not listed, or listed but read nowhere, or
missing from docs/environment.md, is a fault.

usage: tests/repo/knobs_test.py REPO_ROOT CARRY_BINARY
"""
import os
import re
import subprocess
import sys


def read_names(root):
    names = {}
    getenv_calls = []
    lit = re.compile(r'"((?:CARRY|MKL|ATEN)_[A-Z0-9_]+)"')
    get = re.compile(r'(?:getenv|knob_value)\("([A-Za-z0-9_]+)"\)')
    for top in ('layers', 'parallel', 'framework'):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if not f.endswith(('.h', '.cpp', '.cu', '.cuh')):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                for n, line in enumerate(open(path, encoding='utf-8', errors='replace'), 1):
                    code = line.split('//')[0]
                    if re.search(r'\bgetenv\(', code) and rel != os.path.join('layers', 'core', 'knobs.cpp'):
                        getenv_calls.append(f'{rel}:{n}')
                    for m in lit.finditer(code):
                        names.setdefault(m.group(1), rel)
                    for m in get.finditer(code):
                        names.setdefault(m.group(1), rel)
    shell = re.compile(r'\$\{?(CARRY_[A-Z0-9_]+|NCCL_NVLS_ENABLE)\b')
    launcher = os.path.join(root, 'launcher')
    for f in sorted(os.listdir(launcher)):
        path = os.path.join(launcher, f)
        if os.path.isfile(path):
            for line in open(path, encoding='utf-8', errors='replace'):
                for m in shell.finditer(line.split('#')[0] if not line.lstrip().startswith('#!') else ''):
                    names.setdefault(m.group(1), 'launcher/' + f)
    return names, getenv_calls


def main(root, carry):
    listed = subprocess.run([carry, 'env', '--names'], capture_output=True, text=True, check=True).stdout.split()
    read, getenv_calls = read_names(root)
    doc = open(os.path.join(root, 'docs', 'environment.md'), encoding='utf-8').read()
    faults = [f'{where} calls getenv: read the environment through knob_value (layers/core/knobs.h)'
              for where in getenv_calls]
    for n, where in sorted(read.items()):
        if n not in listed:
            faults.append(f'{where} reads {n}, which `carry env` does not list (add it to layers/core/knobs.cpp)')
    for n in listed:
        if n not in read:
            faults.append(f'`carry env` lists {n}, which nothing reads (remove it from layers/core/knobs.cpp)')
        if f'`{n}`' not in doc:
            faults.append(f'docs/environment.md does not name {n}')
    if len(set(listed)) != len(listed):
        faults.append('`carry env --names` lists a name twice')
    for f in faults:
        print(f)
    print(f'knobs_test: {len(listed)} listed, {len(read)} read, {len(faults)} faults')
    return 1 if faults else 0


if __name__ == '__main__':
    if len(sys.argv) != 3:
        sys.exit('usage: tests/repo/knobs_test.py REPO_ROOT CARRY_BINARY')
    sys.exit(main(sys.argv[1], sys.argv[2]))
