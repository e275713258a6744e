"""flash-linear-attention's log-linear attention op (`fla.ops.log_linear_attn.chunk_log_linear_attn`, log-linear
Mamba-2) timed as `carry bench kernels` times carry's `loglinear_mamba2`: bf16 q, k (L2-normalized), v, B = 1,
an fp32 log decay g with half-lives from about 2 to 7·10^4 tokens, level weights softplus(randn) over
L = bit_width(T) + 1 levels; forward and forward+backward milliseconds, the median of triton.testing.do_bench.

usage (on the GPU machine, FLA's wheels on PYTHONPATH as for the anchors):
  python3 tools/fla_log_linear.py [--heads 16] [--dk 128] [--dv 128] [--T 16384,65536,131072]
Prints one markdown row per T."""
import argparse
import math
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--heads', type=int, default=16)
    p.add_argument('--dk', type=int, default=128)
    p.add_argument('--dv', type=int, default=128)
    p.add_argument('--T', default='16384,65536,131072')
    a = p.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        import triton
    except ImportError as e:
        sys.exit(f'fla_log_linear: no torch and triton here ({e}); run it on the GPU machine')
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.log_linear_attn import chunk_log_linear_attn
    except ImportError as e:
        sys.exit(f'fla_log_linear: FLA is not importable ({e}); put its wheels on PYTHONPATH')
    chunk_o.TRITON_ABOVE_3_7_1 = True  # FLA 0.6.0's Triton-version guard, as tools/fla_common.py lifts it
    if not torch.cuda.is_available():
        sys.exit('fla_log_linear: no CUDA device here')
    H, K, V = a.heads, a.dk, a.dv
    print(f'{torch.cuda.get_device_name()}, torch {torch.__version__}, B=1 H={H} dk={K} dv={V}, bf16')
    print('| op | T | fwd ms | fwd+bwd ms |\n|---|---|---|---|')
    for T in [int(t) for t in a.T.split(',')]:
        L = T.bit_length() + 1
        dev, dt = 'cuda', torch.bfloat16
        q = torch.randn(1, T, H, K, device=dev, dtype=dt, requires_grad=True)
        k = F.normalize(torch.randn(1, T, H, K, device=dev), p=2, dim=-1).to(dt).requires_grad_()
        v = torch.randn(1, T, H, V, device=dev, dtype=dt, requires_grad=True)
        u = torch.rand(1, T, H, device=dev) * (math.log(0.3) - math.log(1e-5)) + math.log(1e-5)
        g = (-torch.exp(u)).requires_grad_()
        lam = F.softplus(torch.randn(1, T, H, L, device=dev)).requires_grad_()
        d_o = torch.randn(1, T, H, V, device=dev, dtype=dt)
        xs = [q, k, v, g, lam]

        def fwd():
            return chunk_log_linear_attn(q, k, v, g, lam, scale=K ** -0.5)[0]

        def fb():
            fwd().backward(d_o)
        try:
            f_ms = triton.testing.do_bench(fwd, warmup=50, rep=200, return_mode='median')
            fb_ms = triton.testing.do_bench(fb, warmup=50, rep=200, return_mode='median', grad_to_none=xs)
            print(f'| fla.log_linear_attn | {T} | {f_ms:.3f} | {fb_ms:.3f} |', flush=True)
        except Exception as e:  # out of memory, a Triton error: the row says so
            print(f'| fla.log_linear_attn | {T} | error: {repr(e)[:200]} | |', flush=True)
        del q, k, v, g, lam, d_o, xs
        torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
