"""The engine on the tiny model: determinism, seeds, limits, cancellation and the queue."""

import dataclasses
import sys
import threading
import time

import pytest
import torch

from harness import file_mappings
from service.app import create_app
from service.engine import (
    Engine,
    EngineOverloaded,
    EngineUnavailable,
    Failed,
    Finished,
    SamplingParams,
    Started,
    TextDelta,
    kernels,
)
from tests.support import started_engine

PROMPT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
# The tiny model's weights are random, so its replies to PROMPT, greedy or seeded as below, run for
# thousands of tokens without drawing one of the 2 EOS ids among 151,936: they end by max_tokens or
# by the deadline ("length"), never by EOS ("stop"), unless a test adds a stop string.


def run(engine, params, messages=PROMPT):
    """Generate to the end and return (text, finished event, all events)."""
    generation = engine.submit(engine.template.encode(engine.template.render(messages)), params)
    events = list(generation.events())
    text = "".join(event.text for event in events if isinstance(event, TextDelta))
    return text, events[-1], events


def test_greedy_generation_is_deterministic(engine):
    first = run(engine, SamplingParams(max_tokens=12, temperature=0.0))
    second = run(engine, SamplingParams(max_tokens=12, temperature=0.0))
    assert first[0] == second[0]
    ends = [(finished.finish_reason, finished.completion_tokens) for _, finished, _ in (first, second)]
    assert ends == [("length", 12)] * 2


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
    assert (finished.finish_reason, finished.completion_tokens) == ("length", 5)
    assert finished.prompt_tokens == len(engine.template.encode(engine.template.render(PROMPT)))


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
    generation = engine.submit(engine.template.encode(engine.template.render(PROMPT)),
                               SamplingParams(max_tokens=10_000, temperature=0.0))
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
    with started_engine(make_settings(max_queue=1, max_running=1)) as engine:
        ids = engine.template.encode(engine.template.render(PROMPT))
        running = engine.submit(ids, SamplingParams(max_tokens=10_000, temperature=0.0))
        assert isinstance(running.next_event(timeout=30), Started)
        waiting = engine.submit(ids, SamplingParams(max_tokens=1, temperature=0.0))
        began = time.monotonic()
        with pytest.raises(EngineOverloaded):
            engine.submit(ids, SamplingParams(max_tokens=1, temperature=0.0))
        assert time.monotonic() - began < 0.1
        running.cancel()
        last = list(waiting.events())[-1]
        assert (last.finish_reason, last.completion_tokens) == ("length", 1)


def test_concurrent_generations_interleave(make_settings):
    with started_engine(make_settings(max_running=2)) as engine:
        ids = engine.template.encode(engine.template.render(PROMPT))
        long_run = engine.submit(ids, SamplingParams(max_tokens=400, temperature=0.0))
        assert isinstance(long_run.next_event(timeout=30), Started)
        short = engine.submit(ids, SamplingParams(max_tokens=3, temperature=0.0))
        short_events = list(short.events())
        assert (short_events[-1].finish_reason, short_events[-1].completion_tokens) == ("length", 3)
        # The short request finished while the long one was still running.
        long_events = []
        while (event := long_run.next_event(timeout=0)) is not None:
            long_events.append(event)
        assert long_events and not any(isinstance(event, Finished) for event in long_events)
        long_run.cancel()


def test_deadline_ends_generation_with_length(engine):
    """deadline_seconds cuts a reply that would run for minutes; it ends as `length` with the tokens it had."""
    max_tokens = 100_000
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, deadline_seconds=0.3)
    began = time.monotonic()
    text, finished, _ = run(engine, params)
    elapsed = time.monotonic() - began
    # `length` short of max_tokens: only the deadline ends a reply so.
    assert finished.finish_reason == "length"
    assert 0 < finished.completion_tokens < max_tokens // 10, finished
    assert text
    # The deadline runs from the request's start, which comes after its submission.
    assert elapsed >= 0.3
    assert elapsed < 5  # only catches a deadline that never fires


def lies_in(tensor: torch.Tensor, mappings: list[tuple[int, int, str]]) -> bool:
    """Tell whether every byte of a tensor's memory lies inside one of the mappings."""
    begin = tensor.data_ptr()
    end = begin + tensor.nbytes
    return any(low <= begin and end <= high for low, high, _ in mappings)


