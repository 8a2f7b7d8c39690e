"""The attention mask of attn_implementation="pagedkv", and how a model that reads it is refused.

The mask function registered for "pagedkv" builds no [B, 1, q, kv] eager mask: pagedkv's attention
needs only which keys are real tokens. It returns a ``PaddingMask``, which carries that 2-D padding
mask to pagedkv's attention function and answers the questions transformers' own mask code asks of
a 2-D mask (``ndim``, ``shape``, ``dtype``, ``device``, ``.to(device)``). Anything else done with it
(indexing, slicing, arithmetic, comparisons, a torch function, any other tensor method) is model code
reading the attention mask as the eager 4-D mask (a sparse-attention indexer selecting keys, a
dynamic mask added to it, ...), which pagedkv cannot serve: it raises ``UnsupportedModelError``
naming pagedkv, the model's class, the reading code and the reason. So architectures are refused
by what their code does, on the day a transformers release adds them.

An attention call given a tensor mask of another rank than 2 (a model that builds its own 4-D mask
instead of calling the registered mask function, or a custom 4-D mask passed by the caller) is
refused the same way (``refuse_foreign_mask``).
"""

from __future__ import annotations

import os
import sys

import torch

from .compat import IMPLEMENTATION


class UnsupportedModelError(ValueError):
    """A model whose code does something with the attention mask that attn_implementation="pagedkv"
    cannot serve; the message names the model's class, the code and what to load instead."""


