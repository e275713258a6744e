// Halo exchange under mpirun (1, 2, 4 ranks): a depthwise short causal convolution and sliding-window
// attention computed per rank on [halo; slice] equal the serial computation's slice, forward and the
// gradients of every input (fp64), and a window longer than a slice is refused clearly.
#include "layers/mixer.h"
#include "parallel/halo.h"

#include <gtest/gtest.h>
#include <mpi.h>
#include <torch/csrc/autograd/autograd.h>

namespace carry::parallel {
namespace {

double rel(const Tensor& a, const Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

// Depthwise causal conv: y_t = Σ_{j<K} w_j ⊙ x_{t-j}, x [B, T, D] with `prefix` tokens before it.
Tensor causal_conv(const Tensor& prefix, const Tensor& x, const Tensor& w) {
  auto full = at::cat({prefix, x}, 1);
  int64_t K = w.size(0), T = x.size(1), p = prefix.size(1);
  auto y = at::zeros_like(x);
  for (int64_t j = 0; j < K; ++j) y = y + w[j] * full.narrow(1, p - j, T);
  return y;
}

TEST(Halo, ShortConvolutionAndSlidingWindowEqualSerial) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  int r = comm->rank(), P = comm->size();
  const int64_t B = 2, T = 64 * 4, H = 2, D = 8, K = 4, window = 24, C = 16;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto opt = at::TensorOptions().dtype(at::kDouble);
  auto x = at::randn({B, T, D}, gen, opt), w = at::randn({K, D}, gen, opt);
  auto q = at::randn({B, T, H, D}, gen, opt), k = at::randn({B, T, H, D}, gen, opt),
       v = at::randn({B, T, H, D}, gen, opt);
  auto dy = at::randn({B, T, D}, gen, opt), d_o = at::randn({B, T, H, D}, gen, opt);
  const Mixer& swa = get_mixer("softmax_attn");
  MixerOptions mo;
  mo.window = window;
  mo.chunk_size = C;

  // Serial references with gradients.
  auto leaf = [](const Tensor& t) { return t.detach().clone().requires_grad_(true); };
  auto sx = leaf(x), sq = leaf(q), sk = leaf(k), sv = leaf(v);
  auto sy = causal_conv(at::zeros({B, K - 1, D}, opt), sx, w);
  auto so = swa.chunkwise({sq, sk, sv}, {}, mo).o;
  auto sg = torch::autograd::grad({(sy * dy).sum() + (so * d_o).sum()}, {sx, sq, sk, sv});

  // Each rank: its slice with the halo from the previous rank.
  int64_t n = T / P;
  auto mine = [&](const Tensor& t) { return leaf(t.narrow(1, r * n, n)); };
  auto px = mine(x), pq = mine(q), pk = mine(k), pv = mine(v);
  auto y = causal_conv(halo_exchange(*comm, px, K - 1), px, w);
  // Sliding window: keys/values of the previous `h` tokens (h a whole number of chunks >= window-1);
  // the halo's own queries are computed and dropped. Rank 0 has nothing before it.
  const int64_t hh = ((window - 1 + C - 1) / C) * C;
  const int64_t h = r == 0 ? 0 : hh;
  Tensor o;
  {
    auto hq = halo_exchange(*comm, pq, hh), hkk = halo_exchange(*comm, pk, hh),
         hv = halo_exchange(*comm, pv, hh);
    if (h == 0) {
      o = swa.chunkwise({pq, pk, pv}, {}, mo).o;
      o = o + 0 * (hq.sum() + hkk.sum() + hv.sum());  // keep every rank's backward collective
    } else {
      auto full = swa.chunkwise({at::cat({hq, pq}, 1), at::cat({hkk, pk}, 1), at::cat({hv, pv}, 1)}, {}, mo);
      o = full.o.narrow(1, h, n);
    }
  }
  auto g = torch::autograd::grad({(y * dy.narrow(1, r * n, n)).sum() + (o * d_o.narrow(1, r * n, n)).sum()},
                                 {px, pq, pk, pv});
  double e = std::max(rel(y, sy.detach().narrow(1, r * n, n)), rel(o, so.detach().narrow(1, r * n, n)));
  for (int i = 0; i < 4; ++i) e = std::max(e, rel(g[i], sg[i].narrow(1, r * n, n)));
  double worst = 0;
  MPI_Allreduce(&e, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (r == 0) std::cout << "[ errors   ] halo (conv K=4, window 24) np=" << P << ": " << worst << "\n";
  EXPECT_LE(worst, 1e-12);
}

// owned_gradient: the next rank's gradient of the slice's last tokens is added in place into x's
// gradient from its other use (here the convolution of an interior x, whose gradient is a fresh
// tensor), or makes x's whole gradient when x has no other use. Both equal the serial gradients.
TEST(Halo, OwnedGradientEqualsSerial) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  int r = comm->rank(), P = comm->size();
  const int64_t B = 2, T = 16 * 4, D = 8, K = 4;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto opt = at::TensorOptions().dtype(at::kDouble);
  auto x = at::randn({B, T, D}, gen, opt), w = at::randn({K, D}, gen, opt), dy = at::randn({B, T, D}, gen, opt);
  auto u = at::randn({B, T, D}, gen, opt), du = at::randn({B, K - 1, D}, gen, opt);
  auto leaf = [](const Tensor& t) { return t.detach().clone().requires_grad_(true); };
  auto sx = leaf(x), su = leaf(u);
  auto sy = causal_conv(at::zeros({B, K - 1, D}, opt), sx * 2, w);
  // u: only its halo is used, on every slice (the serial form: each slice's K-1 tokens before it).
  const int64_t n = T / P;
  Tensor su_term = 0 * su.sum();
  for (int i = 1; i < P; ++i) su_term = su_term + (su.narrow(1, i * n - (K - 1), K - 1) * du).sum();
  auto sg = torch::autograd::grad({(sy * dy).sum() + su_term}, {sx, su});

  auto px = leaf(x.narrow(1, r * n, n)), pu = leaf(u.narrow(1, r * n, n));
  auto xi = px * 2;  // interior: its gradient from the convolution is a tensor of its own
  auto y = causal_conv(halo_exchange(*comm, xi, K - 1, /*owned_gradient=*/true), xi, w);
  auto hu = halo_exchange(*comm, pu * 1, K - 1, /*owned_gradient=*/true);
  auto loss = (y * dy.narrow(1, r * n, n)).sum() + (r > 0 ? (hu * du).sum() : 0 * hu.sum());
  auto g = torch::autograd::grad({loss}, {px, pu}, {}, std::nullopt, false, /*allow_unused=*/true);
  double e = rel(g[0], sg[0].narrow(1, r * n, n));
  // u's gradient: from the next rank's halo; the last rank's u gets none (nothing comes after it).
  if (r + 1 < P) e = std::max(e, g[1].defined() ? rel(g[1], sg[1].narrow(1, r * n, n)) : 1.0);
  else if (g[1].defined()) e = std::max(e, g[1].abs().max().item<double>());
  double worst = 0;
  MPI_Allreduce(&e, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (r == 0) std::cout << "[ errors   ] halo, owned gradient np=" << P << ": " << worst << "\n";
  EXPECT_LE(worst, 1e-12);
}

TEST(Halo, HaloLongerThanSliceIsRefused) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  auto x = at::randn({1, 8, 2}, at::kDouble);
  try {
    halo_exchange(*comm, x, 9);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("at least that long"), std::string::npos);
  }
}

}  // namespace
}  // namespace carry::parallel
