"""carry.ops (python/carry/ops.py) against the fp64 token recurrences of reference.py: outputs, final
states and the gradients of every input and of the initial state, for every function and the FLA
options it maps; torch.autograd.gradcheck of each function on tiny shapes; the errors it raises for
what it does not take; and one run compared with the C++ program's `carry mixer` on the same tensors.
On a CUDA machine with a kernel build, the kernel forms against the same references (skipped elsewhere).
"""
import json
import os
import struct
import subprocess

import pytest
import torch
import torch.nn.functional as F

import carry
import carry.ops as ops
import reference as ref

F64 = torch.float64


def leaf(x):
    return x.detach().clone().requires_grad_(True)


def randn(*shape, seed, device="cpu", dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(device=device, dtype=dtype)


def unit_keys(*shape, seed):
    return ref.l2norm(randn(*shape, seed=seed))


def flat(x):
    if x is None:
        return []
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in flat(y)]
    return [x]


def loss_and_grads(outputs, inputs, seed=7):
    """Σ outputs·w for fixed random w, and its gradient for each input."""
    outs = flat(outputs)
    loss = sum((o.double() * randn(*o.shape, seed=seed + i, device=o.device)).sum() for i, o in enumerate(outs))
    return outs, torch.autograd.grad(loss, inputs, allow_unused=True)


def assert_close(got, want, tol, what):
    assert got is not None and want is not None, f"{what}: missing"
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)} against {list(want.shape)}"
    err = (got.double().cpu() - want.double().cpu()).abs().max().item()
    scale = max(want.double().abs().max().item(), 1e-30)
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} against max |reference| {scale:.3e}"


def compare(run_carry, run_ref, inputs, tol=1e-11, names=None):
    """run_carry(*leaves) and run_ref(*leaves) -> the same nested outputs; outputs and gradients close."""
    a = [leaf(x) for x in inputs]
    b = [leaf(x) for x in inputs]
    got, got_grads = loss_and_grads(run_carry(*a), a)
    want, want_grads = loss_and_grads(run_ref(*b), b)
    assert len(got) == len(want)
    for i, (x, y) in enumerate(zip(got, want)):
        assert_close(x, y, tol, f"output {i}")
    names = names or [f"input {i}" for i in range(len(inputs))]
    for n, x, y in zip(names, got_grads, want_grads):
        if y is None:
            continue
        assert_close(x, y, tol, f"gradient of {n}")


# Shapes: T = 10 with chunk_size 4 runs three chunks, the last one padded.
B, T, H, K, V = 2, 10, 2, 4, 3
CHUNK = 4


def gdn_inputs(seed=0, hv=H):
    return [randn(B, T, H, K, seed=seed), unit_keys(B, T, H, K, seed=seed + 1), randn(B, T, hv, V, seed=seed + 2),
            F.logsigmoid(randn(B, T, hv, seed=seed + 3)), torch.sigmoid(randn(B, T, hv, seed=seed + 4)),
            randn(B, hv, K, V, seed=seed + 5)]


@pytest.mark.parametrize("form", ["chunkwise", "naive", None])
def test_gated_delta_rule(form):
    compare(lambda q, k, v, g, beta, h0: ops.chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=CHUNK, form=form),
            lambda q, k, v, g, beta, h0: ref.delta_rule(q, k, v, beta, g=g, initial_state=h0),
            gdn_inputs(), names=["q", "k", "v", "g", "beta", "initial_state"])


def deltaproduct_inputs(n, seed=40):
    """Gated DeltaProduct's inputs with n sub-steps a token: unit keys, β in (0, 2) (negative eigenvalues
    too), half-lives from about a token up."""
    return [randn(B, T, H, K, seed=seed), unit_keys(B, T * n, H, K, seed=seed + 1), randn(B, T * n, H, V, seed=seed + 2),
            F.logsigmoid(randn(B, T, H, seed=seed + 3)), 2 * torch.sigmoid(randn(B, T * n, H, seed=seed + 4)),
            randn(B, H, K, V, seed=seed + 5)]


@pytest.mark.parametrize("form", ["chunkwise", "naive", None])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_gated_delta_product(form, n):
    """chunk_gated_delta_product against reference.delta_product (FLA's naive recurrence): o, the final state
    and the gradient of q, k, v, g, beta and the initial state, T = 10 tokens over chunks of 4."""
    compare(lambda q, k, v, g, beta, h0: ops.chunk_gated_delta_product(
                q, k, v, g, beta, n, initial_state=h0, output_final_state=True, chunk_size=CHUNK, form=form),
            lambda q, k, v, g, beta, h0: ref.delta_product(q, k, v, g, beta, n, initial_state=h0),
            deltaproduct_inputs(n), names=["q", "k", "v", "g", "beta", "initial_state"])


def test_gated_delta_product_options():
    """Packed sequences (cu_seqlens in tokens), no gate, l2-normalized q and k, a scale; and what is refused."""
    n = 2
    q, k, v, g, beta, _ = deltaproduct_inputs(n, seed=50)
    q1, k1, v1, g1, b1 = (x[:1] for x in (q, k, v, g, beta))
    cu = torch.tensor([0, 3, 3, 10])
    o, S = ops.chunk_gated_delta_product(q1, k1, v1, g1, b1, n, output_final_state=True, cu_seqlens=cu,
                                         chunk_size=CHUNK)
    for i, (bos, eos) in enumerate([(0, 3), (3, 3), (3, 10)]):
        want_o, want_S = ref.delta_product(q1[:, bos:eos], k1[:, bos * n:eos * n], v1[:, bos * n:eos * n],
                                           g1[:, bos:eos], b1[:, bos * n:eos * n], n)
        if eos > bos:
            assert_close(o[:, bos:eos], want_o, 1e-11, f"o of sequence {i}")
        assert_close(S[i:i + 1], want_S, 1e-11, f"final state of sequence {i}")
    o, S = ops.chunk_gated_delta_product(q * 3, k * 2, v, None, beta, n, scale=0.3, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, chunk_size=CHUNK)
    want_o, want_S = ref.delta_product(ref.l2norm(q * 3), ref.l2norm(k * 2), v, None, beta, n, scale=0.3)
    assert_close(o, want_o, 1e-11, "o without a gate")
    assert_close(S, want_S, 1e-11, "final state without a gate")
    with pytest.raises(ValueError, match=r"k must be \[B, T\*num_householder, H, K\]"):
        ops.chunk_gated_delta_product(q, k[:, :T], v, g, beta, n)
    with pytest.raises(ValueError, match=r"beta must be \[B, T\*num_householder, H\]"):
        ops.chunk_gated_delta_product(q, k, v, g, beta[:, :T], n)
    with pytest.raises(ValueError, match="num_householder must be a positive int"):
        ops.chunk_gated_delta_product(q, k, v, g, beta, 0)
    with pytest.raises(NotImplementedError, match="cp_context"):
        ops.chunk_gated_delta_product(q, k, v, g, beta, n, cp_context=object())


