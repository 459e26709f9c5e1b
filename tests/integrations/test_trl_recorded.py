"""`RecordedGRPOTrainer` (TRL 1.16) on both transformers generation paths: inert unless asked; with
`importance_sampling=True` TRL's own correction runs on the recording's sampler logprobs (each of its four modes,
the ratio TRL's expression of what it was handed, exactly); with `replay=True` the policy's logprobs are
replayed over the kept sets (`old_per_token_logps` is `replay_logprobs` over a plain forward's logits within
1e-5, and the sampler's own logprob within 1e-5, where TRL's whole-vocabulary value is off by far more)."""

from __future__ import annotations

import math

import pytest
import torch

from ..helpers import TEST_CB_MEMORY_PERCENT, TRANSFORMERS, keep_trl_batches, record_model, record_tokenizer

try:  # TRL is made for the newest transformers. Its package loads its trainers lazily: the guard imports the trainer
    # itself, which is where an older transformers (or a PEFT that warns about it) fails.
    import datasets
    import trl
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401
except Exception as error:  # noqa: BLE001 - any failure to import: skipped, saying why
    pytest.skip(f"TRL does not import with transformers {TRANSFORMERS}: {type(error).__name__}: {error}",
                allow_module_level=True)

from transformers_offload import open_recording, replay_logprobs, sampler_logprobs
from transformers_offload._compat import trl_tested
from transformers_offload.trainers.grpo import RecordedGRPOTrainer

pytestmark = [
    pytest.mark.slow,  # training steps
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # TRL 1.16's own use of what transformers 5.x deprecates
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]
PATHS = pytest.mark.parametrize("continuous_batching", [False, True], ids=["generate", "continuous_batching"])


def _trainer(tmp_path, cls=RecordedGRPOTrainer, *, continuous_batching=False, seed=0, **options):
    """A trainer on the tiny GPT-2, float32 throughout (`bf16=False`: TRL's default on CPU autocasts its scoring
    forward to bfloat16, while generation runs in float32), and the list its rollout batches are kept in."""
    torch.manual_seed(seed)
    model, tokenizer = record_model(), record_tokenizer()
    for module in model.modules():  # no dropout: TRL's scoring forward runs in training mode
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    extra = {name: options.pop(name) for name in ("importance_sampling", "replay", "recording_dir", "peft_config")
             if name in options}
    config = {"per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 6, "max_steps": 1,
              "temperature": 0.7, "top_p": 0.8, "report_to": [], "use_cpu": True, "bf16": False, "beta": 0.0,
              "save_strategy": "no", "disable_tqdm": True, "seed": seed,
              "use_transformers_continuous_batching": continuous_batching,
              "transformers_continuous_batching_config": {"max_memory_percent": TEST_CB_MEMORY_PERCENT}}
    args = trl.GRPOConfig(output_dir=str(tmp_path), **{**config, **options})
    prompts = datasets.Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7", "w8 w9 w10 w11", "w12"] * 2})
    trainer = cls(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions], args=args,
                  train_dataset=prompts, processing_class=tokenizer, **extra)
    batches = keep_trl_batches(trainer)
    return trainer, batches


def test_without_options_it_is_grpo_trainer_itself(tmp_path):
    weights = []
    for cls in (trl.GRPOTrainer, RecordedGRPOTrainer):
        trainer, batches = _trainer(tmp_path / cls.__name__, cls)
        trainer.train()
        assert "sampling_per_token_logps" not in batches[0] and "replay_rows" not in batches[0]
        weights.append({name: value.detach().clone() for name, value in trainer.model.state_dict().items()})
    assert weights[0].keys() == weights[1].keys() and len(weights[0]) > 0
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


