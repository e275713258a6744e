"""carry's mixers with flash-linear-attention's arguments, so that an FLA user swaps one import.

    from carry.ops import chunk_gated_delta_rule   # instead of: from fla.ops.gated_delta_rule import ...
    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)

Every function takes FLA 0.6.0's layout and conventions: inputs [B, T, H, D], gates `g` in log space,
`scale` defaulting to 1/sqrt(K), an initial state [N, H, K, V], and returns `(o, final_state)` with o in
q's dtype and the final state in fp32 (fp64 for fp64 inputs), or None without `output_final_state`.
Each runs one of carry's mixer families through its dispatch (layers/mixer.h): the CUDA kernel form
on CUDA tensors the kernels take (a library built with CARRY_CUDA), the chunkwise ATen form otherwise,
on any device; bf16 and fp16 inputs of the chunkwise form are computed in fp32. Any T works: the
chunked forms run on T rounded up to a multiple of the chunk size, the tail padded with tokens that
leave the state unchanged (k = v = 0, no decay), and the padding is cut off the output.

Everything is differentiable in every input and in the initial state (autograd through the ATen ops
and the kernels' hand-written backwards). `cu_seqlens` (packed sequences, B = 1) runs each sequence
on its own, from its own initial state, and returns one final state a sequence.

Beyond FLA's arguments, every function takes `form` ("kernel", "chunkwise" or "naive"; default: the
dispatch's choice) and `chunk_size` (default 64). FLA options that have no counterpart here (context
parallelism's `cp_context`, `head_first`) raise an error that says so.
"""
import torch
import torch.nn.functional as F

from carry import _library

_library.load()
_ops = torch.ops.carry

_FORMS = (None, "automatic", "kernel", "chunkwise", "naive")
_L2NORM_EPS = 1e-6  # FLA's l2norm: x / sqrt(sum(x^2) + eps)
_LINEAR_ATTN_EPS = 1e-10  # FLA's normalizer: o / (q·z + eps)


def _fail(fn, message, kind=ValueError):
    raise kind(f"carry.ops.{fn}: {message}")


def _check_kwargs(fn, kwargs, allowed=()):
    if "head_first" in kwargs:
        _fail(fn, "head_first is not supported: inputs are [B, T, H, ...] (as in FLA 0.6.0, which removed it)")
    if "cp_context" in kwargs and kwargs["cp_context"] is not None:
        _fail(fn, "cp_context (FLA's context parallelism) is not supported; carry's sequence parallelism runs "
                  "in `carry train` (parallel.sp), and carry.scan gives the state summaries to split a sequence "
                  "yourself", NotImplementedError)
    unknown = sorted(set(kwargs) - set(allowed) - {"cp_context"})
    if unknown:
        _fail(fn, f"unexpected keyword argument(s) {', '.join(unknown)}", TypeError)


def _check_4d(fn, name, x):
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        _fail(fn, f"{name} must be a [B, T, H, D] tensor, got {shape}")


def _wide(x):  # fp32 for bf16 and fp16, the dtype itself otherwise
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _l2norm(x):
    xf = _wide(x)
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + _L2NORM_EPS)).to(x.dtype)


def _pad_tokens(x, pad):
    if x is None or pad == 0:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))


def _state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run(fn, family, q, k, v, *, g=None, gk=None, beta=None, l=None, a=None, b=None, initial_state=(), scale,
         normalize=False, eps=1e-6, chunk_size=64, form=None, offset=0, pad_tail=True, num_householder=1,
         decay_rate=None):
    """One family on [B, T, H, D] inputs of any T; returns (o in q's dtype, final state as a list).
    pad_tail=False: T is a multiple of chunk_size (or the form is naive) and nothing is padded.
    num_householder > 1 (gated_deltaproduct): k, v and beta hold that many rows a token of q.
    decay_rate (mamba1's A, [H, dk], no token dimension) is never padded; the kernels read it in fp32."""
    if form not in _FORMS:
        _fail(fn, f"form must be 'kernel', 'chunkwise' or 'naive' (or None for the dispatch's choice), got {form!r}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        _fail(fn, f"chunk_size must be a positive int, got {chunk_size!r}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            _fail(fn, f"q, k and v must share one dtype, got q {q.dtype} and {name} {x.dtype}")
    out_dtype, T = q.dtype, q.shape[1]
    form = form or "automatic"
    pad = 0 if form == "naive" or not pad_tail else (-T) % chunk_size
    n = num_householder
    q, g, gk, l, a, b = (_pad_tokens(x, pad) for x in (q, g, gk, l, a, b))
    k, v, beta = (_pad_tokens(x, pad * n) for x in (k, v, beta))
    if form == "automatic":
        form = _ops.mixer_form(family, q, k, v, g, gk, beta, l, scale, normalize, eps, chunk_size, offset, a, b, n,
                               decay_rate)
    if form == "kernel":
        # The kernels read q, k, v in their dtype and the gates in theirs or fp32; the level weights l and
        # the rank-one a, b in q's dtype; the state in fp32.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g, gk, beta = (None if x is None else x.contiguous() if x.dtype in (q.dtype, torch.float32)
                       else x.float().contiguous() for x in (g, gk, beta))
        l, a, b = (None if x is None else x.to(q.dtype).contiguous() for x in (l, a, b))
        decay_rate = None if decay_rate is None else decay_rate.float().contiguous()
        sdt = torch.float32
    else:
        cdt = _state_dtype(q.dtype)
        q, k, v, g, gk, beta, l, a, b, decay_rate = (None if x is None else x.to(cdt)
                                                     for x in (q, k, v, g, gk, beta, l, a, b, decay_rate))
        sdt = cdt
    state = [s.to(sdt).contiguous() for s in initial_state]
    o, final = _ops.mixer_forward(family, q, k, v, g, gk, beta, l, state, scale, normalize, eps,
                                  chunk_size, offset, form, a, b, n, decay_rate)
    if pad:
        o = o[:, :T]
    return o.to(out_dtype), [s.to(_state_dtype(s.dtype)) for s in final]


