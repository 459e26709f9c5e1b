"""TRL's `GRPOTrainer` with `Recorder(model, every_call=True)` on both of its transformers generation paths (plain
`generate()`, and `use_transformers_continuous_batching=True`): the recorded tokens are the completions TRL
scored, and the recorded processed logprobs (`log_softmax` of the processed scores at each sampled token) are
TRL's `old_per_token_logps`, a training forward's `log_softmax(logits / T)`, within 1e-5 (measured here:
9.5e-7 and 4.8e-7; the two forwards sum in other orders). Without top-p or top-k the processed scores are
`logits / T`, what TRL scores; with them, TRL's logprobs are not those of the distribution sampled
(docs/integrations.md)."""

from __future__ import annotations

import pytest
import torch

from transformers_offload import Recorder

from ..helpers import TEST_CB_MEMORY_PERCENT, TRANSFORMERS, keep_trl_batches, record_model, record_tokenizer

try:  # TRL is made for the newest transformers. Its package loads its trainers lazily: the guard imports the trainer
    # itself, which is where an older transformers (or a PEFT that warns about it) fails.
    import datasets
    import trl
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401
except Exception as error:  # noqa: BLE001 - any failure to import: skipped, saying why
    pytest.skip(f"TRL does not import with transformers {TRANSFORMERS}: {type(error).__name__}: {error}",
                allow_module_level=True)

pytestmark = [
    pytest.mark.slow,  # a training step; continuous batching's manager starts threads of its own
    # TRL 1.16's own use of what transformers 5.x deprecates (`gradient_checkpointing`...): theirs, not ours.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _processed_logprobs(rec: Recorder, generation: int) -> torch.Tensor:
    """`(rows, steps)`: each sampled token's `log_softmax` under the processed scores it was drawn from."""
    tokens, scores = rec.tokens(generation=generation), rec.scores(generation=generation)
    return torch.stack([torch.log_softmax(s.float(), -1).gather(-1, t[:, None])[:, 0] for s, t in zip(scores, tokens)], 1)


@pytest.mark.parametrize("continuous_batching", [False, True], ids=["generate", "continuous_batching"])
def test_grpo_scores_the_recorded_completions_with_the_recorded_logprobs(tmp_path, continuous_batching):
    torch.manual_seed(0)
    model, tokenizer = record_model(), record_tokenizer()
    for module in model.modules():  # no dropout: TRL's scoring forward runs in training mode
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    prompts = datasets.Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7", "w8 w9 w10 w11"] * 2})
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                          max_completion_length=4, max_steps=1, temperature=0.7, report_to=[], use_cpu=True,
                          num_iterations=2,  # TRL computes old_per_token_logps only where it reuses a batch
                          beta=0.0, save_strategy="no", disable_tqdm=True,
                          use_transformers_continuous_batching=continuous_batching,
                          transformers_continuous_batching_config={"max_memory_percent": TEST_CB_MEMORY_PERCENT})
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                              args=args, train_dataset=prompts, processing_class=tokenizer)
    batches = keep_trl_batches(trainer)
    with Recorder(trainer.model, every_call=True) as rec:
        trainer.train()
    assert len(batches) == 1
    completions, mask, theirs = (batches[0][name] for name in ("completion_ids", "completion_mask", "old_per_token_logps"))
    if continuous_batching:  # one generation per request, `req_0`, `req_1`... in the order TRL lists them
        order = sorted(range(len(rec.generations)), key=lambda i: int(rec.generations[i].sample_ids[0].split("_")[-1]))
        assert [rec.generations[i].mode for i in order] == ["continuous_batching"] * len(completions)
        tokens = [torch.stack(rec.tokens(generation=i), 1)[0] for i in order]
        logprobs = [_processed_logprobs(rec, i)[0] for i in order]
    else:
        assert len(rec.generations) == 1
        tokens = list(torch.stack(rec.tokens(), 1))
        logprobs = list(_processed_logprobs(rec, 0))
    assert len(tokens) == len(completions) == 2
    for row, (mine, kept_mask) in enumerate(zip(tokens, mask.bool())):
        length = int(kept_mask.sum())
        assert torch.equal(mine[:length], completions[row, :length])
        difference = (logprobs[row][:length] - theirs[row, :length]).abs().max()
        assert difference <= 1e-5, f"row {row}: recorded processed logprobs differ from TRL's by {float(difference):.2e}"


# transformers' own, where continuous batching builds its processors without `input_ids` (before dropping the penalty)
@pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`:UserWarning")
def test_grpo_with_a_repetition_penalty_is_refused_under_continuous_batching_and_recorded_by_generate(tmp_path):
    """Continuous batching drops a repetition penalty (transformers 5.25 warns and samples without it), so the
    recorder refuses that manager before any request runs; plain `generate()` applies it and records it."""
    from transformers_offload.errors import UnsupportedModeError

    prompts = datasets.Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7"]})
    for continuous_batching in (True, False):
        torch.manual_seed(0)
        model, tokenizer = record_model(), record_tokenizer()
        args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                              max_completion_length=4, max_steps=1, temperature=0.7, repetition_penalty=1.3,
                              report_to=[], use_cpu=True, beta=0.0, save_strategy="no", disable_tqdm=True,
                              use_transformers_continuous_batching=continuous_batching,
                              transformers_continuous_batching_config={"max_memory_percent": TEST_CB_MEMORY_PERCENT})
        trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                                  args=args, train_dataset=prompts, processing_class=tokenizer)
        with Recorder(trainer.model, every_call=True) as rec:
            if continuous_batching:
                with pytest.raises(UnsupportedModeError, match="RepetitionPenaltyLogitsProcessor, which continuous "
                                                                "batching drops"):
                    trainer.train()
                assert len(rec.generations) == 0
            else:
                trainer.train()
                assert len(rec.generations) == 1
                assert rec.generations[0].generation_config["repetition_penalty"] == 1.3
