"""Find, load and fingerprint a Hugging Face causal LM so that workers share its weights."""

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from .gguf import converted_folder, is_gguf_file
from .hashing import file_sha256

log = logging.getLogger(__name__)

HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
# transformers builds a model under a process-wide default dtype it sets and restores; two threads
# building at once restore each other's setting and leave bfloat16 as the process's default.
_BUILDING = threading.Lock()
# Bytes read_into_page_cache reads at a time.
READ_CHUNK = 8 << 20


class ModelNotFound(RuntimeError):
    """The model folder or hub id cannot be resolved to files on this machine."""


def resolve_model_dir(model: str, converted_dir: Path) -> Path:
    """Return a local folder for a model given as a folder path, a GGUF file (converted once into a
    folder under converted_dir) or a hub id."""
    path = Path(model).expanduser()
    if is_gguf_file(model):
        if not path.is_file():
            raise ModelNotFound(f"GGUF file {model} does not exist")
        try:
            return converted_folder(path.resolve(), converted_dir)
        except (ValueError, KeyError) as exc:  # what the gguf reader and transformers raise for a file they cannot read
            raise ModelNotFound(f"cannot serve GGUF file {model}: {exc}") from exc
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json; is it a Hugging Face model folder?")
        return path
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") != 1:
        raise ModelNotFound(
            f"model folder {model} does not exist; build the demo model with "
            f"`python -m devtools.devmodel {model} --preset qwen2.5-0.5b` or set MODEL"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, allow_patterns=HUB_FILE_PATTERNS))
    except HfHubHTTPError as exc:
        raise ModelNotFound(f"the Hugging Face hub refused {model}: {exc}") from exc
    except LocalEntryNotFoundError as exc:
        raise ModelNotFound(
            f"cannot download {model} from the Hugging Face hub (offline?); download it where a "
            "network exists (`hf download " + model + " --local-dir DIR`), copy DIR here and set "
            "MODEL=DIR"
        ) from exc


# Tokenizers the Gunicorn master loaded before forking its workers, by model folder: a worker then
# uses the copy it inherited instead of building its own (Qwen2.5's takes about 2 s of CPU).
_preloaded_tokenizers: dict[Path, object] = {}


def preload_tokenizer(model: str) -> bool:
    """Load the tokenizer of a model given as a local folder, for processes forked from this one;
    return whether it loaded. It only loads: encoding would start the tokenizer's thread pool, and a
    process that forks must have no thread. A hub id, or a folder whose tokenizer fails to load, is
    left to the workers, which then report why as they do without this."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return False
    try:
        _preloaded_tokenizers[folder.resolve()] = load_tokenizer(folder)
    except Exception:  # noqa: BLE001 (the workers load it again and report the failure)
        log.debug("the tokenizer of %s did not preload; the workers will load it", folder, exc_info=True)
        return False
    return True


def inherited_tokenizer(model_dir: Path):
    """Return the tokenizer preload_tokenizer loaded for this folder in a parent process, or None."""
    return _preloaded_tokenizers.get(Path(model_dir).resolve())


def load_tokenizer(model_dir: Path):
    """Load the fast tokenizer of a model folder, without the Python copies of its vocabulary."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # transformers' BPE tokenizers (Qwen2's among them) keep the vocabulary dict and merge list
    # they built the Rust tokenizer from; nothing reads them again, and for Qwen2.5's 151,643
    # tokens and 294,166 merges they are about 70 MB of Python objects in every worker.
    for name in ("_vocab", "_merges"):
        kept = getattr(tokenizer, name, None)
        if isinstance(kept, (dict, list)):
            setattr(tokenizer, name, type(kept)())
    return tokenizer


def load_generation_defaults(model_dir: Path) -> GenerationConfig:
    """Load the model's generation_config.json, or transformers' defaults where it has none."""
    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:
        return GenerationConfig()