def _varlen(fn, run, per_token, cu_seqlens, initial_state, zero_state, rows=None):
    """Packed sequences: per_token maps names to [1, T, ...] tensors; run(pieces, state list) -> (o, final).
    initial_state: a list of [N, ...] tensors or None; zero_state(): a list of [1, ...] zero tensors;
    rows: names of tensors with that many rows a token ([1, T·rows, ...]), the others one."""
    rows = rows or {}
    any_t = per_token["q"] if "q" in per_token else next(iter(per_token.values()))
    if any_t.shape[0] != 1:
        _fail(fn, f"the batch size is expected to be 1 rather than {any_t.shape[0]} when using cu_seqlens; "
                  "flatten the sequences into one row first")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype.is_floating_point:
        _fail(fn, "cu_seqlens must be a 1-D integer tensor of N+1 offsets [0, ..., T]")
    bounds = [int(x) for x in cu_seqlens.cpu().tolist()]
    T = any_t.shape[1]
    if bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds, bounds[1:])):
        _fail(fn, f"cu_seqlens must rise from 0 to T={T}, got {bounds}")
    n = len(bounds) - 1
    if initial_state is not None and initial_state[0].shape[0] != n:
        _fail(fn, f"the number of initial states is expected to be equal to the number of input sequences, "
                  f"i.e., {n} rather than {initial_state[0].shape[0]}")
    outs, finals = [], []
    for i, (bos, eos) in enumerate(zip(bounds, bounds[1:])):
        init = [s[i:i + 1] for s in initial_state] if initial_state is not None else []
        if eos == bos:
            final = init if init else zero_state()
            finals.append([s.to(_state_dtype(s.dtype)) for s in final])
            continue
        o, final = run({name: x[:, bos * rows.get(name, 1):eos * rows.get(name, 1)]
                        for name, x in per_token.items()}, init)
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, 1) if outs else per_token["v"].new_zeros(per_token["v"].shape[:1] + (T,) + per_token["v"].shape[2:])
    return o, [torch.cat(parts, 0) for parts in zip(*finals)]


def _decay_family(fn, family, q, k, v, *, g=None, gk=None, beta=None, a=None, b=None, scale, initial_state,
                  output_final_state, state_v_first, cu_seqlens, chunk_size, form, num_householder=1):
    """The one-state families (S [N, H, K, V]): gated/ungated delta rule, KDA, GLA, simple GLA, RWKV-7's."""
    B, _, H, K = q.shape
    V = v.shape[-1]
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4:
            _fail(fn, "initial_state must be a [N, H, K, V] tensor")
        if state_v_first:
            initial_state = initial_state.transpose(-1, -2)
        want = (initial_state.shape[0], H, K, V)
        if tuple(initial_state.shape) != want:
            _fail(fn, f"initial_state must be [N, H={H}, K={K}, V={V}]"
                      f"{' (V-first: [N, H, V, K])' if state_v_first else ''}, got {list(initial_state.shape)}")
    per_token = {"q": q, "k": k, "v": v, "g": g, "gk": gk, "beta": beta, "a": a, "b": b}
    per_token = {n: x for n, x in per_token.items() if x is not None}

    def run(t, state):
        o, final = _run(fn, family, t["q"], t["k"], t["v"], g=t.get("g"), gk=t.get("gk"), beta=t.get("beta"),
                        a=t.get("a"), b=t.get("b"), initial_state=state, scale=scale, chunk_size=chunk_size,
                        form=form, num_householder=num_householder)
        return o, final

    if cu_seqlens is not None:
        zero = lambda: [q.new_zeros((1, H, K, V), dtype=_state_dtype(q.dtype))]  # noqa: E731
        sub = {"k": num_householder, "v": num_householder, "beta": num_householder}
        o, final = _varlen(fn, run, per_token, cu_seqlens,
                           None if initial_state is None else [initial_state], zero, rows=sub)
    else:
        if initial_state is not None and initial_state.shape[0] != B:
            _fail(fn, f"initial_state has {initial_state.shape[0]} states for a batch of {B}")
        o, final = run(per_token, [] if initial_state is None else [initial_state])
    if not output_final_state:
        return o, None
    S = final[0]
    return o, S.transpose(-1, -2) if state_v_first else S


def _scale(scale, k):
    return k.shape[-1] ** -0.5 if scale is None else float(scale)


def _gdn_gate(g, A_log, dt_bias):
    """FLA's in-kernel gate −exp(A_log)·softplus(g + dt_bias), A_log and dt_bias broadcast against g."""
    x = _wide(g)
    if dt_bias is not None:
        x = x + _wide(dt_bias)
    return -_wide(A_log).exp() * F.softplus(x)


def _fla_delta_inputs(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, HV):
    """FLA's in-kernel q/k l2 norm and beta logits (doubled with allow_neg_eigval), then each query/key head
    repeated over its HV/H value heads."""
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = _wide(beta).sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    H = q.shape[2]
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    return q, k, beta


def _check_lower_bound(fn, name, g, bound):
    """FLA's `lower_bound` contract: lower_bound <= g < 0."""
    if bound is not None and not bool(((g >= bound) & (g < 0)).all()):
        _fail(fn, f"lower_bound={bound}: expected lower_bound <= {name} < 0, got {name} in "
                  f"[{float(g.min()):.4g}, {float(g.max()):.4g}]")


