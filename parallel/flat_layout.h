// Where each parameter's elements sit in one flat buffer of all of them: the gradients summed over the
// sp group as one message, and, with the update split over the group (framework/train/sharded_update.h),
// the parameters and AdamW's moments gathered as one.
//
// Parameters go in their fixed order, each from a multiple of kAlign elements. So every parameter's
// view of the buffer is as aligned as a tensor of its own: the multi-tensor kernels (the gradient norm's
// _foreach_norm) take their vectorized path by a tensor's address and length, and a view that started
// at an odd element would take the scalar one, with other roundings, than the same tensor on another
// layout.
//
// With P pieces the parameters are cut into P runs of whole parameters of nearly equal size (each cut
// at the parameter boundary nearest to j/P of the total), and every run is padded to the same length,
// so that piece j is elements [j·piece_numel, (j+1)·piece_numel): the equal pieces a reduce-scatter
// leaves one to a rank. The gaps are never read as a parameter's values.
#pragma once

#include <cstdint>
#include <vector>

namespace carry::parallel {

struct FlatLayout {
  static constexpr int64_t kAlign = 16;  // elements: 64 bytes of fp32

  std::vector<int64_t> offset;     // each parameter's first element
  std::vector<int> piece_first;    // piece j holds parameters [piece_first[j], piece_first[j + 1]); P + 1 entries
  int64_t piece_numel = 0;         // every piece's length, a multiple of kAlign
  int64_t numel = 0;               // the buffer's length: P · piece_numel
  int pieces = 1;

  // `numels`: the parameters' element counts in order; `pieces` >= 1.
  static FlatLayout make(const std::vector<int64_t>& numels, int pieces = 1);
  // The piece holding parameter i.
  int piece_of(int i) const;
};

}  // namespace carry::parallel