@PATHS
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_sampling_runs_trls_correction_on_the_recorded_sampler_logprobs(tmp_path, continuous_batching, mode):
    trainer, batches = _trainer(tmp_path, continuous_batching=continuous_batching, importance_sampling=True,
                                recording_dir=tmp_path / "rollouts", vllm_importance_sampling_mode=mode,
                                vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=1.05)
    trainer.train()
    batch = batches[0]
    mask = batch["completion_mask"].bool()
    run = open_recording(tmp_path / "rollouts")  # rank-0's rollouts, every generation of the call
    # what is kept of each rollout: the scores' kept entries (sparse), not the vocabulary's logits
    assert all("logits" not in g.streams and g.encodings["scores"] == "sparse" for g in run.generations), run.generations
    sampled = sampler_logprobs(run, raw=False)
    if continuous_batching:
        order = sorted(range(len(run.generations)), key=lambda i: int(run.generations[i].sample_ids[0].rsplit("_", 1)[-1]))
        sampled = {name: value[order] for name, value in sampled.items()}
    handed = batch["sampling_per_token_logps"]
    width = min(handed.shape[1], sampled["sampled"].shape[1])
    assert torch.equal(handed[:, :width][mask[:, :width]], sampled["sampled"][:, :width][mask[:, :width]])
    # TRL's expression, on what it was handed
    difference = (batch["old_per_token_logps"] - handed) * batch["completion_mask"]
    if mode.startswith("sequence"):
        difference = difference.sum(-1, keepdim=True)
    ratio = difference.exp()
    if mode.endswith("truncate"):
        expected = ratio.clamp(min=0.5, max=1.05)
    else:
        expected = ratio.masked_fill((ratio < 0.5) | (ratio > 1.05), 0.0)
    assert torch.equal(batch["importance_sampling_ratio"], expected)
    assert not torch.all(expected == 1)  # top-p moved the sampler's logprobs: the correction has work to do
    logged = trainer.state.log_history[0]
    assert "sampling/importance_sampling_ratio/mean" in logged
    assert not trainer.use_vllm  # lowered again after each use


@PATHS
def test_replay_scores_the_policy_over_the_kept_sets(tmp_path, continuous_batching):
    trainer, batches = _trainer(tmp_path, continuous_batching=continuous_batching, replay=True, importance_sampling=True)
    trainer.train()
    batch = batches[0]
    mask = batch["completion_mask"].bool()
    assert mask.sum() > 0
    number = int(batch["replay_rows"][0, 0])
    kept = trainer._kept_batches[number].select(range(mask.shape[0]), mask.shape[1])
    assert torch.equal(kept.valid, mask)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    old, sampled = batch["old_per_token_logps"], batch["sampling_per_token_logps"]
    # 1. `replay_logprobs` over a plain forward's logits (the same model, rebuilt: the trainer's has been updated)
    fresh, _ = _trainer(tmp_path / "fresh", continuous_batching=continuous_batching)
    with torch.no_grad():
        logits = fresh.model(input_ids=ids, attention_mask=attention).logits[:, batch["prompt_ids"].shape[1] - 1 : -1]
    expected = replay_logprobs(logits, kept, temperature=0.7)
    assert (old - expected)[mask].abs().max() <= 1e-5
    # 2. it is the sampler's own logprob; TRL's whole-vocabulary value is not
    assert (old - sampled)[mask].abs().max() <= 1e-5
    plain = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, batch["completion_ids"][..., None])[..., 0]
    assert (plain - sampled)[mask].abs().max() > 0.05
    assert not torch.equal(trainer._kept_batches[number].valid, torch.zeros_like(kept.valid))


def test_replay_reaches_the_loss_and_its_gradient(tmp_path):
    """The loss's per-token logprobs are the replayed ones: with `num_iterations=2` and no importance sampling,
    `old_per_token_logps` is the replayed forward, and the first iteration's ratio is exactly 1."""
    trainer, batches = _trainer(tmp_path, replay=True, num_iterations=2, max_steps=2)
    seen = []
    original = trainer._get_per_token_logps_and_entropies

    def spy(model, *args, **kwargs):
        found = original(model, *args, **kwargs)
        seen.append((trainer._replay_rows is not None, found[0]))
        return found

    trainer._get_per_token_logps_and_entropies = spy
    trainer.train()
    replayed = [found for active, found in seen if active]
    assert len(replayed) == 3  # the old logprobs, then the loss's twice (two iterations over one rollout batch)
    assert replayed[1].requires_grad and not replayed[0].requires_grad
    batch = batches[0]
    mask = batch["completion_mask"].bool()
    order = batch["replay_rows"][:, 1]  # the loss saw the rows in TRL's shuffled order
    assert (replayed[0][mask] - batch["old_per_token_logps"][mask]).abs().max() == 0
    assert math.isfinite(float(trainer.state.log_history[-1]["train_loss"])) and order.numel() == mask.shape[0]


