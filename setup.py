"""Build pagedkv._C: the C core (as C11, a static library), the torch shims,
and with PAGEDKV_BUILD=cuda (or auto on a CUDA torch with a complete CUDA toolkit) the CUDA kernels.

The extension is built against the torch of the environment it installs into, so install without
build isolation:  pip install --no-build-isolation .   (a build that cannot see that torch stops
at once with this advice; build_mode.py holds the decisions).
"""

import glob
import importlib.util
import os
import platform
import shutil
import site
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def load_build_mode():
    spec = importlib.util.spec_from_file_location("pagedkv_build_mode", os.path.join(ROOT, "build_mode.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


build_mode = load_build_mode()
BUILD_MODE = os.environ.get("PAGEDKV_BUILD", "auto").lower()
# PAGEDKV_SANITIZE=1 builds everything with ASan+UBSan for local bug hunting (run python with
# LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0; see RELIABILITY.md).
SANITIZE = os.environ.get("PAGEDKV_SANITIZE", "0") == "1"


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def environment_site_dirs():
    """The installing environment's site-packages, first match wins (pip's isolation hides them from sys.path)."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]] + site.getsitepackages()
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return list(dict.fromkeys(dirs))


def import_build_torch():
    """The torch to build against, or None for commands that need none (egg_info, sdist). Stops with one
    message when the build could only use a torch other than the environment's."""
    try:
        import torch
    except ImportError:
        torch = None
    if not build_mode.needs_torch(sys.argv[1:]):
        return torch
    own = [sys.prefix, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    if site.ENABLE_USER_SITE:
        own.append(site.getusersitepackages())
    try:
        build_mode.check_build_torch(
            getattr(torch, "__version__", None),
            getattr(torch, "__file__", None),
            environment_site_dirs(),
            [p for p in own if p],
        )
    except build_mode.BuildConfigError as error:
        raise SystemExit(str(error))
    return torch


torch = import_build_torch()
if torch is None or not build_mode.needs_torch(sys.argv[1:]):
    CHOICE = build_mode.BuildChoice(False, None, "this command builds no extension")
else:
    try:
        CHOICE = build_mode.choose_build(BUILD_MODE, torch.__version__, torch.version.cuda, os.environ, shutil.which)
    except build_mode.BuildConfigError as error:
        raise SystemExit(str(error))
    if BUILD_MODE == "auto" and not CHOICE.with_cuda:
        print(f"pagedkv: building the CPU extension only: {CHOICE.reason}", file=sys.stderr)
WITH_CUDA = CHOICE.with_cuda
if WITH_CUDA:
    print(f"pagedkv: building the CUDA kernels: {CHOICE.reason}", file=sys.stderr)
    os.environ["CUDA_HOME"] = CHOICE.toolkit.home
if torch is not None:
    import torch.utils.cpp_extension as torch_extension
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    if WITH_CUDA:
        # torch's builder takes its toolkit from this global, set by its own search at import (the nvcc
        # on PATH first): use the complete toolkit found above instead
        torch_extension.CUDA_HOME = CHOICE.toolkit.home
else:
    BuildExtension = None

    def CppExtension(name, sources, **_):  # sdist and egg_info only list the sources
        return Extension(name, sources=sources)
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
# No -std here: torch's BuildExtension adds the standard its headers need when none is given (C++17
# up to torch 2.12, C++20 from 2.13 on; torch >= 2.14's headers do not compile as C++17).
cxx_flags = ["-Wall"] + OPT + SAN_FLAGS + OPENMP
link_flags = SAN_FLAGS[:1] + OPENMP

# CUDA targets: sm_80 (cp.async loader), sm_90a (TMA per page chunk), sm_100a
# (TMA gather4), plus compute_80 PTX so newer GPUs JIT the cp.async path.
# PAGEDKV_CUDA_ARCHS (e.g. "80" or "80,90a") narrows this for quick local builds.
CUDA_ARCHS = [a.strip() for a in os.environ.get("PAGEDKV_CUDA_ARCHS", "80,90a,100a").split(",") if a.strip()]

if WITH_CUDA:
    # torch's build reads this even though the -gencode flags below decide (and
    # crashes without it on a machine with no GPU)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a;10.0a")
    # the .cu files include no torch header; they are written in C++20 (checked per target by
    # .ci/cuda_build_check.sh with the same flag)
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


# what the build record lists as compiled: one cubin per target, plus the PTX added above
COMPILED_ARCHS = [f"sm_{a}" for a in CUDA_ARCHS] + (["compute_80"] if "80" in CUDA_ARCHS else [])
BUILD_CONFIG_NAME = "_build_config.py"


def build_config_text():
    return build_mode.build_config_source(torch.__version__, torch.version.cuda, CHOICE, COMPILED_ARCHS, BUILD_MODE)


def read_text(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class BuildWithCore(BuildExtension if BuildExtension is not None else object):
    """Build the C core library first (editable installs skip build_clib), then the extension, then
    write the build record (_build_config.py) next to it: what pagedkv.build_info() reports and what
    the import-time check compares with the running torch."""

    def run(self):
        self.run_command("build_clib")
        if self.editable_mode:
            # editable installs compile in a new temporary folder each time: keeping the extension's
            # objects where other builds keep them lets a re-install, and a wheel built after it (the
            # wheel stage of scripts/test.sh), recompile only what changed
            platform_tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = os.path.join(ROOT, "build", f"temp.{platform_tag}")
        record_dir = os.path.join(self.build_lib, "pagedkv")
        text = build_config_text()
        # an extension is only "up to date" if it was built against this torch and mode: the
        # sources' timestamps alone would keep an extension built against another torch
        if read_text(os.path.join(record_dir, BUILD_CONFIG_NAME)) != text:
            self.force = True
        super().run()
        dirs = [record_dir]
        if self.inplace:  # --inplace and editable installs load the copy in the source tree
            dirs.append(os.path.join(ROOT, "python", "pagedkv"))
        for d in dirs:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, BUILD_CONFIG_NAME), "w") as f:
                f.write(text)


class BuildPyWithoutRecord(build_py):
    """Leaves the build record out of the copied sources: only build_ext writes it, for the extension it
    built (a copy from the source tree would describe an in-place build, perhaps against another torch)."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if m[1] != os.path.splitext(BUILD_CONFIG_NAME)[0]]


commands = {"build_py": BuildPyWithoutRecord}
if BuildExtension is not None:  # (without torch: sdist and egg_info, which build nothing)
    commands["build_ext"] = BuildWithCore
setup(
    libraries=[core_lib] + isa_libs,
    ext_modules=[ext],
    cmdclass=commands,
    # the wheel runs only with the torch its extension was built against (same C++ ABI)
    install_requires=[build_mode.torch_requirement(getattr(torch, "__version__", None)), "numpy"],
)
