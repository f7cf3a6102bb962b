"""Stop strings over streamed text (docs/design.md §10).

The text a client sees ends just before the first stop string. While streaming, the tail of the text
that could still be the start of a stop string is held back, so nothing after a stop is ever sent.
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """New text in -> the part that is safe to send now; sets .stopped when a stop string appears."""
        if self.stopped:
            return ""
        self._held += text
        cut = min((i for i in (self._held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._held, self.stopped = self._held[:cut], "", True
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self._held.endswith(s[:k])), default=0)
        out = self._held[:len(self._held) - keep]
        self._held = self._held[len(out):]
        return out

    def flush(self) -> str:
        """At the end of the request: the held-back tail was not a stop after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
