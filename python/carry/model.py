"""carry's language model as a torch.nn.Module, from a folder `carry export --format hf` writes (or an FLA
folder of the same classes): `carry.load(DIR)` reads config.json and model.safetensors and returns a
module whose forward(input_ids) gives the logits, computed as carry's model computes them (the mixers
through carry.ops: the kernels on CUDA tensors where this build has them, the chunkwise forms otherwise).

Layers: Gated DeltaNet (grouped value heads included), DeltaNet, GLA and KDA, FLA's `gated_deltanet`, `delta_net`,
`gla` and `kda` model types; a block is y = x + mixer(norm(x)), out = y + mlp(norm(y)) with SwiGLU MLPs and RMS norms,
as framework/model/model.h builds it. RWKV-7, FLA's `rwkv7` model type (RWKV7ForCausalLM): LayerNorms with
bias, the first block's pre_norm (norm_first), RWKV7Attention's time mixing through carry.ops.chunk_rwkv7 and
RWKV7FeedForward's channel mix, as carry's rwkv7 model with norm "layer_norm" computes it. For evaluation
and generation from Python: the weights are parameters (trainable), but the forward keeps no recurrent state
between calls.
"""
import json
import os
import struct

import torch
import torch.nn.functional as F
from torch import nn

from carry import ops

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32}


def _fail(message):
    raise ValueError(f"carry.load: {message}")


