"""Token-by-token recurrences in fp64, the definitions that the tests hold carry.ops to.

Each follows flash-linear-attention's conventions (its naive references): inputs [B, T, H, D], log
gates, o_t = scale·S_tᵀ q_t read after the token's update, states [B, H, K, V]. Written as plain loops
over tokens so that nothing is shared with carry's chunkwise or kernel forms.
"""
import torch


def _heads(x):  # [B, T, H, ...] -> [B, H, T, ...]
    return x.transpose(1, 2).double()


def delta_rule(q, k, v, beta, g=None, scale=None, initial_state=None):
    """S_t = exp(g_t)·(S_{t-1} − β_t k_t (k_tᵀ S_{t-1})) + β_t k_t v_tᵀ (no g: DeltaNet): one step a token."""
    return delta_product(q, k, v, g, beta, 1, scale=scale, initial_state=initial_state)


def delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None):
    """Gated DeltaProduct (FLA's naive_recurrent_gated_delta_product): per token S ← exp(g_t)·S, then for
    j < n: S ← S + β_{t,j} k_{t,j} (v_{t,j} − k_{t,j}ᵀ S)ᵀ with k, v, beta [B, T·n, H, ...] (token t's step j
    at row t·n + j); o_t = scale·S_tᵀ q_t."""
    n = num_householder
    q, k, v, beta = _heads(q), _heads(k), _heads(v), _heads(beta)
    g = None if g is None else _heads(g)
    B, H, T, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if initial_state is None else initial_state.double()
    outs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, :, t].exp()[..., None, None]
        for j in range(n):
            kt, r = k[:, :, t * n + j], t * n + j
            err = v[:, :, r] - torch.einsum("bhk,bhkv->bhv", kt, S)
            S = S + torch.einsum("bhk,bhv->bhkv", kt, err * beta[:, :, r][..., None])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t] * scale, S))
    o = torch.stack(outs, 2) if outs else torch.zeros(B, H, 0, v.shape[-1], dtype=torch.float64)
    return o.transpose(1, 2), S


def decay(q, k, v, g=None, gk=None, scale=None, initial_state=None):
    """S_t = exp(g_t)·S_{t-1} (g [B,T,H]) or diag(exp(gk_t))·S_{t-1} (gk [B,T,H,K]), + k_t v_tᵀ."""
    q, k, v = _heads(q), _heads(k), _heads(v)
    B, H, T, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if initial_state is None else initial_state.double()
    g = None if g is None else _heads(g)
    gk = None if gk is None else _heads(gk)
    outs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, :, t].exp()[..., None, None]
        if gk is not None:
            S = S * gk[:, :, t].exp()[..., None]
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t] * scale, S))
    return torch.stack(outs, 2).transpose(1, 2), S


def kda(q, k, v, g, beta, scale=None, initial_state=None):
    """S_t = (I − β_t k_t k_tᵀ)·diag(exp(g_t))·S_{t-1} + β_t k_t v_tᵀ, g [B,T,H,K] (FLA's naive_recurrent_kda)."""
    q, k, v, g, beta = (_heads(x) for x in (q, k, v, g, beta))
    B, H, T, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if initial_state is None else initial_state.double()
    outs = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None]
        kt = k[:, :, t]
        err = v[:, :, t] - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt, err * beta[:, :, t][..., None])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t] * scale, S))
    return torch.stack(outs, 2).transpose(1, 2), S


def dplr(q, k, v, a, b, gk, scale=None, initial_state=None):
    """S_t = diag(exp(gk_t))·S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ (FLA's generalized delta rule; RWKV-7)."""
    q, k, v, a, b, gk = (_heads(x) for x in (q, k, v, a, b, gk))
    B, H, T, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if initial_state is None else initial_state.double()
    outs = []
    for t in range(T):
        read = torch.einsum("bhk,bhkv->bhv", a[:, :, t], S)  # a_tᵀ S_{t-1}
        S = (S * gk[:, :, t].exp()[..., None] + torch.einsum("bhk,bhv->bhkv", b[:, :, t], read)
             + torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t]))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t] * scale, S))
    return torch.stack(outs, 2).transpose(1, 2), S