# Frames in these folders are pagedkv's and torch's own, not the model code that used the mask.
_PAGEDKV_HF_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class PaddingMask:
    """The 2-D padding mask of one attention call, readable only by pagedkv's attention function.

    keep: bool [B, width] (True = real token), or None when every key is a real token. width:
    how many of the call's keys hold tokens (fewer than the keys given when a cache preallocates,
    see ``attention_mask``). keys: how many keys the mask was built for (the kv_length of the
    mask function: what the cache hands attention).
    """

    __slots__ = ("keep", "shape", "device", "keys")
    ndim = 2
    dtype = torch.bool

    def __init__(self, keep: torch.Tensor | None, batch: int, width: int, device, keys: int | None = None):
        self.keep = keep
        self.shape = torch.Size((batch, width))
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.keys = width if keys is None else keys

    @property
    def width(self) -> int:
        return self.shape[1]

    def dim(self) -> int:
        return 2

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def to(self, *args, **kwargs) -> PaddingMask:
        """The same mask on the device named by the arguments (transformers' mask code and
        accelerate's device hooks move masks); a dtype argument is ignored: the mask stays bool."""
        device = kwargs.get("device")
        for arg in args:
            if isinstance(arg, (torch.device, str)):
                device = arg
            elif isinstance(arg, torch.Tensor):
                device = arg.device
        if device is None or torch.device(device) == self.device:
            return self
        keep = None if self.keep is None else self.keep.to(device)
        return PaddingMask(keep, self.shape[0], self.shape[1], device, self.keys)

    def view(self, *shape) -> PaddingMask:
        """The mask itself, for a shape that keeps it [B, width] (model code that flattens the 2-D
        mask it was given, as GPT-2's `attention_mask.view(batch_size, -1)`); any other shape is a
        read of the mask as something else."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        batch, width = self.shape
        if shape not in ((batch, width), (batch, -1), (-1, width)):
            raise UnsupportedModelError(model_reads_mask_message(f"attention_mask.view{shape}"))
        return self

    reshape = view

    def contiguous(self, *args, **kwargs) -> PaddingMask:
        return self

    def tensor(self) -> torch.Tensor:
        """The mask as bool [B, width] (all True when every key is a real token)."""
        if self.keep is not None:
            return self.keep
        return torch.ones(tuple(self.shape), dtype=torch.bool, device=self.device)

    def __repr__(self) -> str:
        padded = "no padding" if self.keep is None else "padded"
        return f"PaddingMask([{self.shape[0]}, {self.shape[1]}], {padded}, device={self.device})"

    __hash__ = object.__hash__

    def __getattr__(self, name):
        if name.startswith("__"):  # protocol probes (copy, numpy, DLPack): not a read of the mask
            raise AttributeError(name)
        raise UnsupportedModelError(model_reads_mask_message(f"attention_mask.{name}"))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        raise UnsupportedModelError(model_reads_mask_message(f"{name}(attention_mask, ...)"))


def _refuse_operator(name: str, what: str):
    def operator(self, *args):
        raise UnsupportedModelError(model_reads_mask_message(what))

    operator.__name__ = name
    return operator


_OPERATORS = {
    "__getitem__": "attention_mask[...]", "__setitem__": "attention_mask[...] = ...",
    "__delitem__": "del attention_mask[...]", "__iter__": "iter(attention_mask)", "__len__": "len(attention_mask)",
    "__contains__": "... in attention_mask", "__bool__": "bool(attention_mask)", "__int__": "int(attention_mask)",
    "__float__": "float(attention_mask)", "__index__": "attention_mask as an index", "__neg__": "-attention_mask",
    "__pos__": "+attention_mask", "__invert__": "~attention_mask", "__abs__": "abs(attention_mask)",
    "__eq__": "attention_mask == ...", "__ne__": "attention_mask != ...", "__lt__": "attention_mask < ...",
    "__le__": "attention_mask <= ...", "__gt__": "attention_mask > ...", "__ge__": "attention_mask >= ...",
}
for _symbol, _name in [("+", "add"), ("-", "sub"), ("*", "mul"), ("@", "matmul"), ("/", "truediv"),
                       ("//", "floordiv"), ("%", "mod"), ("**", "pow"), ("&", "and"), ("|", "or"), ("^", "xor"),
                       ("<<", "lshift"), (">>", "rshift")]:
    _OPERATORS[f"__{_name}__"] = f"attention_mask {_symbol} ..."
    _OPERATORS[f"__r{_name}__"] = f"... {_symbol} attention_mask"
    _OPERATORS[f"__i{_name}__"] = f"attention_mask {_symbol}= ..."
for _name, _what in _OPERATORS.items():
    setattr(PaddingMask, _name, _refuse_operator(_name, _what))
del _symbol, _name, _what


def _calling_model():
    """(the outermost transformers model whose code is running, the first frame outside pagedkv.hf
    and torch: the code that used the mask) for an error message; either may be None."""
    from transformers import PreTrainedModel

    model, site = None, None
    frame = sys._getframe(2)
    try:
        while frame is not None:
            filename = os.path.abspath(frame.f_code.co_filename)
            if site is None and not filename.startswith((_PAGEDKV_HF_DIR, _TORCH_DIR)):
                code = frame.f_code
                site = f"{getattr(code, 'co_qualname', code.co_name)} ({os.path.basename(filename)}:{frame.f_lineno})"
            owner = frame.f_locals.get("self")
            if isinstance(owner, PreTrainedModel):
                model = owner
            frame = frame.f_back
    finally:
        del frame
    return model, site


def _model_name(model, fallback: str) -> str:
    if model is None:
        return fallback
    model_type = getattr(getattr(model, "config", None), "model_type", None) or "?"
    return f"{type(model).__name__} (model_type '{model_type}')"


def model_reads_mask_message(what: str) -> str:
    """Why a model whose code did `what` with the "pagedkv" attention mask cannot run."""
    model, site = _calling_model()
    return (
        f"attn_implementation='{IMPLEMENTATION}' cannot run {_model_name(model, 'this model')}: its model code reads "
        f"the attention mask ({what} in {site}) as the 4-D [batch, 1, q, kv] eager mask, which pagedkv does "
        "not build (its mask function gives a 2-D padding mask that only pagedkv's attention function reads); "
        "load it with attn_implementation='eager' or 'sdpa'"
    )


def refuse_keys_past_mask(attention_mask: PaddingMask, keys: int, module) -> None:
    """Raises UnsupportedModelError for an attention call given more keys than its mask was built
    for: keys the model adds after the cache (compressed keys, another pass's keys) and masks by
    extending the eager mask itself, which pagedkv's padding mask cannot express."""
    model, site = _calling_model()
    raise UnsupportedModelError(
        f"attn_implementation='{IMPLEMENTATION}' cannot run {_model_name(model, type(module).__name__)}: its "
        f"attention ({site}) is given {keys} keys, but the attention mask was built for the {attention_mask.keys} "
        "keys of the cache: the model adds keys after the cache and masks them by extending the 4-D eager mask, "
        "which pagedkv does not build (its mask function gives a 2-D padding mask); load it with "
        "attn_implementation='eager' or 'sdpa'"
    )


def refuse_foreign_mask(attention_mask, module) -> None:
    """Raises UnsupportedModelError for an attention call whose mask is neither None, a PaddingMask
    nor a 2-D [B, kv] tensor: a mask the "pagedkv" mask function did not build."""
    if isinstance(attention_mask, torch.Tensor):
        what = f"a {attention_mask.dim()}-D tensor of shape {tuple(attention_mask.shape)}"
    else:
        what = f"a {type(attention_mask).__name__}"
    model, site = _calling_model()
    raise UnsupportedModelError(
        f"attn_implementation='{IMPLEMENTATION}' cannot run {_model_name(model, type(module).__name__)}: the "
        f"attention mask it gives pagedkv's attention function ({site}) is {what}, which pagedkv's mask function "
        "did not build (the model builds its own eager mask instead of calling the mask function registered for "
        f"'{IMPLEMENTATION}', or a custom 4-D attention_mask was passed); pagedkv attention takes only the 2-D "
        "padding mask its mask function builds; load it with attn_implementation='eager' or 'sdpa'"
    )


# Not traced by torch.compile: the mask's width (the keys written) is read off a tensor, and a traced
# read would specialise the compiled model on it, a recompile per decode step; left out of the
# graph, the width reaches the compiled code as a tensor shape, which it takes as dynamic.
@torch.compiler.disable
def attention_mask(batch_size: int, kv_length: int, kv_offset: int = 0, attention_mask=None, q_length=None,
                   q_offset=None, cache_position=None, **kwargs) -> PaddingMask:
    """The mask function registered for "pagedkv": a PaddingMask of bool [B, n] (True = real token)
    over the last n positions up to the last query, n <= kv_length, or of no tensor when every key
    is a real token.

    As flash attention's mask function, no [B, 1, q, kv] mask is built: the padding mask is what
    the ragged layout needs. It also says how many keys hold tokens: a cache that preallocates
    (transformers' StaticCache, the cache torch.compile runs with) hands attention its whole buffer
    of kv_length rows, of which only the first n are written (flash attention reads n off the
    mask's width too). n comes from the query position (q_offset, or cache_position before 5.x).
    A PaddingMask given back as attention_mask (a mask built once for generate, then handed to the
    model's own mask code) is read as the padding mask it holds.
    """
    if isinstance(attention_mask, PaddingMask):
        attention_mask = attention_mask.tensor()
    filled = kv_length
    if "allow_is_bidirectional_skip" not in kwargs:  # causal: queries are the last keys written
        filled = _written_keys(kv_length, kv_offset, attention_mask, q_length, q_offset, cache_position)
    if attention_mask is None:
        device = cache_position.device if cache_position is not None else kwargs.get("device")
        return PaddingMask(None, batch_size, filled, device, kv_length)
    keep = attention_mask[:, -filled:].to(torch.bool)
    return PaddingMask(None if bool(keep.all()) else keep, batch_size, filled, keep.device, kv_length)


def _written_keys(kv_length, kv_offset, padding_mask, q_length, q_offset, cache_position) -> int:
    """How many of the kv_length keys a causal call is given hold tokens (the rest: rows of a
    preallocated cache not written yet). Keys start at position kv_offset and the last query is
    the last key written."""
    if q_offset is not None and q_length is not None:  # transformers 5.x
        end = q_offset + q_length
    elif padding_mask is not None:  # 4.57: the 2-D mask covers every position up to the last query
        return min(kv_length, padding_mask.size(1))
    elif cache_position is not None:  # 4.57 without a mask: read the last query's position
        end = cache_position[-1] + 1
    else:
        return kv_length
    # A StaticCache layer gives its position as a tensor (no graph break inside its update); this
    # reads it once per mask.
    end = int(end) if isinstance(end, torch.Tensor) else end
    return max(1, min(kv_length, end - kv_offset))