def read_safetensors(path):
    """The tensors of a .safetensors file by name (on the CPU)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        _fail(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack_from("<Q", raw, 0)
    if 8 + n > len(raw):
        _fail(f"{path}: its header claims {n} bytes, the file has {len(raw) - 8} after the length")
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError as e:
        _fail(f"{path}: the header is not JSON ({e})")
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _DTYPES.get(info.get("dtype"))
        if dt is None:
            _fail(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}; expected one of {sorted(_DTYPES)}")
        a, b = info["data_offsets"]
        buf = bytearray(raw[base + a:base + b])
        t = torch.frombuffer(buf, dtype=dt) if buf else torch.empty(0, dtype=dt)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def _rms_norm(x, weight, eps):
    xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(y.dtype)).to(x.dtype)


def _short_conv(x, w):  # causal depthwise, then silu; x [B, T, C], w [C, 1, K]
    K = w.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), w.to(x.dtype), groups=x.shape[-1])
    return F.silu(y.transpose(1, 2))


def _project_qkv(layer, x):
    """q, k, v of a layer with q_proj, k_proj, v_proj: through the short convolutions (then silu) when the
    layer has them (layer.conv), else silu."""
    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    if layer.conv:
        return tuple(_short_conv(t, w) for t, w in ((q, layer.q_conv1d), (k, layer.k_conv1d), (v, layer.v_conv1d)))
    return F.silu(q), F.silu(k), F.silu(v)


class _DeltaLayer(nn.Module):
    """FLA's GatedDeltaNet / DeltaNet / GatedDeltaProduct layer as carry computes it (layers/blocks/mixer_layer.h).
    n > 1 (GatedDeltaProduct): the key, value and beta projections give n rows a token (token t's step j at
    row t·n + j), the betas 2·sigmoid (FLA's allow_neg_eigval, as carry's layer has them)."""

    def __init__(self, d, H, Hv, dk, dv, conv, eps, gated, n=1):
        super().__init__()
        self.H, self.Hv, self.dk, self.dv, self.eps, self.gated, self.n = H, Hv, dk, dv, eps, gated, n
        self.q_proj = nn.Linear(d, H * dk, bias=False)
        self.k_proj = nn.Linear(d, n * H * dk, bias=False)
        self.v_proj = nn.Linear(d, n * Hv * dv, bias=False)
        self.conv = conv
        if conv:
            self.q_conv1d = nn.Parameter(torch.zeros(H * dk, 1, conv))
            self.k_conv1d = nn.Parameter(torch.zeros(n * H * dk, 1, conv))
            self.v_conv1d = nn.Parameter(torch.zeros(n * Hv * dv, 1, conv))
        if gated:
            self.a_proj = nn.Linear(d, Hv, bias=False)
            self.A_log = nn.Parameter(torch.zeros(Hv))
            self.dt_bias = nn.Parameter(torch.zeros(Hv))
        self.b_proj = nn.Linear(d, n * Hv, bias=False)
        self.g_proj = nn.Linear(d, Hv * dv, bias=False)
        self.o_norm = nn.Parameter(torch.ones(dv))
        self.o_proj = nn.Linear(Hv * dv, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = _project_qkv(self, x)
        n = self.n
        q, k = q.reshape(B, T, self.H, self.dk), k.reshape(B, T * n, self.H, self.dk)
        v = v.reshape(B, T * n, self.Hv, self.dv)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(self.b_proj(x)).view(B, T * n, self.Hv)
        if self.gated:
            g = -torch.exp(self.A_log) * F.softplus(self.a_proj(x) + self.dt_bias)
        if n > 1:
            o, _ = ops.chunk_gated_delta_product(q, k, v, g, 2 * beta, n)
        elif self.gated:
            o, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta)
        else:
            o, _ = ops.chunk_delta_rule(q, k, v, beta)
        z = self.g_proj(x).view(B, T, self.Hv, self.dv)
        o = _rms_norm(o.to(x.dtype), self.o_norm, self.eps) * F.silu(z)
        return self.o_proj(o.reshape(B, T, self.Hv * self.dv))


class _KdaLayer(nn.Module):
    """FLA's KimiDeltaAttention layer as carry's `kda` kind computes it: short convolutions (or silu) on q, k, v,
    L2-normalized q and k, beta = sigmoid(b_proj x), the gate g = −exp(A_log)·softplus(f_proj x + dt_bias) per key
    dimension (f_proj of rank dv; with lower_bound, FLA's bounded gate lower_bound·sigmoid(exp(A_log)·(f_proj x +
    dt_bias))), the output RMS-normed and gated by sigmoid(g_proj x) (g_proj of rank dv, with a bias)."""

    def __init__(self, d, H, dk, dv, conv, eps, lower_bound=None):
        super().__init__()
        self.H, self.dk, self.dv, self.eps, self.conv, self.lower_bound = H, dk, dv, eps, conv, lower_bound
        self.q_proj = nn.Linear(d, H * dk, bias=False)
        self.k_proj = nn.Linear(d, H * dk, bias=False)
        self.v_proj = nn.Linear(d, H * dv, bias=False)
        if conv:
            self.q_conv1d = nn.Parameter(torch.zeros(H * dk, 1, conv))
            self.k_conv1d = nn.Parameter(torch.zeros(H * dk, 1, conv))
            self.v_conv1d = nn.Parameter(torch.zeros(H * dv, 1, conv))
        self.f_proj = nn.Sequential(nn.Linear(d, dv, bias=False), nn.Linear(dv, H * dk, bias=False))
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H * dk))
        self.g_proj = nn.Sequential(nn.Linear(d, dv, bias=False), nn.Linear(dv, H * dv, bias=True))
        self.o_norm = nn.Parameter(torch.ones(dv))
        self.o_proj = nn.Linear(H * dv, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = _project_qkv(self, x)
        q, k = q.reshape(B, T, self.H, self.dk), k.reshape(B, T, self.H, self.dk)
        v = v.reshape(B, T, self.H, self.dv)
        g = self.f_proj(x).view(B, T, self.H, self.dk)
        o, _ = ops.chunk_kda(q, k, v, g, self.b_proj(x), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                             lower_bound=self.lower_bound)
        z = self.g_proj(x).view(B, T, self.H, self.dv)
        o = _rms_norm(o.to(x.dtype), self.o_norm, self.eps) * torch.sigmoid(z)
        return self.o_proj(o.reshape(B, T, self.H * self.dv))


class _GlaLayer(nn.Module):
    """FLA's GatedLinearAttention layer as carry's `gla` kind computes it: q, k, v projections with no
    convolution or feature map, gk = logsigmoid(W₂ W₁ x + b) / 16 per key dimension (rank 16), the gated
    output norm (RMS norm times silu(g_proj x))."""

    RANK, NORMALIZER = 16, 16.0

    def __init__(self, d, H, dk, dv, eps):
        super().__init__()
        self.H, self.dk, self.dv, self.eps = H, dk, dv, eps
        self.q_proj = nn.Linear(d, H * dk, bias=False)
        self.k_proj = nn.Linear(d, H * dk, bias=False)
        self.v_proj = nn.Linear(d, H * dv, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(d, self.RANK, bias=False), nn.Linear(self.RANK, H * dk, bias=True))
        self.g_proj = nn.Linear(d, H * dv, bias=False)
        self.g_norm_swish_gate = nn.Parameter(torch.ones(dv))
        self.o_proj = nn.Linear(H * dv, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.dk)
        k = self.k_proj(x).view(B, T, self.H, self.dk)
        v = self.v_proj(x).view(B, T, self.H, self.dv)
        gk = (F.logsigmoid(self.gk_proj(x)) / self.NORMALIZER).view(B, T, self.H, self.dk)
        o, _ = ops.chunk_gla(q, k, v, gk)
        z = self.g_proj(x).view(B, T, self.H, self.dv)
        o = _rms_norm(o.to(x.dtype), self.g_norm_swish_gate, self.eps) * F.silu(z)
        return self.o_proj(o.reshape(B, T, self.H * self.dv))


class _LoRA(nn.Module):
    """FLA's LoRA: lora.2(act(lora.0(x))), lora.0 without bias (names lora.0.weight, lora.2.weight[, .bias])."""

    def __init__(self, d, out, rank, act, bias=True):
        super().__init__()
        self.lora = nn.Sequential(nn.Linear(d, rank, bias=False), act, nn.Linear(rank, out, bias=bias))

    def forward(self, x):
        return self.lora(x)


