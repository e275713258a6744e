"""Builds carry's Python package for pip: CMake on python/CMakeLists.txt (standalone: layers/ and, with
CARRY_CUDA=ON, the kernels, compiled against the torch installed in the environment pip installs into),
the operator library `_carry.so` and `_build.py` written into the package beside its Python files.

Environment: CARRY_CUDA=ON|OFF (default ON when nvidia-smi lists a GPU, nvcc is found and torch is a
CUDA build), CARRY_JOBS (parallel compile jobs, default: the number of cores).
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _torch():
    """(folder, version, CUDA version or None) of the torch installed where this package is going, read
    without importing torch. pip's isolated build environment hides that environment's packages from
    this process, so its interpreter is asked in isolated mode (-I: the environment's own site-packages)."""
    probe = ("import importlib.util as u, os, re; s = u.find_spec('torch'); d = os.path.dirname(s.origin); "
             "t = open(os.path.join(d, 'version.py')).read(); "
             "print(d); print(re.search(r\"__version__ = '([^']*)'\", t).group(1)); "
             "m = re.search(r\"cuda: [^=]*= '([^']*)'\", t); print(m.group(1) if m else '')")
    for cmd in ([sys.executable, "-I", "-c", probe], [sys.executable, "-c", probe]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            folder, version, cuda = (r.stdout.splitlines() + ["", "", ""])[:3]
            return folder, version, cuda or None
    raise SystemExit(f"carry setup: no torch in the environment of {sys.executable}: install torch 2.11 there first "
                     "(carry's operator library is built against it)")


def _cuda_wanted(torch_cuda):
    choice = os.environ.get("CARRY_CUDA", "").upper()
    if choice in ("ON", "OFF"):
        return choice == "ON"
    if choice:
        raise SystemExit(f"carry setup: CARRY_CUDA must be ON or OFF, got {os.environ['CARRY_CUDA']!r}")
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    gpu = False
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        gpu = r.returncode == 0 and r.stdout.startswith("GPU")
    return bool(nvcc and gpu and torch_cuda)


class CMakeBuild(build_ext):
    def get_ext_filename(self, name):  # `_carry.so`: loaded by torch.ops.load_library, not imported
        return os.path.join(*name.split(".")) + ".so"

    def build_extension(self, ext):
        if shutil.which("cmake") is None:
            raise SystemExit("carry setup: cmake is needed to build the package (apt-get install cmake, or pip install cmake)")
        torch_dir, torch_version, torch_cuda = _torch()
        if not torch_version.startswith("2.11"):
            raise SystemExit(f"carry setup: carry is built against torch 2.11, this environment has {torch_version} ({torch_dir})")
        out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        tmp = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        os.makedirs(tmp, exist_ok=True)
        cuda = _cuda_wanted(torch_cuda)
        args = ["cmake", "-S", HERE, "-B", tmp, "-DCMAKE_BUILD_TYPE=Release", f"-DCARRY_TORCH_ROOT={torch_dir}",
                f"-DCARRY_PYTHON_OUTPUT_DIR={out_dir}", f"-DCARRY_CUDA={'ON' if cuda else 'OFF'}"]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        if cuda and not shutil.which("nvcc"):
            args.append("-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc")
        print(f"carry setup: building the operator library against torch {torch_version} ({torch_dir}), "
              f"CUDA kernels {'ON' if cuda else 'OFF'}", flush=True)
        subprocess.run(args, check=True)
        jobs = os.environ.get("CARRY_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", tmp, "-j", jobs, "--target", "carry_python"], check=True)


setup(ext_modules=[Extension("carry._carry", sources=[])], cmdclass={"build_ext": CMakeBuild})
