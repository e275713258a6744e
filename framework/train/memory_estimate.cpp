// The memory estimate (see memory_estimate.h): a counting CPU allocator, one forward per distinct
// layer at three lengths, the parabola through them, the table.
#include "framework/train/memory_estimate.h"

#include "layers/layer_kind.h"

#include "layers/blocks/recompute.h"

#include "framework/model/model.h"
#include "layers/blocks/precision.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <unordered_map>

namespace carry {

namespace {

// Wraps the CPU allocator; counts the bytes of its allocations of the current generation. Its DataPtrs
// are simple (the context is the data pointer, the deleter raw_deleter()), as ATen's raw_allocate
// requires of the CPU allocator (ATen's CPU matrix product, at::mm, reached it at the 340M preset's
// sizes): the
// wrapped allocation and its size live in a table keyed by the pointer.
class CountingAllocator final : public c10::Allocator {
 public:
  static CountingAllocator& instance() {
    static auto* a = new CountingAllocator;  // never destroyed: tensors it allocated may outlive any scope
    return *a;
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // nothing allocated (n = 0)
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(table_mutex_);
      table_[data] = Entry{std::move(inner), n, generation_.load()};
    }
    const int64_t now = live_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &CountingAllocator::release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  void begin(c10::Allocator* base) {
    base_ = base;
    ++generation_;
    live_ = 0, peak_ = 0;
  }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }

 private:
  struct Entry {
    c10::DataPtr inner;
    size_t bytes = 0;
    int64_t generation = 0;
  };
  static void release(void* p) {
    auto& self = instance();
    Entry e;
    {
      std::lock_guard<std::mutex> lock(self.table_mutex_);
      auto it = self.table_.find(p);
      if (it == self.table_.end()) return;
      e = std::move(it->second);
      self.table_.erase(it);
    }
    if (e.generation == self.generation_.load()) self.live_ -= static_cast<int64_t>(e.bytes);
    // e.inner frees through the wrapped allocator's deleter as it goes
  }
  c10::Allocator* base_ = nullptr;
  std::atomic<int64_t> generation_{0}, live_{0}, peak_{0};
  std::mutex table_mutex_;
  std::unordered_map<void*, Entry> table_;
};

CountingAllocator& counting_allocator() { return CountingAllocator::instance(); }

std::string bytes_text(double b) {
  char buf[32];
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  return buf;
}

// The parabola through (x_i, y_i), i = 0..2, at x.
double parabola_at(const std::vector<double>& xs, const std::vector<double>& ys, double x) {
  double r = 0;
  for (int i = 0; i < 3; ++i) {
    double l = 1;
    for (int j = 0; j < 3; ++j)
      if (j != i) l *= (x - xs[j]) / (xs[i] - xs[j]);
    r += ys[i] * l;
  }
  return r;
}

}  // namespace

double extrapolate_bytes(const std::vector<double>& xs, const std::vector<double>& ys, double length) {
  TORCH_CHECK(xs.size() == 3 && ys.size() == 3 && xs[0] < xs[1] && xs[1] < xs[2],
              "extrapolate_bytes: three measurements at ascending lengths expected");
  const double line = ys[2] + (ys[2] - ys[1]) / (xs[2] - xs[1]) * (length - xs[2]);
  return std::max({ys[2], line, parabola_at(xs, ys, length)});
}

double available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024.0;
  return -1;
}

CpuAllocation measure_cpu_allocation(const std::function<void()>& f) {
  static std::mutex mu;  // one measurement at a time (the CPU allocator is process-wide)
  std::lock_guard<std::mutex> lock(mu);
  auto& counter = counting_allocator();
  c10::Allocator* previous = c10::GetCPUAllocator();
  counter.begin(previous);
  c10::SetCPUAllocator(&counter, /*priority=*/0);
  CpuAllocation r;
  try {
    f();
  } catch (...) {
    c10::SetCPUAllocator(previous, 0);
    throw;
  }
  c10::SetCPUAllocator(previous, 0);
  r.live_bytes = static_cast<double>(counter.live());
  r.peak_bytes = static_cast<double>(counter.peak());
  return r;
}

