"""What a request hears of its generation: the event types, the request's handle and the protocol of an event source.

Nothing here imports torch or touches the model: the layers that pass events on (the response
cache, the metrics, the disconnect watcher) need these types and nothing else of the engine.
"""

import hashlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .text import TokenLogprob

if TYPE_CHECKING:
    from .sampling import SamplingParams  # imports torch; the handle only carries the parameters


@dataclass(frozen=True)
class KvScope:
    """Whose stored KV state a generation may reuse, and whether it may leave its own for later ones
    (prefixes.py keeps each scope's apart)."""

    # The response cache's scope of the request ("" when every caller shares one).
    name: str = ""
    # False for a request that asked for no storage (Cache-Control: no-store).
    keep: bool = True

    @property
    def tag(self) -> str:
        """Return what the scope's folder name adds to the model's ("" for the shared scope)."""
        return hashlib.sha256(self.name.encode()).hexdigest()[:24] if self.name else ""


@dataclass(frozen=True)
class Started:
    """The engine took the request off the queue."""

    queue_seconds: float
    # True when the response cache serves the reply: no engine queue was involved.
    cached: bool = False
    # When the engine took it (time.monotonic() of the engine's process; 0 for a cached reply).
    taken_at: float = 0.0


@dataclass(frozen=True)
class TextDelta:
    """A piece of generated text: whole characters, no stop string."""

    text: str
    # The tokens that completed this text since the previous piece: what a continuation is forced with.
    token_ids: tuple[int, ...] = ()
    # Their log probabilities, when the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's own token logprobs, sent once after its pass when the request asked (before any text)."""

    # The prompt's first token, which nothing before it predicts: its text alone.
    first_token: str
    # Every later prompt token, each under the model's distribution at the position before it.
    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Finished:
    """The generation ended; the last event of a successful generation."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    prompt_seconds: float
    decode_seconds: float
    cached_prompt_tokens: int = 0
    # True when the response cache served the reply: the timings are not the engine's.
    cached: bool = False
    # Draft tokens of speculative steps (speculation.py) taken into the reply, and those not taken.
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0


@dataclass(frozen=True)
class Failed:
    """The generation failed inside the engine; the last event of a failed generation."""

    message: str


@dataclass(frozen=True)
class ChoiceEvent:
    """An event of one choice of a request that asked for several (n > 1)."""

    index: int
    event: "PromptLogprobs | TextDelta | Finished | Failed"


Event = Started | PromptLogprobs | TextDelta | Finished | Failed | ChoiceEvent


class EventSource(Protocol):
    """Anything a request reads its reply's events from, ending with one Finished or Failed.

    The engine's Generation is one; the layers stacked on it pass its events on: a response-cache
    flight's reader (service/cache/flights.py), the metrics' observer (service/observed.py) and the
    disconnect watcher (service/disconnect.py). Each declares this protocol as a base, which gives
    it `events()`.
    """

    def next_event(self, timeout: float | None = None) -> Event | None:
        """Return the next event, or None if none came within timeout seconds."""
        ...

    def cancel(self) -> None:
        """Ask for the generation to stop; a last event still comes."""
        ...

    def events(self) -> Iterator[Event]:
        """Yield every event up to and including the last one (Finished or Failed)."""
        while True:
            event = self.next_event()
            yield event
            if isinstance(event, (Finished, Failed)):
                return


class Generation(EventSource):
    """A request's handle: the events the engine sends it, and a way to cancel it.

    `forced_ids` start the reply with tokens generated before (a continuation): they are processed
    with the prompt, count as completion tokens, and their text is not sent again.
    """

    def __init__(self, prompt_ids: list[int], params: "SamplingParams", forced_ids: tuple[int, ...] = (), grammar=None,
                 kv_scope: KvScope = KvScope()):
        self.prompt_ids = prompt_ids
        self.params = params
        self.forced_ids = tuple(forced_ids)
        self.kv_scope = kv_scope
        # The llguidance matcher of params.grammar, advanced by each token of the reply.
        self.grammar = grammar
        self.submitted_at = time.monotonic()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        # The other choices of a request with n > 1: they share this one's place in the queue and its
        # prompt pass, and each decodes as a row of its own (ChoiceGroup joins their events).
        self.siblings: tuple[Generation, ...] = ()
        self._choice: int | None = None

    @property
    def choices(self) -> "tuple[Generation, ...]":
        """Return every choice this generation's prompt pass serves: itself, then its siblings."""
        return (self, *self.siblings)

    @property
    def places(self) -> int:
        """Return the running places the generation takes: one per choice."""
        return 1 + len(self.siblings)

    @property
    def input_ids(self) -> list[int]:
        """Return the tokens the engine processes before it samples: the prompt, then the forced ones."""
        return [*self.prompt_ids, *self.forced_ids]

    def cancel(self) -> None:
        """Ask the engine to stop this generation at its next token."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """Tell whether cancel() was called."""
        return self._cancelled.is_set()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """Return the next event, or None if none came within timeout seconds."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def send(self, event: Event) -> None:
        """Deliver an event to the request (engine side); a choice of a group tags it with its index."""
        self._events.put(event if self._choice is None or isinstance(event, Started) else ChoiceEvent(self._choice, event))


