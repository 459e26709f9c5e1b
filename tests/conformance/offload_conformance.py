"""A pytest plugin: every `generate()` call of a test session runs with a Recorder, checked against
what the call returned.

Load it with `-p offload_conformance` (its folder on `PYTHONPATH`) and `--conformance-out DIR`, into
any test session that calls `generate()` (Hugging Face's own tests, `scripts/conformance.py`). For
the session, `generate` of `GenerationMixin` and of every model class that overrides it is wrapped
(a test harness: the classes are patched, then restored). The outermost `generate()` call of a test
(not the ones it makes inside: an assistant's, a delegating model's inner call, Whisper's loops):

1. runs as the test made it, with a `Recorder(model)` added to its `logits_processor`;
2. where it did not ask for both `output_scores` and `output_logits` (with `return_dict_in_generate`),
   runs again from the same torch random state without the Recorder and with them on: Hugging Face's
   reference. The rerun starts from deep copies, taken before the first run, of what the call may change
   (a given cache, processors, stopping criteria, a passed generation config, the model's and the
   assistant's generation configs); it gets no streamer (the test's sees the recorded run's tokens once).
   A Whisper long-form call is rerun with `return_timestamps=True`, so that each segment's result holds
   its loop's outputs (`_whisper_segments`); torch.compile's recompilation logs are off while it runs
   (`_harness_only`);
3. compares, with `torch.equal`, every recorded step's raw logits and processed scores with the
   reference's (`out.logits`, `out.scores`; Whisper's per-sequence and per-segment outputs mapped as
   `docs/support.md` says), and the sequences of the recorded run with the reference's.

Each call is one line of JSON in `DIR/calls-<worker>.jsonl`: its test, model family (`model_type`),
class, mode and verdict: `exact`; `different` (the recorder marked the generation incomplete, or a
stream, step or the returned sequences differ: `detail` says which); `refused`
(`UnsupportedModeError`, its message in `detail`); `crashed` (the recorded call raised anything else
while the same call without the Recorder does not); `unchecked` (recorded, but the call returns no
scores to compare with even when asked, or raises when asked for them); `raises` (the call raises
without the Recorder too: the test expects it); and whether it used prompt lookup. Each test's outcome
goes to `DIR/tests-<worker>.jsonl`, each file that failed to collect to `DIR/collect-<worker>.jsonl`, and
the shims `follow_the_release` applied to `DIR/shims-<worker>.jsonl`.

The test sees what it would without the plugin: the recorded run's result (checked equal to the
reference's sequences), or, where the recorder refused or crashed, the result of the call without it;
the torch random state after the call is the one the returned run left.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import os
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from transformers import GenerationMixin, PreTrainedModel

from transformers_offload import Recorder
from transformers_offload.errors import DeviceAccumulationWarning, RecordingMismatchWarning, UnsupportedModeError

FLAGS = ("return_dict_in_generate", "output_scores", "output_logits")
_STATE = threading.local()  # .depth: generate() calls of this thread running inside a checked one
_WRAPPED = "__offload_conformance_original__"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--conformance-out", default=None,
                     help="folder for the per-call verdicts (calls-<worker>.jsonl, tests-<worker>.jsonl)")
    parser.addoption("--conformance-baseline", action="store_true",
                     help="record only each test's outcome, with generate() untouched (the run to compare with)")


# -- wrapping the classes ----------------------------------------------------------------------------
def _generating_classes() -> list[type]:
    seen, todo = [], [GenerationMixin]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


def _wrap(classes: list[type]) -> None:
    for cls in classes:
        original = cls.__dict__.get("generate")
        if original is not None and not hasattr(original, _WRAPPED):
            cls.generate = _checked(original)


def wrap_all() -> None:
    """Wrap the `generate` every loaded generating class defines itself, and that of every model built
    later (transformers loads a model's module when first used: its `post_init` wraps its classes)."""
    _wrap(_generating_classes())
    if not hasattr(PreTrainedModel.post_init, _WRAPPED):
        original = PreTrainedModel.post_init

        @functools.wraps(original)
        def post_init(self, *args, **kwargs):
            _wrap([cls for cls in type(self).__mro__ if isinstance(cls, type) and issubclass(cls, GenerationMixin)])
            return original(self, *args, **kwargs)

        setattr(post_init, _WRAPPED, original)
        PreTrainedModel.post_init = post_init


def unwrap_all() -> None:
    for cls in _generating_classes():
        wrapper = cls.__dict__.get("generate")
        if wrapper is not None and hasattr(wrapper, _WRAPPED):
            cls.generate = getattr(wrapper, _WRAPPED)
    if hasattr(PreTrainedModel.post_init, _WRAPPED):
        PreTrainedModel.post_init = getattr(PreTrainedModel.post_init, _WRAPPED)


def _checked(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if getattr(_STATE, "depth", 0) or _SESSION.out is None or _SESSION.baseline:
            return original(self, *args, **kwargs)
        _STATE.depth = 1
        try:
            return _check_call(functools.partial(original, self), signature, self, args, kwargs)
        finally:
            _STATE.depth = 0

    setattr(generate, _WRAPPED, original)
    return generate


# -- one call ----------------------------------------------------------------------------------------
class _Session:
    out: Path | None = None
    test: str | None = None
    worker: str = "main"
    baseline: bool = False
    calls: list[dict[str, Any]] = []


_SESSION = _Session()


def _arguments(signature: inspect.Signature, model: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = signature.bind(model, *args, **kwargs)
    return bound


def _call(original: Callable[..., Any], bound: inspect.BoundArguments, **changes: Any) -> Any:
    """`original` with the bound arguments, `changes` applied (a named parameter, or a **kwargs entry).
    `original` takes the arguments after the model: the unwrapped method bound to it, or the model's
    own `generate` (the Recorder's hooks on the instance, then this plugin's wrapper, which passes it on)."""
    arguments = dict(bound.arguments)
    var_kw = next((p.name for p in bound.signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    extra = dict(arguments.pop(var_kw, {})) if var_kw else {}
    for name, value in changes.items():
        if name in bound.signature.parameters and name != var_kw:
            arguments[name] = value
        else:
            extra[name] = value
    # As keywords wherever the signature allows: what the test passed positionally too (the Recorder's
    # hooks bind a call against transformers' own `generate()` where a model's names no `logits_processor`).
    positional, keywords = [], {}
    for name, value in list(arguments.items())[1:]:
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.POSITIONAL_ONLY:
            positional.append(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            positional.extend(value)
        else:
            keywords[name] = value
    return original(*positional, **keywords, **extra)


def _get(bound: inspect.BoundArguments, name: str, default: Any = None) -> Any:
    if name in bound.arguments and name in bound.signature.parameters:
        return bound.arguments[name]
    for parameter in bound.signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            return bound.arguments.get(parameter.name, {}).get(name, default)
    return default


def _asked(model: Any, bound: inspect.BoundArguments, flag: str) -> bool:
    value = _get(bound, flag)
    if value is None:
        config = _get(bound, "generation_config") or getattr(model, "generation_config", None)
        value = getattr(config, flag, False)
    return bool(value)


def _snapshot(model: Any, bound: inspect.BoundArguments) -> dict[str, Any]:
    """What a call may change and a rerun needs as it was: the given cache, processors, criteria and
    generation config, and the model's and the assistant's generation configs (assisted decoding tunes its
    draft length), deep-copied before the first run."""
    saved: dict[str, Any] = {}
    # A streamer is not copied: the reference run gets none (the test's sees the recorded run's tokens once).
    for name in ("past_key_values", "logits_processor", "stopping_criteria", "generation_config"):
        value = _get(bound, name)
        if value is not None:
            try:
                saved[name] = copy.deepcopy(value)
            except Exception:  # noqa: BLE001 - not copyable: the rerun gets it as it is then
                pass
    owners = [model, _get(bound, "assistant_model")]
    saved["configs"] = [(owner, copy.deepcopy(owner.generation_config)) for owner in owners
                        if owner is not None and getattr(owner, "generation_config", None) is not None]
    return saved


def _restore(saved: dict[str, Any]) -> dict[str, Any]:
    """Put the saved generation configs back; the other saved values, copied again, for a call."""
    for owner, config in saved["configs"]:
        owner.generation_config = copy.deepcopy(config)
    return {name: copy.deepcopy(value) for name, value in saved.items() if name != "configs"}


def _current_configs(saved: dict[str, Any]) -> list[tuple[Any, Any]]:
    return [(owner, owner.generation_config) for owner, _ in saved["configs"]]


def _put_configs(configs: list[tuple[Any, Any]]) -> None:
    for owner, config in configs:
        owner.generation_config = config


def _check_call(original: Callable[..., Any], signature: inspect.Signature, model: Any, args: tuple, kwargs: dict) -> Any:
    bound = _arguments(signature, model, args, kwargs)
    record: dict[str, Any] = {
        "test": _SESSION.test,
        "family": getattr(getattr(model, "config", None), "model_type", None) or "?",
        "model": type(model).__name__,
        "asked": {flag: _asked(model, bound, flag) for flag in FLAGS},
        "prompt_lookup": _get(bound, "prompt_lookup_num_tokens") is not None or getattr(
            _get(bound, "generation_config"), "prompt_lookup_num_tokens", None) is not None,
    }
    saved = _snapshot(model, bound)
    before = torch.get_rng_state()
    processors = list(_get(bound, "logits_processor") or [])
    rec = None
    try:
        rec = Recorder(model)
        with warnings.catch_warnings():
            # The plugin reads the verdict from the generation itself; the asked-for outputs are the test's.
            warnings.simplefilter("ignore", DeviceAccumulationWarning)
            warnings.simplefilter("ignore", RecordingMismatchWarning)
            out = _call(model.generate, bound, logits_processor=[*processors, rec])
    except BaseException as error:  # noqa: BLE001 - classified below, then the call runs without it
        if rec is not None:
            rec.close()
        if isinstance(error, KeyboardInterrupt):
            raise
        record["modes"] = sorted({g.mode for g in (rec.generations if rec is not None else ())})
        torch.set_rng_state(before)
        fresh = _restore(saved)
        try:
            out = _call(original, bound, **fresh)
        except BaseException:
            record.update(verdict="raises", detail=f"{type(error).__name__}: {error}"[:500])
            _SESSION.calls.append(record)
            raise
        if isinstance(error, UnsupportedModeError):
            record.update(verdict="refused", detail=str(error)[:500])
        else:
            record.update(verdict="crashed", detail=f"{type(error).__name__}: {error}"[:500],
                          traceback=traceback.format_exc(limit=-8))
        _SESSION.calls.append(record)
        return out
    rec.close()
    after = torch.get_rng_state()
    generations = rec.generations
    record["modes"] = sorted({g.mode for g in generations})
    record["generations"] = len(generations)
    try:
        if all(record["asked"].values()):
            reference = out
        else:
            torch.set_rng_state(before)
            now = _current_configs(saved)
            fresh = _restore(saved)
            fresh.pop("logits_processor", None)
            try:
                quiet = {"streamer": None} if _get(bound, "streamer") is not None else {}
                with _harness_only(model):
                    reference = _call(original, bound, **fresh, **quiet, **_whisper_segments(model, bound),
                                      logits_processor=_fresh_processors(saved, processors),
                                      return_dict_in_generate=True, output_scores=True, output_logits=True)
            except Exception as error:  # noqa: BLE001 - the model cannot return them: nothing to compare with
                record.update(verdict="unchecked", detail=_UNASKABLE.format(error=f"{type(error).__name__}: {error}")[:500])
                _SESSION.calls.append(record)
                return out
            finally:
                _put_configs(now)
                torch.set_rng_state(after)
        record.update(compare(model, generations, out, reference))
    except Exception as error:  # noqa: BLE001 - the comparison itself failed: report it, keep the test going
        record.update(verdict="crashed", detail=f"comparison failed: {type(error).__name__}: {error}"[:500],
                      traceback=traceback.format_exc(limit=-8))
    _SESSION.calls.append(record)
    return out


# The reference run, the same call without the Recorder and with Hugging Face's outputs asked for, raised while
# the recorded run (without them) did not: the model's generate() cannot return its scores (SeamlessM4T's speech
# generation hands `return_dict_in_generate` to its text-to-unit model too, whose output it then treats as a
# tensor). No recorder ran in it; the call is `unchecked`, not a recorder crash.
_UNASKABLE = ("the reference run (no Recorder, return_dict_in_generate, output_scores and output_logits asked) raised "
              "{error}: this generate() cannot return its scores, so there is nothing to compare with")


def _whisper_segments(model: Any, bound: inspect.BoundArguments) -> dict[str, Any]:
    """For a Whisper long-form call (more input frames than one segment) that asked for no dict output:
    `return_timestamps=True`, which long-form transcription sets for itself anyway, so that the reference
    returns each segment's own outputs (`segments[prompt][i]["result"]`: scores and logits of that
    segment's kept attempt). Without it, 5.25 returns `return_dict_in_generate=True`'s long-form output as
    the last segment's output alone (its check reads the `return_timestamps` argument, None, not the
    generation config's True), which no recording can be compared with."""
    if not _is_whisper(model) or _get(bound, "return_dict_in_generate") or _get(bound, "return_timestamps") is not None:
        return {}
    features = _get(bound, "input_features")
    if features is None:
        features = _get(bound, "inputs")
    try:
        encoder = model.get_encoder()
        stride = encoder.conv1.stride[0] * encoder.conv2.stride[0]
        long_form = features.shape[-1] > stride * model.config.max_source_positions
    except (AttributeError, IndexError, TypeError):
        return {}
    return {"return_timestamps": True} if long_form else {}


@contextlib.contextmanager
def _harness_only(model: Any):
    """The reference run is the harness's, not the test's: torch.compile's recompilation logs are off
    while it runs. A compiled forward that ran with the Recorder's hooks compiles once more for the
    reference run without them (its guards read whether a call is recorded); a test that counts
    recompilations (`test_generate_compile_model_forward_fullgraph`) must see its own calls only. The
    test's later recorded calls still log any recompilation of theirs."""
    names = [name for name in list(logging.Logger.manager.loggerDict) if name.startswith("torch._dynamo")]
    loggers = [logging.getLogger(name) for name in names]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in zip(loggers, before):
            logger.disabled = disabled


def _fresh_processors(saved: dict[str, Any], processors: list[Any]) -> list[Any]:
    if "logits_processor" in saved:
        return list(copy.deepcopy(saved["logits_processor"]))
    return processors


# -- the comparison ----------------------------------------------------------------------------------
def _field(output: Any, name: str) -> Any:
    if isinstance(output, dict) or hasattr(output, "keys"):
        try:
            return output[name]
        except (KeyError, TypeError):
            return getattr(output, name, None)
    return getattr(output, name, None)


def _sequences(output: Any) -> torch.Tensor | None:
    return output if isinstance(output, torch.Tensor) else _field(output, "sequences")


def _differ(mine: torch.Tensor, theirs: torch.Tensor) -> str | None:
    theirs = theirs.detach().cpu()
    if mine.shape != theirs.shape:
        return f"shape {tuple(mine.shape)} recorded, {tuple(theirs.shape)} returned"
    if mine.dtype != theirs.dtype:
        return f"dtype {mine.dtype} recorded, {theirs.dtype} returned"
    if torch.equal(mine, theirs):
        return None
    unequal = ~((mine == theirs) | (mine.isnan() & theirs.isnan()))
    if not unequal.any():
        return None  # equal but for NaNs in the same places
    row, column = unequal.nonzero()[0].tolist()[:2] if mine.dim() >= 2 else (unequal.nonzero()[0].item(), None)
    where = f"row {row}, column {column}" if column is not None else f"row {row}"
    return (f"{int(unequal.sum())} of {mine.numel()} values differ, first at {where}: "
            f"{mine[row, column].item() if column is not None else mine[row].item()!r} recorded, "
            f"{theirs[row, column].item() if column is not None else theirs[row].item()!r} returned")


def _compare_steps(what: str, recorded: tuple, returned: Any,
                   pick: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> str | None:
    if returned is None:
        return None
    if len(recorded) != len(returned):
        return f"{what}: {len(recorded)} steps recorded, {len(returned)} returned"
    for step, (mine, theirs) in enumerate(zip(recorded, returned)):
        if pick is not None:
            mine = pick(step, mine)
        problem = _differ(mine, theirs)
        if problem:
            return f"{what} step {step}: {problem}"
    return None


def compare(model: Any, generations: tuple, out: Any, reference: Any) -> dict[str, Any]:
    """The verdict of one recorded call: its generations against `reference` (what the call returns
    with scores and logits on), and the recorded run's sequences against the reference's."""
    if not generations:
        return {"verdict": "different", "detail": "nothing was recorded"}
    for generation in generations:
        if not generation.complete:
            return {"verdict": "different", "detail": f"generation {generation.index} incomplete: {generation.error}"}
    mine, theirs = _sequences(out), _sequences(reference)
    if mine is not None and theirs is not None and out is not reference:
        if _is_whisper(model) and isinstance(out, torch.Tensor) and mine.shape[1] < theirs.shape[1]:
            theirs = theirs[:, theirs.shape[1] - mine.shape[1]:]  # Whisper's plain tensor drops its decoder prompt
        problem = _differ(mine.cpu(), theirs)
        if problem:
            return {"verdict": "different",
                    "detail": f"the recorded run returned other sequences than the call without the Recorder: {problem}"}
    if len(generations) == 1 and _field(reference, "segments") is None:
        return _compare_one(model, generations[0], reference)
    return _compare_loops(generations, reference)


def _is_whisper(model: Any) -> bool:
    return callable(getattr(type(model), "generate_with_fallback", None))


def _compare_one(model: Any, generation: Any, reference: Any) -> dict[str, Any]:
    scores, logits = _field(reference, "scores"), _field(reference, "logits")
    if scores is None and logits is None:
        return {"verdict": "unchecked", "detail": "the call returns neither scores nor logits, even when asked"}
    scores_pick = logits_pick = None
    beam_indices = _field(reference, "beam_indices")
    if _is_whisper(model) and generation.is_beam and beam_indices is not None:
        # Whisper returns, per sequence and step, the scores row its beam came from, and the first
        # running rows' logits (docs/support.md).
        def scores_pick(step: int, mine: torch.Tensor) -> torch.Tensor:
            return mine[beam_indices[:, step].clamp(min=0).cpu()]

        def logits_pick(step: int, mine: torch.Tensor) -> torch.Tensor:
            return mine[: logits[step].shape[0]]
    problem = (_compare_steps("scores", generation.scores(), scores, scores_pick)
               or _compare_steps("logits", generation.logits(), logits, logits_pick))
    if problem:
        return {"verdict": "different", "detail": f"mode {generation.mode}, {problem}"}
    return {"verdict": "exact"}


def _compare_loops(generations: tuple, reference: Any) -> dict[str, Any]:
    """A call that ran the loop several times (Whisper's fallback, segments): each prompt's kept loops
    against what the call returns for it (per segment where it returns segments)."""
    kept: dict[int, list[tuple[Any, int]]] = {}
    for generation in generations:
        loop = generation.loop or {}
        for row, prompt in enumerate(loop.get("batch_rows", [])):
            if prompt in loop.get("kept_rows", []):
                kept.setdefault(prompt, []).append((generation, row))
    segments = _field(reference, "segments")
    returned_rows = None if _field(reference, "scores") is None else _field(reference, "scores")[0].shape[0]
    if segments is None and (returned_rows != len(kept) or any(len(loops) > 1 for loops in kept.values())):
        return {"verdict": "unchecked",
                "detail": f"{len(generations)} loops recorded for {len(kept)} prompt(s); the call returns no segments "
                          f"and scores for {returned_rows} row(s): nothing to map each loop to"}
    for prompt, loops in sorted(kept.items()):
        if segments is not None:
            results = _loop_results(segments[prompt])
        else:
            results = [{"scores": _column(_field(reference, "scores"), prompt),
                        "logits": _column(_field(reference, "logits"), prompt)}]
        if len(results) != len(loops):
            return {"verdict": "different",
                    "detail": f"prompt {prompt}: {len(loops)} kept loops recorded, {len(results)} results returned"}
        for index, ((generation, row), result) in enumerate(zip(loops, results)):
            for stream in ("scores", "logits"):
                returned = result.get(stream) if isinstance(result, dict) else _field(result, stream)
                if returned is None:
                    continue
                recorded = tuple(step[row] for step in getattr(generation, stream)())
                problem = _compare_steps(stream, recorded, returned)
                if problem:
                    return {"verdict": "different",
                            "detail": f"mode {generation.mode}, prompt {prompt}, loop {index} ({generation.loop}): {problem}"}
    if not kept:
        return {"verdict": "different", "detail": f"{len(generations)} loops recorded, none kept"}
    return {"verdict": "exact"}


def _loop_results(segments: list[dict[str, Any]]) -> list[Any]:
    """One result per decoding loop of a prompt: Whisper cuts a loop's output into several segments at
    its timestamp pairs, each holding that loop's result (the same object); a loop with no timestamp pair
    gives one segment."""
    results: list[Any] = []
    for segment in segments:
        if not results or segment["result"] is not results[-1]:
            results.append(segment["result"])
    return results


def _column(steps: Any, row: int) -> Any:
    return None if steps is None else tuple(step[row] for step in steps)


# -- following the release ---------------------------------------------------------------------------
def follow_the_release() -> list[str]:
    """The one place where a test tree older or newer than the installed release is bridged: names the
    tree calls that the release renamed or dropped, given back with the release's meaning. Applied to the
    recorded and the baseline runs alike (so a test failing for another reason fails in both), before any
    test module is imported. Returns what it added, for the run's log.

    - `PreTrainedModel._is_stateful` (the tree's assisted-decoding tests skip stateful models with it):
      dropped by 5.25, whose generation code no longer reads it; False, as it was for every model class
      but the recurrent ones (none of the families run here).
    - `Cache.get_max_cache_shape(layer_idx=0)` (the attention-shape checks of static caches): renamed
      `get_max_length(layer_idx=None)` by 5.25; a layer's maximum length, as before.
    - `cache_implementation="dynamic_full"` (the assisted-decoding tests' greedy reference: a dynamic cache
      without sliding layers, which rollback needed): dropped by 5.24, whose assisted decoding rolls back
      any dynamic cache itself; read as `"dynamic"`, the release's dynamic cache.
    - `@is_flaky` written bare on a test (the tree's `test_prompt_lookup_decoding_matches_greedy_search`):
      the release's `is_flaky` is a decorator factory, so bare it turns the test into a function that
      returns a decorator and runs nothing, which pytest counts as a pass. Called with the test itself, it
      now decorates it with the factory's defaults, so the test runs (and retries) as its authors meant.
    """
    from transformers import GenerationConfig, cache_utils, testing_utils
    from transformers.generation import configuration_utils

    added = []
    flaky = getattr(testing_utils, "is_flaky", None)
    parameters = list(inspect.signature(flaky).parameters.values()) if callable(flaky) else []
    if parameters and parameters[0].default is not inspect.Parameter.empty and not hasattr(flaky, _WRAPPED):
        @functools.wraps(flaky)
        def is_flaky(*args, **kwargs):
            if len(args) == 1 and not kwargs and callable(args[0]):  # bare: the test itself
                return flaky()(args[0])
            return flaky(*args, **kwargs)

        setattr(is_flaky, _WRAPPED, flaky)
        testing_utils.is_flaky = is_flaky
        added.append("@is_flaky bare = @is_flaky()")
    if not hasattr(PreTrainedModel, "_is_stateful"):
        PreTrainedModel._is_stateful = False
        added.append("PreTrainedModel._is_stateful = False")
    cache = getattr(cache_utils, "Cache", None)
    if cache is not None and not hasattr(cache, "get_max_cache_shape") and hasattr(cache, "get_max_length"):
        def get_max_cache_shape(self, layer_idx: int = 0) -> int:
            return self.get_max_length(layer_idx)

        cache.get_max_cache_shape = get_max_cache_shape
        added.append("Cache.get_max_cache_shape = Cache.get_max_length")
    known = getattr(configuration_utils, "ALL_CACHE_IMPLEMENTATIONS", ("dynamic_full",))
    if "dynamic_full" not in known and not hasattr(GenerationConfig.validate, _WRAPPED):
        validate = GenerationConfig.validate

        @functools.wraps(validate)
        def validate_dynamic_full(self, *args, **kwargs):
            if getattr(self, "cache_implementation", None) == "dynamic_full":
                self.cache_implementation = "dynamic"
            return validate(self, *args, **kwargs)

        setattr(validate_dynamic_full, _WRAPPED, validate)
        GenerationConfig.validate = validate_dynamic_full
        added.append('cache_implementation "dynamic_full" = "dynamic"')
    return added


# -- the session -------------------------------------------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    out = config.getoption("--conformance-out")
    if out is None:
        return
    shims = follow_the_release()
    _SESSION.out = Path(out)
    _SESSION.out.mkdir(parents=True, exist_ok=True)
    _SESSION.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _SESSION.calls = []
    _SESSION.baseline = bool(config.getoption("--conformance-baseline"))
    if shims:  # every process writes them; the script reads them as a set
        _write("shims", [{"shim": shim} for shim in shims])
    if not _SESSION.baseline:
        wrap_all()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION.out is not None:
        unwrap_all()
        _SESSION.out = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if _SESSION.out is None or _SESSION.baseline:
        yield
        return
    wrap_all()  # classes a test module defined or imported late
    _SESSION.test = item.nodeid
    _SESSION.calls = []
    try:
        yield
    finally:
        _write("calls", _SESSION.calls)
        _SESSION.calls = []
        _SESSION.test = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _SESSION.out is None:
        return
    if hasattr(report, "node"):  # xdist's controller: the worker wrote it already, unless it crashed
        if report.when == "???":
            _write("crashed", [{"test": report.nodeid, "detail": str(report.longrepr)[:500]}])
        return
    if report.when == "call" or report.outcome != "passed":
        row = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
        if report.failed:
            row["detail"] = _last_line(report)
        _write("tests", [row])


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A test file that failed to import or collect: nothing of it ran, which the script refuses."""
    if _SESSION.out is None or hasattr(report, "node") or not report.failed:
        return
    _write("collect", [{"file": report.nodeid, "detail": _last_line(report)}])


def _last_line(report: Any) -> str:
    lines = [line for line in str(report.longrepr).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[-1] if errors else lines[-1] if lines else "")[:500]


def _write(kind: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    with open(_SESSION.out / f"{kind}-{_SESSION.worker}.jsonl", "a", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row, default=str) + "\n")