MemoryEstimate estimate_memory(const RunConfig& config, std::FILE* progress) {
  MemoryEstimate m;
  const auto& mc = config.model();
  const int64_t L = mc.n_layers(), kinds = std::max(1, mc.mixers_size());
  const int64_t sp = config.parallel().sp();
  m.batch = config.data().batch_size();
  m.slice_tokens = config.data().seq_len() / sp;
  const bool bf16 = config.precision() == RunConfig::BF16;

  // The distinct layers: the first min(L, |mixers|) of the model (layer i repeats layer i mod |mixers|).
  ModelConfig small = mc;
  small.set_n_layers(std::min<int64_t>(L, kinds));
  const auto options = at::TensorOptions().dtype(at::kFloat);
  {
    // The measurement builds these layers on this CPU and runs them with gradients: refuse clearly
    // where their parameters and gradients alone would not fit (counted on the meta device).
    Model shapes = build_model(small, config.seed(), options.device(at::kMeta));
    const double need = 2.0 * 4.0 * static_cast<double>(shapes.num_parameters());
    const double available = available_memory_bytes();
    TORCH_CHECK(available < 0 || need <= available, "the memory estimate measures the model's ", small.n_layers(),
                " distinct layer(s) on this CPU: with model.d_model = ", mc.d_model(), " and model.vocab_size = ",
                mc.vocab_size(), " they have ", shapes.num_parameters(), " parameters, ", bytes_text(need),
                " with their gradients in fp32, more than the ", bytes_text(available),
                " this host has available; lower model.d_model or model.vocab_size, or run the estimate on a "
                "larger host");
  }
  Model model = build_model(small, config.seed(), options);

  // Parameters of the full model: embedding (+ head), each layer as its distinct twin, the final norm.
  std::vector<int64_t> layer_params(small.n_layers(), 0);
  int64_t outside = 0;
  for (auto& [name, p] : model.parameters()) {
    if (name.rfind("layers.", 0) == 0) {
      layer_params[std::stoll(name.substr(7, name.find('.', 7) - 7))] += p.numel();
    } else {
      outside += p.numel();
    }
  }
  m.parameters = outside;
  for (int64_t i = 0; i < L; ++i) m.parameters += layer_params[i % small.n_layers()];
  m.parameter_bytes = 4.0 * static_cast<double>(m.parameters);
  m.gradient_bytes = m.parameter_bytes;
  // With the update split over ranks (parallel.shard_update where it applies), a rank holds the moments
  // of its piece of the parameters (whole tensors: about 1/ranks).
  m.moment_ranks = update_split_ranks(config);
  m.moments_split = m.moment_ranks > 1;
  m.optimizer_bytes = 2 * m.parameter_bytes / static_cast<double>(m.moment_ranks);

  // Slice lengths: multiples of every layer's chunk size, past every sliding window (a windowed
  // attention layer's cost is quadratic up to its window, linear after it).
  int64_t unit = 64, window = 0;
  for (int64_t i = 0; i < small.n_layers(); ++i) {
    auto o = layer_mixer(small, i).options;
    unit = std::max(unit, o.chunk_size());
    window = std::max(window, o.window());
  }
  const int64_t first = std::max(2 * unit, (window / unit + 1) * unit), stride = 2 * unit;
  std::vector<int64_t> lengths;
  if (m.slice_tokens <= first + 2 * stride) {
    lengths = {m.slice_tokens};
  } else {
    lengths = {first, first + stride, first + 2 * stride};
  }
  m.measured_at = lengths;
  const int64_t d = mc.d_model();
  auto extrapolate = [&](const std::vector<double>& ys) {
    if (ys.size() == 1) return ys[0];
    std::vector<double> xs(lengths.begin(), lengths.end());
    return extrapolate_bytes(xs, ys, static_cast<double>(m.slice_tokens));
  };
  at::manual_seed(0);
  std::vector<double> per_kind(small.n_layers(), 0), backward_of_kind(small.n_layers(), 0), core_of_kind(small.n_layers(), 0);
  for (int64_t i = 0; i < small.n_layers(); ++i) {
    const ModelBlock& b = model.blocks()[i];
    std::vector<double> ys, bs, cs;
    for (int64_t t : lengths) {
      auto x = at::randn({m.batch, t, d}, options).requires_grad_(true);
      // An rwkv7 layer after the first reads the first one's values (its value residual): stand-in values.
      const auto& spec = b.mixer->spec();
      const Tensor value_first =
          spec.value_residual ? at::randn({m.batch, t, spec.n_heads * spec.head_dim_v}, options) : Tensor();
      {
        // Recomputation around the kept core: the forward runs without autograd and keeps the core's
        // graph in the layer's stash (layers/blocks/recompute.h).
        auto stash = std::make_shared<MixerCoreStash>();
        MixerLayerContext with_stash;
        with_stash.core_stash = stash;
        cs.push_back(measure_cpu_allocation([&] {
                       at::NoGradGuard no_grad;
                       AutocastScope autocast(at::kCPU, at::kBFloat16, bf16);
                       (void)b.mixer->forward(b.mixer_norm.forward(x), {}, with_stash, value_first);
                     }).live_bytes);
      }
      at::Tensor y;
      auto used = measure_cpu_allocation([&] {
        AutocastScope autocast(at::kCPU, at::kBFloat16, bf16);
        auto h = x + b.mixer->forward(b.mixer_norm.forward(x), {}, {}, value_first).y;
        y = h + b.feed_forward(b.mlp_norm.forward(h));
      });
      ys.push_back(used.live_bytes);
      if (progress) {
        std::fprintf(progress, "memory: layer %lld (%s) forward at %lld tokens: %.1f MiB kept; its backward...\n",
                     static_cast<long long>(i), b.mixer->spec().kind.c_str(), static_cast<long long>(t),
                     used.live_bytes / (1024.0 * 1024.0));
        std::fflush(progress);
      }
      auto grad = at::randn_like(y);
      bs.push_back(measure_cpu_allocation([&] { y.backward(grad); }).peak_bytes);
      for (auto& [name, p] : model.parameters()) p.mutable_grad() = at::Tensor();
    }
    per_kind[i] = extrapolate(ys);
    backward_of_kind[i] = extrapolate(bs);
    core_of_kind[i] = extrapolate(cs);

  }
  {
    std::vector<double> ys;
    auto params = model.parameters();
    at::Tensor head = params.front().second, norm_weight;
    for (auto& [name, p] : params) {
      if (name == "lm_head.weight") head = p;
      if (name == "norm.weight") norm_weight = p;
    }
    std::vector<double> bs;
    for (int64_t t : lengths) {
      auto x = at::randn({m.batch, t, d}, options).requires_grad_(true);
      auto targets = at::randint(mc.vocab_size(), {m.batch, t}, at::kLong);
      at::Tensor loss;
      auto used = measure_cpu_allocation([&] {
        AutocastScope autocast(at::kCPU, at::kBFloat16, bf16);
        auto h = x * at::rsqrt(x.pow(2).mean(-1, true) + mc.norm_eps()) * norm_weight;
        // The trainer's chunked head and loss (chunked_loss.h): keeps the gradients of h and of the
        // head, never the logits.
        loss = linear_cross_entropy(h, head, targets, {}, config.parallel().loss_chunk_tokens()).loss;
      });
      ys.push_back(used.live_bytes);
      bs.push_back(measure_cpu_allocation([&] { loss.backward(); }).peak_bytes);
      for (auto& [name, p] : model.parameters()) p.mutable_grad() = at::Tensor();
    }
    m.head_bytes = extrapolate(ys);
    m.head_backward_bytes = extrapolate(bs);
    // The ranks after the first of an ordered sp group, one segment a rank, keep the loss's last chunks'
    // logit gradients until the end of the backward (parallel.deferred_head_gradient_mib; the trainer's).
    const auto& par = config.parallel();
    const int64_t sp_ranks = std::max<int64_t>(par.sp(), 1);
    const int64_t segments = par.segments() > 0 ? par.segments() : sp_ranks;
    if (par.scan_mode() == config::ParallelConfig::ORDERED && sp_ranks > 1 && segments == sp_ranks)
      m.head_bytes += std::min(static_cast<double>(par.deferred_head_gradient_mib()) * (1 << 20),
                               static_cast<double>(m.batch * m.slice_tokens * mc.vocab_size()) * (bf16 ? 2 : 4));
  }
  const double input = 4.0 * static_cast<double>(m.batch * m.slice_tokens * d);
  double largest_backward = 0;
  for (int64_t i = 0; i < L; ++i) {
    MemoryEstimate::Layer l;
    l.index = i;
    l.kind = model.blocks()[i % small.n_layers()].mixer->spec().kind;
    l.kept_bytes = per_kind[i % small.n_layers()];
    l.backward_bytes = backward_of_kind[i % small.n_layers()];
    l.input_bytes = input;
    // A recomputed rwkv7 block keeps [h, v_first] (framework/model/model.cpp): its input and the first values.
    const auto& spec = model.blocks()[i % small.n_layers()].mixer->spec();
    if (layer_kind(spec.kind).time_mix)
      l.input_bytes = input * static_cast<double>(d + spec.n_heads * spec.head_dim_v) / static_cast<double>(d);
    l.core_bytes = core_of_kind[i % small.n_layers()];
    m.activations_kept += l.kept_bytes;
    largest_backward = std::max(largest_backward, l.backward_bytes);
    m.layers.push_back(l);
  }
  m.activations_kept += m.head_bytes;
  // With recomputation the last `keep_last` layers keep their activations (parallel.recompute_keep_last):
  // alive from their forward through the head's backward and their own; a recomputed layer is rebuilt
  // only once they are gone.
  const int64_t keep_last = std::min<int64_t>(std::max<int64_t>(config.parallel().recompute_keep_last(), 0), L);
  const bool overlap = recompute_overlap_applies(config, /*if_recomputed=*/true);
  // The inputs kept are every recomputed layer's and the first kept layer's (the output of a recomputed
  // one; a kept layer's own output is in its kept bytes).
  double last_kept = 0, last_backward = 0, rebuilt = 0, recomputed_inputs = 0, keeps_mixer_inputs = 0;
  double rebuilt_kept = 0;  // the largest recomputed layer's activations (parallel.recompute_overlap)
  for (int64_t i = 0; i < L; ++i) {
    const auto& l = m.layers[i];
    const bool recomputed = i < L - keep_last;
    if (recomputed) {
      rebuilt = std::max(rebuilt, l.kept_bytes + l.backward_bytes);
      rebuilt_kept = std::max(rebuilt_kept, l.kept_bytes);
    } else {
      last_kept += l.kept_bytes;
      last_backward = std::max(last_backward, l.backward_bytes);
    }
    if (i <= L - keep_last) {
      recomputed_inputs += l.input_bytes;
      keeps_mixer_inputs += l.input_bytes + (recomputed ? l.core_bytes : 0);
    }
  }
  // Overlapped recomputation: while a layer is differentiated the one below it is rebuilt already.
  if (overlap && L - keep_last >= 2) rebuilt += rebuilt_kept;
  m.activations_recomputed = recomputed_inputs + last_kept + m.head_bytes;
  const double fixed = m.parameter_bytes + m.gradient_bytes + m.optimizer_bytes;
  // Peaks: the backward starts with every activation alive and the head's gradients; with
  // recomputation a layer is rebuilt and differentiated while the others keep only their inputs.
  m.total_kept = fixed + m.activations_kept + std::max(m.head_backward_bytes, largest_backward);
  const double head_or_last = std::max(m.head_backward_bytes, last_backward);
  m.total_recomputed = fixed + recomputed_inputs + m.head_bytes + std::max(last_kept + head_or_last, rebuilt);
  m.activations_keeps_mixer = keeps_mixer_inputs + last_kept + m.head_bytes;
  m.total_keeps_mixer = fixed + keeps_mixer_inputs + m.head_bytes + std::max(last_kept + head_or_last, rebuilt);
  return m;
}

