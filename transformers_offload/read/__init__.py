"""Reading a recording: the `Generation` and its accessors, their layer reading and indexing, and the
reader of a recording directory. Uses `store`; never `capture` or the recorder."""
