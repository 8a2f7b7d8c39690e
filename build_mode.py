"""Build decisions for setup.py, kept free of torch and setuptools so tests can drive them with
fake directory trees and environments: which torch the build may use, whether the CUDA toolkit is
complete, CPU or CUDA extension, and the torch pin of the wheel's metadata.

setup.py loads this file by path (it is not part of the installed package).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Callable, Mapping, Optional, Sequence

MODES = ("auto", "cpu", "cuda")
# setup.py commands that compile the extension or write metadata pinned to a torch version: these
# need the torch the extension will run with (egg_info and sdist do not, so an sdist builds without).
TORCH_COMMANDS = frozenset(
    {"build", "build_ext", "build_clib", "bdist_wheel", "bdist_egg", "install", "develop", "editable_wheel"}
    | {"dist_info"}
)
# the same fix for every way pip or build hides the environment's torch
NO_ISOLATION_HINT = (
    "run the same command without build isolation, e.g. `pip install --no-build-isolation .` "
    "(or `python -m build --wheel --no-isolation`)"
)


# The oldest torch the extension is built and tested with (scripts/test.sh: 2.13 in the main stages, the
# newest release on PyPI in the "newest torch" stage). Older torches are refused before anything compiles.
MIN_TORCH = (2, 13)


class BuildConfigError(Exception):
    """A build that cannot work as configured; the message says what is missing and what to do."""


@dataclasses.dataclass(frozen=True)
class CudaToolkit:
    home: str
    nvcc: str
    version: Optional[str]  # "13.0" from include/cuda.h, None when unreadable


@dataclasses.dataclass(frozen=True)
class BuildChoice:
    with_cuda: bool
    toolkit: Optional[CudaToolkit]
    reason: str  # why this choice, one line (printed for auto builds that fall back to CPU)


def check_torch_floor(torch_version: str) -> None:
    """BuildConfigError when torch_version ("2.12.1+cpu") is older than MIN_TORCH."""
    numbers = []
    for piece in torch_version.split("+")[0].split(".")[:2]:
        match = re.match(r"\d+", piece)
        numbers.append(int(match.group()) if match else 0)
    if tuple(numbers) < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise BuildConfigError(
            f"pagedkv needs torch >= {floor} (the oldest release it is built and tested with); this build sees "
            f"torch {torch_version}. Install a newer torch first (e.g. `pip install 'torch>={floor}'`), then build "
            "again with `pip install --no-build-isolation .`"
        )


def needs_torch(commands: Sequence[str]) -> bool:
    return any(c in TORCH_COMMANDS for c in commands)


def torch_requirement(torch_version: Optional[str]) -> str:
    """The wheel's pin: same major.minor as the torch the extension was built against (its C++ ABI)."""
    if torch_version is None:
        return "torch"
    major, minor = torch_version.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"


# ---------------------------------------------------------------- which torch


def installed_torch(site_dirs: Sequence[str]) -> Optional[tuple[str, str]]:
    """(version, site dir) of the first torch distribution found in site_dirs, in order."""
    for d in site_dirs:
        for info in sorted(glob.glob(os.path.join(d, "torch-*.dist-info"))):
            version = os.path.basename(info)[len("torch-") : -len(".dist-info")]
            return version, d
    return None


def _under(path: str, roots: Sequence[str]) -> bool:
    path = os.path.realpath(path)
    for root in roots:
        root = os.path.realpath(root)
        if path == root or path.startswith(root + os.sep):
            return True
    return False


def check_build_torch(
    torch_version: Optional[str],
    torch_path: Optional[str],
    site_dirs: Sequence[str],
    own_roots: Sequence[str],
) -> None:
    """Refuse, before anything compiles, a build that cannot be against the torch it will run with.

    torch_version/torch_path: the torch this build imports (None when it cannot import one).
    site_dirs: the installing environment's site-packages, in priority order.
    own_roots: folders whose torch is the environment's own (sys.prefix, PYTHONPATH entries, user
    site); pip's isolated build overlay (a temporary folder) is none of these.
    """
    env_torch = installed_torch(site_dirs)
    if torch_version is None:
        if env_torch is not None:
            raise BuildConfigError(
                f"pagedkv: this build cannot see the torch installed in {env_torch[1]} (torch {env_torch[0]}), "
                "and pagedkv's extension must be built against it: pip's build isolation hides it. "
                f"To install, {NO_ISOLATION_HINT}."
            )
        # (python -m build's isolated venv is the only environment this build can see: say both fixes)
        raise BuildConfigError(
            "pagedkv: building the extension needs the torch it will run with, and this build environment has "
            "none. If torch is installed where pagedkv goes, the build is isolated from it: run "
            "`pip install --no-build-isolation .` (or `python -m build --wheel --no-isolation`); otherwise install "
            "torch first (e.g. `pip install torch`), then run that."
        )
    check_torch_floor(torch_version)
    if env_torch is not None and env_torch[0] != torch_version and not _under(torch_path, own_roots):
        raise BuildConfigError(
            f"pagedkv: this build sees torch {torch_version} from {os.path.dirname(torch_path)} (a build "
            f"environment), but torch {env_torch[0]} is installed in {env_torch[1]}; an extension built against "
            f"the first would not load with the second. To install, {NO_ISOLATION_HINT}."
        )


# ---------------------------------------------------------------- CUDA toolkit


