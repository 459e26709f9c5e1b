"""Continuous batching recorded per request: transformers' `generate_batch` and the manager behind it
(`init_continuous_batching`, `add_request`, `get_result`; `transformers serve` and TRL's trainers run on it).

The manager's model runner packs the requests of a batch into one forward, computes float32 logits at
each request's next-token position, runs the processor list over those rows and samples. The capture
taps two of the runner's calls, for the manager it is attached to only: the processor list (what it
receives, copied to the host before any processor runs: the raw logits) and the sampling (what it samples
from: the processed scores, and the tokens it wrote). Row i of a batch is the i-th request of the batch
that predicts a token (`has_new_token`), as the manager reads its tokens back. Each step's rows leave the
device within the step; a request's steps are handed to the recorder (`on_request`) when the manager
hands out its finished result, and checked against it there.

Not recorded, refused with a reason: asynchronous batching, CUDA graphs and a compiled forward (the
runner's Python code does not run at each step).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import torch

from .. import _compat
from ..codecs.stats import STATS_STREAM
from ..errors import UnrecordedCallWarning, UnsupportedModeError
from .continuous_requests import MODE, RequestSteps, request_settings
from .stats import StepStats

__all__ = ["MODE", "ContinuousCapture", "RequestSteps", "refusal", "run_recorded", "runner_known"]


# Called, in the thread that reads a finished result, with the result (transformers' `GenerationOutput`),
# its recorded steps and the manager's generation config.
OnRequest = Callable[[Any, RequestSteps, Any], None]


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of `x` that does not make the host wait (pinned and non-blocking on CUDA: read once
    the manager has synchronised to read the step's tokens, before the result is handed out)."""
    if x.is_cuda:
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return host.copy_(x, non_blocking=True)
    return x.detach().clone()


class _TappedProcessors:
    """The runner's processor list, unchanged, with what it receives copied first (the raw logits)."""

    def __init__(self, processors: Any, stats: StepStats | None) -> None:
        self._processors = processors
        self.stats = stats  # with `"stats"` recorded: this runner's, on the device
        self.raw: torch.Tensor | None = None  # what the list received at this step, on the host

    def __getattr__(self, name: str) -> Any:
        return getattr(self._processors, name)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.raw = _to_host(scores)
        if self.stats is not None:  # a copy on the device: processors may edit `scores` in place
            self.stats.raw(0, scores)
        return self._processors(input_ids, scores, *args, **kwargs)


def refusal(config: Any, use_async_batching: bool = False) -> str | None:
    """Why a manager of continuous batching `config` cannot be recorded (None: it can, as far as `config`
    says; transformers resolves what it leaves unset when the manager starts, checked again then)."""
    if use_async_batching or getattr(config, "use_async_batching", None):
        return ("asynchronous batching overlaps a batch's forward with the previous batch's update, which the "
                "Recorder does not follow; set `ContinuousBatchingConfig(use_async_batching=False)`")
    graphs = getattr(config, "use_cuda_graph", None)
    if graphs is True or (isinstance(graphs, tuple) and any(graphs)):
        return ("with CUDA graphs the runner's step replays a graph, past the Recorder's taps; set "
                "`ContinuousBatchingConfig(use_cuda_graph=False)`")
    for name in ("varlen_compile_config", "decode_compile_config"):
        if getattr(config, name, None) is not None:
            return f"a compiled forward (`{name}`) runs past the Recorder's taps; leave `{name}` unset"
    return None


def runner_known() -> bool:
    """Whether this transformers release's continuous batching runs the model runner the capture taps (a
    `ModelRunner` whose `_forward_process_and_sample` calls its processor list and `_sample`: 5.x)."""
    try:
        from transformers.generation.continuous_batching.model_runner import ModelRunner
    except ImportError:
        return False
    return all(hasattr(ModelRunner, name) for name in ("_forward_process_and_sample", "_sample", "compute_batch"))


def _unknown_runner() -> UnsupportedModeError:
    return UnsupportedModeError(
        f"transformers {_compat.TRANSFORMERS_VERSION} runs continuous batching through a runner the Recorder "
        "does not know (it records the `ModelRunner` of 5.x); record `model.generate(**batch, "
        "logits_processor=[rec])` on a left-padded batch instead, or upgrade transformers.")


def dropped_processors(manager: Any) -> list[str]:
    """The processors `manager`'s generation config asks for that its continuous batching drops (those
    transformers marks `supports_continuous_batching = False`, with `drop_unsupported_processors`:
    the repetition penalties in 5.25)."""
    config = getattr(manager, "continuous_batching_config", None)
    model, generation_config = getattr(manager, "model", None), getattr(manager, "generation_config", None)
    if not getattr(config, "drop_unsupported_processors", True) or model is None or generation_config is None:
        return []
    asked = model._get_logits_processor(generation_config)  # as the manager builds its list
    return [type(p).__name__ for p in asked if getattr(p, "supports_continuous_batching", None) is False]


