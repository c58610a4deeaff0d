"""With int8, int4 and int4m weights a sequence's logits, and so its reply, do not depend on what else its
worker decodes.

A batch-dependent difference is a bfloat16 ulp or so, too little to change the tiny model's sampled
tokens; so these tests compare the logits bit for bit, and the replies byte for byte as well. The
tiny model's layers are too small to show which formats are invariant: torch's bfloat16 products
change with the number of rows only at larger sizes, so the products are also compared at
Qwen2.5-0.5B's own.
"""

import pytest
import torch

from service.engine import Failed, SamplingParams, TextDelta, scheduler, speculation
from tests.support import started_engine

# Prompt lengths of a batch of uneven sequences (the tiny model handles any).
LENGTHS = [37, 300, 5, 120, 600, 64, 9, 200]
STEPS = 6
# The formats whose rows are claimed not to depend on their batch (docs/performance.md): corechat's
# own products. bfloat16 runs torch's, which are not (test_bfloat16_products_depend_on_the_batch_...).
INVARIANT_FORMATS = ["int8", "int4", "int4m"]


@pytest.fixture(scope="module", params=INVARIANT_FORMATS)
def format_engine(request, make_settings):
    """Return a started engine on the tiny model in one weight format."""
    with started_engine(make_settings(dtype=request.param, max_model_len=2048, prefix_cache_mb=0)) as engine:
        yield engine


def random_prompts() -> list[list[int]]:
    """Return token-id prompts of LENGTHS."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(100, 5000, (length,), generator=generator).tolist() for length in LENGTHS]


def decode(runner, prompts: list[list[int]], leave_after: int | None = None) -> list[list[torch.Tensor]]:
    """Process each prompt alone, decode them as one batch for STEPS greedy steps; return each row's logits per step.

    With leave_after, every other row leaves the batch after that many steps (the rest go on).
    """
    kvs, tokens = [], []
    with torch.inference_mode():
        for ids in prompts:
            kv = runner.reserve(len(ids) + STEPS)
            logits = runner.prefill(kv, ids, 1)
            kvs.append(kv)
            tokens.append(int(logits[-1].argmax()))
        rows = list(range(len(prompts)))
        seen = [[] for _ in prompts]
        for step in range(STEPS):
            if step == leave_after:
                leaving = set(range(1, len(rows), 2))
                for index in leaving:
                    runner.release(kvs[index])
                rows = [row for index, row in enumerate(rows) if index not in leaving]
                tokens = [token for index, token in enumerate(tokens) if index not in leaving]
                kvs = [kv for index, kv in enumerate(kvs) if index not in leaving]
            logits = runner.decode(kvs, tokens)
            for index, row in enumerate(rows):
                seen[row].append(logits[index].clone())
            tokens = logits.argmax(-1).tolist()
        for kv in kvs:
            runner.release(kv)
    return seen


def test_a_rows_logits_are_the_same_bits_alone_and_in_batches_of_2_5_and_8(format_engine):
    """Rows of every length, joined in another order and beside others that leave, keep their bits."""
    runner, prompts = format_engine._scheduler.runner, random_prompts()
    alone = [decode(runner, [ids])[0] for ids in prompts]
    for size in (2, 5, 8):
        order = list(range(size))[::-1]
        together = decode(runner, [prompts[row] for row in order], leave_after=2 if size == 8 else None)
        for index, row in enumerate(order):
            for step, logits in enumerate(together[index]):
                assert torch.equal(logits, alone[row][step]), (format_engine.settings.dtype, size, row, step)


def generate(engine, prompts: list[list[int]], params: SamplingParams) -> list[str]:
    """Submit prompts at once and return their replies."""
    generations = [engine.submit(ids, params) for ids in prompts]
    replies = []
    for generation in generations:
        text = ""
        for event in generation.events():
            assert not isinstance(event, Failed), event
            if isinstance(event, TextDelta):
                text += event.text
        replies.append(text)
    return replies


@pytest.fixture()
def recorded_logits(monkeypatch):
    """Record the logits every sampler is given, by sampler, in order (what the engine samples from: a step's
    first rows, and a speculative step's draft rows)."""
    seen: dict[int, list[torch.Tensor]] = {}
    original = scheduler.sample_tokens

    def recording(samplers, logits):
        for sampler, row in zip(samplers, logits, strict=True):
            seen.setdefault(id(sampler), []).append(row.clone())
        return original(samplers, logits)

    monkeypatch.setattr(scheduler, "sample_tokens", recording)
    monkeypatch.setattr(speculation, "sample_tokens", recording)
    return seen


@pytest.mark.parametrize("seed", [None, 1234], ids=["greedy", "seeded"])
def test_engine_replies_alone_equal_replies_in_batches_of_2_5_and_8(make_settings, recorded_logits, seed):
    """Through the real engine with the default shape (MAX_RUNNING 8, chunked prompts, continuous
    batching): each request's reply and every logit it sampled from are the same alone and among
    1, 4 or 7 others."""
    with started_engine(make_settings(max_model_len=2048, prefix_cache_mb=0)) as engine:
        assert engine.settings.max_running >= 8
        prompts = [engine.template.encode(engine.template.render(
            [{"role": "user", "content": "tell me more " * (1 + 37 * i)}]))
                   for i in range(8)]
        params = SamplingParams(max_tokens=24, temperature=0.0 if seed is None else 1.0, seed=seed)
        alone, alone_logits = [], []
        for ids in prompts:
            recorded_logits.clear()
            alone.append(generate(engine, [ids], params)[0])
            alone_logits.append(next(iter(recorded_logits.values())))
        for size in (2, 5, 8):
            recorded_logits.clear()
            together = generate(engine, prompts[:size][::-1], params)[::-1]
            assert together == alone[:size], size
            # Prompts finish their pass shortest first, not in submission order: match each
            # request's logits alone with exactly one sampler's in the batch.
            batched = list(recorded_logits.values())
            assert len(batched) == size
            for want in alone_logits[:size]:
                same = [index for index, got in enumerate(batched)
                        if len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))]
                assert len(same) == 1, size
                batched.pop(same[0])


