"""pagedkv as vLLM's attention backend (pagedkv.vllm): vLLM's own CPU backend is the oracle.

SmolLM2-135M runs through ``vllm.LLM`` (tests/vllm_integration/vllm_generate.py, one process per backend,
model and dtype) with chunked prefill mixed with decodes and prefix caching on: float32 tokens must
equal vLLM's own CPU backend at block sizes 16 and 128, bfloat16 must agree within a logprob
tolerance, and the OpenAI-compatible server (with an FP8 cache) must answer as the offline run does.
FP8 caches (kv_cache_dtype fp8, fp8_e4m3, fp8_e5m2) run a random tiny Llama and attention sinks a
random tiny gpt-oss, each against vLLM's own CPU backend with the same cache dtype. The backend's
forward is also checked directly against a dense attention written from vLLM's semantics (GQA,
sliding window, softcap, sinks, FP8 codes as vLLM's CPU writer makes them, padding rows, pages
shared by two sequences).

scripts/test_vllm.sh builds the environment (vLLM's CPU build + pagedkv) and the model folder;
elsewhere these tests skip.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

_vllm_spec = importlib.util.find_spec("vllm")
# origin None: a namespace package, i.e. some folder named vllm on sys.path, not vLLM
if _vllm_spec is None or _vllm_spec.origin is None:
    pytest.skip("vLLM is not installed in this environment: scripts/test_vllm.sh builds one and runs these tests",
                allow_module_level=True)

from vllm import _custom_ops as vllm_ops  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from pagedkv.vllm_backend import (  # noqa: E402
    FP8_KV_CACHE_DTYPES,
    PagedKVAttentionBackend,
    PagedKVAttentionImpl,
    PagedKVMetadataBuilder,
)

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.environ.get("PAGEDKV_VLLM_MODEL")
needs_model = pytest.mark.skipif(
    not MODEL, reason="PAGEDKV_VLLM_MODEL (a Hugging Face folder: tests/vllm_integration/write_hf_model.py) is not set"
)
BACKEND_LOG_LINE = "pagedkv attention backend"
REFERENCE_BLOCK_SIZE = 128  # vLLM's CPU backend takes multiples of 32 only
# bfloat16 keeps 8 significant bits: a logit of magnitude up to 32 is resolved to 32 * 2^-8 = 0.125.
# Two such roundings (the backends round at different points) bound a logprob difference.
BF16_LOGPROB_TOLERANCE = 2 * 32 * 2.0**-8


def run_generate(tmp_dir, pagedkv: bool, dtype: str, block_sizes: tuple, kv_cache_dtypes: tuple,
                 tensor_parallel_size: int = 1, model: str | None = None) -> dict:
    """One process, one engine per (block size, KV cache dtype): {(block_size, kv_cache_dtype): run}."""
    name = (f"{'pagedkv' if pagedkv else 'vllm'}-{dtype}-bs{'_'.join(map(str, block_sizes))}-"
            f"{'_'.join(kv_cache_dtypes)}-tp{tensor_parallel_size}-{os.path.basename(model or MODEL)}")
    out = os.path.join(tmp_dir, name + ".json")
    env = dict(os.environ, PAGEDKV_VLLM="1" if pagedkv else "0")
    command = [sys.executable, os.path.join(HERE, "vllm_generate.py"), "--model", model or MODEL, "--dtype", dtype,
               "--block-size", *map(str, block_sizes), "--kv-cache-dtype", *kv_cache_dtypes,
               "--tensor-parallel-size", str(tensor_parallel_size), "--out", out]
    if model:  # the random models have no tokenizer
        command.append("--token-prompts")
    if tensor_parallel_size > 1:
        # vLLM's CPU workers bind their OpenMP threads; with one NUMA node it needs one core list per rank
        cores = sorted(os.sched_getaffinity(0))[:tensor_parallel_size]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in cores)
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"{name} failed:\n{log[-6000:]}"
    with open(out) as f:
        runs = json.load(f)["runs"]
    return {(r["block_size"], r["kv_cache_dtype"]): dict(r, log=log) for r in runs}


@pytest.fixture(scope="session")
def generate(tmp_path_factory):
    """Runs each process once per test run (its engines start in turn, sharing vLLM's import).

    generate(pagedkv, dtype, block_sizes, kv_cache_dtypes, ...) -> {(block_size, kv_cache_dtype): run};
    tests that share runs ask with the same arguments.
    """
    results = {}
    tmp_dir = str(tmp_path_factory.mktemp("vllm_runs"))

    def get(pagedkv: bool, dtype: str, block_sizes: tuple, kv_cache_dtypes: tuple = ("auto",),
            tensor_parallel_size: int = 1, model: str | None = None):
        key = (pagedkv, dtype, tuple(block_sizes), tuple(kv_cache_dtypes), tensor_parallel_size, model)
        if key not in results:
            results[key] = run_generate(tmp_dir, *key)
        return results[key]

    return get


# SmolLM2 with pagedkv, one process: the 16-bit cache runs the float32 tests compare, the FP8 runs the
# block-size test's and the server test's offline answer.
SMOLLM2_PAGEDKV = dict(block_sizes=(16, 128), kv_cache_dtypes=("auto", "fp8"))


def token_ids(result):
    return [row["token_ids"] for row in result["completions"]]


@needs_model
@pytest.mark.parametrize("block_size", [16, 128])
def test_float32_tokens_identical_to_vllm_cpu_backend(generate, block_size):
    reference = generate(False, "float32", (REFERENCE_BLOCK_SIZE,))[(REFERENCE_BLOCK_SIZE, "auto")]
    ours = generate(True, "float32", **SMOLLM2_PAGEDKV)[(block_size, "auto")]
    assert BACKEND_LOG_LINE in ours["log"]
    assert BACKEND_LOG_LINE not in reference["log"], "without PAGEDKV_VLLM=1 vLLM must keep its own backend"
    assert token_ids(ours) == token_ids(reference)
    # vLLM resolves the backend's first layout (token-major pages); its own CPU backend keeps head-major ones
    preferred = PagedKVAttentionBackend.supported_kv_cache_layouts()[0].name
    assert f"Using {preferred} KV cache layout" in ours["log"]
    if block_size == 16:
        # the second round's prompts start with a first-round prompt's pages
        assert ours["prefix_cache_hits"] > 0


@needs_model
def test_fp8_cache_tokens_same_at_block_sizes_16_and_128(generate):
    # SmolLM2's 30 layers amplify float32 summation-order differences across FP8 rounding boundaries, so
    # vLLM's own backend is the oracle on the tiny models (below); here pagedkv's FP8 paging must not
    # depend on the page size (chunked prefill, prefix-cache hits at block 16)
    runs = generate(True, "float32", **SMOLLM2_PAGEDKV)
    assert "Using fp8 data type to store kv cache" in runs[(16, "fp8")]["log"]
    assert token_ids(runs[(16, "fp8")]) == token_ids(runs[(128, "fp8")])
    assert runs[(16, "fp8")]["prefix_cache_hits"] > 0


@needs_model
def test_bfloat16_within_logprob_tolerance(generate):
    reference = generate(False, "bfloat16", (REFERENCE_BLOCK_SIZE,))[(REFERENCE_BLOCK_SIZE, "auto")]
    ours = generate(True, "bfloat16", (REFERENCE_BLOCK_SIZE,))[(REFERENCE_BLOCK_SIZE, "auto")]
    assert BACKEND_LOG_LINE in ours["log"]
    for ref_row, our_row in zip(reference["completions"], ours["completions"], strict=True):
        for ref_token, our_token, ref_step, our_step in zip(
            ref_row["token_ids"], our_row["token_ids"], ref_row["logprobs"], our_row["logprobs"], strict=True
        ):
            if ref_token == our_token:
                difference = abs(ref_step[str(ref_token)] - our_step[str(our_token)])
                assert difference <= BF16_LOGPROB_TOLERANCE, (our_row["prompt"], ref_token, difference)
                continue
            # Rounding may only flip a near tie: each backend ranks the other's token (in its top 2)
            # within the tolerance of its own choice. After that the continuations differ.
            for step, chosen, other in ((ref_step, ref_token, our_token), (our_step, our_token, ref_token)):
                assert str(other) in step, (our_row["prompt"], "the other backend's token is not a runner-up")
                assert step[str(chosen)] - step[str(other)] <= BF16_LOGPROB_TOLERANCE, our_row["prompt"]
            break


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


@needs_model
def test_openai_server_answers_as_offline_run(generate, tmp_path):
    # the server runs an FP8 cache: its answer must be the offline engine's with the same cache dtype
    offline = generate(True, "float32", **SMOLLM2_PAGEDKV)[(16, "fp8")]
    sys.path.insert(0, HERE)
    import vllm_generate

    port = free_port()
    env = dict(os.environ, PAGEDKV_VLLM="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            # `vllm serve` runs this server; vllm-cpu's `vllm` command itself fails at start (it looks up
            # the version of a distribution named "vllm", and this one is "vllm-cpu")
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", "--block-size", "16", "--max-model-len", "512",
             "--enforce-eager", "--max-num-batched-tokens", "32", "--enable-prefix-caching", "--kv-cache-dtype", "fp8",
             "--kv-cache-memory-bytes",
             str(128 << 20), "--gpu-memory-utilization", "0.1", "--served-model-name", "smollm2"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, f"vllm serve exited:\n{log_path.read_text()[-6000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"vllm serve did not come up:\n{log_path.read_text()[-6000:]}"
            time.sleep(2)
        prompt = vllm_generate.FIRST_ROUND[0]
        answer = post_json(f"http://127.0.0.1:{port}/v1/completions", {
            "model": "smollm2", "prompt": prompt, "max_tokens": vllm_generate.MAX_NEW_TOKENS, "temperature": 0.0,
            "ignore_eos": True}, timeout=300)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert BACKEND_LOG_LINE in log_path.read_text()
    expected = next(row["text"] for row in offline["completions"] if row["prompt"] == prompt)
    assert answer["choices"][0]["text"] == expected


TINY_MODEL = os.environ.get("PAGEDKV_VLLM_TINY_MODEL")
# float32 resolves a logit of magnitude up to 64 to 64 * 2^-24 = 4e-6; splitting the head and MLP sums
# over two ranks reorders them in every layer, a few such roundings apiece.
TENSOR_PARALLEL_LOGPROB_TOLERANCE = 1e-4


@pytest.mark.skipif(not TINY_MODEL, reason="PAGEDKV_VLLM_TINY_MODEL (write_hf_model.py --random-tiny) is not set")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallelism on CPU needs a core per rank")
def test_tensor_parallel_two_ranks_identical_to_one(generate):
    # SmolLM2's 9 query / 3 KV heads do not split over 2 ranks; the tiny Llama's 4 / 2 do (one KV head per rank)
    single = generate(True, "float32", (16,), ("auto",), 1, TINY_MODEL)[(16, "auto")]
    split = generate(True, "float32", (16,), ("auto",), 2, TINY_MODEL)[(16, "auto")]
    assert BACKEND_LOG_LINE in split["log"]
    assert token_ids(split) == token_ids(single)
    for one, two in zip(single["completions"], split["completions"], strict=True):
        for step_one, step_two in zip(one["logprobs"], two["logprobs"], strict=True):
            for token, logprob in step_one.items():
                assert abs(logprob - step_two[token]) <= TENSOR_PARALLEL_LOGPROB_TOLERANCE


FP8_CACHE_DTYPES = tuple(FP8_KV_CACHE_DTYPES)  # fp8, fp8_e4m3, fp8_e5m2
# vLLM's CPU backend stores FP8 caches with AVX-512 (or AMX) only; pagedkv needs neither
vllm_cpu_fp8 = pytest.mark.skipif(not torch.cpu._is_avx512_supported(),
                                  reason="vLLM's CPU backend runs FP8 KV caches with AVX-512 or AMX only")
GPT_OSS_MODEL = os.environ.get("PAGEDKV_VLLM_GPT_OSS_MODEL")
# Two float32 attention kernels that sum in different orders: logprobs agree to ~1e-5 (measured: <= 9e-6
# with 16-bit caches, <= 5e-5 with FP8 ones, where such a difference may carry a value across an FP8
# rounding boundary and move its code a step). Codes rounded to nearest instead of toward zero, as
# vLLM's CPU writer does, move the tiny Llama's logprobs by 0.03-0.3; ignoring sinks changes gpt-oss's tokens.
FP8_LOGPROB_TOLERANCE = 1e-3


def assert_same_tokens_and_logprobs(reference, ours, tolerance):
    assert token_ids(ours) == token_ids(reference)
    for ref_row, our_row in zip(reference["completions"], ours["completions"], strict=True):
        for ref_step, our_step in zip(ref_row["logprobs"], our_row["logprobs"], strict=True):
            for token, logprob in ref_step.items():
                assert abs(logprob - our_step[token]) <= tolerance, (our_row["prompt"], token, logprob, our_step[token])


@pytest.mark.skipif(not TINY_MODEL, reason="PAGEDKV_VLLM_TINY_MODEL (write_hf_model.py --random-tiny) is not set")
@vllm_cpu_fp8
@pytest.mark.parametrize("kv_cache_dtype", FP8_CACHE_DTYPES)
@pytest.mark.parametrize("block_size", [16, 128])
def test_fp8_cache_tokens_identical_to_vllm_cpu_backend(generate, kv_cache_dtype, block_size):
    # float32 model, the same FP8 codes (the backend writes what vLLM's CPU writer writes, per-tensor scales)
    reference = generate(False, "float32", (REFERENCE_BLOCK_SIZE,), FP8_CACHE_DTYPES,
                         model=TINY_MODEL)[(REFERENCE_BLOCK_SIZE, kv_cache_dtype)]
    ours = generate(True, "float32", (16, 128), FP8_CACHE_DTYPES, model=TINY_MODEL)[(block_size, kv_cache_dtype)]
    assert BACKEND_LOG_LINE in ours["log"] and BACKEND_LOG_LINE not in reference["log"]
    assert "Using fp8 data type to store kv cache" in ours["log"]
    assert_same_tokens_and_logprobs(reference, ours, FP8_LOGPROB_TOLERANCE)
    if block_size == 16:
        assert ours["prefix_cache_hits"] > 0


@pytest.mark.skipif(not GPT_OSS_MODEL,
                    reason="PAGEDKV_VLLM_GPT_OSS_MODEL (write_hf_model.py --random-gpt-oss) is not set")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("fp8", marks=vllm_cpu_fp8)])
def test_attention_sinks_identical_to_vllm_cpu_backend(generate, kv_cache_dtype):
    # gpt-oss: sinks on every layer, a sliding window on the first, float32
    cache_dtypes = ("auto", "fp8") if torch.cpu._is_avx512_supported() else ("auto",)
    reference = generate(False, "float32", (REFERENCE_BLOCK_SIZE,), cache_dtypes,
                         model=GPT_OSS_MODEL)[(REFERENCE_BLOCK_SIZE, kv_cache_dtype)]
    ours = generate(True, "float32", (16,), cache_dtypes, model=GPT_OSS_MODEL)[(16, kv_cache_dtype)]
    assert BACKEND_LOG_LINE in ours["log"]
    assert_same_tokens_and_logprobs(reference, ours, FP8_LOGPROB_TOLERANCE)
    assert ours["prefix_cache_hits"] > 0


# Starts one engine per configuration in turn (one process: vLLM's import is most of the cost); prints each outcome.
ENGINE_START_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM
from vllm.distributed import cleanup_dist_env_and_memory
results = {}
for name, kwargs in json.loads(sys.argv[1]).items():
    try:
        LLM(**kwargs, max_model_len=256, enforce_eager=True, skip_tokenizer_init=True, kv_cache_memory_bytes=32 << 20,
            gpu_memory_utilization=0.1)
        results[name] = "started"
    except Exception as error:
        results[name] = f"{type(error).__name__}: {error}"
    cleanup_dist_env_and_memory()
print("RESULTS " + json.dumps(results))
"""


def write_per_head_fp8_checkpoint(model: str, out) -> str:
    """The model as an llm-compressor checkpoint with one FP8 k_scale / v_scale per KV head (strategy attn_head)."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False,
                            "symmetric": True}}
    weights = load_file(os.path.join(model, "model.safetensors"))
    for layer in range(config["num_hidden_layers"]):
        for name in ("k_scale", "v_scale"):
            weights[f"model.layers.{layer}.self_attn.{name}"] = torch.full((config["num_key_value_heads"],), 0.05)
    os.makedirs(out, exist_ok=True)
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return str(out)


@pytest.mark.skipif(not TINY_MODEL, reason="PAGEDKV_VLLM_TINY_MODEL (write_hf_model.py --random-tiny) is not set")
def test_unsupported_configurations_refused_at_engine_start(tmp_path):
    # Each must stop the engine before it serves anything, naming the reason: per-token-head FP8 scales (not
    # vLLM's per-tensor k_scale / v_scale), a block size above the backend's limit (vLLM's CPU platform does not
    # ask the backend), a checkpoint's per-head FP8 scales (known once the weights are loaded).
    configurations = {
        "fp8_per_token_head": dict(model=TINY_MODEL, kv_cache_dtype="fp8_per_token_head"),
        "block_size_512": dict(model=TINY_MODEL, block_size=512),
        "per_head_scales": dict(model=write_per_head_fp8_checkpoint(TINY_MODEL, tmp_path / "per-head-fp8")),
    }
    run = subprocess.run([sys.executable, "-c", ENGINE_START_SCRIPT, json.dumps(configurations)],
                         env=dict(os.environ, PAGEDKV_VLLM="1"), capture_output=True, text=True)
    log = run.stdout + run.stderr
    assert run.returncode == 0 and "RESULTS " in run.stdout, log[-4000:]
    results = json.loads(run.stdout.split("RESULTS ", 1)[1])
    expected = {
        "fp8_per_token_head": "kv_cache_dtype must be one of",
        "block_size_512": "block_size must be 1..256, got 512",
        "per_head_scales": "one k_scale and one v_scale per layer, got k_scale of shape (2,)",
    }
    for name, reason in expected.items():
        assert results[name].startswith("NotImplementedError: pagedkv attention backend:"), (name, results[name])
        assert reason in results[name] and "unset PAGEDKV_VLLM" in results[name], (name, results[name])


# ---- the backend's forward against a dense attention written from vLLM's semantics ----


def dense_attention(q, keys, values, positions, scale, sliding_window, softcap, sinks=None):
    """q [Tq, Hq, D] at absolute positions; keys/values [S, Hk, D] of the whole sequence so far.

    vLLM: a query at position p sees keys j <= p, and with a window W only the W newest of those
    (p - W < j). Scores are softcapped as softcap * tanh(s / softcap). Sinks [Hq] (gpt-oss): one more
    logit per head in every row's softmax, whose probability is dropped (it has no value).
    """
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    j = torch.arange(keys.shape[0])[None, :]
    p = positions[:, None]
    visible = j <= p
    if sliding_window is not None:
        visible &= j > p - sliding_window
    scores = scores.masked_fill(~visible[None], -math.inf)
    if sinks is not None:
        sink_column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
        probabilities = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probabilities = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probabilities, v)


def vllm_cpu_fp8_codes(x, scale: float, kv_cache_dtype: str):
    """The FP8 codes (uint8 [T, H, D]) vLLM's own CPU backend stores for x [T, H, D]: its cache writer
    (cpu_attn_reshape_and_cache), read back from the value half of its blocks ([block_size, D] rows per
    head; it keeps keys transposed)."""
    tokens, heads, head_size = x.shape
    block_size = 32  # vLLM's CPU FP8 path takes multiples of 32
    blocks = -(-tokens // block_size)
    kv_cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=torch.uint8)
    key_cache, value_cache = kv_cache.view(blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(x, x, key_cache, value_cache, torch.arange(tokens), "vec", k_scale=scale,
                                        v_scale=scale, kv_cache_dtype=kv_cache_dtype)
    values = kv_cache.view(blocks, heads, 2, block_size, head_size)[:, :, 1]
    return values.transpose(1, 2).reshape(blocks * block_size, heads, head_size)[:tokens]


def vllm_cpu_fp8_values(x, scale: float, kv_cache_dtype: str):
    """What vLLM's CPU backend attends over for x: its stored codes times the per-tensor scale (float64)."""
    codes = vllm_cpu_fp8_codes(x, scale, kv_cache_dtype)
    return codes.view(FP8_KV_CACHE_DTYPES[kv_cache_dtype]).double() * scale


class ScaledLayer:
    """The attention layer's per-tensor FP8 scales, as vLLM's Attention layer holds them (float32 [])."""

    def __init__(self, k_scale: float, v_scale: float):
        self._k_scale = torch.tensor(k_scale, dtype=torch.float32)
        self._v_scale = torch.tensor(v_scale, dtype=torch.float32)


def vllm_layer_cache(num_blocks, num_kv_heads, block_size, head_size, dtype, layout=KVCacheLayout.LBHNC):
    """A layer's cache as vLLM hands it to forward: the logical [num_blocks, Hk, block_size, D + Dv] view of
    memory laid out as `layout` says (LBHNC: head-major pages, vLLM's CPU layout; LBNHC: token-major pages,
    the backend's first choice); NaN where nothing was stored (0 in uint8 caches, vLLM's FP8 bytes)."""
    logical = (num_blocks, num_kv_heads, block_size, 2 * head_size)
    order = layout.layer_view_order
    unset = 0 if dtype == torch.uint8 else float("nan")
    physical = torch.full([logical[axis] for axis in order], unset, dtype=dtype)
    return physical.permute([order.index(axis) for axis in range(4)])


# one layout per distinct layer view (BLNHC's layer view is LBNHC's: they differ in where other layers sit)
LAYER_VIEW_LAYOUTS = list({m.layer_view_order: m for m in PagedKVAttentionBackend.supported_kv_cache_layouts()}.values())


# per-tensor scales that spread randn keys and values over much of each format's range
FP8_TEST_SCALES = {"k": 0.02, "v": 0.3}


@pytest.mark.parametrize("layout", LAYER_VIEW_LAYOUTS, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("sliding_window,softcap,with_sinks", [(None, 0.0, False), (7, 0.0, True), (None, 5.0, False),
                                                               (4, 3.0, True), (None, 0.0, True)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_forward_matches_dense_attention(layout, dtype, block_size, sliding_window, softcap, with_sinks,
                                         kv_cache_dtype):
    torch.manual_seed(block_size)
    num_heads, num_kv_heads, head_size = 6, 2, 32
    scale = head_size**-0.5
    # sinks as the model holds them (its dtype): the backend must use them at float32 or better
    sinks = (torch.randn(num_heads) * 2).to(dtype) if with_sinks else None
    impl = PagedKVAttentionImpl(num_heads, head_size, scale, num_kv_heads, None, sliding_window, kv_cache_dtype,
                                softcap or None, sinks=sinks)
    fp8 = kv_cache_dtype != "auto"
    layer = ScaledLayer(FP8_TEST_SCALES["k"], FP8_TEST_SCALES["v"])
    # Two sequences share their first 2 pages (prefix caching); 3 steps: prefill chunks, then a
    # mixed step (one decode, one chunk), with a padding row at the end of each step.
    shared = 2 * block_size
    lengths = [shared + 9, shared + 4]
    pages_per_row = [math.ceil(n / block_size) for n in lengths]
    num_blocks = 2 + (pages_per_row[0] - 2) + (pages_per_row[1] - 2) + 3
    order = torch.randperm(num_blocks).tolist()
    own_pages_1 = order[pages_per_row[0]: pages_per_row[0] + pages_per_row[1] - 2]
    table_rows = [order[: pages_per_row[0]], order[:2] + own_pages_1]
    width = max(pages_per_row) + 1
    block_table = torch.tensor([row + [num_blocks - 1] * (width - len(row)) for row in table_rows], dtype=torch.int32)
    keys = [torch.randn(n, num_kv_heads, head_size).to(dtype) for n in lengths]
    values = [torch.randn(n, num_kv_heads, head_size).to(dtype) for n in lengths]
    keys[1][:shared], values[1][:shared] = keys[0][:shared], values[0][:shared]
    if fp8:
        # vLLM allocates FP8 caches as bytes; the reference attends over the values vLLM's CPU writer stores
        kv_cache = vllm_layer_cache(num_blocks, num_kv_heads, block_size, head_size, torch.uint8, layout)
        attended_keys = [vllm_cpu_fp8_values(k, FP8_TEST_SCALES["k"], kv_cache_dtype) for k in keys]
        attended_values = [vllm_cpu_fp8_values(v, FP8_TEST_SCALES["v"], kv_cache_dtype) for v in values]
    else:
        kv_cache = vllm_layer_cache(num_blocks, num_kv_heads, block_size, head_size, dtype, layout)
        attended_keys, attended_values = keys, values
    # (row 0 new tokens, row 1 new tokens) per step; row 1's shared pages are already cached (step 0 gives it 0)
    steps = [(shared, 0), (lengths[0] - shared - 1, 2), (1, lengths[1] - shared - 2)]
    done = [0, shared]
    for new in steps:
        rows = [b for b in range(2) if new[b] > 0]
        query_lengths = [new[b] for b in rows]
        num_tokens = sum(query_lengths)
        query_start = torch.tensor([0] + torch.tensor(query_lengths).cumsum(0).tolist(), dtype=torch.int32)
        seq_lens = torch.tensor([done[b] + new[b] for b in rows], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=query_start, query_start_loc_cpu=query_start, seq_lens=seq_lens, num_reqs=len(rows),
            num_actual_tokens=num_tokens, max_query_len=max(query_lengths), max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table[rows], slot_mapping=torch.zeros(num_tokens + 1, dtype=torch.int64))
        metadata = PagedKVMetadataBuilder.build(None, 0, common)
        padded = num_tokens + 1  # vLLM pads the token count; pagedkv must leave row num_tokens as zeros
        query = torch.randn(padded, num_heads, head_size).to(dtype)
        key = torch.cat([keys[b][done[b]: done[b] + new[b]] for b in rows] + [torch.zeros(1, num_kv_heads, head_size,
                                                                                          dtype=dtype)])
        value = torch.cat([values[b][done[b]: done[b] + new[b]] for b in rows] +
                          [torch.zeros(1, num_kv_heads, head_size, dtype=dtype)])
        output = torch.full((padded, num_heads, head_size), float("nan"), dtype=dtype)
        impl.forward(layer, query, key, value, kv_cache, metadata, output)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        for i, b in enumerate(rows):
            start, stop = int(query_start[i]), int(query_start[i + 1])
            positions = torch.arange(done[b], done[b] + new[b])
            seen = done[b] + new[b]
            expected = dense_attention(query[start:stop], attended_keys[b][:seen], attended_values[b][:seen],
                                       positions, scale, sliding_window, softcap, sinks)
            torch.testing.assert_close(output[start:stop].double(), expected, atol=tolerance, rtol=tolerance)
        assert torch.equal(output[num_tokens:], torch.zeros_like(output[num_tokens:]))
        for b in rows:
            done[b] += new[b]


def values_across_fp8_range(shape, scale: float, kv_cache_dtype: str, dtype) -> torch.Tensor:
    """Random magnitudes from 1e-6 (subnormal or zero codes) to 7e4 (saturated), and every finite code of
    the format times the scale, exactly or a float32 step or two off (where rounding modes part), and zeros."""
    fp8_dtype = FP8_KV_CACHE_DTYPES[kv_cache_dtype]
    magnitudes = torch.tensor([1e-6, 1e-4, 1e-2, 1.0, 30.0, 600.0, 7e4])
    spread = torch.randn(shape) * magnitudes[torch.randint(0, len(magnitudes), shape)]
    all_codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    finite_codes = all_codes[torch.isfinite(all_codes)]
    on_grid = finite_codes[torch.randint(0, len(finite_codes), shape)] * torch.tensor(scale, dtype=torch.float32)
    on_grid = on_grid * (1 + torch.randint(-2, 3, shape) * 2.0**-23)
    values = torch.where(torch.rand(shape) < 0.5, spread, on_grid)
    values[torch.rand(shape) < 0.02] = 0.0
    values[torch.rand(shape) < 0.02] = -0.0
    return values.to(dtype)


@pytest.mark.parametrize("kv_cache_dtype", FP8_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 3.3), (0.0123, 1 / 3), (0.02, 0.3)])
def test_fp8_cache_holds_vllm_cpu_codes(kv_cache_dtype, dtype, k_scale, v_scale):
    """Byte for byte the codes vLLM's own CPU writer stores, over the formats' whole range."""
    torch.manual_seed(0)
    num_kv_heads, head_size, block_size, tokens = 2, 64, 16, 40
    shape = (tokens, num_kv_heads, head_size)
    key = values_across_fp8_range(shape, k_scale, kv_cache_dtype, dtype)
    value = values_across_fp8_range(shape, v_scale, kv_cache_dtype, dtype)
    impl = PagedKVAttentionImpl(4, head_size, head_size**-0.5, num_kv_heads, None, None, kv_cache_dtype)
    num_blocks = 4
    kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=torch.uint8)
    pages = [2, 0, 3]  # tokens 0..39 on pages 2, 0, 3
    query_start = torch.tensor([0, tokens], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start, query_start_loc_cpu=query_start, seq_lens=torch.tensor([tokens], dtype=torch.int32),
        num_reqs=1, num_actual_tokens=tokens, max_query_len=tokens, max_seq_len=tokens,
        block_table_tensor=torch.tensor([pages], dtype=torch.int32), slot_mapping=torch.zeros(tokens, dtype=torch.int64))
    output = torch.empty(tokens, 4, head_size, dtype=dtype)
    impl.forward(ScaledLayer(k_scale, v_scale), torch.randn(tokens, 4, head_size).to(dtype), key, value, kv_cache,
                 PagedKVMetadataBuilder.build(None, 0, common), output)
    stored = kv_cache[pages].transpose(1, 2).reshape(len(pages) * block_size, num_kv_heads, 2 * head_size)[:tokens]
    assert torch.equal(stored[..., :head_size], vllm_cpu_fp8_codes(key, k_scale, kv_cache_dtype))
    assert torch.equal(stored[..., head_size:], vllm_cpu_fp8_codes(value, v_scale, kv_cache_dtype))
    assert torch.equal(kv_cache[1], torch.zeros_like(kv_cache[1]))  # the page no row uses


def test_kv_sharing_layer_reads_without_storing():
    impl = PagedKVAttentionImpl(2, 16, 0.25, 1, None, None, "auto", None,
                                kv_sharing_target_layer_name="model.layers.0.self_attn.attn")
    kv_cache = vllm_layer_cache(2, 1, 4, 16, torch.float32)
    kv_cache[0] = torch.randn(1, 4, 32)
    before = kv_cache.clone()
    query_start = torch.tensor([0, 1], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start, query_start_loc_cpu=query_start, seq_lens=torch.tensor([4], dtype=torch.int32),
        num_reqs=1, num_actual_tokens=1, max_query_len=1, max_seq_len=4,
        block_table_tensor=torch.tensor([[0, 1]], dtype=torch.int32), slot_mapping=torch.zeros(1, dtype=torch.int64))
    output = torch.empty(1, 2, 16)
    impl.forward(None, torch.randn(1, 2, 16), torch.randn(1, 1, 16), torch.randn(1, 1, 16), kv_cache,
                 PagedKVMetadataBuilder.build(None, 0, common), output)
    assert torch.equal(kv_cache.nan_to_num(), before.nan_to_num())
    assert torch.isfinite(output).all()


@pytest.mark.parametrize("kwargs,message", [
    ({"kv_cache_dtype": "fp8_per_token_head"}, "kv_cache_dtype must be one of"),
    ({"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype must be one of"),
    ({"attn_type": "encoder_only"}, "attn_type must be 'decoder'"),
    ({"attn_type": "encoder_decoder"}, "attn_type must be 'decoder'"),
    ({"alibi_slopes": [0.5, 0.25]}, "ALiBi"),
    ({"sinks": torch.zeros(3)}, "sinks must hold one value per query head, shape (2,), got (3,)"),
    # what flash_attn_paged refuses is refused when vLLM builds the layer, not at the first step
    ({"num_heads": 3, "num_kv_heads": 2}, "(Hq = 3) must be a positive multiple of k_cache.size(2) (Hk = 2)"),
    ({"logits_soft_cap": -1.0}, "softcap must be 0 (off) or in"),
    ({"logits_soft_cap": float("nan")}, "softcap must be 0 (off) or in"),
])
def test_unsupported_configurations_refused(kwargs, message):
    arguments = dict(num_heads=2, head_size=16, scale=0.25, num_kv_heads=1)
    arguments.update(kwargs)
    with pytest.raises(NotImplementedError, match="pagedkv attention backend") as error:
        PagedKVAttentionImpl(**arguments)
    assert message in str(error.value) and "PAGEDKV_VLLM" in str(error.value)


def test_block_size_above_limit_refused():
    # vLLM's CPU platform never asks supports_block_size: the builder (made at engine start with the pages' size)
    # must refuse what the backend does not declare
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    def builder(block_size):
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=16, dtype=torch.float32)
        return PagedKVMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], None, torch.device("cpu"))

    builder(1), builder(3), builder(256)
    with pytest.raises(NotImplementedError, match=r"block_size must be 1\.\.256, got 512.*unset PAGEDKV_VLLM"):
        builder(512)