def _check_manager(manager: Any, options: Any) -> None:
    """`UnsupportedModeError` where a recorder of `options` cannot record `manager`'s requests as asked."""
    unsupported = [name for name in options.streams if name not in ("logits", "scores", STATS_STREAM)]
    unsupported += ["prompt_logprobs"] * (options.prompt_scoring is not None)
    if unsupported:
        raise UnsupportedModeError(
            f"continuous batching is recorded as logits, scores and per-token stats (in any encoding), tokens and "
            f"finished; this Recorder also asks for {', '.join(unsupported)}, which the runner does not compute per "
            "request. Record it with a Recorder without them (e.g. `Recorder(model, streams=('logits', 'scores'))`).")
    if not runner_known() or not hasattr(manager, "_create_batch_processor"):
        raise _unknown_runner()
    problem = refusal(getattr(manager, "continuous_batching_config", None))
    if problem is None and dropped_processors(manager):
        problem = (f"its generation config asks for {', '.join(dropped_processors(manager))}, which continuous batching "
                   f"drops (transformers {_compat.TRANSFORMERS_VERSION}): its requests would not be sampled as the config "
                   "says. Remove those settings, or record `model.generate(**batch, logits_processor=[rec])`")
    if problem is not None:
        raise UnsupportedModeError(f"this continuous batching manager cannot be recorded: {problem}.")


_CAPTURE = "_transformers_offload_capture"  # the manager's attribute naming the capture attached to it


