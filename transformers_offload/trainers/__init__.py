"""Trainers of other libraries with their rollouts recorded: TRL's GRPO (`grpo.RecordedGRPOTrainer`)."""
