"""Install and build decisions, without running a compiler:

- build_mode.py (what setup.py decides): CUDA toolkit detection over fake directory trees (CUDA_HOME,
  then /usr/local/cuda, then nvcc's own folder; complete = bin/nvcc and include/cuda_runtime.h),
  CPU fallback reasons, forced-CUDA errors naming what is missing, the torch pin of the metadata, and
  the refusal of builds that cannot see the environment's torch (pip's build isolation);
- the build record and the import-time check (an extension built for another torch is an
  ImportError naming both versions and how to rebuild), end to end on a copy of the package;
- pagedkv.build_info() against the C dispatcher, and `python -m pagedkv` (report and self-test).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import pagedkv
from pagedkv import _C
from pagedkv import __main__ as cli
from pagedkv import build_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_build_mode():
    spec = importlib.util.spec_from_file_location("pagedkv_build_mode_under_test", os.path.join(ROOT, "build_mode.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bm = load_build_mode()


def fake_toolkit(home, version=13000, nvcc=True, header=True):
    """A CUDA toolkit tree: bin/nvcc (executable), include/cuda_runtime.h, include/cuda.h with CUDA_VERSION."""
    os.makedirs(os.path.join(home, "bin"), exist_ok=True)
    os.makedirs(os.path.join(home, "include"), exist_ok=True)
    if nvcc:
        path = os.path.join(home, "bin", "nvcc")
        with open(path, "w") as f:
            f.write("#!/bin/sh\nexit 1\n")
        os.chmod(path, 0o755)
    if header:
        open(os.path.join(home, "include", "cuda_runtime.h"), "w").close()
    with open(os.path.join(home, "include", "cuda.h"), "w") as f:
        f.write(f"#ifndef CUDA_H\n#define CUDA_VERSION {version}\n#endif\n")
    return str(home)


def which_from(mapping):
    return lambda name: mapping.get(name)


NO_NVCC = which_from({})

# ---------------------------------------------------------------- toolkit detection


def test_cuda_home_wins_and_version_is_read(tmp_path):
    home = fake_toolkit(tmp_path / "cuda-12.8", version=12080)
    default = fake_toolkit(tmp_path / "default")
    toolkit, notes = bm.find_cuda_toolkit({"CUDA_HOME": home}, NO_NVCC, default)
    assert toolkit == bm.CudaToolkit(home, os.path.join(home, "bin", "nvcc"), "12.8")
    assert notes == []


def test_incomplete_cuda_home_is_not_second_guessed(tmp_path):
    home = fake_toolkit(tmp_path / "partial", header=False)
    default = fake_toolkit(tmp_path / "default")
    toolkit, notes = bm.find_cuda_toolkit({"CUDA_HOME": home}, NO_NVCC, default)
    assert toolkit is None
    assert notes == [f"CUDA_HOME={home}: missing include/cuda_runtime.h"]


def test_default_home_before_nvcc_on_path(tmp_path):
    # this machine's case: /usr/local/bin/nvcc is a wrapper script whose folder has no headers
    wrapper_home = tmp_path / "usr_local"
    fake_toolkit(wrapper_home, header=False)
    default = fake_toolkit(tmp_path / "cuda")
    toolkit, _ = bm.find_cuda_toolkit({}, which_from({"nvcc": str(wrapper_home / "bin" / "nvcc")}), default)
    assert toolkit.home == default
    toolkit, notes = bm.find_cuda_toolkit({}, which_from({"nvcc": str(wrapper_home / "bin" / "nvcc")}),
                                          str(tmp_path / "absent"))
    assert toolkit is None
    assert notes == [
        f"{tmp_path / 'absent'}: no such directory",
        f"nvcc on PATH ({wrapper_home / 'bin' / 'nvcc'}) -> {wrapper_home}: missing include/cuda_runtime.h",
    ]


def test_nvcc_folder_and_the_folder_it_links_to(tmp_path):
    real = fake_toolkit(tmp_path / "cuda-13.0")
    os.makedirs(tmp_path / "bin")
    link = tmp_path / "bin" / "nvcc"
    os.symlink(os.path.join(real, "bin", "nvcc"), link)
    toolkit, notes = bm.find_cuda_toolkit({}, which_from({"nvcc": str(link)}), str(tmp_path / "absent"))
    assert toolkit.home == real and toolkit.version == "13.0"
    # the link itself runs nvcc, but its folder has no headers
    assert notes[0].endswith("no such directory")
    assert notes[1].endswith(f"-> {tmp_path}: missing include/cuda_runtime.h")


def test_missing_everything(tmp_path):
    toolkit, notes = bm.find_cuda_toolkit({}, NO_NVCC, str(tmp_path / "absent"))
    assert toolkit is None and notes == [f"{tmp_path / 'absent'}: no such directory", "nvcc on PATH: not found"]


def test_unreadable_version_is_none(tmp_path):
    home = fake_toolkit(tmp_path / "cuda")
    os.remove(os.path.join(home, "include", "cuda.h"))
    assert bm.find_cuda_toolkit({"CUDA_HOME": home}, NO_NVCC)[0].version is None


# ---------------------------------------------------------------- build mode


def test_auto_builds_cuda_only_with_cuda_torch_and_complete_toolkit(tmp_path):
    home = fake_toolkit(tmp_path / "cuda")
    env = {"CUDA_HOME": home}
    choice = bm.choose_build("auto", "2.14.1+cu130", "13.0", env, NO_NVCC)
    assert choice.with_cuda and choice.toolkit.home == home
    cpu_torch = bm.choose_build("auto", "2.13.0+cpu", None, env, NO_NVCC)
    assert not cpu_torch.with_cuda and cpu_torch.reason == "torch 2.13.0+cpu is a CPU-only build"
    assert not bm.choose_build("cpu", "2.14.1+cu130", "13.0", env, NO_NVCC).with_cuda


def test_auto_falls_back_to_cpu_naming_what_is_missing(tmp_path):
    home = fake_toolkit(tmp_path / "cuda", header=False)
    choice = bm.choose_build("auto", "2.14.1+cu130", "13.0", {"CUDA_HOME": home}, NO_NVCC)
    assert not choice.with_cuda
    assert f"CUDA_HOME={home}: missing include/cuda_runtime.h" in choice.reason and "\n" not in choice.reason
    mismatch = bm.choose_build("auto", "2.14.1+cu130", "13.0", {"CUDA_HOME": fake_toolkit(tmp_path / "old", 12080)},
                               NO_NVCC)
    assert not mismatch.with_cuda and "is 12.8" in mismatch.reason and "CUDA 13.0" in mismatch.reason


def test_forced_cuda_fails_at_once_naming_what_is_missing(tmp_path):
    home = fake_toolkit(tmp_path / "cuda", nvcc=False)
    with pytest.raises(bm.BuildConfigError, match=r"PAGEDKV_BUILD=cuda: .*missing bin/nvcc"):
        bm.choose_build("cuda", "2.14.1+cu130", "13.0", {"CUDA_HOME": home}, NO_NVCC)
    with pytest.raises(bm.BuildConfigError, match=r"needs a CUDA build of torch; torch 2.13.0\+cpu has none"):
        bm.choose_build("cuda", "2.13.0+cpu", None, {"CUDA_HOME": fake_toolkit(tmp_path / "ok")}, NO_NVCC)
    with pytest.raises(bm.BuildConfigError, match="major versions must match"):
        bm.choose_build("cuda", "2.14.1+cu130", "13.0", {"CUDA_HOME": fake_toolkit(tmp_path / "old", 12080)}, NO_NVCC)
    with pytest.raises(bm.BuildConfigError, match="PAGEDKV_BUILD must be one of auto, cpu, cuda, got 'gpu'"):
        bm.choose_build("gpu", "2.13.0+cpu", None, {}, NO_NVCC)


def test_metadata_pins_the_torch_built_against():
    assert bm.torch_requirement("2.13.0+cpu") == "torch==2.13.*"
    assert bm.torch_requirement("2.14.1") == "torch==2.14.*"
    assert bm.torch_requirement(None) == "torch"  # an sdist, built without torch


def test_only_building_commands_need_torch():
    assert not bm.needs_torch(["egg_info"]) and not bm.needs_torch(["sdist", "--formats", "gztar"])
    for command in ("bdist_wheel", "build_ext", "editable_wheel", "dist_info", "develop", "install"):
        assert bm.needs_torch([command, "--dist-dir", "x"])


# ---------------------------------------------------------------- which torch the build may use


def fake_site(path, torch_version=None):
    os.makedirs(path, exist_ok=True)
    if torch_version:
        os.makedirs(os.path.join(path, f"torch-{torch_version}.dist-info"))
    return str(path)


def test_isolated_build_without_torch_says_what_to_run(tmp_path):
    env_site = fake_site(tmp_path / "venv" / "site-packages", "2.13.0+cpu")
    with pytest.raises(bm.BuildConfigError) as error:
        bm.check_build_torch(None, None, [env_site], [str(tmp_path / "venv")])
    message = str(error.value)
    assert "torch 2.13.0+cpu" in message and env_site in message
    assert "`pip install --no-build-isolation .`" in message and "\n" not in message
    with pytest.raises(bm.BuildConfigError, match=r"environment has none.*`pip install --no-build-isolation \.`"):
        bm.check_build_torch(None, None, [fake_site(tmp_path / "empty")], [])


def test_build_environment_torch_other_than_the_environment_one_is_refused(tmp_path):
    env_site = fake_site(tmp_path / "venv" / "site-packages", "2.13.0+cpu")
    overlay_torch = tmp_path / "pip-build-env-x" / "overlay" / "torch" / "__init__.py"
    with pytest.raises(bm.BuildConfigError, match=r"torch 2\.14\.1\+cu130 from .*but torch 2\.13\.0\+cpu is installed"):
        bm.check_build_torch("2.14.1+cu130", str(overlay_torch), [env_site], [str(tmp_path / "venv")])
    # the environment's own torch (or one it puts first on PYTHONPATH) builds
    bm.check_build_torch("2.13.0+cpu", os.path.join(env_site, "torch", "__init__.py"), [env_site],
                         [str(tmp_path / "venv")])
    deps = tmp_path / "deps"
    bm.check_build_torch("2.14.1", str(deps / "torch" / "__init__.py"), [env_site], [str(tmp_path / "venv"), str(deps)])


def test_torch_older_than_the_floor_is_refused_before_compiling(tmp_path):
    env_site = fake_site(tmp_path / "venv" / "site-packages", "2.12.1+cpu")
    with pytest.raises(bm.BuildConfigError) as error:
        bm.check_build_torch("2.12.1+cpu", os.path.join(env_site, "torch", "__init__.py"), [env_site],
                             [str(tmp_path / "venv")])
    message = str(error.value)
    assert "torch >= 2.13" in message and "torch 2.12.1+cpu" in message and "\n" not in message
    for version in ("2.13.0+cpu", "2.14.1", "2.15.0+cu132", "2.16.0.dev20261201+cpu", "3.0.0"):
        bm.check_torch_floor(version)
    with pytest.raises(bm.BuildConfigError, match=r"torch 1\.13\.1"):
        bm.check_torch_floor("1.13.1")


def test_first_site_dir_with_torch_is_the_environment_one(tmp_path):
    first = fake_site(tmp_path / "venv", "2.13.0+cpu")
    system = fake_site(tmp_path / "system", "2.12.0")
    assert bm.installed_torch([fake_site(tmp_path / "none"), first, system]) == ("2.13.0+cpu", first)


# ---------------------------------------------------------------- build record and import-time check


def record_values(text):
    values = {}
    exec(text, values)
    return {k: v for k, v in values.items() if k.isupper()}


def test_build_record_round_trip(tmp_path):
    choice = bm.BuildChoice(True, bm.CudaToolkit("/opt/cuda", "/opt/cuda/bin/nvcc", "13.0"), "why")
    record = record_values(bm.build_config_source("2.14.1+cu130", "13.0", choice, ["sm_80", "sm_90a"], "auto"))
    assert record == {
        "TORCH_VERSION": "2.14.1+cu130", "TORCH_CUDA_VERSION": "13.0", "WITH_CUDA": True,
        "CUDA_TOOLKIT_VERSION": "13.0",
        "CUDA_ARCHS": ("sm_80", "sm_90a"), "BUILD_MODE": "auto", "BUILD_REASON": "why",
    }  # fmt: skip
    assert build_report.build_mismatch(record, "2.14.0+cu130", "13.0") is None  # patch releases share the ABI
    assert build_report.build_mismatch(record, "2.14.1+cu128", "12.8").startswith(
        "pagedkv's extension was built for torch 2.14.1+cu130 with CUDA 13.0, but torch 2.14.1+cu128 uses CUDA 12.8"
    )
    cpu_torch = build_report.build_mismatch(record, "2.14.1+cpu", None)
    assert "built with CUDA kernels" in cpu_torch and "CPU-only" in cpu_torch
    cpu_choice = bm.BuildChoice(False, None, "cpu")
    cpu = record_values(bm.build_config_source("2.13.0+cpu", None, cpu_choice, ["sm_80"], "auto"))
    assert cpu["CUDA_ARCHS"] == () and cpu["WITH_CUDA"] is False
    assert build_report.build_mismatch(cpu, "2.13.1+cu130", "13.0") is None  # CPU kernels run on a CUDA torch
    other = build_report.build_mismatch(cpu, "2.14.1+cu130", "13.0")
    assert other.startswith("pagedkv's extension was built for torch 2.13.0+cpu, but torch 2.14.1+cu130 is installed")
    assert "pip install --no-build-isolation" in other and "torch 2.14" in other


def test_extension_built_for_another_torch_is_an_import_error(tmp_path):
    """A copy of the package whose build record names torch 2.5.1: `import pagedkv` must stop before
    the extension loads, naming both torches and the rebuild command."""
    package = tmp_path / "pagedkv"
    shutil.copytree(os.path.dirname(pagedkv.__file__), package, ignore=shutil.ignore_patterns("__pycache__"))
    choice = bm.BuildChoice(False, None, "test")
    (package / "_build_config.py").write_text(bm.build_config_source("2.5.1", None, choice, [], "auto"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    code = "import pagedkv"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: pagedkv's extension was built for torch 2.5.1, but torch "
                           f"{torch.__version__} is installed; rebuild pagedkv against the installed torch"), last


# ---------------------------------------------------------------- build_info and python -m pagedkv


def test_cpu_kernels_available_follows_the_dispatch_order():
    amx = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi", "amx_bf16",
           "amx_tile"}
    every = ["scalar", "avx2", "avx512", "amx"]
    assert build_report.cpu_kernels_available(amx, every) == every
    assert build_report.cpu_kernels_available({"avx2", "fma", "f16c", "avx512f"}, every) == ["scalar", "avx2"]
    assert build_report.cpu_kernels_available({"avx2", "fma"}, every) == ["scalar"]  # no f16c
    assert build_report.cpu_kernels_available(amx, ["scalar"]) == ["scalar"]  # what was compiled (non-x86 build)


def test_build_info_matches_this_process():
    info = pagedkv.build_info()
    assert info["torch"] == torch.__version__ and info["with_cuda"] == bool(_C.with_cuda)
    assert info["extension"] == _C.__file__
    if info["torch_built_against"] is not None:  # a build with a record (every build by this setup.py)
        assert build_report.build_mismatch({"TORCH_VERSION": info["torch_built_against"], "WITH_CUDA": False},
                                           torch.__version__, None) is None
        assert info["build_mode"] in ("auto", "cpu", "cuda")
        assert bool(info["cuda_archs"]) == info["with_cuda"]
    available = info["cpu_kernels_available"]
    assert available[0] == "scalar"
    # the C dispatcher's choice is the best path this CPU has (unless PAGEDKV_CPU_ISA caps it, or Linux
    # refuses the AMX tile state, in which case it runs AVX-512)
    if not os.environ.get("PAGEDKV_CPU_ISA"):
        assert info["cpu_kernel_in_use"] == available[-1] or (available[-1], info["cpu_kernel_in_use"]) == (
            "amx", "avx512")
    # the FP8 byte lookups need an AVX-512 table and VBMI in cpuid (what /proc/cpuinfo lists on Linux)
    if info["cpu_kernel_in_use"] in ("scalar", "avx2"):
        assert not info["cpu_fp8_byte_lookups"] and not info["cpu_bf16_dot_products"]
    elif os.path.exists("/proc/cpuinfo"):
        flags = set(open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split())
        assert info["cpu_fp8_byte_lookups"] == ("avx512vbmi" in flags)


def test_python_m_pagedkv_reports_and_self_tests_a_capped_isa(tmp_path):
    env = dict(os.environ, PAGEDKV_CPU_ISA="scalar", PYTHONPATH=os.path.dirname(os.path.dirname(pagedkv.__file__)))
    done = subprocess.run([sys.executable, "-m", "pagedkv", "--json"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["cpu_kernel_in_use"] == "scalar" and report["PAGEDKV_CPU_ISA"] == "scalar"
    assert report["torch"] == torch.__version__
    ops = [(t["op"], t["ok"]) for t in report["self_test"]["cpu"]]
    assert ops == [("paged_store", True), ("paged_load", True), ("flash_attn_paged", True)]


def test_self_test_catches_a_broken_op(monkeypatch):
    assert all(ok for _, ok, _ in cli.self_test("cpu"))
    monkeypatch.setattr(pagedkv, "paged_store", lambda *args, **kwargs: None)
    results = {name: (ok, detail) for name, ok, detail in cli.self_test("cpu")}
    assert results["paged_store"] == (False, "caches differ from the reference's")
    monkeypatch.setattr(pagedkv, "flash_attn_paged", lambda q, *args, **kwargs: torch.zeros_like(q))
    ok, detail = dict((n, (o, d)) for n, o, d in cli.self_test("cpu"))["flash_attn_paged"]
    assert not ok and detail.startswith("relative error 1.0e+00")


@pytest.mark.parametrize("value", ["AVX2", "avx-512", "bogus"])
def test_unknown_cpu_isa_cap_is_an_import_error(tmp_path, value):
    # the kernels take an unknown value as no cap: a typo in a per-ISA test run would test the best path
    env = dict(os.environ, PAGEDKV_CPU_ISA=value, PYTHONPATH=os.path.dirname(os.path.dirname(pagedkv.__file__)))
    done = subprocess.run([sys.executable, "-c", "import pagedkv"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0
    assert f"PAGEDKV_CPU_ISA must be one of scalar, avx2, avx512, amx or unset, got {value!r}" in done.stderr


def test_python_m_pagedkv_refuses_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--bogus"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
