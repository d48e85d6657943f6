"""Stop-string matching over streamed text, holding back what could begin a stop string.

Like vLLM's detokenizer, the last characters that could still be the start of a
stop string are not emitted until the next piece shows they are not, so a stop
string that straddles tokens or steps is cut before any of it is sent.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...], include_stop: bool) -> None:
        self._stops = stops
        self._include_stop = include_stop
        self._reach = max((len(s) for s in stops), default=1) - 1
        self._held = ""

    def feed(self, piece: str, *, may_stop: bool = True) -> tuple[str, str | None]:
        """Add `piece`; return (text safe to emit now, the stop string that matched or None).

        With `may_stop` False (min_tokens not reached yet) a stop string does not end
        generation. After a match, nothing more is held.
        """
        window = self._held + piece
        matched = _earliest(window, self._stops) if self._stops and may_stop else None
        if matched is not None:
            stop, at = matched
            self._held = ""
            return window[: at + (len(stop) if self._include_stop else 0)], stop
        if len(window) > self._reach:
            cut = len(window) - self._reach
            self._held = window[cut:]
            return window[:cut], None
        self._held = window
        return "", None

    def flush(self) -> str:
        """The held-back text, at the end of generation."""
        held, self._held = self._held, ""
        return held


def _earliest(text: str, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """The stop string that occurs earliest in `text`, and where."""
    best: tuple[str, int] | None = None
    for stop in stops:
        at = text.find(stop)
        if at != -1 and (best is None or at < best[1]):
            best = (stop, at)
    return best
