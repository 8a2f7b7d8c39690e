"""The continuous-batching chat demo (``python -m pagedkv.demo``): ``cli`` runs it and prints its
report, ``check`` compares it with transformers (``--check``), ``plot`` draws pages in use
(``--plot``); the server itself is ``pagedkv.serving``. ``soak`` (``python -m pagedkv.demo.soak``)
is the seeded load run of the server that checks its pages and tokens."""

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
