// The update split over the sp ranks (framework/train/sharded_update.h) under mpirun (2 and 4 ranks; 1
// checks the refusal): the parameters and moments become views of the flat buffers with their values
// kept; each rank's optimizer updates its piece only; the gather gives every rank every piece; a
// parameter replaced instead of copied into is caught at the next gather.
#include "framework/train/sharded_update.h"
#include "parallel/process_group.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <string>

namespace carry {
namespace {

NamedParameters make_parameters() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  NamedParameters ps;
  ps.emplace_back("embedding.weight", at::randn({40, 8}, gen));
  for (int l = 0; l < 3; ++l) {
    ps.emplace_back("layers." + std::to_string(l) + ".w", at::randn({8, 8}, gen));
    ps.emplace_back("layers." + std::to_string(l) + ".scale", at::randn({5}, gen));
  }
  ps.emplace_back("norm.weight", at::randn({8}, gen));
  for (auto& [n, p] : ps) p.set_requires_grad(true);
  return ps;
}

config::OptimizerConfig adam() {
  config::OptimizerConfig o;
  o.set_beta1(0.9), o.set_beta2(0.95), o.set_eps(1e-8), o.set_weight_decay(0.1);
  return o;
}

TEST(ShardedUpdate, PiecesUpdateAndGatherBack) {
  auto world = parallel::make_mpi_communicator(MPI_COMM_WORLD);
  const int P = world->size(), r = world->rank();
  auto params = make_parameters();
  if (P < 2) {
    EXPECT_EQ(ShardedUpdate::unavailable(params, world.get()), "one rank a sequence");
    return;
  }
  if ((P & (P - 1)) != 0) {
    EXPECT_NE(ShardedUpdate::unavailable(params, world.get()).find("not a power of two"), std::string::npos);
    return;
  }
  std::vector<at::Tensor> before;
  for (auto& [n, p] : params) before.push_back(p.detach().clone());
  AdamW opt(params, adam());
  ShardedUpdate sharded(params, opt, world.get());
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i].second, before[i])) << params[i].first;
  // One step with the same gradients everywhere: this rank's piece moves, the others stay until the gather.
  for (auto& [n, p] : params) p.mutable_grad() = at::ones_like(p);
  {
    at::NoGradGuard no_grad;
    opt.step(0.1);
  }
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    const bool mine = i >= sharded.first() && i < sharded.last();
    EXPECT_EQ(at::equal(params[i].second, before[i]), !mine) << "rank " << r << ", " << params[i].first;
  }
  sharded.gather_parameters();
  sharded.wait_parameters();
  for (int i = 0; i < static_cast<int>(params.size()); ++i)
    EXPECT_FALSE(at::equal(params[i].second, before[i])) << "rank " << r << ", " << params[i].first << " not gathered";
  // A rank whose piece holds the embedding first needs another rank's parameters at a block or the final
  // norm; every other rank at the embedding. (The first piece may be empty: here the embedding is more
  // than a quarter of the parameters, so at 4 ranks the first cut falls before it.)
  const bool embedding_mine = sharded.first() == 0 && sharded.last() > 0;
  EXPECT_EQ(sharded.first_foreign_part() >= 0, embedding_mine) << "rank " << r << ": " << sharded.first_foreign_part();
  int holders = embedding_mine ? 1 : 0, all = 0;
  MPI_Allreduce(&holders, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(all, 1) << "exactly one rank holds the embedding";
  // A parameter replaced instead of copied into is caught at the next gather.
  {
    at::NoGradGuard no_grad;
    params[1].second.set_data(at::zeros({8, 8}));
  }
  try {
    sharded.gather_parameters();
    ADD_FAILURE() << "a replaced parameter went unnoticed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("'layers.0.w' no longer lives in the flat buffer"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace
}  // namespace carry
