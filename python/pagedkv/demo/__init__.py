"""The continuous-batching chat demo (``python -m pagedkv.demo``): ``cli`` runs it and prints its
report, ``check`` compares it with transformers (``--check``), ``plot`` draws pages in use
(``--plot``); the server itself is ``pagedkv.serving``."""

from .check import CHECK_RELATIVE_TOLERANCE, CheckResult, build_transformers_model, check_against_transformers
from .cli import DEFAULT_PROMPTS, DemoResult, main, parse_args, run_demo
from .plot import plot_pages

__all__ = [
    "CHECK_RELATIVE_TOLERANCE",
    "DEFAULT_PROMPTS",
    "CheckResult",
    "DemoResult",
    "build_transformers_model",
    "check_against_transformers",
    "main",
    "parse_args",
    "plot_pages",
    "run_demo",
]
