"""One reply in the making in this worker, read by every request that asked for it (single-flight).

Identical requests in a worker share one Flight: its pieces so far, how it ended, and how many
requests still read it. A request that joins late gets every piece from the start, then the rest
live. What fills the flight (a stored reply, this worker's generation, or another worker's through
the store) is runs.py's business.
"""

import dataclasses
import threading
import time

from ..engine import Event, EventSource, Failed, Finished, Started, TextDelta
from .entries import CachedReply


class Flight:
    """A reply's pieces so far, its end, and the requests reading it.

    `on_done(flight)` is called once no request can join the flight any more (it ended, or every
    reader left first).
    """

    def __init__(self, digest: str, on_done=lambda flight: None):
        self.digest = digest
        self.on_done = on_done
        self._changed = threading.Condition()
        self.pieces: list[TextDelta] = []
        self.last: Finished | Failed | None = None
        # The engine's Started, for the request that began the generation with nothing forced.
        self.started: Started | None = None
        self.fresh_generation = False
        self.generations = 0
        # Generations this worker started after following another's, so a reader can tell that one
        # began after it joined.
        self.takeovers = 0
        self.readers = 0
        self.closed = False
        self.generation: EventSource | None = None

    @classmethod
    def replayed(cls, reply: CachedReply) -> "Flight":
        """Return a finished flight holding a stored reply."""
        flight = cls("")
        flight.replay(reply)
        return flight

    # Readers -------------------------------------------------------------------------------

    def join(self, *, leads: bool = False) -> "FlightReader | None":
        """Add a reader, unless every reader left already and the flight stopped."""
        with self._changed:
            if self.closed:
                return None
            self.readers += 1
            return FlightReader(self, leads=leads)

    def leave(self) -> None:
        """Remove a reader; when none is left before the end, stop this worker's generation."""
        with self._changed:
            self.readers -= 1
            if self.readers or self.last is not None:
                return
            self.closed = True
            generation = self.generation
        self.on_done(self)
        if generation is not None:
            generation.cancel()

    def next_for(self, reader: "FlightReader", timeout: float | None) -> Event | None:
        """Return a reader's next event, or None if none came within timeout seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                if not reader.started_sent:
                    if not reader.leads:
                        reader.started_sent = True
                        return Started(queue_seconds=0.0, cached=True)
                    if self.started is not None:
                        reader.started_sent = True
                        return self.started
                    reader.started_sent = bool(self.pieces) or self.last is not None
                if reader.index < len(self.pieces):
                    reader.index += 1
                    return self.pieces[reader.index - 1]
                if self.last is not None:
                    return self._last_for(reader)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._changed.wait(remaining)

    def _last_for(self, reader: "FlightReader") -> Finished | Failed:
        """Return the last event as a reader sees it: the engine's timings only for the request that
        generated the whole reply, so the others do not count in the engine's histograms."""
        if isinstance(self.last, Finished) and not (reader.leads and self.fresh_generation):
            return dataclasses.replace(self.last, prompt_seconds=0.0, decode_seconds=0.0, cached=True)
        return self.last

    # Filling -------------------------------------------------------------------------------

    def add_pieces(self, pieces: list[TextDelta]) -> None:
        """Give readers more text."""
        if pieces:
            with self._changed:
                self.pieces.extend(pieces)
                self._changed.notify_all()

    def mark_started(self, started: Started) -> None:
        """Record the engine's Started of the flight's first generation."""
        with self._changed:
            self.started = self.started or started
            self._changed.notify_all()

    def end(self, last: Finished | Failed) -> None:
        """Give readers the last event (once); no request joins the flight after this."""
        with self._changed:
            if self.last is not None:
                return
            self.last = last
            self._changed.notify_all()
        self.on_done(self)

    def replay(self, reply: CachedReply) -> None:
        """Give readers a stored reply, in the pieces the engine first produced."""
        self.add_pieces([TextDelta(piece) for piece in reply.pieces])
        self.end(Finished(reply.finish_reason, reply.prompt_tokens, reply.completion_tokens, 0.0, 0.0, cached=True))

    def attach(self, generation: EventSource, *, forced: tuple[int, ...], takeover: bool) -> None:
        """Make an engine generation the flight's, cancelling it at once if every reader left meanwhile."""
        with self._changed:
            self.generation = generation
            self.generations += 1
            self.takeovers += takeover
            self.fresh_generation = self.generations == 1 and not forced
            closed = self.closed
        if closed:
            generation.cancel()

    def forced_ids(self) -> tuple[int, ...]:
        """Return the tokens of the flight's text, which a generation continuing it is forced with."""
        return tuple(token for piece in self.pieces for token in piece.token_ids)


class FlightReader(EventSource):
    """One request's view of a flight: an event source, as an engine Generation is."""

    def __init__(self, flight: Flight, *, leads: bool):
        self.flight = flight
        self.leads = leads
        self.index = 0
        self.started_sent = False
        self._joined_at = flight.takeovers
        self._left = False

    @property
    def generated(self) -> bool:
        """Tell whether this worker generated text for this request (it was not only replayed or followed)."""
        return self.leads or self.flight.takeovers > self._joined_at

    def next_event(self, timeout: float | None = None) -> Event | None:
        """Return the next event, or None if none came within timeout seconds; after cancel, a cancelled end."""
        if self._left:
            return Finished("cancelled", 0, 0, 0.0, 0.0)
        return self.flight.next_for(self, timeout)

    def cancel(self) -> None:
        """Stop reading; the flight stops generating when no reader is left."""
        if not self._left:
            self._left = True
            self.flight.leave()
