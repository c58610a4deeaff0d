"""Qwen3 through the lean forward: transformers' Qwen3ForCausalLM's bits, per-head query and key norms
included, and the fused int8/int4 operators' batch invariance with those norms in them.

At bfloat16 the lean forward runs transformers' operations. int8 runs the fused operators, whose norms
sum their means in their own order (test_layer.py); at the tiny Qwen3's width of 64 and heads of 32 the
two orders agree, so int8 is held to transformers' bits here too, head norms included.

The dev preset's norms are ones (transformers' initialisation), under which a norm that forgot its weight
would pass; this module's copy of the tiny Qwen3 draws every norm's weight at random around one."""

import pytest
import torch
from transformers import DynamicCache, Qwen3ForCausalLM

from devtools.devmodel import build_dev_model
from service.app import create_app
from tests.app.test_batch_invariance import decode, random_prompts
from tests.app.test_qwen2 import KERNEL_ATTENTION
from tests.support import started_engine

GREEDY_STEPS = 12


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """Return a tiny random Qwen3 folder whose every RMSNorm weight is random too."""
    folder = build_dev_model(tmp_path_factory.mktemp("qwen3") / "qwen3-tiny", preset="qwen3-tiny")
    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.copy_(torch.rand(weight.shape, generator=generator) + 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def qwen3_settings(make_settings, qwen3_dir):
    """Return a factory of settings on the tiny Qwen3."""
    return lambda **overrides: make_settings(model=str(qwen3_dir), model_name="qwen3-tiny", **overrides)


def test_the_tiny_qwen3_has_query_and_key_norms_and_heads_wider_than_its_width(qwen3_settings):
    """What the rest of this module relies on: the decoder is Qwen3's, and the lean forward takes it."""
    with started_engine(qwen3_settings(dtype="bfloat16", max_model_len=256)) as engine:
        attention = engine.model.model.layers[0].self_attn
        assert type(engine.model).__name__ == "Qwen3ForCausalLM"
        assert attention.q_proj.bias is None and attention.q_norm.weight.shape == (32,)
        assert attention.head_dim * engine.model.config.num_attention_heads != engine.model.config.hidden_size
        assert engine.facts.forward == "lean"


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_lean_forward_gives_transformers_qwen3_bits_and_greedy_tokens(qwen3_settings, dtype):
    """A prompt in two chunks, then greedy decode steps: the lean forward's logits and tokens equal
    transformers' Qwen3ForCausalLM's given the same attention kernel (test_qwen2.py: kernel_attention)."""
    with started_engine(qwen3_settings(dtype=dtype, max_model_len=512, prefix_cache_mb=0)) as engine:
        model, runner = engine.model, engine._scheduler.runner
        assert runner.exact_rows is (dtype == "int8"), "int8 runs the fused operators, bfloat16 torch's"
        prompt = torch.randint(100, 5000, (45,), generator=torch.Generator().manual_seed(1)).tolist()
        lean_logits, lean_tokens = [], []
        with torch.inference_mode():
            kv = runner.reserve(len(prompt) + GREEDY_STEPS)
            for chunk in (prompt[:32], prompt[32:]):
                lean_logits.append(runner.prefill(kv, chunk, 1)[-1])
            for _ in range(GREEDY_STEPS):
                lean_tokens.append(int(lean_logits[-1].argmax()))
                lean_logits.append(runner.decode([kv], [lean_tokens[-1]])[0])
            runner.release(kv)

        model.set_attn_implementation(KERNEL_ATTENTION)
        try:
            reference_logits = []
            with torch.inference_mode():
                cache = DynamicCache(config=model.config)
                for chunk in (prompt[:32], prompt[32:]):
                    reference_logits.append(model(input_ids=torch.tensor([chunk]), cache=cache, use_cache=True,
                                                  logits_to_keep=1).logits[0, -1].float())
                for token in lean_tokens:
                    reference_logits.append(model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True,
                                                  logits_to_keep=1).logits[0, -1].float())
                generated = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY_STEPS,
                                           min_new_tokens=GREEDY_STEPS)
        finally:
            model.set_attn_implementation("sdpa")
        assert len(lean_logits) == len(reference_logits)
        assert all(torch.equal(a, b) for a, b in zip(lean_logits, reference_logits))
        assert generated[0, len(prompt):].tolist() == lean_tokens


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_qwen3_rows_logits_are_the_same_bits_alone_and_in_batches(qwen3_settings, dtype):
    """The fused operators with Qwen3's head norms keep a row's bits whatever else its batch holds."""
    with started_engine(qwen3_settings(dtype=dtype, max_model_len=2048, prefix_cache_mb=0)) as engine:
        runner, prompts = engine._scheduler.runner, random_prompts()
        assert runner.exact_rows, "the fused operators run the layers"
        alone = [decode(runner, [ids])[0] for ids in prompts]
        order = list(range(len(prompts)))[::-1]
        together = decode(runner, [prompts[row] for row in order], leave_after=2)
        for index, row in enumerate(order):
            for step, logits in enumerate(together[index]):
                assert torch.equal(logits, alone[row][step]), (dtype, row, step)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_repeated_qwen3_prompt_reuses_its_stored_prefix_and_replies_the_same(qwen3_settings, dtype):
    """The prefix store serves Qwen3 as Qwen2: the second pass takes the first's KV pages and, its rows not
    depending on how the prompt was cut (int8, int4), gives the same reply."""
    settings = qwen3_settings(dtype=dtype, max_model_len=1024)
    with started_engine(settings) as engine:
        client = create_app(settings, engine=engine).test_client()
        body = {"messages": [{"role": "user", "content": "Tell me about CPUs. " * 60}], "max_tokens": 8,
                "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
        # no-cache keeps the response cache out of it, so the second reply is generated again.
        first, second = (client.post("/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache"})
                         .get_json() for _ in range(2))
        assert first["usage"]["prompt_tokens"] > 256
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
        assert second["choices"][0]["message"] == first["choices"][0]["message"]
