"""Loads carry's operator library `_carry.so` (python/csrc/ops.cpp) into torch.ops.carry.

The library is built against one torch (recorded in `_build.py` beside it) and links its C++ libraries,
so it is loaded only into a process whose torch has the same version. Loading it does not change the
process's CPU math: carry's programs pin MKL's and ATen's CPU code paths for their bitwise promises
(layers/core/cpu_determinism.h); here that happens only when CARRY_CPU_MATH is set (to anything but
`native`) before `import carry`.
"""
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY = os.path.join(_HERE, "_carry.so")
_loaded = False


def _base_version(v):
    return v.split("+")[0]


def load():
    global _loaded
    if _loaded:
        return
    try:
        from carry import _build
    except ImportError:
        _build = None
    if _build is None or not os.path.exists(LIBRARY):
        raise ImportError(
            f"carry: the operator library {LIBRARY} is not built. From carry's repository, "
            "`pip install --no-build-isolation .` builds and installs the package; in a build tree, "
            "`cmake --build build --target carry_python` builds it into build/python/carry "
            "(then import carry with PYTHONPATH=build/python)")
    if _base_version(torch.__version__) != _base_version(_build.torch_version):
        raise ImportError(
            f"carry: {LIBRARY} was built against torch {_build.torch_version}, but this Python has torch "
            f"{torch.__version__} ({os.path.dirname(torch.__file__)}); build the package again in this "
            "environment (`pip install --no-build-isolation .` from carry's repository)")
    unset = "CARRY_CPU_MATH" not in os.environ
    if unset:
        os.environ["CARRY_CPU_MATH"] = "native"
    try:
        torch.ops.load_library(LIBRARY)
    finally:
        if unset:
            del os.environ["CARRY_CPU_MATH"]
    _loaded = True


def cuda_kernels():
    """Whether the library holds carry's CUDA kernels (built with CARRY_CUDA)."""
    from carry import _build
    return bool(_build.cuda_kernels)
