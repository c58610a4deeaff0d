"""A GGUF MODEL becomes a Hugging Face folder once: the file's own values, named by its bytes."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open

from harness import REPO
from service.engine.gguf import convert_in_child, folder_for, is_gguf_file
from service.engine.loading import ModelNotFound, resolve_model_dir
from service.settings import Settings


def test_model_names_a_gguf_file_by_its_suffix():
    assert is_gguf_file("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert is_gguf_file("model.GGUF")
    assert not is_gguf_file("Qwen/Qwen2.5-0.5B-Instruct")
    assert not is_gguf_file("/models/qwen2.5-0.5b-instruct")


def test_a_missing_gguf_file_is_named_as_such(tmp_path):
    """Not the demo model's advice, which would build a random model over the path."""
    with pytest.raises(ModelNotFound, match="GGUF file .*missing.gguf does not exist") as raised:
        resolve_model_dir(str(tmp_path / "missing.gguf"), tmp_path / "converted")
    assert "devmodel" not in str(raised.value)


def test_a_file_that_is_no_gguf_is_refused_naming_it(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ModelNotFound, match="cannot serve GGUF file .*broken.gguf"):
        resolve_model_dir(str(broken), tmp_path / "converted")
    assert not any((tmp_path / "converted" / "gguf").glob("broken*"))


def test_the_folder_is_named_by_the_files_bytes_not_its_place(smollm2_gguf, tmp_path):
    copy = tmp_path / smollm2_gguf.name
    shutil.copyfile(smollm2_gguf, copy)
    converted = tmp_path / "converted"
    assert folder_for(copy, converted) == folder_for(smollm2_gguf, converted)
    with copy.open("r+b") as file:
        file.seek(-1, 2)
        last = file.read(1)
        file.seek(-1, 2)
        file.write(bytes([last[0] ^ 1]))
    assert folder_for(copy, converted) != folder_for(smollm2_gguf, converted)


def test_converted_weights_are_the_files_own_dequantized_values(smollm2_gguf, smollm2_dir):
    """Read back with the gguf library alone: Q4_1 layers and the Q8_0 embedding, exactly, in float32."""
    tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(smollm2_gguf).tensors}
    pairs = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.29.ffn_up.weight": "model.layers.29.mlp.up_proj.weight", "output_norm.weight": "model.norm.weight"}
    with safe_open(smollm2_dir / "model.safetensors", "pt") as converted:
        for gguf_name, name in pairs.items():
            source = tensors[gguf_name]
            expected = torch.from_numpy(gguf.quants.dequantize(source.data, source.tensor_type).copy())
            got = converted.get_tensor(name)
            assert got.dtype == torch.float32
            assert torch.equal(got, expected.reshape(got.shape)), name


def test_model_resolves_to_the_converted_folder(smollm2_gguf, smollm2_dir):
    assert resolve_model_dir(str(smollm2_gguf), Path(Settings().converted_weights_dir)) == smollm2_dir


def test_the_folder_holds_the_architecture_tokenizer_and_template_of_the_file(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(json.loads((smollm2_dir / "generation_config.json").read_text())
                                           ["eos_token_id"]) == "<|im_end|>"


def test_the_command_line_gives_the_folder_the_master_serves(smollm2_gguf, smollm2_dir):
    """What Gunicorn's master runs in a child process (it does no torch work itself) and what converts ahead."""
    printed = subprocess.run([sys.executable, "-m", "service.engine.gguf", str(smollm2_gguf), "--into",
                              Settings().converted_weights_dir], capture_output=True, text=True, check=True, cwd=REPO)
    assert Path(printed.stdout.strip()) == smollm2_dir
    assert convert_in_child(smollm2_gguf, Path(Settings().converted_weights_dir)) == smollm2_dir


def test_numbers_split_as_llama_cpp_splits_them(smollm2_dir):
    """The file's pre-tokenizer (`smollm`) splits digits one by one before the byte-level BPE, as
    llama.cpp does and the model was trained; transformers' GGUF conversion alone leaves that out."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("CONDITIONS\n\n  0. Definitions 2026")["input_ids"])
    assert pieces == ["CON", "DIT", "IONS", "ĊĊĠĠ", "0", ".", "ĠDefinitions", "Ġ", "2", "0", "2", "6"]
