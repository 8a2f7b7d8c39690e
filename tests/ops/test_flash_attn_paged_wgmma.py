"""flash_attn_paged's warpgroup-MMA kernels (kernel option cuda_prefill_wgmma: sm_90a code on a cc 9.x
device; opt-in until its first GPU run decides it) against pagedkv.reference: batches whose packed (query
row, query head) rows fill 64-row query tiles (prefill, chunked prefill, speculative-decoding verification
with GQA) at head sizes 64 and 128, bf16 and fp16, 16-bit and FP8 caches (row scales and
scale groups), both Hopper loaders, causal and not, windows, softcap, sinks and LSE, split-KV, page sizes 1
to 256, query tiles and key tiles cut at every boundary, NaN in slots no query sees, scores that rise past
the float range. Each test also checks, with the profiler, that a warpgroup kernel ran. Skipped where the
device does not run them (no GPU, not cc 9.x, a build without sm_90a).
"""

from __future__ import annotations

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

pytestmark = pytest.mark.usefixtures("cuda_knobs")

LOADERS = {0: "cp.async", 1: "tma-pages"}  # the loaders of a cc 9.x device
# rows (cached, new): prefill chunks onto prefixes, a fresh prompt, a decode row and a short chunk among
# them (>= 128 packed rows per batch row with 8 query heads), tails of query and key tiles
ROWS = [(300, 70), (0, 200), (777, 1), (5, 130), (64, 3)]


def wgmma_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not _C.cuda_wgmma_available(torch.cuda.current_device()):
        pytest.skip("the warpgroup-MMA kernels need sm_90a code on a cc 9.x device")


def wgmma_kernels_launched(fn):
    """Runs fn under the profiler; the names of the warpgroup attention kernels it launched
    (attn_kernel<D, T, fp8, loader, 64, true>, demangled or not)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "attn_kernel" in e.name and ("64, true>" in e.name or "Li64ELb1EEEv" in e.name)]


def attend_wgmma(rows, *, head_dim, q_dtype, cache_dtype, page_size=16, loader=1, splits=0, q_heads=8,
                 num_kv_heads=2, quant_group=None, q_scale=1.0, lse=False, sinks=False, seed=(), **options):
    """Attend on CUDA with the warpgroup kernels forced and compare with the float64 reference; returns
    False where the forced loader does not fit the page size."""
    pagedkv.set_kernel_options(cuda_prefill_wgmma=True, cuda_splits=splits)
    _C.set_cuda_loader(loader)
    group = quant_group or head_dim
    gen = generator(seed_from("wgmma", *seed, head_dim, str(q_dtype), str(cache_dtype), page_size, loader, splits,
                              q_heads, num_kv_heads, group, q_scale, lse, sinks, *sorted(options.items())))
    kv, batch = make_setup(gen, rows, layout="separate", page_size=page_size, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, dtype=cache_dtype, quant_group=group, padding=2, device="cuda")
    kv.poison_("nan")
    fill_history(gen, kv, batch)
    q = randn(gen, (batch.num_tokens, q_heads, head_dim), q_dtype, "cuda", scale=q_scale)
    sink_values = randn(gen, (q_heads,), torch.float32, "cuda", scale=3.0) if sinks else None
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=group, sinks=sink_values, **options)
    op = pagedkv.flash_attn_paged_lse if lse else pagedkv.flash_attn_paged
    result = {}
    try:
        launched = wgmma_kernels_launched(lambda: result.setdefault("out", op(*args, **kwargs)))
    except RuntimeError as e:  # this page size does not fit the TMA loader
        assert "does not fit" in str(e)
        return False
    assert launched, f"no warpgroup-MMA kernel ran for {seed} {options}"
    what = f"wgmma {seed} D {head_dim} {q_dtype} {cache_dtype} page {page_size} {LOADERS[loader]} splits {splits}"
    if lse:
        out, lse_out = result["out"]
        expected, expected_lse = ref.flash_attn_paged_lse(q.double(), *args[1:], **kwargs)
        assert_lse_close(lse_out, expected_lse, q_dtype, what, q16_on_cuda=True)
    else:
        out, expected = result["out"], ref.flash_attn_paged(q.double(), *args[1:], **kwargs)
    assert_attention_close(out, expected, q_dtype, what, q16_on_cuda=True)
    assert bool((out[-2:] == 0).all()), "padding rows must be zeros"
    return True


@CUDA_ONLY
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("head_dim, dtype", [(64, torch.bfloat16), (64, torch.float16), (128, torch.bfloat16),
                                             (128, torch.float16)],
                         ids=lambda x: dtype_name(x) if isinstance(x, torch.dtype) else str(x))
@pytest.mark.parametrize("causal", [True, False])
def test_wgmma_prefill_16_bit(loader, page_size, head_dim, dtype, causal):
    """16-bit caches: the plan's splits, one split (every CTA over all its key tiles), three splits, windows."""
    wgmma_or_skip()
    for splits, window in ((0, -1), (1, -1), (3, -1), (1, 23), (3, 100)):
        if not attend_wgmma(ROWS, head_dim=head_dim, q_dtype=dtype, cache_dtype=dtype, page_size=page_size,
                            loader=loader, splits=splits, causal=causal, window_left=window, seed=("16-bit",)):
            pytest.skip("the forced loader does not fit this page size")