def nbytes(tensors) -> int:
    """Return the bytes the tensors' elements take."""
    return sum(tensor.nbytes for tensor in tensors)


def test_model_weights_are_mapped_from_the_file(engine):
    """The weights are views of the mapped files (the checkpoint and the int8 conversion), not private copies.

    Only the float32 biases and the rotary frequencies are the worker's own: well under 1% of the bytes.
    """
    assert engine.settings.dtype == "int8"
    checkpoint = file_mappings(engine.model_dir / "model.safetensors")
    converted = file_mappings(engine.facts.converted_weights)
    assert checkpoint and converted
    parameters = dict(engine.model.named_parameters())
    buffers = dict(engine.model.named_buffers())
    assert "model.embed_tokens.weight" in parameters and "lm_head.qweight" in buffers
    assert [name for name, tensor in parameters.items() if not lies_in(tensor, checkpoint)] == []
    quantized = {name: tensor for name, tensor in buffers.items() if name.endswith((".qweight", ".qscale"))}
    assert len(quantized) == 2 * (7 * engine.model.config.num_hidden_layers + 1)
    assert [name for name, tensor in quantized.items() if not lies_in(tensor, converted)] == []
    private = [tensor for name, tensor in buffers.items() if name not in quantized]
    assert nbytes(private) < 0.01 * nbytes([*parameters.values(), *quantized.values()])
    assert engine.facts.load_seconds >= 0
    assert len(engine.fingerprint) == 16


def test_weight_format_is_part_of_the_fingerprint(make_settings, engine):
    """int8 and bfloat16 replies differ, so hosts serving them must not share cached replies."""
    assert engine.settings.dtype == "int8"
    with started_engine(make_settings(dtype="bfloat16", max_model_len=256)) as exact:
        assert exact.fingerprint != engine.fingerprint
        # int8 Linear weights are buffers, not parameters: the count must still be the model's.
        assert engine.facts.parameters == exact.facts.parameters > 0


def test_kernel_path_avx2_serves_the_same_replies_on_the_avx2_kernels(make_settings, engine):
    """KERNEL_PATH=avx2 on an AVX-512 CPU runs what an AVX2-only CPU runs; every path gives the same bits."""
    params = SamplingParams(max_tokens=12, temperature=0)
    try:
        with started_engine(make_settings(max_model_len=256, kernel_path="avx2")) as on_avx2:
            assert on_avx2.facts.kernel_paths == "reference,avx2"
            assert run(on_avx2, params)[0] == run(engine, params)[0]
    finally:
        kernels.use_path("best")


POISONED_WORD = "Hello"


