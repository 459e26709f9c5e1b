"""Answers from a recording, built only by reading it: the per-token table (Arrow, pandas, Parquet),
the HTML viewer and the plots. Uses `read` (and `store` through it); never `capture` or the recorder."""