def cuda_version_of(home: str) -> Optional[str]:
    """Toolkit version from include/cuda.h (`#define CUDA_VERSION 13000` -> "13.0"), without running nvcc."""
    try:
        with open(os.path.join(home, "include", "cuda.h"), errors="replace") as f:
            match = re.search(r"^#define\s+CUDA_VERSION\s+(\d+)", f.read(), re.MULTILINE)
    except OSError:
        return None
    if not match:
        return None
    number = int(match.group(1))
    return f"{number // 1000}.{number % 1000 // 10}"


def toolkit_problem(home: str) -> Optional[str]:
    """What a CUDA build lacks under home (None when nvcc and the runtime headers are both there)."""
    if not os.path.isdir(home):
        return "no such directory"
    missing = [
        rel
        for rel, ok in (
            ("bin/nvcc", os.access(os.path.join(home, "bin", "nvcc"), os.X_OK)),
            ("include/cuda_runtime.h", os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))),
        )
        if not ok
    ]
    return "missing " + " and ".join(missing) if missing else None


DEFAULT_CUDA_HOME = "/usr/local/cuda"


def toolkit_candidates(
    environ: Mapping[str, str], which: Callable[[str], Optional[str]], default_home: str = DEFAULT_CUDA_HOME
) -> list[tuple[str, str]]:
    """(description, folder) in the order users expect: CUDA_HOME alone when set (an explicit choice is not
    second-guessed), else /usr/local/cuda, then the folder above the nvcc on PATH (and above the file
    it links to, when that differs)."""
    if environ.get("CUDA_HOME"):
        return [(f"CUDA_HOME={environ['CUDA_HOME']}", environ["CUDA_HOME"])]
    found = [(default_home, default_home)]
    nvcc = which("nvcc")
    if nvcc:
        for path in (nvcc, os.path.realpath(nvcc)):
            home = os.path.dirname(os.path.dirname(os.path.abspath(path)))
            if home not in (h for _, h in found):
                found.append((f"nvcc on PATH ({path}) -> {home}", home))
    else:
        found.append(("nvcc on PATH", ""))
    return found


def find_cuda_toolkit(
    environ: Mapping[str, str], which: Callable[[str], Optional[str]], default_home: str = DEFAULT_CUDA_HOME
) -> tuple[Optional[CudaToolkit], list[str]]:
    """The first complete toolkit among the candidates, and one note per candidate rejected."""
    notes = []
    for description, home in toolkit_candidates(environ, which, default_home):
        problem = toolkit_problem(home) if home else "not found"
        if problem is None:
            return CudaToolkit(home, os.path.join(home, "bin", "nvcc"), cuda_version_of(home)), notes
        notes.append(f"{description}: {problem}")
    return None, notes


def choose_build(
    mode: str,
    torch_version: str,
    torch_cuda: Optional[str],
    environ: Mapping[str, str],
    which: Callable[[str], Optional[str]],
    default_home: str = DEFAULT_CUDA_HOME,
) -> BuildChoice:
    """CPU or CUDA extension. auto: CUDA only with a CUDA torch and a complete toolkit of the same CUDA
    major version; cuda: the same conditions, or BuildConfigError naming what is missing; cpu: CPU."""
    if mode not in MODES:
        raise BuildConfigError(f"PAGEDKV_BUILD must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "cpu":
        return BuildChoice(False, None, "PAGEDKV_BUILD=cpu")
    if torch_cuda is None:
        if mode == "cuda":
            raise BuildConfigError(
                f"PAGEDKV_BUILD=cuda needs a CUDA build of torch; torch {torch_version} has none (torch.version.cuda "
                "is None)"
            )
        return BuildChoice(False, None, f"torch {torch_version} is a CPU-only build")
    toolkit, notes = find_cuda_toolkit(environ, which, default_home)
    problem = None
    if toolkit is None:
        problem = "no complete CUDA toolkit (bin/nvcc and include/cuda_runtime.h in one folder): " + "; ".join(notes)
    elif toolkit.version is not None and toolkit.version.split(".")[0] != torch_cuda.split(".")[0]:
        problem = (
            f"the CUDA toolkit in {toolkit.home} is {toolkit.version}, torch {torch_version} was built with CUDA "
            f"{torch_cuda} (the major versions must match)"
        )
    if problem is None:
        return BuildChoice(True, toolkit, f"torch CUDA {torch_cuda}, toolkit {toolkit.version} in {toolkit.home}")
    if mode == "cuda":
        raise BuildConfigError(f"PAGEDKV_BUILD=cuda: {problem}. Set CUDA_HOME to a complete toolkit.")
    return BuildChoice(False, None, problem + "; set CUDA_HOME to build the CUDA kernels")


# ---------------------------------------------------------------- the build record


def build_config_source(
    torch_version: str,
    torch_cuda: Optional[str],
    choice: BuildChoice,
    cuda_archs: Sequence[str],
    mode: str,
) -> str:
    """Text of python/pagedkv/_build_config.py, written next to the built extension."""
    archs = tuple(cuda_archs) if choice.with_cuda else ()
    values = {
        "TORCH_VERSION": torch_version,
        "TORCH_CUDA_VERSION": torch_cuda,
        "WITH_CUDA": choice.with_cuda,
        "CUDA_TOOLKIT_VERSION": choice.toolkit.version if choice.with_cuda else None,
        "CUDA_ARCHS": archs,
        "BUILD_MODE": mode,
        "BUILD_REASON": choice.reason,
    }
    lines = ["# Written by setup.py when pagedkv._C was built (not tracked by git): what it was built against."]
    lines += [f"{name} = {value!r}" for name, value in values.items()]
    return "\n".join(lines) + "\n"
