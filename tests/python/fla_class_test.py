"""carry's exported models in flash-linear-attention's own classes, on the CPU: a small model of each kind that
exports to FLA (Gated DeltaNet with grouped value heads, DeltaNet, GLA, Gated DeltaProduct, KDA, and RWKV-7
with its channel mix, LayerNorms and pre-norm) is trained by
`carry train`, written by `carry export`, loaded strictly into FLA 0.6.0's model class (`from_pretrained`'s
config, `load_state_dict(strict=True)`), and FLA's model gives the logits `carry eval --dump-logits` gives
for the same tokens (fp32). FLA's layers, blocks and model wiring run as FLA wrote them; what FLA computes
with Triton kernels (which need a GPU) is replaced by FLA's own references (tools/fla_reference.py).
Skipped where `fla` does not import (launcher/python_env installs it).
Needs --carry-binary."""
import os
import sys

import pytest
import torch

from load_test import RUN, RWKV7, _run, _write_tokens

fla = pytest.importorskip("fla", reason="flash-linear-attention is not installed (launcher/python_env installs it)")

import carry  # noqa: E402  (after the skip)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import fla_reference  # noqa: E402


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """FLA's Triton ops replaced by FLA's references and plain torch (tools/fla_reference.py), for this test only."""
    for obj, name, fn in fla_reference.patches():
        if isinstance(obj, dict):
            monkeypatch.setitem(obj, name, fn)
        else:
            monkeypatch.setattr(obj, name, fn)


@pytest.mark.parametrize("kind,conv,tie,dv,extra", [("gated_deltanet", 4, "false", 24, "n_v_heads: 4"),
                                                     ("deltanet", 4, "true", 16, ""),
                                                     ("gla", 0, "true", 24, ""),
                                                     ("gated_deltaproduct", 4, "false", 32,
                                                      "mixer_options { chunk_size: 16 conv_size: 4 num_householder: 2 }"),
                                                     ("kda", 4, "false", 24, ""),
                                                     ("kda", 0, "true", 16, ""),
                                                     ("kda", 4, "false", 16, "mixer_options { chunk_size: 16 conv_size: 4 lower_bound: -3.5 }"),
                                                     ("rwkv7", 0, "false", 16, RWKV7),
                                                     ("rwkv7", 0, "true", 16, RWKV7.replace("true", "false"))])
def test_fla_class_gives_carry_eval_logits(carry_binary, tmp_path, fla_on_cpu, kind, conv, tie, dv, extra):
    import json

    import fla.models
    from transformers import AutoConfig
    gen = torch.Generator().manual_seed(4)
    _write_tokens(tmp_path / "train.tok", torch.randint(0, 256, (600,), generator=gen).tolist())
    run = RUN.format(kind=kind, conv=conv, tie=tie, dv=dv, extra="")
    if extra.startswith("mixer_options"):
        run = run.replace(f"mixer_options {{ chunk_size: 16 conv_size: {conv} }}", extra)
    else:
        run = run.replace("head_dim_v: " + str(dv), f"head_dim_v: {dv} {extra}")
    (tmp_path / "run.textproto").write_text(run)
    _run([carry_binary, "train", "run.textproto"], tmp_path)
    _run([carry_binary, "export", "ck", "--format", "hf", "--out", "hf"], tmp_path)
    # 128 tokens a sequence: FLA's layers take their chunk paths (above 64 tokens), the ones training uses.
    _run([carry_binary, "eval", "ck", "--data", "train.tok", "--seq-len", "128", "--batch-size", "2", "--cpu",
          "--max-sequences", "2", "--dump-logits", "logits.safetensors"], tmp_path)
    config = AutoConfig.from_pretrained(str(tmp_path / "hf"))
    cls = getattr(fla.models, json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0])
    model = cls(config).eval()
    state = carry.model.read_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embeddings.weight"]
    model.load_state_dict(state, strict=True)  # raises on a missing, unexpected or misshapen tensor
    dumped = carry.model.read_safetensors(str(tmp_path / "logits.safetensors"))
    tokens, want = dumped["tokens"].long(), dumped["logits"].float()
    with torch.no_grad():
        got = model(tokens[..., :want.shape[1]]).logits.float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"[ errors   ] FLA {cls.__name__} {extra}: logits vs carry eval {err:.2e}, argmax agree {agree:.4f}")
    assert err < 1e-5
