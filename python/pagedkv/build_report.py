"""What this pagedkv was built against and what it runs on.

`build_info()` reports the build record that setup.py writes next to the extension
(`_build_config.py`: torch version, CUDA toolkit and archs) with what this process finds: the running
torch, the CPU kernel paths this machine can run and the one the dispatcher chose. `check_build()`
runs at import, before the extension loads, so an extension built for another torch fails with an
ImportError that says how to rebuild rather than with an undefined symbol.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import platform
import sys
from typing import Optional

import torch

__all__ = ["build_info", "check_build", "build_mismatch", "cpu_kernels_available"]

REBUILD = (
    "rebuild pagedkv against the installed torch: `pip install --no-build-isolation --no-deps --force-reinstall .` "
    "in the pagedkv source tree (`python setup.py build_ext --inplace` for a checkout used in place), or install "
    "a pagedkv wheel built for torch {minor}"
)
# CPU kernel paths in the order the dispatcher (csrc/core/pkv_cpu_dispatch.c) prefers them, each with
# the /proc/cpuinfo flags it needs; every path also needs those of the paths before it.
CPU_KERNEL_FLAGS = (
    ("scalar", ()),
    ("avx2", ("avx2", "fma", "f16c")),
    ("avx512", ("avx512f", "avx512bw", "avx512vl")),
    ("amx", ("avx512_bf16", "avx512vbmi", "amx_bf16", "amx_tile")),
)


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _record() -> Optional[dict]:
    """The build record as a dict, or None for an extension built without one (before it existed)."""
    try:
        module = importlib.import_module("pagedkv._build_config")
    except ImportError:
        return None
    return {name: getattr(module, name) for name in dir(module) if name.isupper()}


def build_mismatch(record: Optional[dict], torch_version: str, torch_cuda: Optional[str]) -> Optional[str]:
    """Why an extension with this build record cannot run with this torch (None when it can)."""
    if record is None:
        return None
    built = record["TORCH_VERSION"]
    rebuild = REBUILD.format(minor=_minor(torch_version))
    if _minor(built) != _minor(torch_version):
        return f"pagedkv's extension was built for torch {built}, but torch {torch_version} is installed; {rebuild}"
    if record["WITH_CUDA"]:
        built_cuda = record["TORCH_CUDA_VERSION"]
        if torch_cuda is None:
            return (
                f"pagedkv's extension was built with CUDA kernels for torch {built} (CUDA {built_cuda}), but torch "
                f"{torch_version} is a CPU-only build; install a CUDA build of torch {_minor(built)} or {rebuild}"
            )
        if built_cuda.split(".")[0] != torch_cuda.split(".")[0]:
            return (
                f"pagedkv's extension was built for torch {built} with CUDA {built_cuda}, but torch {torch_version} "
                f"uses CUDA {torch_cuda}; {rebuild}"
            )
    return None


CPU_ISA_VALUES = ("scalar", "avx2", "avx512", "amx")


def check_cpu_isa_variable() -> None:
    """PAGEDKV_CPU_ISA caps the CPU kernel path (csrc/cpu/pkv_cpu_dispatch.c); the kernels take any
    other value as no cap, so a typo ("AVX2") would silently run (and test) the best path."""
    value = os.environ.get("PAGEDKV_CPU_ISA")
    if value and value not in CPU_ISA_VALUES:
        raise ImportError(f"PAGEDKV_CPU_ISA must be one of {', '.join(CPU_ISA_VALUES)} or unset, got {value!r}")


def check_build() -> None:
    """Import-time check: PAGEDKV_CPU_ISA, the build record against the running torch, then load the
    extension with a message that says what to do when it does not load."""
    check_cpu_isa_variable()
    record = _record()
    problem = build_mismatch(record, torch.__version__, torch.version.cuda)
    if problem:
        raise ImportError(problem)
    try:
        importlib.import_module("pagedkv._C")
    except ImportError as error:
        if getattr(error, "name", None) == "pagedkv._C":
            raise ImportError(
                "pagedkv._C (the compiled extension) is not built: `pip install --no-build-isolation .` in the "
                "pagedkv source tree builds it against the installed torch"
            ) from error
        built = record["TORCH_VERSION"] if record else "an unrecorded torch"
        raise ImportError(
            f"pagedkv._C failed to load ({error}); it was built for {built}, torch {torch.__version__} is installed; "
            + REBUILD.format(minor=_minor(torch.__version__))
        ) from error


# ---------------------------------------------------------------- CPU kernel paths


def _cpu_flags() -> Optional[set]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _extension_library():
    from . import _C

    return ctypes.CDLL(_C.__file__)


def cpu_kernel_in_use() -> str:
    """The CPU kernel table the extension's dispatcher chose for this process (its `name` field)."""
    get = _extension_library().pkv_cpu_kernels_get
    get.restype = ctypes.POINTER(ctypes.c_char_p)  # the table starts with `const char *name`
    return get().contents.value.decode()


def cpu_kernels_available(flags: Optional[set] = None, compiled: Optional[list] = None) -> list:
    """The CPU kernel paths compiled into the extension that this CPU can run, in dispatch order.

    flags: the CPU's /proc/cpuinfo flags (None: read them; unreadable: only the paths up to the one in
    use are known to run). compiled: paths the extension holds (None: look its tables up)."""
    if compiled is None:
        library = _extension_library()
        compiled = [name for name, _ in CPU_KERNEL_FLAGS if hasattr(library, f"pkv_cpu_kernels_{name}")]
    if flags is None:
        flags = _cpu_flags()
    names = [name for name, _ in CPU_KERNEL_FLAGS]
    if flags is None:
        runnable = names[: names.index(cpu_kernel_in_use()) + 1]
    else:
        runnable = []
        for name, needs in CPU_KERNEL_FLAGS:
            if not set(needs) <= flags:
                break
            runnable.append(name)
    return [name for name in runnable if name in compiled]


# ---------------------------------------------------------------- the report


def build_info() -> dict:
    """This install in one dict: what the extension was built against, what runs it, which kernels."""
    from . import _C

    record = _record() or {}
    library = _extension_library()
    return {
        "pagedkv": sys.modules["pagedkv"].__version__,
        "package_dir": os.path.dirname(os.path.abspath(__file__)),
        "extension": _C.__file__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_built_against": record.get("TORCH_VERSION"),  # None: built before build records existed
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "build_mode": record.get("BUILD_MODE"),
        "build_reason": record.get("BUILD_REASON"),
        "with_cuda": bool(_C.with_cuda),
        "cuda_toolkit": record.get("CUDA_TOOLKIT_VERSION"),
        "cuda_archs": list(record.get("CUDA_ARCHS", ())),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
        "cpu_kernels_available": cpu_kernels_available(),
        "cpu_kernel_in_use": cpu_kernel_in_use(),
        "cpu_bf16_dot_products": bool(library.pkv_cpu_has_dot_bf16()),
        # AVX512_VBMI byte lookups: FP8 rows widened to bf16 in registers for the bf16 dot products
        "cpu_fp8_byte_lookups": bool(library.pkv_cpu_has_vbmi()),
        "PAGEDKV_CPU_ISA": os.environ.get("PAGEDKV_CPU_ISA"),
        # pagedkv.kernel_options(): the process-wide options (host checks, forced paths, opt-ins)
        "kernel_options": importlib.import_module(".ops", __package__).kernel_options(),
    }
