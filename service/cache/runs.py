"""This worker's part in a reply's run, through the store: find the reply, generate it, or follow it.

Across workers and hosts a reply goes through the store. The worker holding the reply's lock
generates and publishes each piece, with the tokens that produced it, to the reply's flight stream,
renewing the lock from its own thread whatever its clients read; other workers read the stream. A
worker that takes over (the generating one stopped or died) continues the run where it stands: the
run's tokens are processed as prompt and sampling goes on from that position, so every reader of a
run gets one coherent reply, and the stored reply is exactly the run's text.
"""

import logging
import threading
import time
import uuid

from ..engine import EventSource, Failed, Finished, Started, TextDelta
from ..errors import APIError
from .entries import CachedReply, FlightRecord, flight_key, is_complete, lock_key, reply_key
from .flights import Flight

log = logging.getLogger(__name__)


class Run:
    """Fill a flight: from the store, from this worker's generation, or from another worker's run.

    `start(forced_ids)` queues an engine generation continuing `forced_ids` (raising an APIError such
    as a 503 when it cannot).
    """

    def __init__(self, cache, flight: Flight, params, start):
        self.cache = cache
        self.store = cache.store
        self.flight = flight
        self.params = params
        self.start = start
        self.reply_key = reply_key(flight.digest)
        self.lock_key = lock_key(flight.digest)
        self.stream = flight_key(flight.digest)
        self.generation: EventSource | None = None
        self.token: str | None = None
        self.run_id: str | None = None
        self.after = self.store.stream_start
        self.following = False
        self.may_store = True

    def open(self) -> str:
        """Find the reply and set the flight going; return the lookup result.

        `hit` (replayed from the store or a finished run), `follow` (another worker generates it),
        `miss` (this worker generates and publishes it) or `error` (the store failed: this worker
        generates it unshared). Raises the APIError of an engine that cannot take the request.
        """
        if not self.cache.breaker.closed():
            self.may_store = False
            self._start_generation(())
            return "error"
        try:
            reply = self._cached_reply()
            if reply is not None:
                self.flight.replay(reply)
                return "hit"
            token = uuid.uuid4().hex
            if not self.store.acquire(self.lock_key, token, self.cache.lease_seconds):
                self.following = True
                threading.Thread(target=self._follow, name="corechat-flight", daemon=True).start()
                return "follow"
            self.token = token
            forced = self._claim_run()
        except self.store.errors as error:
            self.cache.breaker.trip(error)
            self._generate_unshared()
            return "error"
        if forced is None:
            return "hit"
        self._start_generation(forced)
        return "miss"

    def _cached_reply(self) -> CachedReply | None:
        """Return the stored reply, or None; a corrupt entry is logged, deleted and counts as none."""
        data = self.store.get(self.reply_key)
        if data is None:
            return None
        try:
            return CachedReply.decode(data)
        except ValueError as error:
            log.warning("deleting corrupt cache entry %s: %s", self.reply_key, error)
            self.store.delete(self.reply_key)
            return None

    def _claim_run(self) -> tuple[int, ...] | None:
        """Holding the lock, settle where the reply stands; return the tokens to continue generating
        from, or None when the reply is over and its text was handed to the readers.
        """
        records = [record for _, fields in self.store.read_all(self.stream)
                   if (record := FlightRecord.decode(fields)) is not None]
        run = records[-1].run if records else None
        current = [record for record in records if record.run == run]
        closing = next((record for record in current if record.closes_run), None)
        run_pieces = [record.event for record in current if record.kind == "piece"]
        if run is not None and run == self.run_id:
            # The run this flight reads: pass on what it had not read yet, then end as it ended or go on.
            self.flight.add_pieces(run_pieces[len(self.flight.pieces):])
            if closing is not None:
                self._release()
                self.flight.end(closing.event)
                return None
            return self.flight.forced_ids()
        if not self.flight.pieces:
            if run is not None and closing is None:
                # A run whose generator stopped and nobody continued: its text may have reached clients.
                self.run_id = run
                self.flight.add_pieces(run_pieces)
                return self.flight.forced_ids()
            reply = self._cached_reply()
            if reply is not None:  # stored while this request looked for it
                self._release()
                self.flight.replay(reply)
                return None
        elif run is not None and closing is None:
            log.info("single-flight run of %s went another way; generating on unshared", self.stream)
            self._release()
            self.may_store = False
            return self.flight.forced_ids()
        # No run, or one that is over (failed, cut by the clock, too large to store, or lost with Redis):
        # begin a new one, from the text this flight already sent.
        self.run_id = uuid.uuid4().hex
        self._publish(FlightRecord("begin", self.run_id), restart=True)
        for piece in self.flight.pieces:
            self._publish(FlightRecord("piece", self.run_id, piece))
        return self.flight.forced_ids()

    # Generating ----------------------------------------------------------------------------

    def _start_generation(self, forced: tuple[int, ...]) -> None:
        """Queue the engine generation and run it in the flight's thread; on an engine refusal, end the
        flight (and the run) with it and raise it."""
        try:
            generation = self.start(forced)
        except APIError as error:
            self._publish_guarded(FlightRecord("failed", self.run_id or "", Failed(error.message)))
            self._release()
            self.flight.end(Failed(error.message))
            raise
        self.generation = generation
        self.flight.attach(generation, forced=forced, takeover=self.following)
        threading.Thread(target=self._relay, name="corechat-flight", daemon=True).start()

    def _relay(self) -> None:
        """Pass the engine's events to readers and publish them, renewing the lock on the way (the
        flight's thread)."""
        try:
            self._relay_events()
        except Exception:
            log.exception("single-flight relay failed")
            self._release()
            self.flight.end(Failed("internal error"))

    def _relay_events(self) -> None:
        """Relay events until the last one."""
        lease = self.cache.lease_seconds
        renewed_at = time.monotonic()
        while True:
            event = self.generation.next_event(timeout=self.cache.poll_seconds)
            if self.token is not None and time.monotonic() - renewed_at >= lease / 3:
                renewed_at = time.monotonic()
                if not self._guarded(self.store.renew, self.lock_key, self.token, lease, self.stream):
                    log.info("single-flight lease of %s lost; generating on unshared", self.stream)
                    self.token = None
            if isinstance(event, Started):
                self.flight.mark_started(event)
            elif isinstance(event, TextDelta):
                self.flight.add_pieces([event])
                self._publish_guarded(FlightRecord("piece", self.run_id, event))
            elif isinstance(event, Finished):
                self._settle(event)
                return
            elif isinstance(event, Failed):
                self._publish_guarded(FlightRecord("failed", self.run_id, event))
                self._release()
                self.flight.end(event)
                return

    def _settle(self, finished: Finished) -> None:
        """Store a complete reply, close or abandon the run, and give readers the end.

        A flight that publishes stores before it writes the end, so whoever reads the end finds the
        reply stored. One that lost the store on the way tries once, after its readers got the end,
        so a store still down costs them nothing.
        """
        if finished.finish_reason == "cancelled":
            self._publish_guarded(FlightRecord("abandoned", self.run_id))
            self._release()
            self.flight.end(finished)
            return
        reply = None
        if self.may_store and is_complete(finished, self.params):
            reply = CachedReply(tuple(piece.text for piece in self.flight.pieces), finished.finish_reason,
                                finished.prompt_tokens, finished.completion_tokens)
        publishing = self.token is not None
        if reply is not None and publishing:
            self._store(reply)
        self._publish_guarded(FlightRecord("end", self.run_id, finished))
        self._release()
        self.flight.end(finished)
        if reply is not None and not publishing:
            self._store(reply)

    def _store(self, reply: CachedReply) -> None:
        """Store a finished reply unless it is larger than the size cap."""
        data = reply.encode()
        if len(data) > self.cache.max_entry_bytes:
            log.info("not caching a reply of %d bytes (cache_max_entry_bytes is %d)", len(data),
                     self.cache.max_entry_bytes)
            return
        self._guarded(self.store.put, self.reply_key, data, self.cache.ttl_seconds)

    # Following -----------------------------------------------------------------------------

    def _follow(self) -> None:
        """Read the run another worker generates, and take it over when it stops (the flight's thread)."""
        try:
            try:
                self._follow_run()
            except self.store.errors as error:
                self.cache.breaker.trip(error)
                self._generate_unshared()
        except APIError:
            pass  # the engine refused the takeover; the flight ended with that failure
        except Exception:
            log.exception("single-flight follower failed")
            self._release()
            self.flight.end(Failed("internal error"))

    def _follow_run(self) -> None:
        """Pass on the run's records until it ends, or until this worker generates it."""
        while not self.flight.closed:
            records = self.store.read(self.stream, self.after, self.cache.poll_seconds)
            for record_id, fields in records:
                self.after = record_id
                record = FlightRecord.decode(fields)
                if record is None:
                    continue
                if self.run_id is not None and record.run != self.run_id:
                    # The stream began a new run: this flight's run is over without an end it could read.
                    if self.flight.pieces:
                        self._generate_unshared()
                        return
                    self.run_id, self.after = None, self.store.stream_start
                    break
                self.run_id = record.run
                if record.kind == "piece":
                    self.flight.add_pieces([record.event])
                elif record.closes_run:
                    self.flight.end(record.event)
                    return
                elif record.kind == "abandoned" and self._take_over():
                    return
            if not records and self.store.holder(self.lock_key) is None and self._take_over():
                return

    def _take_over(self) -> bool:
        """Try to become the run's generator; return whether this flight generates (or ended) now."""
        token = uuid.uuid4().hex
        if not self.store.acquire(self.lock_key, token, self.cache.lease_seconds):
            return False
        self.token = token
        forced = self._claim_run()
        if forced is not None:
            self._start_generation(forced)
        return True

    def _generate_unshared(self) -> None:
        """Continue this flight's text on this worker alone, after the store failed it."""
        self.token = None
        self._start_generation(self.flight.forced_ids())

    # The store -----------------------------------------------------------------------------

    def _publish(self, record: FlightRecord, *, restart: bool = False) -> None:
        """Write a record to the run's stream while this worker holds the lock (store errors propagate)."""
        if self.token is not None and not self.store.append(self.lock_key, self.token, self.stream,
                                                            record.encode(), restart=restart):
            log.info("single-flight lock of %s lost; generating on unshared", self.stream)
            self.token = None

    def _publish_guarded(self, record: FlightRecord) -> None:
        """Write a record to the run's stream; a store failure only stops publishing."""
        self._guarded(self._publish, record)

    def _release(self) -> None:
        """Let the lock go (if this worker holds it) and stop publishing."""
        token, self.token = self.token, None
        if token is not None:
            self._guarded(self.store.release, self.lock_key, token)

    def _guarded(self, call, *args):
        """Run a store call; on failure trip the breaker, stop publishing and return None."""
        try:
            return call(*args)
        except self.store.errors as error:
            self.cache.breaker.trip(error)
            self.token = None
            return None