def test_fused_recurrent_functions():
    """FLA's fused_recurrent_* names: the same recurrences as the chunk_* functions (reference.py), with their
    defaults (beta ones) and gk / g + gk for the gated delta rule; what they do not take is refused."""
    q, k, v, g, beta, h0 = gdn_inputs(seed=60)
    gk = F.logsigmoid(randn(B, T, H, K, seed=66))
    o, S = ops.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True)
    want_o, want_S = ref.delta_rule(q, k, v, beta, g=g, initial_state=h0)
    assert_close(o, want_o, 1e-11, "gated delta rule, g: o")
    assert_close(S, want_S, 1e-11, "gated delta rule, g: final state")
    o, S = ops.fused_recurrent_gated_delta_rule(q, k, v, g=g, gk=gk, beta=beta, initial_state=h0,
                                                output_final_state=True)
    want_o, want_S = ref.kda(q, k, v, gk + g.unsqueeze(-1), beta, initial_state=h0)
    assert_close(o, want_o, 1e-11, "gated delta rule, g and gk: o")
    assert_close(S, want_S, 1e-11, "gated delta rule, g and gk: final state")
    o, _ = ops.fused_recurrent_gated_delta_rule(q, k, v, gk=gk)
    assert_close(o, ref.kda(q, k, v, gk, torch.ones(B, T, H, dtype=F64))[0], 1e-11, "gk, beta ones: o")
    o, _ = ops.fused_recurrent_delta_rule(q, k, v, initial_state=h0)
    assert_close(o, ref.delta_rule(q, k, v, torch.ones(B, T, H, dtype=F64), initial_state=h0)[0], 1e-11,
                 "delta rule, beta ones: o")
    o, S = ops.fused_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    want_o, want_S = ref.decay(q, k, v, gk=gk, initial_state=h0)
    assert_close(o, want_o, 1e-11, "gla: o")
    assert_close(S, want_S, 1e-11, "gla: final state")
    o, _ = ops.fused_recurrent_simple_gla(q, k, v, g, initial_state=h0)
    assert_close(o, ref.decay(q, k, v, g=g, initial_state=h0)[0], 1e-11, "simple gla: o")
    with pytest.raises(NotImplementedError, match="gv"):
        ops.fused_recurrent_gated_delta_rule(q, k, v, g=g, gv=randn(B, T, H, V, seed=67), beta=beta)
    with pytest.raises(NotImplementedError, match="reverse=True"):
        ops.fused_recurrent_gla(q, k, v, gk, reverse=True)
    with pytest.raises(NotImplementedError, match="use_gate_in_kernel with gk"):
        ops.fused_recurrent_gated_delta_rule(q, k, v, gk=gk, beta=beta, use_gate_in_kernel=True, A_log=g[0, 0])


def test_gated_delta_rule_fla_options():
    """l2-normalized q and k, beta as logits with negative eigenvalues, the gate from raw g with A_log
    and dt_bias, grouped value heads (H = 2 query/key heads, each for 2 of 4 value heads), a V-first
    state, a scale."""
    q, k, v, graw, braw, h0 = gdn_inputs(seed=10, hv=4)
    q, k = q * 3, randn(B, T, H, K, seed=20) * 2
    A_log, dt_bias = randn(4, seed=21), randn(4, seed=22)

    def run(q, k, v, graw, braw, h0, A_log, dt_bias):
        return ops.chunk_gated_delta_rule(
            q, k, v, graw, braw, scale=0.3, initial_state=h0.transpose(-1, -2), output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
            state_v_first=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, chunk_size=CHUNK)

    def want(q, k, v, graw, braw, h0, A_log, dt_bias):
        g = -A_log.exp() * F.softplus(graw + dt_bias)
        qn, kn = ref.l2norm(q).repeat_interleave(2, 2), ref.l2norm(k).repeat_interleave(2, 2)
        o, S = ref.delta_rule(qn, kn, v, 2 * torch.sigmoid(braw), g=g, scale=0.3, initial_state=h0)
        return o, S.transpose(-1, -2)

    compare(run, want, [q, k, v, graw, braw, h0, A_log, dt_bias],
            names=["q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"])


def test_gated_delta_rule_varlen():
    """Packed sequences (lengths 3, 0, 5, 2): each from its own initial state, one final state each."""
    q, k, v, g, beta, _ = [x[:1] for x in gdn_inputs(seed=30)]
    cu = torch.tensor([0, 3, 3, 8, 10])
    h0 = randn(4, H, K, V, seed=36)

    def want(q, k, v, g, beta, h0):
        outs, finals = [], []
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if e == s:
                finals.append(h0[i:i + 1])
                continue
            o, S = ref.delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], g=g[:, s:e], initial_state=h0[i:i + 1])
            outs.append(o)
            finals.append(S)
        return torch.cat(outs, 1), torch.cat(finals, 0)

    compare(lambda q, k, v, g, beta, h0: ops.chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=CHUNK),
            want, [q, k, v, g, beta, h0])


def test_delta_rule():
    q, k, v, _, beta, h0 = gdn_inputs(seed=40)
    compare(lambda q, k, v, beta, h0: ops.chunk_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True,
                                                           chunk_size=CHUNK),
            lambda q, k, v, beta, h0: ref.delta_rule(q, k, v, beta, initial_state=h0),
            [q, k, v, beta, h0])
    # l2-normalized in the op, from keys that are not
    k2 = randn(B, T, H, K, seed=47) * 3
    compare(lambda q, k, v, beta: ops.chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True, chunk_size=CHUNK),
            lambda q, k, v, beta: (ref.delta_rule(ref.l2norm(q), ref.l2norm(k), v, beta)[0], None),
            [q, k2, v, beta])


def test_gla():
    q, k, v = randn(B, T, H, K, seed=50), randn(B, T, H, K, seed=51), randn(B, T, H, V, seed=52)
    gk, h0 = F.logsigmoid(randn(B, T, H, K, seed=53)), randn(B, H, K, V, seed=54)
    compare(lambda q, k, v, gk, h0: ops.chunk_gla(q, k, v, gk, scale=0.7, initial_state=h0, output_final_state=True,
                                                  chunk_size=CHUNK),
            lambda q, k, v, gk, h0: ref.decay(q, k, v, gk=gk, scale=0.7, initial_state=h0),
            [q, k, v, gk, h0])


