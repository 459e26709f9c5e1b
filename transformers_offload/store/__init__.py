"""Where recorded steps go and how they sit on disk: the in-memory store, the shard store and its
buffers, the format's names and manifest checks, durable writes and checksums, and the shard reader.
Imports nothing from `capture`, `read` or the recorder: a finished generation leaves as plain data."""
