"""Cache keys, cached replies and flight records: what identifies a reply, and how it is written down."""

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass

from ..engine import Failed, Finished, SamplingParams, TextDelta

log = logging.getLogger(__name__)

NAMESPACE = "corechat:v2"
STORABLE_FINISH_REASONS = ("stop", "length")


def cache_key(fingerprint: str, scope: str, prompt_ids: list[int], params: SamplingParams) -> str:
    """Return the digest naming a reply: model fingerprint, scope, prompt tokens and every sampling parameter.

    The prompt goes in as token ids, not text: two prompts that render alike but encode differently
    (a control token typed as text, or parsed) get different replies. All of SamplingParams goes in,
    so a parameter added later changes keys without anyone remembering to.
    """
    canonical = json.dumps(
        {"fingerprint": fingerprint, "scope": scope, "prompt_ids": prompt_ids, "params": dataclasses.asdict(params)},
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def reply_key(digest: str) -> str:
    """Return the store key of a cached reply."""
    return f"{NAMESPACE}:reply:{digest}"


def lock_key(digest: str) -> str:
    """Return the store key of the single-flight lock of a reply."""
    return f"{NAMESPACE}:lock:{digest}"


def flight_key(digest: str) -> str:
    """Return the store key of the stream the generating worker publishes a reply's pieces to."""
    return f"{NAMESPACE}:flight:{digest}"


def is_reproducible(params: SamplingParams) -> bool:
    """Tell whether the same request always gets the same reply: greedy or explicitly seeded."""
    return params.greedy or params.seed is not None


def is_complete(finished: Finished, params: SamplingParams) -> bool:
    """Tell whether a reply ended on its own or at max_tokens (not cancelled, not cut by the clock)."""
    if finished.finish_reason == "length":
        return finished.completion_tokens >= params.max_tokens
    return finished.finish_reason == "stop"


@dataclass(frozen=True)
class CachedReply:
    """A finished reply: its text pieces as the engine emitted them, how it ended and its token counts."""

    pieces: tuple[str, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    def encode(self) -> bytes:
        """Return the compact JSON bytes stored for this reply."""
        record = [list(self.pieces), self.finish_reason, self.prompt_tokens, self.completion_tokens]
        return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> "CachedReply":
        """Parse stored bytes, raising ValueError on anything that is not a valid reply."""
        try:
            pieces, finish_reason, prompt_tokens, completion_tokens = json.loads(data)
        except (TypeError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"undecodable entry: {exc}") from None
        if not (isinstance(pieces, list) and all(isinstance(piece, str) for piece in pieces)):
            raise ValueError("pieces are not a list of strings")
        if finish_reason not in STORABLE_FINISH_REASONS:
            raise ValueError(f"bad finish_reason {finish_reason!r}")
        counts = (prompt_tokens, completion_tokens)
        if not all(type(count) is int and count >= 0 for count in counts):
            raise ValueError("token counts are not non-negative integers")
        return cls(tuple(pieces), finish_reason, prompt_tokens, completion_tokens)


@dataclass(frozen=True)
class FlightRecord:
    """One entry of a flight stream.

    A run is one reply in the making, however many workers took turns generating it: `begin` opens it,
    `piece` adds text with the tokens that produced it, `abandoned` says its generator stopped and
    someone should continue, `end` and `failed` close it.
    """

    kind: str
    run: str
    event: TextDelta | Finished | Failed | None = None

    @property
    def closes_run(self) -> bool:
        """Tell whether the run ends here."""
        return self.kind in ("end", "failed")

    def encode(self) -> dict[str, str]:
        """Return the record as the flat string fields a Redis stream entry holds."""
        fields = {"k": self.kind, "run": self.run}
        if isinstance(self.event, TextDelta):
            fields.update(text=self.event.text, ids=" ".join(map(str, self.event.token_ids)))
        elif isinstance(self.event, Finished):
            fields.update(reason=self.event.finish_reason, prompt_tokens=str(self.event.prompt_tokens),
                          completion_tokens=str(self.event.completion_tokens))
        elif isinstance(self.event, Failed):
            fields.update(message=self.event.message)
        return fields

    @classmethod
    def decode(cls, fields: dict[str, str]) -> "FlightRecord | None":
        """Parse a stream entry; None (and a log line) for one that makes no sense."""
        try:
            kind, run = fields["k"], fields["run"]
            if kind in ("begin", "abandoned"):
                return cls(kind, run)
            if kind == "piece":
                ids = tuple(int(token) for token in fields["ids"].split())
                if any(token < 0 for token in ids):
                    raise ValueError("negative token id")
                return cls(kind, run, TextDelta(fields["text"], ids))
            if kind == "end" and fields["reason"] in STORABLE_FINISH_REASONS:
                finished = Finished(fields["reason"], int(fields["prompt_tokens"]), int(fields["completion_tokens"]),
                                    0.0, 0.0, cached=True)
                return cls(kind, run, finished)
            if kind == "failed":
                return cls(kind, run, Failed(fields["message"]))
        except (KeyError, ValueError):
            pass
        log.warning("ignoring a malformed single-flight record %r", fields)
        return None
