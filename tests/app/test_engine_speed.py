"""Prefix reuse and batched decoding change how fast the engine is, never what it generates."""

import os
import threading

import pytest

from service.engine import Engine, Finished, SamplingParams, TextDelta
from tests.support import started_engine

SYSTEM = "You are a terse assistant. " * 20
QUESTIONS = ["What is a prime?", "Name a colour.", "Count to three.", "Why is water wet?"]


def run_to_end(engine: Engine, prompt_ids: list[int], max_tokens: int = 12) -> tuple[str, Finished]:
    """Generate greedily and return the text and the final event."""
    generation = engine.submit(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    text, finished = [], None
    for event in generation.events():
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None, "the generation failed"
    return "".join(text), finished


def prompt_of(engine: Engine, question: str) -> list[int]:
    """Encode a chat with the shared system prompt and one question."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return engine.template.encode(engine.template.render(messages))


def float32_settings(make_settings, **overrides):
    """Return settings of a float32 engine on the tiny model (float32: exact comparisons do not hinge on bf16
    rounding)."""
    return make_settings(**{"dtype": "float32", "max_model_len": 1024, **overrides})


@pytest.fixture(scope="module")
def plain_engine(make_settings):
    """An engine without prefix reuse that runs one sequence at a time."""
    with started_engine(float32_settings(make_settings, prefix_cache_mb=0, max_running=1)) as engine:
        yield engine


@pytest.fixture(scope="module")
def fast_engine(make_settings):
    """An engine with prefix reuse and batches of up to four sequences."""
    with started_engine(float32_settings(make_settings, prefix_cache_mb=64, max_running=4)) as engine:
        yield engine


def test_prefix_reuse_processes_only_new_tokens_and_keeps_output_identical(plain_engine, fast_engine):
    """A second prompt sharing the system prompt reuses its KV state and generates the same text."""
    first, second = prompt_of(fast_engine, QUESTIONS[0]), prompt_of(fast_engine, QUESTIONS[1])
    shared = next(index for index, (a, b) in enumerate(zip(first, second)) if a != b)
    text_cold, finished_cold = run_to_end(fast_engine, first)
    text_warm, finished_warm = run_to_end(fast_engine, second)
    assert finished_cold.cached_prompt_tokens == 0
    assert finished_warm.cached_prompt_tokens == shared
    assert text_warm == run_to_end(plain_engine, second)[0]
    assert text_cold == run_to_end(plain_engine, first)[0]


def test_repeated_prompt_reuses_all_but_its_last_token(fast_engine):
    """The same prompt again processes only its last token, and does not corrupt the stored prefix."""
    prompt = prompt_of(fast_engine, QUESTIONS[2])
    first_text, _ = run_to_end(fast_engine, prompt)
    again_text, again = run_to_end(fast_engine, prompt)
    third_text, _ = run_to_end(fast_engine, prompt)
    assert again.cached_prompt_tokens == len(prompt) - 1
    assert first_text == again_text == third_text


def test_concurrent_sequences_decode_in_one_batch_with_unbatched_results(plain_engine, fast_engine):
    """Four streams at once share forward passes and each gets what it gets alone."""
    prompts = [fast_engine.template.encode(fast_engine.template.render([{"role": "user", "content": q * (i + 1)}]))
               for i, q in enumerate(QUESTIONS)]
    alone = [run_to_end(plain_engine, prompt, max_tokens=16)[0] for prompt in prompts]
    together: list[str | None] = [None] * len(prompts)

    def generate(index: int) -> None:
        together[index] = run_to_end(fast_engine, prompts[index], max_tokens=16)[0]

    threads = [threading.Thread(target=generate, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert together == alone
    assert fast_engine.facts.largest_batch >= 2


def test_prompt_processed_in_chunks_generates_what_one_pass_generates(plain_engine, make_settings):
    """Cutting a prompt into chunks of 16 tokens changes when its work happens, not its reply."""
    with started_engine(float32_settings(make_settings, prefix_cache_mb=0, prefill_chunk_tokens=16)) as chunked:
        prompt = prompt_of(chunked, QUESTIONS[3])
        assert len(prompt) > 5 * 16
        assert run_to_end(chunked, prompt, max_tokens=16)[0] == run_to_end(plain_engine, prompt, max_tokens=16)[0]


def test_running_stream_keeps_decoding_while_a_long_prompt_is_processed(make_settings, monkeypatch):
    """A long prompt arriving is processed one chunk per decode step, so a running stream is not stalled."""
    from service.engine import Generation, Started

    chunk = 16
    with started_engine(float32_settings(make_settings, prefix_cache_mb=0, prefill_chunk_tokens=chunk)) as engine:
        sent = []  # (generation, event), in the order the engine thread sends them
        original_send = Generation.send
        monkeypatch.setattr(Generation, "send",
                            lambda self, event: (sent.append((self, event)), original_send(self, event))[1])
        running = engine.submit(prompt_of(engine, QUESTIONS[0]), SamplingParams(max_tokens=100_000, temperature=0.0))
        assert isinstance(running.next_event(timeout=30), Started)
        assert running.next_event(timeout=30) is not None  # decoding
        long_prompt = engine.template.encode(engine.template.render([{"role": "user", "content": SYSTEM * 3}]))
        chunks = -(-len(long_prompt) // chunk)
        assert chunks >= 20
        _, finished = run_to_end(engine, long_prompt, max_tokens=1)
        running.cancel()
        order = [(generation is running, type(event).__name__) for generation, event in list(sent)]
        long_started = order.index((False, "Started"))
        long_first = next(index for index, item in enumerate(order)
                          if item[0] is False and item[1] in ("TextDelta", "Finished"))
        deltas_between = sum(1 for item in order[long_started:long_first] if item == (True, "TextDelta"))
        # One decode step after each chunk but the last; a few deltas may be held back (partial characters).
        assert deltas_between >= (chunks - 1) // 2, (chunks, deltas_between)
        assert finished.prompt_tokens == len(long_prompt)


def test_a_long_prompt_is_cut_to_the_stall_while_streams_decode_and_in_whole_chunks_alone(make_settings, monkeypatch):
    """Alone, a long prompt goes in PREFILL_CHUNK_TOKENS chunks; beside a decoding stream, in chunks
    cut to PREFILL_STALL_SECONDS at the measured speed (a stall of a nanosecond: the least, 16)."""
    from service.engine import Started
    from service.engine.prompts import PromptPass

    taken = []
    original = PromptPass.run
    monkeypatch.setattr(PromptPass, "run",
                        lambda self, sequence, tokens: (taken.append(tokens), original(self, sequence, tokens))[1])
    with started_engine(float32_settings(make_settings, prefix_cache_mb=0, prefill_chunk_tokens=128,
                                         prefill_stall_seconds=1e-9)) as engine:
        long_prompt = engine.template.encode(engine.template.render([{"role": "user", "content": SYSTEM * 3}]))
        assert len(long_prompt) > 3 * 128
        run_to_end(engine, long_prompt, max_tokens=1)
        whole, tail = divmod(len(long_prompt), 128)
        assert taken == [128] * whole + ([tail] if tail else [])
        running = engine.submit(prompt_of(engine, QUESTIONS[0]), SamplingParams(max_tokens=100_000, temperature=0.0))
        assert isinstance(running.next_event(timeout=30), Started)
        assert running.next_event(timeout=30) is not None  # decoding
        taken.clear()
        run_to_end(engine, long_prompt, max_tokens=1)
        running.cancel()
        whole, tail = divmod(len(long_prompt), 16)
        assert taken == [16] * whole + ([tail] if tail else [])


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_weights_are_converted_once_into_a_versioned_shared_file_and_generate(make_settings, tmp_path, dtype):
    """DTYPE=int8/int4 writes its converted file once (its name carries the format and its version),
    later engines map it again, and generation works."""
    from service.engine.quantized import FORMAT_VERSION, QuantizedLinear

    with started_engine(float32_settings(make_settings, dtype=dtype, converted_weights_dir=str(tmp_path))) as first:
        converted = first.facts.converted_weights
        assert os.path.basename(converted).startswith(f"corechat-{dtype}-v{FORMAT_VERSION}-")
        written_at = os.stat(converted).st_mtime_ns
    with started_engine(make_settings(dtype=dtype, converted_weights_dir=str(tmp_path), max_model_len=1024)) as engine:
        assert engine.facts.converted_weights == converted
        assert os.stat(converted).st_mtime_ns == written_at
        # The output layer is int8 under int8 and int6 under int4 (converted.format_of), the layers in the DTYPE's.
        assert isinstance(engine.model.lm_head, QuantizedLinear)
        assert engine.model.lm_head.format.name == {"int8": "int8", "int4": "int6"}[dtype]
        assert engine.model.model.layers[0].mlp.down_proj.format.name == dtype
        text, finished = run_to_end(engine, prompt_of(engine, QUESTIONS[0]))
        assert finished.completion_tokens == 12 and finished.finish_reason == "length"


def test_a_converted_file_of_another_format_version_is_never_read(make_settings, tiny_model_dir, tmp_path):
    """A file an older corechat wrote (same fingerprint, unversioned name, another layout) stays unread."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir, ignore=shutil.ignore_patterns("corechat-*"))
    with started_engine(float32_settings(make_settings, model=str(model_dir), dtype="int8")) as engine:
        fingerprint = os.path.basename(engine.facts.converted_weights).removesuffix(".safetensors").rsplit("-", 1)[1]
    for stale in model_dir.glob("corechat-*"):
        stale.unlink()
    (model_dir / f"corechat-int8-{fingerprint}.safetensors").write_bytes(b"not a safetensors file")
    with started_engine(float32_settings(make_settings, model=str(model_dir), dtype="int8")) as engine:
        assert "-v" in os.path.basename(engine.facts.converted_weights)
        text, finished = run_to_end(engine, prompt_of(engine, QUESTIONS[0]))
        assert finished.finish_reason == "length"


def test_workers_converting_at_once_map_one_int8_file(make_settings, tiny_model_dir, tmp_path):
    """Engines starting together convert once and map the same inode (none maps a replaced file)."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir, ignore=shutil.ignore_patterns("corechat-*"))
    engines = [Engine(make_settings(model=str(model_dir), dtype="int8")) for _ in range(2)]
    threads = [threading.Thread(target=engine.start) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert all(engine.wait_ready(120) for engine in engines)
        converted = {engine.facts.converted_weights for engine in engines}
        assert len(converted) == 1
        with open("/proc/self/maps") as maps:
            mappings = [line.split() for line in maps if str(model_dir) in line and "corechat-int8" in line]
        assert mappings and all(len(fields) == 6 for fields in mappings), "a worker maps a replaced (deleted) file"
        assert len({fields[4] for fields in mappings}) == 1
    finally:
        for engine in engines:
            engine.stop()
