"""Continuous batching over a paged KV cache: the server loop that ``python -m pagedkv.demo`` and
``pagedkv.hf.generate_batch`` share.

Requests arrive at different steps of a server loop. Every step:

1. requests whose arrival step has come join the waiting queue;
2. each running request needs room for one more token; when the pool has no free page for it,
   the most recently admitted running request is **preempted**: its pages are released and it goes
   back to the front of the waiting queue, to be recomputed later from prompt + generated tokens;
3. if nothing was preempted, waiting requests are admitted in arrival order while their whole
   (re)prefill fits in the free pages and in the per-step prefill token budget;
4. one ragged forward pass runs the new requests' prefill rows together with one decode row per
   running request, greedy tokens are appended, and requests finishing on EOS or on
   ``max_new_tokens`` release their pages.

A step either completes or leaves every request where it was: when the forward pass (or a
reservation for an admitted request) raises, the requests admitted in that step release their
pages and go back to the front of the waiting queue, no running request has advanced (each keeps
the room reserved for its next token, which the next step uses), and the exception propagates with
a note naming the step's rows. Requests preempted in that step stay
preempted (their pages were released before the forward; they are recomputed when readmitted).

``abort(request_id)`` stops a request between steps, wherever it is (not yet arrived, waiting,
running): its pages are released and it joins ``finished`` with ``finish_reason == "abort"`` and the
tokens generated so far.

``finished`` and ``records`` grow by one entry per finished request and per step; a server that
runs indefinitely should take their entries out (and clear them) as it goes.

The model is any callable ``model(tokens, positions, input_row_offsets, cache_lengths,
lookup_table) -> logits [B, vocab]`` over the pages the page manager hands out
(``pagedkv.llama.LlamaPagedModel``, ``pagedkv.hf.TransformersPagedModel``).
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import sys
import time
from collections.abc import Callable, Sequence

import torch

from .page_manager import PageManager

__all__ = ["ContinuousBatchingServer", "ProgressBar", "Request", "StepRecord", "page_manager_for"]


@dataclasses.dataclass
class Request:
    request_id: int
    arrival_step: int
    message: str
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)
    # float32 [vocab] logits that produced each generated token (kept only for --check)
    step_logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    admitted_step: int | None = None
    finished_step: int | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    prefix_cached_tokens: int = 0  # prompt tokens found in live requests' pages, over all admissions

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def max_total_tokens(self) -> int:
        # The last generated token is never fed back, so it never occupies the cache.
        return len(self.prompt) + self.max_new_tokens - 1


@dataclasses.dataclass
class StepRecord:
    step: int
    seconds: float
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    pages_used: int  # during the forward pass (after reserving, before releasing)
    shared_pages: int
    holding: list[int]  # requests holding pages during the forward pass
    preempted: list[int]
    admitted: list[int]
    finished: list[int]


class ProgressBar:
    """tqdm on stderr when installed, else a one-line bar redrawn in place."""

    def __init__(self, total: int, enabled: bool = True):
        self.total = total
        self.count = 0
        self.enabled = enabled
        self._tqdm = None
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, desc="generating", unit="tok", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self._tqdm = None

    def update(self, count: int, total: int, status: str) -> None:
        self.count, self.total = count, total
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.total = total
            self._tqdm.n = count
            self._tqdm.set_postfix_str(status, refresh=False)
            self._tqdm.refresh()
            return
        width = 30
        filled = int(width * count / max(total, 1))
        sys.stderr.write(f"\rgenerating [{'#' * filled}{'.' * (width - filled)}] {count}/{total} tok {status}")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            sys.stderr.write("\n")


def page_manager_for(kv_cache) -> PageManager:
    """A page manager over a cache object's pages (pagedkv.cache); copy-on-write copies apply to every
    tensor holding them (`page_tensors()`: blocks or pools, and their scales)."""
    return PageManager(kv_cache.num_pages, kv_cache.page_size, caches=kv_cache.page_tensors())


class ContinuousBatchingServer:
    """The scheduling loop of the module docstring over one model, cache and page manager."""

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        page_manager,
        stop_token_ids: Sequence[int],
        device: torch.device,
        max_prefill_tokens: int = 512,
        max_running: int = 16,
        record_logits: bool = False,
        vocab_size: int | None = None,
    ):
        # With no running slot nothing is ever admitted: step() would run forever.
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            raise ValueError(f"max_running must be an int >= 1, got {max_running!r}")
        self.model = model
        self.page_manager = page_manager
        self.stop_token_ids = {int(t) for t in stop_token_ids}
        self.device = device
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = max_running
        self.record_logits = record_logits
        # Prompt token ids are checked against this at submit (a token past the embedding table
        # failed the whole step it was admitted in); default: the model's config.vocab_size.
        if vocab_size is None:
            vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size < 1):
            raise ValueError(f"vocab_size must be an int >= 1 or None, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.pending: list[Request] = []  # not arrived yet, by arrival step
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.finished: list[Request] = []
        self.records: list[StepRecord] = []
        self.step_index = 0
        self.preemptions = 0

    # -- bookkeeping ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        # Refused here, before step() hands the request to the page manager: an empty prompt has no token
        # to compute the first logits from (step() raised after add_sequence had taken the id, and every
        # later step raised again); max_new_tokens 0 still generated one token, and its max_total_tokens
        # (prompt - 1) undercounts the prefill, so a prompt one page larger than the pool was accepted and
        # never admitted (step() looped forever); a second request with a live id failed add_sequence in
        # the middle of a step.
        if not request.prompt:
            raise ValueError(f"request {request.request_id}: prompt is empty; a request needs at least one token")
        if isinstance(request.max_new_tokens, bool) or not isinstance(request.max_new_tokens, int) \
                or request.max_new_tokens < 1:
            raise ValueError(f"request {request.request_id}: max_new_tokens must be an int >= 1, "
                             f"got {request.max_new_tokens!r}")
        self._check_prompt(request)
        if any(r.request_id == request.request_id for r in (*self.pending, *self.waiting, *self.running)):
            raise ValueError(f"request_id {request.request_id} is already submitted and not finished")
        if self._pages_for(request.max_total_tokens) > self.page_manager.num_pages:
            raise ValueError(
                f"request {request.request_id} needs up to {request.max_total_tokens} tokens "
                f"({self._pages_for(request.max_total_tokens)} pages), more than the whole pool "
                f"({self.page_manager.num_pages} pages): raise --num-pages"
            )
        self.pending.append(request)
        self.pending.sort(key=lambda r: (r.arrival_step, r.request_id))

    def _check_prompt(self, request: Request) -> None:
        # A token id the page manager or the embedding cannot take failed add_sequence or the forward
        # of every step that tried to admit the request, so nothing behind it was ever served.
        high = self.vocab_size if self.vocab_size is not None else 2**31
        for position, token in enumerate(request.prompt):
            if isinstance(token, bool):
                valid = False
            else:
                try:
                    valid = 0 <= operator.index(token) < high
                except TypeError:
                    valid = False
            if not valid:
                raise ValueError(
                    f"request {request.request_id}: prompt[{position}] = {token!r} is not a token id in [0, {high})"
                )

    def abort(self, request_id: int) -> Request:
        """Stop a submitted, unfinished request now (call between steps).

        Wherever the request is (not arrived yet, waiting, running), it leaves the server's queues,
        its pages are released, and it joins ``finished`` with ``finish_reason = "abort"``, keeping
        the tokens generated so far. Returns the request; KeyError if no unfinished request has the id.
        """
        for queue in (self.running, self.waiting, self.pending):
            for request in queue:
                if request.request_id == request_id:
                    break
            else:
                continue
            if queue is self.running:
                self.page_manager.release(request.request_id)
            queue.remove(request)
            request.finish_reason = "abort"
            request.finished_step = self.step_index
            self.finished.append(request)
            return request
        raise KeyError(f"abort: no submitted, unfinished request has request_id {request_id}")

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_manager.page_size)

    def has_work(self) -> bool:
        return bool(self.pending or self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.page_manager.release(request.request_id)
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.preemptions += 1
        self.preemptions += 1

    def _finish(self, request: Request, reason: str) -> None:
        self.page_manager.release(request.request_id)
        self.running.remove(request)
        request.finish_reason = reason
        request.finished_step = self.step_index
        self.finished.append(request)

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> StepRecord:
        page_manager = self.page_manager
        while self.pending and self.pending[0].arrival_step <= self.step_index:
            self.waiting.append(self.pending.pop(0))

        # 1. Room for one more token per running request, preempting the youngest when needed.
        preempted: list[int] = []
        decode_rows: list[Request] = []
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted below, on behalf of an older request
            while not page_manager.can_reserve(request.request_id, 1):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request in self.running:
                page_manager.reserve(request.request_id, 1)
                decode_rows.append(request)

        # 2 and 3 change nothing when they raise: admissions of this step are undone (see the module
        # docstring), and _forward advances no request before the model's logits are in hand.
        prefill_rows: list[tuple[Request, int, int | None]] = []  # (request, tokens cached, admitted_step before)
        try:
            if not preempted:  # a step that preempted admits nothing (the pool is short already)
                self._admit(decode_rows, prefill_rows)
            row_requests, row_tokens = self._rows(decode_rows, prefill_rows)
            holding = [r.request_id for r in self.running]
            pages_used = page_manager.used_pages
            shared_pages = getattr(page_manager, "shared_pages", 0)
            seconds, next_tokens, logits_cpu = 0.0, [], None
            if row_requests:
                seconds, next_tokens, logits_cpu = self._forward(row_requests, row_tokens)
        except BaseException as error:
            admitted = [r.request_id for r, _, _ in prefill_rows]
            self._undo_admissions(prefill_rows)
            if hasattr(error, "add_note"):
                error.add_note(
                    f"pagedkv.serving: step {self.step_index} failed and was rolled back: decode rows "
                    f"{[r.request_id for r in decode_rows]} did not advance; admitted rows {admitted} went back "
                    f"to the waiting queue (abort() a request to drop it)"
                )
            raise
        finished = self._advance(row_requests, row_tokens, next_tokens, logits_cpu)

        record = StepRecord(
            step=self.step_index,
            seconds=seconds,
            prefill_tokens=sum(len(t) for t in row_tokens[len(decode_rows) :]),
            decode_tokens=len(decode_rows),
            running=len(self.running),
            waiting=len(self.waiting),
            pages_used=pages_used,
            shared_pages=shared_pages,
            holding=holding,
            preempted=preempted,
            admitted=[r.request_id for r, _, _ in prefill_rows],
            finished=finished,
        )
        self.records.append(record)
        self.step_index += 1
        return record

    def _admit(self, decode_rows: list[Request], prefill_rows: list[tuple[Request, int, int | None]]) -> None:
        """Admit waiting requests in order while their prefill fits the free pages and the step's
        prefill token budget (appending to ``prefill_rows`` as each is admitted)."""
        page_manager = self.page_manager
        prefill_budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            tokens = request.tokens
            # Full pages of this prefix that live requests already computed are shared, not recomputed
            # (the count leaves at least one token to compute, for the logits).
            cached = page_manager.add_sequence(request.request_id, tokens)
            try:
                new_tokens = len(tokens) - cached
                if not 0 <= cached < len(tokens):
                    raise RuntimeError(f"add_sequence reported {cached} cached tokens of {len(tokens)}")
                fits_budget = new_tokens <= prefill_budget or not (decode_rows or prefill_rows)
                if not fits_budget or not page_manager.can_reserve(request.request_id, new_tokens):
                    page_manager.release(request.request_id)
                    break
                page_manager.reserve(request.request_id, new_tokens)
            except BaseException:
                if request.request_id in page_manager:
                    page_manager.release(request.request_id)
                raise
            self.waiting.popleft()
            self.running.append(request)
            prefill_rows.append((request, cached, request.admitted_step))
            request.admitted_step = self.step_index
            request.prefix_cached_tokens += cached
            prefill_budget -= new_tokens

    def _undo_admissions(self, prefill_rows: list[tuple[Request, int, int | None]]) -> None:
        """Put the requests admitted in a failed step back at the front of the waiting queue, in their
        order, releasing their pages (nothing of them was committed)."""
        for request, cached, admitted_before in reversed(prefill_rows):
            if request.request_id in self.page_manager:
                self.page_manager.release(request.request_id)
            if request in self.running:
                self.running.remove(request)
            self.waiting.appendleft(request)
            request.admitted_step = admitted_before
            request.prefix_cached_tokens -= cached

    @staticmethod
    def _rows(decode_rows: list[Request], prefill_rows) -> tuple[list[Request], list[list[int]]]:
        """One ragged forward's rows: decode rows (the last generated token) then prefill rows (the
        tokens after the cached prefix)."""
        row_requests: list[Request] = []
        row_tokens: list[list[int]] = []
        for request in decode_rows:
            row_requests.append(request)
            row_tokens.append(request.generated[-1:])
        for request, cached, _ in prefill_rows:
            row_requests.append(request)
            row_tokens.append(request.tokens[cached:])
        return row_requests, row_tokens

    def _forward(
        self, row_requests: list[Request], row_tokens: list[list[int]]
    ) -> tuple[float, list[int], torch.Tensor | None]:
        """Run the model over the rows; returns the seconds it took, each row's greedy token and (with
        record_logits) the logits on the CPU. Changes no request and commits nothing."""
        page_manager = self.page_manager
        seq_ids = [r.request_id for r in row_requests]
        lookup_table, cache_lengths = page_manager.export(seq_ids, device=self.device)
        lengths_before = [page_manager.length(i) for i in seq_ids]
        offsets = [0]
        flat_tokens: list[int] = []
        positions: list[int] = []
        for tokens, start in zip(row_tokens, lengths_before):
            flat_tokens.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            offsets.append(len(flat_tokens))

        start_time = time.perf_counter()
        logits = self.model(
            torch.tensor(flat_tokens, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            torch.tensor(offsets, dtype=torch.int32, device=self.device),
            cache_lengths,
            lookup_table,
        )  # [B, vocab] float32
        # Checked before any row advances: logits for fewer rows advanced the first rows and then
        # failed with an IndexError, leaving the others behind.
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != len(row_requests):
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise RuntimeError(f"the model returned logits of shape {shape}, expected [{len(row_requests)}, vocab]")
        next_tokens = logits.argmax(dim=-1).tolist()
        seconds = time.perf_counter() - start_time
        return seconds, next_tokens, (logits.cpu() if self.record_logits else None)

    def _advance(
        self,
        row_requests: list[Request],
        row_tokens: list[list[int]],
        next_tokens: list[int],
        logits_cpu: torch.Tensor | None,
    ) -> list[int]:
        """Commit each row's tokens, append its next token and finish it on a stop token or its
        length; returns the ids of the requests finished."""
        page_manager = self.page_manager
        finished: list[int] = []
        for row, (request, tokens) in enumerate(zip(row_requests, row_tokens)):
            page_manager.commit(request.request_id, len(tokens), tokens=tokens)
            request.generated.append(int(next_tokens[row]))
            if logits_cpu is not None:
                request.step_logits.append(logits_cpu[row].clone())
            if next_tokens[row] in self.stop_token_ids:
                self._finish(request, "eos")
                finished.append(request.request_id)
            elif len(request.generated) >= request.max_new_tokens:
                self._finish(request, "length")
                finished.append(request.request_id)
        return finished
