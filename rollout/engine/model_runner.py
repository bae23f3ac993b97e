"""One step's model work: flatten a scheduled batch into model inputs, run the forward, and
compute logits only for the rows that need them.

The rows that need logits are each sampling sequence's last token and, for requests that asked
for prompt log-probs, the prompt positions of this chunk; a prefill chunk of 500 tokens that does
not finish its prompt needs none. In a pure decode step every row samples, so the hidden states
and the logits are used as they are (no row selection copies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rollout.engine.scheduler import ScheduledBatch
from rollout.engine.sequence import Sequence
from rollout.models.attention import PagedAttentionMetadata


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: PagedAttentionMetadata
    logit_rows: list[int]  # rows of hidden whose logits are needed
    sample_at: list[int]  # index into logit rows of each sampling sequence
    samplers: list[Sequence]
    prompt_lp: list[tuple[Sequence, int, int, int]]  # (seq, first logit row, start pos, count)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def prepare_batch(
    batch: ScheduledBatch, block_size: int, device: torch.device | str | None
) -> PreparedBatch:
    """Tokens, positions, paged metadata and logit rows of `batch` (reads the sequences only)."""
    ids: list[int] = []
    positions: list[int] = []
    q_lens, ctx_lens, tables = [], [], []
    logit_rows: list[int] = []
    sample_at: list[int] = []
    samplers: list[Sequence] = []
    prompt_lp = []
    row = 0
    for seq, n in batch:
        c = seq.num_computed
        ids.extend(seq.tokens[c : c + n])
        positions.extend(range(c, c + n))
        q_lens.append(n)
        ctx_lens.append(c + n)
        tables.append(seq.block_table)
        if seq.wants_prompt_log_probs:
            # logits at position p score prompt token p + 1
            count = max(0, min(c + n, seq.request.prompt_length - 1) - c)
            if count:
                prompt_lp.append((seq, len(logit_rows), c, count))
                logit_rows.extend(range(row, row + count))
        if c + n == len(seq.tokens):
            sample_at.append(len(logit_rows))
            logit_rows.append(row + n - 1)
            samplers.append(seq)
        row += n
    meta = PagedAttentionMetadata.from_lists(q_lens, ctx_lens, tables, block_size, device)
    return PreparedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta,
        logit_rows=logit_rows,
        sample_at=sample_at,
        samplers=samplers,
        prompt_lp=prompt_lp,
    )


class ModelRunner:
    """Runs `model` (rollout.models.DecoderLM or compatible) over prepared batches."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def logits(self, prep: PreparedBatch, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """Logits [len(prep.logit_rows), V] in logit-row order (None when no row needs them);
        the new tokens' K/V land in kv_cache."""
        hidden = self.model.forward_paged(prep.input_ids, prep.positions, prep.meta, kv_cache)
        rows = prep.logit_rows
        if not rows:
            return None
        if len(rows) != prep.num_tokens or rows != list(range(len(rows))):
            index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
            hidden = hidden.index_select(0, index)
        return self.model.compute_logits(hidden)

    @staticmethod
    def sampling_logits(prep: PreparedBatch, logits: torch.Tensor) -> torch.Tensor:
        """The logits of each sampling sequence, in `prep.samplers` order."""
        at = prep.sample_at
        if len(at) == logits.shape[0] and at == list(range(len(at))):
            return logits
        return logits.index_select(0, torch.tensor(at, dtype=torch.long, device=logits.device))
