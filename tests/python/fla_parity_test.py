"""tools/fla_parity.py, the FLA side of the parity run, against `carry train` on the CPU (fp32): a small
Gated DeltaNet initialised by FLA (`fla_parity.py init`), read by `carry import`, trained for the same steps
by carry (init_from) and by FLA's GatedDeltaNetForCausalLM in PyTorch (`fla_parity.py train`, FLA's Triton
ops replaced by its references as in fla_class_test) on the same unshuffled windows (more sequences than
the file holds windows, so the stream wraps around), the same warmup and cosine schedule, weight decay and
an active gradient clip: every step's loss agrees. Then `fla_parity.py eval` of carry's exported final model
gives `carry eval`'s loss on the same windows, and `fla_parity.py compare` reports the two curves' difference.
Bad inputs (a shuffled run, a file that is not a token file) are refused in one line. Needs --carry-binary."""
import json
import os
import subprocess
import sys

import pytest
import torch

from load_test import _run, _write_tokens

pytest.importorskip("fla", reason="flash-linear-attention is not installed (launcher/python_env installs it)")

from fla_class_test import fla_on_cpu  # noqa: E402,F401  (the fixture)

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "fla_parity.py")

RUN = """name: "parity_test"
seed: 1
model_preset: "tiny.textproto"
init_from: "ck0"
data {{ token_files {{ paths: "train.tok" shuffle: {shuffle} eod_token: -1 }} seq_len: 64 batch_size: 2 }}
optimizer {{ lr: 3e-3 weight_decay: 0.1 grad_clip: 0.5 warmup_steps: 2 total_steps: 6 min_lr_ratio: 0.1 }}
checkpoint {{ dir: "ck" every_steps: 6 }}
logging {{ every_steps: 1 metrics_file: "carry/metrics.jsonl" }}
"""


