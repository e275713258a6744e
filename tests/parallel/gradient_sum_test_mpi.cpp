// The weight gradients' tree sum started during the backward (parallel/gradient_sum.h), under mpirun
// (1, 2, 4 ranks): over three steps it gives tree_sum's bits of the flat gradients; the first step
// only counts the hooks (nothing is sent before the backward ends), the later ones send buckets while
// the backward runs; a parameter used twice in the graph (tied) and one without a gradient are summed
// right; a count that says a gradient arrives in two parts keeps every step on the plain path. And the
// buckets by the copy engines (parallel/peer_sum.h): refused with a reason off two NCCL GPUs, and on
// them (2 ranks, one GPU each) the all-reduce's bits over steps where one rank runs ahead.
#include "parallel/gradient_sum.h"
#include "parallel/flat_layout.h"
#include "parallel/segments.h"

#include <gtest/gtest.h>
#include <mpi.h>
#include <torch/cuda.h>

#include <atomic>

namespace carry::parallel {
namespace {

// Counts the messages of the communicator it wraps.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  int world_rank_of(int r) const override { return inner_->world_rank_of(r); }
  std::string backend() const override { return inner_->backend(); }
  at::Device device() const override { return inner_->device(); }
  const CommOptions& options() const override { return inner_->options(); }
  void send_recv(const Tensor& out, int dst, Tensor& in, int src, int tag) override {
    ++messages;
    inner_->send_recv(out, dst, in, src, tag);
  }
  std::vector<Tensor> all_gather(const Tensor& t) override { return inner_->all_gather(t); }
  void all_reduce_sum(Tensor& t) override {  // a bucket over two ranks
    ++messages;
    inner_->all_reduce_sum(t);
  }
  void broadcast(Tensor& t, int root) override { inner_->broadcast(t, root); }
  void barrier() override { inner_->barrier(); }
  std::atomic<int> messages{0};

 private:
  std::shared_ptr<Communicator> inner_;
};

NamedParameters make_parameters() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  NamedParameters p;
  for (int64_t n : {300, 17, 4096, 1, 900, 2500, 64})
    p.emplace_back("p" + std::to_string(p.size()), at::randn({n}, gen, at::kFloat).requires_grad_(true));
  return p;
}

// A loss that differs by rank and step: p1 is used twice (tied), p6 not at all.
Tensor loss_of(const NamedParameters& p, int rank, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * rank + step);
  Tensor l = at::zeros({}, p[0].second.options().requires_grad(false));
  for (int i = 0; i < 6; ++i) {
    const Tensor& w = p[i].second;
    auto x = at::randn(w.sizes(), gen, at::kFloat) * at::exp(at::randn(w.sizes(), gen, at::kFloat) * 3);
    l = l + (w * w * x.to(w.device())).sum();
  }
  return l + (p[1].second * p[1].second.sin()).sum() * 0.5;
}

// The flat gradients in the trainer's layout (parallel/flat_layout.h: each parameter aligned, zeros between).
Tensor flat_of(const NamedParameters& p) {
  std::vector<int64_t> numels;
  for (auto& [name, t] : p) numels.push_back(t.numel());
  const auto layout = FlatLayout::make(numels);
  Tensor flat = at::zeros({layout.numel}, p[0].second.options().requires_grad(false));
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i].second.grad().defined())
      flat.narrow(0, layout.offset[i], p[i].second.numel()).copy_(p[i].second.grad().reshape({-1}));
  return flat;
}

TEST(GradientSum, BucketsDuringTheBackwardGiveTreeSumsBits) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const int r = world->rank();
  auto counting = std::make_shared<CountingCommunicator>(make_mpi_communicator(MPI_COMM_WORLD));
  auto params = make_parameters();
  OverlappedGradientSum sum(params, counting, /*bucket_bytes=*/4096);  // several buckets
  for (int step = 0; step < 3; ++step) {
    for (auto& [name, t] : params) t.mutable_grad() = Tensor();
    sum.begin();
    counting->messages = 0;
    loss_of(params, r, step).backward();
    const int during = counting->messages;
    Tensor got = sum.finish().clone();
    const Tensor want = tree_sum({flat_of(params)}, world.get());
    EXPECT_TRUE(at::equal(got, want)) << "step " << step << ", rank " << r;
    EXPECT_EQ(params[6].second.grad().defined(), false);
    if (world->size() > 1) {
      // The first step counts (nothing sent before finish), the later ones send during the backward.
      if (step == 0) EXPECT_EQ(during, 0);
      else EXPECT_GT(during, 0) << "step " << step;
      EXPECT_EQ(sum.overlapping(), true);
    }
  }
}

