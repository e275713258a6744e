// The ordered segments' gradient sum, started during the backward (see the header).
#include "parallel/gradient_sum.h"

#include "parallel/flat_layout.h"

#include "layers/core/nvtx.h"
#include "parallel/peer_sum.h"
#include "parallel/segments.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <optional>

#ifdef CARRY_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace carry::parallel {

namespace {
constexpr int kGradientTag = 7202;
bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }
}  // namespace

struct OverlappedGradientSum::State {
  enum class Mode { counting, overlapping, plain };

  NamedParameters params;
  std::vector<int64_t> offset;                   // each parameter's first element in the flat buffer
  std::vector<std::pair<int, int>> buckets;      // parameter ranges [first, last), in the flat order
  std::vector<int> bucket_of;                    // a parameter's bucket
  std::shared_ptr<Communicator> comm;
  int64_t total = 0;

  std::mutex mutex;  // the hooks run on autograd's threads
  Mode mode = Mode::counting;
  bool armed = false;
  std::vector<int> arrivals;   // hooks fired this backward, per parameter
  std::vector<char> absent;    // no hook in the counting step: no gradient (zeros), not waited for
  std::vector<int> missing;    // per bucket: its parameters not arrived yet
  int next = -1;               // the next bucket to send (they go from the last to the first)
  Tensor flat, got;            // this rank's flat gradients (then their sum), and the partner's (P > 2)
  std::unique_ptr<PeerSum> peer;  // use_copy_engines: the buckets go by the copy engines
#ifdef CARRY_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> side;  // where the buckets' messages and sums run
  // set_timing: finish()'s start and end on the caller's stream, per step not yet taken
  bool timing = false;
  std::vector<std::pair<std::shared_ptr<at::cuda::CUDAEvent>, std::shared_ptr<at::cuda::CUDAEvent>>> timed;
#endif

  Tensor piece(const Tensor& t, int b) const {
    const int64_t first = offset[buckets[b].first];
    const int64_t end = buckets[b].second < static_cast<int>(offset.size()) ? offset[buckets[b].second] : total;
    return t.narrow(0, first, end - first);
  }

  // Copies parameter i's gradient (zeros if it has none) into the flat buffer, on the current stream.
  void gather(int i) {
    const Tensor& p = params[i].second;
    auto dst = flat.narrow(0, offset[i], p.numel());
    if (p.grad().defined()) dst.copy_(p.grad().reshape({-1}));
    else dst.zero_();
  }

  // Sends bucket b through tree_sum's rounds (recursive doubling), after what the current stream has
  // enqueued; on CUDA on the side stream, so the current stream does not wait.
  void send(int b) {
    NvtxRange range("gradient bucket");
    Tensor mine = piece(flat, b);
    if (peer) {  // the copy engines, with streams of their own
      peer->exchange_and_add(mine, offset[buckets[b].first]);
      return;
    }
#ifdef CARRY_WITH_CUDA
    std::optional<c10::cuda::CUDAStreamGuard> on_side;
    if (side) {
      at::cuda::CUDAEvent ready;
      ready.record(c10::cuda::getCurrentCUDAStream(side->device_index()));
      ready.block(*side);
      on_side.emplace(*side);
    }
#endif
    CommContext ctx("the weight gradients' tree sum over sp, bucket " + std::to_string(b + 1) + " of " +
                    std::to_string(buckets.size()));
    const int r = comm->rank(), P = comm->size();
    if (P == 2) {  // one all-reduce in place, as tree_sum over two ranks: one addition an element
      comm->all_reduce_sum(mine);
      return;
    }
    Tensor theirs = got.defined() ? piece(got, b) : Tensor();  // more than two ranks
    for (int d = 1; d < P; d *= 2) {
      comm->send_recv(mine, r ^ d, theirs, r ^ d, kGradientTag);
      mine.add_(theirs);  // IEEE addition commutes: tree_sum's lower-half-first order gives the same bits
    }
  }

