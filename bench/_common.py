"""What the benchmarks share: the timing harness (warm-up, interleaved rounds, medians, spreads, ratios
to stock, fresh processes with default allocator settings), the per-step memory probe, the machine
description, tables, JSON, plots.

Every timed comparison runs the same way: one warm-up call, then `repeats` rounds, each round every
case once in the same order (`interleaved`), so that a slow minute of the machine falls on every case
alike; a case's figure is its median over the rounds with the spread (min..max), and its ratio to stock
is median over stock's median (`summarize`). A peak is measured in a fresh process per run, as users
run it (`fresh_runs`, no allocator environment variables), and reported the same way.

Every clock a script reads is one of these: `stopwatch` / `Stopwatch` (wall seconds by the host clock,
and the process's and the thread's CPU seconds), `timed` (one call), `process_seconds` (a command in a
fresh process: to its first line of output and to its exit); every median or percentile `median`,
`percentile`, `spread`, `summarize`. In a measured process, the peak resident set since a point is
`reset_high_water` then `high_water_mib`, and the peaks of its anonymous memory and resident set are
sampled by `ResidentPeaks`.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import transformers
from transformers.generation import StoppingCriteria

RESULTS = Path(__file__).resolve().parent / "results"

# The allocator settings a benchmark's child process must not carry: a peak is measured in a process
# as users run it, with the C library's defaults. (Fixing glibc's thresholds, MALLOC_MMAP_THRESHOLD_
# and MALLOC_TRIM_THRESHOLD_, made peaks repeat to about 1 MiB, but hid that freed per-chunk buffers
# stayed with glibc: +31 MiB measured, +1.3 GiB seen by a user. Report the spread over runs instead.)
ALLOCATOR_VARIABLES = ("MALLOC_", "GLIBC_TUNABLES")  # glibc malloc's environment settings


# The sampling settings and chat prompts the real-model benches share (their batches repeat the prompts).
SAMPLING_SETTINGS = {
    "greedy": dict(do_sample=False),
    "top_p": dict(do_sample=True, temperature=0.7, top_p=0.9),
    "top_k": dict(do_sample=True, top_k=50),
}
CHAT_PROMPTS = [
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give three tips for learning to cook.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Name two uses of a paperclip besides holding paper.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
    "How many legs does a spider have?",
    "Translate 'good morning' into French and Spanish.",
]


def default_env(**extra: str) -> dict[str, str]:
    """This process's environment without any allocator setting (`ALLOCATOR_VARIABLES`), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ALLOCATOR_VARIABLES)}
    return {**env, **extra}


def median(values: Iterable[float]) -> float:
    """The median of `values` (the mean of the two middle ones for an even count), unrounded."""
    return statistics.median(values)


def percentile(values: Sequence[float], q: int) -> float:
    """The `q`th percentile of `values` (1 to 99: `statistics.quantiles(values, n=100)`, its default
    method; 50 is the median) or, for 100, the largest."""
    return max(values) if q >= 100 else statistics.quantiles(values, n=100)[q - 1]


def spread(values: Sequence[float], digits: int = 1) -> dict[str, float]:
    """Median, min and max of `values` (one per run), rounded to `digits` decimals."""
    ordered = sorted(values)
    return {"median": round(median(ordered), digits), "min": round(ordered[0], digits),
            "max": round(ordered[-1], digits)}


class Stopwatch:
    """A clock started when made: `elapsed()` is the wall seconds so far; `stop()` notes the wall seconds
    in `seconds`, and the CPU seconds of the process (every thread, `time.process_time()`) and of this
    thread (`time.thread_time()`) in `cpu_seconds` and `thread_seconds`. `started` is the host clock
    (`time.perf_counter()`) when it began. The CPU clocks are read outside the wall clock's interval."""

    def __init__(self) -> None:
        self.seconds = self.cpu_seconds = self.thread_seconds = 0.0
        self._cpu, self._thread = time.process_time(), time.thread_time()
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        """Wall seconds since the clock started."""
        return time.perf_counter() - self.started

    def stop(self) -> float:
        """Note the wall, process CPU and thread CPU seconds since the clock started; returns the wall seconds."""
        self.seconds = time.perf_counter() - self.started
        self.cpu_seconds = time.process_time() - self._cpu
        self.thread_seconds = time.thread_time() - self._thread
        return self.seconds


