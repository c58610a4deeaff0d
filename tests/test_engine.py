"""The engine on the tiny model: determinism, seeds, limits, cancellation and the queue."""

import time

import pytest

from service.engine import Engine, EngineOverloaded, Failed, Finished, SamplingParams, Started, TextDelta

PROMPT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


def run(engine, params, messages=PROMPT):
    """Generate to the end and return (text, finished event, all events)."""
    generation = engine.submit(engine.encode(engine.render_prompt(messages)), params)
    events = list(generation.events())
    text = "".join(event.text for event in events if isinstance(event, TextDelta))
    return text, events[-1], events


def test_greedy_generation_is_deterministic(engine):
    first = run(engine, SamplingParams(max_tokens=12, temperature=0.0))
    second = run(engine, SamplingParams(max_tokens=12, temperature=0.0))
    assert first[0] == second[0]
    assert first[1] == second[1] or first[1].completion_tokens == second[1].completion_tokens


def test_same_seed_same_output_and_other_seed_differs(engine):
    params = dict(max_tokens=16, temperature=1.0, top_p=1.0)
    one = run(engine, SamplingParams(seed=7, **params))[0]
    again = run(engine, SamplingParams(seed=7, **params))[0]
    other = run(engine, SamplingParams(seed=8, **params))[0]
    assert one == again
    assert one != other


def test_max_tokens_ends_with_length_and_counts_tokens(engine):
    text, finished, events = run(engine, SamplingParams(max_tokens=5, temperature=0.0))
    assert isinstance(events[0], Started)
    assert isinstance(finished, Finished)
    if finished.finish_reason == "length":
        assert finished.completion_tokens == 5
    else:
        assert finished.finish_reason == "stop" and finished.completion_tokens <= 5
    assert finished.prompt_tokens == len(engine.encode(engine.render_prompt(PROMPT)))


def test_stop_string_from_real_generation_is_cut_and_not_shown(engine):
    params = dict(max_tokens=20, temperature=1.0, seed=3)
    full, _, _ = run(engine, SamplingParams(**params))
    # Stop on three characters from the middle of the seeded output: they may span tokens.
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    text, finished, _ = run(engine, SamplingParams(stop=(stop,), **params))
    assert finished.finish_reason == "stop"
    assert text == full[: full.index(stop)]
    assert stop not in text


def test_cancel_stops_generation_at_next_token(engine):
    generation = engine.submit(engine.encode(engine.render_prompt(PROMPT)), SamplingParams(max_tokens=10_000, temperature=0.0))
    assert isinstance(generation.next_event(timeout=30), Started)
    generation.next_event(timeout=30)
    generation.cancel()
    events = list(generation.events())
    assert events[-1].finish_reason == "cancelled"
    assert events[-1].completion_tokens < 10_000
    deadline = time.monotonic() + 5
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.running == 0


def test_full_queue_refuses_at_once(make_settings):
    engine = Engine(make_settings(max_queue=1, max_running=1))
    engine.start()
    assert engine.wait_ready(60)
    try:
        ids = engine.encode(engine.render_prompt(PROMPT))
        running = engine.submit(ids, SamplingParams(max_tokens=10_000, temperature=0.0))
        assert isinstance(running.next_event(timeout=30), Started)
        waiting = engine.submit(ids, SamplingParams(max_tokens=1, temperature=0.0))
        began = time.monotonic()
        with pytest.raises(EngineOverloaded):
            engine.submit(ids, SamplingParams(max_tokens=1, temperature=0.0))
        assert time.monotonic() - began < 0.1
        running.cancel()
        assert list(waiting.events())[-1].finish_reason in ("stop", "length")
    finally:
        engine.stop()


def test_concurrent_generations_interleave(make_settings):
    engine = Engine(make_settings(max_running=2))
    engine.start()
    assert engine.wait_ready(60)
    try:
        ids = engine.encode(engine.render_prompt(PROMPT))
        long_run = engine.submit(ids, SamplingParams(max_tokens=400, temperature=0.0))
        assert isinstance(long_run.next_event(timeout=30), Started)
        short = engine.submit(ids, SamplingParams(max_tokens=3, temperature=0.0))
        short_events = list(short.events())
        assert short_events[-1].completion_tokens <= 3
        # The short request finished while the long one was still running.
        long_events = []
        while (event := long_run.next_event(timeout=0)) is not None:
            long_events.append(event)
        assert long_events and not any(isinstance(event, Finished) for event in long_events)
        long_run.cancel()
    finally:
        engine.stop()


def test_deadline_ends_generation_with_length(engine):
    params = SamplingParams(max_tokens=100_000, temperature=0.0, deadline_seconds=0.3)
    began = time.monotonic()
    text, finished, _ = run(engine, params)
    assert finished.finish_reason in ("length", "stop")
    assert time.monotonic() - began < 5


def test_model_weights_are_mapped_from_the_file(engine):
    """The weights are views of the mapped safetensors file, not private copies."""
    with open("/proc/self/maps") as maps:
        mapped = maps.read()
    assert str(engine.model_dir / "model.safetensors") in mapped
    assert engine.facts["load_seconds"] >= 0
    assert len(engine.fingerprint) == 16


def test_fingerprint_survives_a_copy_and_changes_with_retrained_weights(tiny_model_dir, tmp_path):
    import shutil

    from service.engine.loading import load_tokenizer, model_fingerprint

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    tokenizer = load_tokenizer(copy)
    assert model_fingerprint(copy, tokenizer) == model_fingerprint(tiny_model_dir, tokenizer)
    # Retraining changes every weight; the fingerprint samples the data, so it sees that.
    data = (copy / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    retrained = data[:header_end] + bytes(byte ^ 1 for byte in data[header_end:])
    (copy / "model.safetensors").write_bytes(retrained)
    assert model_fingerprint(copy, tokenizer) != model_fingerprint(tiny_model_dir, tokenizer)


def test_weight_format_is_part_of_the_fingerprint(make_settings, engine):
    """int8 and bfloat16 replies differ, so hosts serving them must not share cached replies."""
    assert engine.settings.dtype == "int8"
    exact = Engine(make_settings(dtype="bfloat16", max_model_len=256))
    exact.start()
    try:
        assert exact.wait_ready(60)
        assert exact.fingerprint != engine.fingerprint
        # int8 Linear weights are buffers, not parameters: the count must still be the model's.
        assert engine.facts["parameters"] == exact.facts["parameters"] > 0
    finally:
        exact.stop()


def test_stopping_the_engine_ends_queued_and_running_generations(make_settings):
    """Every request gets a last event when the engine stops, so no request thread waits forever."""
    engine = Engine(make_settings(max_running=1))
    engine.start()
    assert engine.wait_ready(60)
    ids = engine.encode(engine.render_prompt(PROMPT))
    running = engine.submit(ids, SamplingParams(max_tokens=100_000, temperature=0.0))
    assert isinstance(running.next_event(timeout=30), Started)
    queued = engine.submit(ids, SamplingParams(max_tokens=5, temperature=0.0))
    engine.stop()
    running_last = list(running.events())[-1]
    queued_last = queued.next_event(timeout=5)
    assert isinstance(running_last, Finished) and running_last.finish_reason == "cancelled"
    assert isinstance(queued_last, Failed) and "shutting down" in queued_last.message
