"""Charts of a simulation run: TTFT CDF per policy, and mean / p99 TTFT bars (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


def plot_ttft(
    ttfts: Mapping[str, Sequence[float]],
    path: str | Path,
    title: str,
    floor_s: float | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf_ax, bar_ax) = plt.subplots(1, 2, figsize=(13, 5))
    names = list(ttfts)
    for name in names:
        values = np.sort(np.asarray(ttfts[name], dtype=float))
        if values.size:
            cdf_ax.plot(values, np.arange(1, values.size + 1) / values.size, label=name)
    if floor_s:
        cdf_ax.axvline(floor_s, color="grey", linestyle=":", label="TTFT floor (mean)")
    cdf_ax.set_xscale("log")
    cdf_ax.set_xlabel("TTFT (s)")
    cdf_ax.set_ylabel("fraction of requests")
    cdf_ax.set_title("TTFT CDF")
    cdf_ax.grid(True, which="both", alpha=0.3)
    cdf_ax.legend(fontsize="small")

    means = [float(np.mean(ttfts[n])) if len(ttfts[n]) else 0.0 for n in names]
    p99s = [float(np.percentile(ttfts[n], 99)) if len(ttfts[n]) else 0.0 for n in names]
    positions = np.arange(len(names))
    bar_ax.bar(positions - 0.2, means, width=0.4, label="mean")
    bar_ax.bar(positions + 0.2, p99s, width=0.4, label="p99")
    bar_ax.set_xticks(positions, names, rotation=30, ha="right")
    bar_ax.set_yscale("log")
    bar_ax.set_ylabel("TTFT (s)")
    bar_ax.set_title("TTFT mean and p99")
    bar_ax.grid(True, axis="y", which="both", alpha=0.3)
    bar_ax.legend(fontsize="small")

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