@contextmanager
def stopwatch() -> Iterator[Stopwatch]:
    """Time a block by the host clock (`time.perf_counter()`): `with stopwatch() as clock: ...`, then
    `clock.seconds` (and `clock.cpu_seconds`, `clock.thread_seconds`; `clock.elapsed()` inside the
    block). On a device, synchronise inside the block before it ends."""
    clock = Stopwatch()
    try:
        yield clock
    finally:
        clock.stop()


def timed(call: Callable[[], Any]) -> float:
    """Wall seconds of `call()`."""
    with stopwatch() as clock:
        call()
    return clock.seconds


def interleaved(cases: Mapping[str, Callable[[int], Any]], repeats: int, *,
                warmup: Callable[[], Any] | None = None, rotate: bool = False, show: bool = False) -> dict[str, list[Any]]:
    """`warmup()` once (not kept), then `repeats` rounds, each calling every case once, in `cases`'
    order (`rotate`: round i starts at case i, for a disk whose speed drifts with what was written
    before), with the round's index. A case returns its measurement: seconds (`timed`, `stopwatch`) or
    anything else (a dict of seconds and bytes). Returns each case's measurements, one per round; round
    i of every case ran in the same minute (`summarize` pairs them). `show` prints each as it comes."""
    if warmup is not None:
        warmup()
    found: dict[str, list[Any]] = {name: [] for name in cases}
    names = list(cases)
    for round_ in range(repeats):
        shift = round_ % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            case = cases[name]
            found[name].append(case(round_))
            if show:
                print(f"round {round_ + 1}/{repeats}: {name}: {json.dumps(found[name][-1], default=str)}", flush=True)
    return found


def summarize(values: Mapping[str, Sequence[float]], base: str | None = None) -> dict[str, dict[str, Any]]:
    """Per case: its values, their `spread` (median, min, max), and with `base` (stock's case) the ratio
    of its median to base's (`over_base`) and the spread of its excess over base round by round
    (`excess`: value i minus base's value i, the same round of `interleaved` or `fresh_runs`)."""
    summary: dict[str, dict[str, Any]] = {}
    for name, found in values.items():
        entry: dict[str, Any] = {"values": list(found), **spread(found)}
        entry["median_exact"] = median(found)
        if base is not None:
            entry["over_base"] = entry["median_exact"] / median(values[base])
            entry["excess"] = spread([a - b for a, b in zip(found, values[base])])
        summary[name] = entry
    return summary


def timing_columns(entry: Mapping[str, Any]) -> list[str]:
    """A `summarize` entry as table cells: median seconds, min..max, and its ratio to stock if known."""
    cells = [f"{entry['median_exact']:.2f}", f"{min(entry['values']):.2f}..{max(entry['values']):.2f}"]
    return cells + ([f"{entry['over_base']:.3f}x"] if "over_base" in entry else [])


TIMING_HEADERS = ["median s", "min..max s", "over stock"]


def fresh_runs(script: str | Path, cases: Mapping[str, Sequence[str]], runs: int, *, timeout: float = 1800,
               show: bool = True, **env: str) -> dict[str, list[dict[str, Any]]]:
    """Each case `runs` times, interleaved, each `python script ARGS...` in a fresh process (a peak never
    goes down) with the C library's default allocator settings (`default_env`, plus `env`) and
    `HF_HUB_OFFLINE=1`; the child prints its result as JSON on its last line of output. Returns each
    case's results, one per round.

    Raises:
        SystemExit: a run failed (its stderr's end in the message).
    """
    environment = default_env(HF_HUB_OFFLINE="1", **env)
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    for round_ in range(runs):
        for name, arguments in cases.items():
            done = subprocess.run([sys.executable, str(script), *arguments], capture_output=True, text=True,
                                  env=environment, timeout=timeout)
            if done.returncode != 0:
                raise SystemExit(f"{name} (run {round_ + 1}) failed:\n{done.stderr[-3000:]}")
            found[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            if show:
                print(f"run {round_ + 1}/{runs}: {name}: {json.dumps(found[name][-1])}", flush=True)
    return found


def process_seconds(command: Sequence[str], *, first_line: bool = True, cwd: str | Path | None = None,
                    timeout: float = 600, **env: str) -> dict[str, float]:
    """Wall seconds from starting `command` in a fresh process (`default_env`, plus `env`, and
    `HF_HUB_OFFLINE=1`; its output captured) to its exit (`exit`) and, with `first_line`, to its first
    line on stdout (`first_line`).

    Raises:
        SystemExit: it failed, or printed no line where `first_line` waits for one (its stderr's end in
            the message).
    """
    environment = default_env(HF_HUB_OFFLINE="1", **env)
    found: dict[str, float] = {}
    with stopwatch() as clock:
        process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   cwd=cwd, env=environment)
        line = process.stdout.readline() if first_line else None
        if first_line:
            found["first_line"] = clock.elapsed()
        _, errors = process.communicate(timeout=timeout)
    if process.returncode != 0 or (first_line and not line):
        raise SystemExit(f"{list(command)} failed ({process.returncode}):\n{errors[-3000:]}")
    return {**found, "exit": clock.seconds}