@torch.compiler.disable
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                           allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, *, form=None, **kwargs):
    """Gated DeltaNet: S_t = exp(g_t)·(I − β_t k_t k_tᵀ)·S_{t−1} + β_t k_t v_tᵀ, o_t = scale·S_tᵀ q_t.

    q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H: grouped value heads, each query/key head
    serving HV/H value heads); g, beta [B, T, HV]; initial_state [N, HV, K, V]. As FLA: optional
    l2-normalized q and k (`use_qk_l2norm_in_kernel`), beta as logits (`use_beta_sigmoid_in_kernel`,
    doubled with `allow_neg_eigval`), and the gate computed from raw `g` (`use_gate_in_kernel=True` with
    `A_log` [HV] and optional `dt_bias` [HV]: g = −exp(A_log)·softplus(g + dt_bias)).
    """
    fn = "chunk_gated_delta_rule"
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            _fail(fn, "pass state_v_first or the deprecated transpose_state_layout, not both")
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    _check_kwargs(fn, dict(kwargs, cp_context=cp_context), ("chunk_size", "use_gate_in_kernel", "A_log", "dt_bias"))
    chunk_size = kwargs.get("chunk_size", 64)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(fn, name, x)
    if q.shape[2] != k.shape[2]:
        _fail(fn, f"q and k must have the same number of heads, got q.shape[2]={q.shape[2]} and k.shape[2]={k.shape[2]}")
    H, HV = q.shape[2], v.shape[2]
    if HV % H != 0:
        _fail(fn, f"num_v_heads (HV={HV}) must be a multiple of num_heads (H={H})")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        _fail(fn, "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if kwargs.get("use_gate_in_kernel", False):
        if kwargs.get("A_log") is None:
            _fail(fn, "A_log must be provided when use_gate_in_kernel=True")
        g = _gdn_gate(g, kwargs["A_log"], kwargs.get("dt_bias"))
    scale = _scale(scale, k)
    q, k, beta = _fla_delta_inputs(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                   allow_neg_eigval, HV)
    return _decay_family(fn, "gated_deltanet", q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, state_v_first=state_v_first,
                         cu_seqlens=cu_seqlens, chunk_size=chunk_size, form=form)


@torch.compiler.disable
def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, *, form=None, **kwargs):
    """DeltaNet: S_t = (I − β_t k_t k_tᵀ)·S_{t−1} + β_t k_t v_tᵀ, o_t = scale·S_tᵀ q_t.

    q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [N, H, K, V].
    """
    fn = "chunk_delta_rule"
    _check_kwargs(fn, kwargs, ("chunk_size",))
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(fn, name, x)
    if beta.dim() != 3:
        _fail(fn, f"beta must be [B, T, H], got {list(beta.shape)}")
    scale = _scale(scale, k)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    return _decay_family(fn, "deltanet", q, k, v, beta=beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, state_v_first=False, cu_seqlens=cu_seqlens,
                         chunk_size=kwargs.get("chunk_size", 64), form=form)


@torch.compiler.disable
def chunk_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                              output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                              cu_seqlens_cpu=None, cp_context=None, *, form=None, **kwargs):
    """Gated DeltaProduct (FLA's `chunk_gated_delta_product`): each token decays the state once and then
    applies num_householder delta-rule steps, S_{t,j} = (I − β_{t,j} k_{t,j} k_{t,j}ᵀ)·S_{t,j−1} +
    β_{t,j} k_{t,j} v_{t,j}ᵀ from S_{t,0} = exp(g_t)·S_{t−1}; o_t = scale·S_tᵀ q_t.

    q [B, T, H, K]; k [B, T·n, H, K], v [B, T·n, H, V], beta [B, T·n, H] with token t's step j at row t·n + j
    (n = num_householder); g [B, T, H] or None (no decay); initial_state [N, H, K, V]; cu_seqlens counts
    tokens (the rows of q).
    """
    fn = "chunk_gated_delta_product"
    _check_kwargs(fn, dict(kwargs, cp_context=cp_context), ("chunk_size",))
    if not isinstance(num_householder, int) or isinstance(num_householder, bool) or num_householder < 1:
        _fail(fn, f"num_householder must be a positive int, got {num_householder!r}")
    n = num_householder
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(fn, name, x)
    B, T, H, K = q.shape
    if tuple(k.shape) != (B, T * n, H, K):
        _fail(fn, f"k must be [B, T*num_householder, H, K] = {[B, T * n, H, K]}, got {list(k.shape)}")
    if tuple(v.shape[:3]) != (B, T * n, H):
        _fail(fn, f"v must be [B, T*num_householder, H, V] = {[B, T * n, H, 'V']}, got {list(v.shape)}")
    if tuple(beta.shape) != (B, T * n, H):
        _fail(fn, f"beta must be [B, T*num_householder, H] = {[B, T * n, H]}, got {list(beta.shape)}")
    if g is None:
        g = q.new_zeros((B, T, H), dtype=_wide(q).dtype)
    elif tuple(g.shape) != (B, T, H):
        _fail(fn, f"g must be [B, T, H] = {[B, T, H]}, got {list(g.shape)}")
    scale = _scale(scale, k)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    return _decay_family(fn, "gated_deltaproduct", q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, state_v_first=False, cu_seqlens=cu_seqlens,
                         chunk_size=kwargs.get("chunk_size", 64), form=form, num_householder=n)


@torch.compiler.disable
def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
              cu_seqlens=None, cu_seqlens_cpu=None, *, form=None, chunk_size=64):
    """Gated linear attention: S_t = diag(exp(g_t))·S_{t−1} + k_t v_tᵀ, o_t = scale·S_tᵀ q_t.

    q, k, g [B, T, H, K] (g a log decay per key dimension); v [B, T, H, V]; initial_state [N, H, K, V].
    """
    fn = "chunk_gla"
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        _check_4d(fn, name, x)
    if q.shape != k.shape or q.shape != g.shape:
        _fail(fn, f"q, k and g must have the same shape, got {list(q.shape)}, {list(k.shape)}, {list(g.shape)}")
    return _decay_family(fn, "gla", q, k, v, gk=g, scale=_scale(scale, q), initial_state=initial_state,
                         output_final_state=output_final_state, state_v_first=state_v_first,
                         cu_seqlens=cu_seqlens, chunk_size=chunk_size, form=form)