@pytest.fixture(scope="module")
def poisoned_engine(make_settings, tiny_model_dir, tmp_path_factory):
    """Return a started int8 engine on a copy of the tiny model whose embedding of POISONED_WORD is NaN,
    its output layer untied from the embedding so that only a sequence reading that word meets the NaN."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from service.engine.loading import load_tokenizer

    copy = tmp_path_factory.mktemp("poisoned") / "model"
    shutil.copytree(tiny_model_dir, copy, ignore=shutil.ignore_patterns("corechat-*", ".*"))
    config = json.loads((copy / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (copy / "config.json").write_text(json.dumps(config))
    tensors = load_file(copy / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding.clone()
    [poisoned_id] = load_tokenizer(copy).encode(POISONED_WORD)
    embedding[poisoned_id] = float("nan")
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with started_engine(make_settings(model=str(copy), max_model_len=256, prefix_cache_mb=0)) as engine:
        engine.poisoned_id = poisoned_id
        yield engine


def events_of(generation) -> tuple[str, list]:
    """Read a generation to its end; return its text and its events."""
    events = list(generation.events())
    return "".join(event.text for event in events if isinstance(event, TextDelta)), events


def test_a_sequence_whose_numbers_blow_up_fails_alone_instead_of_writing_text(poisoned_engine):
    """NaN activations reach the logits through the int8 kernels and fail the sequence that meets them
    with NonFiniteLogits, in its prompt pass or in a decode step, while a sequence beside it in the
    same batch finishes."""
    engine, poisoned_id = poisoned_engine, poisoned_engine.poisoned_id
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    clean_prompt = [100, 200, 300, 400]
    # The prompt holds the NaN token: its prompt pass fails it.
    in_prompt = engine.submit([100, 200, poisoned_id, 400], greedy)
    beside_prompt = engine.submit(clean_prompt, greedy)
    text, events = events_of(in_prompt)
    assert events[-1] == Failed("generation failed: NonFiniteLogits") and text == ""
    assert events_of(beside_prompt)[1][-1].completion_tokens == 12
    # Biased to pick the NaN token first (from finite logits): the decode step that reads it fails
    # that row alone, greedy or drawn.
    for params in (greedy, SamplingParams(max_tokens=12, temperature=1.0, seed=5)):
        picks_it = engine.submit(clean_prompt, dataclasses.replace(params, logit_bias=((poisoned_id, 100.0),)))
        beside = engine.submit(clean_prompt, dataclasses.replace(params, max_tokens=40))
        _, events = events_of(picks_it)
        assert events[-1] == Failed("generation failed: NonFiniteLogits")
        assert sum(isinstance(event, TextDelta) for event in events) <= 1  # the NaN token's own text, at most
        assert events_of(beside)[1][-1].completion_tokens == 40


def test_a_reply_whose_numbers_blow_up_is_an_error_over_http(make_settings, poisoned_engine):
    """The client gets a 500 internal_error naming the fault, not text; a clean prompt gets its reply."""
    app = create_app(make_settings(model=poisoned_engine.settings.model, max_model_len=256), engine=poisoned_engine)
    client = app.test_client()
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0}
    poisoned = client.post("/v1/chat/completions",
                           json={**body, "messages": [{"role": "user", "content": POISONED_WORD}]},
                           headers={"Cache-Control": "no-store"})
    assert poisoned.status_code == 500
    assert poisoned.json["error"]["code"] == "internal_error"
    assert "NonFiniteLogits" in poisoned.json["error"]["message"]
    clean = client.post("/v1/chat/completions",
                        json={**body, "messages": [{"role": "user", "content": "Good morning"}]},
                        headers={"Cache-Control": "no-store"})
    assert clean.status_code == 200 and clean.json["choices"][0]["message"]["content"]


def test_stopping_the_engine_ends_queued_and_running_generations(make_settings):
    """Every request gets a last event when the engine stops, so no request thread waits forever."""
    engine = Engine(make_settings(max_running=1))
    engine.start()
    assert engine.wait_ready(60)
    ids = engine.template.encode(engine.template.render(PROMPT))
    running = engine.submit(ids, SamplingParams(max_tokens=100_000, temperature=0.0))
    assert isinstance(running.next_event(timeout=30), Started)
    queued = engine.submit(ids, SamplingParams(max_tokens=5, temperature=0.0))
    engine.stop()
    running_last = list(running.events())[-1]
    queued_last = queued.next_event(timeout=5)
    assert isinstance(running_last, Finished) and running_last.finish_reason == "cancelled"
    assert isinstance(queued_last, Failed) and "shutting down" in queued_last.message


def submit_until_refused(engine, ids, accepted: list) -> None:
    """Submit one-token generations as fast as possible until the engine refuses them."""
    while True:
        try:
            accepted.append(engine.submit(ids, SamplingParams(max_tokens=1, temperature=0.0)))
        except EngineOverloaded:
            continue
        except EngineUnavailable:
            return


@pytest.mark.parametrize("started", [True, False], ids=["engine-thread-running", "never-started"])
def test_requests_submitted_while_the_engine_stops_all_get_a_last_event(make_settings, started):
    """Submit from several threads across stop(); every accepted request must still end.

    Each queueing is delayed so that the submitters sit between submit's check and its put when
    stop() comes, and a put that finds the engine stopping waits for the engine thread to end
    first (2 s at most): the window of the race, microseconds in production, made certain.
    """
    engine = Engine(make_settings())
    if started:
        engine.start()
        assert engine.wait_ready(60)
    put_now = engine._pending.put_nowait

    def put_late(generation):
        """Queue after a pause; once stop() came, only after the engine thread ended (or 2 s)."""
        time.sleep(0.01)
        if engine._stopping.is_set() and engine._thread is not None:
            engine._thread.join(2)
        put_now(generation)

    engine._pending.put_nowait = put_late
    accepted: list = []
    submitters = [threading.Thread(target=submit_until_refused, args=(engine, [1, 2, 3], accepted)) for _ in range(6)]
    for submitter in submitters:
        submitter.start()
    time.sleep(0.5)
    engine.stop()
    for submitter in submitters:
        submitter.join(10)
    assert accepted and not any(submitter.is_alive() for submitter in submitters)
    deadline = time.monotonic() + 10
    without_last_event = [generation for generation in accepted if not ends_before(generation, deadline)]
    assert not without_last_event, f"{len(without_last_event)} of {len(accepted)} requests never ended"


def ends_before(generation, deadline: float) -> bool:
    """Tell whether a generation delivers its last event before a monotonic deadline."""
    while (event := generation.next_event(timeout=max(0.0, deadline - time.monotonic()))) is not None:
        if isinstance(event, (Finished, Failed)):
            return True
    return False


def test_readyz_answers_while_the_engine_thread_adds_facts(make_settings):
    """/readyz renders a snapshot of the facts the engine thread keeps changing, never a 500.

    A thread stands in for the engine thread here, setting and clearing facts much faster than the
    engine does (a fact appears the first time it is known, such as a prefix-cache hit).
    """
    engine = Engine(make_settings())
    client = create_app(make_settings(), engine=engine).test_client()
    churning = threading.Event()

    def churn_facts():
        """Set and clear facts until told to stop."""
        while not churning.is_set():
            for count in range(200):
                engine.facts.update(prefix_cache_hits=count, largest_batch=count)
            engine.facts.update(prefix_cache_hits=None, largest_batch=None)

    churner = threading.Thread(target=churn_facts)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    churner.start()
    try:
        deadline = time.monotonic() + 3
        statuses = set()
        while time.monotonic() < deadline:
            statuses.add(client.get("/readyz").status_code)
    finally:
        churning.set()
        churner.join()
        sys.setswitchinterval(interval)
    assert statuses == {503}  # not started: not ready, and never a 500


@pytest.fixture(scope="module")
def exact_engine(make_settings):
    """An engine in float32 throughout, where a prompt pass and a decode step give the same logits
    to within rounding far below what moves a draw of the tiny model."""
    with started_engine(make_settings(max_model_len=256, dtype="float32")) as exact:
        yield exact


def pieces_of(generation) -> tuple[list[TextDelta], Finished]:
    """Return a generation's text pieces and its last event."""
    events = list(generation.events())
    return [event for event in events if isinstance(event, TextDelta)], events[-1]


