"""carry's exported models in flash-linear-attention's own classes, on the CPU: a small model of each kind that
exports to FLA (Gated DeltaNet with grouped value heads, DeltaNet, GLA, Gated DeltaProduct, KDA, and RWKV-7
with its channel mix, LayerNorms and pre-norm) is trained by
`carry train`, written by `carry export`, loaded strictly into FLA 0.6.0's model class (`from_pretrained`'s
config, `load_state_dict(strict=True)`), and FLA's model gives the logits `carry eval --dump-logits` gives
for the same tokens (fp32). FLA's layers, blocks and model wiring run as FLA wrote them; what FLA computes
with Triton kernels (which need a GPU) is replaced by FLA's own references: its token recurrences
(`naive_recurrent_gated_delta_rule`, `delta_rule_recurrence`, `naive_recurrent_gla`,
`naive_recurrent_kda`, `naive_recurrent_gated_delta_product`, `dplr_recurrence`) with the in-kernel options
applied as FLA's kernels apply them (`naive_gdn_gate`, `naive_kda_gate`), RWKV-7's references
(`torch_addcmul_rwkv7`, `k_update_ref`, `gate_output_correction_ref`), and plain torch for the short
convolution, the token shift, the RMS norms, the SwiGLU MLP and the squared ReLU. Skipped where `fla` does not import (launcher/python_env installs it).
Needs --carry-binary."""
import pytest
import torch
import torch.nn.functional as F

from load_test import RUN, RWKV7, _run, _write_tokens

fla = pytest.importorskip("fla", reason="flash-linear-attention is not installed (launcher/python_env installs it)")

import carry  # noqa: E402  (after the skip)


def _l2(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _delta_inputs(q, k, v, beta, kw):
    """The options FLA's delta-rule kernels apply inside: l2 norm of q and k, sigmoid (doubled) beta, grouped
    value heads (value head j reads query/key head j // (HV / H))."""
    if kw.get("use_qk_l2norm_in_kernel"):
        q, k = _l2(q), _l2(k)
    if kw.get("use_beta_sigmoid_in_kernel"):
        beta = beta.sigmoid()
    if kw.get("allow_neg_eigval") and kw.get("use_beta_sigmoid_in_kernel"):
        beta = beta * 2
    g = v.shape[2] // q.shape[2]
    return q.repeat_interleave(g, 2), k.repeat_interleave(g, 2), beta


def _gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    q, k, beta = _delta_inputs(q, k, v, beta, kw)
    if kw.get("use_gate_in_kernel"):
        g = naive_gdn_gate(g, kw["A_log"], kw.get("dt_bias"))
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale, initial_state, output_final_state)


def _delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False, **kw):
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    q, k, beta = _delta_inputs(q, k, v, beta, kw)
    assert scale is None
    o, s = delta_rule_recurrence(*(x.transpose(1, 2) for x in (q, k, v, beta)), initial_state, output_final_state)
    return o.transpose(1, 2), s


def _gla(q, k, v, g=None, gk=None, scale=None, initial_state=None, output_final_state=False, **kw):
    from fla.ops.gla.naive import naive_recurrent_gla
    assert scale is None
    return naive_recurrent_gla(q, k, v, gk if gk is not None else g, initial_state, output_final_state)


def _kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda
    q, k, beta = _delta_inputs(q, k, v, beta, kw)
    if kw.get("use_gate_in_kernel") and kw.get("lower_bound") is not None:
        g = naive_kda_lowerbound_gate(g, kw["A_log"], kw.get("dt_bias"), kw["lower_bound"])
    elif kw.get("use_gate_in_kernel"):
        g = naive_kda_gate(g, kw["A_log"], kw.get("dt_bias"))
    return naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state)


def _gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None, output_final_state=False,
                         **kw):
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product
    if kw.get("use_qk_l2norm_in_kernel"):
        q, k = _l2(q), _l2(k)
    return naive_recurrent_gated_delta_product(q, k, v, g, beta, q.shape[-1] ** -0.5 if scale is None else scale,
                                               initial_state=initial_state, output_final_state=output_final_state,
                                               num_householder=num_householder)


