"""The batched sampler keeps exactly the top-k/top-p tokens, draws by them, and never looks across rows."""

import collections

import pytest
import torch

from service.engine.draws import CANDIDATES, kept_floors
from service.engine.logprobs import prompt_token_logprobs, token_logprobs
from service.engine.sampling import (
    GREEDY_BELOW_TEMPERATURE,
    NO_TOKEN,
    SEEN_CAPACITY,
    NonFiniteLogits,
    Sampler,
    SamplingParams,
    biased,
    choice_seed,
    penalized,
    sample_tokens,
)

VOCAB = 5000
TOP_K = [0, 1, 5, 50, CANDIDATES, 300, 4999]
TOP_P = [1.0, 0.9, 0.5, 0.99, 0.99999999, 1e-300, 5e-324, 0.0]


def sorted_floor(probabilities: torch.Tensor, top_k: int, top_p: float) -> float:
    """Return the smallest kept probability by the definition, over the whole sorted row."""
    ordered = torch.sort(probabilities.double(), descending=True).values
    floor = float(ordered[top_k - 1]) if top_k else 0.0
    if top_p >= 1.0:
        return floor
    # Tokens of probability 0 are never drawn: whether the floor reaches them does not matter.
    kept_by_k = ordered[(ordered >= floor) & (ordered > 0)]
    total = float(kept_by_k.sum()) if top_k else 1.0
    before = torch.cat([torch.zeros(1, dtype=torch.float64), kept_by_k.cumsum(0)[:-1]])
    return float(kept_by_k[max(1, int((before < top_p * total).sum())) - 1])


def rows_of_every_shape(count: int) -> torch.Tensor:
    """Return softmax rows from flat to peaked, a third rounded to bfloat16 so equal probabilities abound."""
    generator = torch.Generator().manual_seed(5)
    rows = []
    for row in range(count):
        logits = torch.randn(VOCAB, generator=generator) * [0.3, 1.0, 5.0, 20.0][row % 4]
        rows.append(logits.bfloat16().float() if row % 3 == 0 else logits)
    return torch.softmax(torch.stack(rows), dim=-1)


@pytest.mark.parametrize("top_k", TOP_K)
def test_kept_tokens_are_those_a_sort_of_the_whole_row_keeps(top_k):
    """The kept set found by buckets of the whole row agrees with the definition computed over a sorted
    row, for flat, peaked and tied rows and every top_p edge."""
    probabilities = rows_of_every_shape(12)
    for top_p in TOP_P:
        if not top_k and top_p >= 1.0:
            continue
        want = [sorted_floor(row, top_k, top_p) for row in probabilities]
        whole = kept_floors(probabilities, [top_k] * len(want), [top_p] * len(want))
        assert whole.tolist() == want, top_p


