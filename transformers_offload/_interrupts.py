"""Ctrl-C during a recorded call: held while the recorder's own code runs, let through where it waits.

Python raises `KeyboardInterrupt` from the SIGINT handler at whatever bytecode the main thread has
reached. In the model's forward or a user's processor that is harmless: nothing of the recorder is
half done. In the recorder's own code it is not: between a ring slot marked busy and its release, or
between a step taken from the ring and its copy into a shard buffer, an interrupt loses completed
steps or leaves a wait that nothing will end.

So, for the duration of a recorded `generate()` call made in the main thread, `call()` wraps the
SIGINT handler in place (Python's own raises `KeyboardInterrupt`; a user's is called the same way):

- outside the recorder's code it calls that handler at once, as if nothing were installed;
- inside it (`held()`: the taps, the start and the end of the call) it notes the signal and calls
  the handler when the outermost held section is left;
- where the recorder waits inside a step (`waiting()`: for a ring slot, for a shard buffer the writer
  still holds) it calls it at once, so one Ctrl-C ends the call promptly; the ring and the store are
  in a consistent state at those points, and the step being handed over stays in its slot;
- while the call ends (`ending()`), waits hold it too: what the ring and the store have is written
  first (seconds at most: three shard buffers), then `KeyboardInterrupt` is raised;
- only the call's first SIGINT is ever held: a second one (whether the first was held or raised) is
  let through at once, wherever it lands: the way out of a wait that never ends.

Elsewhere (a call in another thread, a handler that is not a Python function: `SIG_IGN`, `SIG_DFL`)
nothing is installed and every section is a no-op.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator

_current: _Guard | None = None  # the guard of the recorded call running in the main thread


class _Guard:
    def __init__(self, previous: Callable[[int, Any], Any]) -> None:
        self.previous = previous
        self.depth = 0  # held sections entered
        self.waiting = 0  # waits, inside held sections, that let the signal through
        self.ending = 0  # > 0 while the call ends: waits hold the signal too
        self.pending: tuple[int, Any] | None = None  # a held signal
        self.received = 0  # SIGINTs during the call

    def handle(self, signum: int, frame: Any) -> None:
        self.received += 1
        if self.depth and self.received == 1 and not self.waiting:
            self.pending = (signum, frame)
            return
        self.pending = None
        self.previous(signum, frame)

    def release(self) -> None:
        """Call the wrapped handler for a held signal (it raises `KeyboardInterrupt` by default)."""
        if self.pending is not None:
            signum, frame = self.pending
            self.pending = None
            self.previous(signum, frame)


def _guard() -> _Guard | None:
    """The current call's guard, if this thread is the one it guards (the main thread)."""
    guard = _current
    if guard is None or threading.current_thread() is not threading.main_thread():
        return None
    return guard


@contextlib.contextmanager
def call() -> Iterator[None]:
    """For one recorded `generate()` call: wrap the SIGINT handler (main thread only; a nested call
    shares the outer one's guard) and put the previous handler back afterwards."""
    global _current
    if _current is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN, SIG_DFL, or a handler set from C
        yield
        return
    guard = _Guard(previous)
    signal.signal(signal.SIGINT, guard.handle)
    _current = guard
    try:
        yield
    finally:
        _current = None
        if signal.getsignal(signal.SIGINT) == guard.handle:  # unless someone replaced it since
            signal.signal(signal.SIGINT, previous)
        guard.release()  # a signal that arrived in the last held section (normally none is left)


class _Section:
    """A held section (`ending`: the end of the call, whose waits hold the signal too)."""

    __slots__ = ("guard", "ending")

    def __init__(self, ending: bool) -> None:
        self.ending = ending
        self.guard: _Guard | None = None

    def __enter__(self) -> None:
        guard = self.guard = _guard()
        if guard is not None:
            guard.depth += 1
            guard.ending += self.ending

    def __exit__(self, *exc: Any) -> None:
        guard = self.guard
        if guard is not None:
            guard.depth -= 1
            guard.ending -= self.ending
            if not guard.depth:
                guard.release()


def held() -> _Section:
    """A section of the recorder's own code inside a step: a SIGINT is raised when it is left."""
    return _Section(False)


def ending() -> _Section:
    """The end of a recorded call: a SIGINT is raised when it is left, waits included."""
    return _Section(True)


@contextlib.contextmanager
def waiting(where: str) -> Iterator[None]:
    """A wait inside a held section (`where` names it: "ring slot", "shard buffer", "flush",
    "writer"): a SIGINT, held or new, is raised here at once, except while the call ends."""
    guard = _guard()
    if guard is None or guard.ending:
        yield
        return
    guard.release()
    guard.waiting += 1
    try:
        yield
    finally:
        guard.waiting -= 1


def pending() -> bool:
    """Whether a SIGINT is held, to be raised when the current section is left."""
    guard = _guard()
    return guard is not None and guard.pending is not None