class ContinuousCapture:
    """Records the requests of the continuous batching managers it is attached to, one `RequestSteps` per
    request, until `close`."""

    def __init__(self, on_request: OnRequest) -> None:
        self._on_request = on_request
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, str], RequestSteps] = {}  # per (manager, request id)
        self._managers: list[Any] = []  # attached, with their taps to remove at `close`
        self._with_stats = False  # whether `"stats"` is recorded (each runner then computes its own)
        self.closed = False

    def attach(self, manager: Any, options: Any) -> None:
        """Tap `manager`'s batch processor (now if it has one, else when it makes it) and its finished
        results, for a recorder of `options` (`RecorderOptions`). Attaching again is a no-op.

        Raises:
            TypeError: `manager` is not a continuous batching manager.
            RuntimeError: this capture is closed; `manager` is running already, or another recorder is
                attached to it.
            UnsupportedModeError: `manager` runs in a way that cannot be recorded (`refusal`), or `options`
                ask for what continuous batching does not give.
        """
        if not all(callable(getattr(manager, name, None)) for name in ("add_request", "get_result", "start")):
            raise TypeError(f"`attach` takes a continuous batching manager (`model.init_continuous_batching()`), "
                            f"got {type(manager).__name__}.")
        if self.closed:
            raise RuntimeError("this Recorder is closed; create a new `Recorder(model)` to record this manager.")
        owner = getattr(manager, _CAPTURE, None)
        if owner is self:
            return
        if callable(getattr(manager, "is_running", None)) and manager.is_running():
            raise RuntimeError("this continuous batching manager is running: attach the Recorder before "
                               "`manager.start()`, so that every step of its requests is recorded.")
        if owner is not None:
            raise RuntimeError("another Recorder is attached to this continuous batching manager: one records it at "
                               "a time; close that one first.")
        _check_manager(manager, options)
        self._with_stats = STATS_STREAM in options.streams
        create, get_result = manager._create_batch_processor, manager.get_result

        def create_batch_processor(*args: Any, **kwargs: Any) -> Any:
            return self._tap(manager, create(*args, **kwargs))

        def tapped_get_result(*args: Any, **kwargs: Any) -> Any:
            result = get_result(*args, **kwargs)
            if result is not None and result.is_finished():
                self.finish(result, manager.generation_config, id(manager))
            return result

        manager._create_batch_processor = create_batch_processor
        manager.get_result = tapped_get_result
        setattr(manager, _CAPTURE, self)
        self._managers.append(manager)
        if getattr(manager, "batch_processor", None) is not None:  # kept from an earlier run (`persistent_manager`)
            self._tap(manager, manager.batch_processor)

    def _tap(self, manager: Any, processor: Any) -> Any:
        """Tap the model runner of `manager`'s batch `processor` (once); returns `processor`."""
        problem = refusal(manager.continuous_batching_config, getattr(processor, "use_async_batching", False))
        if problem is not None:
            raise UnsupportedModeError(f"this continuous batching manager cannot be recorded: {problem}.")
        runner = processor.model_runner
        if isinstance(runner.logit_processor, _TappedProcessors):
            return processor  # a manager reuses its batch processor (made at warm-up, then at start)
        if getattr(runner, "use_cuda_graph_varlen", False) or getattr(runner, "use_cuda_graph_decode", False):
            raise UnsupportedModeError("the continuous batching runner replays CUDA graphs, past the Recorder's "
                                       "taps; set `ContinuousBatchingConfig(use_cuda_graph=False)`.")
        if getattr(runner, "_compiled_varlen", None) is not None or getattr(runner, "_compiled_decode", None) is not None:
            raise UnsupportedModeError("the continuous batching runner's forward is compiled, past the Recorder's "
                                       "taps; leave its compile configs unset.")
        runner.logit_processor = _TappedProcessors(runner.logit_processor, StepStats() if self._with_stats else None)
        sample, key = runner._sample, id(manager)

        def tapped_sample(scores: torch.Tensor, output_ids: torch.Tensor) -> None:
            sample(scores, output_ids)
            self._on_sample(runner, key, scores, output_ids)

        runner._sample = tapped_sample
        return processor

    def _on_sample(self, runner: Any, manager: int, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        """After a batch's sampling, in the manager's thread: each predicting request's row, to the host."""
        states = [future.state for future in runner.inputs_and_outputs.requests_in_batch if future.has_new_token]
        rows = len(states)
        processors = runner.logit_processor
        processed = processors.do_processing
        raw, processors.raw = processors.raw, None
        logits = raw[:rows] if processed else _to_host(scores[0, :rows])
        kept = _to_host(scores[0, :rows]) if processed else None
        tokens = _to_host(output_ids[0, :rows])
        stats = None
        if processors.stats is not None:  # computed on the device, as in generate(); its small record to the host
            if not processed:
                processors.stats.raw(0, scores[0])
            processors.stats.processed(0, scores[0])
            stats = _to_host(processors.stats.record(0, output_ids[0, : scores.shape[1]].long())[:rows])
            processors.stats.clear()
        with self._lock:
            for row, state in enumerate(states):
                steps = self._pending.get((manager, state.request_id))
                if steps is None:  # its first step
                    steps = self._pending[(manager, state.request_id)] = RequestSteps(settings=request_settings(state))
                steps.logits.append(logits[row])
                steps.scores.append(None if kept is None else kept[row])
                steps.tokens.append(tokens[row])
                if stats is not None:
                    steps.stats.append(stats[row])

    def finish(self, result: Any, generation_config: Any, manager: int) -> None:
        """A request's result was handed out by `manager` (its `id`): its steps go to the recorder."""
        with self._lock:
            steps = self._pending.pop((manager, result.request_id), RequestSteps())
            if self.closed:
                return
        self._on_request(result, steps, generation_config)

    def close(self) -> None:
        """Remove the taps from every attached manager (its kept batch processor's too) and drop the steps of
        requests whose result was not handed out (read another way than `get_result`, cancelled, or still
        running), warning `UnrecordedCallWarning` with their ids."""
        with self._lock:
            self.closed = True
            dropped = sorted({request_id for _, request_id in self._pending})
            self._pending.clear()
        for manager in self._managers:
            for name in ("_create_batch_processor", "get_result", _CAPTURE):
                manager.__dict__.pop(name, None)
            runner = getattr(getattr(manager, "batch_processor", None), "model_runner", None)
            if runner is not None and isinstance(runner.logit_processor, _TappedProcessors):
                runner.logit_processor = runner.logit_processor._processors
                runner.__dict__.pop("_sample", None)
        self._managers.clear()
        if dropped:
            warnings.warn(UnrecordedCallWarning(
                f"continuous batching requests {dropped} were not recorded: their results were not handed out "
                "through `manager.get_result()` before the Recorder closed (cancelled, still running, or read "
                "another way)."), stacklevel=3)


def run_recorded(model: Any, generate_batch: Any, args: tuple, kwargs: dict, attach: Callable[[Any], None]) -> Any:
    """Run `generate_batch(*args, **kwargs)` with `attach` called on the continuous batching manager
    it creates (through `model.init_continuous_batching`, wrapped on this instance for the call).

    Raises:
        UnsupportedModeError: this release's continuous batching is not recorded; before it runs.
        RuntimeError: the call made no manager through `init_continuous_batching`, so nothing was recorded.
    """
    if not runner_known():
        raise _unknown_runner()
    if kwargs.get("logits_processor"):
        names = ", ".join(type(p).__name__ for p in kwargs["logits_processor"])
        warnings.warn(f"generate_batch() does not run the `logits_processor` it is given ({names}): continuous "
                      "batching builds its processors from the generation config. The Recorder records what it ran.",
                      UserWarning, stacklevel=4)
    init, own = model.init_continuous_batching, model.__dict__.get("init_continuous_batching")
    attached = []

    def init_continuous_batching(*init_args: Any, **init_kwargs: Any) -> Any:
        manager = init(*init_args, **init_kwargs)
        attach(manager)
        attached.append(manager)
        return manager

    model.init_continuous_batching = init_continuous_batching
    try:
        output = generate_batch(*args, **kwargs)
    finally:
        if own is None:
            del model.init_continuous_batching  # the class's method again
        else:
            model.init_continuous_batching = own
    if not attached and (args[0] if args else kwargs.get("inputs")):  # generate_batch([]) makes none
        raise RuntimeError("generate_batch() returned without making a continuous batching manager through "
                           "`init_continuous_batching`, so nothing was recorded; please report this with your "
                           "transformers version.")
    return output
