#!/usr/bin/env python3
"""tools/wandb_offline.py RUN [--project P] [--name NAME] [--dir DIR] [--config FILE] [--carry BIN]:
a Weights & Biases offline run from what a carry run writes (launcher/wandb runs it with .venv's wandb).

RUN is a run directory holding metrics.jsonl (logging.metrics_file's folder) or a metrics file. Every
record becomes one W&B history row at its step (records of one step, a step's and its evaluation's, are
one row): the step keys under train/ (train/loss, train/grad_norm, train/lr, train/tokens_per_s, ...), the
evaluation keys under eval/ (eval/loss, eval/accuracy, ...). The run's config is the resolved config
(config.textproto: beside the metrics, in its checkpoints/ folder, or --config), flattened to dotted keys
(data.seq_len, optimizer.lr, ...), with carry's version and commit (`carry --version`, else git) and the
CARRY_* variables of this environment (run it from the job that ran carry to record that run's). The run
is written offline (WANDB_MODE=offline) under DIR/wandb/offline-run-*; `wandb sync DIR/wandb/offline-run-*`
uploads it later, from any machine with network access."""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fail(message):
    sys.exit("wandb_offline: " + message)


def metrics_file(run):
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        fail(f"expected a run directory holding metrics.jsonl or a metrics file, got '{run}' ({path} is not a file)")
    return path


def read_records(path):
    """The metrics file's records in order; a line that is not a JSON object stops with its line number."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{path}:{n}: not a JSON record ({e.msg} at column {e.colno})")
            if not isinstance(rec, dict):
                fail(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
            out.append(rec)
    return out


def history_rows(records):
    """[(step, {key: value})]: one row a step, in the file's order; markers (event) are left out, and so are
    non-numeric values (null: a non-finite loss)."""
    rows, index = [], {}
    for rec in records:
        if "event" in rec or "step" not in rec:
            continue
        step = int(rec["step"])
        row = {}
        for k, v in rec.items():
            if k in ("step", "time") or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            row[k.replace("eval_", "eval/", 1) if k.startswith("eval_") else "train/" + k] = v
        if step not in index:
            index[step] = len(rows)
            rows.append((step, {}))
        rows[index[step]][1].update(row)
    steps = [s for s, _ in rows]
    if steps != sorted(steps):
        fail("the metrics file's steps go back (a file from two runs?): " + str(steps[:20]))
    return rows


def flatten_textproto(text):
    """A textproto's fields as dotted keys: `data { seq_len: 64 }` -> {"data.seq_len": 64}; repeated fields
    become lists; numbers, booleans and enum names as such, quoted strings unquoted."""
    tokens = re.findall(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[{}:]|[^\s{}:"\']+', re.sub(r"#[^\n]*", "", text))
    out, path, i = {}, [], 0

    def value(tok):
        if tok[0] in "\"'":
            return bytes(tok[1:-1], "utf-8").decode("unicode_escape")
        if tok in ("true", "false"):
            return tok == "true"
        try:
            return int(tok)
        except ValueError:
            try:
                return float(tok)
            except ValueError:
                return tok

    while i < len(tokens):
        tok = tokens[i]
        if tok == "}":
            if not path:
                fail("the config has an unmatched '}'")
            path.pop()
            i += 1
            continue
        name = tok
        if i + 1 < len(tokens) and tokens[i + 1] == ":":
            i += 2
            if i < len(tokens) and tokens[i] == "{":
                path.append(name)
                i += 1
                continue
            key = ".".join(path + [name])
            v = value(tokens[i])
            if key in out:
                out[key] = (out[key] if isinstance(out[key], list) else [out[key]]) + [v]
            else:
                out[key] = v
            i += 1
        elif i + 1 < len(tokens) and tokens[i + 1] == "{":
            path.append(name)
            i += 2
        else:
            fail(f"the config is not a textproto near '{name}'")
    return out


def find_config(run, given):
    if given:
        if not os.path.isfile(given):
            fail(f"--config: no file '{given}'")
        return given
    base = run if os.path.isdir(run) else os.path.dirname(os.path.abspath(run))
    for cand in (os.path.join(base, "config.textproto"), os.path.join(base, "checkpoints", "config.textproto")):
        if os.path.isfile(cand):
            return cand
    return None


def carry_version(binary):
    for cmd in ([binary, "--version"] if binary else [], [os.path.join(ROOT, "build", "bin", "carry"), "--version"]):
        if cmd and os.path.isfile(cmd[0]):
            try:
                return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
            except (OSError, subprocess.SubprocessError, IndexError):
                pass
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=30).stdout.strip()
        return "commit " + commit if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--project", default="carry")
    ap.add_argument("--name", default=None, help="the run's name (default: the run directory's name)")
    ap.add_argument("--dir", default=None, help="where the offline run goes (default: RUN)")
    ap.add_argument("--config", default=None, help="the resolved config (default: found beside the metrics)")
    ap.add_argument("--carry", default=None, help="the carry binary whose --version is recorded")
    a = ap.parse_args()

    path = metrics_file(a.run)
    rows = history_rows(read_records(path))
    if not rows:
        fail(f"{path} holds no step or evaluation records")
    config = {}
    cfg_path = find_config(a.run, a.config)
    if cfg_path:
        with open(cfg_path, encoding="utf-8") as f:
            config.update(flatten_textproto(f.read()))
    config["carry.version"] = carry_version(a.carry)
    config["carry.config_file"] = cfg_path or "(none found)"
    for k in sorted(os.environ):
        if k.startswith("CARRY_"):
            config["env." + k] = os.environ[k]

    try:
        import wandb
    except ImportError:
        fail("the wandb package is not installed (launcher/wandb installs it into .venv)")
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    out_dir = a.dir or (a.run if os.path.isdir(a.run) else os.path.dirname(os.path.abspath(a.run)))
    name = a.name or os.path.basename(os.path.abspath(out_dir))
    run = wandb.init(project=a.project, name=name, dir=out_dir, config=config, mode="offline")
    for step, row in rows:
        run.log(row, step=step)
    run_dir = run.dir
    run.finish()
    offline = os.path.dirname(run_dir.rstrip("/")) if os.path.basename(run_dir.rstrip("/")) == "files" else run_dir
    print(f"wandb_offline: {len(rows)} steps of {path} written to {offline}; upload with: wandb sync {offline}")


if __name__ == "__main__":
    main()