@CUDA_ONLY
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=dtype_name)
@pytest.mark.parametrize("group", ["row", 32])
def test_wgmma_prefill_fp8(loader, head_dim, q_dtype, cache_dtype, group):
    """FP8 caches converted on the way in (one scale per row, or groups of 32 channels), page 16 and 64."""
    wgmma_or_skip()
    for page_size, splits in ((16, 0), (64, 1)):
        if not attend_wgmma(ROWS, head_dim=head_dim, q_dtype=q_dtype, cache_dtype=cache_dtype, page_size=page_size,
                            loader=loader, splits=splits, quant_group=head_dim if group == "row" else group,
                            seed=("fp8",)):
            pytest.skip("the forced loader does not fit this page size")


@CUDA_ONLY
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("q_heads, num_kv_heads", [(4, 4), (8, 1), (16, 2), (12, 3)])
@pytest.mark.parametrize("option", ["softcap", "sinks", "lse", "sinks+lse+window"])
def test_wgmma_gqa_softcap_sinks_lse(loader, q_heads, num_kv_heads, option):
    """GQA 1, 8, 8 and 4 (a query tile spans several query rows' heads), with softcap, sinks, the
    log-sum-exp, or sinks and LSE under a window with split-KV."""
    wgmma_or_skip()
    case = {"softcap": dict(softcap=20.0, q_scale=3.0), "sinks": dict(sinks=True), "lse": dict(lse=True),
            "sinks+lse+window": dict(sinks=True, lse=True, window_left=40, splits=3)}[option]
    g = q_heads // num_kv_heads  # >= 128 packed rows per batch row at every GQA ratio
    rows = [(300, 600 // g), (0, 1200 // g), (777, 1), (64, 3)]
    attend_wgmma(rows, head_dim=128, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, loader=loader,
                 q_heads=q_heads, num_kv_heads=num_kv_heads, seed=(option,), **case)


@CUDA_ONLY
@pytest.mark.parametrize("new_tokens", [4, 8])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_wgmma_speculative_verification(new_tokens, cache_dtype):
    """Speculative-decoding verification: several new tokens per row over long caches, GQA 8 (16 query
    heads, 2 KV heads), 32 or 64 packed rows per row: 8 new tokens fill a 64-row tile, 4 do not (the
    default kernel then), causal, both against the reference."""
    wgmma_or_skip()
    rows = [(cached, new_tokens) for cached in (500, 37, 1300, 64, 999, 5, 256, 700)]
    if new_tokens * 8 >= 64:
        attend_wgmma(rows, head_dim=128, q_dtype=torch.bfloat16, cache_dtype=cache_dtype, q_heads=16,
                     num_kv_heads=2, causal=True, seed=("verification", new_tokens))
    else:  # too few packed rows: the plan keeps the default kernel
        pagedkv.set_kernel_options(cuda_prefill_wgmma=True)
        gen = generator(seed_from("verification", new_tokens, str(cache_dtype)))
        kv, batch = make_setup(gen, rows, layout="separate", page_size=16, num_kv_heads=2, head_dim=128,
                               dtype=cache_dtype, device="cuda")
        fill_history(gen, kv, batch)
        q = randn(gen, (batch.num_tokens, 16, 128), torch.bfloat16, "cuda")
        args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, batch.lookup_table)
        kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales)
        result = {}
        assert not wgmma_kernels_launched(lambda: result.setdefault("out", pagedkv.flash_attn_paged(*args, **kwargs)))
        assert_attention_close(result["out"], ref.flash_attn_paged(q.double(), *args[1:], **kwargs), torch.bfloat16,
                               "verification, 4 new tokens")


@CUDA_ONLY
@pytest.mark.parametrize("new", [63, 64, 65, 127, 129])
@pytest.mark.parametrize("cached", [0, 1, 63, 64, 65, 191])
def test_wgmma_tile_boundaries(new, cached):
    """Query tiles of 64 packed rows (GQA 1 here: one query head per KV head, so new rows are packed rows)
    and key tiles of 64 cut just before, at and after their boundaries, causal, one split."""
    wgmma_or_skip()
    rows = [(cached, new), (0, 400), (cached + 5, new + 64)]  # >= 128 packed rows per batch row
    attend_wgmma(rows, head_dim=64, q_dtype=torch.bfloat16, cache_dtype=torch.bfloat16, q_heads=2, num_kv_heads=2,
                 splits=1, causal=True, seed=("boundaries", new, cached))


