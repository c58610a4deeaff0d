"""The log probabilities a reply reports: each drawn token's, under the distribution it was drawn from,
with its row's most likely alternatives; and a prompt's own tokens' (legacy completions' echo)."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .draws import take_rows
from .sampling import Sampler, penalized


@dataclass(frozen=True)
class TokenLogprobs:
    """A drawn token's log probability and its row's most likely tokens with theirs (ids, most likely first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(samplers: Sequence[Sampler], logits: torch.Tensor, tokens: Sequence[int]) -> list[TokenLogprobs | None]:
    """Return each row's log probabilities where its request asked for them (None elsewhere).

    They are those of the distribution the token was drawn from: the same penalized logits
    sample_tokens computes (call this before the samplers record the tokens), over the
    temperature (1 for greedy rows), before top_k and top_p cut it.
    """
    rows = [row for row, sampler in enumerate(samplers) if sampler.params.logprobs]
    result: list[TokenLogprobs | None] = [None] * len(samplers)
    if not rows:
        return result
    asking = [samplers[row] for row in rows]
    scores = penalized(asking, take_rows(logits, rows).float())
    temperatures = torch.tensor([[1.0 if sampler.params.greedy else sampler.params.temperature] for sampler in asking])
    # Shifted first, as draw() does, so a small temperature cannot overflow the largest logit.
    logprobs = torch.log_softmax((scores - scores.amax(dim=-1, keepdim=True)) / temperatures, dim=-1)
    width = max(sampler.params.top_logprobs for sampler in asking)
    top = torch.topk(logprobs, width, dim=-1) if width else None
    for slot, (row, sampler) in enumerate(zip(rows, asking, strict=True)):
        pairs = ()
        if top is not None and sampler.params.top_logprobs:
            count = sampler.params.top_logprobs
            # A token the grammar forbids (-inf) is no alternative.
            pairs = tuple((token, value) for token, value in zip(top.indices[slot, :count].tolist(), top.values[slot, :count].tolist())
                          if value != float("-inf"))
        result[row] = TokenLogprobs(float(logprobs[slot, tokens[row]]), pairs)
    return result


def prompt_token_logprobs(logits: torch.Tensor, next_ids: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Return the log probability of each of `next_ids` under the row of `logits` [rows, vocab] before it, with
    the row's `top` most likely tokens.

    The model's own distribution (no temperature, penalty or bias): what scoring a text asks, and what
    vLLM's prompt logprobs report.
    """
    logprobs = torch.log_softmax(logits[: len(next_ids)].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(next_ids, dtype=torch.long)[:, None])[:, 0].tolist()
    if not top:
        return [TokenLogprobs(value) for value in chosen]
    values, indices = torch.topk(logprobs, top, dim=-1)
    return [TokenLogprobs(value, tuple(zip(row_ids, row_values)))
            for value, row_ids, row_values in zip(chosen, indices.tolist(), values.tolist(), strict=True)]
