"""A GGUF model file (llama.cpp's and Ollama's format) as the Hugging Face folder the engine loads.

`MODEL=path/to/model.gguf` is converted once into a folder of the converted-weights directory,
named by the file's SHA-256: config.json, tokenizer and chat template from the file's metadata,
generation_config.json, and model.safetensors holding every tensor dequantized to float32 (exactly
the values the file's quantized blocks stand for). transformers reads the file (its GGUF support
needs the `gguf` package); the folder then serves at every DTYPE like any other, and its int8 or
int4 weights are converted from those float32 values.

Reading a GGUF file takes tens of seconds, longer than a worker may spend booting: Gunicorn's master
converts it before forking, in a child process so that the master itself does no torch work
(lifecycle.import_worker_libraries), and `python -m service.engine.gguf FILE` converts ahead. A
worker that finds no folder converts under the same lock as the others, so only one does.
"""

import argparse
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .hashing import file_sha256

log = logging.getLogger(__name__)

SUFFIX = ".gguf"
# Part of the folder's name: bump it whenever what a conversion writes changes.
CONVERSION_VERSION = 2
WEIGHTS = "model.safetensors"
# llama.cpp splits text before its byte-level BPE as the file's `tokenizer.ggml.pre` names it;
# transformers' conversion keeps only the byte-level step, so a number after a space or a newline
# would tokenize otherwise than the model was trained on (and than llama.cpp does). The splits of
# the pre-tokenizers whose names differ from what transformers rebuilds, as their models' own
# tokenizer.json files give them, run before the byte-level step.
SPLITS_BEFORE_BYTES = {"smollm": (("Digits", {"individual_digits": True}),)}


def is_gguf_file(model: str) -> bool:
    """Tell whether MODEL names a GGUF file (by its suffix; it need not exist yet)."""
    return model.lower().endswith(SUFFIX)


def folder_for(gguf_path: Path, converted_dir: Path) -> Path:
    """Return the folder a GGUF file converts into: named by its stem and the SHA-256 of its bytes."""
    digest = file_sha256(gguf_path, converted_dir / "hashes")
    return converted_dir / "gguf" / f"{gguf_path.stem}-{digest[:16]}-v{CONVERSION_VERSION}"


def converted_folder(gguf_path: Path, converted_dir: Path) -> Path:
    """Return the Hugging Face folder of a GGUF file, converting it first unless an earlier run did."""
    folder = folder_for(gguf_path, converted_dir)
    if (folder / WEIGHTS).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f".{folder.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / WEIGHTS).is_file():
            log.info("converting %s once into %s", gguf_path, folder)
            write_folder(gguf_path, folder)
    return folder


def write_folder(gguf_path: Path, folder: Path) -> None:
    """Write a GGUF file's config, tokenizer, generation defaults and float32 weights as one folder, atomically."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source_dir, name = gguf_path.parent, gguf_path.name
    temporary = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        config = AutoConfig.from_pretrained(source_dir, gguf_file=name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        # What the engine and llama.cpp's converter read the architecture from.
        config.architectures = [type(skeleton).__name__]
        checkpoint = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
        tensors = checkpoint["tensors"]
        expected = {parameter for parameter, _ in skeleton.named_parameters()}
        if getattr(config, "tie_word_embeddings", False):
            expected.discard("lm_head.weight")
        missing = sorted(expected - set(tensors))
        if missing:
            raise ValueError(f"{gguf_path} lacks tensors the {config.model_type} architecture needs: {missing[:5]}")
        config.save_pretrained(temporary)
        tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name)
        restore_splits(tokenizer, checkpoint["tokenizer"].get("pre_tokenizer_type", ""))
        tokenizer.save_pretrained(temporary)
        GenerationConfig.from_model_config(config).save_pretrained(temporary)
        save_file({key: tensor.to(torch.float32).contiguous() for key, tensor in tensors.items()},
                  str(temporary / WEIGHTS), metadata={"format": "pt", "source": name})
        (temporary / "corechat-source.json").write_text(json.dumps({"gguf_file": str(gguf_path.resolve())}) + "\n")
        for written in temporary.iterdir():
            os.chmod(written, 0o644)
        os.chmod(temporary, 0o755)
        os.replace(temporary, folder)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def restore_splits(tokenizer, pre_tokenizer_type: str) -> None:
    """Put back the splits before the byte-level step that the file's pre-tokenizer name stands for."""
    from tokenizers import pre_tokenizers

    splits = SPLITS_BEFORE_BYTES.get(pre_tokenizer_type, ())
    if splits:
        backend = tokenizer.backend_tokenizer
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [getattr(pre_tokenizers, kind)(**options) for kind, options in splits] + [backend.pre_tokenizer])


def convert_in_child(gguf_path: Path, converted_dir: Path) -> Path:
    """Return a GGUF file's folder, converting it in a child process unless an earlier run did
    (Gunicorn's master does no torch work of its own)."""
    folder = folder_for(gguf_path, converted_dir)
    if not (folder / WEIGHTS).is_file():
        finished = subprocess.run([sys.executable, "-m", "service.engine.gguf", str(gguf_path), "--into",
                                   str(converted_dir)], cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL)
        if finished.returncode != 0:
            log.warning("converting %s failed (exit status %d); each worker tries again and reports why",
                        gguf_path, finished.returncode)
    return folder


def main() -> None:
    """Convert a GGUF file into the folder MODEL=FILE serves, and print the folder."""
    parser = argparse.ArgumentParser(prog="python -m service.engine.gguf", description=main.__doc__)
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("--into", type=Path, help="the converted-weights directory (default: CONVERTED_WEIGHTS_DIR)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.into is None:
        from service.settings import Settings

        args.into = Path(Settings().converted_weights_dir)
    print(converted_folder(args.gguf_file.expanduser().resolve(), args.into))


if __name__ == "__main__":
    main()