def _rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, **kw):
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
    K = r.shape[-1]  # dplr_recurrence reads q·K^-1/2: q·K^1/2·scale in, q·scale read (powers of two here)
    t = [x.transpose(1, 2) for x in (r * (K ** 0.5 * scale), k, v, a, b, w)]
    o, s = dplr_recurrence(*t, initial_state=initial_state, output_final_state=output_final_state)
    return o.transpose(1, 2), s


def _token_shift(x, cu_seqlens=None, cache=None, output_cache=False, **kw):
    assert cu_seqlens is None and cache is None
    delta = F.pad(x, (0, 0, 1, -1)) - x
    return (delta, x[:, -1:]) if output_cache else delta


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """FLA's Triton ops replaced by FLA's references and plain torch, for this test only."""
    import fla.layers.delta_net as dn
    import fla.layers.gated_deltanet as gdn
    import fla.layers.gated_deltaproduct as gdp
    import fla.layers.gla as gla
    import fla.layers.kda as kda
    import fla.layers.rwkv7 as rwkv7
    import fla.models.rwkv7.modeling_rwkv7 as rwkv7_model
    from fla.modules.activations import ACT2FN
    from fla.ops.rwkv7.fused_addcmul import torch_addcmul_rwkv7
    from fla.ops.rwkv7.fused_k_update import k_update_ref
    from fla.ops.rwkv7.gate_output_correction import gate_output_correction_ref
    from fla.modules import FusedRMSNormGated, GatedMLP, RMSNorm, ShortConvolution

    for module, names, fn in ((gdn, ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"), _gated_delta_rule),
                              (dn, ("chunk_delta_rule", "fused_recurrent_delta_rule"), _delta_rule),
                              (gla, ("chunk_gla", "fused_recurrent_gla", "fused_chunk_gla"), _gla),
                              (kda, ("chunk_kda", "fused_recurrent_kda"), _kda),
                              (gdp, ("chunk_gated_delta_product",), _gated_delta_product),
                              (gdp, ("fused_recurrent_gated_delta_rule",), _gated_delta_rule),
                              (rwkv7, ("chunk_rwkv7",), _rwkv7), (rwkv7, ("token_shift",), _token_shift),
                              (rwkv7_model, ("token_shift",), _token_shift),
                              (rwkv7, ("fused_addcmul_rwkv7",), torch_addcmul_rwkv7),
                              (rwkv7, ("fused_k_rwkv7",), lambda k, a, ka, **kw: k_update_ref(k, a, ka)),
                              (rwkv7, ("gate_output_correction",), gate_output_correction_ref)):
        for name in names:
            monkeypatch.setattr(module, name, fn)

    def conv(self, x, residual=None, cache=None, output_final_state=False, cu_seqlens=None, **kw):
        assert residual is None and cache is None and cu_seqlens is None
        K = self.weight.shape[-1]
        y = F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), self.weight, self.bias, groups=x.shape[-1]).transpose(1, 2)
        return (F.silu(y) if self.activation in ("silu", "swish") else y), None

    def gated_norm(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        assert residual is None and not prenorm
        return _rms(x, self.weight, self.eps) * (torch.sigmoid(g) if self.activation == "sigmoid" else F.silu(g))

    def norm(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None:
            x = x + residual
        y = _rms(x, self.weight, self.eps)
        return (y, x) if prenorm else y

    # Without a cache, Gated DeltaNet runs its three convolutions as one fused causal_conv1d kernel: the same
    # sums as the three ShortConvolutions it is made of, taken here instead.
    monkeypatch.setattr(gdn.GatedDeltaNet, "_use_fused_qkv_conv", lambda self, *a, **kw: False)
    monkeypatch.setitem(ACT2FN, "sqrelu", lambda x: F.relu(x).square())
    monkeypatch.setattr(ShortConvolution, "forward", conv)
    monkeypatch.setattr(FusedRMSNormGated, "forward", gated_norm)
    monkeypatch.setattr(RMSNorm, "forward", norm)
    monkeypatch.setattr(GatedMLP, "forward", lambda self, x, **kw: self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


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
