"""What a model's weights weigh: one copy as served, and the bytes a decoded token reads (a decode step's bound)."""

import json
import math
import re
from pathlib import Path


def safetensors_header(path: Path) -> dict:
    """Return a safetensors file's header: tensor name -> dtype, shape, offsets."""
    with path.open("rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    header.pop("__metadata__", None)
    return header


def element_counts_of(model_dir: Path) -> dict[str, int]:
    """Return the number of elements of every tensor of the model."""
    return {name: math.prod(info["shape"]) for name, info in safetensors_header(model_dir / "model.safetensors").items()}


def converted_weights_path(server_log: str) -> Path | None:
    """Return the converted weights file the workers logged mapping (kept out of /readyz), if any."""
    found = re.search(r"weights mapped from (\S+)", server_log)
    return Path(found.group(1)) if found else None


def served_weight_bytes(model_dir: Path, dtype: str, converted: Path | None) -> int:
    """Return the bytes of one copy of the weights as served: for int8, int4 and int4m the converted file plus the bf16
    tensors it keeps."""
    counts = element_counts_of(model_dir)
    if dtype not in ("int8", "int4", "int4m"):
        return sum(counts.values()) * {"bfloat16": 2, "float32": 4}[dtype]
    replaced = {name.removesuffix(".qweight") for name in safetensors_header(converted) if name.endswith(".qweight")}
    return converted.stat().st_size + 2 * sum(count for name, count in counts.items() if name not in replaced)


def weight_bytes_per_token(model_dir: Path, dtype: str) -> dict:
    """Count the weight bytes one decoded token reads: every matrix once, the embedding only as the output layer."""
    config = json.loads((model_dir / "config.json").read_text())
    element_counts = element_counts_of(model_dir)
    total = sum(element_counts.values())
    # A token looks up one embedding row; the output layer reads the whole matrix (the same one when tied).
    embedding = element_counts.get("model.embed_tokens.weight", 0)
    read = total if config.get("tie_word_embeddings") else total - embedding
    # int8 and int4: a byte or half a byte per weight and a float16 scale per 32 (int4m a float16 minimum too);
    # the 4-bit formats' output layer is int6 (three quarters of a byte and the scale).
    element_bytes = {"bfloat16": 2, "float32": 4, "int8": 1.0625, "int4": 0.5625, "int4m": 0.625}[dtype]
    output = embedding if config.get("tie_word_embeddings") else element_counts.get("lm_head.weight", 0)
    output_bytes = {"int4": 0.8125, "int4m": 0.8125}.get(dtype, element_bytes)
    return {"parameters": total, "parameters_read_per_token": read,
            "bytes_per_token": (read - output) * element_bytes + output * output_bytes}