  // Sends every bucket whose turn has come and whose parameters have all arrived.
  void send_ready() {
    while (next >= 0 && missing[next] == 0) send(next--);
  }
};

namespace {

// Autograd calls it after adding a backward's gradient into the parameter's .grad.
class ArrivalHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  ArrivalHook(std::weak_ptr<OverlappedGradientSum::State> state, int index)
      : state_(std::move(state)), index_(index) {}
  void operator()(const torch::autograd::Variable&) override {
    auto s = state_.lock();
    if (!s) return;
    std::lock_guard<std::mutex> lock(s->mutex);
    if (!s->armed) return;
    const int i = index_;
    ++s->arrivals[i];
    if (s->mode != OverlappedGradientSum::State::Mode::overlapping) return;
    const int b = s->bucket_of[i];
    TORCH_CHECK(s->arrivals[i] == 1 && b <= s->next, "gradient sum: the gradient of parameter '", s->params[i].first,
                "' arrived twice in one backward, after its bucket was sent");
    s->gather(i);
    if (!s->absent[i]) --s->missing[b];
    s->send_ready();
  }

 private:
  std::weak_ptr<OverlappedGradientSum::State> state_;
  int index_;
};

}  // namespace

OverlappedGradientSum::OverlappedGradientSum(NamedParameters params, std::shared_ptr<Communicator> comm,
                                             int64_t bucket_bytes)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(comm && power_of_two(comm->size()), "gradient sum: the communicator must have a power of two of "
              "ranks, got ", comm ? comm->size() : 0);
  TORCH_CHECK(!params.empty() && bucket_bytes > 0, "gradient sum: needs parameters and a positive bucket size");
  State& s = *state_;
  s.params = std::move(params);
  s.comm = std::move(comm);
  const int n = static_cast<int>(s.params.size());
  int first = 0;
  int64_t bytes = 0;
  // The trainer's flat layout of one piece (parallel/flat_layout.h: each parameter aligned).
  std::vector<int64_t> numels;
  for (auto& [name, p] : s.params) numels.push_back(p.numel());
  const FlatLayout layout = FlatLayout::make(numels);
  s.offset = layout.offset;
  s.total = layout.numel;
  for (int i = 0; i < n; ++i) {
    const Tensor& p = s.params[i].second;
    TORCH_CHECK(p.scalar_type() == s.params[0].second.scalar_type() && p.device() == s.params[0].second.device(),
                "gradient sum: every parameter must share one dtype and device");
    s.bucket_of.push_back(static_cast<int>(s.buckets.size()));
    bytes += p.numel() * p.element_size();
    if (bytes >= bucket_bytes || i == n - 1) {
      s.buckets.emplace_back(first, i + 1);
      first = i + 1;
      bytes = 0;
    }
  }
  s.arrivals.assign(n, 0);
  s.absent.assign(n, 0);
  for (int i = 0; i < n; ++i)
    torch::autograd::impl::set_post_acc_grad_hooks(s.params[i].second, std::make_unique<ArrivalHook>(state_, i));
}

OverlappedGradientSum::~OverlappedGradientSum() {
  for (auto& [name, p] : state_->params) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

bool OverlappedGradientSum::overlapping() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->mode == State::Mode::overlapping;
}

namespace {
void allocate(OverlappedGradientSum::State& s) {
  if (s.flat.defined()) return;
  const auto opt = s.params[0].second.options();
  s.flat = at::zeros({s.total}, opt);  // the gaps between parameters stay zeros
  if (s.comm->size() > 2) s.got = at::empty({s.total}, opt);  // two ranks: one all-reduce in place
#ifdef CARRY_WITH_CUDA
  if (opt.device().is_cuda()) s.side = c10::cuda::getStreamFromPool(false, opt.device().index());
#endif
}
}  // namespace

std::string OverlappedGradientSum::use_copy_engines() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  allocate(s);
  std::string why;
  s.peer = PeerSum::open(*s.comm, s.flat, &why);
  return s.peer ? "" : why;
}

