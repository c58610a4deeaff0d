"""What one HTTP request's hooks and view tell each other: a typed record, kept on `flask.g`."""

import enum
import time
from dataclasses import dataclass, field

from flask import g

# The one attribute of `flask.g` that corechat uses; everything else goes through the record's fields.
G_ATTRIBUTE = "corechat_request"


class CacheStatus(enum.StrEnum):
    """What the response cache did for a reply: its X-Cache header."""

    # Replayed from the cache, or read from an identical request's generation as it went.
    HIT = "hit"
    # Generated for this request, and stored for the next.
    MISS = "miss"
    # Generated without the cache: not consulted, opted out, or its store failed.
    BYPASS = "bypass"


@dataclass
class RequestRecord:
    """What is known about the request being handled, filled in by the hooks and the view as it goes."""

    # When the request reached the app: the start of its time to first token and its duration.
    arrived_at: float = field(default_factory=time.monotonic)
    # Whether its generation is observed by the metrics, which then count its outcome themselves.
    observed: bool = False
    # What the cache did for its reply; `bypass` until the cache is consulted.
    x_cache: CacheStatus = CacheStatus.BYPASS
    # A hash of the API key it was let in with; None when the API needs no key.
    api_key_hash: str | None = None


def current_record() -> RequestRecord:
    """Return the record of the request being handled, creating it on first use."""
    record = g.get(G_ATTRIBUTE)
    if record is None:
        record = RequestRecord()
        setattr(g, G_ATTRIBUTE, record)
    return record
