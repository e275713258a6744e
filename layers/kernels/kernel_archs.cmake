# Which CUDA sources are also compiled for sm_100a (Blackwell B200/GB200): every .cu of the kernels but the
# delta rule's wgmma walks (layers/kernels/delta_rule/*.cu, layers/kernels/log_linear/walk.cu: Hopper-only
# instructions), whose layers take their ATen forms there (layers/core/fused_switch.h). Included by the
# project's build and by the Python package's own; tests/cuda/kernel_archs_test.py checks the objects.
#   carry_blackwell_sources(OUT ROOT SOURCES...): OUT = the sources of SOURCES to compile for sm_100a too.
function(carry_blackwell_sources out root)
  file(GLOB hopper_only CONFIGURE_DEPENDS ${root}/layers/kernels/delta_rule/*.cu)
  list(APPEND hopper_only ${root}/layers/kernels/log_linear/walk.cu)
  set(sources ${ARGN})
  list(FILTER sources INCLUDE REGEX "\\.cu$")
  list(REMOVE_ITEM sources ${hopper_only})
  set(${out} ${sources} PARENT_SCOPE)
endfunction()
