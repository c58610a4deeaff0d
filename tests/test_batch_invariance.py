"""A sequence's logits, and so its reply, do not depend on what else its worker decodes.

The tiny model's logits differ by a bfloat16 ulp or so where numerics depend on the batch, too
little to change its sampled tokens; so these tests compare the logits bit for bit (what the
exact response cache relies on), and the replies byte for byte as well.
"""


import pytest
import torch

from service.engine import Engine, Failed, SamplingParams, TextDelta, scheduler
from service.engine.batching import DecodeBatch
from service.engine.kvcache import new_cache
from support import ready_facts

# Prompt lengths that give a batch wide and uneven left padding (the tiny model handles any).
LENGTHS = [37, 300, 5, 120, 600, 64, 9, 200]
STEPS = 6
INVARIANT_FORMATS = ["int8", "int4", "bfloat16"]


@pytest.fixture(scope="module", params=INVARIANT_FORMATS)
def format_engine(request, make_settings):
    """Return a started engine on the tiny model in one weight format."""
    engine = Engine(make_settings(dtype=request.param, max_model_len=2048, prefix_cache_mb=0))
    engine.start()
    assert engine.wait_ready(300), engine.facts
    yield engine
    engine.stop()


def random_prompts() -> list[list[int]]:
    """Return token-id prompts of LENGTHS."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(100, 5000, (length,), generator=generator).tolist() for length in LENGTHS]


def decode(model, prompts: list[list[int]], leave_after: int | None = None) -> list[list[torch.Tensor]]:
    """Process each prompt alone, decode them as one batch for STEPS greedy steps; return each row's logits per step.

    With leave_after, every other row leaves the batch after that many steps (the rest go on, trimmed).
    """
    caches, tokens = [], []
    with torch.inference_mode():
        for ids in prompts:
            cache = new_cache(model.config)
            logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1).logits
            caches.append(cache)
            tokens.append(int(logits[0, -1].argmax()))
        batch = DecodeBatch(model.config)
        batch.join(caches)
        rows = list(range(len(prompts)))
        seen = [[] for _ in prompts]
        for step in range(STEPS):
            if step == leave_after:
                leaving = list(range(1, len(rows), 2))
                batch.leave(leaving)
                rows = [row for index, row in enumerate(rows) if index not in leaving]
                tokens = [token for index, token in enumerate(tokens) if index not in leaving]
            logits = batch.step(model, tokens)
            for index, row in enumerate(rows):
                seen[row].append(logits[index].clone())
            tokens = logits.argmax(-1).tolist()
    return seen


def test_a_rows_logits_are_the_same_bits_alone_and_in_batches_of_2_5_and_8(format_engine):
    """Rows of every padding, joined in another order and beside others that leave, keep their bits."""
    model, prompts = format_engine.model, random_prompts()
    alone = [decode(model, [ids])[0] for ids in prompts]
    for size in (2, 5, 8):
        order = list(range(size))[::-1]
        together = decode(model, [prompts[row] for row in order], leave_after=2 if size == 8 else None)
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
    """Record the logits every sampler is given, by sampler (what the engine samples from)."""
    seen: dict[int, list[torch.Tensor]] = {}
    original = scheduler.sample_tokens

    def recording(samplers, logits):
        for sampler, row in zip(samplers, logits, strict=True):
            seen.setdefault(id(sampler), []).append(row.clone())
        return original(samplers, logits)

    monkeypatch.setattr(scheduler, "sample_tokens", recording)
    return seen


@pytest.mark.parametrize("seed", [None, 1234], ids=["greedy", "seeded"])
def test_engine_replies_alone_equal_replies_in_batches_of_2_5_and_8(make_settings, recorded_logits, seed):
    """Through the real engine with the default shape (MAX_RUNNING 8, chunked prompts, continuous
    batching): each request's reply and every logit it sampled from are the same alone and among
    1, 4 or 7 others."""
    engine = Engine(make_settings(max_model_len=2048, prefix_cache_mb=0))
    assert engine.settings.max_running >= 8
    engine.start()
    assert engine.wait_ready(300), engine.facts
    try:
        template = engine.template
        prompts = [template.encode(template.render([{"role": "user", "content": "tell me more " * (1 + 37 * i)}]))
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
    finally:
        engine.stop()


def test_a_prompt_gives_the_same_logits_whole_chunked_from_a_stored_prefix_and_decoded(format_engine):
    """A token's logits do not depend on how its prompt was cut, on a prefix coming from the store,
    or on its being decoded rather than processed in a prompt pass."""
    model = format_engine.model
    ids = random_prompts()[3][:100] + random_prompts()[7]

    def last_logits(cuts: list[int]) -> torch.Tensor:
        """Process the prompt in passes cut at `cuts`; return the last position's logits."""
        cache, logits = new_cache(model.config), None
        with torch.inference_mode():
            for begin, end in zip([0] + cuts, cuts + [len(ids)]):
                logits = model(input_ids=torch.tensor([ids[begin:end]]), cache=cache, use_cache=True,
                               logits_to_keep=1).logits[0, -1]
        return logits

    whole = last_logits([])
    assert torch.equal(last_logits(list(range(16, len(ids), 16))), whole)
    assert torch.equal(last_logits([200]), whole)
    # The last token decoded after a prompt pass over the others, as in a batch.
    with torch.inference_mode():
        cache = new_cache(model.config)
        model(input_ids=torch.tensor([ids[:-1]]), cache=cache, use_cache=True, logits_to_keep=1)
    batch = DecodeBatch(model.config)
    batch.join([cache])
    with torch.inference_mode():
        decoded = batch.step(model, [ids[-1]])[0]
    assert torch.equal(decoded, whole)