def linear_attn(q, k, v, scale=None, initial_state=None, normalize=False, eps=1e-10):
    """S_t = S_{t-1} + k_t v_tᵀ, z_t = z_{t-1} + k_t; o_t = scale·S_tᵀ q_t, normalized by scale·q_tᵀ z_t + eps.
    initial_state: (S [B,H,K,V], z [B,1,H,K]) or None. Returns o, (S, z [B,1,H,K])."""
    qh, kh, vh = _heads(q), _heads(k), _heads(v)
    B, H, T, K = kh.shape
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(B, H, K, vh.shape[-1], dtype=torch.float64)
    z = torch.zeros(B, H, K, dtype=torch.float64)
    if initial_state is not None:
        S = initial_state[0].double()
        z = initial_state[1].double().squeeze(1)
    outs = []
    for t in range(T):
        S = S + torch.einsum("bhk,bhv->bhkv", kh[:, :, t], vh[:, :, t])
        z = z + kh[:, :, t]
        qt = qh[:, :, t] * scale
        o = torch.einsum("bhk,bhkv->bhv", qt, S)
        if normalize:
            o = o / ((qt * z).sum(-1, keepdim=True) + eps)
        outs.append(o)
    return torch.stack(outs, 2).transpose(1, 2), (S, z.unsqueeze(1))


def l2norm(x, eps=1e-6):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def hla2(q, k, v, g=None, scale=None, initial_state=None, normalize=False, eps=1e-6):
    """S_t = γS + k kᵀ, C_t = γC + q vᵀ, m_t = γm + q, G_t = γG + k kᵀ C_{t-1}, h_t = γh + k kᵀ m_{t-1};
    o_t = scale·q_tᵀ(S_t C_t − G_t) (normalized: / (scale·q_tᵀ(S_t m_t − h_t) + eps)); γ_t = exp(g_t).
    initial_state: (S, C, m, G, h) or None. Returns o, (S, C, m, G, h)."""
    qh, kh, vh = _heads(q), _heads(k), _heads(v)
    B, H, T, K = kh.shape
    V = vh.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    f64 = torch.float64
    if initial_state is None:
        S, C, m, G, h = (torch.zeros(B, H, K, K, dtype=f64), torch.zeros(B, H, K, V, dtype=f64),
                         torch.zeros(B, H, K, dtype=f64), torch.zeros(B, H, K, V, dtype=f64),
                         torch.zeros(B, H, K, dtype=f64))
    else:
        S, C, m, G, h = (x.double() for x in initial_state)
    gh = None if g is None else _heads(g)
    outs = []
    for t in range(T):
        gamma = 1.0 if gh is None else gh[:, :, t].exp()
        qt, kt, vt = qh[:, :, t], kh[:, :, t], vh[:, :, t]
        kk = torch.einsum("bhi,bhj->bhij", kt, kt)
        G = _scale_by(gamma, G) + torch.einsum("bhij,bhjv->bhiv", kk, C)
        h = _scale_by(gamma, h) + torch.einsum("bhij,bhj->bhi", kk, m)
        S = _scale_by(gamma, S) + kk
        C = _scale_by(gamma, C) + torch.einsum("bhk,bhv->bhkv", qt, vt)
        m = _scale_by(gamma, m) + qt
        num = torch.einsum("bhk,bhkv->bhv", qt * scale, torch.einsum("bhij,bhjv->bhiv", S, C) - G)
        if normalize:
            den = torch.einsum("bhk,bhk->bh", qt * scale, torch.einsum("bhij,bhj->bhi", S, m) - h)
            num = num / (den[..., None] + eps)
        outs.append(num)
    return torch.stack(outs, 2).transpose(1, 2), (S, C, m, G, h)


