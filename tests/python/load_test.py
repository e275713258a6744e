"""carry.load: a model `carry export --format hf` wrote gives, in Python, the logits `carry eval
--dump-logits` gives for the same tokens (fp32, CPU): Gated DeltaNet with short convolutions and grouped value
heads, DeltaNet without convolutions and with a tied head, Gated DeltaProduct (two steps a token), GLA, KDA (with and without convolutions), and RWKV-7 as FLA's RWKV7ForCausalLM (LayerNorms,
the channel mix; with the pre-norm and its own head, and without, tied); a folder with a missing or
misshapen tensor is refused naming it. Needs --carry-binary."""
import json
import os
import struct
import subprocess

import pytest
import torch

import carry

RUN = """name: "load_test"
seed: 3
model {{ vocab_size: 257 d_model: 32 n_layers: 2 n_heads: 2 head_dim_k: 16 head_dim_v: {dv} {extra}
        mixers: "{kind}" mixer_options {{ chunk_size: 16 conv_size: {conv} }} tie_embeddings: {tie} init_std: 0.2 }}
data {{ token_files {{ paths: "train.tok" }} seq_len: 48 batch_size: 2 }}
optimizer {{ lr: 1e-2 warmup_steps: 1 total_steps: 3 }}
checkpoint {{ dir: "ck" every_steps: 3 }}
"""


RWKV7 = 'feed_forward: "rwkv7_channel_mix" norm: "layer_norm" pre_norm: true norm_eps: 1e-5 mlp_ratio: 4'


def _write_tokens(path, ids):
    with open(path, "wb") as f:
        f.write(b"CARRYTOK" + struct.pack("<IIQ", 1, 2, len(ids)))
        f.write(struct.pack("<%dH" % len(ids), *ids))


def _run(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr + r.stdout
    return r


@pytest.mark.parametrize("kind,conv,tie,dv,extra", [("gated_deltanet", 4, "false", 24, "n_v_heads: 4"),
                                                     ("deltanet", 0, "true", 16, ""),
                                                     ("gated_deltaproduct", 4, "false", 32, ""),
                                                     ("gla", 0, "false", 24, ""),
                                                     ("kda", 4, "false", 24, ""),
                                                     ("kda", 0, "true", 16, ""),
                                                     ("kda", 4, "false", 16, "mixer_options { kind: \"kda\" lower_bound: -3.5 }"),
                                                     ("rwkv7", 0, "false", 16, RWKV7),
                                                     ("rwkv7", 0, "true", 16, RWKV7.replace("true", "false"))])
def test_load_gives_carry_eval_logits(carry_binary, tmp_path, kind, conv, tie, dv, extra):
    gen = torch.Generator().manual_seed(1)
    _write_tokens(tmp_path / "train.tok", torch.randint(0, 256, (400,), generator=gen).tolist())
    (tmp_path / "run.textproto").write_text(RUN.format(kind=kind, conv=conv, tie=tie, dv=dv, extra=extra))
    _run([carry_binary, "train", "run.textproto"], tmp_path)
    _run([carry_binary, "export", "ck", "--format", "hf", "--out", "hf"], tmp_path)
    _run([carry_binary, "eval", "ck", "--data", "train.tok", "--seq-len", "48", "--batch-size", "2", "--cpu",
          "--dump-logits", "logits.safetensors"], tmp_path)
    dumped = carry.model.read_safetensors(str(tmp_path / "logits.safetensors"))
    tokens, want = dumped["tokens"], dumped["logits"]
    model = carry.load(str(tmp_path / "hf"))
    with torch.no_grad():
        got = model(tokens[..., :want.shape[1]].long())
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"[ errors   ] carry.load {kind} {extra}: logits vs carry eval {err:.2e}")
    assert err < 1e-5


def test_load_refuses_what_does_not_match(carry_binary, tmp_path):
    gen = torch.Generator().manual_seed(2)
    _write_tokens(tmp_path / "train.tok", torch.randint(0, 256, (400,), generator=gen).tolist())
    (tmp_path / "run.textproto").write_text(RUN.format(kind="gated_deltanet", conv=4, tie="true", dv=16, extra=""))
    _run([carry_binary, "train", "run.textproto"], tmp_path)
    _run([carry_binary, "export", "ck", "--format", "hf", "--out", "hf"], tmp_path)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing .* tensors, the first 'model.layers.2"):
        carry.load(str(tmp_path / "hf"))
    config["num_hidden_layers"], config["head_dim"] = 2, 8
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has shape"):
        carry.load(str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="not a directory"):
        carry.load(str(tmp_path / "nothing"))


@pytest.mark.parametrize("key,value,match", [("use_gv", True, "use_gv is True"),
                                             ("use_short_conv", True, "no short convolutions"),
                                             ("gate_logit_normalizer", 8, "gate_logit_normalizer is 8")])
def test_load_refuses_gla_settings_carry_does_not_compute(tmp_path, key, value, match):
    config = {"model_type": "gla", "hidden_size": 32, "num_heads": 2, "num_hidden_layers": 1, "expand_k": 0.5,
              "expand_v": 1.0, "intermediate_size": 64, "vocab_size": 16, "use_short_conv": False, key: value}
    os.makedirs(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=match):
        carry.load(str(tmp_path / "hf"))


@pytest.mark.parametrize("key,value,match", [("lower_bound", 0.5, "lower_bound is 0.5"),
                                             ("allow_neg_eigval", True, "allow_neg_eigval is True"),
                                             ("num_v_heads", 4, "no grouped value heads")])
def test_load_refuses_kda_settings_carry_does_not_compute(tmp_path, key, value, match):
    config = {"model_type": "kda", "hidden_size": 32, "num_heads": 2, "head_dim": 16, "num_hidden_layers": 1,
              "intermediate_size": 64, "vocab_size": 16, key: value}
    os.makedirs(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=match):
        carry.load(str(tmp_path / "hf"))


@pytest.mark.parametrize("key,value,match", [("hidden_act", "relu", "hidden_act is 'relu'"),
                                             ("norm_bias", False, "norm_bias is False"),
                                             ("value_dim", [32, 33], "one width a layer, multiples of num_heads 2")])
def test_load_refuses_rwkv7_settings_carry_does_not_compute(tmp_path, key, value, match):
    config = {"model_type": "rwkv7", "hidden_size": 32, "head_dim": 16, "num_hidden_layers": 2, "intermediate_size": 64,
              "vocab_size": 16, key: value}
    os.makedirs(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=match):
        carry.load(str(tmp_path / "hf"))