@torch.compiler.disable
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, *, form=None, **kwargs):
    """Kimi Delta Attention (FLA's `chunk_kda`, carry's `kda`): S_t = (I − β_t k_t k_tᵀ)·Diag(exp(g_t))·S_{t−1}
    + β_t k_t v_tᵀ, o_t = scale·S_tᵀ q_t, a log decay per key dimension.

    q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H: grouped value heads); g [B, T, HV, K]; beta
    [B, T, HV]; initial_state [N, HV, K, V]. As FLA: `use_qk_l2norm_in_kernel`, `use_beta_sigmoid_in_kernel`
    (doubled with `allow_neg_eigval`), and `use_gate_in_kernel` with `A_log` [HV] and optional `dt_bias`
    [HV·K] (g = −exp(A_log)·softplus(g + dt_bias); with `lower_bound`, FLA's bounded gate
    lower_bound·sigmoid(exp(A_log)·(g + dt_bias)), A_log optional). `safe_gate` and `disable_recompute` change
    nothing here.
    """
    fn = "chunk_kda"
    _check_kwargs(fn, dict(kwargs, cp_context=cp_context), ("chunk_size", "A_log", "dt_bias"))
    for name, on in (("return_intermediate_states", return_intermediate_states), ("use_graph", use_graph)):
        if on:
            _fail(fn, f"{name} is not supported (FLA's inference and CUDA-graph paths)", NotImplementedError)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        _check_4d(fn, name, x)
    if q.shape != k.shape:
        _fail(fn, f"q and k must have the same shape, got {list(q.shape)} and {list(k.shape)}")
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV % H != 0:
        _fail(fn, f"num_v_heads (HV={HV}) must be a multiple of num_heads (H={H})")
    if tuple(g.shape) != (B, T, HV, K):
        _fail(fn, f"g must be [B, T, HV, K] = {[B, T, HV, K]}, got {list(g.shape)}")
    if beta.dim() != 3 or tuple(beta.shape) != (B, T, HV):
        _fail(fn, f"beta must be [B, T, HV] = {[B, T, HV]}, got {list(beta.shape)}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        _fail(fn, "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
        if A_log is None and lower_bound is None:
            _fail(fn, "A_log must be provided when use_gate_in_kernel=True and lower_bound is not set")
        dt_bias = None if dt_bias is None else dt_bias.view(HV, K)
        if lower_bound is None:
            g = _gdn_gate(g, A_log.view(HV, 1), dt_bias)
        else:  # FLA's bounded gate: lower_bound·sigmoid(exp(A_log)·(g + dt_bias)), in [lower_bound, 0)
            x = _wide(g) if dt_bias is None else _wide(g) + _wide(dt_bias)
            g = lower_bound * torch.sigmoid(x if A_log is None else _wide(A_log).view(HV, 1).exp() * x)
    _check_lower_bound(fn, "g", g, lower_bound)
    scale = _scale(scale, k)
    q, k, beta = _fla_delta_inputs(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                   allow_neg_eigval, HV)
    return _decay_family(fn, "kda", q, k, v, gk=g, beta=beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, state_v_first=state_v_first,
                         cu_seqlens=cu_seqlens, chunk_size=kwargs.get("chunk_size", 64), form=form)


@torch.compiler.disable
def chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None, cu_seqlens_cpu=None, *, form=None, **kwargs):
    """The diagonal-plus-rank-one delta rule (FLA's generalized delta rule, carry's `rwkv7` family):
    S_t = Diag(exp(gk_t))·S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ, o_t = scale·S_tᵀ q_t.

    q, k, a, b, gk [B, T, H, K] (gk a log decay per key dimension); v [B, T, H, V]; initial_state
    [N, H, K, V]. FLA's kernel options `safe_gate`, `disable_recompute` and `lower_bound` are accepted:
    the first two change nothing here; `lower_bound` checks lower_bound <= gk < 0, as FLA asserts it.
    """
    return _dplr("chunk_dplr_delta_rule", q, k, v, a, b, gk, _scale(scale, k), initial_state, output_final_state,
                 cu_seqlens, form, kwargs)


@torch.compiler.disable
def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                cu_seqlens_cpu=None, *, form=None, **kwargs):
    """RWKV-7's state update, FLA's `chunk_rwkv7`: chunk_dplr_delta_rule with q = r (the receptance),
    gk = w (the log decay, [B, T, H, K]) and scale 1 by default. RWKV-7 passes a = −κ̂ and b = κ̂ ⊙ a_lr."""
    return _dplr("chunk_rwkv7", r, k, v, a, b, w, float(scale), initial_state, output_final_state, cu_seqlens,
                 form, kwargs, gate_name="w", query_name="r")


def _dplr(fn, q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens, form, kwargs,
          gate_name="gk", query_name="q"):
    _check_kwargs(fn, kwargs, ("chunk_size", "safe_gate", "disable_recompute", "lower_bound"))
    for name, x in ((query_name, q), ("k", k), ("v", v), ("a", a), ("b", b), (gate_name, gk)):
        _check_4d(fn, name, x)
    for name, x in (("k", k), ("a", a), ("b", b), (gate_name, gk)):
        if x.shape != q.shape:
            _fail(fn, f"{name} must have {query_name}'s shape {list(q.shape)}, got {list(x.shape)}")
    _check_lower_bound(fn, gate_name, gk, kwargs.get("lower_bound"))
    return _decay_family(fn, "rwkv7", q, k, v, gk=gk, a=a, b=b, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, state_v_first=False, cu_seqlens=cu_seqlens,
                         chunk_size=kwargs.get("chunk_size") or 64, form=form)


