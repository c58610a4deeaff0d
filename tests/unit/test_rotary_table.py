"""The lean forward's rotary table gives each position the bits the model's rotary module gives it."""

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from service.engine.qwen2 import RotaryTable


def qwen2_rotary(head_dim: int) -> Qwen2RotaryEmbedding:
    config = Qwen2Config(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=32768,
                         rope_theta=1_000_000.0)
    return Qwen2RotaryEmbedding(config)


def llama3_rotary() -> LlamaRotaryEmbedding:
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 2048})
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("rotary", [qwen2_rotary(64), qwen2_rotary(128), qwen2_rotary(16), llama3_rotary()],
                         ids=["qwen2-64", "qwen2-128", "qwen2-16", "llama3"])
@pytest.mark.parametrize("count", [1, 3, 128])
def test_table_rows_are_the_modules_bits_at_every_position_and_batch(rotary, count):
    """Positions in any order and batch, across the table's chunks and as it grows, on the first and the
    last position of a chunk: the rows equal the module's own output for those positions, bit for bit."""
    table = RotaryTable(rotary, torch.bfloat16)
    assert table.tabled
    hidden = torch.zeros(count, 8, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(count)
    edges = [0, RotaryTable.CHUNK - 1, RotaryTable.CHUNK, 3 * RotaryTable.CHUNK + 5]
    for top in (40, 700, 4000):
        positions = torch.randint(0, top, (count,), generator=generator)
        positions[: min(count, len(edges))] = torch.tensor(edges[: min(count, len(edges))]).clamp(max=top - 1)
        for last in (None, int(positions.max())):
            cos, sin = table.rows(hidden, positions, last)
            expected_cos, expected_sin = rotary(hidden, positions.unsqueeze(0))
            assert cos.is_contiguous() and sin.is_contiguous()
            assert torch.equal(cos, expected_cos[0]) and torch.equal(sin, expected_sin[0])
    assert table.cos.shape[0] % RotaryTable.CHUNK == 0


def test_a_rotary_whose_frequencies_follow_the_length_is_run_every_forward():
    """Dynamic scaling changes the frequencies past the trained length: no table then, the module's output."""
    config = Qwen2Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024,
                         rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    rotary = Qwen2RotaryEmbedding(config)
    table = RotaryTable(rotary, torch.bfloat16)
    assert not table.tabled
    hidden = torch.zeros(2, 8, dtype=torch.bfloat16)
    positions = torch.tensor([3, 3000])
    cos, sin = table.rows(hidden, positions)
    expected_cos, expected_sin = rotary(hidden, positions.unsqueeze(0))
    assert torch.equal(cos, expected_cos[0]) and torch.equal(sin, expected_sin[0])
    assert table.cos is None
