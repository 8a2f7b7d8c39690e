"""The demo's ``--check``: every finished request rerun through Hugging Face
``transformers.LlamaForCausalLM`` with the same weights (float32, CPU), teacher-forced, its greedy
tokens and logits compared with what pagedkv's server produced."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from .. import gguf_model
from ..serving import Request

# The check's bound on ||logits_pagedkv - logits_hf|| / ||logits_hf|| at every generated step.
CHECK_RELATIVE_TOLERANCE = 1e-4


@dataclasses.dataclass
class CheckResult:
    request_id: int
    steps: int
    identical_tokens: int
    max_relative_error: float


def build_transformers_model(loaded: gguf_model.LoadedModel):
    """``transformers.LlamaForCausalLM`` holding ``loaded.state_dict`` (float32, CPU, eval).

    Built on the meta device and given the tensors by assignment, which skips HF's random
    initialisation (seconds for 135M parameters); the rotary embedding, whose frequencies are a
    non-persistent buffer, is then rebuilt from the config.
    """
    import transformers

    hf_config = loaded.config.to_transformers()
    with torch.device("meta"):
        hf_model = transformers.LlamaForCausalLM(hf_config)
    state = {name: tensor.float() for name, tensor in loaded.state_dict.items()}
    missing, unexpected = hf_model.load_state_dict(state, strict=False, assign=True)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise KeyError(f"transformers state dict mismatch: missing {missing}, unexpected {unexpected}")
    if loaded.config.tie_word_embeddings:
        hf_model.lm_head.weight = hf_model.model.embed_tokens.weight
    for name, module in list(hf_model.named_modules()):
        if "inv_freq" in dict(module.named_buffers(recurse=False)):
            parent_name, _, attribute = name.rpartition(".")
            setattr(hf_model.get_submodule(parent_name), attribute, type(module)(config=hf_config))
    left_on_meta = [n for n, t in [*hf_model.named_parameters(), *hf_model.named_buffers()] if t.is_meta]
    if left_on_meta:
        raise RuntimeError(f"transformers model has uninitialised tensors: {left_on_meta}")
    return hf_model.eval()


def check_against_transformers(loaded: gguf_model.LoadedModel, requests: Sequence[Request]) -> list[CheckResult]:
    """Teacher-forced HF rerun of each request: one forward over prompt + generated[:-1]."""
    hf_model = build_transformers_model(loaded)
    results = []
    with torch.inference_mode():
        for request in requests:
            sequence = request.prompt + request.generated[:-1]
            hf_logits = hf_model(torch.tensor([sequence])).logits[0, len(request.prompt) - 1 :].float()
            ours = torch.stack(request.step_logits)  # [steps, vocab]
            errors = (ours - hf_logits).norm(dim=-1) / hf_logits.norm(dim=-1)
            identical = (hf_logits.argmax(dim=-1) == torch.tensor(request.generated)).sum().item()
            results.append(CheckResult(request.request_id, len(request.generated), int(identical), errors.max().item()))
    return results


def report_check(args, loaded, finished: Sequence[Request]) -> tuple[int, list[CheckResult] | None]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("check: FAILED, transformers is not installed (pip install transformers)")
        return 2, None
    check_start = time.perf_counter()
    results = check_against_transformers(loaded, finished)
    steps = sum(r.steps for r in results)
    identical = sum(r.identical_tokens for r in results)
    worst = max(r.max_relative_error for r in results)
    exact_mode = args.kv_dtype == "fp32" and args.model_dtype == "fp32"
    print(
        f"check vs transformers {__import__('transformers').__version__} LlamaForCausalLM (float32, CPU), "
        f"{len(results)} requests, {steps} generated steps, {time.perf_counter() - check_start:.1f} s:"
    )
    for result in sorted(results, key=lambda r: r.request_id):
        print(
            f"  request {result.request_id}: {result.identical_tokens}/{result.steps} greedy tokens identical, "
            f"max relative logits error {result.max_relative_error:.2e}"
        )
    if exact_mode:
        ok = identical == steps and worst <= CHECK_RELATIVE_TOLERANCE
        print(
            f"check {'PASSED' if ok else 'FAILED'}: greedy tokens identical {identical}/{steps}, "
            f"max relative logits error {worst:.2e} (bound {CHECK_RELATIVE_TOLERANCE:.0e})"
        )
        return (0 if ok else 1), results
    print(
        f"check ({args.kv_dtype} KV, {args.model_dtype} model, not asserted): greedy agreement "
        f"{identical / max(steps, 1):.1%} ({identical}/{steps}), max relative logits error {worst:.2e}"
    )
    return 0, results
