"""pagedkv.hf registration with transformers and its supported / tested versions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hf_helpers import *  # noqa: F403  (transformers, pagedkv.hf as phf, ref and the shared helpers)


# ---- registration and versions ---------------------------------------------------------------


def test_registered_with_transformers():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[phf.IMPLEMENTATION] is phf.attention_forward
    assert phf.IMPLEMENTATION in AttentionMaskInterface._global_mapping
    phf.register()  # idempotent
    assert AttentionInterface._global_mapping[phf.IMPLEMENTATION] is phf.attention_forward


def test_installed_version_is_supported():
    assert phf.check_transformers_version() == transformers.__version__
    major = phf._version_tuple(transformers.__version__)[0]
    assert phf.transformers_continuous_batching_supported() == (major >= 5)


@pytest.mark.parametrize("version", ["4.40.2", "4.56.1", "3.5.1"])
def test_too_old_transformers_is_refused_by_name(version):
    with pytest.raises(RuntimeError, match=f">= 4.57.*installed transformers {version}"):
        phf.check_transformers_version(version)


@pytest.mark.parametrize("version", ["4.57.0", "4.57.0rc1", "4.57.6", "5.0.0", "5.24.0", "5.24.0.dev0"])
def test_supported_versions_pass(version):
    assert phf.check_transformers_version(version) == version


def test_missing_hook_is_named_with_the_version(monkeypatch):
    from transformers import modeling_utils

    monkeypatch.delattr(modeling_utils, "AttentionInterface")
    with pytest.raises(RuntimeError, match=f"transformers {transformers.__version__} lacks AttentionInterface"):
        phf.check_transformers_version()


@pytest.mark.parametrize("version", [*phf.TESTED_VERSIONS, "4.58.0", "5.24.9"])
def test_tested_lines_import_quietly(version):
    """Every tested transformers line, and patch releases of it or of an older supported line, import
    without a warning (the suite runs on both tested lines: scripts/test.sh)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat._warn_if_untested(version)


@pytest.mark.parametrize("version", ["5.25.0", "6.0.0.dev0"])
def test_a_newer_line_warns_naming_the_tested_versions(version):
    tested = " and ".join(phf.TESTED_VERSIONS)  # two lines tested
    with pytest.warns(UserWarning, match=f"tested with transformers {tested}; installed {re.escape(version)} is newer"):
        compat._warn_if_untested(version)


def test_newer_line_warning_is_emitted_once_at_the_import():
    """Importing pagedkv.hf under a newer transformers warns once per process (importing it again,
    registering again: no new warning, even with every warning shown), at the line that imports it."""
    script = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "import transformers\n"
        "transformers.__version__ = '99.1.0'\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import pagedkv.hf\n"
        "    import importlib; importlib.import_module('pagedkv.hf')\n"
        "    pagedkv.hf.register()\n"
        "for warning in caught:\n"
        "    print(warning.filename, warning.lineno, warning.message)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONWARNINGS": "always"})
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "pagedkv.hf was tested" in line]
    tested = " and ".join(phf.TESTED_VERSIONS)
    assert lines == [f"<string> 7 pagedkv.hf was tested with transformers {tested}; installed 99.1.0 is newer. "
                     "Models whose code pagedkv cannot serve are refused by name (pagedkv.hf.UnsupportedModelError "
                     "or a ValueError at construction); any other failure with attn_implementation='pagedkv' is a "
                     "pagedkv bug"], result.stdout
