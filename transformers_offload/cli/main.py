"""`main()`: one parser from the command table, one place that turns a command's outcome into its output and
exit status (0 done; 1 a damaged or missing input or a failed run; 2 a usage error or, for `compare`, inputs
that do not line up; 130 interrupted)."""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from . import comparing, jobs, options, reading

# Each family of commands: a module with `add(commands)`, `run(arguments, command_line) -> (json, text)`,
# `ERRORS` (command -> (exception types, exit status) pairs, the first match wins), `JSON_INDENT`, and
# optionally `damaged(arguments, error)` (its own report of an error) and `interrupted(arguments, command_line)`.
COMMANDS: tuple[ModuleType, ...] = (reading, jobs, comparing)


def main(argv: list[str] | None = None) -> int:
    """Run one command (`argv`: its arguments, default `sys.argv[1:]`); returns the exit status: 0 done,
    1 a damaged or missing input, 2 a usage error (argparse's own exit for bad arguments)."""
    parser = argparse.ArgumentParser(
        prog=options.program(),
        description="Tools for recordings written by transformers-offload's Recorder(spill_dir=...).",
        epilog="examples:\n  transformers-offload inspect runs/france\n"
        "  transformers-offload verify runs/france --json\n"
        "  transformers-offload record --model smollm2 --prompts prompts.jsonl --out runs/france\n"
        "(`python -m transformers_offload` runs the same commands)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for family in COMMANDS:
        family.add(commands)
    arguments = parser.parse_args(argv)
    family = next(family for family in COMMANDS if arguments.command in family.ERRORS)
    command_line = options.command_line(argv)
    try:
        result, text = family.run(arguments, command_line)
    except options.UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not hasattr(family, "interrupted"):
            raise
        print(family.interrupted(arguments, command_line), file=sys.stderr)
        return 130
    except Exception as error:
        status = _status(family, arguments, error)
        if status is None:
            raise
        return status
    options.emit(options.as_json(result, indent=family.JSON_INDENT) if arguments.json else text)
    return 0


def _status(family: ModuleType, arguments: argparse.Namespace, error: Exception) -> int | None:
    """The exit status of `error` for this command, after reporting it; None for an error it does not expect."""
    reported = getattr(family, "damaged", None)
    status = reported(arguments, error) if reported is not None else None
    if status is not None:
        return status
    for types, status in family.ERRORS[arguments.command]:
        if isinstance(error, types):
            print(f"error: {error}", file=sys.stderr)
            return status
    return None
