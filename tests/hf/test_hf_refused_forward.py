"""A forward through a PagedCache either completes in every layer or changes nothing: whichever layer
fails (paged_store refusing keys that require grad, a refusal from attention, an exception raised by
model code between layers), in prefill or decode, around beam-search reorders, float and FP8 pages.
Checked against a plain per-row reference (the cache driven layer by layer) and against a twin cache
that never saw the failed forward (real models: logits bit for bit)."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import *  # noqa: F403  (transformers, pagedkv.hf as phf, ref and the shared helpers)

LAYERS = 3  # small_config's layers: failing at 0, 1 (a middle layer) and 2 (the last)
FAILURES = ["store", "raise"]  # paged_store refuses the layer's key / model code raises before its attention


class Interrupt(BaseException):
    """Raised by model code between layers, as KeyboardInterrupt would be."""


def public_state(cache):
    """What a PagedCache shows between forwards: positions, every layer's stored lengths, the lookup
    table, the pool size, which layers have pages, the padding mask crop reads. (The page tensors of
    a failed forward's growth stay until it is rolled back: pool_state.)"""
    layers = []
    for layer in range(LAYERS):
        try:
            cache.layer_pages(layer)
            layers.append(layer)
        except KeyError:
            pass
    return (cache.get_seq_length(), [layer.seen for layer in cache.layers],
            [None if layer.lengths is None else layer.lengths.tolist() for layer in cache.layers],
            None if cache.lookup_table is None else cache.lookup_table.tolist(), cache.num_pages, layers,
            None if cache._kept is None else cache._kept.tolist())


def pool_state(cache):
    """The pool's bookkeeping (row page lists, reference counts, free list) and its page tensors' sizes."""
    pool = cache.pool
    if pool is None:
        return None
    return (snapshot(cache)[0], sorted(pool.layers),
            {index: [tuple(t.shape) for t in pages.page_tensors()] for index, pages in pool.layers.items()})


def failed_step(cache, reference, new_positions, fail_layer, failure, gen):
    """A forward over new_positions (bool [B, q]) whose layers below fail_layer store and attend and
    whose layer fail_layer fails: "store" (paged_store refuses a key that requires grad) or "raise"
    (model code raised before the layer's attention). The reference is left as it was."""
    batch, q_len = new_positions.shape
    mask = torch.tensor([row + new.tolist() for row, new in zip(reference.positions, new_positions)])
    for layer in range(fail_layer + 1):
        query = torch.randn(batch, 4, q_len, 16, generator=gen)
        key, value = torch.randn(batch, 2, q_len, 16, generator=gen), torch.randn(batch, 2, q_len, 16, generator=gen)
        if layer < fail_layer:
            cache.attend(layer, query, key, value, mask, dict(OPTIONS))
        elif failure == "store":
            with pytest.raises(RuntimeError, match="key requires grad"):
                cache.attend(layer, query, key.requires_grad_(), value, mask, dict(OPTIONS))


PREFILL = torch.arange(7) >= torch.tensor([0, 3])[:, None]  # two left-padded rows of 7 and 4 tokens


@pytest.mark.parametrize("fail_layer", range(LAYERS))
@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("phase", ["prefill", "decode", "decode-shared"])
def test_a_failed_forward_changes_nothing(fail_layer, failure, phase):
    """A forward failing in layer fail_layer: the cache shows what it held before (positions, lengths,
    table, pool size, padding mask) at once; the next forward rolls the failed one back (the pool's
    bookkeeping and page tensors as before) and stores and attends as if it had never run, also after
    a reorder. decode-shared: the rows share their pages (reorder_cache([0, 0])), so the failed forward
    copied the shared last page for the row writing into it, growing the pool."""
    gen = torch.Generator().manual_seed(fail_layer)
    cache, reference = empty_cache_and_reference(4, rows=2)
    if phase != "prefill":
        forward_step(cache, reference, PREFILL, gen)
    if phase == "decode-shared":
        cache.reorder_cache(torch.tensor([0, 0]))
        reference.select([0, 0])
    shown, pool = public_state(cache), pool_state(cache)
    new = PREFILL if phase == "prefill" else torch.ones(2, 3, dtype=torch.bool)
    failed_step(cache, reference, new, fail_layer, failure, gen)
    assert public_state(cache) == shown
    if phase == "decode-shared" and fail_layer > 0:
        assert cache.pool.num_pages > shown[4], "the failed forward did not grow the pool: nothing is rolled back"
    failed_step(cache, reference, new, LAYERS - 1, "store", gen)  # a retry failing in the last layer
    assert public_state(cache) == shown
    cache._roll_back_step()  # what the next forward (or crop, reorder_cache, reset) does first
    assert pool_state(cache) == pool and public_state(cache) == shown
    forward_step(cache, reference, new, gen)
    check_stored(cache, reference)
    check_pool(cache.pool)
    failed_step(cache, reference, torch.ones(2, 1, dtype=torch.bool), fail_layer, failure, gen)
    cache.reorder_cache(torch.tensor([1, 0]))
    reference.select([1, 0])
    forward_step(cache, reference, torch.tensor([[True, False], [True, True]]), gen)
    check_stored(cache, reference)
    check_pool(cache.pool)


def test_a_forward_refused_at_the_first_layer_copies_no_shared_page():
    """Rows sharing their pages, a forward refused at layer 0: no copy on write stays behind (the
    table, reference counts and pool size as before), and a crop after it sees the rows as they were."""
    gen = torch.Generator().manual_seed(9)
    cache, reference = empty_cache_and_reference(4, rows=2)
    forward_step(cache, reference, torch.ones(2, 6, dtype=torch.bool), gen)
    cache.reorder_cache(torch.tensor([0, 0]))
    reference.select([0, 0])
    table, num_pages, pool = cache.lookup_table.clone(), cache.num_pages, pool_state(cache)
    failed_step(cache, reference, torch.ones(2, 1, dtype=torch.bool), 0, "store", gen)
    assert torch.equal(cache.lookup_table, table) and cache.num_pages == num_pages
    cache.crop(-1)
    reference.crop(1)
    check_stored(cache, reference)
    assert cache.pool.num_pages == num_pages and cache.pool.row_pages[0] == cache.pool.row_pages[1]
    assert pool_state(cache)[1:] == pool[1:]
    check_pool(cache.pool)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("fail_layer", range(LAYERS))
def test_fp8_pages_after_a_failed_forward_equal_a_cache_that_never_saw_it(kv_dtype, fail_layer):
    """FP8 pages (codes and scales), rows sharing pages: a cache whose forward failed in fail_layer
    and a twin that never ran it store and attend the same steps alike, bit for bit, and both read back
    each row's history as pagedkv.reference stores it."""
    gen = torch.Generator().manual_seed(11)
    config = small_config("llama")
    caches = [phf.PagedCache(config, page_size=4, kv_dtype=kv_dtype) for _ in range(2)]  # [0] sees the failure
    positions = [[], []]
    history = [[[] for _ in range(2)] for _ in range(LAYERS)]  # [layer][row]: the keys stored, in order

    def step(new, fail_at=None):
        """A forward of both caches (of the first alone when it fails at layer fail_at)."""
        mask = torch.tensor([row + n.tolist() for row, n in zip(positions, new)])
        keys = []
        for layer in range(LAYERS):
            query = 4 * torch.randn(2, 4, new.size(1), 16, generator=gen)
            key, value = (4 * torch.randn(2, 2, new.size(1), 16, generator=gen) for _ in range(2))
            if layer == fail_at:
                with pytest.raises(RuntimeError, match="key requires grad"):
                    caches[0].attend(layer, query, key.requires_grad_(), value, mask, dict(OPTIONS))
                return
            runs = caches[:1] if fail_at is not None else caches
            outs = [cache.attend(layer, query, key, value, mask, dict(OPTIONS)) for cache in runs]
            assert torch.equal(outs[0], outs[-1]), f"layer {layer}: attention differs from the twin's"
            keys.append(key)
        for layer, key in enumerate(keys):
            for row in range(2):
                history[layer][row].extend(key[row, :, new[row].nonzero().squeeze(1)].transpose(0, 1).unbind(0))
        for row in range(2):
            positions[row].extend(new[row].tolist())

    step(torch.arange(6) >= torch.tensor([0, 2])[:, None])
    for cache in caches:
        cache.reorder_cache(torch.tensor([0, 0]))
    positions[1] = list(positions[0])
    for layer in history:
        layer[1] = list(layer[0])
    step(torch.ones(2, 2, dtype=torch.bool), fail_at=fail_layer)
    step(torch.ones(2, 2, dtype=torch.bool))
    for cache in caches:
        cache.reorder_cache(torch.tensor([1, 0]))
    positions.reverse()
    for layer in history:
        layer.reverse()
    step(torch.ones(2, 1, dtype=torch.bool))
    group = caches[0].quant_group
    for layer in range(LAYERS):
        pages = [cache.layer_pages(layer) for cache in caches]
        lengths = [cache.layers[layer].lengths for cache in caches]
        assert torch.equal(lengths[0], lengths[1]) and lengths[0].tolist() == [len(row) for row in history[layer]]
        stored = [ref.gather_rows(p.k, p.k_scales, cache.lookup_table, n, quant_group=group)
                  for p, cache, n in zip(pages, caches, lengths)]
        for row in range(2):
            assert torch.equal(stored[0][row], stored[1][row]), f"layer {layer} row {row}: K differs from the twin's"
            keys = torch.stack(history[layer][row])
            expected_k = torch.zeros(1, keys.size(0), 2, 16, dtype=kv_dtype)
            expected_s = torch.ones(1, keys.size(0), 2, ref.num_scale_groups(16, group))
            ref.paged_store(keys, None, expected_k, None, torch.tensor([0, keys.size(0)], dtype=torch.int32),
                            torch.zeros(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), expected_s,
                            None, group)
            expected = ref.gather_rows(expected_k, expected_s, torch.zeros(1, 1, dtype=torch.int32),
                                       torch.tensor([keys.size(0)], dtype=torch.int32), quant_group=group)[0]
            assert torch.equal(stored[0][row], expected), f"layer {layer} row {row}: K differs from the reference"
    check_pool(caches[0].pool)


# ---- real models: the failure raised inside model.forward -------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    """The tiny random llama (3 layers), every parameter frozen (tests make one layer trainable)."""
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(small_config("llama"), attn_implementation="pagedkv").eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    model.requires_grad_(False)
    return model


def failing(model, fail_layer, failure):
    """Context: the next forward of `model` fails in layer fail_layer: "store" (the layer's weights
    require grad, the forward runs in grad mode: paged_store refuses its key), "attention" (the
    layer's attention is called with head_mask, which pagedkv's attention refuses after the cache
    update), "interrupt" (an Interrupt raised before the layer's attention)."""
    attention = model.model.layers[fail_layer].self_attn

    class Failing:
        def __enter__(self):
            self.hooks = []
            if failure == "store":
                attention.requires_grad_(True)
            elif failure == "attention":
                def add_head_mask(module, args, kwargs):
                    return args, {**kwargs, "head_mask": torch.ones(1)}
                self.hooks.append(attention.register_forward_pre_hook(add_head_mask, with_kwargs=True))
            else:
                def interrupt(module, args):
                    raise Interrupt()
                self.hooks.append(attention.register_forward_pre_hook(interrupt))
            return self

        def __exit__(self, *exc):
            attention.requires_grad_(False)
            for hook in self.hooks:
                hook.remove()

    return Failing()


MODEL_FAILURES = {"store": (RuntimeError, "paged_store: key, value require grad"), "attention": (NotImplementedError, "head_mask"),
                  "interrupt": (Interrupt, None)}


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "e4m3"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("failure", sorted(MODEL_FAILURES))
@pytest.mark.parametrize("fail_layer", range(LAYERS))
def test_model_forward_failing_in_a_layer_changes_nothing(llama, fail_layer, failure, phase, kv_dtype):
    """model(...) on a left-padded batch raising in layer fail_layer (prefill, or a decode step after
    a beam-style reorder_cache([0, 0]) made the rows share pages): the cache shows what it held before,
    and the following steps (a reorder, decode steps) give the logits of a twin cache that never saw the
    failed forward, bit for bit; those equal pagedkv attention over transformers' own cache."""
    ids, mask = left_padded([6, 3], seed=fail_layer)
    argument = phf._cache_argument(llama)
    caches = [phf.PagedCache(llama, page_size=4, kv_dtype=kv_dtype) for _ in range(2)]  # [0] sees the failure
    default = transformers.DynamicCache()

    def forward(cache, ids, mask):
        with torch.no_grad():
            return llama(input_ids=ids, attention_mask=mask, **{argument: cache}).logits

    if phase == "decode":
        for cache in caches:
            forward(cache, ids, mask)
            cache.reorder_cache(torch.tensor([0, 0]))
        ids, mask = ids[[0, 0], -1:], torch.cat([mask[[0, 0]], torch.ones(2, 1, dtype=mask.dtype)], 1)
    shown = public_state(caches[0])
    error, match = MODEL_FAILURES[failure]
    with failing(llama, fail_layer, failure), torch.enable_grad(), pytest.raises(error, match=match):
        llama(input_ids=ids, attention_mask=mask, **{argument: caches[0]})
    assert public_state(caches[0]) == shown
    steps = [(ids, mask)]
    if phase == "prefill":  # then decode steps of the same batch after a reorder
        steps.append((ids[[1, 0], -1:], torch.cat([mask[[1, 0]], torch.ones(2, 1, dtype=mask.dtype)], 1)))
    else:
        steps.append((ids[:, -1:], torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)))
    for number, (step_ids, step_mask) in enumerate(steps):
        if number == 1 and phase == "prefill":
            for cache in caches:
                cache.reorder_cache(torch.tensor([1, 0]))
        logits = [forward(cache, step_ids, step_mask) for cache in caches]
        assert torch.equal(logits[0], logits[1]), f"step {number}: logits differ from the twin cache's"
    assert public_state(caches[0]) == public_state(caches[1])
    check_pool(caches[0].pool)
    if kv_dtype == torch.float32 and phase == "prefill":
        # the twin against transformers' cache: the prefill, the reorder, the decode step
        expected = forward(default, *steps[0])
        default.reorder_cache(torch.tensor([1, 0]))
        expected = forward(default, *steps[1])
        torch.testing.assert_close(logits[1][:, -1], expected[:, -1], rtol=1e-5, atol=1e-5)


