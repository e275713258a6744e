#!/usr/bin/env python3
"""Repository text names only paths that exist, and speaks of the project, not of its development.

Every source file, script, config and doc (README.md, docs/, and every file under layers/, parallel/,
framework/, launcher/, tools/, tests/, configs/, .ci/, CMakeLists.txt) is read; each word that looks like
a repository path (it starts with one of the top-level folders) must name a file or folder that exists
(globs such as `layers/kernels/decay/*.cu`, `fwd.*` and brace lists `{fwd,bwd}.cu` are expanded). The
same files must not name development sessions, device calls, scratch folders or the sibling checkout of
shared files. docs/benchmarks/log/ is the dated measurement log: history, exempt from both checks.

usage: tests/repo/paths_test.py REPO_ROOT   (exit 0 when clean; else one line per fault, exit 1)
"""
import glob
import itertools
import os
import re
import sys

TOP = ('layers', 'framework', 'parallel', 'tests', 'launcher', 'tools', 'configs', 'docs', '.ci')
SCANNED_DIRS = TOP
SCANNED_FILES = ('README.md', 'CMakeLists.txt')
EXEMPT_DIRS = ('docs/benchmarks/log',)
TEXT_EXT = ('.h', '.cpp', '.cu', '.cuh', '.py', '.sh', '.md', '.txt', '.proto', '.textproto', '.in', '.inc', '')
# Files the build makes (protoc, configure_file, framework/version_commit.cmake), named by the sources
# that include them.
GENERATED = re.compile(r'\.pb\.(h|cc)$|^tests' r'/paths\.h$|^framework' r'/version_commit\.h$')
PATH_RE = re.compile(r'(?<![\w./-])(?:' + '|'.join(re.escape(t) for t in TOP) + r')/[\w.*{},/-]*[\w*}/]')
# Built from pieces so that this file does not match itself.
HISTORY_RE = re.compile(r'\b[Ss]ess' r'ion [0-9]|\bcall [0-9]|\.kd' r'ev\b|\.\./sh' r'ared|nvidia-h' r'[0-9]+-x[0-9]')


def expand_braces(p):
    m = re.search(r'\{([^{}]*)\}', p)
    if not m:
        return [p]
    return list(itertools.chain.from_iterable(
        expand_braces(p[:m.start()] + alt + p[m.end():]) for alt in m.group(1).split(',')))


def exists(root, p):
    p = p.rstrip('.,;:')
    if '{' in p and '}' not in p:
        p = p.split('{')[0]
    for q in expand_braces(p):
        q = q.rstrip('/') or q
        if GENERATED.search(q):
            continue
        if any(c in q for c in '*?['):
            if not glob.glob(os.path.join(root, q)):
                return False
        elif not os.path.exists(os.path.join(root, q)):
            return False
    return True


def scanned(root):
    for f in SCANNED_FILES:
        if os.path.isfile(os.path.join(root, f)):
            yield f
    for d in SCANNED_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, d)):
            rel = os.path.relpath(dirpath, root)
            if any(rel == e or rel.startswith(e + '/') for e in EXEMPT_DIRS):
                dirnames[:] = []
                continue
            dirnames[:] = [n for n in dirnames if not n.startswith('.') and n != '__pycache__']
            for n in filenames:
                if os.path.splitext(n)[1] in TEXT_EXT:
                    yield os.path.join(rel, n)


def main(root):
    faults = []
    files = 0
    for rel in scanned(root):
        try:
            text = open(os.path.join(root, rel), encoding='utf-8').read()
        except (UnicodeDecodeError, OSError):
            continue
        files += 1
        for n, line in enumerate(text.split('\n'), 1):
            for m in PATH_RE.finditer(line):
                p = m.group(0)
                if '<' in line[m.end():m.end() + 1] or p.endswith('/*/'):
                    continue
                if not exists(root, p):
                    faults.append(f'{rel}:{n}: names {p}, which does not exist')
            if HISTORY_RE.search(line):
                faults.append(f'{rel}:{n}: development history in repository text: {line.strip()[:100]}')
    for f in faults:
        print(f)
    print(f'paths_test: {files} files read, {len(faults)} faults')
    return 1 if faults else 0


if __name__ == '__main__':
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit('usage: tests/repo/paths_test.py REPO_ROOT')
    sys.exit(main(sys.argv[1]))