@torch.compiler.disable
def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, *, form=None, **kwargs):
    """Simple GLA (a scalar decay per head and token): S_t = exp(g_t)·S_{t−1} + k_t v_tᵀ, o_t = scale·S_tᵀ q_t.

    g [B, T, H] (log decay per token), or g_gamma [H] (a fixed log decay per head), or neither (no decay).
    """
    fn = "chunk_simple_gla"
    _check_kwargs(fn, kwargs, ("chunk_size",))
    chunk_size = kwargs.get("chunk_size") or 64
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(fn, name, x)
    B, T, H, _ = q.shape
    if g is not None and g_gamma is not None:
        _fail(fn, "give g or g_gamma, not both")
    if g_gamma is not None:
        if g_gamma.shape != (H,):
            _fail(fn, f"g_gamma must be [H={H}], got {list(g_gamma.shape)}")
        g = g_gamma.view(1, 1, H).expand(B, T, H)
    elif g is None:
        g = q.new_zeros((B, T, H), dtype=torch.float32)
    return _decay_family(fn, "scalar_decay", q, k, v, g=g, scale=_scale(scale, k), initial_state=initial_state,
                         output_final_state=output_final_state, state_v_first=state_v_first,
                         cu_seqlens=cu_seqlens, chunk_size=chunk_size, form=form)


@torch.compiler.disable
def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                      cu_seqlens=None, *, form=None, chunk_size=64):
    """Linear attention: S_t = S_{t−1} + k_t v_tᵀ, o_t = scale·S_tᵀ q_t; with `normalize` (FLA's default)
    divided by scale·q_tᵀ z_t + 1e-10, z_t = z_{t−1} + k_t. No feature map is applied (apply yours to q, k).

    Without `normalize`, the state is S [N, H, K, V]. With it, as FLA: initial_state (S, z) with z
    [N, 1, H, K] (or S alone: z starts at zero), and the second result is (S or None, z).
    """
    fn = "chunk_linear_attn"
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(fn, name, x)
    B, _, H, K = q.shape
    V = v.shape[-1]
    scale = _scale(scale, k)
    S0, z0 = initial_state, None
    if isinstance(initial_state, (tuple, list)):
        if not normalize:
            _fail(fn, "initial_state is a (S, z) pair only with normalize=True; without, it is S [N, H, K, V]")
        S0, z0 = initial_state
    n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    sdt = _state_dtype(q.dtype)
    if S0 is not None and (S0.dim() != 4 or tuple(S0.shape[1:]) != (H, K, V)):
        _fail(fn, f"the initial state S must be [N, H={H}, K={K}, V={V}], got {list(S0.shape)}")
    if z0 is not None and (z0.dim() != 4 or tuple(z0.shape[1:]) != (1, H, K)):
        _fail(fn, f"the initial state z must be [N, 1, H={H}, K={K}], got {list(z0.shape)}")
    state = None
    if S0 is not None or z0 is not None:
        rows = (S0 if S0 is not None else z0).shape[0]
        S0 = S0 if S0 is not None else q.new_zeros((rows, H, K, V), dtype=sdt)
        z0 = z0.squeeze(1) if z0 is not None else q.new_zeros((rows, H, K), dtype=sdt)
        state = [S0, z0]

    def run(t, st):
        return _run(fn, "linear_attn", t["q"], t["k"], t["v"], initial_state=st, scale=scale, normalize=normalize,
                    eps=_LINEAR_ATTN_EPS, chunk_size=chunk_size, form=form)

    per_token = {"q": q, "k": k, "v": v}
    if cu_seqlens is not None:
        zero = lambda: [q.new_zeros((1, H, K, V), dtype=sdt), q.new_zeros((1, H, K), dtype=sdt)]  # noqa: E731
        o, final = _varlen(fn, run, per_token, cu_seqlens, state, zero)
    else:
        if state is not None and state[0].shape[0] != n:
            _fail(fn, f"initial_state has {state[0].shape[0]} states for a batch of {B}")
        o, final = run(per_token, state or [])
    S, z = final
    if normalize:
        return o, (S if output_final_state else None, z.unsqueeze(1))
    return o, S if output_final_state else None


# Higher-order linear attention: the state tensors of each family, in carry's order (layers/hla/hla.h),
# and each one's shape after [N, H]: "kk" [K, K], "kv" [K, V], "k" [K].
_HLA_STATES = {"hla2": (("S", "kk"), ("C", "kv"), ("m", "k"), ("G", "kv"), ("h", "k")),
               "ahla": (("P", "kv"), ("m_K", "k"), ("E", "kv"), ("n", "k"))}


# FLA's fused_recurrent_* functions (its token-by-token kernels, which its layers call for short inputs at
# inference) take the same arguments as the chunk_* ones: here they are the same carry forms, the
# dispatch's choice (the kernels on CUDA tensors, padded to whole chunks), so an FLA model's decoding path
# swaps its import too.
@torch.compiler.disable
def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, form=None, **kwargs):
    """FLA's fused_recurrent_gated_delta_rule: Gated DeltaNet with g [B, T, HV] (chunk_gated_delta_rule), or
    with gk [B, T, HV, K] a decay per key dimension (chunk_kda; with g too, both decays); beta [B, T, HV]
    defaults to ones as in FLA."""
    fn = "fused_recurrent_gated_delta_rule"
    if gv is not None:
        _fail(fn, "gv (a decay per value dimension) is not supported: no carry family decays the value side",
              NotImplementedError)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    common = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                  allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens, form=form)
    if gk is not None:
        if use_gate_in_kernel:
            _fail(fn, "use_gate_in_kernel with gk is not supported (pass the decays gk themselves)",
                  NotImplementedError)
        if g is not None:
            gk = _wide(gk) + _wide(g).unsqueeze(-1)
        return chunk_kda(q, k, v, gk, beta, **common, **kwargs)
    if g is None:
        if use_gate_in_kernel:
            _fail(fn, "`g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`")
        g = torch.zeros(v.shape[:3], dtype=_wide(q).dtype, device=q.device)
    return chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                                  dt_bias=dt_bias, **common, **kwargs)


