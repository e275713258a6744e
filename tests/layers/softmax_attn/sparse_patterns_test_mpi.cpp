// Softmax attention's sparse patterns under mpirun (1, 2, 4 ranks), against the serial run in fp64:
//   - a softmax_attn layer (global tokens, summary columns, both, and with window 1) over a sequence split
//     over the ranks with packed documents: one document over every rank (its global tokens on rank 0,
//     its summary columns on all), starts inside slices, at a rank boundary and inside a rank's halo;
//     the output and the gradients of the input and of every parameter;
//   - a hybrid model (Gated DeltaNet + softmax attention with global tokens and summary columns) trained 3
//     steps on packed documents: losses and parameters at sp = P equal those of one rank (fp64, with and
//     without activation recomputation), and with
//     ordered segments (whose messages run between segments of one rank, parallel/segments.h) sp = P and
//     sp = 1 with P segments give the same bits (fp32).
// Skipped at 1 rank where the comparison needs more than one.
#include "framework/data/token_file.h"
#include "framework/train/trainer.h"
#include "layers/blocks/mixer_layer.h"
#include "parallel/process_group.h"
#include "parallel/slice_context.h"
#include "tests/helpers/temp_dir.h"

#include <gtest/gtest.h>
#include <mpi.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>

namespace carry::testing {
namespace {

double max_over_ranks(double x) {
  double y = 0;
  MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return y;
}

double rel(const Tensor& a, const Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-300);
}

struct Pattern {
  int64_t window, global_tokens, stride;
};

TEST(SoftmaxAttnPatternsSp, LayerEqualsSerialWithDocumentsAcrossRanks) {
  auto comm = parallel::make_mpi_communicator(MPI_COMM_WORLD);
  const int r = comm->rank(), P = comm->size();
  const int64_t B = 2, N = 64, T = N / P, d = 16;
  auto opt = at::TensorOptions().dtype(at::kDouble);
  // Sequence 0: documents at 0, 5, 21, 32 (a rank boundary at 2 and 4 ranks) and 44 (inside the halo of the
  // slice at 48 with 4 ranks); sequence 1: one document over the whole sequence.
  auto starts = at::zeros({B, N}, at::kBool);
  for (int64_t p : {0, 5, 21, 32, 44}) starts[0][p] = true;
  starts[1][0] = true;
  double worst = 0;
  for (const Pattern& pat : std::vector<Pattern>{{6, 3, 0}, {6, 0, 5}, {7, 4, 3}, {1, 2, 4}}) {
    MixerLayerSpec spec;
    spec.kind = "softmax_attn";
    spec.d_model = d, spec.n_heads = 2, spec.head_dim_k = 8, spec.head_dim_v = 8, spec.chunk_size = 8;
    spec.window = pat.window, spec.global_tokens = pat.global_tokens, spec.stride = pat.stride;
    ParameterInit init(11, opt);
    MixerLayer layer(spec, init);
    std::vector<Tensor> params;
    for (auto& [n, t] : layer.parameters()) params.push_back(t);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
    auto x = at::randn({B, N, d}, gen, opt), dy = at::randn({B, N, d}, gen, opt);

    // Serial: the whole sequence in one slice.
    MixerLayerContext whole;
    whole.document_starts = starts;
    index_documents(whole, N, at::kCPU);
    auto sx = x.clone().requires_grad_(true);
    auto sy = layer.forward(sx, {}, whole).y;
    std::vector<Tensor> inputs{sx};
    inputs.insert(inputs.end(), params.begin(), params.end());
    auto sg = torch::autograd::grad({(sy * dy).sum()}, inputs);

    // This rank's slice in the slice context (the relay carries the pattern keys and the halo).
    MixerLayerContext ctx = parallel::make_slice_context(comm, parallel::ScanMode::ordered, 1, N);
    ctx.document_starts = starts;
    index_documents(ctx, T, at::kCPU);
    auto px = x.narrow(1, r * T, T).clone().requires_grad_(true);
    auto py = layer.forward(px, {}, ctx).y;
    inputs[0] = px;
    auto pg = torch::autograd::grad({(py * dy.narrow(1, r * T, T)).sum()}, inputs);
    double e = std::max(rel(py, sy.detach().narrow(1, r * T, T)), rel(pg[0], sg[0].narrow(1, r * T, T)));
    for (size_t i = 1; i < pg.size(); ++i) {
      auto g = pg[i].contiguous();
      comm->all_reduce_sum(g);  // each rank holds its slice's share of a parameter's gradient
      e = std::max(e, rel(g, sg[i]));
    }
    e = max_over_ranks(e);
    worst = std::max(worst, e);
    EXPECT_LE(e, 1e-12) << "w=" << pat.window << " G=" << pat.global_tokens << " S=" << pat.stride;
  }
  if (r == 0)
    std::printf("[ errors   ] softmax_attn patterns layer np=%d vs serial (packed documents, fp64, output and "
                "every gradient): %.3g\n", P, worst);
}

TEST(SoftmaxAttnPatternsSp, HybridTrainingEqualsOneRank) {
  const int P = parallel::world_info().size;
  if (P != 2 && P != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  // Every window of 64 tokens has end-of-document tokens at 9 and 40: a document over the ranks'
  // boundaries, another from 41 on.
  std::string dir;
  if (parallel::world_info().rank == 0) {
    dir = make_temp_dir("carry_sparse_patterns_sp");
    std::vector<uint32_t> t(64 * 12 + 1);
    for (size_t i = 0; i < t.size(); ++i) t[i] = i % 64 == 9 || i % 64 == 40 ? 0 : 1 + (i * 7 + i / 5) % 31;
    write_token_file(dir + "/train.tok", t);
  }
  char buf[256] = {0};
  std::snprintf(buf, sizeof buf, "%s", dir.c_str());
  MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
  dir = buf;
  auto cfg = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> o{"data.token_files={paths: \"" + dir + "/train.tok\" eod_token: 0}"};
    o.insert(o.end(), extra.begin(), extra.end());
    return run_config_from_text(R"(
name: "sparse_patterns_sp"
model { vocab_size: 32 d_model: 32 n_layers: 2 n_heads: 2 mixers: ["gated_deltanet", "softmax_attn"]
        mixer_options { kind: "softmax_attn" window: 6 global_tokens: 3 stride: 5 }
        mixer_options { chunk_size: 8 conv_size: 4 } }
data { seq_len: 64 batch_size: 2 }
optimizer { lr: 1e-2 total_steps: 3 }
)",
                                "sparse_patterns_sp.textproto", o);
  };
  parallel::CommOptions copt;
  copt.timeout_s = 120;
  copt.on_timeout = parallel::CommOptions::OnTimeout::throw_error;
  auto run = [&](const RunConfig& c, bool distributed, at::ScalarType dt, std::vector<double>& losses) {
    TrainerOptions o;
    o.log = nullptr;
    o.force_cpu = true;
    o.dtype = dt;
    std::shared_ptr<parallel::ProcessGroups> groups;
    if (distributed)
      groups = std::make_shared<parallel::ProcessGroups>(parallel::make_process_groups({1, P}, parallel::Backend::mpi, copt));
    Trainer t(c, groups, o);
    for (int i = 0; i < 3; ++i) losses.push_back(t.train_step().loss);
    std::vector<Tensor> params;
    for (auto& [n, p] : t.model().parameters()) params.push_back(p.detach().clone());
    return params;
  };
  std::vector<double> lb;
  auto pb = run(cfg({}), false, at::kDouble, lb);
  for (const char* recompute : {"false", "true"}) {  // with recomputation the relay's messages are replayed
    std::vector<double> la;
    auto pa = run(cfg({"parallel.sp=" + std::to_string(P), std::string("parallel.recompute=") + recompute}), true,
                  at::kDouble, la);
    double worst = 0;
    for (size_t i = 0; i < la.size(); ++i) worst = std::max(worst, std::abs(la[i] - lb[i]) / std::abs(lb[i]));
    for (size_t i = 0; i < pa.size(); ++i) worst = std::max(worst, rel(pa[i], pb[i]));
    worst = max_over_ranks(worst);
    if (parallel::world_info().rank == 0)
      std::printf("[ errors   ] gdn + softmax_attn (window 6, global_tokens 3, stride 5) sp=%d vs 1 rank, packed "
                  "documents (fp64, 3 steps, recompute %s): %.3g\n", P, recompute, worst);
    EXPECT_LT(worst, 1e-11) << "recompute " << recompute;
    EXPECT_NE(lb.front(), lb.back()) << "the run does not train";
  }
  {
    std::vector<double> sp_losses, segment_losses;
    auto sp_params = run(cfg({"parallel.sp=" + std::to_string(P)}), true, at::kFloat, sp_losses);
    auto segment_params = run(cfg({"parallel.segments=" + std::to_string(P)}), false, at::kFloat, segment_losses);
    int same = sp_losses == segment_losses ? 1 : 0;
    for (size_t i = 0; same && i < sp_params.size(); ++i) same = at::equal(sp_params[i], segment_params[i]);
    int all = 0;
    MPI_Allreduce(&same, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (parallel::world_info().rank == 0)
      std::printf("[ bitwise  ] gdn + softmax_attn patterns sp=%d vs sp=1 with %d segments (fp32, 3 steps): %s\n", P, P,
                  all ? "equal" : "DIFFER");
    EXPECT_EQ(all, 1);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (parallel::world_info().rank == 0) remove_tree(dir);
}

}  // namespace
}  // namespace carry::testing