@pytest.mark.parametrize("gate", ["g", "g_gamma", "none"])
def test_simple_gla(gate):
    q, k, v = randn(B, T, H, K, seed=60), randn(B, T, H, K, seed=61), randn(B, T, H, V, seed=62)
    h0 = randn(B, H, K, V, seed=63)
    g = F.logsigmoid(randn(B, T, H, seed=64))
    gamma = F.logsigmoid(randn(H, seed=65))
    if gate == "g":
        run = lambda q, k, v, h0, g: ops.chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True,  # noqa: E731
                                                          chunk_size=CHUNK)
        want = lambda q, k, v, h0, g: ref.decay(q, k, v, g=g, initial_state=h0)  # noqa: E731
        inputs = [q, k, v, h0, g]
    elif gate == "g_gamma":
        run = lambda q, k, v, h0, gm: ops.chunk_simple_gla(q, k, v, g_gamma=gm, initial_state=h0,  # noqa: E731
                                                           output_final_state=True, chunk_size=CHUNK)
        want = lambda q, k, v, h0, gm: ref.decay(q, k, v, g=gm.expand(B, T, H), initial_state=h0)  # noqa: E731
        inputs = [q, k, v, h0, gamma]
    else:
        run = lambda q, k, v, h0: ops.chunk_simple_gla(q, k, v, initial_state=h0, output_final_state=True,  # noqa: E731
                                                       chunk_size=CHUNK)
        want = lambda q, k, v, h0: ref.decay(q, k, v, initial_state=h0)  # noqa: E731
        inputs = [q, k, v, h0]
    compare(run, want, inputs)


@pytest.mark.parametrize("normalize", [True, False])
def test_linear_attn(normalize):
    # Positive features, as a feature map gives them, so that the normalizer stays away from zero.
    q, k = F.elu(randn(B, T, H, K, seed=70)) + 1, F.elu(randn(B, T, H, K, seed=71)) + 1
    v, S0 = randn(B, T, H, V, seed=72), randn(B, H, K, V, seed=73)
    if normalize:
        z0 = (F.elu(randn(B, 1, H, K, seed=74)) + 1) * 3
        compare(lambda q, k, v, S0, z0: ops.chunk_linear_attn(q, k, v, initial_state=(S0, z0), output_final_state=True,
                                                              normalize=True, chunk_size=CHUNK),
                lambda q, k, v, S0, z0: ref.linear_attn(q, k, v, initial_state=(S0, z0), normalize=True),
                [q, k, v, S0, z0])
    else:
        compare(lambda q, k, v, S0: ops.chunk_linear_attn(q, k, v, initial_state=S0, output_final_state=True,
                                                          normalize=False, chunk_size=CHUNK),
                lambda q, k, v, S0: (lambda o, s: (o, s[0]))(*ref.linear_attn(q, k, v, initial_state=(S0, torch.zeros(B, 1, H, K, dtype=F64)))),
                [q, k, v, S0])


@pytest.mark.parametrize("form", ["chunkwise", "naive", None])
def test_kda(form):
    """chunk_kda against reference.kda (FLA's naive_recurrent_kda): o, the final state and the gradient of q, k,
    v, g, beta and the initial state, T = 10 over chunks of 4; decays per key dimension with half-lives from
    about a token up."""
    q, k, v = randn(B, T, H, K, seed=20), unit_keys(B, T, H, K, seed=21), randn(B, T, H, V, seed=22)
    g = F.logsigmoid(randn(B, T, H, K, seed=23))
    beta = torch.sigmoid(randn(B, T, H, seed=24))
    S0 = randn(B, H, K, V, seed=25)
    compare(lambda q, k, v, g, beta, S0: ops.chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                                                       chunk_size=CHUNK, form=form),
            lambda q, k, v, g, beta, S0: ref.kda(q, k, v, g, beta, initial_state=S0),
            [q, k, v, g, beta, S0], tol=1e-10, names=["q", "k", "v", "g", "beta", "initial_state"])


def test_kda_fla_options():
    """FLA's in-kernel options: the gate from A_log and dt_bias (and the bounded gate of lower_bound), beta from
    logits (doubled with allow_neg_eigval), l2-normalized q and k, grouped value heads; and what is refused."""
    q, k = randn(1, T, 1, K, seed=26), randn(1, T, 1, K, seed=27)
    v = randn(1, T, 2, V, seed=28)  # two value heads a query/key head
    raw, logit = randn(1, T, 2, K, seed=29), randn(1, T, 2, seed=30)
    A_log, dt_bias = randn(2, seed=31) * 0.3, randn(2 * K, seed=32) * 0.3
    o, S = ops.chunk_kda(q, k, v, raw, logit, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                         allow_neg_eigval=True, chunk_size=CHUNK)
    g = -A_log.exp().view(2, 1) * F.softplus(raw + dt_bias.view(2, K))
    rep = lambda x: ref.l2norm(x).repeat_interleave(2, dim=2)  # noqa: E731
    want_o, want_S = ref.kda(rep(q), rep(k), v, g, 2 * torch.sigmoid(logit))
    assert_close(o, want_o, 1e-10, "o")
    assert_close(S, want_S, 1e-10, "final state")
    # FLA's bounded gate (lower_bound): lower_bound·sigmoid(exp(A_log)·(g + dt_bias)), and without A_log.
    for a in (A_log, None):
        o, S = ops.chunk_kda(q, k, v, raw, logit, output_final_state=True, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, A_log=a, dt_bias=dt_bias, lower_bound=-4.0,
                             use_beta_sigmoid_in_kernel=True, chunk_size=CHUNK)
        x = raw + dt_bias.view(2, K)
        g_lb = -4.0 * torch.sigmoid(x if a is None else a.exp().view(2, 1) * x)
        want_o, want_S = ref.kda(rep(q), rep(k), v, g_lb, torch.sigmoid(logit))
        assert_close(o, want_o, 1e-10, "o, lower_bound")
        assert_close(S, want_S, 1e-10, "final state, lower_bound")
    with pytest.raises(ValueError, match="A_log must be provided when use_gate_in_kernel=True and lower_bound"):
        ops.chunk_kda(q, k, v, raw, logit, use_gate_in_kernel=True)
    with pytest.raises(NotImplementedError, match="return_intermediate_states is not supported"):
        ops.chunk_kda(q, k, v, g, logit, return_intermediate_states=True)
    with pytest.raises(ValueError, match=r"g must be \[B, T, HV, K\]"):
        ops.chunk_kda(q, k, v, g[:, :, :1], logit)


def rwkv7_inputs(seed):
    """RWKV-7's inputs as its layer makes them: r, k, v; w = −0.6065·σ(·) (its log decay, half-lives from
    about 1.1 tokens up); a = −κ̂ and b = κ̂ ⊙ a_lr with κ̂ unit keys and a_lr in (0, 1)."""
    r, k, v = randn(B, T, H, K, seed=seed), randn(B, T, H, K, seed=seed + 1), randn(B, T, H, V, seed=seed + 2)
    w = -0.6065306597126334 * torch.sigmoid(randn(B, T, H, K, seed=seed + 3))
    kappa = unit_keys(B, T, H, K, seed=seed + 4)
    return r, w, k, v, -kappa, kappa * torch.sigmoid(randn(B, T, H, K, seed=seed + 5))