def safetensors_files(model_dir: Path) -> list[Path]:
    """List a model's safetensors files, following a shard index where there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelNotFound(f"{model_dir} has no model.safetensors (only safetensors weights are served)")


def map_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Return every tensor of a safetensors file as a view of one read-only memory map.

    safetensors' torch loader maps the file once (`torch.UntypedStorage.from_file(path, shared=False)`)
    and hands out zero-copy slices of that storage. The map is private (copy-on-write) and never
    written, so all workers read the same page-cache pages: N workers cost one copy of the weights,
    not N (tests/unit/test_loading.py checks that every tensor lies inside the file's one mapping).
    """
    return load_file(path)


def read_into_page_cache(tensor: torch.Tensor) -> int:
    """Read a file-mapped tensor's bytes once from its file (in READ_CHUNK pieces into one buffer, never
    through the mapping, so no page of it joins the process), so that they are in the page cache before
    serving; return the bytes read (0 for a tensor that is not a mapped file's).

    The embedding table is read a row at a time, the first time each token occurs, on the engine's
    thread: a row whose page is not cached stalls every stream for a read from disk (after a reboot,
    one lookup in ten took 3-14 ms on the dev model; docs/performance.md).
    """
    address, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    found = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            if low <= address < high and len(fields) == 6 and fields[5].startswith("/"):
                found = fields[5].rstrip("\n"), int(fields[2], 16) + address - low
                break
    if found is None or size == 0:
        return 0
    path, offset = found
    buffer = memoryview(bytearray(min(READ_CHUNK, size)))
    done = 0
    try:
        with open(path, "rb", buffering=0) as file:
            while done < size:
                count = os.preadv(file.fileno(), [buffer[:min(len(buffer), size - done)]], offset + done)
                if count <= 0:
                    break
                done += count
    except OSError as exc:  # the file was replaced or removed since it was mapped
        log.debug("could not read %s ahead: %s", path, exc)
    return done


def load_model(model_dir: Path, dtype: torch.dtype):
    """Build the model without allocating weights, then point its parameters at the mapped files."""
    config = AutoConfig.from_pretrained(model_dir)
    with _BUILDING, torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    state = {}
    for path in safetensors_files(model_dir):
        state.update(map_safetensors(path))
    converted = [name for name, tensor in state.items() if tensor.dtype != dtype and tensor.is_floating_point()]
    if converted:
        log.warning("converting %d tensors to %s: each worker holds a private copy of them", len(converted), dtype)
        state = {name: tensor.to(dtype) if name in converted else tensor for name, tensor in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if unexpected:
        log.warning("ignoring %d unexpected tensors, e.g. %s", len(unexpected), unexpected[:3])
    _materialize_buffers(model)
    still_missing = [name for name, param in model.named_parameters() if param.is_meta]
    if still_missing:
        raise ModelNotFound(f"weights missing from {model_dir}: {still_missing[:5]}")
    return model.eval()


def _materialize_buffers(model) -> None:
    """Compute the non-persistent buffers (rotary frequencies) that the meta build left empty."""
    for module in model.modules():
        empty = [name for name, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
        if empty:
            for name in empty:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            # transformers computes these buffers in _init_weights, as its own meta loading does.
            model._init_weights(module)


def model_fingerprint(model_dir: Path, tokenizer, hashes_dir: Path) -> str:
    """Hash what decides the model's output: config, every byte of the weight files, tokenizer and template.

    The weights' hashes are kept between starts (file_sha256); a copy to another host hashes the
    same, so hosts sharing one Redis share entries, and a fine-tune that changes a single byte does not.
    """
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    for path in safetensors_files(model_dir):
        digest.update(f"{path.name}:{file_sha256(path, hashes_dir)}".encode())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (model_dir / name).is_file():
            digest.update((model_dir / name).read_bytes())
    digest.update(str(tokenizer.chat_template).encode())
    return digest.hexdigest()[:16]
