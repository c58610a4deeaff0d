"""The text GPTQ's rounding is calibrated on (gptq.py): a fixed mix written for it (stories, facts,
chats, code, JSON, SQL, arithmetic, a few other languages), so a conversion depends on nothing but
the model. bench/quality.py scores on another text (GPL-3), so the calibration never sees what is scored.
"""

from pathlib import Path

import torch

TEXT = Path(__file__).with_name("text.txt")
WINDOW = 512


def calibration_windows(tokenizer) -> torch.Tensor:
    """Return the calibration text's token ids cut into windows [count, WINDOW] (the tail that fills no
    window dropped), or one shorter window where the whole text is shorter."""
    ids = tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    count = len(ids) // WINDOW
    if count == 0:
        return torch.tensor([ids])
    return torch.tensor(ids[:count * WINDOW]).reshape(count, WINDOW)
