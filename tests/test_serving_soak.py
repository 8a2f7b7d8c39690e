"""The seeded soak of the continuous-batching server (``pagedkv.demo.soak``) at CI size: about a
thousand requests of random lengths on the tiny random model, with aborts, bad requests, preemption,
shared prefixes and steps that fail in a layer; every request compared with its solo run. The long
run is ``python -m pagedkv.demo.soak`` (benchmarks/README.md)."""

import pytest
import torch
from pagedkv.demo import soak

pytestmark = pytest.mark.soak


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's matmuls are too small to share between threads: with torch's default of one
    thread per core the soak spends most of its time in OpenMP hand-offs (about ten times as long on
    two busy cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def loaded():
    return soak.tiny_soak_model(0)


def test_soak_pages_return_to_zero_and_tokens_equal_solo_runs(loaded):
    settings = soak.SoakSettings(num_requests=1000, seed=0)
    result = soak.run_soak(settings, loaded, [loaded.config.eos_token_id])
    # every request compared with the same request run alone
    assert result.mismatches == []
    assert result.checked == result.completed + result.aborted == settings.num_requests
    # the tokens of requests whose first difference is a tie of the solo logits are not compared
    # past it: there must be few enough that the comparison still covers the run
    assert len(result.ties) <= result.checked // 100, result.ties
    assert result.final_used_pages == 0 and result.final_sequences == 0
    assert result.final_free_pages == settings.num_pages
    # the paths the soak is for were taken (drawn by the seed: fixed for this seed)
    assert result.preemptions > 0 and result.preempted_requests > 0
    assert result.peak_pages_used == settings.num_pages
    assert result.aborted_running > 0 and result.aborted > result.aborted_running
    assert result.refused > 0 and result.injected_faults > 0
    assert result.prefix_cached_tokens > 0
    assert result.completed_on_stop > 0


class ReadsAnotherRowsPages:
    """A broken cache: layer 1 attends over the first two rows' pages swapped."""

    def __init__(self, kv_cache):
        self.kv_cache = kv_cache

    def store(self, *args):
        return self.kv_cache.store(*args)

    def attention(self, layer, q, input_row_offsets, cache_lengths, lookup_table):
        if layer == 1 and lookup_table.shape[0] >= 2:
            lookup_table = lookup_table.clone()
            lookup_table[[0, 1]] = lookup_table[[1, 0]]
        return self.kv_cache.attention(layer, q, input_row_offsets, cache_lengths, lookup_table)


def test_soak_comparison_catches_a_server_that_reads_another_rows_pages(loaded):
    """The comparison with solo runs is not vacuous: the tiny model's tokens depend on the history it
    attends over, so a server mixing two rows' pages fails it."""

    def break_cache(model):
        model.kv_cache = ReadsAnotherRowsPages(model.kv_cache)
        return model

    settings = soak.SoakSettings(num_requests=100, seed=1, fault_share=0.0)
    result = soak.run_soak(settings, loaded, [loaded.config.eos_token_id], wrap_model=break_cache)
    assert result.mismatches and not result.ok
    assert result.final_used_pages == 0


def test_latency_histogram_percentiles():
    histogram = soak.LatencyHistogram()
    assert histogram.percentile(0.5) is None
    for value in range(1, 101):  # 1..100 ms
        histogram.add(value / 1000)
    # a percentile is its bucket's upper edge: the exact order statistic, at most 1% high
    for fraction, exact in ((0.5, 0.050), (0.99, 0.099), (1.0, 0.100), (0.01, 0.001)):
        assert exact <= histogram.percentile(fraction) <= exact * soak.LatencyHistogram.RATIO
    assert histogram.summary_ms()["count"] == 100