def test_the_reported_case_frozen_first_layer_decode_in_grad_mode(llama):
    """The report: layer 0 frozen, the others trainable, prefill under no_grad, one decode step in grad
    mode. The refused step left layer 0 one position ahead (get_seq_length 6 for 5 stored positions,
    crop and reorder_cache refused, later forwards off by one); now the cache holds its 5 positions
    and continues as if the step had never run."""
    argument = phf._cache_argument(llama)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    caches = [phf.PagedCache(llama, page_size=4) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            llama(input_ids=ids[:, :5], **{argument: cache})
    for layer in llama.model.layers[1:]:
        layer.requires_grad_(True)
    try:
        with pytest.raises(RuntimeError, match="paged_store: key, value require grad"):
            llama(input_ids=ids[:, 5:], **{argument: caches[0]})
    finally:
        llama.requires_grad_(False)
    assert caches[0].get_seq_length() == 5
    assert [layer.lengths.tolist() for layer in caches[0].layers] == [[5]] * LAYERS
    with torch.no_grad():
        got = llama(input_ids=ids[:, 5:], **{argument: caches[0]}).logits
        expected = llama(input_ids=ids[:, 5:], **{argument: caches[1]}).logits
    assert torch.equal(got, expected)
    for cache in caches:
        cache.crop(-2)  # refused before ("the layers hold [5, 6] positions")
        cache.reorder_cache(torch.tensor([0]))
    assert public_state(caches[0]) == public_state(caches[1]) and caches[0].get_seq_length() == 4
