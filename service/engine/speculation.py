"""Speculative decode steps that never change a byte: draft tokens checked as extra rows of their sequence.

A decoding sequence whose last tokens occurred before in its prompt or reply proposes the tokens
that followed them (drafts.py). The step runs them after its next token as rows of the sequence,
a prompt chunk's way: each row writes its KV state at its own position and attends to its
sequence up to there. With int8, int4 and int4m a row's logits are the same bits whatever else the
forward runs (runners.SequenceModel.exact_rows), so row i's logits are those a single decode step
would give once the drafts before it were taken. The sampler then chooses row by row, as single
steps would, its state moving only by the tokens it takes: a draft is taken only where the
sampler chose it, and the first token it did not choose is taken too (its row's own choice). So
greedy and seeded replies, logprobs, penalties and grammars are exactly those of plain decoding;
seeded draws need nothing more because each draw is seeded by the reply's position alone
(sampling.Sampler). The rows past the last token taken are forgotten (the sequence's length
rewound), so later steps see exactly the taken state.

Drafts only use rows a full batch would: none while requests wait or a prompt is in its pass,
and a step runs at most MAX_RUNNING rows, so speculation never takes a place from another stream.
"""

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .drafts import PromptLookup
from .draws import take_rows
from .events import Failed
from .facts import EngineFacts
from .grammar import mask_logits
from .kvpool import SequencePages
from .logprobs import TokenLogprobs, token_logprobs
from .sampling import biased, sample_tokens
from .sequences import Delivery, Sequence

log = logging.getLogger(__name__)


class DraftRowsModel(Protocol):
    """A runner that checks drafts: several rows of a sequence in one step, and its state rewound after."""

    def decode_rows(self, kvs: list[SequencePages], inputs: list[list[int]]) -> torch.Tensor:
        """Run each sequence's tokens as rows at its next positions; return every row's logits."""

    def rewind(self, kv: SequencePages, length: int) -> None:
        """Forget a sequence's KV state past `length` tokens."""


@dataclass
class DraftStep:
    """A step's rows: each sequence's drafts (maybe none), where its rows start, and every row's logits once run."""

    drafts: list[list[int]]
    starts: list[int]
    logits: torch.Tensor | None = field(default=None, repr=False)

    def rows_of(self, index: int) -> torch.Tensor:
        """Return the logits of sequence `index`'s rows: its next token's, then its drafts'."""
        start = self.starts[index]
        return self.logits[start:start + 1 + len(self.drafts[index])]


def share_rows(proposals: list[list[int]], rows: int) -> list[list[int]]:
    """Cut the proposals so they hold at most `rows` tokens, shared evenly among the sequences that propose."""
    proposing = [index for index, proposal in enumerate(proposals) if proposal]
    cut = [[] for _ in proposals]
    for order, index in enumerate(proposing):
        share = rows // len(proposing) + (1 if order < rows % len(proposing) else 0)
        cut[index] = proposals[index][:share]
    return cut


class Speculator:
    """Propose a step's drafts and take, for each sequence, what its rows' sampler chooses."""

    def __init__(self, runner: DraftRowsModel, most_tokens: int, delivery: Delivery, facts: EngineFacts):
        self.runner = runner
        self.most_tokens = most_tokens
        self.delivery = delivery
        self.facts = facts

    def propose(self, active: list[Sequence], rows: int) -> DraftStep | None:
        """Return the step's drafts within `rows` extra rows, or None where no sequence has any."""
        if rows <= 0:
            return None
        proposals = []
        for sequence in active:
            kv = sequence.kv
            # Room for the drafts and the token after them, in the reply and in the sequence's pages.
            room = min(self.most_tokens, sequence.generation.params.max_tokens - sequence.completion_tokens - 1,
                       kv.capacity - kv.length - 1)
            if sequence.lookup is None:
                sequence.lookup = PromptLookup(sequence.generation.input_ids, self.most_tokens)
            proposals.append(sequence.lookup.propose(sequence.taken_ids, room))
        if not any(proposals):
            return None
        drafts = share_rows(proposals, rows)
        starts, row = [], 0
        for draft in drafts:
            starts.append(row)
            row += 1 + len(draft)
        return DraftStep(drafts, starts)

    def forward(self, active: list[Sequence], step: DraftStep) -> torch.Tensor:
        """Run every sequence's next token and drafts as one batch, keeping every row's logits in the step;
        return each sequence's first row's, which the step's batch chooses from as a plain step's."""
        step.logits = self.runner.decode_rows([sequence.kv for sequence in active],
                                              [[sequence.next_input[0], *draft]
                                               for sequence, draft in zip(active, step.drafts, strict=True)])
        return take_rows(step.logits, step.starts)

    def take(self, sequence: Sequence, token_id: int, logprob: TokenLogprobs | None, step: DraftStep,
             index: int) -> bool:
        """Take sequence `index`'s token chosen from its first row, then, while it equals the next draft token,
        the token its next row's sampler chooses; rewind its KV state to the tokens taken. Return whether it goes on."""
        draft, rows = step.drafts[index], step.rows_of(index)
        start = sequence.kv.length - 1 - len(draft)
        # Counted before each token goes in, so the final event of a reply that ends on it holds its count:
        # every draft is rejected until its token is taken.
        sequence.rejected_draft_tokens += len(draft)
        taken = accepted = 0
        while True:
            matched = taken < len(draft) and token_id == draft[taken]
            if matched:
                accepted += 1
                sequence.accepted_draft_tokens += 1
                sequence.rejected_draft_tokens -= 1
            goes_on = self.delivery.advance_or_fail(sequence, token_id, logprob)
            taken += 1
            if not goes_on or not matched:
                break
            try:
                token_id, logprob = self._choose(sequence, rows[taken:taken + 1])
            except Exception as exc:  # one sequence's fault fails it alone, as a single step's would
                log.exception("a sequence failed while checking its draft")
                sequence.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
                goes_on = False
                break
        self.runner.rewind(sequence.kv, start + taken)
        sequence.lookup.judged(len(draft), accepted)
        self.facts.accepted_draft_tokens = (self.facts.accepted_draft_tokens or 0) + accepted
        self.facts.rejected_draft_tokens = (self.facts.rejected_draft_tokens or 0) + len(draft) - accepted
        return goes_on

    @staticmethod
    def _choose(sequence: Sequence, row: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        """Return the token a sequence's sampler chooses from one row of logits, and its logprobs."""
        samplers = [sequence.sampler]
        with torch.inference_mode():
            row = biased(samplers, row)
            mask_logits(row, [sequence.generation.grammar])
            token_ids = sample_tokens(samplers, row)
            return token_ids[0], token_logprobs(samplers, row, token_ids)[0]