@pytest.mark.parametrize("form", ["chunkwise", "naive", None])
def test_rwkv7(form):
    """chunk_rwkv7 (scale 1) and chunk_dplr_delta_rule (default scale) against reference.dplr: o, the final
    state and the gradient of every input and of the initial state; T = 10 over chunks of 4."""
    r, w, k, v, a, b = rwkv7_inputs(seed=30)
    S0 = randn(B, H, K, V, seed=36)
    names = ["r", "w", "k", "v", "a", "b", "initial_state"]
    compare(lambda r, w, k, v, a, b, S0: ops.chunk_rwkv7(r, w, k, v, a, b, initial_state=S0, output_final_state=True,
                                                         chunk_size=CHUNK, form=form),
            lambda r, w, k, v, a, b, S0: ref.dplr(r, k, v, a, b, w, scale=1.0, initial_state=S0),
            [r, w, k, v, a, b, S0], tol=1e-10, names=names)
    compare(lambda q, gk, k, v, a, b, S0: ops.chunk_dplr_delta_rule(q, k, v, a, b, gk, initial_state=S0,
                                                                    output_final_state=True, chunk_size=CHUNK,
                                                                    form=form),
            lambda q, gk, k, v, a, b, S0: ref.dplr(q, k, v, a, b, gk, initial_state=S0),
            [r, w, k, v, a, b, S0], tol=1e-10, names=["q", "gk"] + names[2:])


def test_rwkv7_varlen_and_errors():
    """Packed sequences equal the sequences run one by one; bad inputs are named."""
    r, w, k, v, a, b = (x[:1] for x in rwkv7_inputs(seed=31))
    cu = torch.tensor([0, 4, 10])
    o, S = ops.chunk_rwkv7(r, w, k, v, a, b, output_final_state=True, cu_seqlens=cu, chunk_size=CHUNK)
    assert S.shape == (2, H, K, V)
    for i, (s, e) in enumerate([(0, 4), (4, 10)]):
        oi, Si = ref.dplr(*(x[:, s:e] for x in (r, k, v, a, b, w)), scale=1.0)
        assert_close(o[:, s:e], oi, 1e-10, f"sequence {i}: o")
        assert_close(S[i:i + 1], Si, 1e-10, f"sequence {i}: final state")
    with pytest.raises(ValueError, match=r"a must have r's shape \[1, 10, 2, 4\], got \[1, 10, 2, 3\]"):
        ops.chunk_rwkv7(r, w, k, v, a[..., :3], b)
    with pytest.raises(ValueError, match="lower_bound=-0.5: expected lower_bound <= w < 0"):
        ops.chunk_rwkv7(r, w, k, v, a, b, lower_bound=-0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        ops.chunk_dplr_delta_rule(r, k, v, a, b, w, head_dim=4)


def hla_inputs(seed, positive=False):
    """Unit q and k (positive with the normalizer, which then stays away from zero), v, g = logsigmoid."""
    q, k = unit_keys(B, T, H, K, seed=seed), unit_keys(B, T, H, K, seed=seed + 1)
    if positive:
        q, k = q.abs(), k.abs()
    return q, k, randn(B, T, H, V, seed=seed + 2), F.logsigmoid(randn(B, T, H, seed=seed + 3))


@pytest.mark.parametrize("family", ["hla2", "ahla"])
@pytest.mark.parametrize("form", ["chunkwise", "naive", None])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("gate", [True, False])
def test_hla(family, form, normalize, gate):
    """chunk_hla2 / chunk_ahla against reference.hla2 / ahla: o, every final-state entry and the gradient of
    q, k, v, g and of every initial-state entry; T = 10 over chunks of 4 (the last one padded); the initial
    state is what 6 earlier tokens leave."""
    q, k, v, g = hla_inputs(seed=40, positive=normalize)
    ref_fn = ref.hla2 if family == "hla2" else ref.ahla
    op = ops.chunk_hla2 if family == "hla2" else ops.chunk_ahla
    pq, pk, pv, pg = (x[:, :6] for x in hla_inputs(seed=50, positive=normalize))
    _, state0 = ref_fn(pq, pk, pv, g=pg)
    names = ["q", "k", "v"] + (["g"] if gate else []) + [f"initial {n}" for n, _ in ops._HLA_STATES[family]]

    def split(xs):
        return xs[:3], (xs[3] if gate else None), xs[3 + gate:]

    def run_carry(*xs):
        (a, b, c), gg, st = split(xs)
        return op(a, b, c, gg, initial_state=tuple(st), output_final_state=True, normalize=normalize,
                  chunk_size=CHUNK, form=form)

    def run_ref(*xs):
        (a, b, c), gg, st = split(xs)
        return ref_fn(a, b, c, g=gg, initial_state=st, normalize=normalize)

    inputs = [q, k, v] + ([g] if gate else []) + list(state0)
    compare(run_carry, run_ref, inputs, tol=1e-10, names=names)


def test_hla_varlen_and_errors():
    """Packed sequences equal the sequences run one by one, from their own states; bad inputs are named."""
    q, k, v, g = (x[:1] for x in hla_inputs(seed=60))
    cu = torch.tensor([0, 3, 3, 10])
    o, (S, C, m, G, h) = ops.chunk_hla2(q, k, v, g, output_final_state=True, cu_seqlens=cu, chunk_size=CHUNK)
    assert S.shape == (3, H, K, K) and m.shape == (3, H, K)
    for i, (a, b) in enumerate([(0, 3), (3, 3), (3, 10)]):
        if a == b:
            assert all(float(x[i].abs().max()) == 0 for x in (S, C, m, G, h))
            continue
        oi, si = ref.hla2(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b])
        assert_close(o[:, a:b], oi, 1e-10, f"sequence {i}: o")
        for name, x, y in zip("SCmGh", (S, C, m, G, h), si):
            assert_close(x[i:i + 1], y, 1e-10, f"sequence {i}: {name}")
    with pytest.raises(ValueError, match="initial_state must be a tuple of 4 tensors"):
        ops.chunk_ahla(q, k, v, g, initial_state=torch.zeros(1, H, K, V, dtype=F64))
    with pytest.raises(ValueError, match=r"initial_state's m must be \[N, H, 4\]"):
        ops.chunk_hla2(q, k, v, g, initial_state=(torch.zeros(1, H, K, K, dtype=F64), torch.zeros(1, H, K, V, dtype=F64),
                                                  torch.zeros(1, H, K, 1, dtype=F64), torch.zeros(1, H, K, V, dtype=F64),
                                                  torch.zeros(1, H, K, dtype=F64)))
    with pytest.raises(ValueError, match=r"g must be a \[B, T, H\]"):
        ops.chunk_hla2(q, k, v, g[..., None])


LL_T = 13  # two chunks of 4 and a partial one (4 tokens at offset 8, then 1 by the recurrence), 5 levels


def log_linear_inputs(seed, t=LL_T):
    return [randn(B, t, H, K, seed=seed), unit_keys(B, t, H, K, seed=seed + 1), randn(B, t, H, V, seed=seed + 2),
            F.logsigmoid(randn(B, t, H, seed=seed + 3)), torch.sigmoid(randn(B, t, H, seed=seed + 4)),
            F.softplus(randn(B, t, H, 5, seed=seed + 5))]


