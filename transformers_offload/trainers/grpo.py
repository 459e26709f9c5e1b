"""`RecordedGRPOTrainer`: TRL's `GRPOTrainer` (1.16) generating with transformers (plain `generate()` or
`use_transformers_continuous_batching=True`), its rollouts recorded, so that

- `importance_sampling=True`: each sampled token's logprob under the distribution it was drawn from (the
  processed scores, renormalised over its kept set: `sampler_logprobs(...)["sampled"]`) is handed to TRL as
  `sampling_per_token_logps`, and TRL's own importance-sampling correction runs on it as it does with vLLM's
  (`vllm_importance_sampling_mode` `token_truncate`, `token_mask`, `sequence_truncate`, `sequence_mask`, with
  `vllm_importance_sampling_clip_min`/`_max`, all from `GRPOConfig`; without vLLM, TRL has no sampler logprobs
  and runs none);
- `replay=True`: the policy's per-token logprobs (the loss's and `old_per_token_logps`) are replayed over each
  token's kept set (`replay_logprobs_from_hidden`): `log_softmax(logits / T)` restricted to the ids top-p/top-k
  left, where TRL scores the token under the whole vocabulary. Steps that kept the whole vocabulary keep TRL's
  value. The reference model's logprobs (`beta > 0`) and the entropies stay TRL's (whole vocabulary).

With neither (the default) it is `GRPOTrainer` itself: nothing recorded, nothing changed. `recording_dir` also
spills each process's rollouts to `recording_dir/rank-R` (`open_recording(recording_dir)` reads every rank's as
one recording).

How: the rollout call (`_generate`) runs inside a `Recorder(model, every_call=True, streams=("scores",),
encodings={"scores": "sparse"})` (per step and row, the ids the processors kept and their scores); its tokens
are checked against TRL's completions (a mismatch raises before any loss); kept sets and sampler logprobs are
taken from it. TRL's importance-sampling code runs where it is written, gated on
`use_vllm`: the trainer raises that flag around `_generate_and_score_completions` and `_compute_loss` (and lowers
it again around the rollout, which is transformers'). Replay reads the policy backbone's last hidden state
(a forward hook) beside TRL's fused head, and each micro-batch finds its rows' kept sets by a `replay_rows`
column (`(batch, 2)`: rollout batch, row) that TRL's shuffle and split carry with the rest.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
from collections.abc import Iterator
from typing import Any

import torch

from .._compat import TRL_TESTED, text_config, trl_tested
from ..recorder import Recorder
from ..rl.head import replay_logprobs_from_hidden
from ..rl.kept import VALUE_CHANGING, KeptSets, kept_sets
from ..rl.sampler import sampler_logprobs

try:
    import trl
    from trl import GRPOTrainer  # TRL's modules load lazily: this is what fails where TRL does not import
except Exception as error:  # not installed, or made for another transformers: say how to get one that imports
    raise ImportError(f"RecordedGRPOTrainer needs TRL 1.16, which does not import here ({type(error).__name__}: "
                      f"{error}): `pip install 'trl==1.16.*'` (the `integrations` extra).") from error

if not trl_tested(trl.__version__):
    raise ImportError(f"TRL {trl.__version__} is not a release RecordedGRPOTrainer was tested with "
                      f"({', '.join(release + '.x' for release in TRL_TESTED)}): it overrides GRPOTrainer's private "
                      "methods as those releases have them. Install one (`pip install 'trl==1.16.*'`), or record the "
                      "rollouts yourself (docs/rl.md).")

# Model settings under which the head's logits are not `hidden @ W.T + b` (TRL's fused head applies them; a
# replay from hidden states would not): refused with replay.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")
_GRPO_ARGUMENTS = inspect.signature(GRPOTrainer.__init__)  # what the refusals read, before it runs
_KEPT_BATCHES = 4  # rollout batches whose kept sets are held (the training buffer's, and an evaluation's)


def _make_recording_dir(recording_dir: Any) -> None:
    """`recording_dir` made (each rank spills into `rank-R` inside it) at construction, not at the first rollout."""
    try:
        os.makedirs(recording_dir, exist_ok=True)
    except OSError as error:
        raise ValueError(f"`recording_dir` {str(recording_dir)!r} cannot be created ({error.strerror or error}): pass a "
                         "directory this process may write.") from None


class _Rows:
    """The generations of one rollout call, in TRL's completion order (what `kept_sets` lays out)."""

    def __init__(self, generations: list[Any]) -> None:
        self.generations = generations


class RecordedGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose transformers rollouts are recorded, with sampler logprobs for TRL's
    importance-sampling correction and replay over each token's kept set (module docstring).

    Args:
        *args, **kwargs: `trl.GRPOTrainer`'s.
        importance_sampling (`bool`, *optional*, defaults to False): hand TRL each token's sampler logprob
            (float32, the processed distribution's, mirroring what vLLM hands it as `logprobs`) and run TRL's
            correction with `GRPOConfig`'s `vllm_importance_sampling_mode` and clips.
        replay (`bool`, *optional*, defaults to False): replay the policy's per-token logprobs over the kept sets.
        recording_dir (`str` or `os.PathLike`, *optional*): also spill each process's rollouts to
            `recording_dir/rank-R` (appending one generation per rollout call).

    Raises:
        ImportError: TRL other than 1.16 (from the import).
        TypeError: arguments `GRPOTrainer.__init__` does not take.
        ValueError: each before `GRPOTrainer.__init__` runs: a `recording_dir` that cannot be created; asked for
            with vLLM (which hands TRL its own logprobs), tools, environments or a custom `rollout_func` (not one
            recorded generate call), a `repetition_penalty` with replay (it changes the
            scores' values, not only the set), a model whose head rescales its logits with replay, or a VESPO
            loss with a `sequence_*` mode (as TRL refuses it with vLLM).
        RuntimeError: during training, a rollout whose recorded tokens are not TRL's completions.

    Example:
        >>> trainer = RecordedGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(top_p=0.8, ...),  # doctest: +SKIP
        ...                               train_dataset=prompts, importance_sampling=True, replay=True)
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(self, *args: Any, importance_sampling: bool = False, replay: bool = False,
                 recording_dir: Any = None, **kwargs: Any) -> None:
        self._importance_sampling, self._replay, self._recording_dir = bool(importance_sampling), bool(replay), recording_dir
        self._records = self._importance_sampling or self._replay or recording_dir is not None
        if self._records:  # before GRPOTrainer's own set-up (models, reference model, datasets) has run
            self._refuse_what_is_not_recorded(_GRPO_ARGUMENTS.bind(self, *args, **kwargs).arguments)
            if recording_dir is not None:
                _make_recording_dir(recording_dir)
        super().__init__(*args, **kwargs)
        self._kept_batches: dict[int, KeptSets] = {}
        self._batch_numbers = itertools.count()
        self._replay_rows: Any = None  # (batch, rows or None) while a replayed forward may run

    def _refuse_what_is_not_recorded(self, given: dict[str, Any]) -> None:
        """The refusals, from the arguments `GRPOTrainer.__init__` is given (`given`, by name): its config's fields
        as TRL 1.16 copies them onto the trainer, the default `GRPOConfig`'s where no `args` is given."""
        args = given.get("args")

        def setting(name: str) -> Any:
            return getattr(args, name) if args is not None else trl.GRPOConfig.__dataclass_fields__[name].default

        what = "importance_sampling" if self._importance_sampling else "replay" if self._replay else "recording_dir"
        if setting("use_vllm"):
            raise ValueError(f"`{what}` records transformers generation; with `use_vllm=True` TRL takes vLLM's "
                             "logprobs itself: use trl.GRPOTrainer, or set `use_vllm=False`.")
        if given.get("tools") or given.get("rollout_func") is not None or given.get("environment_factory") is not None:
            raise ValueError(f"`{what}` needs each rollout to be one recorded generate call; tools, environments and "
                             "a custom `rollout_func` add tokens no call sampled: use trl.GRPOTrainer.")
        if self._importance_sampling and not setting("vllm_importance_sampling_correction"):
            raise ValueError("`importance_sampling=True` runs TRL's correction, which `GRPOConfig("
                             "vllm_importance_sampling_correction=False)` turns off: drop one of the two.")
        extra = dict(setting("generation_kwargs") or {})
        changing = sorted(name for name, neutral in VALUE_CHANGING.items() if extra.get(name, neutral) != neutral)
        if self._replay and changing:
            raise ValueError(f"`replay=True` with `generation_kwargs` {changing}: these change the scores' values, not "
                             "only which ids are kept, so a replay over the kept sets is not the distribution sampled. "
                             "Remove them, or set `replay=False`.")
        temperature = setting("temperature")
        if self._replay and extra.get("temperature", temperature) != temperature:
            raise ValueError(f"`replay=True`: `generation_kwargs` sample at temperature {extra['temperature']}, TRL "
                             f"scores at `temperature={temperature}`: set one temperature.")
        if self._replay and (setting("repetition_penalty") or 1.0) != 1.0:
            raise ValueError(f"`replay=True` with `repetition_penalty={setting('repetition_penalty')}`: the penalty "
                             "changes the scores' values, not only which ids are kept, so a replay over the kept sets "
                             "is not the distribution sampled. Set `repetition_penalty=1.0`, or `replay=False`.")
        if self._replay:
            model = given["model"]
            if isinstance(model, str):  # TRL loads it by name: its config tells the same
                from transformers import AutoConfig

                config = AutoConfig.from_pretrained(model)
            else:
                config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
            scaled = [name for name in _LOGIT_TRANSFORMS if getattr(text_config(config), name, None) not in (None, 1, 1.0)]
            if scaled:
                raise ValueError(f"`replay=True`: this model's head transforms its logits ({', '.join(scaled)}), "
                                 "which a replay from hidden states does not: set `replay=False`.")
        if (self._importance_sampling and setting("loss_type") == "vespo"
                and setting("vllm_importance_sampling_mode") not in ("token_truncate", "token_mask")):
            raise ValueError("the VESPO loss needs `vllm_importance_sampling_mode` 'token_truncate' or 'token_mask', "
                             f"got {setting('vllm_importance_sampling_mode')!r} (as TRL requires with vLLM).")

    # -- the rollout: recorded ---------------------------------------------------------------------------------

    def _generate(self, prompts: list) -> Any:
        if not self._records:
            return super()._generate(prompts)
        # the scores only, sparse: each step's kept entries (what top-p/top-k left), not the whole vocabulary
        options: dict[str, Any] = {"every_call": True, "streams": ("scores",), "encodings": {"scores": "sparse"}}
        if self._recording_dir is not None:
            options.update(spill_dir=f"{self._recording_dir}/rank-{self.accelerator.process_index}", append=True)
        with self._vllm_flags(False), Recorder(self.model, **options) as rec:
            result = list(super()._generate(prompts))
        completion_ids = result[1]
        rows = _Rows(_in_completion_order(rec.generations))
        sampler = sampler_logprobs(rows, raw=False)
        _check_tokens(sampler, completion_ids)
        if self._replay:
            kept = kept_sets(rows)
            if bool((kept.temperature != float(self.temperature)).any()):
                raise RuntimeError(f"the rollouts sampled at {kept.temperature.unique().tolist()}, the trainer scores "
                                   f"at temperature {self.temperature}: replay needs one temperature.")
            number = next(self._batch_numbers)
            self._kept_batches[number] = kept
            for old in sorted(self._kept_batches)[:-_KEPT_BATCHES]:
                del self._kept_batches[old]
            self._replay_rows = (number, None)  # `old_per_token_logps`: every row, in order
        if self._importance_sampling:
            result[4] = [sampler["sampled"][row, : len(ids)].tolist() for row, ids in enumerate(completion_ids)]
        return tuple(result)

    def _generate_and_score_completions(self, inputs: list) -> dict:
        if not self._records:
            return super()._generate_and_score_completions(inputs)
        try:
            with self._vllm_flags(self._importance_sampling):
                output = super()._generate_and_score_completions(inputs)
            if self._replay:
                number, size = self._replay_rows[0], output["completion_ids"].shape[0]
                output["replay_rows"] = torch.stack([torch.full((size,), number), torch.arange(size)], 1).to(
                    output["completion_ids"].device)
        finally:
            self._replay_rows = None
        return output

    # -- the loss: importance sampling and replay ----------------------------------------------------------------

    def _compute_loss(self, model: Any, inputs: dict) -> torch.Tensor:
        if not self._records:
            return super()._compute_loss(model, inputs)
        try:
            self._replay_rows = inputs.get("replay_rows") if self._replay else None
            with self._vllm_flags(self._importance_sampling):
                return super()._compute_loss(model, inputs)
        finally:
            self._replay_rows = None

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **extra: Any) -> tuple:
        if self._replay_rows is None or self._is_reference(model):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)
        given = sorted(name for name, value in extra.items() if value is not None)
        if given:
            raise ValueError(f"`replay=True` replays text rollouts; this batch carries {given}: set `replay=False`.")
        number, rows = self._rows_of(self._replay_rows, input_ids.shape[0])
        kept_all = self._kept_batches[number]
        policy = self._policy(model)
        backbone, head = policy.base_model, policy.get_output_embeddings()
        size, length = input_ids.shape
        logps, entropies, aux = [], [], []
        for start in range(0, size, batch_size or size):
            end = min(start + (batch_size or size), size)
            captured: list[Any] = []
            handle = backbone.register_forward_hook(lambda _module, _args, out, kept=captured: kept.append(out))
            try:
                found, entropy, aux_loss = super()._get_per_token_logps_and_entropies(
                    model, input_ids[start:end], attention_mask[start:end], logits_to_keep,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss)
            finally:
                handle.remove()
            last = captured[-1]
            last = last.last_hidden_state if hasattr(last, "last_hidden_state") else last[0]
            hidden = last[:, length - logits_to_keep - 1 : length - 1].to(head.weight.device)
            kept = kept_all.select(rows[start:end], logits_to_keep).to(hidden.device)
            replayed = replay_logprobs_from_hidden(hidden, head.weight, kept, bias=head.bias,
                                                   temperature=float(self.temperature), full_logprobs=found)
            logps.append(torch.where(kept.valid, replayed.to(found.dtype), found))
            entropies.append(entropy)
            aux.append(aux_loss)
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux).mean() if compute_aux_loss else None)

    # -- helpers ---------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _vllm_flags(self, on: bool) -> Iterator[None]:
        """TRL's importance-sampling code is gated on `use_vllm and vllm_importance_sampling_correction`: raised
        here (on=True) around the code that computes and applies the ratio, lowered (on=False) around the
        rollout, which must take transformers' path."""
        saved = self.use_vllm, self.vllm_importance_sampling_correction
        self.use_vllm = self.vllm_importance_sampling_correction = on
        try:
            yield
        finally:
            self.use_vllm, self.vllm_importance_sampling_correction = saved

    def _policy(self, model: Any) -> Any:
        """The causal LM TRL patched with its fused head (under accelerate's wrapper and PEFT's)."""
        model = self.accelerator.unwrap_model(model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _is_reference(self, model: Any) -> bool:
        return self.ref_model is not None and self._policy(model) is self._policy(self.ref_model)

    @staticmethod
    def _rows_of(replay_rows: Any, size: int) -> tuple[int, list[int]]:
        if isinstance(replay_rows, tuple):  # during the rollout batch's own scoring: every row, in order
            return replay_rows[0], list(range(size))
        host = replay_rows.cpu()  # once per micro-batch, outside any decoding step
        if host.shape[0] != size or bool((host[:, 0] != host[0, 0]).any()):
            raise RuntimeError("a micro-batch's `replay_rows` do not name one rollout batch's rows: TRL split or "
                               "merged its batches in a way this trainer was not built for.")
        return int(host[0, 0]), host[:, 1].tolist()


def _in_completion_order(generations: list[Any]) -> list[Any]:
    """One generate call's generation as it is; continuous batching's requests (`req_0`, `req_1`...) in the
    order of their ids, which is the order TRL lists their outputs."""
    if generations and all(generation.mode == "continuous_batching" for generation in generations):
        return sorted(generations, key=lambda generation: int(str(generation.sample_ids[0]).rsplit("_", 1)[-1]))
    return list(generations)


def _check_tokens(sampler: dict, completion_ids: list[list[int]]) -> None:
    """The recorded tokens must be TRL's completions, row by row (else nothing recorded can be trusted)."""
    rows = sampler["tokens"].shape[0]
    if rows != len(completion_ids):
        raise RuntimeError(f"the rollout recorded {rows} rows, TRL has {len(completion_ids)} completions: the "
                           "recording does not match what TRL scores.")
    for row, ids in enumerate(completion_ids):
        valid = int(sampler["valid"][row].sum())
        recorded = sampler["tokens"][row, :valid].tolist()
        if recorded != list(ids):
            raise RuntimeError(f"completion {row}: TRL scores {len(ids)} tokens {list(ids)[:8]}..., the recording "
                               f"holds {valid} {recorded[:8]}...: they differ.")