def test_what_cannot_be_recorded_or_replayed_is_refused(tmp_path):
    with pytest.raises(ValueError, match="repetition_penalty=1.3"):
        _trainer(tmp_path, replay=True, repetition_penalty=1.3)
    with pytest.raises(ValueError, match=r"generation_kwargs` \['repetition_penalty'\]"):
        _trainer(tmp_path, replay=True, generation_kwargs={"repetition_penalty": 1.3})
    with pytest.raises(ValueError, match="sample at temperature 0.5, TRL scores at `temperature=0.7`"):
        _trainer(tmp_path, replay=True, generation_kwargs={"temperature": 0.5})
    with pytest.raises(ValueError, match="drop one of the two"):
        _trainer(tmp_path, importance_sampling=True, vllm_importance_sampling_correction=False)
    with pytest.raises(ValueError, match="VESPO loss needs"):
        _trainer(tmp_path, importance_sampling=True, loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")
    assert trl_tested(trl.__version__) and trl_tested("1.16.3")
    assert not trl_tested("1.15.2") and not trl_tested("1.17.0") and not trl_tested("2.16.0")


def test_refusals_come_before_grpo_trainers_own_set_up(tmp_path, monkeypatch):
    """Each refusal, and a `recording_dir` that cannot be created, raise before `GRPOTrainer.__init__` runs (it loads
    models and prepares datasets); a TRL argument that does not exist is TRL's TypeError."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [({"replay": True}, {"repetition_penalty": 1.3}, "repetition_penalty=1.3"),
             ({"importance_sampling": True}, {"use_vllm": True}, "with `use_vllm=True` TRL takes vLLM's"),
             ({"importance_sampling": True}, {"vllm_importance_sampling_correction": False}, "drop one of the two"),
             ({"recording_dir": blocker / "rollouts"}, {}, "`recording_dir` .* cannot be created")]
    for extra, config, said in cases:
        with monkeypatch.context() as patch:
            patch.setattr(trl.GRPOTrainer, "__init__", lambda *args, **kwargs: pytest.fail("GRPOTrainer.__init__ ran"))
            args = trl.GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, temperature=0.7,
                                  **config)
            with pytest.raises(ValueError, match=said):
                RecordedGRPOTrainer(model=record_model(), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                    args=args, **extra)
    with pytest.raises(TypeError):
        RecordedGRPOTrainer(model=record_model(), replay=True, no_such_argument=1)
    made = tmp_path / "made" / "rollouts"
    with monkeypatch.context() as patch:  # a recording_dir that can be created is, at construction
        patch.setattr(trl.GRPOTrainer, "__init__", lambda *args, **kwargs: None)
        RecordedGRPOTrainer(model=record_model(), recording_dir=made)
    assert made.is_dir()


def test_a_peft_adapter_is_replayed_through_its_base_models_head(tmp_path):
    """TRL wraps the model with PEFT (`peft_config`); the recorder records the PeftModel's rollouts and the replay
    reads the base model's backbone and head: `old_per_token_logps` is the sampler's own logprob within 1e-5."""
    peft = pytest.importorskip("peft", exc_type=ImportError)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    trainer, batches = _trainer(tmp_path, importance_sampling=True, replay=True, peft_config=config)
    assert isinstance(trainer.model, peft.PeftModel)
    trainer.train()
    batch = batches[0]
    mask = batch["completion_mask"].bool()
    assert (batch["old_per_token_logps"] - batch["sampling_per_token_logps"])[mask].abs().max() <= 1e-5
