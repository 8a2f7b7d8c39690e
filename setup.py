"""Build pagedkv._C: the C core (as C11, a static library), the torch shims,
and with PAGEDKV_BUILD=cuda (or auto on a CUDA torch with nvcc) the CUDA kernels.

Install without build isolation so the extension is built against the torch
it will run with:  pip install --no-build-isolation -e .
"""

import glob
import os
import shutil

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_MODE = os.environ.get("PAGEDKV_BUILD", "auto").lower()
if BUILD_MODE not in ("auto", "cpu", "cuda"):
    raise SystemExit(f"PAGEDKV_BUILD must be auto, cpu or cuda, got {BUILD_MODE!r}")
# PAGEDKV_SANITIZE=1 builds everything with ASan+UBSan for local bug hunting (run python with
# LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0; see RELIABILITY.md).
SANITIZE = os.environ.get("PAGEDKV_SANITIZE", "0") == "1"


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def want_cuda():
    has_nvcc = shutil.which("nvcc") is not None or os.path.exists(
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    )
    if BUILD_MODE == "cpu":
        return False
    if BUILD_MODE == "cuda":
        if torch.version.cuda is None:
            raise SystemExit("PAGEDKV_BUILD=cuda needs a CUDA build of torch (torch.version.cuda is None)")
        if not has_nvcc:
            raise SystemExit("PAGEDKV_BUILD=cuda needs nvcc (set CUDA_HOME)")
        return True
    # auto: never key on torch.cuda.is_available(); build machines have no GPU
    return torch.version.cuda is not None and has_nvcc


WITH_CUDA = want_cuda()
SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"] if SANITIZE else []
OPT = ["-O1", "-g"] if SANITIZE else ["-O3"]

# The core is C: its own flags, not torch's C++ flags.
core_lib = (
    "pkv_core",
    {
        "sources": rel("csrc/core/*.c"),
        "cflags": ["-std=c11", "-fPIC", "-Wall", "-Wextra", "-fno-strict-aliasing"] + OPT + SAN_FLAGS,
    },
)

cpp_sources = [s for s in rel("csrc/torch/*.cpp") if not s.endswith("_cuda.cpp")]
cxx_flags = ["-std=c++17", "-Wall"] + OPT + SAN_FLAGS
link_flags = SAN_FLAGS[:1]

if WITH_CUDA:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a;10.0a")
    nvcc_flags = [
        "-O3",
        "-std=c++17",
        "-lineinfo",
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_100a,code=sm_100a",
    ]
    ext = CUDAExtension(
        "pagedkv._C",
        sources=cpp_sources + rel("csrc/torch/*_cuda.cpp") + rel("csrc/cuda/*.cu"),
        define_macros=[("PAGEDKV_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
    )
else:
    ext = CppExtension(
        "pagedkv._C",
        sources=cpp_sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


class BuildWithCore(BuildExtension):
    """Build the C core library first (editable installs skip build_clib)."""

    def run(self):
        self.run_command("build_clib")
        super().run()


setup(
    libraries=[core_lib],
    ext_modules=[ext],
    cmdclass={"build_ext": BuildWithCore},
)