def test_a_seeded_reply_continued_from_its_first_tokens_goes_on_as_the_original(exact_engine):
    prompt_ids = exact_engine.template.encode(exact_engine.template.render(PROMPT))
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11)
    original, finished = pieces_of(exact_engine.submit(prompt_ids, params))
    assert finished.finish_reason == "length" and len(original) > 8
    forced = tuple(token for piece in original[:6] for token in piece.token_ids)
    rest, continued = pieces_of(exact_engine.submit(prompt_ids, params, forced))
    assert [piece.token_ids for piece in rest] == [piece.token_ids for piece in original[6:]]
    assert "".join(piece.text for piece in original[:6] + rest) == "".join(piece.text for piece in original)
    assert (continued.prompt_tokens, continued.completion_tokens) == (len(prompt_ids), 40)


def test_a_continuation_sends_only_new_text_and_counts_the_forced_tokens(engine):
    prompt_ids = engine.template.encode(engine.template.render(PROMPT))
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=5)
    original, _ = pieces_of(engine.submit(prompt_ids, params))
    forced = tuple(token for piece in original[:4] for token in piece.token_ids)
    rest, finished = pieces_of(engine.submit(prompt_ids, params, forced))
    assert all(piece.token_ids for piece in rest)
    assert finished.completion_tokens == len(forced) + sum(len(piece.token_ids) for piece in rest)
    assert (finished.finish_reason, finished.completion_tokens) == ("length", 30)
    assert finished.prompt_tokens == len(prompt_ids)


def test_a_continuation_whose_forced_tokens_fill_max_tokens_ends_at_once(engine):
    prompt_ids = engine.template.encode(engine.template.render(PROMPT))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    original, _ = pieces_of(engine.submit(prompt_ids, params))
    forced = tuple(token for piece in original for token in piece.token_ids)
    rest, finished = pieces_of(engine.submit(prompt_ids, params, forced[:6]))
    assert len(forced) == 6
    assert "".join(piece.text for piece in rest) == ""
    assert (finished.finish_reason, finished.completion_tokens) == ("length", 6)