def test_a_prompt_gives_the_same_logits_whole_chunked_from_a_stored_prefix_and_decoded(format_engine):
    """A token's logits do not depend on how its prompt was cut, on a prefix coming from the store,
    or on its being decoded rather than processed in a prompt pass."""
    runner = format_engine._scheduler.runner
    ids = random_prompts()[3][:100] + random_prompts()[7]

    def last_logits(cuts: list[int], stored: int = 0) -> torch.Tensor:
        """Process the prompt in passes cut at `cuts` (after `stored` tokens taken from the stored
        state of another pass); return the last position's logits."""
        kv, logits = runner.reserve(len(ids)), None
        with torch.inference_mode():
            if stored:
                source = runner.reserve(stored)
                runner.prefill(source, ids[:stored], 1)
                runner.load(kv, [torch.cat(list(pieces)) for pieces in runner.read(source, stored)], stored)
                runner.release(source)
            for begin, end in zip([stored] + cuts, cuts + [len(ids)]):
                logits = runner.prefill(kv, ids[begin:end], 1)[-1]
        runner.release(kv)
        return logits

    whole = last_logits([])
    assert torch.equal(last_logits(list(range(16, len(ids), 16))), whole)
    assert torch.equal(last_logits([200]), whole)
    assert torch.equal(last_logits([], stored=130), whole)
    # The last token decoded after a prompt pass over the others, as in a batch.
    with torch.inference_mode():
        kv = runner.reserve(len(ids))
        runner.prefill(kv, ids[:-1], 1)
        decoded = runner.decode([kv], [ids[-1]])[0]
        runner.release(kv)
    assert torch.equal(decoded, whole)


def test_a_prefix_cache_hit_samples_from_the_same_logits_as_the_cold_pass(make_settings, recorded_logits):
    """The same request again (its prompt's KV from the prefix store) gets the same logits, so the same reply."""
    with started_engine(make_settings(max_model_len=2048, prefix_cache_mb=64)) as engine:
        ids = engine.template.encode(engine.template.render(
            [{"role": "user", "content": "a shared system prompt " * 40}]))
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
        cold = generate(engine, [ids], params)
        cold_logits = list(recorded_logits.values())
        recorded_logits.clear()
        assert generate(engine, [ids], params) == cold
        assert engine.facts.prefix_cache_hits == 1
        hit_logits = list(recorded_logits.values())
        assert all(torch.equal(a, b) for a, b in zip(hit_logits[0], cold_logits[0], strict=True))