@torch.compiler.disable
def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, form=None, **kwargs):
    """FLA's fused_recurrent_delta_rule: chunk_delta_rule's arguments, beta [B, T, H] defaulting to ones."""
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    return chunk_delta_rule(q, k, v, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            cu_seqlens=cu_seqlens, form=form, **kwargs)


def _no_reverse(fn, reverse, gv):
    if reverse:
        _fail(fn, "reverse=True (the state passed from the last token to the first) is not supported",
              NotImplementedError)
    if gv is not None:
        _fail(fn, "gv (a decay per value dimension) is not supported: no carry family decays the value side",
              NotImplementedError)


@torch.compiler.disable
def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                        reverse=False, state_v_first=False, cu_seqlens=None, *, form=None, **kwargs):
    """FLA's fused_recurrent_gla: chunk_gla's arguments; gk None is no decay."""
    _no_reverse("fused_recurrent_gla", reverse, gv)
    if gk is None:
        gk = torch.zeros(k.shape, dtype=_wide(q).dtype, device=q.device)
    return chunk_gla(q, k, v, gk, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     state_v_first=state_v_first, cu_seqlens=cu_seqlens, form=form, **kwargs)


@torch.compiler.disable
def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None, *,
                               form=None, **kwargs):
    """FLA's fused_recurrent_simple_gla: chunk_simple_gla's arguments."""
    _no_reverse("fused_recurrent_simple_gla", reverse, None)
    return chunk_simple_gla(q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, state_v_first=state_v_first,
                            cu_seqlens=cu_seqlens, form=form, **kwargs)


