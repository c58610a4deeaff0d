"""How one step's prompt budget is shared in the engine: a short prompt is not held behind a long one's pass,
and prompts given up mid-pass free their place at once (the defaults a user gets)."""

import threading
import time

import pytest

from service.engine import Failed, Finished, SamplingParams, Started, TextDelta
from service.engine.runners import PagedModel
from tests.support import started_engine

# Long enough that its pass takes many steps of PREFILL_CHUNK_TOKENS on the tiny model.
LONG_TOKENS = 24_000
EVENT_TIMEOUT = 120


@pytest.fixture(scope="module")
def default_engine(make_settings):
    """An engine with every scheduling setting at its default."""
    with started_engine(make_settings()) as engine:
        yield engine


def prompt(tokens: int, offset: int = 0) -> list[int]:
    """Return a prompt of ordinary token ids, different for each offset (so no stored prefix helps)."""
    return [1000 + (offset * 7919 + index) % 50_000 for index in range(tokens)]


class Watched:
    """A generation whose events a thread records with the time each arrived."""

    def __init__(self, generation):
        self.generation = generation
        self.events: list[tuple[float, object]] = []
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        """Record every event until the last."""
        while True:
            event = self.generation.next_event(timeout=EVENT_TIMEOUT)
            assert event is not None, "no event within the timeout"
            self.events.append((time.monotonic(), event))
            if isinstance(event, Started):
                self.started.set()
            if isinstance(event, Finished | Failed):
                return

    def first_token_at(self) -> float:
        """Return when the first text arrived."""
        return next(at for at, event in self.events if isinstance(event, TextDelta))

    def last(self) -> object:
        """Wait for the final event and return it."""
        self._thread.join(EVENT_TIMEOUT)
        assert not self._thread.is_alive(), "the generation never ended"
        return self.events[-1][1]


def test_a_short_prompt_gets_its_first_token_while_a_long_prompt_is_in_its_pass(default_engine):
    """With the defaults, a one-line question arriving during a long prompt's pass is answered first."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    long = Watched(default_engine.submit(prompt(LONG_TOKENS), params))
    assert long.started.wait(EVENT_TIMEOUT)
    short = Watched(default_engine.submit(prompt(30, offset=1), params))
    assert isinstance(short.last(), Finished) and isinstance(long.last(), Finished)
    assert short.first_token_at() < long.first_token_at()
    assert short.last().finish_reason == long.last().finish_reason == "length"


def test_the_prompt_work_left_counts_down_through_a_long_pass_and_is_zero_once_it_decodes(default_engine):
    """What a worker reads to decide whether it gathers new streams (service/process/gathering.py): the
    prompt tokens queued and in their pass."""
    assert default_engine.prompt_tokens_left == 0
    long = Watched(default_engine.submit(prompt(LONG_TOKENS, offset=5), SamplingParams(max_tokens=2, temperature=0.0)))
    assert long.started.wait(EVENT_TIMEOUT)
    seen = []
    while not any(isinstance(event, TextDelta | Finished) for _, event in long.events):
        seen.append(default_engine.prompt_tokens_left)
        time.sleep(0.01)
    assert max(seen) > LONG_TOKENS // 2, seen[:5]
    # Started goes out just before the engine takes the prompt's room and counts it.
    counted = seen[next(index for index, left in enumerate(seen) if left):]
    assert counted == sorted(counted, reverse=True), "it only counts down"
    assert isinstance(long.last(), Finished)
    assert default_engine.prompt_tokens_left == 0


def test_a_prompt_cancelled_mid_pass_ends_and_frees_its_place_at_once(default_engine):
    """Cancelling a prompt in its pass ends it at the next step, while another long prompt goes on."""
    params = SamplingParams(max_tokens=2, temperature=0.0)
    kept = Watched(default_engine.submit(prompt(LONG_TOKENS, offset=2), params))
    cancelled = Watched(default_engine.submit(prompt(LONG_TOKENS, offset=3), params))
    assert kept.started.wait(EVENT_TIMEOUT) and cancelled.started.wait(EVENT_TIMEOUT)
    cancelled.generation.cancel()
    ended = cancelled.last()
    assert isinstance(ended, Finished) and ended.finish_reason == "cancelled" and ended.completion_tokens == 0
    assert default_engine.running == 1, "the cancelled prompt still holds its place"
    assert isinstance(kept.last(), Finished)
    assert cancelled.events[-1][0] < kept.first_token_at()


def test_a_prompt_whose_deadline_passes_mid_pass_ends_with_length(default_engine):
    """A deadline that passes while a prompt is in its pass ends it there, without a token."""
    generation = default_engine.submit(prompt(LONG_TOKENS, offset=4),
                                       SamplingParams(max_tokens=4, deadline_seconds=0.05))
    ended = Watched(generation).last()
    assert isinstance(ended, Finished) and ended.finish_reason == "length" and ended.completion_tokens == 0


def test_a_failed_decode_step_ends_every_sequence_it_held_frees_their_pages_and_the_engine_serves_on(
        default_engine, monkeypatch):
    """A decode step that raises (as running out of memory would) fails each sequence it was running with an
    error event, gives their KV pages back, and the next requests are served."""
    runner = default_engine._scheduler.runner
    free_before = runner.pool.free_pages
    failures = iter([MemoryError("injected: no memory for this step")])

    def failing_once(original):
        """Return the runner's step, failing the first step of either kind (a plain or a speculative one)."""
        def step(self, kvs, inputs):
            failure = next(failures, None)
            if failure is not None:
                raise failure
            return original(self, kvs, inputs)
        return step

    monkeypatch.setattr(PagedModel, "decode", failing_once(PagedModel.decode))
    monkeypatch.setattr(PagedModel, "decode_rows", failing_once(PagedModel.decode_rows))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    failed = Watched(default_engine.submit(prompt(40, offset=5), params)).last()
    assert isinstance(failed, Failed) and "MemoryError" in failed.message
    served = Watched(default_engine.submit(prompt(40, offset=6), params)).last()
    assert isinstance(served, Finished) and served.completion_tokens == 4
    assert runner.pool.free_pages == free_before, "a failed or finished sequence still holds KV pages"
