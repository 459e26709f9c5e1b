"""Hooks into one model instance: inert unless a `generate()` call carries an attached recorder.

Attaching a recorder shadows, in the instance's `__dict__` (never on the class), `generate`, the private
`_get_logits_processor` and `_get_stopping_criteria` (and `_get_logits_warper` where it exists;
`generate_batch`, to record continuous batching; a Whisper model's methods around its decoding loops,
`loops.loop_tap_wrappers`), and registers forward hooks that ask the forward for attentions or hidden
states when the recorder records them. A call whose `logits_processor` holds no recorder runs the
original methods untouched; detaching the last recorder removes every wrapper and hook.

The call in progress (`loops.RecordedCall`: one capture per decoding loop) is kept per thread, so two
threads generating with their own recorders never see each other's steps. A model whose `generate()`
calls an inner model's (BLIP-2) has the recorder attached to the inner model for the call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from typing import Any, Callable

import torch

from .. import _compat, _interrupts
from ..errors import UnsupportedModeError
from . import prompt_logprobs as _prompt_logprobs
from .call_recorder import CallRecorder
from .layers import STREAMS as _layer_streams
from .loops import RecordedCall, loop_tap_wrappers
from .loops import active_call as _active_call
from .loops import active_calls as _active_calls
from .loops import active_capture as _active_capture
from .loops import arguments_of as _bind
from .loops import calls_on as _active
from .modes import check_mode, check_own_loop
from .refusals import not_pickled
from .tapped_lists import TappedCriteriaList, TappedProcessorList

_ABSENT = object()
_LOCK = threading.Lock()
_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, ModelHooks]" = weakref.WeakKeyDictionary()


class ModelHooks:
    """The wrappers installed on one model instance, shared by every recorder attached to it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model_ref = weakref.ref(model)
        self.recorders: list[Any] = []
        self._wrappers: dict[str, Callable[..., Any]] = {}
        self._previous: dict[str, Any] = {}  # what the instance's __dict__ held before (usually nothing)
        self._forward_handle: Any = None
        self._pre_handles: list[Any] = []  # the pre-hooks, and the encoder's forward hook
        self._loop_taps = _compat.loop_taps(model)  # a model's methods around each decoding loop

    def __reduce_ex__(self, protocol: Any) -> Any:
        model = self._model_ref()
        raise not_pickled(f"this {type(model).__name__}, with a transformers-offload Recorder attached,")

    # -- attach / detach ---------------------------------------------------------------------------
    def install(self) -> None:
        model = self._model_ref()
        names = ("generate", *_compat.LIST_BUILDERS, *_compat.CONTINUOUS_BATCHING_ENTRIES, *self._loop_taps)
        makers = {
            **loop_tap_wrappers(self._model_ref),
            "generate_batch": self._wrap_generate_batch,
            "generate": self._wrap_generate,
            "_get_logits_processor": self._wrap_processor_list,
            "_get_stopping_criteria": self._wrap_criteria_list,
            "_get_logits_warper": self._wrap_warper_list,
        }
        for name in names:
            wrapper = makers[name](getattr(model, name))
            self._previous[name] = model.__dict__.get(name, _ABSENT)
            model.__dict__[name] = wrapper
            self._wrappers[name] = wrapper
        self._forward_handle = model.register_forward_hook(self._on_forward)
        encoder = _compat.encoder_of(model)
        for module in (model, encoder):
            if module is not None:
                self._pre_handles.append(module.register_forward_pre_hook(self._ask_outputs, with_kwargs=True))
        if encoder is not None:
            self._pre_handles.append(encoder.register_forward_hook(self._on_encoder_forward))
        else:  # their output is the head's input: the prompt logprobs' hidden states
            for decoder in _prompt_logprobs.decoders_of(model):
                self._pre_handles.append(decoder.register_forward_hook(self._on_base_forward))

    def uninstall(self) -> None:
        model = self._model_ref()
        if model is not None:
            for name, wrapper in self._wrappers.items():
                if model.__dict__.get(name) is not wrapper:
                    continue  # someone replaced our wrapper since: leave theirs alone
                previous = self._previous.get(name, _ABSENT)
                if previous is _ABSENT:
                    del model.__dict__[name]
                else:
                    model.__dict__[name] = previous
        self._wrappers.clear()
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None
        for handle in self._pre_handles:
            handle.remove()
        self._pre_handles = []

    # -- wrappers ------------------------------------------------------------------------------------
    def _wrap_generate(self, original: Callable[..., Any]) -> Callable[..., Any]:
        # Bind the call against the class's `generate` (not `original`, which may be a user's
        # `*args, **kwargs` wrapper) to find `logits_processor` however it was passed: by name, or in
        # the `**kwargs` of a class that overrides `generate()` without naming it (BLIP-2, a user's).
        class_generate = type(self._model_ref()).generate
        var_keyword = next((name for name, parameter in inspect.signature(class_generate).parameters.items()
                            if parameter.kind is inspect.Parameter.VAR_KEYWORD), None)

        def generate(*args: Any, **kwargs: Any) -> Any:
            model = self._model_ref()
            try:
                bound = _bind(class_generate, (model, *args), kwargs)
            except TypeError:
                return original(*args, **kwargs)  # let transformers report the bad call
            extra = bound.get(var_keyword, {}) if var_keyword else {}
            arguments = {**extra, **bound}
            recorder = self._recorder_of_call(arguments)
            # A call inside another model's recorded loop (an inner decoder's, per step; with or without the
            # recorder, handed down with the outer call's processors) is not recorded: it is counted on the
            # outer loop's generation, and the recorder passes its scores through.
            outer = _recording_loop(recorder) if _active_call(model) is None else None
            if outer is not None:
                outer.capture.count_nested_call()
            elif recorder is None and not _active_calls():
                for attached in list(self.recorders):
                    attached.unrecorded_call()
            if recorder is None or outer is not None:
                # Not recorded, even when made inside a recorded call (e.g. from a processor).
                with _active(model, None):
                    return original(*args, **kwargs)
            config = _compat.provisional_generation_config(model, arguments.get("generation_config"), extra)
            check_own_loop(model, check_mode(config, arguments.get("assistant_model"), recorder.streams))
            # Ctrl-C is held while the recorder's own code runs, and the end of the call writes what
            # was recorded before raising it (`_interrupts`).
            tapped = bool(self._loop_taps)
            checked = dict(
                custom_generate=arguments.get("custom_generate"),
                # A model that runs the loop per segment masks its audio frames, not the loop's prompts.
                attention_mask=None if tapped else _tensor_or_none(arguments.get("attention_mask")),
                inputs=_first_tensor(arguments.get("inputs"), arguments.get("input_ids"), arguments.get("inputs_embeds"),
                                     arguments.get("input_features"), arguments.get("pixel_values")),
                past_key_values=arguments.get("past_key_values"),
            )
            begin = functools.partial(recorder.begin_call, assistant_model=arguments.get("assistant_model"),
                                      **checked)
            call = RecordedCall(recorder, begin, tapped=tapped)
            delegates = _compat.generation_delegates(model)
            if delegates:
                _check_lazy_call(model, recorder, checked)
            with _interrupts.call(), _attached_for_the_call(delegates, recorder):
                before = len(recorder.generations)
                try:
                    if not delegates:
                        with _interrupts.held():
                            call.begin()
                    # A model with generating children (BLIP-2's language model, CSM's depth decoder) may
                    # hand the call to a child's generate() or run the loop itself: its capture begins
                    # when its own loop starts, if it does (`_get_logits_processor`).
                    with _active(model, call):
                        output = original(*args, **kwargs)
                except BaseException as error:
                    if call.capture is not None:
                        with _interrupts.ending():
                            call.end(None, error)
                    raise
                if call.capture is not None:
                    with _interrupts.ending():
                        call.end(output, None)
                elif len(recorder.generations) == before:
                    names = ", ".join(type(inner).__name__ for inner in delegates)
                    raise RuntimeError(
                        f"{type(model).__name__}.generate() returned without running a decoding loop of its own or "
                        f"passing the Recorder on to its inner model's generate() ({names}), so nothing was recorded: "
                        "this model's generate() is not supported by transformers-offload. Record the inner model's "
                        "own generate() call instead."
                    )
            return output

        return functools.update_wrapper(generate, original)

    def _wrap_generate_batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def generate_batch(*args: Any, **kwargs: Any) -> Any:
            if _is_recorder(kwargs.get("logits_processor")):
                raise TypeError("`logits_processor` must be a list: pass `logits_processor=[rec]`.")
            processors = _as_list(kwargs.get("logits_processor") or ())
            recorder = next((p for p in processors if _is_recorder(p)), None) or self._recorder_of_call({})
            if recorder is None:
                return original(*args, **kwargs)
            kwargs["logits_processor"] = [p for p in processors if p is not recorder]  # left as it would be
            return recorder.record_batch(original, *args, **kwargs)

        return functools.update_wrapper(generate_batch, original)

    def _wrap_processor_list(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _get_logits_processor(*args: Any, **kwargs: Any) -> Any:
            processors = original(*args, **kwargs)
            call = _active_call(self._model_ref())
            if call is None:
                return processors  # no recorded call
            with _interrupts.held():
                # The first loop of a call whose capture waited for it (a model with generating
                # children); from a call's second loop on (a generate() that runs transformers' loop
                # more than once), a new capture: its own generation.
                capture = call.begin() if call.capture is None else call.loop_starts()
            arguments = _bind(original, args, kwargs)
            kept = [p for p in processors if not _is_recorder(p)]
            with _interrupts.held():
                capture.start(arguments["generation_config"], arguments.get("input_ids_seq_length") or 0,
                              no_processors=not kept)
            on_warpers = _compat.final_tap_on_warper_list(capture.facts.mode, capture.facts.do_sample)
            return TappedProcessorList(kept, capture, raw=True, processed=not on_warpers)

        return _get_logits_processor

    def _wrap_warper_list(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _get_logits_warper(*args: Any, **kwargs: Any) -> Any:
            warpers = original(*args, **kwargs)
            capture = _active_capture(self._model_ref())
            if capture is None:
                return warpers
            return TappedProcessorList(warpers, capture, raw=False, processed=True)

        return _get_logits_warper

    def _wrap_criteria_list(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _get_stopping_criteria(*args: Any, **kwargs: Any) -> Any:
            criteria = original(*args, **kwargs)
            capture = _active_capture(self._model_ref())
            if capture is None:
                return criteria
            return TappedCriteriaList([c for c in criteria if not _is_recorder(c)], capture)

        return _get_stopping_criteria

    def _ask_outputs(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        # generate() keeps its own `output_attentions`/`output_hidden_states` off (it would keep them
        # on the device): the recorded call's forwards, and its encoder's, are asked directly.
        capture = _active_capture(self._model_ref())
        if capture is None or capture.layer_tap is None:
            return None
        return args, capture.layer_tap.ask(kwargs)

    def _on_encoder_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        capture = _active_capture(self._model_ref())
        if capture is not None:
            capture.on_encoder(output)

    def _on_base_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        capture = _active_capture(self._model_ref())
        if capture is not None and capture.prompt is not None:
            capture.on_base_output(output)

    def _on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        capture = _active_capture(module)
        if capture is not None and capture.started and capture.wants_forward:
            with _interrupts.held():
                capture.on_forward(output)

    # -- which recorder a call carries ---------------------------------------------------------------
    def _recorder_of_call(self, arguments: dict[str, Any]) -> Any:
        processors = arguments.get("logits_processor") or ()
        if _is_recorder(processors):
            raise TypeError("`logits_processor` must be a list: pass `logits_processor=[rec]`.")
        criteria = arguments.get("stopping_criteria") or ()
        found = [p for p in processors if _is_recorder(p)]
        if not found:
            if _is_recorder(criteria) or any(_is_recorder(c) for c in criteria):
                raise ValueError(
                    "a Recorder was passed in `stopping_criteria` only; it records from "
                    "`logits_processor`: pass `logits_processor=[rec]` (it needs no place in "
                    "`stopping_criteria`)."
                )
            return next((r for r in self.recorders if r.every_call and not r.closed), None)
        if len(found) > 1:
            raise ValueError(
                f"`logits_processor` holds {len(found)} Recorders; a generate() call records into one. "
                "Pass a single Recorder."
            )
        recorder = found[0]
        if recorder.closed:
            raise RuntimeError(
                "this Recorder is closed: its hooks were removed from the model. Create a new "
                "`Recorder(model)` for further generate() calls."
            )
        if recorder not in self.recorders:
            model = self._model_ref()
            raise ValueError(
                f"this Recorder is attached to another model ({recorder.model_name}), not to this "
                f"{type(model).__name__}: a Recorder records the generate() calls of the model it was "
                "created with. Create one for this model: `Recorder(model)`."
            )
        return recorder


def _check_lazy_call(model: torch.nn.Module, recorder: Any, checked: dict[str, Any]) -> None:
    """Before a call whose capture begins with its own loop (a model with generating children): what the
    recorder would refuse at the start, refused now, before anything runs; and an encoder-decoder model
    asked for attentions or hidden states, whose encoder runs before the recorder knows whether the call
    runs its own loop or hands it to a child (its encoder's layers could not be asked for)."""
    recorder.check_call(**checked)
    layer_streams = [name for name in recorder.streams if name in _layer_streams]
    if layer_streams and _compat.encoder_of(model) is not None:
        raise UnsupportedModeError(
            f"{type(model).__name__} is an encoder-decoder model whose generate() may hand the call to a child "
            f"model's: its encoder runs before the Recorder knows which loop it records, so {layer_streams} "
            "cannot be recorded for it. Use a Recorder without them in `streams` for this model."
        )


@contextlib.contextmanager
def _attached_for_the_call(children: list[torch.nn.Module], recorder: Any):
    """`recorder` attached to `children` while the call runs: a child's generate() that is handed the
    recorder records as the call's generation (BLIP-2), one inside the recorded loop is seen (Moshi)."""
    attached = []
    try:
        for child in children:
            attach(child, recorder)
            attached.append(child)
        yield
    finally:
        for child in attached:
            detach(child, recorder)


def _recording_loop(recorder: Any) -> RecordedCall | None:
    """This thread's recorded call whose decoding loop runs now (its capture started): any, for a call
    without a recorder (`recorder` None); else the one `recorder` records."""
    for call in _active_calls():
        if call.capture is not None and call.capture.started and recorder in (None, call.recorder):
            return call
    return None


def _first_tensor(*values: Any) -> torch.Tensor | None:
    """The first of `values` that is a tensor (the call's prompt ids or embeddings), else None."""
    return next((value for value in values if isinstance(value, torch.Tensor)), None)


def _as_list(value: Any) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        return [value]


def _tensor_or_none(value: Any) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def _is_recorder(obj: Any) -> bool:
    return isinstance(obj, CallRecorder)


def attach(model: torch.nn.Module, recorder: CallRecorder) -> None:
    """Install the hooks on `model` (once per model) and register `recorder` with them."""
    with _LOCK:
        hooks = _ATTACHED.get(model)
        if hooks is None:
            hooks = ModelHooks(model)
            hooks.install()
            _ATTACHED[model] = hooks
        hooks.recorders.append(recorder)


def detach(model: torch.nn.Module, recorder: CallRecorder) -> None:
    """Unregister `recorder`; the last one to leave removes the hooks from `model`."""
    with _LOCK:
        hooks = _ATTACHED.get(model)
        if hooks is None or recorder not in hooks.recorders:
            return
        hooks.recorders.remove(recorder)
        if not hooks.recorders:
            hooks.uninstall()
            del _ATTACHED[model]


def records_now(model: torch.nn.Module) -> bool:
    """Whether this thread is inside a recorded `generate()` call of `model`."""
    capture = _active_capture(model)
    return capture is not None and capture.started


def is_hooked(model: torch.nn.Module) -> bool:
    """Whether any recorder is attached to `model` (its wrappers and forward hook are in place)."""
    with _LOCK:
        return model in _ATTACHED
