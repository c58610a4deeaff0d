"""A model loaded in-process as a worker loads it, for the probes that time the model's parts and for
bench/quality.py; the 0.5B dev model unless a folder is named.

`load_dev_model` gives the dev model and its tokenizer (bench/probes/agreement.py), `load_dev_runner`
the runner a worker's engine drives (bench/probes/step_probe.py, kv_fetch_probe.py), `load_runner`
that runner of any model folder (bench/quality.py).
"""

from pathlib import Path

from bench import CACHE_DIR

# Where bench/run.py builds the qwen2.5-0.5b dev model.
DEV_MODEL_DIR = CACHE_DIR / "bench-qwen2.5-0.5b"


def built_dev_model() -> Path:
    """Build the 0.5B dev model folder once; return it."""
    from devtools.devmodel import build_dev_model

    return build_dev_model(DEV_MODEL_DIR, preset="qwen2.5-0.5b")


def load_dev_model(dtype: str):
    """Build (once) and load the 0.5B dev model as a worker does; return the model and its tokenizer.

    dtype is a DTYPE value: int8 and int4 map (converting once) the quantized file a worker maps.
    """
    model, tokenizer, _ = load_prepared_dev_model(dtype)
    return model, tokenizer


def load_prepared_dev_model(dtype: str):
    """load_dev_model, and what preparing the model decided (service.engine.prepare.PreparedModel)."""
    return load_prepared_model(built_dev_model(), dtype)


def load_prepared_model(model_dir: Path, dtype: str):
    """Load a model folder at a DTYPE as a worker does; return the model, its tokenizer and what preparing it decided."""
    from service.engine.core import DTYPES
    from service.engine.loading import load_model, load_tokenizer, model_fingerprint
    from service.engine.prepare import prepare_model
    from service.settings import Settings

    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, DTYPES[dtype])
    settings = Settings()
    prepared = prepare_model(model, tokenizer, dtype, model_dir, Path(settings.converted_weights_dir), Path(settings.kernels_dir),
                             model_fingerprint(model_dir, tokenizer, Path(settings.converted_weights_dir)),
                             kernel_path=settings.kernel_path)
    return model, tokenizer, prepared


def load_runner(model_dir: Path, dtype: str, kv_cache_mb: int = 1024):
    """Load a model folder as a worker does; return the runner its engine drives (the lean forward's where
    that serves the model, else transformers'), the tokenizer and what preparing the model decided."""
    from service.engine.core import DTYPES
    from service.engine.memory import KVBudget, kv_bytes_per_token
    from service.engine.runners import PagedModel, TransformersModel

    model, tokenizer, prepared = load_prepared_model(model_dir, dtype)
    budget = KVBudget.of(kv_cache_mb, kv_bytes_per_token(model.config, DTYPES[dtype]))
    runner = PagedModel(prepared.lean, budget) if prepared.lean is not None else TransformersModel(model, budget)
    return runner, tokenizer, prepared


def load_dev_runner(dtype: str, kv_cache_mb: int = 1024):
    """Load the 0.5B dev model as a worker does; return the runner its engine drives and the tokenizer."""
    runner, tokenizer, _ = load_runner(built_dev_model(), dtype, kv_cache_mb)
    return runner, tokenizer
