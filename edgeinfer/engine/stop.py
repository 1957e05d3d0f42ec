"""Stop strings over text that arrives a few characters at a time.

A stop string may span token boundaries, and a streamed reply must never show the start of one
that later completes: text that could still grow into a stop string is held back until it
either completes (and is cut) or stops matching (and is released).
"""

from __future__ import annotations


class StopStrings:
    """Finds the earliest stop string in growing text and how much of it is safe to show."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._longest = max((len(s) for s in stops), default=0)

    def find(self, text: str, new_from: int) -> int:
        """Start of the earliest stop string that ends at or after text[new_from:], or -1.

        Text before new_from was already searched, so a match must overlap the new part.
        """
        start = max(0, new_from - self._longest + 1)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits, default=-1)

    def safe_len(self, text: str) -> int:
        """Length of the prefix of text that no stop string can still start in."""
        for i in range(max(0, len(text) - self._longest + 1), len(text)):
            tail = text[i:]
            if any(s.startswith(tail) for s in self.stops):
                return i
        return len(text)
