"""What one program state holds while it runs: text, variables, meta info, messages, stream events."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TextEvent:
    """A piece of text appended to a state; ``var`` names the gen/select it came from, if any."""

    text: str
    var: str | None = None


@dataclass
class StateCore:
    """The data of one state. Only the event loop that runs the program mutates it."""

    text: str = ""
    variables: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    open_role: tuple[str, int] | None = None  # (role, where its content starts in text)
    # [start, end) of finished messages' contents that hold special-token text: sent as plain text
    plain_spans: list[tuple[int, int]] = field(default_factory=list)
    scopes: dict[str, int] = field(default_factory=dict)
    events: list[TextEvent] = field(default_factory=list)
    done: bool = False
    error: BaseException | None = None
    # where the state stands in the program's tree of forks ("root", "root/f0.1": fork 0's branch 1),
    # and who hears each of its text events (a server streaming a program); branches inherit it
    path: str = "root"
    listener: Callable[[StateCore, TextEvent], None] | None = field(default=None, repr=False)
    _signal: asyncio.Event | None = field(default=None, repr=False)

    def append(self, text: str, var: str | None = None) -> None:
        if not text:
            return
        self.text += text
        event = TextEvent(text, var)
        self.events.append(event)
        if self.listener is not None:
            self.listener(self, event)
        self._notify()

    def finish(self, error: BaseException | None = None) -> None:
        self.done, self.error = True, error
        self._notify()

    def branch(self, name: str = "") -> StateCore:
        """A fork branch: a copy of text, variables and messages; no events, not done. ``name``
        (e.g. "f0.1") extends the path."""
        return StateCore(text=self.text, variables=copy.copy(self.variables), meta=copy.copy(self.meta),
                         messages=list(self.messages), open_role=self.open_role,
                         plain_spans=list(self.plain_spans), path=f"{self.path}/{name}" if name else self.path,
                         listener=self.listener)

    def join(self, branches: list[StateCore], mode: str, known: set[str], base: int) -> None:
        """Gather the branches' new variables (those not in ``known``) and their meta info as
        lists, or append the text each branch added after its first ``base`` characters, one
        branch after the other."""
        if mode == "gather_variable":
            for b in branches:
                for name, value in b.variables.items():
                    if name not in known:
                        self.variables.setdefault(name, []).append(value)
                        self.meta.setdefault(name, []).append(b.meta.get(name))
        else:
            self.append("".join(b.text[base:] for b in branches))

    async def wait_event(self, index: int) -> TextEvent | None:
        """The event at ``index`` once it exists; None when the state finished before it."""
        while index >= len(self.events) and not self.done:
            if self._signal is None:
                self._signal = asyncio.Event()
            await self._signal.wait()
        if self.error is not None and index >= len(self.events):
            raise self.error
        return self.events[index] if index < len(self.events) else None

    def _notify(self) -> None:
        if self._signal is not None:
            self._signal.set()
            self._signal = None