class ChoiceGroup(EventSource):
    """The n generations of one request (n > 1), read as one source: each choice's events as ChoiceEvents (the
    first Started as it is), then, once every choice ended, one Finished for the request (its prompt counted
    once, the choices' tokens summed; cancelled if any was), or the first Failed."""

    def __init__(self, generations: list[Generation]):
        lead, *siblings = generations
        events: queue.SimpleQueue = queue.SimpleQueue()
        for index, generation in enumerate(generations):
            generation._events, generation._choice = events, index
        lead.siblings = tuple(siblings)
        self.lead = lead
        self.generations = generations
        self._events = events
        self._ended: dict[int, Finished | Failed] = {}
        self._last: Finished | Failed | None = None
        self._done = False

    @property
    def prompt_ids(self) -> list[int]:
        """Return the prompt every choice continues."""
        return self.lead.prompt_ids

    @property
    def input_ids(self) -> list[int]:
        """Return the tokens the prompt pass processes."""
        return self.lead.input_ids

    @property
    def forced_ids(self) -> tuple[int, ...]:
        """Return no forced tokens: a group is never a continuation."""
        return ()

    def cancel(self) -> None:
        """Ask the engine to stop every choice."""
        for generation in self.generations:
            generation.cancel()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """Return the next event of any choice, then the request's last (or None on timeout)."""
        if self._last is not None and not self._done:
            self._done = True
            return self._last
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, ChoiceEvent) and isinstance(event.event, (Finished, Failed)):
            self._ended[event.index] = event.event
            if len(self._ended) == len(self.generations):
                self._last = self._summary()
        return event

    def _summary(self) -> Finished | Failed:
        """Return the request's last event from its choices' ones."""
        ended = [self._ended[index] for index in range(len(self.generations))]
        failed = [event for event in ended if isinstance(event, Failed)]
        if failed:
            return failed[0]
        first = ended[0]
        cancelled = any(event.finish_reason == "cancelled" for event in ended)
        return Finished(
            finish_reason="cancelled" if cancelled else first.finish_reason,
            prompt_tokens=first.prompt_tokens,
            completion_tokens=sum(event.completion_tokens for event in ended),
            prompt_seconds=first.prompt_seconds,
            decode_seconds=max(event.decode_seconds for event in ended),
            cached_prompt_tokens=first.cached_prompt_tokens,
            accepted_draft_tokens=sum(event.accepted_draft_tokens for event in ended),
            rejected_draft_tokens=sum(event.rejected_draft_tokens for event in ended),
        )
