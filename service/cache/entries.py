"""Cache keys and cached replies: what identifies a reply, and its compact, validated encoding."""

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from ..engine import Finished, SamplingParams

NAMESPACE = "corechat:v1"
STORABLE_FINISH_REASONS = ("stop", "length")


def cache_key(fingerprint: str, prompt: str, params: SamplingParams) -> str:
    """Return the digest naming a reply: model fingerprint, rendered prompt and every sampling parameter.

    All of SamplingParams goes in, so a parameter added later changes keys without anyone remembering to.
    """
    canonical = json.dumps(
        {"fingerprint": fingerprint, "prompt": prompt, "params": dataclasses.asdict(params)},
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


def flight_key(digest: str, token: str) -> str:
    """Return the store key of the stream one leader publishes its pieces to."""
    return f"{NAMESPACE}:flight:{digest}:{token}"


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