TEST(GradientSum, AGradientInTwoPartsKeepsThePlainPath) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const int r = world->rank();
  auto counting = std::make_shared<CountingCommunicator>(make_mpi_communicator(MPI_COMM_WORLD));
  auto params = make_parameters();
  OverlappedGradientSum sum(params, counting, 4096);
  for (int step = 0; step < 2; ++step) {
    for (auto& [name, t] : params) t.mutable_grad() = Tensor();
    sum.begin();
    counting->messages = 0;
    // Two backwards before finish: p0's hook fires twice, on rank 0 only.
    loss_of(params, r, step).backward();
    if (r == 0) (params[0].second * 2).sum().backward();
    EXPECT_EQ(static_cast<int>(counting->messages), 0) << "step " << step;
    Tensor got = sum.finish().clone();
    EXPECT_TRUE(at::equal(got, tree_sum({flat_of(params)}, world.get()))) << "step " << step;
    if (world->size() > 1) EXPECT_FALSE(sum.overlapping());  // every rank agreed on the plain path
  }
}

// Off two GPUs of one host over NCCL the copy engines are refused with a reason, and the buckets go
// over the communicator as before (the same bits).
TEST(GradientSum, CopyEnginesNeedTwoNcclGpus) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  auto params = make_parameters();
  OverlappedGradientSum sum(params, make_mpi_communicator(MPI_COMM_WORLD), 4096);
  const std::string why = sum.use_copy_engines();
  EXPECT_NE(why.find(world->size() == 2 ? "NCCL backend" : "two ranks"), std::string::npos) << why;
  EXPECT_FALSE(sum.copy_engines());
  for (int step = 0; step < 2; ++step) {
    for (auto& [name, t] : params) t.mutable_grad() = Tensor();
    sum.begin();
    loss_of(params, world->rank(), step).backward();
    Tensor got = sum.finish().clone();
    EXPECT_TRUE(at::equal(got, tree_sum({flat_of(params)}, world.get()))) << "step " << step;
  }
}

// Two ranks, one GPU each, NCCL (skipped otherwise): the buckets by the copy engines give NCCL's
// all-reduce's bits at every step; rank 0 or rank 1 runs ahead by a queue of matrix products in
// alternate steps, so each side's waits (for the other's buckets, for its buffer) are exercised.
TEST(GradientSum, CopyEnginesGiveTheAllReducesBits) {
  const bool here = nccl_available() && world_info().size == 2 &&
                    torch::cuda::device_count() >= static_cast<size_t>(world_info().local_size);
  double missing = here ? 0 : 1, any = 0;
  MPI_Allreduce(&missing, &any, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (any != 0) GTEST_SKIP() << "needs two ranks with a GPU each and NCCL";
  CommOptions opt;
  opt.on_timeout = CommOptions::OnTimeout::throw_error;
  ProcessGroups g = make_process_groups({1, 2}, Backend::nccl, opt);
  const at::Device dev(at::kCUDA, world_info().local_rank);
  const int r = g.sp->rank();
  NamedParameters params;
  for (auto& [name, t] : make_parameters()) params.emplace_back(name, t.detach().to(dev).requires_grad_(true));
  OverlappedGradientSum sum(params, g.sp_gradients, /*bucket_bytes=*/4096);  // several buckets
  ASSERT_EQ(sum.use_copy_engines(), "");
  ASSERT_TRUE(sum.copy_engines());
  auto busy = at::randn({2048, 2048}, at::TensorOptions().device(dev));
  for (int step = 0; step < 6; ++step) {
    for (auto& [name, t] : params) t.mutable_grad() = Tensor();
    if (step % 2 == r) for (int i = 0; i < 40; ++i) busy = at::mm(busy, busy).tanh_();  // this rank lags
    sum.begin();
    loss_of(params, r, step).backward();
    Tensor got = sum.finish().clone();
    Tensor want = flat_of(params).clone();
    g.sp_gradients->all_reduce_sum(want);
    EXPECT_TRUE(at::equal(got, want)) << "step " << step << ", rank " << r << ": largest difference "
                                      << (got - want).abs().max().item<float>();
    EXPECT_EQ(sum.overlapping(), true);
  }
}

}  // namespace
}  // namespace carry::parallel