def ahla(q, k, v, g=None, scale=None, initial_state=None, normalize=False, eps=1e-6):
    """P_t = γP + k vᵀ, E_t = γE + k (q_tᵀ P_t), m_K = γ m_K + k, n_t = γn + k (q_tᵀ m_K,t);
    o_t = scale·q_tᵀ E_t (normalized: / (scale·q_tᵀ n_t + eps)). Returns o, (P, m_K, E, n)."""
    qh, kh, vh = _heads(q), _heads(k), _heads(v)
    B, H, T, K = kh.shape
    V = vh.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    f64 = torch.float64
    if initial_state is None:
        P, mK, E, n = (torch.zeros(B, H, K, V, dtype=f64), torch.zeros(B, H, K, dtype=f64),
                       torch.zeros(B, H, K, V, dtype=f64), torch.zeros(B, H, K, dtype=f64))
    else:
        P, mK, E, n = (x.double() for x in initial_state)
    gh = None if g is None else _heads(g)
    outs = []
    for t in range(T):
        gamma = 1.0 if gh is None else gh[:, :, t].exp()
        qt, kt, vt = qh[:, :, t], kh[:, :, t], vh[:, :, t]
        P = _scale_by(gamma, P) + torch.einsum("bhk,bhv->bhkv", kt, vt)
        mK = _scale_by(gamma, mK) + kt
        E = _scale_by(gamma, E) + torch.einsum("bhk,bhv->bhkv", kt, torch.einsum("bhk,bhkv->bhv", qt, P))
        n = _scale_by(gamma, n) + kt * torch.einsum("bhk,bhk->bh", qt, mK)[..., None]
        num = torch.einsum("bhk,bhkv->bhv", qt * scale, E)
        if normalize:
            num = num / (torch.einsum("bhk,bhk->bh", qt * scale, n)[..., None] + eps)
        outs.append(num)
    return torch.stack(outs, 2).transpose(1, 2), (P, mK, E, n)


def _scale_by(gamma, x):  # γ [B, H] (or 1.0) times a [B, H, ...] state
    if isinstance(gamma, float):
        return x
    return x * gamma.reshape(gamma.shape + (1,) * (x.dim() - 2))


def log_linear_mamba2(q, k, v, g, level_scales, scale=1.0, offset=0):
    """o_t = scale·Σ_{s≤t} exp(g_{s+1} + … + g_t)·level_scales[t, ℓ]·(q_t·k_s)·v_s with the Fenwick level
    ℓ = bit_length((offset+t) xor (offset+s)) (0 for s = t), as pairs over all tokens (no state)."""
    qh, kh, vh = _heads(q), _heads(k), _heads(v)
    gh, lh = _heads(g), _heads(level_scales)  # [B, H, T], [B, H, T, L]
    T = qh.shape[2]
    G = gh.cumsum(-1)
    out = torch.zeros_like(vh)
    for t in range(T):
        for s in range(t + 1):
            level = ((offset + t) ^ (offset + s)).bit_length()
            w = (G[:, :, t] - G[:, :, s]).exp() * lh[:, :, t, level] * (qh[:, :, t] * kh[:, :, s]).sum(-1)
            out[:, :, t] = out[:, :, t] + w[..., None] * vh[:, :, s]
    return (out * scale).transpose(1, 2)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None):
    """Mamba-1's selective scan token by token in fp64, as mamba_ssm's selective_scan_ref states it:
    u, delta, z [B, D, L], A [D, N], B, C [B, N, L], D and delta_bias [D]; returns (out [B, D, L], h_L)."""
    u, delta, A, B, C = (x.double() for x in (u, delta, A, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.double()[:, None]
    if delta_softplus:
        delta = torch.nn.functional.softplus(delta)
    Bs, Dm, L = u.shape
    h = torch.zeros(Bs, Dm, A.shape[1], dtype=torch.float64) if initial_state is None else initial_state.double()
    ys = []
    for t in range(L):
        h = torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t] * u[:, :, t])[:, :, None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    out = torch.stack(ys, dim=-1)
    if D is not None:
        out = out + u * D.double()[:, None]
    if z is not None:
        out = out * torch.nn.functional.silu(z.double())
    return out, h
