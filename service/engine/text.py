"""Turn generated token ids into text pieces that are whole characters and never show a stop string."""

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream


def byte_level_alphabet() -> dict[str, int]:
    """Return the byte each character of a byte-level BPE token stands for (GPT-2's printable mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 256)]
    shifted = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + n): byte for n, byte in enumerate(shifted)}}


@dataclass(frozen=True)
class TokenLogprob:
    """One token as logprobs report it: its text (bytes of a split character shown as U+FFFD), bytes and log probability."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple["TokenLogprob", ...] = ()


class TokenSpeller:
    """Spell token ids as the bytes they stand for (a byte-level BPE vocabulary, added tokens as written)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._alphabet = byte_level_alphabet()
        self._added = {token_id: token.content for token_id, token in tokenizer.added_tokens_decoder.items()}

    def bytes_of(self, token_id: int) -> bytes:
        """Return the bytes a token stands for (none for an id past the vocabulary)."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        return bytes(self._alphabet[char] for char in piece if char in self._alphabet)

    def logprob(self, token_id: int, logprob: float, top: tuple[tuple[int, float], ...] = ()) -> TokenLogprob:
        """Return a token's logprob entry, with its alternatives'."""
        data = self.bytes_of(token_id)
        alternatives = tuple(self.logprob(other, value) for other, value in top)
        return TokenLogprob(data.decode("utf-8", errors="replace"), tuple(data), logprob, alternatives)


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