def test_fp8_per_head_scales_refused():
    impl = PagedKVAttentionImpl(2, 32, 0.25, 2, None, None, "fp8")
    layer = ScaledLayer(1.0, 1.0)
    layer._k_scale = torch.ones(2)  # one scale per KV head: not vLLM's per-tensor k_scale
    query_start = torch.tensor([0, 1], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start, query_start_loc_cpu=query_start, seq_lens=torch.tensor([1], dtype=torch.int32),
        num_reqs=1, num_actual_tokens=1, max_query_len=1, max_seq_len=1,
        block_table_tensor=torch.tensor([[0]], dtype=torch.int32), slot_mapping=torch.zeros(1, dtype=torch.int64))
    kv_cache = torch.zeros(1, 2, 4, 64, dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match=r"one k_scale and one v_scale per layer.*\(2,\).*PAGEDKV_VLLM"):
        impl.forward(layer, torch.randn(1, 2, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32), kv_cache,
                     PagedKVMetadataBuilder.build(None, 0, common), torch.empty(1, 2, 32))
    assert torch.equal(kv_cache, torch.zeros_like(kv_cache))


def one_sequence_metadata(tokens: int, cached: int, pages: list[int]):
    """One sequence with `cached` tokens already in its pages and `tokens` new ones this step."""
    query_start = torch.tensor([0, tokens], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start, query_start_loc_cpu=query_start,
        seq_lens=torch.tensor([cached + tokens], dtype=torch.int32), num_reqs=1, num_actual_tokens=tokens,
        max_query_len=tokens, max_seq_len=cached + tokens, block_table_tensor=torch.tensor([pages], dtype=torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64))
    return PagedKVMetadataBuilder.build(None, 0, common)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("fault", ["output dtype", "output rows", "output value size", "query head size",
                                   "query heads"])
