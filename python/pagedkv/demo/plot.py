"""The demo's ``--plot``: pages in use per server step against contiguous buffers, as a PNG."""

from __future__ import annotations

from collections.abc import Sequence

from ..serving import StepRecord


def plot_pages(
    path: str, records: Sequence[StepRecord], contiguous_pages: Sequence[int], num_pages: int, title: str
) -> None:
    """Pages in use per step (top) and running / waiting requests (bottom), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    figure, (pages_axis, requests_axis) = plt.subplots(
        2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    pages_axis.step(steps, [r.pages_used for r in records], where="post", label="pagedkv pages in use")
    pages_axis.step(
        steps,
        contiguous_pages,
        where="post",
        linestyle="--",
        label="contiguous max-length buffers, same requests",
    )
    if any(r.shared_pages for r in records):
        pages_axis.step(steps, [r.shared_pages for r in records], where="post", label="shared (prefix) pages")
    pages_axis.axhline(num_pages, color="black", linewidth=1, label=f"pool: {num_pages} pages")
    preempt_steps = [r.step for r in records if r.preempted]
    if preempt_steps:
        pages_axis.scatter(
            preempt_steps,
            [records[s].pages_used for s in preempt_steps],
            marker="x",
            color="tab:red",
            zorder=3,
            label="preemption",
        )
    pages_axis.set_ylabel("KV pages")
    pages_axis.set_title(title)
    pages_axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    pages_axis.grid(alpha=0.3)

    requests_axis.step(steps, [len(r.holding) for r in records], where="post", label="running")
    requests_axis.step(steps, [r.waiting for r in records], where="post", label="waiting")
    requests_axis.set_xlabel("server step")
    requests_axis.set_ylabel("requests")
    requests_axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    requests_axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
