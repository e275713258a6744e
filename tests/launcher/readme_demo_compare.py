#!/usr/bin/env python3
"""Compares README.md's sample of the demo with a real run's output (readme_demo_test.sh calls it).

usage: readme_demo_compare.py SAMPLE OUTPUT

Each sample line must match an output line, in order: the same text once numbers are taken out, the
same integers, and fractional figures within 0.01 absolute or 2% relative. The machine-dependent fields
(`| N tok/s`, `| rss N MiB`, `| elapsed T`, `| eta T`) are dropped from both first. Exit 0 when every
line matches; else one line naming the first sample line without a match, exit 1.
"""
import re
import sys

DROP = re.compile(r'\s*\|\s*(?:[0-9.]+ tok/s|rss [0-9.]+ [KMG]iB|elapsed [0-9hms]+|eta [0-9hms]+)')
NUM = re.compile(r'[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?')


def parts(line):
    line = DROP.sub('', line).rstrip()
    return NUM.sub('#', line), NUM.findall(line)


def close(a, b):
    if re.fullmatch(r'[-+]?\d+', a) and re.fullmatch(r'[-+]?\d+', b):
        return a == b
    x, y = float(a), float(b)
    return abs(x - y) <= max(0.01, 0.02 * abs(y))


def main(sample_path, output_path):
    sample = [l for l in open(sample_path).read().split('\n') if l.strip()]
    output = [parts(l) for l in open(output_path, errors='replace').read().split('\n')]
    at = 0
    for want in sample:
        text, nums = parts(want)
        for i in range(at, len(output)):
            t, n = output[i]
            if t == text and len(n) == len(nums) and all(close(a, b) for a, b in zip(n, nums)):
                at = i + 1
                break
        else:
            print(f'readme_demo_compare: no output line (after line {at}) matches the sample line: {want}')
            return 1
    print(f'readme_demo_compare: {len(sample)} sample lines match')
    return 0


if __name__ == '__main__':
    if len(sys.argv) != 3:
        sys.exit('usage: readme_demo_compare.py SAMPLE OUTPUT')
    sys.exit(main(sys.argv[1], sys.argv[2]))
