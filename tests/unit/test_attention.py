"""The paged attention kernel: softmax attention over a sequence's own pages, the same bits on every
instruction-set path, for a prompt's token and a decode step alike, whatever else shares the call."""

import pytest
import torch

from harness import anonymous_megabytes
from service.engine import kernels
from service.engine.kvpool import PagePool
from service.engine.memory import PAGE_TOKENS, KVBudget
from service.settings import Settings

HEADS, KV_HEADS, DIM, LAYERS = 14, 2, 64, 3


@pytest.fixture(scope="module", autouse=True)
def loaded_kernels():
    """Load (building if needed) this CPU's kernels."""
    kernels.load(Settings().kernels_dir)


def paths() -> list[str]:
    """Return every path this CPU runs attention on, the reference first."""
    return kernels.attention_paths()


def new_pool(pages: int, dim: int = DIM, kv_heads: int = KV_HEADS) -> PagePool:
    """Return a pool of `pages` pages, its storage zeroed (as if written before)."""
    pool = PagePool(KVBudget(pages, PAGE_TOKENS * 2 * LAYERS * kv_heads * dim * 2), (LAYERS, kv_heads, dim))
    pool.storage.zero_()
    return pool


def random(*shape, seed: int) -> torch.Tensor:
    """Return random bfloat16 values."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def attend(pool, query, keys, values, tables, sequences, positions, layer=1, path="best", scale=0.125):
    """Run the kernel: write the rows' keys and values at their positions, then attend."""
    return torch.ops.corechat.paged_attention(
        query, keys, values, pool.storage, layer, tables, torch.tensor(sequences, dtype=torch.long),
        torch.tensor(positions, dtype=torch.long), scale, kernels.PATHS[path])