bool OverlappedGradientSum::copy_engines() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->peer != nullptr;
}

void OverlappedGradientSum::begin() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  allocate(s);
  if (s.peer && s.mode == State::Mode::overlapping) s.peer->begin_step();
  std::fill(s.arrivals.begin(), s.arrivals.end(), 0);
  s.missing.clear();
  for (auto& [first, last] : s.buckets) {
    int m = 0;
    for (int i = first; i < last; ++i) {
      if (s.mode == State::Mode::overlapping && s.absent[i]) s.flat.narrow(0, s.offset[i], s.params[i].second.numel()).zero_();
      else ++m;
    }
    s.missing.push_back(m);
  }
  s.next = static_cast<int>(s.buckets.size()) - 1;
  s.armed = true;
}

void OverlappedGradientSum::set_timing(bool on) {
#ifdef CARRY_WITH_CUDA
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->timing = on;
#else
  (void)on;
#endif
}

double OverlappedGradientSum::take_waited_seconds() {
  double s = 0;
#ifdef CARRY_WITH_CUDA
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (auto& [start, end] : state_->timed) {
    end->synchronize();
    s += start->elapsed_time(*end) / 1000.0;
  }
  state_->timed.clear();
#endif
  return s;
}

Tensor OverlappedGradientSum::finish() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(s.armed, "gradient sum: finish() without begin()");
  s.armed = false;
#ifdef CARRY_WITH_CUDA
  // The caller's stream from here to the end of the sums (every return path below).
  std::shared_ptr<at::cuda::CUDAEvent> start;
  const bool timed = s.timing && s.flat.is_cuda();
  if (timed) {
    start = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
    start->record(c10::cuda::getCurrentCUDAStream(s.flat.device().index()));
  }
  struct Stop {
    State& s;
    std::shared_ptr<at::cuda::CUDAEvent> start;
    ~Stop() {
      if (!start) return;
      auto end = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
      end->record(c10::cuda::getCurrentCUDAStream(s.flat.device().index()));
      s.timed.emplace_back(start, end);
    }
  } stop{s, timed ? start : nullptr};
#endif
  if (s.mode != State::Mode::overlapping) {
    // Counting (or plain): the whole buffer after the backward, as tree_sum does.
    for (int i = 0; i < static_cast<int>(s.params.size()); ++i) s.gather(i);
    if (s.mode == State::Mode::counting) {
      // Early buckets from the next step on if every rank saw each parameter's hook at most once.
      bool once = true;
      for (size_t i = 0; i < s.arrivals.size(); ++i) {
        once = once && s.arrivals[i] <= 1;
        s.absent[i] = s.arrivals[i] == 0;
      }
      Tensor flag = at::full({1}, once ? 0.0 : 1.0, at::TensorOptions().dtype(at::kFloat).device(s.comm->device()));
      {
        CommContext ctx("gradient sum: agreeing whether the buckets can go during the backward");
        s.comm->all_reduce_sum(flag);
      }
      s.mode = flag.cpu().item<float>() == 0 ? State::Mode::overlapping : State::Mode::plain;
    }
    return tree_sum({s.flat}, s.comm.get()).contiguous();
  }
  // The buckets the backward did not send (their parameters without a gradient, or late): now, in order.
  for (int b = s.next; b >= 0; --b) {
    for (int i = s.buckets[b].first; i < s.buckets[b].second; ++i)
      if (s.arrivals[i] == 0) s.gather(i);
    s.send(b);
  }
  s.next = -1;
  if (s.peer) {  // the caller's stream waits for the copy engines' sums
    s.peer->finish_step();
    return s.flat;
  }
#ifdef CARRY_WITH_CUDA
  if (s.side) {  // the caller's stream waits for the side stream's sums
    at::cuda::CUDAEvent done;
    done.record(*s.side);
    done.block(c10::cuda::getCurrentCUDAStream(s.side->device_index()));
  }
#endif
  return s.flat;
}

}  // namespace carry::parallel
