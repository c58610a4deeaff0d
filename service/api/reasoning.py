"""A reply's thinking split off from its content, as llama.cpp's `--reasoning-format` and vLLM's Qwen3
reasoning parser return it: `reasoning_content` apart from `content`.

Qwen3 writes `<think>\\n...\\n</think>\\n\\n` before its answer (an empty block when told not to think).
The text between the markers is the reasoning, without the newlines the template puts around it (it
strips them too when the reasoning comes back in a message); the newlines after the closing marker
are dropped from the content. A reply that does not open with the marker is content alone; one cut
off inside its thinking is reasoning alone.

The parser takes the reply in pieces and gives out only what no later piece can change (a piece that
may be the start of a marker, or trailing newlines that may precede one, waits), so a stream's
deltas join into exactly what the whole reply gives.
"""

import enum

from ..engine import ReasoningMarkers


class _Where(enum.Enum):
    BEFORE = "before"  # nothing but whitespace yet: the reply may still open its thinking
    INSIDE = "inside"
    AFTER = "after"  # just past the closing marker: its newlines are dropped
    CONTENT = "content"


def _marker_start(text: str, marker: str) -> int:
    """Return where a suffix of `text` that could begin `marker` starts (len(text) when none can)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)


class ReasoningParser:
    """Split one reply's text, piece by piece, into (reasoning, content)."""

    def __init__(self, markers: ReasoningMarkers):
        self.markers = markers
        self._where = _Where.INSIDE if markers.opened_by_prompt else _Where.BEFORE
        self._held = ""
        self._reasoned = False

    def feed(self, text: str) -> tuple[str, str]:
        """Take a piece of the reply; return the reasoning and content it settles."""
        self._held += text
        reasoning, content = [], []
        while self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End the reply; return what was held back: content before any thinking, reasoning inside it."""
        held, self._held = self._held, ""
        if self._where is _Where.BEFORE:
            return "", held
        if self._where is _Where.INSIDE:
            return self._reasoning(held.rstrip("\n")), ""
        return "", held if self._where is _Where.CONTENT else ""

    def _reasoning(self, text: str) -> str:
        """Return reasoning text to give out, without the newlines that open the thinking."""
        if not self._reasoned:
            text = text.lstrip("\n")
            self._reasoned = bool(text)
        return text

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Settle what the held text allows; return True when the state moved on and another step may settle more."""
        held = self._held
        if self._where is _Where.BEFORE:
            stripped = held.lstrip()
            if stripped.startswith(self.markers.open):
                self._held, self._where = stripped[len(self.markers.open):], _Where.INSIDE
                return True
            if self.markers.open.startswith(stripped):
                return False
            self._where = _Where.CONTENT
            return True
        if self._where is _Where.INSIDE:
            before, closed, after = held.partition(self.markers.close)
            if closed:
                reasoning.append(self._reasoning(before.rstrip("\n")))
                self._held, self._where = after, _Where.AFTER
                return True
            settled = _marker_start(held, self.markers.close)
            while settled and held[settled - 1] == "\n":
                settled -= 1
            reasoning.append(self._reasoning(held[:settled]))
            self._held = held[settled:]
            return False
        if self._where is _Where.AFTER:
            self._held = held.lstrip("\n")
            if not self._held:
                return False
            self._where = _Where.CONTENT
            return True
        content.append(held)
        self._held = ""
        return False