@pytest.mark.parametrize("form", ["chunkwise", "naive", None])
def test_log_linear_attn(form):
    """chunk_log_linear_attn against the pairwise definition (reference.log_linear_mamba2): o and the gradient
    of q, k, v, g and level_scales, T = 13 over chunks of 4."""
    q, k, v, g, _, lam = log_linear_inputs(seed=70)
    compare(lambda q, k, v, g, lam: ops.chunk_log_linear_attn(q, k, v, g, lam, chunk_size=CHUNK, form=form)[0],
            lambda q, k, v, g, lam: ref.log_linear_mamba2(q, k, v, g, lam),
            [q, k, v, g, lam], tol=1e-10, names=["q", "k", "v", "g", "level_scales"])


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
@pytest.mark.parametrize("form", ["chunkwise", "naive"])
def test_log_linear_state_continues(family, form):
    """A sequence cut at 8 (a chunk boundary, at offset 8): the second part run from the first part's final
    state gives the whole's output and final state, and the gradients of every input of both parts equal
    the whole's (so the state's gradient flows as it must). For Gated DeltaNet the whole runs in the naive
    form (the recurrence) as the reference."""
    x = log_linear_inputs(seed=80)
    cut = 8

    def call(q, k, v, g, beta, lam, **kw):
        if family == "mamba2":
            return ops.chunk_log_linear_attn(q, k, v, g, lam, chunk_size=CHUNK, **kw)
        return ops.chunk_log_linear_gated_delta_rule(q, k, v, g, beta, lam, chunk_size=CHUNK, **kw)

    def split(*xs):
        first = call(*[t[:, :cut] for t in xs], output_final_state=True, form=form)
        o2, final = call(*[t[:, cut:] for t in xs], initial_state=first[1], output_final_state=True, offset=cut,
                         form=form)
        return torch.cat([first[0], o2], 1), final

    def whole(*xs):
        return call(*xs, output_final_state=True, form="naive" if family == "gdn" else form)

    names = ["q", "k", "v", "g", "beta", "level_scales"]
    inputs = x if family == "gdn" else x[:4] + [x[4] * 0 + 1] + x[5:]
    compare(split, whole, inputs, tol=1e-10, names=names)


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_log_linear_grouped_heads(family):
    """One query/key head for two value heads (FLA's grouped heads, q and k [B, T, G, K], v [B, T, 2G, V]): the
    same as q and k repeated to every value head, o, final state and the gradient of every input."""
    q, k, v, g, beta, lam = log_linear_inputs(seed=95)
    q1, k1 = q[:, :, :1], k[:, :, :1]  # G = 1 for H = 2

    def call(q, k, v, g, beta, lam):
        if family == "mamba2":
            return ops.chunk_log_linear_attn(q, k, v, g, lam, output_final_state=True, chunk_size=CHUNK)
        return ops.chunk_log_linear_gated_delta_rule(q, k, v, g, beta, lam, output_final_state=True, chunk_size=CHUNK)

    rep = lambda x: x.repeat_interleave(2, dim=2)  # noqa: E731
    compare(call, lambda q, k, v, g, beta, lam: call(rep(q), rep(k), v, g, beta, lam), [q1, k1, v, g, beta, lam],
            tol=1e-12, names=["q", "k", "v", "g", "beta", "level_scales"])
    with pytest.raises(ValueError, match="value heads H=2 must be a multiple of the query/key heads G=3"):
        call(rep(q1).repeat(1, 1, 2, 1)[:, :, :3], rep(k1).repeat(1, 1, 2, 1)[:, :, :3], v, g, beta, lam)


def test_log_linear_varlen_and_errors():
    q, k, v, g, beta, lam = (t[:1] for t in log_linear_inputs(seed=90))
    cu = torch.tensor([0, 5, 13])
    o, final = ops.chunk_log_linear_attn(q, k, v, g, lam, output_final_state=True, cu_seqlens=cu, chunk_size=CHUNK)
    assert len(final) == 4 and final[0].shape == (2, H, K, V)
    for i, (a, b) in enumerate([(0, 5), (5, 13)]):
        oi, fi = ops.chunk_log_linear_attn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], lam[:, a:b],
                                           output_final_state=True, chunk_size=CHUNK)
        assert_close(o[:, a:b], oi, 1e-12, f"sequence {i}: o")
        for j, (x, y) in enumerate(zip(final, fi)):
            assert_close(x[i:i + 1], y, 1e-12, f"sequence {i}: level state {j}")
    with pytest.raises(ValueError, match="level_scales has L=3 levels; positions up to 13 and the state there need L >= 5"):
        ops.chunk_log_linear_attn(q, k, v, g, lam[..., :3])
    with pytest.raises(ValueError, match="offset must be a multiple of chunk_size=4"):
        ops.chunk_log_linear_attn(q, k, v, g, lam, chunk_size=CHUNK, offset=2)
    with pytest.raises(ValueError, match="initial_state must be a tuple of L-1 = 4 level states"):
        ops.chunk_log_linear_attn(q, k, v, g, lam, initial_state=torch.zeros(1, H, K, V, dtype=F64))
    with pytest.raises(ValueError, match=r"beta must be a \[B, T, H\]"):
        ops.chunk_log_linear_gated_delta_rule(q, k, v, g, None, lam)


def test_gradcheck():
    """Backward against finite differences (gradcheck's fast mode: random directions), every function once,
    tiny fp64 shapes (T = 5, chunk 4)."""
    b, t, h, kd, vd = 1, 5, 1, 3, 2

    def o_and_state(res):
        return tuple(flat(res))

    q, k, v = (leaf(randn(b, t, h, d, seed=i) * 0.5) for i, d in enumerate((kd, kd, vd)))
    gd = leaf(F.logsigmoid(randn(b, t, h, seed=3)))
    gk = leaf(F.logsigmoid(randn(b, t, h, kd, seed=4)))
    beta = leaf(torch.sigmoid(randn(b, t, h, seed=5)))
    h0 = leaf(randn(b, h, kd, vd, seed=6))
    assert torch.autograd.gradcheck(lambda q, k, v, g, be, h0: o_and_state(ops.chunk_gated_delta_rule(
        q, k, v, g, be, initial_state=h0, output_final_state=True, chunk_size=4)), (q, k, v, gd, beta, h0), fast_mode=True)
    assert torch.autograd.gradcheck(lambda q, k, v, be, h0: o_and_state(ops.chunk_delta_rule(
        q, k, v, be, initial_state=h0, output_final_state=True, chunk_size=4)), (q, k, v, beta, h0), fast_mode=True)
    assert torch.autograd.gradcheck(lambda q, k, v, gk, h0: o_and_state(ops.chunk_gla(
        q, k, v, gk, initial_state=h0, output_final_state=True, chunk_size=4)), (q, k, v, gk, h0), fast_mode=True)
    assert torch.autograd.gradcheck(lambda q, k, v, gs, h0: o_and_state(ops.chunk_simple_gla(
        q, k, v, gs, initial_state=h0, output_final_state=True, chunk_size=4)), (q, k, v, gd, h0), fast_mode=True)
    qp, kp = leaf(F.elu(q) + 1), leaf(F.elu(k) + 1)
    z0 = leaf(F.elu(randn(b, 1, h, kd, seed=30)) + 2)
    assert torch.autograd.gradcheck(lambda q, k, v, S0, z0: o_and_state(ops.chunk_linear_attn(
        q, k, v, initial_state=(S0, z0), output_final_state=True, chunk_size=4)), (qp, kp, v, h0, z0), fast_mode=True)
    kn = leaf(ref.l2norm(k))
    assert torch.autograd.gradcheck(lambda q, k, v, gk, be, h0: o_and_state(ops.chunk_kda(
        q, k, v, gk, be, initial_state=h0, output_final_state=True, chunk_size=4)), (q, kn, v, gk, beta, h0), fast_mode=True)
    a = leaf(-ref.l2norm(randn(b, t, h, kd, seed=31)))
    bb = leaf(-a.detach() * torch.sigmoid(randn(b, t, h, kd, seed=32)))
    assert torch.autograd.gradcheck(lambda r, w, k, v, a, bb, h0: o_and_state(ops.chunk_rwkv7(
        r, w, k, v, a, bb, initial_state=h0, output_final_state=True, chunk_size=4)), (q, gk, k, v, a, bb, h0),
        fast_mode=True)


