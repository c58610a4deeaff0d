"""The real SmolLM2-135M-Instruct (Llama architecture), served from its GGUF file where meaning matters.

float32 runs transformers' forward: its greedy replies must be transformers' `generate`, token for
token. bfloat16, int8, int4 and int4m run the lean forward over corechat's kernels: bfloat16's logits are
transformers' bits given the attention kernel (as test_qwen2.py holds for Qwen2), and every format's
next-token distributions stay within a stated distance of float32's on a real text.
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from service.engine import SamplingParams, TextDelta
from tests.app.test_qwen2 import KERNEL_ATTENTION
from tests.support import started_engine

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "How many legs does a spider have?"]
# A real text the model has likely seen the like of, and that Debian ships.
TEXT = Path("/usr/share/common-licenses/GPL-3")
# The bound on each format's mean KL divergence from float32 over TEXT's first two windows, and on the
# share of positions whose most likely next token differs from float32's. Each measures the same on
# every run (bench/quality.py has the figures over the whole text); the bounds sit 1.3 to 2 times above,
# so a format that loses a good part of its faithfulness fails.
BOUNDS = {"bfloat16": (0.0025, 0.05), "int8": (0.004, 0.06), "int4": (0.15, 0.25), "int4m": (0.006, 0.05)}


@pytest.fixture(scope="module")
def settings_for(make_settings, smollm2_gguf):
    """Return a factory of settings serving SmolLM2's GGUF file in a DTYPE."""
    return lambda dtype: make_settings(model=str(smollm2_gguf), model_name="smollm2", dtype=dtype, max_model_len=2048,
                                       prefix_cache_mb=0)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """Return transformers' own float32 model of the folder the GGUF file converts into."""
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def reply_ids(engine, question: str, max_tokens: int) -> tuple[list[int], list[int], str]:
    """Return a greedy reply's prompt ids, token ids and text, as the engine streams them."""
    prompt_ids = engine.template.encode(engine.template.render([{"role": "user", "content": question}]))
    events = list(engine.submit(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)).events())
    pieces = [event for event in events if isinstance(event, TextDelta)]
    return prompt_ids, [token for piece in pieces for token in piece.token_ids], "".join(piece.text for piece in pieces)


def test_float32_greedy_replies_are_transformers_generate_token_for_token(settings_for, reference):
    with started_engine(settings_for("float32")) as engine:
        eos = engine.model.generation_config.eos_token_id
        replies = {}
        for question in QUESTIONS:
            prompt_ids, ids, text = reply_ids(engine, question, 40)
            with torch.inference_mode():
                expected = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=40, do_sample=False)
            expected = [token for token in expected[0, len(prompt_ids):].tolist() if token != eos]
            assert ids == expected, question
            replies[question] = text
    assert "Paris" in replies["What is the capital of France?"]


def test_bfloat16_lean_forward_gives_transformers_bits_on_llama(settings_for):
    """A prompt in two chunks, then decode steps: the lean forward's logits are transformers' with kernel attention."""
    with started_engine(settings_for("bfloat16")) as engine:
        model, runner = engine.model, engine._scheduler.runner
        assert engine.facts.forward == "lean"
        ids = engine.template.encode(engine.template.render([{"role": "user", "content": QUESTIONS[0]}]))
        chunks, steps = (ids[:20], ids[20:]), [30, 31, 32]
        with torch.inference_mode():
            kv = runner.reserve(len(ids) + len(steps))
            lean = [runner.prefill(kv, chunk, 1)[-1] for chunk in chunks]
            lean += [runner.decode([kv], [token])[0] for token in steps]
            runner.release(kv)
            model.set_attn_implementation(KERNEL_ATTENTION)
            try:
                cache = DynamicCache(config=model.config)
                parts = (*chunks, *([token] for token in steps))
                reference = [model(input_ids=torch.tensor([part]), cache=cache, use_cache=True,
                                   logits_to_keep=1).logits[0, -1].float() for part in parts]
            finally:
                model.set_attn_implementation("sdpa")
    assert all(torch.equal(a, b) for a, b in zip(lean, reference, strict=True))


def windows(tokenizer, count: int, length: int) -> list[list[int]]:
    """Return the first `count` windows of `length` tokens of TEXT."""
    ids = tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    return [ids[start:start + length] for start in range(0, count * length, length)]


@pytest.mark.parametrize("dtype", sorted(BOUNDS))
def test_every_format_stays_near_float32_on_real_text(settings_for, reference, dtype):
    """Two windows of 256 tokens, the second half of each scored as llama-perplexity scores it."""
    with started_engine(settings_for(dtype)) as engine:
        runner = engine._scheduler.runner
        assert engine.facts.forward == "lean"
        divergences, disagreements = [], []
        for window in windows(engine.tokenizer, 2, 256):
            with torch.inference_mode():
                kv = runner.reserve(len(window))
                served = runner.prefill(kv, window, 0)[128:].log_softmax(-1)
                runner.release(kv)
                expected = reference(input_ids=torch.tensor([window])).logits[0, 128:].float().log_softmax(-1)
            divergences.append((expected.exp() * (expected - served)).sum(-1))
            disagreements.append(expected.argmax(-1) != served.argmax(-1))
    mean_divergence, bound, share_bound = float(torch.cat(divergences).mean()), *BOUNDS[dtype]
    share = float(torch.cat(disagreements).float().mean())
    assert mean_divergence < bound, mean_divergence
    assert share < share_bound, share