def mixed_samplers() -> list[Sampler]:
    """Return samplers of every kind a batch can mix, some with tokens already counted for penalties."""
    params = [
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=1),
        SamplingParams(max_tokens=9, temperature=0.7, top_p=0.8, top_k=20, seed=2),
        SamplingParams(max_tokens=9, temperature=1.3, seed=3),
        SamplingParams(max_tokens=9, temperature=1.0, top_k=400, seed=4),
        SamplingParams(max_tokens=9, temperature=0.9, frequency_penalty=1.5, presence_penalty=0.5, seed=5),
        SamplingParams(max_tokens=9, temperature=GREEDY_BELOW_TEMPERATURE, top_p=0.5, seed=6),
        SamplingParams(max_tokens=9, temperature=1.0, top_p=5e-324, seed=7),
    ]
    samplers = [Sampler(each, VOCAB) for each in params]
    for sampler in samplers:
        for token_id in (3, 3, 17):
            sampler.record(token_id)
    return samplers


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_token_is_the_same_alone_and_in_any_batch(threads):
    """Greedy, nucleus, top-k, penalised and plain rows each take the same token alone, in every
    batch of 2, 5 and 8 rows and in any order, with one thread or two."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits = torch.log(rows_of_every_shape(8)) + torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(9))
        samplers = mixed_samplers()
        alone = [sample_tokens([sampler], row[None])[0] for sampler, row in zip(samplers, logits)]
        for size in (2, 5, 8):
            for rows in (list(range(size)), list(range(8 - size, 8))[::-1]):
                together = sample_tokens([samplers[row] for row in rows], logits[rows])
                assert together == [alone[row] for row in rows], (size, rows)
    finally:
        torch.set_num_threads(before)


def test_draws_follow_the_kept_probabilities_and_never_leave_the_kept_set():
    """Over many positions of one seed the draws match the renormalised kept probabilities."""
    probabilities = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = torch.log(probabilities)
    # top_p 0.8 keeps the tokens with less than 0.8 before them: 0.4, 0.25 and 0.15 (0.8 before 0.1).
    samplers = [Sampler(SamplingParams(max_tokens=1, temperature=1.0, top_p=0.8, seed=42), 6) for _ in range(20_000)]
    for position, sampler in enumerate(samplers):
        sampler.position = position
    draws = collections.Counter(sample_tokens(samplers, logits.expand(len(samplers), -1).contiguous()))
    assert set(draws) == {0, 1, 2}
    for token, share in ((0, 0.4 / 0.8), (1, 0.25 / 0.8), (2, 0.15 / 0.8)):
        assert abs(draws[token] / 20_000 - share) < 0.015, draws


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=1, temperature=GREEDY_BELOW_TEMPERATURE, seed=1),
    SamplingParams(max_tokens=1, temperature=1.0, top_p=1e-300, seed=1),
    SamplingParams(max_tokens=1, temperature=1.0, top_p=5e-324, seed=1),
    SamplingParams(max_tokens=1, temperature=1.0, top_p=0.0, seed=1),
], ids=["smallest-normal-temperature", "top_p-1e-300", "top_p-5e-324", "top_p-0"])
def test_extreme_parameters_take_the_most_likely_token(params):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    for position in range(20):
        samplers = [Sampler(params, VOCAB) for _ in range(3)]
        for sampler in samplers:
            sampler.position = position
        assert sample_tokens(samplers, logits) == torch.argmax(logits, dim=-1).tolist()


def test_penalties_lower_the_tokens_a_reply_already_holds():
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 7] = 3.0, 2.0
    sampler = Sampler(SamplingParams(max_tokens=5, temperature=0.0, frequency_penalty=1.5), 10)
    assert sample_tokens([sampler], logits) == [4]
    sampler.record(4)
    assert sample_tokens([sampler], logits) == [7]
    assert logits[0, 4] == 3.0  # the caller's logits are left as they were


def test_logit_bias_is_added_to_its_own_row_alone_in_one_batch():
    torch.manual_seed(3)
    logits = torch.randn(4, 10).bfloat16()
    biases = [((2, 100.0), (5, -0.5)), (), ((0, -100.0),), ((2, 1.25), (9, 7.0))]
    samplers = [Sampler(SamplingParams(max_tokens=1, temperature=0.0, logit_bias=bias), 10) for bias in biases]
    expected = logits.float().clone()
    for row, bias in enumerate(biases):
        for token, value in bias:
            expected[row, token] += value
    assert torch.equal(biased(samplers, logits), expected)
    assert sample_tokens(samplers, biased(samplers, logits))[0] == 2
    unbiased = logits[1:2]
    assert biased(samplers[1:2], unbiased) is unbiased  # no row with a bias: no copy


@pytest.mark.parametrize("width", [10, 151_936], ids=["10", "vocabulary"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "drawn"])
def test_a_row_with_non_finite_logits_gets_no_token_and_fails_alone(temperature, width):
    """A NaN anywhere in a row (first, within, last: the vectorized loops' head, body and tail), an
    infinite largest logit, or every logit forbidden (-inf) gives that row no token (argmax would take
    the NaN's index): its sampler raises NonFiniteLogits when the scheduler records the token, and the
    other rows, one with forbidden (-inf) tokens among them, take the tokens they take alone."""
    logits = torch.randn(7, width, generator=torch.Generator().manual_seed(3))
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, :5] = float("-inf")
    logits[4, 0] = float("nan")
    logits[5, -1] = float("nan")
    logits[6] = float("-inf")
    failing = (1, 2, 4, 5, 6)

    def samplers(count: int) -> list[Sampler]:
        return [Sampler(SamplingParams(max_tokens=2, temperature=temperature, seed=1), width) for _ in range(count)]

    rows = samplers(7)
    tokens = sample_tokens(rows, logits)
    assert [tokens[row] for row in failing] == [NO_TOKEN] * len(failing)
    assert [tokens[0], tokens[3]] == [sample_tokens(samplers(1), logits[row:row + 1])[0] for row in (0, 3)]
    for row in failing:
        with pytest.raises(NonFiniteLogits, match="not finite"):
            rows[row].record(tokens[row])
    rows[0].record(tokens[0])
    assert rows[0].position == 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.5]])
    sampler = Sampler(SamplingParams(max_tokens=5, temperature=0.0, repetition_penalty=2.0), 5, prompt_ids=[0, 1, 0])
    assert penalized([sampler], logits).tolist() == [[1.0, -4.0, 2.0, -2.0, 1.5]]  # transformers' rule
    sampler.record(2)
    assert penalized([sampler], logits).tolist() == [[1.0, -4.0, 1.0, -2.0, 1.5]]
    assert logits.tolist() == [[2.0, -2.0, 2.0, -2.0, 1.5]]  # the caller's logits are left as they were
    # Greedy takes the unseen token 4 once both 2.0s are halved.
    assert sample_tokens([sampler], logits) == [4]


@pytest.mark.parametrize("prompt_ids", [[], list(range(SEEN_CAPACITY - 1)), list(range(SEEN_CAPACITY)),
                                       list(range(3 * SEEN_CAPACITY + 1)) * 2])
def test_the_seen_tokens_grow_past_their_first_room_and_stay_each_once_in_order(prompt_ids):
    vocab = 8 * SEEN_CAPACITY
    params = SamplingParams(max_tokens=5, temperature=0.0, repetition_penalty=2.0)
    sampler = Sampler(params, vocab, prompt_ids=prompt_ids)
    replied = [vocab - 1 - index for index in range(2 * SEEN_CAPACITY + 3)] + [0, vocab - 1, vocab + 5]
    for token in replied:
        sampler.record(token)  # repeats and ids beyond the vocabulary add nothing
    expected = list(dict.fromkeys(token for token in prompt_ids + replied if token < vocab))
    assert sampler.seen_ids[: sampler.seen_count].tolist() == expected
    logits = torch.full((1, vocab), 2.0)
    seen = set(expected)
    assert penalized([sampler], logits)[0].tolist() == [1.0 if token in seen else 2.0 for token in range(vocab)]


def test_logprobs_are_of_the_penalized_logits_over_the_temperature_before_top_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[2, 10:] = float("-inf")  # a grammar's mask: only ten tokens allowed
    params = [SamplingParams(max_tokens=1, temperature=0.5, top_k=3, seed=1, logprobs=True, top_logprobs=5,
                             repetition_penalty=1.3),
              SamplingParams(max_tokens=1, temperature=0.0, logprobs=False),
              SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=20)]
    samplers = [Sampler(each, 50, prompt_ids=[1, 2, 3]) for each in params]
    tokens = sample_tokens(samplers, logits)
    entries = token_logprobs(samplers, logits, tokens)
    expected = torch.log_softmax(penalized(samplers[:1], logits[:1])[0] / 0.5, dim=-1)
    assert entries[0].logprob == pytest.approx(float(expected[tokens[0]]), abs=1e-5)
    assert [token for token, _ in entries[0].top] == torch.topk(expected, 5).indices.tolist()
    assert entries[1] is None
    greedy = torch.log_softmax(penalized(samplers[2:], logits[2:])[0], dim=-1)  # greedy: temperature 1
    assert entries[2].top[0] == (tokens[2], pytest.approx(float(greedy[tokens[2]]), abs=1e-5))
    assert len(entries[2].top) == 10, "forbidden tokens are no alternatives"


def test_the_first_choice_keeps_the_seed_and_every_other_gets_its_own():
    seeds = [choice_seed(1234, index) for index in range(8)]
    assert seeds[0] == 1234 and len(set(seeds)) == 8
    assert seeds == [choice_seed(1234, index) for index in range(8)]
    assert all(0 <= seed < 2**63 for seed in seeds[1:])
    assert choice_seed(-5, 0) == -5 and choice_seed(-5, 1) != choice_seed(5, 1)


def test_prompt_token_logprobs_are_the_raw_distributions_of_the_next_tokens_with_their_most_likely():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator) * 3
    next_ids = [7, 3, 49]
    scored = prompt_token_logprobs(logits, next_ids, top=2)
    expected = torch.log_softmax(logits, dim=-1)
    assert len(scored) == 3  # the last row predicts a token past the prompt: not scored
    for row, (token, entry) in enumerate(zip(next_ids, scored)):
        assert entry.logprob == pytest.approx(float(expected[row, token]), abs=1e-6)
        best = torch.topk(expected[row], 2)
        assert [token for token, _ in entry.top] == best.indices.tolist()
        assert [value for _, value in entry.top] == pytest.approx(best.values.tolist(), abs=1e-6)
    assert all(entry.top == () for entry in prompt_token_logprobs(logits, next_ids, top=0))


FLOAT32 = torch.finfo(torch.float32)
# Zeros, the smallest subnormal, the largest subnormal and the smallest normal, the bounds and next to them.
BELOW_MAX = float(torch.nextafter(torch.tensor(FLOAT32.max), torch.tensor(0.0)))
EXTREMES = [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, -1.1754942e-38, FLOAT32.tiny, FLOAT32.max, -FLOAT32.max, BELOW_MAX,
            float("inf"), float("-inf"), 1.0, -1.0]


@pytest.mark.parametrize("penalty", [1.05, 2.0, 1.0000001, 7e-39, 3.0e38, 0.5, 1.0])
def test_the_penalty_operator_gives_the_bits_of_transformers_rule_in_float32(penalty):
    """The repetition penalty's one operator lowers each seen logit as torch's where(value < 0, value *
    penalty, value / penalty) does in float32, bit for bit: zeros of both signs, subnormals, the float32
    bounds and next to them, infinities; unseen logits and the caller's tensor stay as they were."""
    vocab = 4096
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(5)) * 1e3
    logits[1, : len(EXTREMES)] = torch.tensor(EXTREMES)
    others = torch.randperm(vocab - 64, generator=torch.Generator().manual_seed(6))[:200] + 64
    seen = torch.cat([torch.arange(len(EXTREMES)), others])
    before = logits.clone()
    lowered = torch.ops.corechat.repetition_penalized(logits, [seen], [seen.numel()], [1], [penalty])
    values = before[1, seen]
    expected = before.clone()
    expected[1, seen] = torch.where(values < 0, values * penalty, values / penalty)
    assert torch.equal(lowered.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(logits.view(torch.int32), before.view(torch.int32))


def test_the_penalty_operator_refuses_what_does_not_fit_its_logits():
    logits = torch.zeros(2, 10)
    ids = torch.tensor([1, 2])
    penalize = torch.ops.corechat.repetition_penalized
    for seen, counts, rows, message in (([ids], [2], [2], "not one of"), ([ids], [3], [0], "past the seen"),
                                        ([torch.tensor([10])], [1], [0], "outside the vocabulary"),
                                        ([ids.int()], [2], [0], "int64"), ([ids], [2, 1], [0], "one seen list")):
        with pytest.raises(RuntimeError, match=message):
            penalize(logits, seen, counts, rows, [1.5])
    assert penalize(logits, [ids], [0], [0], [1.5]).equal(logits)  # no id counted: nothing moves


@pytest.mark.parametrize("width", [1, 7, 8, 9, 16, 17, 151_936])
def test_finite_rows_tells_what_torch_tells_of_each_rows_largest(width):
    """finite_rows is torch.isfinite(logits.amax(-1)) for a NaN or an infinity at every place of the
    vectorized loop (first, inside, the tail), every value -inf, and the float32 bounds."""
    cases = []
    for place in sorted({0, width // 2, width - 1}):
        for value in (float("nan"), float("inf"), FLOAT32.max, -FLOAT32.max):
            row = torch.randn(width, generator=torch.Generator().manual_seed(place))
            row[place] = value
            cases.append(row)
    cases.append(torch.full((width,), float("-inf")))
    last = torch.full((width,), float("-inf"))
    last[-1] = -FLOAT32.max
    cases.append(last)
    logits = torch.stack(cases)
    expected = [int(finite) for finite in torch.isfinite(logits.amax(-1)).tolist()]
    assert torch.ops.corechat.finite_rows(logits) == expected
