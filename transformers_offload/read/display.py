"""How a recording shows itself in a notebook (`_repr_html_`): through a renderer that the viewer
(`answers.viewer`) registers when the package is imported, so `read` never imports `answers`."""

from __future__ import annotations

from typing import Any, Callable

_renderers: list[Callable[..., str]] = []


def register(renderer: Callable[..., str]) -> None:
    """Use `renderer(source) -> str` (an HTML fragment) for `_repr_html_`."""
    _renderers[:] = [renderer]


def html(source: Any) -> str | None:
    """The notebook's HTML of `source` (a recorder, a recording or a generation); None without a
    renderer (IPython then shows the `repr`)."""
    return _renderers[0](source) if _renderers else None
