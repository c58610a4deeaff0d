"""Turn generated token ids into text pieces that are whole characters and never show a stop string."""

from tokenizers.decoders import DecodeStream


class StopStringFilter:
    """Hold back text that may be the start of a stop string; cut the text at the first one found."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add text and return what can safely be shown now."""
        if not self.stop:
            return text
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            shown, self.pending = self.pending[:cut], ""
            return shown
        keep = self._longest_stop_prefix_suffix()
        shown = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return shown

    def flush(self) -> str:
        """Return what was held back, once generation ended without a stop string."""
        shown, self.pending = self.pending, ""
        return shown

    def _longest_stop_prefix_suffix(self) -> int:
        """Return the length of the longest end of pending text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class TextAssembler:
    """Decode one sequence's tokens incrementally into text deltas, honouring stop strings."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = StopStringFilter(stop)
        self.text = ""

    @property
    def stopped(self) -> bool:
        """Tell whether a stop string has appeared."""
        return self._stop.stopped

    def add(self, token_id: int) -> str:
        """Take one token; return the text it completes (empty while a character is unfinished)."""
        piece = self._stream.step(self._backend, token_id) or ""
        shown = self._stop.feed(piece)
        self.text += shown
        return shown

    def finish(self) -> str:
        """Return the text still held back when generation ends."""
        shown = "" if self._stop.stopped else self._stop.flush()
        self.text += shown
        return shown
