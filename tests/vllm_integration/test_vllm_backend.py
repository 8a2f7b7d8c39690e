"""pagedkv as vLLM's attention backend (pagedkv.vllm): vLLM's own CPU backend is the oracle.

SmolLM2-135M runs through ``vllm.LLM`` (tests/vllm_integration/vllm_generate.py, one process per run) with
chunked prefill mixed with decodes and prefix caching on: float32 tokens must equal vLLM's own CPU
backend at block sizes 16 and 128, bfloat16 must agree within a logprob tolerance, and the
OpenAI-compatible server must answer as the offline run does. The backend's forward is also
checked directly against a dense attention written from vLLM's semantics (GQA, sliding window,
softcap, padding rows, pages shared by two sequences).

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

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from pagedkv.vllm_backend import (  # noqa: E402
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


def run_generate(tmp_dir, pagedkv: bool, dtype: str, block_size: int, tensor_parallel_size: int = 1,
                 model: str | None = None):
    name = f"{'pagedkv' if pagedkv else 'vllm'}-{dtype}-bs{block_size}-tp{tensor_parallel_size}-{bool(model)}"
    out = os.path.join(tmp_dir, name + ".json")
    env = dict(os.environ, PAGEDKV_VLLM="1" if pagedkv else "0")
    command = [sys.executable, os.path.join(HERE, "vllm_generate.py"), "--model", model or MODEL, "--dtype", dtype,
               "--block-size", str(block_size), "--tensor-parallel-size", str(tensor_parallel_size), "--out", out]
    if model:  # the tiny model has no tokenizer
        command.append("--token-prompts")
    if tensor_parallel_size > 1:
        # vLLM's CPU workers bind their OpenMP threads; with one NUMA node it needs one core list per rank
        cores = sorted(os.sched_getaffinity(0))[:tensor_parallel_size]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in cores)
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"{name} failed:\n{log[-6000:]}"
    with open(out) as f:
        result = json.load(f)
    result["log"] = log
    return result


@pytest.fixture(scope="session")
def generate(tmp_path_factory):
    """Runs each configuration once per test run (each is a vLLM engine start)."""
    results = {}
    tmp_dir = str(tmp_path_factory.mktemp("vllm_runs"))

    def get(pagedkv: bool, dtype: str, block_size: int, tensor_parallel_size: int = 1, model: str | None = None):
        key = (pagedkv, dtype, block_size, tensor_parallel_size, model)
        if key not in results:
            results[key] = run_generate(tmp_dir, *key)
        return results[key]

    return get


def token_ids(result):
    return [row["token_ids"] for row in result["completions"]]


@needs_model
@pytest.mark.parametrize("block_size", [16, 128])
def test_float32_tokens_identical_to_vllm_cpu_backend(generate, block_size):
    reference = generate(False, "float32", REFERENCE_BLOCK_SIZE)
    ours = generate(True, "float32", block_size)
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
def test_bfloat16_within_logprob_tolerance(generate):
    reference = generate(False, "bfloat16", REFERENCE_BLOCK_SIZE)
    ours = generate(True, "bfloat16", REFERENCE_BLOCK_SIZE)
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
    offline = generate(True, "float32", 16)
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
             "--enforce-eager", "--max-num-batched-tokens", "32", "--enable-prefix-caching", "--kv-cache-memory-bytes",
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
    single = generate(True, "float32", 16, 1, TINY_MODEL)
    split = generate(True, "float32", 16, 2, TINY_MODEL)
    assert BACKEND_LOG_LINE in split["log"]
    assert token_ids(split) == token_ids(single)
    for one, two in zip(single["completions"], split["completions"], strict=True):
        for step_one, step_two in zip(one["logprobs"], two["logprobs"], strict=True):
            for token, logprob in step_one.items():
                assert abs(logprob - step_two[token]) <= TENSOR_PARALLEL_LOGPROB_TOLERANCE


# ---- the backend's forward against a dense attention written from vLLM's semantics ----


def dense_attention(q, keys, values, positions, scale, sliding_window, softcap):
    """q [Tq, Hq, D] at absolute positions; keys/values [S, Hk, D] of the whole sequence so far.

    vLLM: a query at position p sees keys j <= p, and with a window W only the W newest of those
    (p - W < j). Scores are softcapped as softcap * tanh(s / softcap).
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
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def vllm_layer_cache(num_blocks, num_kv_heads, block_size, head_size, dtype, layout=KVCacheLayout.LBHNC):
    """A layer's cache as vLLM hands it to forward: the logical [num_blocks, Hk, block_size, D + Dv] view of
    memory laid out as `layout` says (LBHNC: head-major pages, vLLM's CPU layout; LBNHC: token-major pages,
    the backend's first choice); NaN where nothing was stored."""
    logical = (num_blocks, num_kv_heads, block_size, 2 * head_size)
    order = layout.layer_view_order
    physical = torch.full([logical[axis] for axis in order], float("nan"), dtype=dtype)
    return physical.permute([order.index(axis) for axis in range(4)])


# one layout per distinct layer view (BLNHC's layer view is LBNHC's: they differ in where other layers sit)
LAYER_VIEW_LAYOUTS = list({m.layer_view_order: m for m in PagedKVAttentionBackend.supported_kv_cache_layouts()}.values())


@pytest.mark.parametrize("layout", LAYER_VIEW_LAYOUTS, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("sliding_window,softcap", [(None, 0.0), (7, 0.0), (None, 5.0), (4, 3.0)])
def test_forward_matches_dense_attention(layout, dtype, block_size, sliding_window, softcap):
    torch.manual_seed(block_size)
    num_heads, num_kv_heads, head_size = 6, 2, 32
    scale = head_size**-0.5
    impl = PagedKVAttentionImpl(num_heads, head_size, scale, num_kv_heads, None, sliding_window, "auto",
                                softcap or None)
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
    kv_cache = vllm_layer_cache(num_blocks, num_kv_heads, block_size, head_size, dtype, layout)
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
        impl.forward(None, query, key, value, kv_cache, metadata, output)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        for i, b in enumerate(rows):
            start, stop = int(query_start[i]), int(query_start[i + 1])
            positions = torch.arange(done[b], done[b] + new[b])
            expected = dense_attention(query[start:stop], keys[b][: done[b] + new[b]], values[b][: done[b] + new[b]],
                                       positions, scale, sliding_window, softcap)
            torch.testing.assert_close(output[start:stop].double(), expected, atol=tolerance, rtol=tolerance)
        assert torch.equal(output[num_tokens:], torch.zeros_like(output[num_tokens:]))
        for b in rows:
            done[b] += new[b]


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
    ({"kv_cache_dtype": "fp8"}, "FP8 KV caches are not supported yet"),
    ({"attn_type": "encoder_only"}, "attn_type must be 'decoder'"),
    ({"attn_type": "encoder_decoder"}, "attn_type must be 'decoder'"),
    ({"alibi_slopes": [0.5, 0.25]}, "ALiBi"),
    ({"sinks": torch.zeros(2)}, "sinks"),
])
def test_unsupported_configurations_refused(kwargs, message):
    arguments = dict(num_heads=2, head_size=16, scale=0.25, num_kv_heads=1)
    arguments.update(kwargs)
    with pytest.raises(NotImplementedError, match="pagedkv attention backend") as error:
        PagedKVAttentionImpl(**arguments)
    assert message in str(error.value) and "PAGEDKV_VLLM" in str(error.value)
