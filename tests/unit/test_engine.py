"""The engine's pure parts: the model fingerprint, and each sampled draw depending on the seed and the
position alone."""

import torch

from service.engine import SamplingParams


def test_fingerprint_survives_a_copy_and_changes_with_retrained_weights(tiny_model_dir, tmp_path):
    import shutil

    from service.engine.loading import load_tokenizer, model_fingerprint

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    tokenizer = load_tokenizer(copy)
    hashes = tmp_path / "hashes"
    assert model_fingerprint(copy, tokenizer, hashes) == model_fingerprint(tiny_model_dir, tokenizer, hashes)
    data = (copy / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    retrained = data[:header_end] + bytes(byte ^ 1 for byte in data[header_end:])
    (copy / "model.safetensors").write_bytes(retrained)
    assert model_fingerprint(copy, tokenizer, hashes) != model_fingerprint(tiny_model_dir, tokenizer, hashes)


# Continuations: a reply resumed from its first tokens, as a cache takeover does -------------


def test_each_draw_depends_on_the_seed_and_position_alone():
    from service.engine.sampling import Sampler, sample_tokens

    logits = [torch.randn(1000, generator=torch.Generator().manual_seed(row)) for row in range(20)]

    def draws(seed: int, history: list[int]) -> list[int]:
        """Return the tokens a sampler at position len(history) draws from each of the logits."""
        chosen = []
        for row in logits:
            sampler = Sampler(SamplingParams(max_tokens=100, temperature=1.0, seed=seed), 1000)
            for token_id in history:
                sampler.record(token_id)
            chosen.append(sample_tokens([sampler], row[None])[0])
        return chosen

    at_five = draws(7, [1, 2, 3, 4, 5])
    # Other tokens before, the same position: the same draws (no state carried from earlier draws).
    assert draws(7, [9, 9, 9, 9, 9]) == at_five
    assert draws(7, [1, 2, 3, 4, 5, 6]) != at_five
    assert draws(8, [1, 2, 3, 4, 5]) != at_five