def test_refused_step_leaves_cache_unchanged(kv_cache_dtype, fault):
    # forward stores this step's K/V, then attends: whatever the attention would refuse must be refused
    # before the store, so that a step that raises changes nothing
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_size, tokens = 4, 2, 32, 3
    impl = PagedKVAttentionImpl(num_heads, head_size, head_size**-0.5, num_kv_heads, None, None, kv_cache_dtype)
    cache_dtype = torch.uint8 if kv_cache_dtype != "auto" else torch.bfloat16
    kv_cache = vllm_layer_cache(3, num_kv_heads, 4, head_size, cache_dtype, KVCacheLayout.LBNHC)
    kv_cache[0] = 7  # a page of keys an earlier step stored
    before = kv_cache.clone()
    query = torch.randn(tokens, num_heads, head_size, dtype=torch.bfloat16)
    output = torch.empty(tokens, num_heads, head_size, dtype=torch.bfloat16)
    if fault == "output dtype":
        output = output.float()
    elif fault == "output rows":
        output = torch.empty(tokens - 1, num_heads, head_size, dtype=torch.bfloat16)
    elif fault == "output value size":
        output = output[..., : head_size // 2]
    elif fault == "query head size":
        query = query[..., : head_size // 2]
    else:
        query, output = query[:, :3], output[:, :3]
    key = torch.randn(tokens, num_kv_heads, head_size, dtype=torch.bfloat16)
    value = torch.randn(tokens, num_kv_heads, head_size, dtype=torch.bfloat16)
    # the refusal's type is not the point (today's: ValueError naming query or output), the cache is
    with pytest.raises((ValueError, RuntimeError), match="must"):
        impl.forward(ScaledLayer(1.0, 1.0), query, key, value, kv_cache, one_sequence_metadata(tokens, 4, [0, 2]),
                     output)
    assert torch.equal(kv_cache.nan_to_num(), before.nan_to_num())
