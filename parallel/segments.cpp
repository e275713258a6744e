// Ordered segments (see the header).
#include "parallel/segments.h"

#include "layers/common/nvtx.h"

namespace carry::parallel {

namespace {

bool power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// The largest power of two strictly below n (n >= 2).
int64_t split_below(int64_t n) {
  int64_t p = 1;
  while (2 * p < n) p *= 2;
  return p;
}

// The tree over items [a, b) of `v`.
Tensor tree(const std::vector<Tensor>& v, int64_t a, int64_t b) {
  if (b - a == 1) return v[a];
  const int64_t m = a + split_below(b - a);
  return tree(v, a, m) + tree(v, m, b);
}

}  // namespace

SegmentCommunicator::SegmentCommunicator(std::shared_ptr<Communicator> sp, int per_rank, at::Device device)
    : sp_(std::move(sp)),
      per_rank_(per_rank),
      sp_rank_(sp_ ? sp_->rank() : 0),
      sp_size_(sp_ ? sp_->size() : 1),
      device_(device) {
  TORCH_CHECK(per_rank >= 1, "segments: each rank must hold at least one segment, got ", per_rank);
  options_.name = "segments";
}

void SegmentCommunicator::set_segment(int j) {
  TORCH_CHECK(j >= 0 && j < per_rank_, "segments: segment ", j, " is not one of this rank's 0..", per_rank_ - 1);
  segment_ = j;
}

int SegmentCommunicator::world_rank_of(int r) const { return sp_ ? sp_->world_rank_of(r / per_rank_) : 0; }

std::string SegmentCommunicator::backend() const {
  return "segments over " + (sp_ ? sp_->backend() : std::string("one rank"));
}

void SegmentCommunicator::send_recv(const Tensor& out, int dst, Tensor& in, int src, int tag) {
  const int me = rank();
  const bool local_dst = dst >= 0 && local(dst), local_src = src >= 0 && local(src);
  if (local_dst || local_src) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (local_dst) mailbox_[{me, dst, tag}].push_back(out.detach().to(device_).clone());
    if (local_src) {
      auto it = mailbox_.find({src, me, tag});
      TORCH_CHECK(it != mailbox_.end() && !it->second.empty(), "segments: segment ", me,
                  " waits for a message (tag ", tag, ") from segment ", src,
                  ", which did not send one; the segments of a rank must run in order (forward 0, 1, ...; "
                  "backward in reverse)");
      Tensor got = it->second.front();
      it->second.erase(it->second.begin());
      if (it->second.empty()) mailbox_.erase(it);
      TORCH_CHECK(got.numel() == in.numel() && got.scalar_type() == in.scalar_type(), "segments: segment ", me,
                  " expects ", in.numel(), " elements of ", in.scalar_type(), " (tag ", tag, ") from segment ", src,
                  ", which sent ", got.numel(), " of ", got.scalar_type());
      in.copy_(got.view(in.sizes()));
    }
  }
  const int rdst = dst >= 0 && !local_dst ? dst / per_rank_ : -1;
  const int rsrc = src >= 0 && !local_src ? src / per_rank_ : -1;
  if (rdst < 0 && rsrc < 0) return;
  TORCH_CHECK(sp_, "segments: rank ", rdst >= 0 ? dst : src, " is not a segment of this one-rank run");
  Tensor none;
  sp_->send_recv(rdst >= 0 ? out : Tensor(), rdst, rsrc >= 0 ? in : none, rsrc, tag);
}

std::vector<Tensor> SegmentCommunicator::all_gather(const Tensor&) {
  TORCH_CHECK(false, "segments: all_gather is not defined over segments (only the ordered scan runs on them)");
}
void SegmentCommunicator::all_reduce_sum(Tensor&) {
  TORCH_CHECK(false, "segments: all_reduce_sum is not defined over segments (use tree_sum)");
}
void SegmentCommunicator::broadcast(Tensor&, int) {
  TORCH_CHECK(false, "segments: broadcast is not defined over segments");
}
void SegmentCommunicator::barrier() { TORCH_CHECK(false, "segments: barrier is not defined over segments"); }

Tensor tree_sum(const std::vector<Tensor>& local, Communicator* sp) {
  const int64_t k = static_cast<int64_t>(local.size());
  TORCH_CHECK(power_of_two(k), "tree_sum: a rank must hold a power of two of segments, got ", k);
  Tensor mine = tree(local, 0, k);
  if (!sp || sp->size() == 1) return mine;
  NvtxRange range("tree_sum over sp");
  const int r = sp->rank(), P = sp->size();
  mine = mine.contiguous();
  if (P == 2) {
    CommContext ctx("tree sum over segments: the two ranks' subtrees");
    sp->all_reduce_sum(mine);
    return mine;
  }
  if (power_of_two(P)) {
    // Recursive doubling: after the round of distance d, each rank holds the sum of its block of 2d
    // ranks, the lower half's sum first, as the tree adds it.
    for (int d = 1; d < P; d *= 2) {
      const int partner = r ^ d;
      Tensor got = at::empty_like(mine);
      {
        CommContext ctx("tree sum over segments: round of distance " + std::to_string(d));
        sp->send_recv(mine, partner, got, partner, /*tag=*/7201);
      }
      mine = (r & d) ? got + mine : mine + got;
    }
    return mine;
  }
  std::vector<Tensor> all;
  {
    CommContext ctx("tree sum over segments: gathering every rank's subtree");
    all = sp->all_gather(mine);
  }
  return tree(all, 0, P);
}

}  // namespace carry::parallel
