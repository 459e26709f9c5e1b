"""The command line: `transformers-offload COMMAND ...` (the console script) or `python -m transformers_offload
COMMAND ...`, a thin layer over the public API. `main` builds one parser from the command table
(`main.COMMANDS`); each family of commands is a module (`reading`, `jobs`, `comparing`) that adds its
parsers and runs them; `options` holds the options they share and the printing; `summary` renders
`inspect`'s report.

Reading commands start without torch and transformers: nothing here imports them at import time."""

from .main import main

__all__ = ["main"]
