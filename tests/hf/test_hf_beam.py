"""PagedCache under beam search and assisted decoding: generate's sequences equal transformers'
default cache with sdpa; the pool's shared pages (reference counts, copy on write, free list)
against a plain per-row reference through random reorders, crops and steps; and the refusals of
arguments the cache cannot take, which leave it unchanged."""

from __future__ import annotations

import collections

import pytest
import torch

from hf_helpers import *  # noqa: F403  (transformers, pagedkv.hf as phf, ref and the shared helpers)

from pagedkv.hf import cache as paged_cache  # noqa: E402

PAGE_SIZES = [1, 4, 16]
# transformers' crop argument on this line: "tokens_to_remove" (5.x) or "max_length" (4.57)
CROP_ARGUMENT = paged_cache._crop_argument(transformers.cache_utils.Cache)


def spy(cache, method):
    """Records the argument of every call of cache.<method> (then calls it)."""
    calls = []
    original = getattr(cache, method)

    def recording(argument):
        calls.append(argument.clone() if isinstance(argument, torch.Tensor) else argument)
        return original(argument)

    setattr(cache, method, recording)
    return calls


def record_crops(cache):
    """Records (positions held before, after) of each cache.crop call."""
    crops = []
    crop = cache.crop

    def recording_crop(argument):
        before = cache.get_seq_length()
        crop(argument)
        crops.append((before, cache.get_seq_length()))

    cache.crop = recording_crop
    return crops


# ---- beam search: the sequences of transformers' default cache ---------------------------------

BEAM_PROMPTS = {"unpadded": [6, 6], "left-padded": [9, 3, 6]}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("prompts", sorted(BEAM_PROMPTS))
def test_beam_search_sequences_identical_to_sdpa(saved_models, family, page_size, prompts):
    """num_beams 2 and 4 (4 with num_return_sequences=2): every returned sequence equals the default
    cache's with sdpa, and the beams were reordered (not only kept in place) along the way."""
    path = saved_models[family]
    ids, mask = left_padded(BEAM_PROMPTS[prompts], seed=page_size)
    sdpa, model = load(path, "sdpa"), load(path, "pagedkv")
    for beams, returned in [(2, 1), (4, 2)]:
        options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                       num_beams=beams, num_return_sequences=returned)
        cache = phf.PagedCache(model, page_size=page_size)
        reorders = spy(cache, "reorder_cache")
        with torch.inference_mode():
            expected = sdpa.generate(**options)
            got = model.generate(**options, **{phf._cache_argument(model): cache})
        assert torch.equal(got, expected), f"num_beams={beams}"
        rows = ids.shape[0] * beams
        assert reorders and any(not torch.equal(idx, torch.arange(rows)) for idx in reorders)
        check_pool(cache.pool)


def test_beam_search_bfloat16_identical_to_the_default_cache(saved_models):
    """bf16 pages through reorders and copies. The reference is the same attention over transformers'
    default cache: against sdpa, bf16 beams could part at a near tie on another CPU kernel path (AMX)."""
    path = saved_models["llama"]
    ids, mask = left_padded([7, 4], seed=2)
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                   num_beams=3)
    model = load(path, "pagedkv", torch.bfloat16)
    with torch.inference_mode():
        expected = model.generate(**options)
        got = model.generate(**options, **paged_cache_argument(model, page_size=4))
    assert torch.equal(got, expected)