def print_peaks(found: Mapping[str, Sequence[Mapping[str, Any]]], *, key: str = "growth_mib",
                base: str | None = None, label: str = "growth", unit: str = "MiB") -> dict[str, dict[str, Any]]:
    """Print, and return, each case's `key` over its runs (`fresh_runs`' results) as median, min and max,
    and with `base` (stock's case) its excess over base round by round (run i against base's run i)."""
    values = {case: [run[key] for run in runs] for case, runs in found.items()}
    rows, summary = [], {}
    for case, measured in values.items():
        summary[case] = {key: spread(measured)}
        if base is not None and base in values and case != base:
            summary[case][f"over_{base}"] = spread([a - b for a, b in zip(measured, values[base])])
        over = summary[case].get(f"over_{base}")
        rows.append([case, *summary[case][key].values(), *(over.values() if over else ("-", "-", "-"))])
    over_header = f"over {base} median {unit}" if base else "over base"
    print_table(["case", f"{label} median {unit}", "min", "max", over_header, "min", "max"], rows)
    return summary


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


def reset_high_water() -> None:
    """Start this process's peak resident set (`high_water_mib`) over from its current resident set
    (Linux: `echo 5 > /proc/self/clear_refs`; elsewhere nothing), so that what came before, such as
    loading a model, whose transient peak depends on timing, does not hide what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def high_water_mib() -> float:
    """This process's peak resident set since `reset_high_water()` (Linux `VmHWM`), or since it started
    (`peak_rss_bytes` elsewhere), in MiB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return peak_rss_bytes() / 2**20


def resident_bytes() -> tuple[int, int]:
    """This process's anonymous resident memory (`RssAnon`: what it allocated, without the file pages it
    maps, which the kernel can drop) and its whole resident set (`VmRSS`) now, in bytes (Linux
    `/proc/self/status`; 0 where a line is missing)."""
    with open("/proc/self/status") as status:
        found = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status
                 if line.startswith(("RssAnon:", "VmRSS:"))}
    return found.get("RssAnon", 0), found.get("VmRSS", 0)


class ResidentPeaks:
    """The peaks of this process's anonymous resident memory and of its whole resident set
    (`resident_bytes`), sampled every `interval` seconds by a thread from when it is made until `stop()`.
    Sampled rather than taken from `ru_maxrss`, which a child started by fork and exec inherits from its
    parent (the parent's resident set at the fork), and which counts mapped file pages."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peaks = resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peaks = tuple(map(max, self.peaks, resident_bytes()))

    def stop(self) -> tuple[int, int]:
        """The peaks (anonymous, resident), in bytes, a last reading included."""
        self._stop.set()
        self._thread.join()
        self.peaks = tuple(map(max, self.peaks, resident_bytes()))
        return self.peaks


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


def help_text_prompts(vocab: int, rows: int, length: int = 48) -> torch.Tensor:
    """`(rows, length)` prompt ids: the first `length` tokens of the first `rows` of Python's help texts
    (`pydoc_data.topics`), by SmolLM2's tokenizer, folded into a vocabulary of `vocab` entries."""
    from pydoc_data.topics import topics

    from transformers_offload.demo_model import load

    _, tokenizer = load()
    texts = [topics[name] for name in sorted(topics)[:rows]]
    return torch.stack([torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:length]) % vocab
                        for text in texts])


def smollm2_or_wide(case: str) -> tuple[Any, Any]:
    """`smollm2`: SmolLM2-135M-Instruct and its tokenizer (float32, vocabulary 49,152); `wide`: a 2-layer Qwen2
    with Qwen2's vocabulary of 152,064 made from a config (hidden size 256, random weights, float32), no tokenizer."""
    if case == "smollm2":
        from transformers_offload.demo_model import load

        model, tokenizer = load()
        return model.float().eval(), tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=152_064, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval(), None