def _markov_tokens(n, vocab, seed):
    """A token stream with structure (each token picks its successor from four), so the loss falls."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, 4), generator=gen)
    ids, t = [], 0
    for _ in range(n):
        t = int(table[t, int(torch.randint(0, 4, (1,), generator=gen))])
        ids.append(t)
    return ids


def _losses(path):
    out = {}
    for line in open(path, encoding="utf-8"):
        r = json.loads(line)
        if "event" not in r:
            out[r["step"]] = r["loss"]
    return out


def _tool(*args, cwd):
    return subprocess.run([sys.executable, TOOL, *args], cwd=cwd, capture_output=True, text=True)


def test_fla_training_follows_carry_step_for_step(carry_binary, tmp_path, fla_on_cpu, monkeypatch, capsys):
    sys.path.insert(0, os.path.dirname(TOOL))
    import fla_parity
    monkeypatch.chdir(tmp_path)
    _write_tokens(tmp_path / "train.tok", _markov_tokens(7 * 64 + 1, 256, 5))  # 7 windows; 12 sequences are read
    fla_parity.main(["init", "ck0", "--shape", "tiny", "--seed", "3"])
    _run([carry_binary, "import", "ck0", "--model-out", "tiny.textproto"], tmp_path)
    (tmp_path / "run.textproto").write_text(RUN.format(shuffle="false"))
    _run([carry_binary, "train", "run.textproto"], tmp_path)
    fla_parity.main(["train", "ck0", "--run", "run.textproto", "--out", "fla", "--carry", carry_binary,
                     "--device", "cpu"])
    c, f = _losses(tmp_path / "carry" / "metrics.jsonl"), _losses(tmp_path / "fla" / "metrics.jsonl")
    assert sorted(c) == sorted(f) == list(range(1, 7))
    rel = max(abs(c[s] - f[s]) / f[s] for s in c)
    report = (f"[ errors   ] FLA training vs carry train, 6 steps: losses {[round(f[s], 5) for s in sorted(f)]}, "
          f"largest relative difference {rel:.2e}")
    with capsys.disabled():
        print(report)
    assert f[6] < f[1] - 0.05  # it learns
    assert rel < 1e-5

    # --max-minutes: stopped after the first step past the limit, with the weights and the steps done saved.
    fla_parity.main(["train", "ck0", "--run", "run.textproto", "--out", "fla_short", "--carry", carry_binary,
                     "--device", "cpu", "--max-minutes", "1e-9"])
    assert json.loads((tmp_path / "fla_short" / "summary.json").read_text())["steps"] == 1
    assert _losses(tmp_path / "fla_short" / "metrics.jsonl") == {1: f[1]}
    assert (tmp_path / "fla_short" / "model" / "config.json").is_file()

    # FLA's model reads carry's final weights and scores them as carry eval does.
    _run([carry_binary, "export", "ck", "--format", "fla", "--out", "carry_final"], tmp_path)
    _run([carry_binary, "eval", "ck", "--data", "train.tok", "--seq-len", "64", "--batch-size", "1", "--cpu",
          "--max-sequences", "5", "--json", "carry_eval.json"], tmp_path)
    want = json.loads((tmp_path / "carry_eval.json").read_text())["loss"]
    fla_parity.main(["eval", "carry_final", "--tokens", "train.tok", "--seq-len", "64", "--max-sequences", "5",
                     "--device", "cpu", "--json", "fla_eval.json"])
    got = json.loads((tmp_path / "fla_eval.json").read_text())
    with capsys.disabled():
        print(f"[ errors   ] eval of carry's final model: carry eval {want:.6f}, FLA {got['loss']:.6f}")
    assert got["sequences"] == 5 and abs(got["loss"] - want) / want < 1e-5

    # FLA's final model, read by carry eval.
    _run([carry_binary, "eval", "fla/model", "--data", "train.tok", "--seq-len", "64", "--cpu",
          "--max-sequences", "5", "--json", "carry_eval_fla.json"], tmp_path)
    fla_parity.main(["eval", "fla/model", "--tokens", "train.tok", "--seq-len", "64", "--max-sequences", "5",
                     "--device", "cpu", "--json", "fla_eval_fla.json"])
    a = json.loads((tmp_path / "carry_eval_fla.json").read_text())["loss"]
    b = json.loads((tmp_path / "fla_eval_fla.json").read_text())["loss"]
    with capsys.disabled():
        print(f"[ errors   ] eval of FLA's final model: carry eval {a:.6f}, FLA {b:.6f}")
    assert abs(a - b) / b < 1e-5

    capsys.readouterr()
    fla_parity.main(["compare", "carry/metrics.jsonl", "fla/metrics.jsonl", "--window", "2", "--skip", "0",
                     "--json", "compare.json"])
    table = capsys.readouterr().out
    assert table.startswith("| steps |") and "| 6 | 2-step mean |" in table
    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["max_rel_diff"] < 1e-5 and result["steps"] == 6


def test_refuses_what_it_cannot_follow(carry_binary, tmp_path):
    _write_tokens(tmp_path / "train.tok", _markov_tokens(3 * 64 + 1, 256, 5))
    r = _tool("init", "ck0", "--shape", "tiny", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    _run([carry_binary, "import", "ck0", "--model-out", "tiny.textproto"], tmp_path)
    (tmp_path / "run.textproto").write_text(RUN.format(shuffle="true"))
    r = _tool("train", "ck0", "--run", "run.textproto", "--out", "fla", "--carry", carry_binary, "--device", "cpu",
              cwd=tmp_path)
    assert r.returncode == 1 and "shuffle is true" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "bad.tok").write_bytes(b"not a token file at all, no header")
    r = _tool("eval", "ck0", "--tokens", "bad.tok", "--seq-len", "8", "--device", "cpu", cwd=tmp_path)
    assert r.returncode == 1 and "bad.tok: expected a carry token file" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "a.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "b.jsonl").write_text('{"step": 2, "loss": 2.0}\n')
    r = _tool("compare", "a.jsonl", "b.jsonl", cwd=tmp_path)
    assert r.returncode == 1 and "share no logged step" in r.stderr


def test_parity_run_on_the_cpu(carry_binary, tmp_path):
    """launcher/parity_run end to end at the small shape (fp32, FLA's references on the CPU): the carry, fla,
    sp2 and report phases; the curves agree, sp = 2 gives one GPU's two-segment bits, every eval is run."""
    root = os.path.join(os.path.dirname(TOOL), "..")
    _write_tokens(tmp_path / "train.tok", _markov_tokens(9 * 128 + 1, 256, 5))
    _write_tokens(tmp_path / "val.tok", _markov_tokens(3 * 128 + 1, 256, 6))
    r = _tool("init", "w/init", "--shape", "tiny", "--seed", "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    _run([carry_binary, "import", "w/init", "--model-out", "tiny.textproto"], tmp_path)
    t = str(tmp_path)
    (tmp_path / "run.textproto").write_text(f"""name: "parity_run_test"
seed: 1
model_preset: "tiny.textproto"
init_from: "{t}/w/init"
data {{ token_files {{ paths: "{t}/train.tok" eval_paths: "{t}/val.tok" shuffle: false eod_token: -1 }}
        seq_len: 128 batch_size: 1 }}
optimizer {{ lr: 3e-3 grad_clip: 0.5 warmup_steps: 2 total_steps: 12 }}
checkpoint {{ dir: "{t}/w/carry/checkpoints" every_steps: 100 }}
logging {{ every_steps: 1 metrics_file: "{t}/w/carry/metrics.jsonl" }}
""")
    env = dict(os.environ, CARRY_PARITY_DEVICE="cpu", CARRY_PYTHON=sys.executable, OMP_NUM_THREADS="1",
               CARRY_BUILD_DIR=os.path.dirname(os.path.dirname(os.path.abspath(carry_binary))))
    env.pop("OUT", None)
    r = subprocess.run([os.path.join(root, "launcher", "parity_run"), "--run", str(tmp_path / "run.textproto"),
                        "--no-plot", "carry", "fla", "sp2", "report"], cwd=root, env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the same loss bits at all 12 steps" in r.stdout, r.stdout
    assert "not run" not in r.stdout and "| trained by FLA |" in r.stdout, r.stdout
    results = tmp_path / "w" / "results"
    compare = json.loads((results / "compare.json").read_text())
    evals = {n: json.loads((results / f"eval_{n}.json").read_text())["loss"]
             for n in ("carry_by_carry", "carry_by_fla", "fla_by_carry", "fla_by_fla")}
    print(f"[ errors   ] launcher/parity_run on the CPU: curves {compare['max_rel_diff']:.2e}, evals {evals}")
    assert compare["steps"] == 12 and compare["max_rel_diff"] < 1e-5
    assert abs(evals["carry_by_carry"] - evals["carry_by_fla"]) / evals["carry_by_carry"] < 1e-5
    assert abs(evals["fla_by_carry"] - evals["fla_by_fla"]) / evals["fla_by_fla"] < 1e-5
    assert abs(evals["carry_by_carry"] - evals["fla_by_fla"]) / evals["fla_by_fla"] < 1e-4
