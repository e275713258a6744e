// Mixed precision helpers (see precision.h).
#include "layers/blocks/precision.h"

#include <ATen/autocast_mode.h>

namespace carry {

AutocastScope::AutocastScope(at::DeviceType device, at::ScalarType dtype, bool enabled)
    : device_(device), active_(enabled), was_enabled_(false), was_dtype_(dtype) {
  if (!active_) return;
  was_enabled_ = at::autocast::is_autocast_enabled(device_);
  was_dtype_ = at::autocast::get_autocast_dtype(device_);
  at::autocast::set_autocast_dtype(device_, dtype);
  at::autocast::set_autocast_enabled(device_, true);
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  at::autocast::set_autocast_enabled(device_, was_enabled_);
  at::autocast::set_autocast_dtype(device_, was_dtype_);
  // The cast weights cached for this region are stale once the optimizer updates the masters.
  if (!was_enabled_) at::autocast::clear_cache();
}

AutocastState AutocastState::current() {
  AutocastState s;
  s.cpu = at::autocast::is_autocast_enabled(at::kCPU);
  s.cuda = at::autocast::is_autocast_enabled(at::kCUDA);
  s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  return s;
}

AutocastStateScope::AutocastStateScope(const AutocastState& s)
    : cpu_(at::kCPU, s.cpu_dtype, s.cpu), cuda_(at::kCUDA, s.cuda_dtype, s.cuda) {}

bool autocast_active_for(const Tensor& x) {
  if (!x.defined()) return false;
  return at::autocast::is_autocast_enabled(x.device().type());
}

namespace {
Tensor up(const Tensor& t) {
  if (!t.defined() || !t.is_floating_point()) return t;
  auto s = t.scalar_type();
  return (s == at::kBFloat16 || s == at::kHalf) ? t.to(at::kFloat) : t;
}
}  // namespace

MixerInputs full_precision(const MixerInputs& in) {
  MixerInputs out = in;
  for (const auto& n : MixerInputs::names()) out.get(n) = up(in.get(n));
  return out;
}

State full_precision(const State& state) {
  State out;
  for (auto& t : state) out.push_back(up(t));
  return out;
}

MixerInputs kernel_precision(const MixerInputs& in) {
  MixerInputs out = in;
  for (const auto& n : MixerInputs::names()) {
    const Tensor& t = in.get(n);
    if (!t.defined() || !at::isFloatingType(t.scalar_type())) continue;
    const auto dt = MixerInputs::is_gate(n) ? at::kFloat : at::autocast::get_autocast_dtype(t.device().type());
    out.get(n) = t.to(dt);
  }
  return out;
}

}  // namespace carry
