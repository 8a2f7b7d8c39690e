"""The continuous-batching server (``pagedkv.serving``) under faults and aborts: a step that fails
(an exception in one layer, a refused reservation, a model that returns the wrong rows) leaves every
request and the page manager as they were before it; ``abort`` drops a request wherever it is; bad
prompts are refused at submit. Tokens are compared with the same requests run alone."""

import pytest
import torch
from pagedkv import gguf_model
from pagedkv.llama import LlamaPagedModel, make_kv_cache
from pagedkv.serving import ContinuousBatchingServer, Request, page_manager_for

PAGE_SIZE = 4


@pytest.fixture(scope="module")
def loaded():
    return gguf_model.random_tiny_llama(0)


def make_server(loaded, num_pages, **options):
    kv_cache = make_kv_cache(loaded.config, num_pages, PAGE_SIZE)
    model = LlamaPagedModel.from_state_dict(loaded.config, loaded.state_dict, kv_cache=kv_cache)
    return ContinuousBatchingServer(model, page_manager_for(kv_cache), [], torch.device("cpu"), **options)


def run_to_end(server, limit=1000):
    for _ in range(limit):
        if not server.has_work():
            return
        server.step()
    raise AssertionError("the server did not finish its requests")


def solo_tokens(loaded, prompt, max_new_tokens):
    server = make_server(loaded, num_pages=64)
    server.submit(Request(0, 0, "", list(prompt), max_new_tokens))
    run_to_end(server)
    return server.finished[0].generated


PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [256, 50], [256, 9, 8, 7, 6, 5, 4]]


def snapshot(server):
    """What a failed step must leave unchanged: each request's place and tokens, each sequence's
    length and pages in the manager, the manager's counters."""
    manager = server.page_manager
    manager.check_invariants()
    live = [r.request_id for r in server.running]
    return {
        "pending": [r.request_id for r in server.pending],
        "waiting": [r.request_id for r in server.waiting],
        "running": live,
        "generated": {r.request_id: list(r.generated) for r in (*server.running, *server.waiting)},
        "admitted_step": {r.request_id: r.admitted_step for r in (*server.running, *server.waiting)},
        "lengths": {i: manager.length(i) for i in live},
        "sequences": manager.num_sequences,
        "step_index": server.step_index,
    }


def submit_all(server, arrivals):
    for request_id, (prompt, arrival) in enumerate(zip(PROMPTS, arrivals)):
        server.submit(Request(request_id, arrival, "", list(prompt), 6))


def expected_tokens(loaded):
    return {i: solo_tokens(loaded, prompt, 6) for i, prompt in enumerate(PROMPTS)}


class FailingStore:
    """A cache whose store raises once, in layer ``layer``, on the ``call``-th store of that layer
    (the earlier layers of that forward have stored their K/V)."""

    def __init__(self, kv_cache, layer, call):
        self.kv_cache, self.layer, self.remaining = kv_cache, layer, call

    def store(self, layer, *args):
        if layer == self.layer:
            self.remaining -= 1
            if self.remaining == 0:
                raise RuntimeError("injected: store refused")
        return self.kv_cache.store(layer, *args)

    def attention(self, *args, **kwargs):
        return self.kv_cache.attention(*args, **kwargs)


@pytest.mark.parametrize("failing_layer", [0, 2])
def test_a_step_that_fails_in_a_layer_changes_nothing(loaded, failing_layer):
    """Request 2 arrives at step 2 and is admitted into a step whose forward fails in a layer. On the
    old server it stayed running with its prompt uncomputed (a row of 0 tokens next step, or the
    last prompt token fed as a decode row of a cache holding nothing)."""
    expected = expected_tokens(loaded)
    server = make_server(loaded, num_pages=32)
    submit_all(server, [0, 0, 2, 5])
    server.step()
    server.step()  # steps 0, 1: requests 0 and 1 prefill and decode
    before = snapshot(server)
    server.model.kv_cache = FailingStore(server.model.kv_cache, failing_layer, call=1)
    with pytest.raises(RuntimeError, match="injected: store refused") as failure:
        server.step()
    after = snapshot(server)
    # request 2 had moved from pending to waiting: that is the only change
    assert before["pending"] == [2, 3] and after["pending"] == [3]
    assert after["waiting"] == [2]
    assert {k: v for k, v in after.items() if k not in ("pending", "waiting", "generated", "admitted_step")} == {
        k: v for k, v in before.items() if k not in ("pending", "waiting", "generated", "admitted_step")
    }
    assert after["generated"][2] == [] and after["admitted_step"][2] is None
    assert all(after["generated"][i] == before["generated"][i] for i in (0, 1))
    assert "step 2 failed and was rolled back" in "\n".join(getattr(failure.value, "__notes__", []))
    run_to_end(server)  # the store refuses once only
    assert {r.request_id: r.generated for r in server.finished} == expected
    assert server.page_manager.used_pages == 0 and server.page_manager.num_sequences == 0


