#!/usr/bin/env python3
"""Plots the metrics of one or more carry runs (launcher/plot is the entry point).

Each RUN is a run directory holding metrics.jsonl, or a metrics file itself (logging.metrics_file:
JSON lines written by framework/train/run_log.cpp). Writes into --out (default: the first run's
directory, or plots/ for several runs):
  loss.png          training loss (thin: every record; thick: moving average) and eval loss (dots)
  lr.png            learning rate
  tokens_per_s.png  throughput
  overview.png      the three side by side
with one colour per run, so several runs compare on one figure. --x step|tokens|hours picks the axis.
--print lists what was read instead of (or before) plotting; --no-plot skips the figures.
Records of a step seen twice (a file written by a version that kept duplicates after a resume) count
once: the last one wins.
"""
import argparse
import json
import math
import os
import sys


def read_run(path):
    metrics = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(metrics):
        sys.exit(f"plot: {path}: no metrics file (expected a run directory with metrics.jsonl, or a .jsonl file)")
    name = os.path.basename(os.path.dirname(os.path.abspath(metrics))) if not os.path.isdir(path) else os.path.basename(os.path.abspath(path))
    steps, evals, markers, broken = {}, {}, [], 0
    with open(metrics, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                broken += 1
                continue
            if "event" in r:
                markers.append(r)
            elif "eval_loss" in r:
                evals[r["step"]] = r
            elif "loss" in r:
                steps[r["step"]] = r
    return {"name": name, "file": metrics, "steps": [steps[k] for k in sorted(steps)],
            "evals": [evals[k] for k in sorted(evals)], "markers": markers, "broken": broken}


def x_of(record, axis, run):
    if axis == "tokens":
        return record.get("tokens_seen")
    if axis == "hours":
        e = record.get("elapsed_s")
        return None if e is None else e / 3600.0
    return record["step"]


def tokens_at(run, step):
    """tokens_seen of the step record at or before `step` (eval records have none)."""
    best = None
    for r in run["steps"]:
        if r["step"] <= step:
            best = r
    return None if best is None else best.get("tokens_seen")


def series(run, key, axis):
    xs, ys = [], []
    for r in run["steps"]:
        x, y = x_of(r, axis, run), r.get(key)
        if x is not None and isinstance(y, (int, float)) and math.isfinite(y):
            xs.append(x)
            ys.append(y)
    return xs, ys


def eval_series(run, axis):
    xs, ys = [], []
    for r in run["evals"]:
        if axis == "tokens":
            x = tokens_at(run, r["step"])
        elif axis == "hours":
            x = None
            for s in run["steps"]:
                if s["step"] <= r["step"] and s.get("elapsed_s") is not None:
                    x = s["elapsed_s"] / 3600.0
        else:
            x = r["step"]
        y = r.get("eval_loss")
        if x is not None and isinstance(y, (int, float)) and math.isfinite(y):
            xs.append(x)
            ys.append(y)
    return xs, ys


def moving_average(ys, n):
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= n:
            acc -= ys[i - n]
        out.append(acc / min(i + 1, n))
    return out


def describe(run):
    s, e = run["steps"], run["evals"]
    lines = [f"run {run['name']} ({run['file']}): {len(s)} step records"
             + (f" (steps {s[0]['step']}..{s[-1]['step']})" if s else "")
             + f", {len(e)} evals, {len(run['markers'])} start/resume markers"
             + (f", {run['broken']} unreadable lines" if run["broken"] else "")]
    if s:
        last = s[-1]
        lines.append(f"  last step {last['step']}: loss {last['loss']:.4f}, lr {last.get('lr', float('nan')):.3e}, "
                     f"{last.get('tokens_per_s', float('nan')):.0f} tok/s, tokens seen {last.get('tokens_seen', 0)}")
    if e:
        lines.append(f"  last eval at step {e[-1]['step']}: loss {e[-1]['eval_loss']:.4f}")
    return "\n".join(lines)


def plot(runs, out, axis, smooth):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = {"step": "step", "tokens": "tokens seen", "hours": "elapsed (hours)"}[axis]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    os.makedirs(out, exist_ok=True)

    def draw_loss(ax):
        for i, run in enumerate(runs):
            c = colors[i % len(colors)]
            xs, ys = series(run, "loss", axis)
            if not xs:
                continue
            n = max(1, min(smooth, len(ys) // 5 or 1))
            ax.plot(xs, ys, color=c, alpha=0.25, linewidth=0.8)
            ax.plot(xs, moving_average(ys, n), color=c, linewidth=1.8, label=f"{run['name']} train")
            ex, ey = eval_series(run, axis)
            if ex:
                ax.plot(ex, ey, "o--", color=c, markersize=4, linewidth=1, label=f"{run['name']} eval")
        ax.set_xlabel(label)
        ax.set_ylabel("loss")
        ax.set_title("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    def draw(ax, key, title, log=False):
        for i, run in enumerate(runs):
            xs, ys = series(run, key, axis)
            if xs:
                ax.plot(xs, ys, color=colors[i % len(colors)], linewidth=1.5, label=run["name"])
        ax.set_xlabel(label)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    written = []
    for fname, fn in [("loss.png", draw_loss),
                      ("lr.png", lambda ax: draw(ax, "lr", "learning rate")),
                      ("tokens_per_s.png", lambda ax: draw(ax, "tokens_per_s", "tokens per second"))]:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        fn(ax)
        fig.tight_layout()
        path = os.path.join(out, fname)
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5), dpi=100)
    draw_loss(axes[0])
    draw(axes[1], "lr", "learning rate")
    draw(axes[2], "tokens_per_s", "tokens per second")
    fig.tight_layout()
    path = os.path.join(out, "overview.png")
    fig.savefig(path)
    plt.close(fig)
    written.append(path)
    return written


def main():
    p = argparse.ArgumentParser(prog="launcher/plot", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories or metrics .jsonl files")
    p.add_argument("--out", help="directory for the PNGs")
    p.add_argument("--x", choices=["step", "tokens", "hours"], default="step")
    p.add_argument("--smooth", type=int, default=20, help="moving-average window of the training loss, in records")
    p.add_argument("--print", action="store_true", help="describe what was read")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args()
    runs = [read_run(r) for r in a.runs]
    if a.print:
        for run in runs:
            print(describe(run))
    if a.no_plot:
        return
    if not any(run["steps"] for run in runs):
        sys.exit("plot: no step records to plot")
    out = a.out or (os.path.dirname(os.path.abspath(runs[0]["file"])) if len(runs) == 1 else "plots")
    for path in plot(runs, out, a.x, a.smooth):
        print(f"plot: wrote {path}")


if __name__ == "__main__":
    main()
