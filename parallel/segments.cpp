// Ordered segments (see the header).
#include "parallel/segments.h"

#include "layers/core/nvtx.h"

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

// The range [lo, hi) of an n-element buffer a rank holds before each halving round (distance 1, 2, ...,
// P/2) and, last, after them.
std::vector<std::pair<int64_t, int64_t>> halving_ranges(int r, int P, int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> ranges{{0, n}};
  for (int d = 1; d < P; d *= 2) {
    auto [lo, hi] = ranges.back();
    const int64_t mid = lo + (hi - lo) / 2;
    ranges.emplace_back((r & d) ? mid : lo, (r & d) ? hi : mid);
  }
  return ranges;
}

// Recursive halving: in the round of distance d a rank and its partner r ^ d, which hold the same range,
// split it; each keeps one half, sends the other and adds the partner's copy of its own half. After the
// rounds a rank holds its last range summed over all ranks in the tree's order (the block of 2d ranks'
// sum is its two halves' sums added, as the tree adds them; IEEE addition commutes, so which operand
// comes first does not change a bit).
void halving_rounds(Tensor& flat, Communicator* sp) {
  const int r = sp->rank(), P = sp->size();
  const auto ranges = halving_ranges(r, P, flat.numel());
  for (size_t i = 0; i + 1 < ranges.size(); ++i) {
    const int d = 1 << i;
    const auto [lo, hi] = ranges[i];
    const auto [keep_lo, keep_hi] = ranges[i + 1];
    const int64_t give_lo = keep_lo == lo ? keep_hi : lo, give_hi = keep_lo == lo ? hi : keep_lo;
    Tensor got = at::empty({keep_hi - keep_lo}, flat.options());
    {
      CommContext ctx("tree sum over segments: halving round of distance " + std::to_string(d));
      sp->send_recv(flat.narrow(0, give_lo, give_hi - give_lo), r ^ d, got, r ^ d, /*tag=*/7204);
    }
    flat.narrow(0, keep_lo, keep_hi - keep_lo).add_(got);
  }
}

// The halving rounds in reverse: each round hands the partner the range this rank holds and takes its
// range, until every rank holds the whole buffer.
void gathering_rounds(Tensor& flat, Communicator* sp) {
  const int r = sp->rank(), P = sp->size();
  const auto ranges = halving_ranges(r, P, flat.numel());
  for (size_t i = ranges.size() - 1; i >= 1; --i) {
    const int d = 1 << (i - 1);
    const auto [lo, hi] = ranges[i];
    const auto [plo, phi] = ranges[i - 1];
    const int64_t other_lo = lo == plo ? hi : plo, other_hi = lo == plo ? phi : lo;
    Tensor got = flat.narrow(0, other_lo, other_hi - other_lo);
    {
      CommContext ctx("tree sum over segments: gathering round of distance " + std::to_string(d));
      sp->send_recv(flat.narrow(0, lo, hi - lo), r ^ d, got, r ^ d, /*tag=*/7205);
    }
  }
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
  if (power_of_two(P) && mine.numel() >= int64_t{1024} * P) {
    // By halves (recursive halving, then doubling back): each rank sends 2(1 − 1/P) of the buffer
    // instead of log2(P) whole buffers (0.5 GB of a 125M model's gradients: 1.5 against 2 buffers at 4
    // ranks, 1.75 against 3 at 8). In place: a rank's one segment is the caller's own tensor, so that
    // one is copied first.
    if (k == 1) mine = mine.clone(at::MemoryFormat::Contiguous);
    Tensor flat = mine.view({-1});
    halving_rounds(flat, sp);
    gathering_rounds(flat, sp);
    return mine;
  }
  if (power_of_two(P)) {
    // Recursive doubling (small buffers: fewer messages): after the round of distance d, each rank
    // holds the sum of its block of 2d ranks, the lower half's sum first, as the tree adds it.
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

int tree_piece(int rank, int P) {
  TORCH_CHECK(power_of_two(P) && rank >= 0 && rank < P, "tree_piece: expected a rank of a power of two of ranks, got ",
              rank, " of ", P);
  if (P == 2) return rank;  // the reduce-scatter's piece
  return static_cast<int>(halving_ranges(rank, P, P).back().first);
}

Tensor tree_reduce_scatter(const std::vector<Tensor>& local, Communicator* sp) {
  const int64_t k = static_cast<int64_t>(local.size());
  TORCH_CHECK(power_of_two(k), "tree_reduce_scatter: a rank must hold a power of two of segments, got ", k);
  Tensor mine = tree(local, 0, k);
  if (!sp || sp->size() == 1) return mine;
  const int P = sp->size();
  TORCH_CHECK(power_of_two(P) && mine.dim() == 1 && mine.numel() % P == 0, "tree_reduce_scatter: expected a 1-D "
              "buffer of ", P, " equal pieces over a power of two of ranks, got shape ", mine.sizes(), " over ", P);
  NvtxRange range("tree_reduce_scatter over sp");
  mine = mine.contiguous();
  if (P == 2) {
    CommContext ctx("tree sum over segments: the two ranks' subtrees, piece by piece");
    sp->reduce_scatter_sum(mine);
    return mine;
  }
  if (k == 1) mine = mine.clone(at::MemoryFormat::Contiguous);  // the halving rounds write over it
  halving_rounds(mine, sp);
  return mine;
}

void tree_all_gather(Tensor& flat, Communicator* sp) {
  if (!sp || sp->size() == 1) return;
  const int P = sp->size();
  TORCH_CHECK(power_of_two(P) && flat.dim() == 1 && flat.is_contiguous() && flat.numel() % P == 0,
              "tree_all_gather: expected a contiguous 1-D buffer of ", P, " equal pieces over a power of two of "
              "ranks, got shape ", flat.sizes(), " over ", P);
  NvtxRange range("tree_all_gather over sp");
  if (P == 2) {
    CommContext ctx("the update's pieces from the rank holding each");
    sp->all_gather_pieces(flat);
    return;
  }
  gathering_rounds(flat, sp);
}

}  // namespace carry::parallel
