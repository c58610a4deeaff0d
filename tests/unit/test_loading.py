"""Finding and loading models: local folders, hub ids without a network, sharded checkpoints, mapped weights,
fingerprints."""

import ctypes
import json
import mmap
import os

import pytest
import torch
from safetensors.torch import save_file

from harness import file_mappings, mapping_rss_kb
from service.engine.loading import ModelNotFound, load_model, map_safetensors, read_into_page_cache, resolve_model_dir


def test_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(ModelNotFound, match="devtools.devmodel"):
        resolve_model_dir(str(tmp_path / "nothing-here"), tmp_path)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="config.json"):
        resolve_model_dir(str(tmp_path), tmp_path)


def test_hub_id_without_network_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelNotFound, match="hf download"):
        resolve_model_dir("Qwen/Qwen2.5-0.5B-Instruct", tmp_path)


def test_sharded_checkpoint_loads_to_the_same_model(tiny_model_dir, tmp_path):
    for path in tiny_model_dir.iterdir():
        if path.name != "model.safetensors" and path.is_file():
            (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = {name: tensor.clone() for name, tensor in map_safetensors(tiny_model_dir / "model.safetensors").items()}
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in halves.items():
        save_file({name: tensors[name] for name in shard_names}, tmp_path / shard)
        weight_map.update({name: shard for name in shard_names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    single = load_model(tiny_model_dir, torch.bfloat16)
    sharded = load_model(tmp_path, torch.bfloat16)
    ids = torch.tensor([[151644, 872, 198, 9707, 151645]])
    with torch.inference_mode():
        assert torch.equal(single(input_ids=ids).logits, sharded(input_ids=ids).logits)


def test_served_parameters_lie_inside_one_private_mapping_of_the_weights_file(tiny_model_dir):
    """Every parameter of a bfloat16 model is a view of the file's one copy-on-write map, not a copy:
    so the page cache holds the weights once for all workers."""
    path = tiny_model_dir / "model.safetensors"
    model = load_model(tiny_model_dir, torch.bfloat16)
    mappings = file_mappings(path)
    holding = set()
    for name, param in model.named_parameters():
        start, end = param.data_ptr(), param.data_ptr() + param.nbytes
        inside = [mapping for mapping in mappings if mapping[0] <= start and end <= mapping[1]]
        assert inside, f"{name} is not inside a mapping of {path}"
        holding.update(inside)
    assert len(holding) == 1, "the parameters come from more than one mapping of the file"
    (_, _, permissions), = holding
    assert permissions.endswith("p"), "the map must be private, so nothing is ever written back to the file"


def test_float32_serving_converts_bf16_weights(tiny_model_dir):
    model = load_model(tiny_model_dir, torch.float32)
    assert {param.dtype for param in model.parameters()} == {torch.float32}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tokenizer_without_its_python_vocabulary_tokenizes_and_templates_the_same(tiny_model_dir):
    """Dropping the tokenizer's Python copy of the vocabulary and merges changes nothing the engine uses."""
    from transformers import AutoTokenizer

    from service.engine.loading import load_tokenizer

    trimmed, full = load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not trimmed._vocab and not trimmed._merges and len(full._vocab) > 150_000
    texts = ["Hello, world!", "naïve café — 東京 🚀", "<|im_start|>user\nhi<|im_end|>", "  spaces\tand\nlines  ",
             "x" * 500]
    for text in texts:
        ids = trimmed(text, add_special_tokens=False)["input_ids"]
        assert ids == full(text, add_special_tokens=False)["input_ids"]
        assert trimmed.decode(ids) == full.decode(ids) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[1]}]
    rendered = [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                for tokenizer in (trimmed, full)]
    assert rendered[0] == rendered[1]
    assert trimmed.get_vocab() == full.get_vocab()
    assert (trimmed.eos_token_id, len(trimmed)) == (full.eos_token_id, len(full))


def test_models_loading_at_once_leave_the_default_dtype_alone(tiny_model_dir):
    """transformers sets and restores the process's default dtype while building; two threads at
    once used to leave bfloat16 behind for every later torch.randn in the process."""
    import threading

    threads = [threading.Thread(target=load_model, args=(tiny_model_dir, torch.bfloat16)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.get_default_dtype() == torch.float32


def model_copy(tiny_model_dir, folder):
    """Copy the tiny model into `folder` (no converted file, no kept hash); return it."""
    import shutil

    shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("corechat-*", ".*"))
    return folder


def flip_byte(path, offset: int) -> None:
    """Change one byte of a file in place."""
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x01]))