def test_low_precision_on_cpu():
    """bf16 inputs: o comes back in bf16 and the final state in fp32, computed in fp32 (chunkwise form)."""
    q, k, v, g, beta, h0 = gdn_inputs(seed=80)
    o, S = ops.chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g.float(), beta.bfloat16(),
                                      initial_state=h0.float(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    want_o, want_S = ref.delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16(), g=g.float(),
                                    initial_state=h0.float())
    assert_close(o, want_o, 2e-2, "bf16 o")
    assert_close(S, want_S, 1e-5, "bf16 final state")


def test_errors():
    q, k, v, g, beta, h0 = gdn_inputs()
    with pytest.raises(NotImplementedError, match="cp_context"):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, cp_context=object())
    with pytest.raises(ValueError, match="head_first"):
        ops.chunk_delta_rule(q, k, v, beta, head_first=True)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, use_fancy_mode=True)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        ops.chunk_gated_delta_rule(q, k, randn(B, T, 3, V, seed=1), g, beta)
    with pytest.raises(ValueError, match="share one dtype"):
        ops.chunk_delta_rule(q, k.float(), v, beta)
    with pytest.raises(ValueError, match="form must be"):
        ops.chunk_gla(q, k, v, k, form="fast")
    with pytest.raises(ValueError, match="initial_state must be"):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0[:, :, :2])
    with pytest.raises(ValueError, match="g or g_gamma"):
        ops.chunk_simple_gla(q, k, v, g, g_gamma=torch.zeros(H))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.chunk_gla(q, k, v, k, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="unknown mixer family"):
        torch.ops.carry.family_info("no_such_family")


def test_families():
    names = carry.families()
    for n in ("gated_deltanet", "deltanet", "gla", "scalar_decay", "linear_attn"):
        assert n in names
    inputs, optional, state, _ = torch.ops.carry.family_info("gated_deltanet")
    assert list(inputs) == ["q", "k", "v", "g", "beta"] and list(state) == ["S"]
    for family, specs in ops._HLA_STATES.items():  # chunk_hla2 / chunk_ahla's state order is carry's
        assert list(torch.ops.carry.family_info(family)[2]) == [n for n, _ in specs]


# ---- against the C++ program: `carry mixer` on the same tensors (framework/cli/mixer_command.h) ----

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32"}


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = bytes(t.detach().cpu().clone(memory_format=torch.contiguous_format).untyped_storage())
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F64", f"{name}: {info['dtype']}"
        b, e = info["data_offsets"]
        buf = bytearray(raw[8 + n + b:8 + n + e])
        out[name] = torch.frombuffer(buf, dtype=F64).reshape(info["shape"]).clone()
    return out


def test_against_carry_mixer(carry_binary, tmp_path):
    """chunk_gated_delta_rule and `carry mixer --family gated_deltanet` on the same fp64 tensors: o, the
    final state and every gradient agree to rounding (the two share the C++ mixer; this checks the
    package's argument mapping and its autograd path against the program's)."""
    t = 8
    q, k, v, g, beta = (x[:, :t] for x in gdn_inputs(seed=90)[:5])
    h0 = randn(B, H, K, V, seed=95)
    do, dS = randn(B, t, H, V, seed=96), randn(B, H, K, V, seed=97)
    write_safetensors(tmp_path / "in.safetensors", {"q": q, "k": k, "v": v, "g": g, "beta": beta,
                                                    "initial_state": h0, "do": do, "dfinal_state": dS})
    out = tmp_path / "out.safetensors"
    subprocess.run([carry_binary, "mixer", "--family", "gated_deltanet", "--input", str(tmp_path / "in.safetensors"),
                    "--output", str(out), "--chunk-size", "4"], check=True, capture_output=True, text=True)
    theirs = read_safetensors(out)
    leaves = [leaf(x) for x in (q, k, v, g, beta, h0)]
    o, S = ops.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=4)
    grads = torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves)
    assert_close(o, theirs["o"], 1e-13, "o")
    assert_close(S, theirs["final_state.S"] if "final_state.S" in theirs else theirs["final_state"], 1e-13, "final state")
    for name, gr in zip(["dq", "dk", "dv", "dg", "dbeta"], grads[:5]):
        assert_close(gr, theirs[name], 1e-12, name)
    ds0 = theirs.get("dinitial_state.S", theirs.get("dinitial_state"))
    assert_close(grads[5], ds0, 1e-12, "dinitial_state")


# ---- the kernel forms (a CUDA machine with a library built with CARRY_CUDA) ----

needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and carry.cuda_kernels()),
                                   reason="needs a CUDA GPU and carry built with its kernels")


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_kernels(dtype, tol):
    b, t, h, d = 2, 200, 4, 64
    dev = "cuda"
    q = randn(b, t, h, d, seed=100)
    k = ref.l2norm(randn(b, t, h, d, seed=101))
    v = randn(b, t, h, d, seed=102)
    g = F.logsigmoid(randn(b, t, h, seed=103)) * 0.1
    beta = torch.sigmoid(randn(b, t, h, seed=104))
    gk = F.logsigmoid(randn(b, t, h, d, seed=105)) * 0.1
    h0 = randn(b, h, d, d, seed=106)
    cast = lambda *xs: [x.to(dev, dtype) for x in xs]  # noqa: E731
    qc, kc, vc = cast(q, k, v)
    gc, betac, gkc = g.to(dev, torch.float32), beta.to(dev, torch.float32), gk.to(dev, torch.float32)
    h0c = h0.to(dev, torch.float32)
    lo = lambda x: x.to(dtype).double()  # noqa: E731  (the reference reads the rounded inputs)
    form = torch.ops.carry.mixer_form("gated_deltanet", qc, kc, vc, gc, None, betac, None, 0.0, False, 1e-6, 64, 0)
    assert form == "kernel"
    # Gated DeltaProduct with two sub-steps a token (k, v, beta on 2·t rows).
    k2, v2 = ref.l2norm(randn(b, 2 * t, h, d, seed=107)), randn(b, 2 * t, h, d, seed=108)
    beta2 = torch.sigmoid(randn(b, 2 * t, h, seed=109))
    k2c, v2c = cast(k2, v2)
    beta2c = beta2.to(dev, torch.float32)
    pad = lambda x, n: F.pad(x, (0, 0) * (x.dim() - 2) + (0, n))  # noqa: E731  (the chunk multiple ops pads to)
    form = torch.ops.carry.mixer_form("gated_deltaproduct", pad(qc, 56), pad(k2c, 112), pad(v2c, 112), pad(gc, 56),
                                      None, pad(beta2c, 112), None, 0.0, False, 1e-6, 64, 0, None, None, 2)
    assert form == "kernel"
    cases = [
        (lambda: ops.chunk_gated_delta_rule(qc, kc, vc, gc, betac, initial_state=h0c, output_final_state=True),
         ref.delta_rule(lo(q), lo(k), lo(v), beta, g=g, initial_state=h0)),
        (lambda: ops.chunk_delta_rule(qc, kc, vc, betac, initial_state=h0c, output_final_state=True),
         ref.delta_rule(lo(q), lo(k), lo(v), beta, initial_state=h0)),
        (lambda: ops.chunk_gla(qc, kc, vc, gkc, initial_state=h0c, output_final_state=True),
         ref.decay(lo(q), lo(k), lo(v), gk=gk, initial_state=h0)),
        (lambda: ops.chunk_simple_gla(qc, kc, vc, gc, initial_state=h0c, output_final_state=True),
         ref.decay(lo(q), lo(k), lo(v), g=g, initial_state=h0)),
        (lambda: ops.chunk_linear_attn(qc, kc, vc, initial_state=h0c, output_final_state=True, normalize=False),
         (lambda o, s: (o, s[0]))(*ref.linear_attn(lo(q), lo(k), lo(v), initial_state=(h0, torch.zeros(b, 1, h, d, dtype=F64))))),
        (lambda: ops.chunk_gated_delta_product(qc, k2c, v2c, gc, beta2c, 2, initial_state=h0c, output_final_state=True),
         ref.delta_product(lo(q), lo(k2), lo(v2), g, beta2, 2, initial_state=h0)),
    ]
    for i, (run, (want_o, want_S)) in enumerate(cases):
        o, S = run()
        assert o.dtype == dtype and S.dtype == torch.float32
        assert_close(o, want_o, tol, f"case {i}: o")
        assert_close(S, want_S, tol, f"case {i}: final state")
    # Gradients of the kernel form against the chunkwise form on the same GPU, in fp32.
    leaves = [leaf(x.to(dev, torch.float32)) for x in (q, k, v, g, beta, h0)]
    leaves2 = [leaf(x) for x in leaves]
    o1, S1 = ops.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    o2, S2 = ops.chunk_gated_delta_rule(*leaves2[:5], initial_state=leaves2[5], output_final_state=True,
                                        form="chunkwise")
    _, g1 = loss_and_grads((o1, S1), leaves)
    _, g2 = loss_and_grads((o2, S2), leaves2)
    for n, a, c in zip(["q", "k", "v", "g", "beta", "initial_state"], g1, g2):
        assert_close(a, c, 1e-3, f"kernel gradient of {n}")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["hla2", "ahla", "loglinear_mamba2", "loglinear_gdn"])
def test_hla_log_linear_kernels(family, dtype):
    """The kernel forms of the HLA and log-linear functions against their chunkwise forms on the same GPU in
    fp32 (on the same rounded inputs), from the state a 64-token prefix leaves (at offset 64 for the
    levels): fp32 inputs, o, every final-state entry and every gradient (the initial state's included)
    within 1e-3 of the largest reference entry; bf16 inputs, o and every final-state entry within 2e-2."""
    b, t, h, d, dev = 1, 256, 2, 64, "cuda"
    q, k, v = unit_keys(b, 64 + t, h, d, seed=110), unit_keys(b, 64 + t, h, d, seed=111), randn(b, 64 + t, h, d, seed=112)
    g = F.logsigmoid(randn(b, 64 + t, h, seed=113)) * 0.1 - 1e-3  # half-lives from about 2 to 700 tokens
    beta = torch.sigmoid(randn(b, 64 + t, h, seed=114))
    lam = F.softplus(randn(b, 64 + t, h, 10, seed=115))  # positions up to 320 and the state there: 10 levels
    hla = family in ("hla2", "ahla")

    def call(xs, state, form, offset):
        q, k, v, g, beta, lam = xs
        kw = dict(initial_state=state, output_final_state=True, form=form)
        if family == "hla2":
            return ops.chunk_hla2(q, k, v, g, **kw)
        if family == "ahla":
            return ops.chunk_ahla(q, k, v, g, **kw)
        if family == "loglinear_mamba2":
            return ops.chunk_log_linear_attn(q, k, v, g, lam, offset=offset, **kw)
        return ops.chunk_log_linear_gated_delta_rule(q, k, v, g, beta, lam, offset=offset, **kw)

    prefix = [x[:, :64].to(dev, torch.float32) for x in (q, k, v, g, beta, lam)]
    state0 = tuple(call(prefix, None, "chunkwise", 0)[1])
    inputs = [x[:, 64:].to(dev, torch.float32) for x in (q, k, v, g, beta, lam)] + list(state0)
    n = 6

    def run(form):
        def f(*xs):
            qkv = [x.to(dtype) if form is None else x.to(dtype).float() for x in xs[:3]]
            return call(qkv + list(xs[3:n]), tuple(xs[n:]), form, 64)
        return f

    low = [x.to(dtype) for x in inputs[:3]]
    form = torch.ops.carry.mixer_form(family, *low, inputs[3], None, None if hla or family == "loglinear_mamba2"
                                      else inputs[4], None if hla else inputs[5], 0.0, False, 1e-6, 64, 64)
    assert form == "kernel", f"{family} {dtype}: the automatic form is {form}"
    names = ["q", "k", "v", "g", "beta", "level_scales"] + [f"initial state {i}" for i in range(len(state0))]
    if dtype == torch.float32:
        compare(run(None), run("chunkwise"), inputs, tol=1e-3, names=names)
        return
    got, want = flat(run(None)(*inputs)), flat(run("chunkwise")(*inputs))
    for i, (x, y) in enumerate(zip(got, want)):
        assert_close(x, y, 2e-2, f"{family} bf16: output {i}")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_scan_kernels(dtype):
    """selective_scan_fn on the selective-scan kernels (CUDA, the automatic form) against its chunkwise form
    on the same GPU in fp32 on the same rounded inputs, D = 24, N = 16, L = 300: fp32 inputs, the output,
    the final state and every gradient within 1e-3 of the largest reference entry; bf16, the output and
    the final state within 2e-2."""
    xs = [x.to("cuda", torch.float32) for x in scan_inputs(seed=150, Bs=1, Dm=24, N=16, L=300)]
    q = xs[4].to(dtype).transpose(1, 2).unsqueeze(2).contiguous()
    form = torch.ops.carry.mixer_form("mamba1", q, q.clone(), xs[0].to(dtype).transpose(1, 2).unsqueeze(-1).contiguous(),
                                      F.softplus(xs[1]).transpose(1, 2).contiguous(), None, None, None, 1.0, False,
                                      1e-6, 64, 0, None, None, 2, xs[2])
    assert form == "kernel", f"mamba1 {dtype}: the automatic form is {form}"

    def run(form):
        def f(u, d, A, Bm, Cm, D, z, db, h0):
            if form is not None:  # the reference: the rounded values in fp32
                u, d, Bm, Cm = (x.to(dtype).float() for x in (u, d, Bm, Cm))
            else:
                u, d, Bm, Cm = (x.to(dtype) for x in (u, d, Bm, Cm))
            return ops.selective_scan_fn(u, d, A, Bm, Cm, D, z, db, delta_softplus=True, return_last_state=True,
                                         initial_state=h0, form=form)
        return f

    if dtype == torch.float32:
        compare(run(None), run("chunkwise"), xs, tol=1e-3, names=SCAN_NAMES)
        return
    got, want = flat(run(None)(*xs)), flat(run("chunkwise")(*xs))
    for i, (x, y) in enumerate(zip(got, want)):
        assert_close(x, y, 2e-2, f"mamba1 bf16: output {i}")