def _token_shift(x):
    """x_{t-1} - x_t over [B, T, C], zero before the first token."""
    return F.pad(x, (0, 0, 1, -1)) - x


class _Rwkv7Attention(nn.Module):
    """FLA's RWKV7Attention as carry's rwkv7 kind computes it (layers/rwkv7/time_mix.h): token shift, six
    lerps, the LoRA decay w = -e^(-1/2)·sigmoid(.), the value residual (not on the first layer, whose values
    are v_first), the in-context rate a, the gate, carry.ops.chunk_rwkv7 with a = -κ̂, b = κ̂·a, GroupNorm
    per head (eps = head_dim·norm_eps), the bonus term and o_proj."""

    DECAY_SCALE = 0.6065306597126334

    def __init__(self, d, H, dk, dv, ranks, first, eps):
        super().__init__()
        self.H, self.dk, self.dv, self.first = H, dk, dv, first
        K, V = H * dk, H * dv
        for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, n, nn.Parameter(torch.zeros(1, 1, d)))
        self.k_k = nn.Parameter(torch.zeros(K))
        self.k_a = nn.Parameter(torch.zeros(K))
        self.r_k = nn.Parameter(torch.zeros(H, dk))
        self.r_proj = nn.Linear(d, K, bias=False)
        self.k_proj = nn.Linear(d, K, bias=False)
        self.v_proj = nn.Linear(d, V, bias=False)
        self.o_proj = nn.Linear(V, d, bias=False)
        self.w_lora = _LoRA(d, K, ranks["decay"], nn.Tanh())
        if not first:
            self.v_lora = _LoRA(d, V, ranks["v"], nn.Identity())
        self.a_lora = _LoRA(d, K, ranks["a"], nn.Identity())
        self.g_lora = _LoRA(d, V, ranks["gate"], nn.Sigmoid(), bias=False)
        self.g_norm = nn.GroupNorm(H, V, eps=dk * eps)

    def forward(self, x, v_first):
        B, T, _ = x.shape
        delta = _token_shift(x)
        xr, xw, xk, xv, xa, xg = (x + delta * getattr(self, n) for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
        r = self.r_proj(xr)
        w = -self.DECAY_SCALE * torch.sigmoid(self.w_lora(xw))
        k = self.k_proj(xk)
        v = self.v_proj(xv)
        if self.first:
            v_first = v
        else:
            v = v + torch.sigmoid(self.v_lora(xv)) * (v_first - v)
        a = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        kk = F.normalize((k * self.k_k).view(B, T, self.H, self.dk), dim=-1, p=2.0)
        k = k * (1 + (a - 1) * self.k_a)
        heads = lambda t, n: t.reshape(B, T, self.H, n)  # noqa: E731
        r, w, k, a, v = heads(r, self.dk), heads(w, self.dk), heads(k, self.dk), heads(a, self.dk), heads(v, self.dv)
        o, _ = ops.chunk_rwkv7(r, w, k, v, -kk, kk * a)
        o = self.g_norm(o.to(x.dtype).reshape(B * T, self.H * self.dv)).view(B, T, -1)
        bonus = ((r * k * self.r_k).sum(-1, keepdim=True) * v).reshape(B, T, -1)
        return self.o_proj((o + bonus) * g), v_first


class _Rwkv7FeedForward(nn.Module):
    """FLA's RWKV7FeedForward: value(relu(key(x + δ·x_k))²)."""

    def __init__(self, d, inter):
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(d))
        self.key = nn.Linear(d, inter, bias=False)
        self.value = nn.Linear(inter, d, bias=False)

    def forward(self, x):
        return self.value(torch.relu(self.key(x + _token_shift(x) * self.x_k)) ** 2)