def test_models_differing_in_one_byte_have_different_fingerprints(tiny_model_dir, tmp_path):
    """A fine-tune that changes one weight byte, where the old fingerprint's 64 KiB samples every 8 MiB
    never looked, is another model: its converted weights and cached replies are its own."""
    from service.engine.loading import load_tokenizer, model_fingerprint

    base = model_copy(tiny_model_dir, tmp_path / "base")
    tuned = model_copy(tiny_model_dir, tmp_path / "tuned")
    tokenizer = load_tokenizer(base)
    size = (tuned / "model.safetensors").stat().st_size
    unsampled = 8 * 1024 * 1024 + 64 * 1024 + 12345
    assert size > unsampled + 1
    flip_byte(tuned / "model.safetensors", unsampled)
    hashes = tmp_path / "hashes"
    assert model_fingerprint(base, tokenizer, hashes) != model_fingerprint(tuned, tokenizer, hashes)


def test_a_weight_files_hash_is_kept_until_the_file_changes(tiny_model_dir, tmp_path):
    """A restart reads the kept hash instead of reading the weights again (shown by a hash planted in
    the sidecar being used); a file whose mtime or bytes change is hashed again."""
    import hashlib

    from service.engine.hashing import HASH_SIDECAR_SUFFIX, file_sha256

    model = model_copy(tiny_model_dir, tmp_path / "model")
    weights = model / "model.safetensors"
    real = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert file_sha256(weights, tmp_path / "hashes") == real
    sidecar = model / f".model.safetensors{HASH_SIDECAR_SUFFIX}"
    kept = json.loads(sidecar.read_text())
    assert kept["sha256"] == real and kept["identity"]["size"] == weights.stat().st_size
    planted = "0" * 64
    sidecar.write_text(json.dumps({**kept, "sha256": planted}))
    assert file_sha256(weights, tmp_path / "hashes") == planted
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    assert file_sha256(weights, tmp_path / "hashes") == real
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "sha256": planted}))
    mtime = weights.stat().st_mtime_ns
    flip_byte(weights, 1000)
    os.utime(weights, ns=(mtime, mtime))  # a write in place that puts the mtime back
    assert file_sha256(weights, tmp_path / "hashes") == hashlib.sha256(weights.read_bytes()).hexdigest() != real


def resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """Return how many of a mapped tensor's pages are in the page cache (mincore), and how many it spans."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = (length + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    assert ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0
    return sum(byte & 1 for byte in vector), pages


def test_the_embedding_table_is_read_into_the_page_cache_without_joining_the_process(tmp_path):
    """A mapped tensor's pages, dropped from the page cache (as after a reboot), are all cached once
    read_into_page_cache returns, though the process read none of them through its mapping; a tensor
    that is no file's is left alone."""
    path = tmp_path / "table.safetensors"
    save_file({"table": torch.randn(4096, 513)}, str(path))  # 8.0 MiB and a piece
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)
    table = map_safetensors(path)["table"]
    resident, pages = resident_pages(table)
    if resident == pages:
        pytest.skip("this file system keeps the file's pages cached whatever it is told (tmpfs)")
    mapped = mapping_rss_kb(table.data_ptr())  # the header safetensors read, and the pages around it
    assert read_into_page_cache(table) == table.numel() * 4
    assert resident_pages(table) == (pages, pages)
    assert mapping_rss_kb(table.data_ptr()) == mapped < 8192
    assert read_into_page_cache(torch.zeros(1000)) == 0
