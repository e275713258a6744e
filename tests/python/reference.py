"""Token-by-token recurrences in fp64, the definitions that the tests hold carry.ops to.

Each follows flash-linear-attention's conventions (its naive references): inputs [B, T, H, D], log
gates, o_t = scale·S_tᵀ q_t read after the token's update, states [B, H, K, V]. Written as plain loops
over tokens so that nothing is shared with carry's chunkwise or kernel forms.
"""
import torch


def _heads(x):  # [B, T, H, ...] -> [B, H, T, ...]
    return x.transpose(1, 2).double()


def delta_rule(q, k, v, beta, g=None, scale=None, initial_state=None):
    """S_t = exp(g_t)·(S_{t-1} − β_t k_t (k_tᵀ S_{t-1})) + β_t k_t v_tᵀ (no g: DeltaNet)."""
    q, k, v, beta = _heads(q), _heads(k), _heads(v), _heads(beta)
    g = None if g is None else _heads(g)
    B, H, T, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if initial_state is None else initial_state.double()
    outs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        err = v[:, :, t] - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt, err * beta[:, :, t][..., None])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t] * scale, S))
    return torch.stack(outs, 2).transpose(1, 2), S


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