class _Rwkv7Block(nn.Module):
    """FLA's RWKV7Block: residual = pre_norm(x) on the first block (norm_first), else x; y = residual +
    attn(attn_norm(residual)); out = y + ffn(ffn_norm(y)). Its parameters carry FLA's names."""

    def __init__(self, d, H, dk, dv, inter, ranks, first, pre_norm, eps):
        super().__init__()
        if pre_norm:
            self.pre_norm = nn.LayerNorm(d, eps=eps)
        self.attn_norm = nn.LayerNorm(d, eps=eps)
        self.attn = _Rwkv7Attention(d, H, dk, dv, ranks, first, eps)
        self.ffn_norm = nn.LayerNorm(d, eps=eps)
        self.ffn = _Rwkv7FeedForward(d, inter)

    def forward(self, x, v_first):
        residual = self.pre_norm(x) if hasattr(self, "pre_norm") else x
        a, v_first = self.attn(self.attn_norm(residual), v_first)
        y = residual + a
        return y + self.ffn(self.ffn_norm(y)), v_first


def _rwkv7_low_rank_dims(config, d, dk):
    """The LoRA widths FLA's RWKV7Attention gets from RWKV7Config (its defaults 64, 64, 16, 128 where
    config.json has no such key; the layer's own formula where the key is null)."""
    factor = dk / 64
    formula = {"decay": 2.5 * d ** 0.5 * factor, "a": 2.5 * d ** 0.5 * factor, "v": 1.7 * d ** 0.5 * factor,
               "gate": 5 * d ** 0.5}
    defaults = {"decay": 64, "a": 64, "v": 16, "gate": 128}
    out = {}
    for name in formula:
        key = f"{name}_low_rank_dim"
        value = config.get(key, defaults[name])
        out[name] = value if value is not None else max(32, int(round(formula[name] / 32) * 32))
    return out