std::string memory_report(const MemoryEstimate& m, const RunConfig& config) {
  std::ostringstream os;
  const auto& par = config.parallel();
  auto row = [&](const std::string& what, double bytes, const std::string& note = "") {
    char buf[160];
    std::snprintf(buf, sizeof buf, "  %-38s %11s%s%s\n", what.c_str(), bytes_text(bytes).c_str(), note.empty() ? "" : "   ",
                  note.c_str());
    os << buf;
  };
  os << "memory estimate per rank (one GPU each): dp " << par.dp() << " x sp " << par.sp() << ", " << m.batch
     << " sequence" << (m.batch == 1 ? "" : "s") << " a micro-batch, " << m.slice_tokens << " tokens of each on a rank"
     << (config.precision() == RunConfig::BF16 ? ", bf16 autocast" : ", fp32") << "\n";
  row("parameters (fp32)", m.parameter_bytes, std::to_string(m.parameters) + " parameters");
  row("gradients (fp32)", m.gradient_bytes);
  row("AdamW moments (fp32, 2 a parameter)", m.optimizer_bytes,
      m.moments_split ? "this rank's piece, about 1/" + std::to_string(m.moment_ranks) + " (parallel.shard_update)" : "");
  std::string at;
  for (size_t i = 0; i < m.measured_at.size(); ++i) at += (i ? ", " : "") + std::to_string(m.measured_at[i]);
  os << "  activations kept for the backward, per layer (measured on the CPU at " << at << " tokens"
     << (m.measured_at.size() > 1 ? ", extrapolated" : "") << "):\n";
  // Runs of equal layers on one line.
  for (size_t i = 0; i < m.layers.size();) {
    size_t j = i;
    while (j + 1 < m.layers.size() && m.layers[j + 1].kind == m.layers[i].kind &&
           m.layers[j + 1].kept_bytes == m.layers[i].kept_bytes)
      ++j;
    // Only consecutive equal layers merge when the model is not a cycle of several kinds.
    std::string name = "layer " + std::to_string(i) + (j > i ? "-" + std::to_string(j) : "") + " " + m.layers[i].kind;
    row("  " + name, m.layers[i].kept_bytes,
        (j > i ? "each; " : "") + std::string("recomputed: keeps its input, ") + bytes_text(m.layers[i].input_bytes) +
            ", and its mixer core " + bytes_text(m.layers[i].core_bytes) + " when kept");
    i = j + 1;
  }
  row("  head and loss (chunked: gradients of h and the head)", m.head_bytes);
  double layer_backward = 0;
  for (auto& l : m.layers) layer_backward = std::max(layer_backward, l.backward_bytes);
  row("backward transients, largest", std::max(m.head_backward_bytes, layer_backward),
      "head " + bytes_text(m.head_backward_bytes) + ", a layer " + bytes_text(layer_backward));
  row("activations, kept", m.activations_kept, "every layer + head");
  const int64_t keep_last = std::min<int64_t>(par.recompute_keep_last(), static_cast<int64_t>(m.layers.size()));
  const std::string rebuilt = recompute_overlap_applies(config, /*if_recomputed=*/true)
                                  ? "two layers rebuilt at a time (recompute_overlap)"
                                  : "one rebuilt at a time";
  row("activations, recomputed", m.activations_recomputed,
      keep_last > 0 ? "layer inputs + the last " + std::to_string(keep_last) + " whole + head; " + rebuilt
                    : "layer inputs + head; " + rebuilt);
  row("activations, around kept mixers", m.activations_keeps_mixer, "layer inputs + mixer cores + head");
  const bool recompute = par.recompute(), keeps = recompute && par.recompute_keeps_mixer();
  row("peak, activations kept", m.total_kept, recompute ? "" : "<- this config (parallel.recompute: false)");
  row("peak, recomputed", m.total_recomputed, recompute && !keeps ? "<- this config (parallel.recompute: true)" : "");
  row("peak, recomputed around kept mixers", m.total_keeps_mixer,
      keeps ? "<- this config (parallel.recompute_keeps_mixer: true)" : "");
  os << "  (ATen forms as measured; CUDA kernel forms keep other tensors. Allocator fragmentation and\n"
        "  communication buffers come on top.)\n";
  return os.str();
}

}  // namespace carry