@CUDA_ONLY
@pytest.mark.parametrize("step", [1.0, 100.0, 300.0])
def test_wgmma_rising_scores(step):
    """Scores rising by `step` per 64 keys (conftest.rising_scores: a 300-token chunk and a decode token over
    300 cached keys): every rescale factor below 2^-126 at the large steps."""
    wgmma_or_skip()
    pagedkv.set_kernel_options(cuda_prefill_wgmma=True)
    args = rising_scores(torch.bfloat16, step, "cuda", new=(300, 1))
    result = {}
    assert wgmma_kernels_launched(lambda: result.setdefault("out", pagedkv.flash_attn_paged(*args)))
    cpu_args = [t.cpu() for t in args]
    expected = ref.flash_attn_paged(cpu_args[0].double(), *cpu_args[1:])
    assert_attention_close(result["out"], expected, torch.bfloat16, f"wgmma, scores rising {step} per tile")


@CUDA_ONLY
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_wgmma_nan_in_slots_no_query_sees(loader, cache_dtype):
    """NaN keys, values and scales before every query row's window and past every row's keys (recycled
    pages): masked before any product, so the output is finite and equals the reference."""
    wgmma_or_skip()
    pagedkv.set_kernel_options(cuda_prefill_wgmma=True)
    _C.set_cuda_loader(loader)
    rows, window = [(300, 100), (100, 130), (20, 200)], 23
    gen = generator(seed_from("wgmma nan", loader, str(cache_dtype)))
    kv, batch = make_setup(gen, rows, layout="separate", page_size=16, num_kv_heads=2, head_dim=128,
                           dtype=cache_dtype, device="cuda")
    kv.poison_("nan")
    fill_history(gen, kv, batch)
    for b, (cached, _) in enumerate(rows):
        keys = torch.arange(max(cached - window, 0), device="cuda")
        pages, slots = batch.lookup_table[b, keys // 16].long(), keys % 16
        for t in (kv.k_cache, kv.v_cache, kv.k_scales, kv.v_scales):
            if t is not None:
                t[pages, slots] = float("nan")
    q = randn(gen, (batch.num_tokens, 8, 128), torch.bfloat16, "cuda")
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, window_left=window)
    result = {}
    assert wgmma_kernels_launched(lambda: result.setdefault("out", pagedkv.flash_attn_paged(*args, **kwargs)))
    expected = ref.flash_attn_paged(q.double(), *args[1:], **kwargs)
    assert torch.isfinite(expected).all()
    assert_attention_close(result["out"], expected, torch.bfloat16, f"wgmma, NaN before the window, {loader}")


@CUDA_ONLY
def test_wgmma_option_off_by_default_and_same_as_default_kernel():
    """Off by default; on, a prefill's output agrees with the default kernel's within the 16-bit output's
    rounding (both accumulate in float32), and decode calls keep the default kernel."""
    wgmma_or_skip()
    assert pagedkv.kernel_options()["cuda_prefill_wgmma"] is False
    gen = generator(seed_from("wgmma vs default"))
    kv, batch = make_setup(gen, [(500, 300), (0, 257)], layout="separate", page_size=16, num_kv_heads=2,
                           head_dim=128, dtype=torch.bfloat16, device="cuda")
    fill_history(gen, kv, batch)
    q = randn(gen, (batch.num_tokens, 8, 128), torch.bfloat16, "cuda")
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, batch.lookup_table)
    default = pagedkv.flash_attn_paged(*args)
    assert not wgmma_kernels_launched(lambda: pagedkv.flash_attn_paged(*args))
    pagedkv.set_kernel_options(cuda_prefill_wgmma=True)
    result = {}
    assert wgmma_kernels_launched(lambda: result.setdefault("out", pagedkv.flash_attn_paged(*args)))
    torch.testing.assert_close(result["out"].float(), default.float(), rtol=2e-2, atol=2e-2)
    # decode (one new token per row): not prefill-like, the default kernel
    kv2, batch2 = make_setup(gen, [(500, 1), (70, 1)], layout="separate", page_size=16, num_kv_heads=2,
                             head_dim=128, dtype=torch.bfloat16, device="cuda")
    fill_history(gen, kv2, batch2)
    q2 = randn(gen, (batch2.num_tokens, 8, 128), torch.bfloat16, "cuda")
    args2 = (q2, batch2.input_row_offsets, kv2.k_cache, kv2.v_cache, batch2.cache_lengths, batch2.lookup_table)
    assert not wgmma_kernels_launched(lambda: pagedkv.flash_attn_paged(*args2))
