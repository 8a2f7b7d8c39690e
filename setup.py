"""Build pagedkv._C: the C core (as C11, a static library), the torch shims,
and with PAGEDKV_BUILD=cuda (or auto on a CUDA torch with nvcc) the CUDA kernels.

Install without build isolation so the extension is built against the torch
it will run with:  pip install --no-build-isolation -e .
"""

import glob
import os
import platform
import shutil
import sys

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
C_FLAGS = ["-std=c11", "-fPIC", "-Wall", "-Wextra", "-fno-strict-aliasing"] + OPT + SAN_FLAGS
# CPU kernels per ISA (csrc/cpu/kernels/pkv_cpu_kernels.inc compiled once per file in
# csrc/cpu/isa/), each a static library with its own flags (csrc/cpu/isa/isa_flags.txt),
# picked at run time by cpuid (csrc/cpu/pkv_cpu_dispatch.c).
def read_isa_flags():
    flags = {}
    with open(os.path.join(ROOT, "csrc", "cpu", "isa", "isa_flags.txt")) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if words:
                flags["csrc/cpu/isa/" + words[0]] = words[1:]
    return flags


CPU_ISA_FLAGS = read_isa_flags()
IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# The C library: the core, the CPU backend and its ISA files without flags (the scalar one).
C_SOURCES = rel("csrc/core/*.c") + rel("csrc/cpu/*.c") + rel("csrc/cpu/isa/*.c")
# build_clib recompiles an object when one of these changed ("obj_deps"; it ignores "depends").
CORE_DEPENDS = rel("csrc/core/*.h") + rel("csrc/cpu/*.h") + rel("csrc/cpu/kernels/*")
core_lib = (
    "pkv_core",
    {
        "sources": [s for s in C_SOURCES if s not in CPU_ISA_FLAGS],
        "cflags": C_FLAGS,
        "obj_deps": {"": CORE_DEPENDS},
    },
)
# Listed after pkv_core: the static link resolves pkv_core's references to their tables.
isa_libs = [
    (
        os.path.splitext(os.path.basename(src))[0],
        {"sources": [src], "cflags": C_FLAGS + flags, "obj_deps": {"": CORE_DEPENDS}},
    )
    for src, flags in CPU_ISA_FLAGS.items()
] if IS_X86 else []

cpp_sources = [s for s in rel("csrc/torch/*.cpp") if not s.endswith("_cuda.cpp")]
# -fopenmp: at::parallel_for is a header template whose OpenMP pragma compiles to a plain
# serial loop without it (every CPU op then ran on one core). The libgomp.so.1 it links is
# the one torch has already loaded (same soname), so there is one OpenMP runtime and pool.
OPENMP = [] if sys.platform == "darwin" else ["-fopenmp"]
cxx_flags = ["-std=c++17", "-Wall"] + OPT + SAN_FLAGS + OPENMP
link_flags = SAN_FLAGS[:1] + OPENMP

# CUDA targets: sm_80 (cp.async loader), sm_90a (TMA per page chunk), sm_100a
# (TMA gather4), plus compute_80 PTX so newer GPUs JIT the cp.async path.
# PAGEDKV_CUDA_ARCHS (e.g. "80" or "80,90a") narrows this for quick local builds.
CUDA_ARCHS = [a.strip() for a in os.environ.get("PAGEDKV_CUDA_ARCHS", "80,90a,100a").split(",") if a.strip()]

if WITH_CUDA:
    # torch's build reads this even though the -gencode flags below decide (and
    # crashes without it on a machine with no GPU)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a;10.0a")
    # torch >= 2.14 headers need C++20 (torch's own default when no -std is given)
    cxx_flags = [f for f in cxx_flags if not f.startswith("-std=")] + ["-std=c++20"]
    nvcc_flags = ["-O3", "-std=c++20", "-lineinfo"]
    nvcc_flags += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]
    if "80" in CUDA_ARCHS:
        nvcc_flags.append("-gencode=arch=compute_80,code=compute_80")
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
    libraries=[core_lib] + isa_libs,
    ext_modules=[ext],
    cmdclass={"build_ext": BuildWithCore},
)
