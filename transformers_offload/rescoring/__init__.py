"""Rescoring: a recording's tokens replayed through another model, whose logits are recorded on them.
`decode` replays each generation with a stock `generate()` (the public `rescore`), `forward` scores it by
chunked forward passes, `run` rescores a whole recording directory, resumably and over ranks."""