# ---- carry.scan: a sequence split in two, stitched by its summaries ----

@pytest.mark.parametrize("family", ["gated_deltanet", "gla", "linear_attn"])
def test_scan_summaries(family):
    """Slices [0, 6) and [6, 10): summarize both, compose, apply to h0: the final state of the whole;
    the second slice run from apply(summary of the first, h0): the whole's output there."""
    q, k, v, g, beta, h0 = gdn_inputs(seed=110)
    gk = F.logsigmoid(randn(B, T, H, K, seed=111))
    kw = {"gated_deltanet": dict(g=g, beta=beta), "gla": dict(gk=gk), "linear_attn": {}}[family]
    state0 = [h0] if family != "linear_attn" else [h0, randn(B, H, K, seed=112)]
    cut = 6
    part = lambda x, a, b: None if x is None else x[:, a:b]  # noqa: E731
    s1 = carry.scan.summarize(family, q[:, :cut], k[:, :cut], v[:, :cut], chunk_size=CHUNK,
                              **{n: part(x, 0, cut) for n, x in kw.items()})
    s2 = carry.scan.summarize(family, q[:, cut:], k[:, cut:], v[:, cut:], chunk_size=CHUNK,
                              **{n: part(x, cut, T) for n, x in kw.items()})
    final = carry.scan.apply(family, carry.scan.compose(family, s1, s2), state0)
    if family == "gated_deltanet":
        o_ref, S_ref = ref.delta_rule(q, k, v, beta, g=g, initial_state=h0)
        o2, _ = ops.chunk_gated_delta_rule(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:],
                                           initial_state=carry.scan.apply(family, s1, state0)[0], chunk_size=CHUNK)
        assert_close(o2, o_ref[:, cut:], 1e-11, "second slice's output")
    elif family == "gla":
        _, S_ref = ref.decay(q, k, v, gk=gk, initial_state=h0)
    else:
        _, (S_ref, z_ref) = ref.linear_attn(q, k, v, initial_state=(h0, state0[1].unsqueeze(1)))
        assert_close(final[1], z_ref.squeeze(1), 1e-11, "final z")
    assert_close(final[0], S_ref, 1e-11, "final state")


def scan_inputs(seed=90, Bs=2, Dm=5, N=4, L=T):
    """Mamba-1's selective scan: u, the raw delta (softplus'd with its bias), A < 0, B, C, D, z, delta_bias,
    an initial state."""
    return [randn(Bs, Dm, L, seed=seed), randn(Bs, Dm, L, seed=seed + 1) * 0.5 - 1.0,
            -torch.exp(randn(Dm, N, seed=seed + 2) * 0.5), randn(Bs, N, L, seed=seed + 3),
            randn(Bs, N, L, seed=seed + 4), randn(Dm, seed=seed + 5), randn(Bs, Dm, L, seed=seed + 6),
            randn(Dm, seed=seed + 7) * 0.3, randn(Bs, Dm, N, seed=seed + 8)]


SCAN_NAMES = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"]


@pytest.mark.parametrize("form", ["chunkwise", "naive", None])
def test_selective_scan_fn(form):
    compare(lambda u, d, A, Bm, Cm, D, z, db, h0: ops.selective_scan_fn(
                u, d, A, Bm, Cm, D, z, db, delta_softplus=True, return_last_state=True, initial_state=h0,
                chunk_size=CHUNK, form=form),
            lambda u, d, A, Bm, Cm, D, z, db, h0: ref.selective_scan(u, d, A, Bm, Cm, D, z, db, True, h0),
            scan_inputs(), names=SCAN_NAMES)


def test_selective_scan_fn_plain_and_one_group():
    """No D, z, bias or softplus (delta given positive), B and C as [B, 1, N, L], no final state asked."""
    u, d, A, Bm, Cm = scan_inputs(seed=120)[:5]
    d = F.softplus(d)
    compare(lambda u, d, A, Bm, Cm: ops.selective_scan_fn(u, d, A, Bm.unsqueeze(1), Cm.unsqueeze(1),
                                                           chunk_size=CHUNK),
            lambda u, d, A, Bm, Cm: ref.selective_scan(u, d, A, Bm, Cm)[0],
            [u, d, A, Bm, Cm], names=SCAN_NAMES[:5])


def test_selective_scan_fn_refuses_what_it_does_not_take():
    u, d, A, Bm, Cm = scan_inputs()[:5]
    with pytest.raises(ValueError, match="complex A is not supported"):
        ops.selective_scan_fn(u, d, torch.complex(A, A), Bm, Cm)
    with pytest.raises(ValueError, match="a fixed \\[D, N\\] B"):
        ops.selective_scan_fn(u, d, A, torch.ones(A.shape, dtype=A.dtype), Cm)
    with pytest.raises(ValueError, match="delta must have u's shape"):
        ops.selective_scan_fn(u, d[:, :, :3], A, Bm, Cm)
    with pytest.raises(ValueError, match="initial_state must be a"):
        ops.selective_scan_fn(u, d, A, Bm, Cm, initial_state=torch.zeros(2, 3))
