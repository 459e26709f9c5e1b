"""What the benchmarks share: the per-step memory probe, the machine description, tables, JSON, plots."""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import transformers
from transformers.generation import StoppingCriteria

RESULTS = Path(__file__).resolve().parent / "results"

# The allocator settings a benchmark's child process must not carry: a peak is measured in a process
# as users run it, with the C library's defaults. (Fixing glibc's thresholds, MALLOC_MMAP_THRESHOLD_
# and MALLOC_TRIM_THRESHOLD_, made peaks repeat to about 1 MiB, but hid that freed per-chunk buffers
# stayed with glibc: +31 MiB measured, +1.3 GiB seen by a user. Report the spread over runs instead.)
ALLOCATOR_VARIABLES = ("MALLOC_", "GLIBC_TUNABLES")  # glibc malloc's environment settings
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}  # older results only


def default_env(**extra: str) -> dict[str, str]:
    """This process's environment without any allocator setting (`ALLOCATOR_VARIABLES`), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ALLOCATOR_VARIABLES)}
    return {**env, **extra}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of `values` (one per run)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {"median": round(median, 1), "min": round(ordered[0], 1), "max": round(ordered[-1], 1)}


def rss_bytes() -> int:
    """This process's resident set now, in bytes (Linux `/proc/self/statm`; the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident set so far, in bytes (`ru_maxrss` is KiB on Linux, bytes on macOS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class MemoryProbe(StoppingCriteria):
    """A stopping criterion that never stops and notes `read()` once per step (after the token is
    appended): the memory-against-steps trace. Every case of a benchmark carries it, the baseline too.
    It also notes the host clock (`time.perf_counter()`, seconds) in `times`: on a device, a step's
    end as the host sees it (generate() waits for the device once per step).

    `read` must not synchronise with the device (`torch.cuda.memory_allocated` and the RSS are host
    counters). It returns a `(rows,)` bool tensor of False on `input_ids`' device, made once.
    """

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read
        self.trace: list[int] = []
        self.times: list[float] = []
        self._never: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        self.trace.append(self.read())
        if self._never is None or self._never.shape[0] != input_ids.shape[0]:
            self._never = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self._never


def machine() -> dict[str, Any]:
    """The hardware and versions a result was measured on."""
    info = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Print `rows` as a Markdown table (also returned), numbers right-aligned."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    right = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"]
    lines.append("| " + " | ".join(("-" * (w - 1) + ":") if r else "-" * w for w, r in zip(widths, right)) + " |")
    for row in cells:
        lines.append("| " + " | ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, or an ImportError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "the benchmark plots need matplotlib: `pip install 'transformers-offload[bench]'`"
        ) from error
    return plt


def _save(plt: Any, figure: Any, path: Path, title: str) -> None:
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"wrote {path}")


def plot_traces(path: Path, panels: dict[str, dict[str, Sequence[float]]], *, ylabel: str, title: str) -> None:
    """One panel per key of `panels`, one line per case: a value per step (the memory trace)."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for axis, (name, lines) in zip(axes[0], panels.items()):
        for label, values in lines.items():
            axis.plot(range(len(values)), values, label=label)
        axis.set_title(name)
        axis.set_xlabel("step")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    _save(plt, figure, path, title)


def plot_bars(path: Path, panels: dict[str, dict[str, float]], *, title: str) -> None:
    """One panel per key of `panels`, one bar per case."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for axis, (name, bars) in zip(axes[0], panels.items()):
        axis.bar(list(bars), list(bars.values()), color="tab:blue")
        for index, value in enumerate(bars.values()):
            axis.annotate(f"{value:.3g}", (index, value), ha="center", va="bottom", fontsize=8)
        axis.set_title(name, fontsize=10)
        axis.tick_params(axis="x", labelsize=8)
        axis.grid(axis="y", alpha=0.3)
    _save(plt, figure, path, title)
