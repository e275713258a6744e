// Ordered segments under mpirun (1, 2, 4 ranks): tree_sum gives every layout of 8 segments the same
// bits as one rank holding all 8, and the segment communicator carries a halo exchange across
// segments of one rank and across ranks exactly as 8 ranks would (forward and gradient).
#include "parallel/halo.h"
#include "parallel/segments.h"

#include <gtest/gtest.h>
#include <mpi.h>
#include <torch/csrc/autograd/autograd.h>

namespace carry::parallel {
namespace {

constexpr int kSegments = 8;

// Segment i's partial sum: fp32 values spread over many magnitudes, so that the order of the
// additions shows in the last bits.
std::vector<Tensor> partial_sums(int64_t n = 4096) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  std::vector<Tensor> v;
  for (int i = 0; i < kSegments; ++i)
    v.push_back(at::randn({n}, gen, at::kFloat) * at::exp(at::randn({n}, gen, at::kFloat) * 4));
  return v;
}

// Sizes: 4096 and 12289 elements go by halves at 4 ranks (12289 splits unevenly), 1000 by whole
// buffers (recursive doubling). Each rank's inputs stay as they were.
TEST(Segments, TreeSumIsTheSameOnEveryLayout) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const int r = comm->rank(), P = comm->size();
  if (kSegments % P != 0) GTEST_SKIP() << "needs a world size dividing " << kSegments;
  for (int64_t n : {int64_t{4096}, int64_t{12289}, int64_t{1000}}) {
    auto all = partial_sums(n);
    const Tensor one_rank = tree_sum(all, nullptr);
    const int k = kSegments / P;
    std::vector<Tensor> mine(all.begin() + r * k, all.begin() + (r + 1) * k);
    std::vector<Tensor> kept;
    for (auto& t : mine) kept.push_back(t.clone());
    const Tensor spread = tree_sum(mine, comm.get());
    EXPECT_TRUE(at::equal(spread, one_rank)) << "rank " << r << " of " << P << ", " << n << " elements";
    for (size_t i = 0; i < mine.size(); ++i)
      EXPECT_TRUE(at::equal(mine[i], kept[i])) << "rank " << r << ": tree_sum changed its input " << i;
    // The order matters at all: a left fold differs (else the test above would prove nothing).
    Tensor fold = all[0];
    for (int i = 1; i < kSegments; ++i) fold = fold + all[i];
    EXPECT_FALSE(at::equal(fold, one_rank));
  }
}

// The tree sum in two halves (tree_reduce_scatter, then tree_all_gather): the piece a rank holds after
// the first has tree_sum's bits, and after the second every rank holds the whole sum with them. Over
// 1, 2 and 4 ranks (power-of-two sizes; 12288 splits into 4 pieces of 3072).
TEST(Segments, TreeSumInHalvesHasItsBits) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const int r = comm->rank(), P = comm->size();
  if (kSegments % P != 0) GTEST_SKIP() << "needs a world size dividing " << kSegments;
  for (int64_t n : {int64_t{4096}, int64_t{12288}}) {
    auto all = partial_sums(n);
    const Tensor one_rank = tree_sum(all, nullptr);
    const int k = kSegments / P;
    std::vector<Tensor> mine(all.begin() + r * k, all.begin() + (r + 1) * k);
    Tensor flat = tree_reduce_scatter(mine, comm.get());
    const int piece = tree_piece(r, P);
    const int64_t len = n / P;
    EXPECT_TRUE(at::equal(flat.narrow(0, piece * len, len), one_rank.narrow(0, piece * len, len)))
        << "rank " << r << " of " << P << ", piece " << piece << ", " << n << " elements";
    tree_all_gather(flat, comm.get());
    EXPECT_TRUE(at::equal(flat, one_rank)) << "rank " << r << " of " << P << ", " << n << " elements";
  }
  // Every piece is some rank's.
  std::vector<int> held(P, 0);
  for (int q = 0; q < P; ++q) held.at(tree_piece(q, P)) += 1;
  for (int j = 0; j < P; ++j) EXPECT_EQ(held[j], 1) << "piece " << j << " of " << P;
  // A buffer that does not split into equal pieces is refused with its shape.
  if (P > 1) {
    std::vector<Tensor> odd{at::ones({P * 8 + 1})};
    try {
      tree_reduce_scatter(odd, comm.get());
      ADD_FAILURE() << "an uneven buffer was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("equal pieces"), std::string::npos) << e.what_without_backtrace();
    }
  }
}

TEST(Segments, RankMustHoldAPowerOfTwo) {
  auto all = partial_sums();
  try {
    tree_sum({all[0], all[1], all[2]}, nullptr);
    FAIL() << "three segments a rank were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("power of two of segments, got 3"), std::string::npos)
        << e.what_without_backtrace();
  }
}

// A segment that asks for a message its predecessor has not sent (segments run out of order) gets a
// clear error, not a hang.
TEST(Segments, OutOfOrderSegmentsAreRefusedClearly) {
  SegmentCommunicator seg(nullptr, 2, at::kCPU);
  seg.set_segment(1);
  Tensor t = at::empty({4});
  try {
    seg.recv(t, 0, 9);
    FAIL() << "a message nobody sent was received";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("segment 1 waits for a message (tag 9) from segment 0, which "
                                                            "did not send one"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

// A halo exchange over 8 segments, run segment after segment on each rank, equals the serial shift:
// segment i receives segment i−1's last tokens, and the gradient of the halo reaches segment i−1.
TEST(Segments, HaloCrossesSegmentsAndRanks) {
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const int r = world->rank(), P = world->size();
  if (kSegments % P != 0) GTEST_SKIP() << "needs a world size dividing " << kSegments;
  const int k = kSegments / P;
  const int64_t L = 6, D = 3, halo = 2;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto x = at::randn({1, kSegments * L, D}, gen, at::kDouble);
  auto seg = std::make_shared<SegmentCommunicator>(P > 1 ? world : nullptr, k, at::kCPU);
  std::vector<Tensor> leaves, got;
  for (int j = 0; j < k; ++j) {
    seg->set_segment(j);
    leaves.push_back(x.narrow(1, seg->rank() * L, L).clone().requires_grad_(true));
    got.push_back(halo_exchange(*seg, leaves.back(), halo));
  }
  for (int j = k - 1; j >= 0; --j) {  // backward in reverse, each halo's gradient its segment's index + 1
    seg->set_segment(j);
    torch::autograd::backward({got[j]}, {at::full_like(got[j], seg->rank() + 1.0)});
  }
  for (int j = 0; j < k; ++j) {
    const int i = r * k + j;
    auto expect = i == 0 ? at::zeros({1, halo, D}, at::kDouble) : x.narrow(1, i * L - halo, halo);
    EXPECT_TRUE(at::equal(got[j].detach(), expect)) << "segment " << i;
    auto dx = at::zeros({1, L, D}, at::kDouble);
    if (i + 1 < kSegments) dx.narrow(1, L - halo, halo).fill_(i + 2.0);  // from segment i+1's halo
    // The last segment's x gets no gradient (nothing comes from a next segment).
    const Tensor& g = leaves[j].grad();
    EXPECT_TRUE(g.defined() ? at::equal(g, dx) : i + 1 == kSegments) << "segment " << i;
  }
}

}  // namespace
}  // namespace carry::parallel