def test_a_refused_reservation_for_an_admitted_request_changes_nothing(loaded, monkeypatch):
    """The old server took the sequence id (add_sequence) before the reservation that raised, so every
    later step failed with 'seq_id already in use' and nothing was served again."""
    expected = expected_tokens(loaded)
    server = make_server(loaded, num_pages=32)
    submit_all(server, [0, 0, 0, 0])
    manager = server.page_manager
    reserve = manager.reserve
    calls = []

    def refuse_third(seq_id, count):
        calls.append(seq_id)
        if len(calls) == 3:
            raise ValueError("injected: reservation refused")
        return reserve(seq_id, count)

    monkeypatch.setattr(manager, "reserve", refuse_third)
    with pytest.raises(ValueError, match="injected"):
        server.step()
    assert [r.request_id for r in server.waiting] == [0, 1, 2, 3] and not server.running
    assert manager.num_sequences == 0 and manager.used_pages == 0
    assert all(r.admitted_step is None and r.prefix_cached_tokens == 0 for r in server.waiting)
    manager.check_invariants()
    run_to_end(server)
    assert {r.request_id: r.generated for r in server.finished} == expected
    assert manager.used_pages == 0 and manager.num_sequences == 0


def test_logits_for_too_few_rows_advance_no_row(loaded):
    """The old server committed and advanced the first rows, then failed with an IndexError: the last
    row's request had its tokens uncommitted while the others had moved on."""
    server = make_server(loaded, num_pages=32)
    submit_all(server, [0, 0, 0, 0])
    server.step()
    before = snapshot(server)
    model = server.model
    server.model = lambda *args: model(*args)[:-1]
    with pytest.raises(RuntimeError, match=r"the model returned logits of shape \(3, 258\), expected \[4, vocab\]"):
        server.step()
    assert snapshot(server) == before
    server.model = model
    run_to_end(server)
    assert {r.request_id: r.generated for r in server.finished} == expected_tokens(loaded)
    assert server.page_manager.used_pages == 0


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([256, 258], r"prompt\[1\] = 258 is not a token id in \[0, 258\)"),
        ([-1], r"prompt\[0\] = -1 is not a token id in \[0, 258\)"),
        ([1, True], r"prompt\[1\] = True is not a token id"),
        ([1, 2.0], r"prompt\[1\] = 2.0 is not a token id"),
    ],
)
def test_prompt_tokens_the_model_cannot_take_are_refused_at_submit(loaded, prompt, message):
    """A token past the vocabulary used to be accepted: its first step failed in the embedding, and so
    did every later step (the request was admitted again each time), so no request was served."""
    server = make_server(loaded, num_pages=16)
    server.submit(Request(0, 0, "", [256, 5, 6], 3))
    with pytest.raises(ValueError, match=message):
        server.submit(Request(1, 0, "", prompt, 3))
    run_to_end(server)
    assert [r.request_id for r in server.finished] == [0]


def test_vocab_size_argument_is_checked(loaded):
    server = make_server(loaded, num_pages=4)
    assert server.vocab_size == 258  # from the model's config
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1 or None, got 0"):
        ContinuousBatchingServer(server.model, server.page_manager, [], torch.device("cpu"), vocab_size=0)
    plain = ContinuousBatchingServer(lambda *a: None, server.page_manager, [], torch.device("cpu"))
    assert plain.vocab_size is None
    with pytest.raises(ValueError, match=r"prompt\[0\] = 2147483648 is not a token id in \[0, 2147483648\)"):
        plain.submit(Request(0, 0, "", [2**31], 1))


@pytest.mark.parametrize("where", ["pending", "waiting", "running", "preempted"])
def test_abort_drops_a_request_wherever_it_is(loaded, where):
    expected = expected_tokens(loaded)
    # 6 pages of 4 tokens: two requests running at full length need 8, so one gets preempted
    server = make_server(loaded, num_pages=6 if where == "preempted" else 32, max_running=2)
    submit_all(server, [0, 0, 0, 50])
    for _ in range(3):
        server.step()
    if where == "preempted":
        while server.preemptions == 0:
            server.step()
        target = server.waiting[0].request_id
    else:
        target = {"pending": 3, "waiting": server.waiting[-1].request_id, "running": server.running[0].request_id}[where]
    held = server.page_manager.used_pages
    request = server.abort(target)
    assert request.finish_reason == "abort" and request.finished_step == server.step_index
    assert server.finished[-1] is request
    assert all(target not in [r.request_id for r in queue] for queue in (server.pending, server.waiting, server.running))
    assert target not in server.page_manager
    if where == "running":
        assert server.page_manager.used_pages < held
    server.page_manager.check_invariants()
    with pytest.raises(KeyError, match=f"no submitted, unfinished request has request_id {target}"):
        server.abort(target)
    run_to_end(server)
    tokens = {r.request_id: r.generated for r in server.finished}
    for request_id, generated in tokens.items():
        if request_id == target:
            # what it generated before the abort is the start of its solo run
            assert generated == expected[target][: len(generated)]
        else:
            assert generated == expected[request_id]
    assert server.page_manager.used_pages == 0 and server.page_manager.num_sequences == 0
    server.submit(Request(target, server.step_index, "", list(PROMPTS[target]), 6))  # the id is free again
    run_to_end(server)
    assert server.finished[-1].generated == expected[target]
