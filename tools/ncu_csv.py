# Reading `ncu --csv` output, for tools/ncu_step_breakdown.py and tools/ncu_kernel_sum.py.
import csv
import sys

# ncu prints a metric's unit beside each value; times in ms, sizes in bytes.
TIME_MS = {'ns': 1e-6, 'nsecond': 1e-6, 'us': 1e-3, 'usecond': 1e-3, 'ms': 1.0, 'msecond': 1.0,
           's': 1e3, 'second': 1e3}
BYTES = {'byte': 1.0, 'Kbyte': 1e3, 'Mbyte': 1e6, 'Gbyte': 1e9, 'KB': 1e3, 'MB': 1e6, 'GB': 1e9}


def read_rows(path, tool):
    """The metric rows of an ncu CSV file, in the file's order: (kernel name, metric name, value), a
    time in ms, a byte count in bytes, any other metric as printed. Exits with one message (naming
    `tool`) when the file cannot be read, holds no ncu rows, or has a unit this does not know."""
    try:
        lines = [l for l in open(path, errors='replace') if l.startswith('"')]
    except OSError as e:
        sys.exit(f"{tool}: cannot read {path}: {e.strerror}")
    rows = list(csv.reader(lines))
    need = ('Kernel Name', 'Metric Name', 'Metric Unit', 'Metric Value')
    if not rows or any(h not in rows[0] for h in need):
        sys.exit(f"{tool}: no ncu CSV rows in {path} (expected the output of ncu --csv --metrics ...)")
    head = rows[0]
    ki, mi, ui, vi = (head.index(x) for x in need)
    out = []
    for n, r in enumerate(rows[1:], start=2):
        if len(r) != len(head) or r[ki] == 'Kernel Name':
            continue
        try:
            v = float(r[vi].replace(',', ''))
        except ValueError:
            continue  # ncu's "n/a"
        unit = r[ui]
        if r[mi].startswith('gpu__time') or unit in TIME_MS:
            if unit not in TIME_MS:
                sys.exit(f"{tool}: {path}, CSV row {n}: unknown time unit '{unit}' for {r[mi]}")
            v *= TIME_MS[unit]
        elif r[mi].startswith('dram__bytes') or unit in BYTES:
            if unit not in BYTES:
                sys.exit(f"{tool}: {path}, CSV row {n}: unknown byte unit '{unit}' for {r[mi]}")
            v *= BYTES[unit]
        out.append((r[ki], r[mi], v))
    return out
