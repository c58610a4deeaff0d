"""bench/probes/kernel_ab.py renames a revision's kernels so both libraries load in one process."""

import re

from bench.probes.kernel_ab import RENAMED, renamed_source
from service.engine import kernels


def test_renamed_sources_keep_nothing_of_the_corechat_namespace_or_operator_library():
    """Every source of the kernels, renamed: no `namespace corechat`, `corechat::` or TORCH_LIBRARY(corechat
    is left, the renamed ones stand in their place, and the rest of the text is untouched."""
    registrations = 0
    for path in sorted(kernels.SOURCE_DIR.iterdir()):
        text = path.read_text()
        renamed = renamed_source(text)
        assert not re.search(r"\bnamespace corechat\b|\bcorechat::|TORCH_LIBRARY\w*\(corechat\b", renamed), path.name
        assert renamed.count(f"namespace {RENAMED}") == len(re.findall(r"\bnamespace corechat\b", text)), path.name
        registrations += len(re.findall(rf"TORCH_LIBRARY\w*\({RENAMED},", renamed))
        assert re.sub(RENAMED, "corechat", renamed) == text, path.name
    assert registrations == 3  # ops.cpp's library, layer.cpp's and sampling.cpp's fragments