def _qkv_dims(fn, q, k, v):
    """(B, T, H, K, V) of [B, T, H, K] q and k and [B, T, H, V] v, one query/key head a value head."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(fn, name, x)
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        _fail(fn, f"q and k must be [B, T, H, K] and v [B, T, H, V] with one head each (no grouped heads), got "
                  f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    return (*q.shape, v.shape[-1])


def _hla(fn, family, q, k, v, g, scale, initial_state, output_final_state, normalize, eps, cu_seqlens,
         chunk_size, form):
    B, T, H, K, V = _qkv_dims(fn, q, k, v)
    if g is not None and (not isinstance(g, torch.Tensor) or tuple(g.shape) != (B, T, H)):
        _fail(fn, f"g must be a [B, T, H] = [{B}, {T}, {H}] tensor of log decays, got "
                  f"{list(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}")
    dims = {"kk": (K, K), "kv": (K, V), "k": (K,)}
    specs = _HLA_STATES[family]
    names = ", ".join(n for n, _ in specs)
    state = None
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != len(specs):
            _fail(fn, f"initial_state must be a tuple of {len(specs)} tensors ({names}), got "
                      f"{type(initial_state).__name__}"
                      f"{' of ' + str(len(initial_state)) if isinstance(initial_state, (tuple, list)) else ''}")
        n = initial_state[0].shape[0] if isinstance(initial_state[0], torch.Tensor) else -1
        for (name, kind), x in zip(specs, initial_state):
            want = (n, H) + dims[kind]
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
                _fail(fn, f"initial_state's {name} must be [N, H, {', '.join(map(str, dims[kind]))}] = "
                          f"{list(want)}, got {list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        state = list(initial_state)
    scale = _scale(scale, k)

    def run(t, st):
        return _run(fn, family, t["q"], t["k"], t["v"], g=t.get("g"), initial_state=st, scale=scale,
                    normalize=normalize, eps=eps, chunk_size=chunk_size, form=form)

    per_token = {n: x for n, x in (("q", q), ("k", k), ("v", v), ("g", g)) if x is not None}
    if cu_seqlens is not None:
        sdt = _state_dtype(q.dtype)
        zero = lambda: [q.new_zeros((1, H) + dims[kind], dtype=sdt) for _, kind in specs]  # noqa: E731
        o, final = _varlen(fn, run, per_token, cu_seqlens, state, zero)
    else:
        if state is not None and state[0].shape[0] != B:
            _fail(fn, f"initial_state has {state[0].shape[0]} states for a batch of {B}")
        o, final = run(per_token, state or [])
    return o, tuple(final) if output_final_state else None


def chunk_hla2(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, normalize=False,
               eps=1e-6, cu_seqlens=None, *, form=None, chunk_size=64):
    """Second-order (masked) higher-order linear attention, carry's `hla2` (no FLA counterpart), per head:
        S_t = γ_t S_{t−1} + k_t k_tᵀ,  C_t = γ_t C_{t−1} + q_t v_tᵀ,  m_t = γ_t m_{t−1} + q_t,
        G_t = γ_t G_{t−1} + k_t k_tᵀ C_{t−1},  h_t = γ_t h_{t−1} + k_t k_tᵀ m_{t−1},
        o_t = scale·q_tᵀ (S_t C_t − G_t), with `normalize` divided by scale·q_tᵀ (S_t m_t − h_t) + eps,
    γ_t = exp(g_t) (g [B, T, H] log decays, or None: no decay). The state is the tuple (S [N, H, K, K],
    C [N, H, K, V], m [N, H, K], G [N, H, K, V], h [N, H, K]), in and out.
    """
    fn = "chunk_hla2"
    return _hla(fn, "hla2", q, k, v, g, scale, initial_state, output_final_state, normalize, eps, cu_seqlens,
                chunk_size, form)


def chunk_ahla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, normalize=False,
               eps=1e-6, cu_seqlens=None, *, form=None, chunk_size=64):
    """Asymmetric higher-order linear attention, carry's `ahla` (no FLA counterpart), per head:
        P_t = γ_t P_{t−1} + k_t v_tᵀ,  E_t = γ_t E_{t−1} + k_t (q_tᵀ P_t),
        m_K,t = γ_t m_K,t−1 + k_t,  n_t = γ_t n_{t−1} + k_t (q_tᵀ m_K,t),
        o_t = scale·q_tᵀ E_t, with `normalize` divided by scale·q_tᵀ n_t + eps,
    γ_t = exp(g_t) (g [B, T, H] or None). The state is the tuple (P [N, H, K, V], m_K [N, H, K],
    E [N, H, K, V], n [N, H, K]).
    """
    fn = "chunk_ahla"
    return _hla(fn, "ahla", q, k, v, g, scale, initial_state, output_final_state, normalize, eps, cu_seqlens,
                chunk_size, form)


def _grouped_heads(fn, q, k, v):
    """q, k [B, T, G, K] and v [B, T, H, V] with H a multiple of G (FLA's grouped heads: each query/key head
    serves H/G consecutive value heads): q and k repeated to H heads."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(fn, name, x)
    G, H = q.shape[2], v.shape[2]
    if k.shape == q.shape and G != H and G > 0 and H % G == 0 and v.shape[:2] == q.shape[:2]:
        q, k = q.repeat_interleave(H // G, dim=2), k.repeat_interleave(H // G, dim=2)
    elif k.shape == q.shape and v.shape[:2] == q.shape[:2] and H % max(G, 1):
        _fail(fn, f"the number of value heads H={H} must be a multiple of the query/key heads G={G}")
    return q, k


def _log_linear(fn, family, q, k, v, g, beta, level_scales, scale, initial_state, output_final_state, cu_seqlens,
                offset, chunk_size, form):
    q, k = _grouped_heads(fn, q, k, v)
    B, T, H, K, V = _qkv_dims(fn, q, k, v)
    for name, x in (("g", g), ("beta", beta)):
        if (name == "g" or family == "loglinear_gdn") and \
                (not isinstance(x, torch.Tensor) or tuple(x.shape) != (B, T, H)):
            _fail(fn, f"{name} must be a [B, T, H] = [{B}, {T}, {H}] tensor, got "
                      f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(level_scales, torch.Tensor) or level_scales.dim() != 4 or \
            tuple(level_scales.shape[:3]) != (B, T, H):
        _fail(fn, f"level_scales must be [B, T, H, L] = [{B}, {T}, {H}, L], got "
                  f"{list(level_scales.shape) if isinstance(level_scales, torch.Tensor) else type(level_scales).__name__}")
    if not isinstance(offset, int) or offset < 0:
        _fail(fn, f"offset (the absolute position of the first token) must be a non-negative int, got {offset!r}")
    if form != "naive" and offset % chunk_size:
        _fail(fn, f"offset must be a multiple of chunk_size={chunk_size} (chunks start there), got {offset}; "
                  "form='naive' takes any offset")
    L = level_scales.shape[-1]
    lengths = [T]
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
        bounds = cu_seqlens.tolist()
        lengths = [int(b) - int(a) for a, b in zip(bounds[:-1], bounds[1:])]
    need = (offset + max(lengths + [0])).bit_length() + 1
    if L < need:
        _fail(fn, f"level_scales has L={L} levels; positions up to {offset + max(lengths + [0])} and the state "
                  f"there need L >= {need}")
    state = None
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != L - 1 or \
                not all(isinstance(x, torch.Tensor) and x.dim() == 4 and tuple(x.shape[1:]) == (H, K, V)
                        for x in initial_state):
            _fail(fn, f"initial_state must be a tuple of L-1 = {L - 1} level states, each [N, H={H}, K={K}, "
                      f"V={V}] (carry's state: one entry per bit of the position; FLA's LogLinearAttentionState "
                      f"is not taken), got {type(initial_state).__name__}")
        state = list(initial_state)
    scale = _scale(scale, k)

    def run(t, st):
        # The chunked form on whole chunks, the last partial chunk by the recurrence from the state there:
        # the state at the end is the state at T (padding would move it to a later boundary).
        n = t["q"].shape[1]
        main = n if form == "naive" else n - n % chunk_size
        pieces = [(0, main, form), (main, n, "naive")]
        outs = []
        for a, b, f in pieces:
            if b == a:
                continue
            o, st = _run(fn, family, t["q"][:, a:b], t["k"][:, a:b], t["v"][:, a:b], g=t["g"][:, a:b],
                         beta=None if t.get("beta") is None else t["beta"][:, a:b], l=t["l"][:, a:b],
                         initial_state=st, scale=scale, chunk_size=chunk_size, form=f, offset=offset + a,
                         pad_tail=False)
            outs.append(o)
        if not outs:
            return t["v"].new_zeros(t["v"].shape), st
        return torch.cat(outs, 1), st

    per_token = {n: x for n, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("l", level_scales))
                 if x is not None}
    sdt = _state_dtype(q.dtype)
    zero = lambda n=1: [q.new_zeros((n, H, K, V), dtype=sdt) for _ in range(L - 1)]  # noqa: E731
    if cu_seqlens is not None:
        o, final = _varlen(fn, run, per_token, cu_seqlens, state, zero)
    else:
        if state is not None and state[0].shape[0] != B:
            _fail(fn, f"initial_state has {state[0].shape[0]} states for a batch of {B}")
        o, final = run(per_token, state if state is not None else zero(B))
    return o, tuple(final) if output_final_state else None


def chunk_log_linear_attn(q, k, v, g, level_scales, initial_state=None, output_final_state=False, cu_seqlens=None,
                          scale=1.0, *, offset=0, form=None, chunk_size=64):
    """Log-linear attention over Mamba-2 (carry's `loglinear_mamba2`), FLA 0.6.0's `chunk_log_linear_attn`
    arguments: o_t = scale·Σ_{s≤t} exp(g_{s+1} + … + g_t)·level_scales[t, ℓ(t, s)]·(q_t·k_s)·v_s, ℓ(t, s) the
    Fenwick level bit_width(t xor s) of absolute positions (offset + index), g [B, T, H] log decays,
    level_scales [B, T, H, L]; `scale` defaults to 1.0 as FLA's does (None: 1/sqrt(K)).

    The state at a position p is carry's: a tuple of L-1 tensors [N, H, K, V], one per bit of p (FLA's
    LogLinearAttentionState is not taken); a state continues at `offset` = p. q, k may have G heads for v's H
    (H a multiple of G: each query/key head serves H/G consecutive value heads, as FLA's).
    """
    fn = "chunk_log_linear_attn"
    return _log_linear(fn, "loglinear_mamba2", q, k, v, g, None, level_scales, scale, initial_state,
                       output_final_state, cu_seqlens, offset, chunk_size, form)


def chunk_log_linear_gated_delta_rule(q, k, v, g, beta, level_scales, initial_state=None, output_final_state=False,
                                      cu_seqlens=None, scale=None, *, offset=0, form=None, chunk_size=64):
    """Log-linear Gated DeltaNet (carry's `loglinear_gdn`, no FLA counterpart): the Fenwick levels of
    chunk_log_linear_attn over Gated DeltaNet's transition (g [B, T, H] log decays, beta [B, T, H]), read with
    level_scales [B, T, H, L]; scale defaults to 1/sqrt(K). The state and grouped heads as in
    chunk_log_linear_attn.
    """
    fn = "chunk_log_linear_gated_delta_rule"
    return _log_linear(fn, "loglinear_gdn", q, k, v, g, beta, level_scales, scale, initial_state,
                       output_final_state, cu_seqlens, offset, chunk_size, form)


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, *, initial_state=None, chunk_size=64, form=None):
    """Mamba-1's selective scan (S6) with mamba_ssm's arguments (mamba_ssm.ops.selective_scan_interface.
    selective_scan_fn), on carry's mamba1 family: the selective-scan kernels on CUDA tensors they take,
    the chunkwise form elsewhere.

    u, delta, z: [B, D, L]; A: [D, N] real (negative for a decay); B, C: [B, N, L] or [B, 1, N, L] (one
    group); D, delta_bias: [D]. delta ← softplus(delta + delta_bias) as the flags say; per channel d and
    state n, h_t = exp(delta_t A) h_{t−1} + delta_t B_t u_t and y_t = C_tᵀ h_t; out = y + D ⊙ u, times silu(z)
    when z is given, in u's dtype. return_last_state: also the final state [B, D, N] in fp32 (fp64 for
    fp64 inputs). Beyond mamba_ssm: initial_state [B, D, N], `form` and `chunk_size` as the FLA-style
    functions take them. The kernels take N ∈ {4, 8, 16}."""
    fn = "selective_scan_fn"
    for name, x in (("u", u), ("delta", delta)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            _fail(fn, f"{name} must be a [B, D, L] tensor, got {None if not isinstance(x, torch.Tensor) else list(x.shape)}")
    if delta.shape != u.shape:
        _fail(fn, f"delta must have u's shape {list(u.shape)}, got {list(delta.shape)}")
    Bs, Dm, L = u.shape
    if not isinstance(A, torch.Tensor) or A.dim() != 2 or A.shape[0] != Dm or A.is_complex():
        _fail(fn, f"A must be a real [D, N] tensor with D = {Dm} (complex A is not supported), got "
                  f"{None if not isinstance(A, torch.Tensor) else (list(A.shape), A.dtype)}")
    N = A.shape[1]

    def rows(name, x):  # B or C as [B, L, 1, N]
        if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[1] == 1:
            x = x[:, 0]
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape) != (Bs, N, L):
            _fail(fn, f"{name} must be an input-dependent [B, N, L] = {[Bs, N, L]} tensor (or [B, 1, N, L]; "
                      f"a fixed [D, N] {name} and several groups are not supported), got "
                      f"{None if not isinstance(x, torch.Tensor) else list(x.shape)}")
        return x.transpose(1, 2).unsqueeze(2)

    for name, x, shape in (("D", D, (Dm,)), ("delta_bias", delta_bias, (Dm,)), ("z", z, tuple(u.shape)),
                           ("initial_state", initial_state, (Bs, Dm, N))):
        if x is not None and (not isinstance(x, torch.Tensor) or tuple(x.shape) != shape):
            _fail(fn, f"{name} must be a {list(shape)} tensor, got {None if not isinstance(x, torch.Tensor) else list(x.shape)}")
    wide = _wide(u)
    dt = delta.to(wide)
    if delta_bias is not None:
        dt = dt + delta_bias.to(wide)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    dt = dt.transpose(1, 2)  # [B, L, D]
    v = (dt * u.to(wide).transpose(1, 2)).to(u.dtype).unsqueeze(-1)  # Δ⊙x [B, L, D, 1]
    q, k = rows("C", C).to(u.dtype), rows("B", B).to(u.dtype)
    state = () if initial_state is None else [initial_state.unsqueeze(-1)]
    o, final = _run(fn, "mamba1", q, k, v, g=dt, decay_rate=A, initial_state=state, scale=1.0,
                    chunk_size=chunk_size, form=form)
    out = o[..., 0].transpose(1, 2).to(wide)
    if D is not None:
        out = out + u.to(wide) * D.to(wide)[:, None]
    if z is not None:
        out = out * F.silu(z.to(wide))
    out = out.to(u.dtype)
    return (out, final[0][..., 0]) if return_last_state else out


__all__ = ["chunk_gated_delta_rule", "chunk_delta_rule", "chunk_gated_delta_product",
           "fused_recurrent_gated_delta_rule", "fused_recurrent_delta_rule", "fused_recurrent_gla",
           "fused_recurrent_simple_gla", "chunk_gla", "chunk_simple_gla", "chunk_linear_attn",
           "chunk_kda", "chunk_dplr_delta_rule", "chunk_rwkv7",
           "chunk_hla2", "chunk_ahla", "chunk_log_linear_attn", "chunk_log_linear_gated_delta_rule",
           "selective_scan_fn"]
