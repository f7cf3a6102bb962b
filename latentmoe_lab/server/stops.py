"""Stop strings over streamed text (docs/design.md §10).

The text a client sees ends just before the stop string that completes first (of two completing on the
same character, the one that starts earlier). While streaming, the tail of the text that could still be
the start of a stop string is held back, so nothing after a stop is ever sent.

Matching is incremental (Knuth-Morris-Pratt): each stop string keeps the length of its longest prefix
that ends the text so far, and a new character moves it in amortized O(1). The work per token is
O(new characters x stop strings), whatever the stop strings' lengths, and the held-back tail is at most
the longest stop string (the request parser caps them: protocol.MAX_STOP_CHARS).
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._failure = [_failure_table(s) for s in stops]
        self._matched = [0] * len(stops)  # per stop: its prefix length that ends the text so far
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """New text in -> the part that is safe to send now; sets .stopped when a stop string appears."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        for position, char in enumerate(text):
            completed = self._advance(char)
            if completed is not None:  # the stop ends at this character: cut before its first one
                self.stopped = True
                held = self._held + text[:position + 1]
                self._held = ""
                return held[:len(held) - completed]
        keep = max(self._matched)
        held = self._held + text
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep]

    def _advance(self, char: str) -> int | None:
        """Move every stop's state by one character -> the length of the longest stop completed, or None."""
        completed = None
        for i, (stop, failure) in enumerate(zip(self.stops, self._failure)):
            k = self._matched[i]
            while k and stop[k] != char:
                k = failure[k - 1]
            if stop[k] == char:
                k += 1
            if k == len(stop):
                completed = max(completed or 0, k)
                k = failure[k - 1]
            self._matched[i] = k
        return completed

    def flush(self) -> str:
        """At the end of the request: the held-back tail was not a stop after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


def _failure_table(stop: str) -> list[int]:
    """failure[k]: the longest proper prefix of stop[:k + 1] that is also its suffix (KMP)."""
    failure, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = failure[k - 1]
        if stop[i] == stop[k]:
            k += 1
        failure[i] = k
    return failure