def test_a_prefix_cache_hit_samples_from_the_same_logits_as_the_cold_pass(make_settings, recorded_logits):
    """The same request again (its prompt's KV from the prefix store) gets the same logits, so the same reply."""
    engine = Engine(make_settings(max_model_len=2048, prefix_cache_mb=64))
    engine.start()
    assert engine.wait_ready(300), engine.facts
    try:
        template = engine.template
        ids = template.encode(template.render([{"role": "user", "content": "a shared system prompt " * 40}]))
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
        cold = generate(engine, [ids], params)
        cold_logits = list(recorded_logits.values())
        recorded_logits.clear()
        assert generate(engine, [ids], params) == cold
        assert engine.facts.prefix_cache_hits == 1
        hit_logits = list(recorded_logits.values())
        assert all(torch.equal(a, b) for a, b in zip(hit_logits[0], cold_logits[0], strict=True))
    finally:
        engine.stop()


def test_replies_over_http_alone_equal_the_same_requests_beyond_capacity(tmp_path_factory):
    """`make serve`'s defaults (int8, one worker per core, MAX_RUNNING, prefix store on): each of
    more requests than the workers can run at once gets, byte for byte, the reply it got alone."""
    import concurrent.futures

    import requests

    from service.settings import Settings
    from support import GunicornServer

    defaults = Settings()
    with GunicornServer(tmp_path_factory.mktemp("invariance"), workers=defaults.worker_count) as server:
        capacity = server.workers * defaults.max_running
        bodies = [{"messages": [{"role": "user", "content": f"request {i}: " + "go on " * (1 + 23 * (i % 5))}],
                   "max_tokens": 16, **({"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i})}
                  for i in range(capacity + 4)]

        def reply(body: dict) -> str:
            response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120,
                                     headers={"Cache-Control": "no-cache", "Connection": "close"})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["message"]["content"]

        alone = [reply(body) for body in bodies]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(reply, bodies))
        largest = max(facts.get("largest_batch", 0) for facts in ready_facts(server).values())
    assert largest == defaults.max_running, "the load did not fill a worker's batch"
    assert together == alone