class _Block(nn.Module):
    def __init__(self, d, inter, eps, attn):
        super().__init__()
        self.eps = eps
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.attn = attn
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x):
        y = x + self.attn(_rms_norm(x, self.attn_norm, self.eps))
        n = _rms_norm(y, self.mlp_norm, self.eps)
        return y + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))


class CarryModel(nn.Module):
    """The causal language model of a carry / FLA folder; forward(input_ids [B, T] int64) -> logits [B, T, V]."""

    def __init__(self, config):
        super().__init__()
        kind = config.get("model_type")
        if kind not in ("gated_deltanet", "gated_deltaproduct", "delta_net", "gla", "kda", "rwkv7"):
            _fail(f"model_type {kind!r}: carry.load builds gated_deltanet, gated_deltaproduct, delta_net, gla, kda "
                  "and rwkv7 models")
        if config.get("attn") is not None:
            _fail("config.json has an `attn` entry (softmax attention layers): not built by carry.load")
        self.config = config
        self.kind = kind
        if kind == "rwkv7":
            self._build_rwkv7(config)
            return
        d, H, L = config["hidden_size"], config["num_heads"], config["num_hidden_layers"]
        eps = float(config.get("norm_eps", 1e-6))
        n = 1
        if kind == "gated_deltanet":
            dk = config.get("head_dim", 256)
            dv = int(dk * config.get("expand_v", 2.0))
            Hv = config.get("num_v_heads") or H
        elif kind == "gated_deltaproduct":
            dk = config.get("head_dim", 256)
            dv = int(dk * config.get("expand_v", 2.0))
            Hv = H
            self._check_deltaproduct(config)
            n = config.get("num_householder", 1)
        elif kind == "kda":
            dk = config.get("head_dim", 128)
            dv = int(dk * config.get("expand_v", 1.0))
            Hv = H
            self._check_kda(config, H)
        else:
            dk = round(d * config.get("expand_k", 0.5 if kind == "gla" else 1.0)) // H
            dv = round(d * config.get("expand_v", 1.0)) // H
            Hv = H
        conv = config.get("conv_size", 4) if config.get("use_short_conv", True) else 0
        if kind == "gla":
            self._check_gla(config, conv)
        inter = config.get("intermediate_size")
        if inter is None:
            _fail("config.json has no intermediate_size (carry writes it)")
        self.eps = eps
        self.embeddings = nn.Embedding(config["vocab_size"], d)
        def mixer():
            if kind == "gla":
                return _GlaLayer(d, H, dk, dv, eps)
            if kind == "kda":
                return _KdaLayer(d, H, dk, dv, conv, eps, config.get("lower_bound"))
            return _DeltaLayer(d, H, Hv, dk, dv, conv, eps, kind != "delta_net", n)
        self.layers = nn.ModuleList([_Block(d, inter, eps, mixer()) for _ in range(L)])
        self.norm = nn.Parameter(torch.ones(d))
        self.tied = bool(config.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(d, config["vocab_size"], bias=False)

    def _build_rwkv7(self, config):
        """FLA's RWKV7ForCausalLM from its RWKV7Config keys (FLA's defaults where a key is missing)."""
        d, L = config["hidden_size"], config["num_hidden_layers"]
        dk, H = config.get("head_dim", 64), config.get("num_heads")
        if dk is None and H is None:
            _fail("config.json: rwkv7 needs head_dim or num_heads")
        dk = dk if dk is not None else d // H
        H = d // dk
        if H * dk != d:
            _fail(f"config.json: hidden_size {d} is not a multiple of head_dim {dk}")
        value_dim = config.get("value_dim")
        value_dim = [d] * L if value_dim is None else [value_dim] * L if isinstance(value_dim, int) else value_dim
        if len(value_dim) != L or any(v % H for v in value_dim):
            _fail(f"config.json: value_dim {config.get('value_dim')!r}: one width a layer, multiples of num_heads {H}")
        want = {"hidden_act": "sqrelu", "norm_bias": True}
        for key, value in want.items():
            if config.get(key, value) != value:
                _fail(f"config.json: {key} is {config[key]!r}; carry's rwkv7 model computes {key} = {value!r}")
        inter = config.get("intermediate_size")
        if inter is None:
            inter = int(d * (config.get("hidden_ratio") or 4))
            inter = 32 * ((inter + 31) // 32)
        eps = float(config.get("norm_eps", 1e-5))
        ranks = _rwkv7_low_rank_dims(config, d, dk)
        pre_norm = bool(config.get("norm_first", True))
        self.eps = eps
        self.embeddings = nn.Embedding(config["vocab_size"], d)
        self.layers = nn.ModuleList([_Rwkv7Block(d, H, dk, value_dim[i] // H, inter, ranks, i == 0, pre_norm and i == 0, eps)
                                     for i in range(L)])
        self.norm = nn.LayerNorm(d, eps=eps)
        self.tied = bool(config.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(d, config["vocab_size"], bias=False)

    @staticmethod
    def _check_deltaproduct(config):
        """The GatedDeltaProduct settings carry's `gated_deltaproduct` kind computes; any other is refused by name."""
        want = {"use_output_gate": True, "use_forget_gate": True, "allow_neg_eigval": True, "num_v_heads": None}
        fla_default = {"use_output_gate": True, "use_forget_gate": False, "allow_neg_eigval": False, "num_v_heads": None}
        for key, value in want.items():
            if config.get(key, fla_default[key]) != value:
                _fail(f"config.json: {key} is {config.get(key)!r}; carry's gated_deltaproduct layer computes "
                      f"{key} = {value!r}")
        n = config.get("num_householder", 1)
        if not isinstance(n, int) or n < 1:
            _fail(f"config.json: num_householder must be a positive int, got {n!r}")

    @staticmethod
    def _check_kda(config, H):
        """The KDA settings carry's `kda` kind computes; any other is refused by name."""
        if config.get("allow_neg_eigval", False):
            _fail("config.json: allow_neg_eigval is True; carry's kda layer computes allow_neg_eigval = False")
        lb = config.get("lower_bound")
        if lb is not None and not (isinstance(lb, (int, float)) and -1e3 <= lb < 0):
            _fail(f"config.json: lower_bound is {lb!r}; carry's kda layer takes a lower bound in [-1000, 0) or none")
        if config.get("num_v_heads") not in (None, H):
            _fail(f"config.json: num_v_heads is {config['num_v_heads']!r}; carry's kda layer has no grouped value heads")

    @staticmethod
    def _check_gla(config, conv):
        """The GLA settings carry's `gla` kind computes; any other is refused by name."""
        want = {"use_output_gate": True, "use_gk": True, "use_gv": False, "feature_map": None, "clamp_min": None,
                "num_kv_heads": None, "gate_logit_normalizer": 16, "gate_low_rank_dim": 16}
        for key, value in want.items():
            if key in config and config[key] != value:
                _fail(f"config.json: {key} is {config[key]!r}; carry's gla layer computes {key} = {value!r}")
        if conv:
            _fail("config.json: use_short_conv is true for gla; carry's gla layer has no short convolutions "
                  "(FLA applies silu after them, carry's gla kind does not)")

    def _targets(self):
        """FLA's tensor names -> this module's parameters."""
        if self.kind == "rwkv7":  # the modules carry FLA's names
            out = {"model." + n: p for n, p in self.named_parameters() if not n.startswith("lm_head.")}
            if not self.tied:
                out["lm_head.weight"] = self.lm_head.weight
            return out
        out = {"model.embeddings.weight": self.embeddings.weight, "model.norm.weight": self.norm}
        if not self.tied:
            out["lm_head.weight"] = self.lm_head.weight
        for i, b in enumerate(self.layers):
            p, a = f"model.layers.{i}.", b.attn
            out.update({p + "attn_norm.weight": b.attn_norm, p + "mlp_norm.weight": b.mlp_norm,
                        p + "mlp.gate_proj.weight": b.gate_proj.weight, p + "mlp.up_proj.weight": b.up_proj.weight,
                        p + "mlp.down_proj.weight": b.down_proj.weight})
            if isinstance(a, _GlaLayer):
                for n in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj"):
                    out[p + f"attn.{n}.weight"] = getattr(a, n).weight
                out[p + "attn.gk_proj.0.weight"] = a.gk_proj[0].weight
                out[p + "attn.gk_proj.1.weight"] = a.gk_proj[1].weight
                out[p + "attn.gk_proj.1.bias"] = a.gk_proj[1].bias
                out[p + "attn.g_norm_swish_gate.weight"] = a.g_norm_swish_gate
                continue
            if isinstance(a, _KdaLayer):  # the module carries FLA's names
                out.update({p + "attn." + n: t for n, t in a.named_parameters()})
                for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                    if a.conv:
                        out[p + f"attn.{n}.weight"] = out.pop(p + f"attn.{n}")
                out[p + "attn.o_norm.weight"] = out.pop(p + "attn.o_norm")
                continue
            for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "o_proj") + (("a_proj",) if a.gated else ()):
                out[p + f"attn.{n}.weight"] = getattr(a, n).weight
            if a.gated:
                out[p + "attn.A_log"], out[p + "attn.dt_bias"] = a.A_log, a.dt_bias
            if a.conv:
                for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                    out[p + f"attn.{n}.weight"] = getattr(a, n)
            out[p + "attn.o_norm.weight"] = a.o_norm
        return out

    def load_weights(self, tensors, source):
        """Copies FLA-named tensors in, strictly: every parameter by name and shape, nothing left over."""
        targets = self._targets()
        missing = sorted(set(targets) - set(tensors))
        extra = sorted(set(tensors) - set(targets))
        if missing:
            _fail(f"{source}: missing {len(missing)} tensors, the first {missing[0]!r}")
        if extra:
            _fail(f"{source}: {len(extra)} tensors the model does not have, the first {extra[0]!r}")
        with torch.no_grad():
            for name, p in targets.items():
                t = tensors[name]
                if tuple(t.shape) != tuple(p.shape):
                    _fail(f"{source}: {name!r} has shape {list(t.shape)}, the model's is {list(p.shape)}")
                p.copy_(t.to(p.dtype))

    def forward(self, input_ids):
        if input_ids.dim() != 2:
            _fail(f"input_ids must be [B, T], got {list(input_ids.shape)}")
        h = self.embeddings(input_ids)
        if self.kind == "rwkv7":
            v_first = None
            for b in self.layers:
                h, v_first = b(h, v_first)
            h = self.norm(h)
            return F.linear(h, self.embeddings.weight if self.tied else self.lm_head.weight)
        for b in self.layers:
            h = b(h)
        h = _rms_norm(h, self.norm, self.eps)
        return F.linear(h, self.embeddings.weight if self.tied else self.lm_head.weight)


def load(path, dtype=torch.float32, device="cpu"):
    """The model of an FLA / Hugging Face folder (config.json and model.safetensors, as `carry export
    --format hf` writes them) as a CarryModel in `dtype` on `device`, in eval mode."""
    config_path, weights_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    if not os.path.isdir(path):
        _fail(f"{path}: not a directory (expected a folder with config.json and model.safetensors; a carry "
              "checkpoint is written as one by `carry export CHECKPOINT --format hf --out DIR`)")
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            _fail(f"{p}: missing (a sharded model.safetensors.index.json folder is not read here)")
    with open(config_path) as f:
        config = json.load(f)
    model = CarryModel(config)
    model.load_weights(read_safetensors(weights_path), weights_path)
    return model.to(device=device, dtype=dtype).eval()
