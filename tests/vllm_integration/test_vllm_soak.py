"""vLLM's OpenAI server with pagedkv attention under a minute of load and faults (benchmarks/soak_vllm_server.py).

The soak driver starts the server on 127.0.0.1 with a KV pool of 1024 tokens, takes each distinct prompt's
answer alone, then runs 12 streaming clients for 60 s (mixed prompt and output lengths, a fifth of them
dropping the connection mid-answer, requests preempted when the pool runs out). Every answer must equal
its prompt's solo answer token for token (a dropped one: the prefix it got), the server must log no error
and never stall, the engine must end with no KV block in use and no request running or waiting, and the
server's resident memory must not grow after warm-up by more than the driver's bound. The timings it
reports are not asserted (benchmarks/results has the 10-minute run beside vLLM's own backend).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

_vllm_spec = importlib.util.find_spec("vllm")
if _vllm_spec is None or _vllm_spec.origin is None:
    pytest.skip("vLLM is not installed in this environment: scripts/test_vllm.sh builds one and runs these tests",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import soak_vllm_server  # noqa: E402

MODEL = os.environ.get("PAGEDKV_VLLM_MODEL")


@pytest.mark.skipif(not MODEL, reason="PAGEDKV_VLLM_MODEL (tests/vllm_integration/write_hf_model.py) is not set")
def test_openai_server_soak_with_disconnects_and_preemption(tmp_path):
    command = [sys.executable, soak_vllm_server.__file__, "--model", MODEL, "--quick", "--backends", "pagedkv",
               "--prompts", "8", "--results-dir", str(tmp_path), "--name", "soak", "--log-dir", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    output = run.stdout + run.stderr
    assert os.path.exists(tmp_path / "soak.json"), (
        f"the soak driver wrote no results ({run.returncode}):\n{output[-6000:]}")
    with open(tmp_path / "soak.json") as f:
        (result,) = json.load(f)["results"]
    by_status = result["by_status"]
    # the load ran what it must exercise
    assert by_status.get("completed", 0) > 0 and by_status.get("disconnected", 0) > 0, by_status
    assert result["preemptions"] > 0, "the pool did not run out: nothing was preempted"
    assert result["prefix_cache_hits"] > 0
    assert result["backend_log_line"], "the server did not run pagedkv's attention backend"
    # and held up
    assert result["mismatches"] == [], result["mismatches"][:3]
    assert result["failures"] == [] and result["stall"] == [], (result["failures"][:3], result["stall"])
    assert result["server_error_lines"] == [], result["server_error_lines"][:5]
    assert result["probe"] == "completed"
    assert result["end_state"] == {"vllm:kv_cache_usage_perc": 0.0, "vllm:num_requests_running": 0.0,
                                   "vllm:num_requests_waiting": 0.0}
    assert result["rss"]["growth_after_warmup_mib"] <= soak_vllm_server.RSS_GROWTH_LIMIT_MIB, result["rss"]
    assert soak_vllm_server.problems(result) == []
    assert run.returncode == 0, output[-6000:]
