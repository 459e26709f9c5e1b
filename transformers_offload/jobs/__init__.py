"""Batch jobs over files of prompts or recordings: `record` (a prompts file through `generate()`), the
claims that keep two writers off one sample, and the data-parallel share of each rank."""