def test_long_beam_search_reuses_pages(saved_models, monkeypatch):
    """30 steps of 4 beams over 2 left-padded prompts: the pool never hands out more pages than the
    rows hold at once (freed pages are taken again: without the free list every step's copies of
    shared last pages would add pages), and the reference counts match the rows' page lists."""
    path = saved_models["llama"]
    ids, mask = left_padded([5, 2], seed=4)
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                   num_beams=4)
    model = load(path, "pagedkv")
    cache = phf.PagedCache(model, page_size=4)
    taken = []
    original_take = paged_cache._Pool._take

    def counting_take(pool, count):
        taken.append(count)
        return original_take(pool, count)

    monkeypatch.setattr(paged_cache._Pool, "_take", counting_take)
    with torch.inference_mode():
        expected = load(path, "sdpa").generate(**options)
        got = model.generate(**options, **{phf._cache_argument(model): cache})
    assert torch.equal(got, expected)
    pool = cache.pool
    rows, longest = 2 * 4, ids.shape[1] + 30
    most_held = rows * -(-longest // 4)  # every row holding its own pages, none shared
    assert pool.next_free <= most_held, f"{pool.next_free} pages handed out, the rows hold at most {most_held}"
    assert sum(taken) > pool.next_free, "no page was ever taken from the free list"
    check_pool(pool)


# ---- assisted decoding: greedy tokens ---------------------------------------------------------------

ASSIST_PROMPTS = {
    "unpadded": ([5, 9, 12, 5, 9, 12, 5, 9, 12, 5, 9], 0),
    "left-padded": ([5, 9, 12, 5, 9, 12, 5, 9], 3),
}


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("prompt", sorted(ASSIST_PROMPTS))
@pytest.mark.parametrize("assistant", ["model", "prompt_lookup"])
def test_assisted_decoding_tokens_identical_to_greedy_sdpa(saved_models, page_size, prompt, assistant):
    """A draft model (mistral for a llama: many drafts rejected) or prompt lookup proposes tokens;
    the PagedCache is cropped back over the rejected ones, and the tokens equal plain greedy sdpa."""
    path = saved_models["llama"]
    tokens, padding = ASSIST_PROMPTS[prompt]
    ids = torch.tensor([[0] * padding + tokens])
    mask = torch.tensor([[0] * padding + [1] * len(tokens)])
    # min_new_tokens (greedy's EOS suppression) is refused with a draft model on 4.57: EOS may end both
    expected = greedy(load(path, "sdpa"), ids, mask, 16, stop_at_eos=True)
    model = load(path, "pagedkv")
    cache = phf.PagedCache(model, page_size=page_size)
    crops = record_crops(cache)
    if assistant == "model":
        extra = {"assistant_model": load(saved_models["mistral"], "sdpa")}
    else:
        extra = {"prompt_lookup_num_tokens": 3}
    got = greedy(model, ids, mask, 16, stop_at_eos=True, **extra, **{phf._cache_argument(model): cache})
    assert torch.equal(got, expected)
    assert any(after < before for before, after in crops), "no draft was rejected: crop never removed a position"
    check_pool(cache.pool)
    assert cache.layers[0].lengths.tolist() == [cache.get_seq_length() - padding]


# ---- the pool against a per-row reference (hf_helpers: check_pool, ReferenceRows, forward_step) -------------


@pytest.mark.parametrize("page_size", [1, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_shared_pages_match_a_plain_reference(page_size, seed):
    """Random forwards (left padding, padding holes later on), reorders, crops, row selections and
    repeats straight on a PagedCache: after each, every row's stored K/V in every layer equal a plain
    per-row reference, each forward's attention equals attention over the reference's rows (so a
    row's writes never reached a page another row still reads), the pool's counts are consistent and
    it never hands out more pages than the rows held at once."""
    gen = torch.Generator().manual_seed(seed)
    cache, reference = empty_cache_and_reference(page_size, rows=3)
    padding = torch.tensor([0, 4, 2])
    forward_step(cache, reference, torch.arange(7) >= padding[:, None], gen)
    most_live, done = cache.pool.next_free, collections.Counter()
    for _ in range(60):
        batch = len(reference.positions)
        seen = len(reference.positions[0])
        operation = ["step", "step", "reorder", "crop", "select", "repeat"][int(torch.randint(6, (1,), generator=gen))]
        if operation == "step":
            q_len = int(torch.randint(1, 4, (1,), generator=gen))
            new = torch.rand(batch, q_len, generator=gen) > 0.15  # now and then a padding hole
            forward_step(cache, reference, new, gen)
        elif operation == "reorder":
            beam_idx = torch.randint(batch, (batch,), generator=gen)
            cache.reorder_cache(beam_idx)
            reference.select(beam_idx.tolist())
        elif operation == "crop" and seen > 1:
            count = int(torch.randint(1, min(seen, 6), (1,), generator=gen))
            cache.crop(-count)
            reference.crop(count)
        elif operation == "select":
            indices = torch.randint(batch, (int(torch.randint(1, min(batch + 2, 6), (1,), generator=gen)),),
                                    generator=gen)
            cache.batch_select_indices(indices)
            reference.select(indices.tolist())
        elif operation == "repeat" and batch <= 2:
            cache.batch_repeat_interleave(2)
            reference.select([row for row in range(batch) for _ in range(2)])
        else:
            continue
        done[operation] += 1
        check_pool(cache.pool)
        check_stored(cache, reference)
        most_live = max(most_live, len({p for pages in cache.pool.row_pages for p in pages}))
        assert cache.pool.next_free <= most_live, "a page was cut from the pool while freed pages were left"
    assert min(done[name] for name in ("step", "reorder", "crop", "select")) >= 3, done


def test_a_shared_page_is_copied_before_a_write_and_full_pages_stay_shared():
    """Two rows made of one: the pages both hold full stay shared (one id), the partly filled last
    page is copied for the first row that writes into it (the other keeps the page), and the page
    no row holds after a reorder goes to the free list and is taken next."""
    gen = torch.Generator().manual_seed(3)
    cache, reference = empty_cache_and_reference(4, rows=1)
    forward_step(cache, reference, torch.ones(1, 6, dtype=torch.bool), gen)  # pages: 4 + 2 tokens
    cache.batch_repeat_interleave(2)
    reference.select([0, 0])
    first, last = cache.pool.row_pages[0]
    assert cache.pool.row_pages == [[first, last], [first, last]] and cache.pool.refs[last] == 2
    forward_step(cache, reference, torch.ones(2, 1, dtype=torch.bool), gen)
    copied = cache.pool.row_pages[0][1]
    assert copied != last and cache.pool.row_pages == [[first, copied], [first, last]]
    assert (cache.pool.refs[first], cache.pool.refs[last], cache.pool.refs[copied]) == (2, 1, 1)
    check_stored(cache, reference)
    cache.reorder_cache(torch.tensor([1, 1]))  # row 0's copy is held by no row now
    reference.select([1, 1])
    assert cache.pool.free == [copied]
    forward_step(cache, reference, torch.ones(2, 1, dtype=torch.bool), gen)
    assert cache.pool.row_pages[0][1] == copied and cache.pool.free == []  # taken back, the pool did not grow
    check_stored(cache, reference)
    check_pool(cache.pool)


def test_rows_that_store_nothing_copy_no_shared_page():
    """Two rows sharing a partly filled last page that both store nothing in a step (padding holes)
    while a third row stores: the shared page stays shared (no copy is made for a row that writes
    nothing into it)."""
    gen = torch.Generator().manual_seed(7)
    cache, reference = empty_cache_and_reference(4, rows=2)
    forward_step(cache, reference, torch.ones(2, 6, dtype=torch.bool), gen)  # each row: pages of 4 + 2 tokens
    cache.batch_select_indices(torch.tensor([0, 0, 1]))
    reference.select([0, 0, 1])
    shared = cache.pool.row_pages[0]
    forward_step(cache, reference, torch.tensor([[False], [False], [True]]), gen)
    assert cache.pool.row_pages[0] == cache.pool.row_pages[1] == shared
    check_stored(cache, reference)
    check_pool(cache.pool)


def test_crop_releases_the_pages_past_the_new_end():
    gen = torch.Generator().manual_seed(5)
    cache, reference = empty_cache_and_reference(2, rows=2)
    forward_step(cache, reference, torch.tensor([[True] * 9, [False] * 4 + [True] * 5]), gen)
    assert [len(p) for p in cache.pool.row_pages] == [5, 3]
    cache.crop(-4)  # row 0 keeps 5 tokens (3 pages), row 1 keeps 1 (1 page)
    reference.crop(4)
    assert [len(p) for p in cache.pool.row_pages] == [3, 1] and len(cache.pool.free) == 4
    assert cache.get_seq_length() == 5 and cache.layers[2].lengths.tolist() == [5, 1]
    check_stored(cache, reference)
    check_pool(cache.pool)
    forward_step(cache, reference, torch.ones(2, 3, dtype=torch.bool), gen)  # the freed pages come back
    assert cache.pool.next_free == 8
    check_stored(cache, reference)
    if CROP_ARGUMENT == "max_length":  # 4.57: crop(max_length) keeps max_length positions
        cache.crop(6)
        reference.crop(2)
        check_stored(cache, reference)
        cache.crop(100)  # already shorter: nothing changes
        check_stored(cache, reference)
    else:
        cache.crop(0)  # 5.x: crop(0) removes nothing
        check_stored(cache, reference)


# ---- arguments the cache cannot take: refused by name, nothing changed ---------------------------------


def filled_cache():
    """Three left-padded rows of 6 positions, the first two sharing their pages."""
    gen = torch.Generator().manual_seed(8)
    cache, reference = empty_cache_and_reference(4, rows=3)
    forward_step(cache, reference, torch.arange(6) >= torch.tensor([0, 2, 5])[:, None], gen)
    cache.reorder_cache(torch.tensor([0, 0, 1]))
    reference.select([0, 0, 1])
    return cache, reference


REFUSED_CALLS = [
    ("reorder_cache", torch.tensor([0, 1]), ValueError, r"beam_idx has 2 entries, but the cache holds 3 rows"),
    ("reorder_cache", torch.tensor([0, 1, 3]), ValueError, r"beam_idx\[2\] is 3, not a row of the cache \(rows 0..2\)"),
    ("reorder_cache", torch.tensor([0, -1, 1]), ValueError, r"beam_idx\[1\] is -1, not a row"),
    ("reorder_cache", torch.tensor([0.0, 1.0, 2.0]), TypeError, r"beam_idx must hold integers, got torch.float32"),
    ("reorder_cache", torch.zeros(3, 1, dtype=torch.int64), ValueError, r"beam_idx must be 1-D"),
    ("reorder_cache", 2, TypeError, r"beam_idx must be a 1-D integer tensor or a sequence of ints, got int"),
    ("reorder_cache", [0, True, 1], TypeError, r"beam_idx\[1\] must be an int, got bool"),
    ("batch_select_indices", torch.tensor([], dtype=torch.int64), ValueError, r"indices selects no row"),
    ("batch_select_indices", [4], ValueError, r"indices\[0\] is 4, not a row"),
    ("batch_select_indices", torch.tensor([True, False]), ValueError, r"indices: a bool mask needs one entry per row"),
    ("batch_repeat_interleave", 0, ValueError, r"repeats must be >= 1, got 0"),
    ("batch_repeat_interleave", 2.0, TypeError, r"repeats must be an int"),
    ("batch_repeat_interleave", True, TypeError, r"repeats must be an int"),
    ("crop", -7, ValueError, rf"{CROP_ARGUMENT}=-7 removes 7 positions, but the cache holds 6"),
    ("crop", 1.5, TypeError, rf"{CROP_ARGUMENT} must be an int, got float"),
    ("crop", False, TypeError, rf"{CROP_ARGUMENT} must be an int, got bool"),
]
if CROP_ARGUMENT == "tokens_to_remove":
    REFUSED_CALLS.append(("crop", 2, ValueError, r"tokens_to_remove must be <= 0 \(minus the number of positions"))


@pytest.mark.parametrize("method,argument,error,match", REFUSED_CALLS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(REFUSED_CALLS)])
def test_refused_arguments_name_the_argument_and_change_nothing(method, argument, error, match):
    cache, reference = filled_cache()
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        getattr(cache, method)(argument)
    assert same(snapshot(cache), before)
    check_stored(cache, reference)


def refused_forward(cache, batch, q_len, positions):
    """One forward whose store paged_store refuses (keys that require grad, in grad mode)."""
    mask = torch.ones(batch, positions + q_len, dtype=torch.bool)
    key = torch.randn(batch, 2, q_len, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="key requires grad"):
        cache.attend(0, torch.randn(batch, 4, q_len, 16), key, torch.randn(batch, 2, q_len, 16), mask, dict(OPTIONS))


def test_a_refused_forward_changes_nothing():
    """A forward whose store is refused leaves the cache as it was: the first forward of a new cache
    reserved rows for its batch (a retry with another batch then failed on the old row count), and a
    forward into a filled cache left its padding mask for crop (which then counted the tokens removed
    from the failed forward's positions)."""
    gen = torch.Generator().manual_seed(6)
    cache, reference = empty_cache_and_reference(4, rows=2)
    refused_forward(cache, 3, 5, 0)
    forward_step(cache, reference, torch.tensor([[True] * 6, [False] * 3 + [True] * 3]), gen)
    check_stored(cache, reference)
    check_pool(cache.pool)
    refused_forward(cache, 2, 2, 6)
    cache.crop(-4)
    reference.crop(4)
    check_stored(cache, reference)
    check_pool(cache.pool)
    forward_step(cache, reference, torch.ones(2, 2, dtype=torch.bool), gen)
    check_stored(cache, reference)


def test_taken_arguments_of_other_kinds():
    """A bool mask (one entry per row) and a list select rows as index tensors do."""
    cache, reference = filled_cache()
    cache.batch_select_indices(torch.tensor([True, False, True]))
    reference.select([0, 2])
    check_stored(cache, reference)
    cache.reorder_cache([1, 0])
    reference.select([1, 0])
    check_stored(cache, reference)
    check_pool(cache.pool)


def test_one_layer_alone_and_continuous_batching_are_refused(saved_models):
    cache, _ = filled_cache()
    for method, argument in [("reorder_cache", torch.tensor([0, 1, 2])), ("crop", -1), ("batch_repeat_interleave", 2),
                             ("batch_select_indices", torch.tensor([0]))]:
        with pytest.raises(NotImplementedError, match=rf"call {method} on the PagedCache .*not on layer 1 alone"):
            getattr(cache.layers[1], method)(argument)
    model = load(saved_models["llama"], "pagedkv")
    collection = phf.PagedKVCacheCollection(4, 3, 16, 2, 16, dtype=torch.float32)
    ragged = phf.PagedCache(model, kv_dtype=torch.float32, collection=collection)
    with pytest.raises(NotImplementedError, match=r"PagedCache\(collection=...\) does not support reorder_cache"):
        ragged.reorder_cache(torch.tensor([0]))


def test_an_empty_cache_takes_the_calls_as_no_ops(saved_models):
    """Before the first forward (and after reset) there are no rows: like transformers' DynamicCache,
    reordering or repeating changes nothing; the argument's type is still checked."""
    cache = phf.PagedCache(small_config("llama"), page_size=4)
    cache.reorder_cache(torch.tensor([0, 0]))
    cache.batch_repeat_interleave(3)
    cache.crop(0)
    with pytest.raises(TypeError, match="beam_idx must hold integers"):
        cache.reorder_cache(torch.tensor([0.5]))
    with pytest.raises(ValueError, match=rf"{CROP_ARGUMENT}=-1 removes 1 positions, but the cache holds 0"):
        cache.crop(-1)
    assert cache.pool is None and cache.get_seq_length() == 0


# ---- layers that gather (store every position, hand back their history) ----------------------------


def diffllama(implementation):
    config = transformers.DiffLlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    return model


def test_gathering_layers_under_beam_search_and_prompt_lookup():
    """DiffLlama rearranges V after the cache, so its PagedCache layers gather (see
    PagedLayer.gathers: every position stored, padding included): beam search over a left-padded
    batch and prompt lookup decoding give eager's sequences there too."""
    refused = phf.attention.refused_architecture_message(transformers.DiffLlamaForCausalLM)
    if refused:  # 4.57's DiffLlama does not call the attention interface
        pytest.skip(refused)
    eager, model = diffllama("eager"), diffllama("pagedkv")
    ids, mask = left_padded([7, 4], seed=2)
    beam = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                num_beams=3, num_return_sequences=2)
    lookup = dict(input_ids=torch.tensor([[5, 9, 12, 5, 9, 12, 5, 9, 12]]), max_new_tokens=12, do_sample=False)
    for options, extra in [(beam, {}), (lookup, {"prompt_lookup_num_tokens": 3})]:
        cache = phf.PagedCache(model, page_size=4)
        crops = record_crops(cache)
        with torch.inference_mode():
            expected = eager.generate(**options)
            got = model.generate(**options, **extra, **{phf._cache_argument(model): cache})
        assert torch.equal(got, expected), list(extra)
        assert not extra or any(after < before for before, after in crops), "no draft was rejected"
        assert all(layer.gathers for layer in cache.layers)
        check_pool(cache.pool)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_pages_are_copied_with_their_scales(kv_dtype):
    """An FP8 PagedCache's copy on write copies each page's scales with its codes: after two rows made
    of one both store a token into their shared last page, both rows still read the first row's
    history exactly (a copy without its scales would read the codes at scale 1)."""
    gen = torch.Generator().manual_seed(5)
    config = small_config("llama")
    cache = phf.PagedCache(config, page_size=4, kv_dtype=kv_dtype)

    def step(batch, q_len):
        mask = torch.ones(batch, cache.get_seq_length() + q_len, dtype=torch.bool)
        for layer in range(config.num_hidden_layers):
            query = 4 * torch.randn(batch, 4, q_len, 16, generator=gen)
            key, value = (4 * torch.randn(batch, 2, q_len, 16, generator=gen) for _ in range(2))
            cache.attend(layer, query, key, value, mask, dict(OPTIONS))

    def stored(layer):
        pool = cache.pool
        return pool.layers[layer].gather(pool.lookup_table, cache.layers[layer].lengths, torch.float32)

    step(1, 6)  # one row, pages of 4 + 2 tokens
    before = [stored(layer) for layer in range(config.num_hidden_layers)]
    cache.batch_repeat_interleave(2)
    step(2, 1)  # both rows write into the shared last page: the first to write gets a copy
    assert cache.pool.row_pages[0][1] != cache.pool.row_pages[1][1], "no copy was made"
    for layer, (k0, v0) in enumerate(before):
        k, v = stored(layer)  # rows of 7 tokens, one after the other
        for row in range(2):
            assert torch.equal(k[7 * row : 7 * row + 6], k0), f"layer {layer} row {row}: K history changed"
            assert torch.equal(v[7 * row : 7 * row + 6], v0), f"layer {layer} row {row}: V history changed"