def expected(query, keys, values, scale=0.125) -> torch.Tensor:
    """One row's attention over keys [tokens, kv_heads, dim] in float64: (heads, dim)."""
    group = query.shape[0] // keys.shape[1]
    rows = []
    for head in range(query.shape[0]):
        weights = torch.softmax(keys[:, head // group].double() @ query[head].double() * scale, dim=0)
        rows.append(weights @ values[:, head // group].double())
    return torch.stack(rows)


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_a_prompts_tokens_attend_causally_to_softmax_attention_within_bfloat16_rounding(dim):
    """A prompt of 300 tokens across pages in shuffled order: token p sees keys 0..p."""
    tokens = 300
    pool = new_pool(8, dim)
    table = torch.randperm(8, generator=torch.Generator().manual_seed(0))[: -(-tokens // PAGE_TOKENS)].unsqueeze(0)
    query = random(tokens, HEADS, dim, seed=1)
    keys, values = random(tokens, KV_HEADS, dim, seed=2), random(tokens, KV_HEADS, dim, seed=3)
    out = attend(pool, query, keys, values, table, [0] * tokens, list(range(tokens)))
    for token in (0, 1, 15, 16, 63, 64, 65, 299):
        want = expected(query[token], keys[: token + 1], values[: token + 1])
        assert torch.allclose(out[token].double(), want, rtol=2e-2, atol=2e-2), token


def test_every_path_gives_the_references_bits():
    """The reference's plain C++, AVX2 and AVX-512 run the same operations in the same order per row."""
    tokens = 200
    results = {}
    for path in paths():
        pool = new_pool(4)
        table = torch.tensor([[3, 0, 2, 1]])
        results[path] = attend(pool, random(tokens, HEADS, DIM, seed=4), random(tokens, KV_HEADS, DIM, seed=5),
                               random(tokens, KV_HEADS, DIM, seed=6), table, [0] * tokens, list(range(tokens)),
                               path=path)
    for path, got in results.items():
        assert torch.equal(got, results["reference"]), path


def test_dot_products_near_and_below_the_smallest_normal_float_give_the_references_bits():
    """Queries and keys whose products and running sums lie around FLT_MIN (2^-126), some of them
    bfloat16 subnormals, and a scale of 2^120 that makes those sums the scores: every path flushes
    as vdpbf16ps does (subnormal inputs as 0, results tiny after rounding to 0), so every path gives
    the reference's bits, and the flushing shows: scores of 2^-130 would weigh the values unevenly."""
    tokens = 70
    generator = torch.Generator().manual_seed(60)
    query = (torch.randn(tokens, HEADS, DIM, generator=generator) * 2.0 ** -63).bfloat16()
    keys = (torch.randn(tokens, KV_HEADS, DIM, generator=generator) * 2.0 ** -63).bfloat16()
    keys[::3, :, ::5] = 2.0 ** -130  # subnormal in bfloat16 and float32: counted as 0
    query[::4, :, 1::7] = -(2.0 ** -128)
    values = random(tokens, KV_HEADS, DIM, seed=61)
    assert (keys.float().abs() < 2.0 ** -126).logical_and(keys != 0).any()
    results = {}
    for path in paths():
        results[path] = attend(new_pool(2), query, keys, values, torch.tensor([[1, 0]]), [0] * tokens,
                               list(range(tokens)), path=path, scale=2.0 ** 120)
    for path, got in results.items():
        assert torch.equal(got, results["reference"]), path
    assert results["reference"].isfinite().all()


def test_what_a_page_holds_past_a_sequences_last_key_never_reaches_its_output():
    """Value slots past an odd count of keys are read beside the last key's (keys go in pairs): a NaN
    left there by an earlier sequence counts as 0."""
    tokens = 37
    inputs = (random(tokens, HEADS, DIM, seed=62), random(tokens, KV_HEADS, DIM, seed=63),
              random(tokens, KV_HEADS, DIM, seed=64))
    for path in paths():
        clean, dirty = new_pool(1), new_pool(1)
        dirty.storage.fill_(float("nan"))
        outputs = [attend(pool, *inputs, torch.tensor([[0]]), [0] * tokens, list(range(tokens)), path=path)
                   for pool in (clean, dirty)]
        assert torch.equal(outputs[0], outputs[1]), path


def test_the_avx512_bf16_path_runs_where_the_cpu_has_the_bfloat16_dot_product():
    has = set(kernels.AVX512_BF16.cpu_flags) <= kernels.cpu_flags()
    assert ("avx512_bf16" in kernels.attention_paths()) == has
    assert "avx512_bf16" not in kernels.available_paths()


def test_a_token_gets_the_same_bits_in_a_prompt_pass_in_chunks_and_as_a_decode_step():
    """Whole, cut in chunks, or one row at a time as decode steps: each token's output is the same bits."""
    tokens = 150
    query = random(tokens, HEADS, DIM, seed=7)
    keys, values = random(tokens, KV_HEADS, DIM, seed=8), random(tokens, KV_HEADS, DIM, seed=9)
    table = torch.tensor([[1, 2, 0]])
    outputs = []
    for cuts in ([0, tokens], [0, 16, 17, 100, tokens], list(range(tokens + 1))):
        pool = new_pool(3)
        parts = [attend(pool, query[a:b], keys[a:b], values[a:b], table, [0] * (b - a), list(range(a, b)))
                 for a, b in zip(cuts, cuts[1:])]
        outputs.append(torch.cat(parts))
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_a_decode_rows_bits_do_not_depend_on_the_other_rows_of_its_step():
    """Eight sequences of uneven lengths in one step: each row equals its sequence decoded alone."""
    lengths = [300, 1, 17, 250, 64, 129, 8, 123]
    pool = new_pool(64)
    tables = torch.arange(64).view(8, 8)
    for index, length in enumerate(lengths):  # the sequences' earlier tokens, written as prompts
        attend(pool, random(length, HEADS, DIM, seed=index), random(length, KV_HEADS, DIM, seed=10 + index),
               random(length, KV_HEADS, DIM, seed=20 + index), tables, [index] * length, list(range(length)))
    query = random(8, HEADS, DIM, seed=30)
    keys, values = random(8, KV_HEADS, DIM, seed=31), random(8, KV_HEADS, DIM, seed=32)
    together = attend(pool, query, keys, values, tables, list(range(8)), lengths)
    for row, length in enumerate(lengths):
        one = slice(row, row + 1)
        alone = attend(pool, query[one], keys[one], values[one], tables[one], [0], [length])
        assert torch.equal(alone[0], together[row]), row


def test_prompt_rows_of_two_sequences_in_one_call_get_each_prompt_alones_bits():
    """Rows of one sequence are attended together: where one prompt's rows meet another's, each row
    still gets the bits of its prompt attended alone, on every path."""
    lengths = [70, 37]
    query = random(sum(lengths), HEADS, DIM, seed=40)
    keys, values = random(sum(lengths), KV_HEADS, DIM, seed=41), random(sum(lengths), KV_HEADS, DIM, seed=42)
    tables = torch.tensor([[0, 1], [2, 3]])
    sequences = [0] * lengths[0] + [1] * lengths[1]
    positions = list(range(lengths[0])) + list(range(lengths[1]))
    for path in paths():
        together = attend(new_pool(4), query, keys, values, tables, sequences, positions, path=path)
        pool, first = new_pool(4), 0
        for index, length in enumerate(lengths):
            rows = slice(first, first + length)
            alone = attend(pool, query[rows], keys[rows], values[rows], tables[index : index + 1], [0] * length,
                           list(range(length)), path=path)
            assert torch.equal(alone, together[rows]), (path, index)
            first += length


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 1, 64), (9, 3, 64), (6, 2, 128), (3, 1, 16)])
def test_a_long_decode_row_split_over_threads_gets_one_threads_bits(heads, kv_heads, dim):
    """From 1,024 keys a decode row whose (kv head, row) pairs cannot share the threads evenly splits each
    pair's keys and value lanes over them: the same bits with 1 to 4 threads, on every path, just below
    the threshold and past it, for a zero query (every score 0) as for a random one, and a NaN in one head's
    query still gives NaN in that head alone."""
    length = 1500
    pages = -(-(length + 1) // PAGE_TOKENS)
    pool = new_pool(pages + 1, dim, kv_heads)
    table = torch.randperm(pages + 1, generator=torch.Generator().manual_seed(dim))[:pages].unsqueeze(0)
    attend(pool, random(length, heads, dim, seed=60), random(length, kv_heads, dim, seed=61),
           random(length, kv_heads, dim, seed=62), table, [0] * length, list(range(length)))
    nan_query = random(1, heads, dim, seed=63)
    nan_query[0, 0, 3] = float("nan")
    before = torch.get_num_threads()
    try:
        for position in (1022, 1023, length):  # 1,023 keys, then 1,024 (split) and 1,501
            for query in (random(1, heads, dim, seed=position), torch.zeros(1, heads, dim, dtype=torch.bfloat16),
                          nan_query):
                row = (query, random(1, kv_heads, dim, seed=64), random(1, kv_heads, dim, seed=65), table, [0],
                       [position])
                torch.set_num_threads(1)
                one_thread = attend(pool, *row, path="reference")
                bits = one_thread.view(torch.int16)  # NaN's too
                for path in paths():
                    for threads in (1, 2, 3, 4):
                        torch.set_num_threads(threads)
                        got = attend(pool, *row, path=path).view(torch.int16)
                        assert torch.equal(got, bits), (position, path, threads)
            assert one_thread[0, 0].isnan().all() and not one_thread[0, 1:].isnan().any()
    finally:
        torch.set_num_threads(before)


def test_a_nan_in_a_query_gives_nan_not_plausible_output():
    pool = new_pool(1)
    query = random(3, HEADS, DIM, seed=40)
    query[2, 0, 5] = float("nan")
    out = attend(pool, query, random(3, KV_HEADS, DIM, seed=41), random(3, KV_HEADS, DIM, seed=42),
                 torch.tensor([[0]]), [0, 0, 0], [0, 1, 2])
    assert out[2, 0].isnan().all() and not out[:2].isnan().any()


@pytest.mark.parametrize(("change", "message"), [
    ({"positions": [PAGE_TOKENS]}, "outside its table"),
    ({"positions": [-1]}, "outside its table"),
    ({"sequences": [1]}, "names no table"),
    ({"tables": torch.tensor([[5]])}, "names page"),
    ({"tables": torch.tensor([[-1]])}, "names page"),
    ({"layer": LAYERS}, "layer"),
    ({"query": torch.zeros(1, HEADS, 48, dtype=torch.bfloat16)}, "head dim"),
    ({"query": torch.zeros(1, 3, DIM, dtype=torch.bfloat16)}, "multiple of kv_heads"),
    ({"keys": torch.zeros(1, KV_HEADS, DIM)}, "bfloat16"),
    ({"scale": 0.0}, "scale"),
    ({"scale": -0.125}, "scale"),
    ({"scale": float("inf")}, "scale"),
    ({"scale": float("nan")}, "scale"),
    ({"scale": 1e39}, "scale"),
    ({"scale": 1e-46}, "scale"),
])
def test_bad_arguments_raise_instead_of_reading_or_writing_out_of_bounds(change, message):
    pool = new_pool(1)
    arguments = {"query": torch.zeros(1, HEADS, DIM, dtype=torch.bfloat16),
                 "keys": torch.zeros(1, KV_HEADS, DIM, dtype=torch.bfloat16),
                 "values": torch.zeros(1, KV_HEADS, DIM, dtype=torch.bfloat16),
                 "tables": torch.tensor([[0]]), "sequences": [0], "positions": [0], "layer": 1, "scale": 0.125}
    arguments.update(change)
    with pytest.raises(RuntimeError, match=message):
        attend(pool, arguments["query"], arguments["keys"], arguments["values"], arguments["tables"],
               arguments["sequences"], arguments["positions"], layer=arguments["layer"], scale=arguments["scale"])


def test_decoding_at_ever_new_context_lengths_does_not_grow_memory():
    """The kernel's scratch space follows the longest context seen, not every length seen."""
    pool = new_pool(16)
    tables = torch.arange(16).view(1, 16)
    tokens = 800
    attend(pool, random(tokens, HEADS, DIM, seed=50), random(tokens, KV_HEADS, DIM, seed=51),
           random(tokens, KV_HEADS, DIM, seed=52), tables, [0] * tokens, list(range(tokens)))
    before = anonymous_megabytes()
    for position in range(500, 800):
        attend(pool, random(1, HEADS, DIM, seed=position), random(1, KV_HEADS, DIM, seed=1),
               random(1, KV_HEADS, DIM, seed=2),
               tables, [0], [position])
    assert anonymous_megabytes() - before < 10
