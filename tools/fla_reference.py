"""flash-linear-attention's models on a CPU: every Triton op FLA's model classes call (Gated DeltaNet,
DeltaNet, GLA, Gated DeltaProduct, KDA, RWKV-7) replaced by FLA's own references — its token recurrences
(`naive_recurrent_gated_delta_rule`, `delta_rule_recurrence`, `naive_recurrent_gla`, `naive_recurrent_kda`,
`naive_recurrent_gated_delta_product`, `dplr_recurrence`) with the in-kernel options applied as FLA's kernels
apply them (`naive_gdn_gate`, `naive_kda_gate`), RWKV-7's references (`torch_addcmul_rwkv7`, `k_update_ref`,
`gate_output_correction_ref`) — and plain torch for the short convolution, the token shift, the RMS norms, the
SwiGLU MLP and the squared ReLU. FLA's layers, blocks and model wiring run as FLA wrote them.
tests/python/fla_class_test.py applies patches() for one test (pytest's monkeypatch); tools/fla_parity.py
--device cpu applies them with use_references()."""
import torch
import torch.nn.functional as F


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


def patches():
    """(object, attribute, replacement) for every Triton op FLA's models call, FLA's reference or plain torch
    in its place (a dict's item where the object is a dict)."""
    out = []
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
            out.append((module, name, fn))

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
    out.append((gdn.GatedDeltaNet, "_use_fused_qkv_conv", lambda self, *a, **kw: False))
    out.append((ACT2FN, "sqrelu", lambda x: F.relu(x).square()))
    out += [(ShortConvolution, "forward", conv), (FusedRMSNormGated, "forward", gated_norm), (RMSNorm, "forward", norm),
            (GatedMLP, "forward", lambda self, x, **kw: self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))]
    return out


def use_references():
    """Applies patches() for the rest of the process (a script's CPU run)."""
    for obj, name, fn in patches():
        if isinstance(obj, dict):
            obj[name] = fn
        else:
            setattr(obj, name, fn)


