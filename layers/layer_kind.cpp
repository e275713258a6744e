// The layer-kind registry (see the header). Kinds register at static initialization from their
// family's layer.cpp (layers is linked as object files, so every registration is present).
#include "layers/layer_kind.h"

#include "layers/layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>

namespace carry {
namespace {
std::map<std::string, LayerKind>& registry() {
  static std::map<std::string, LayerKind> r;
  return r;
}
}  // namespace

bool register_layer_kind(const LayerKind& kind) {
  TORCH_INTERNAL_ASSERT(!registry().count(kind.kind), "layer kind registered twice: ", kind.kind);
  registry()[kind.kind] = kind;
  return true;
}

const LayerKind* find_layer_kind(const std::string& kind) {
  auto it = registry().find(kind);
  return it == registry().end() ? nullptr : &it->second;
}

const LayerKind& layer_kind(const std::string& kind) {
  const LayerKind* k = find_layer_kind(kind);
  TORCH_CHECK(k, "mixer layer: unknown mixer kind '", kind, "'; kinds with a layer: ", join(layer_kind_names()));
  return *k;
}

const std::vector<std::string>& layer_kind_names() {
  static const std::vector<std::string> names = [] {
    std::vector<const LayerKind*> kinds;
    for (auto& [n, k] : registry()) kinds.push_back(&k);
    std::stable_sort(kinds.begin(), kinds.end(),
                     [](const LayerKind* a, const LayerKind* b) { return a->listing < b->listing; });
    std::vector<std::string> out;
    for (auto* k : kinds) out.push_back(k->kind);
    return out;
  }();
  return names;
}

}  // namespace carry
