"""One step's model work: flatten a scheduled batch into model inputs, run the forward, and
compute logits only for the rows that need them.

The rows that need logits are each sampling sequence's last token and, for requests that asked
for prompt log-probs, the prompt positions of this chunk; a prefill chunk of 500 tokens that does
not finish its prompt needs none. In a pure decode step every row samples, so the hidden states
and the logits are used as they are (no row selection copies).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from rollout.engine.config import InferenceConfig
from rollout.engine.cuda_graphs import DecodeGraphs
from rollout.engine.scheduler import ScheduledBatch
from rollout.engine.sequence import Sequence
from rollout.models import batch_invariant as bi
from rollout.models.attention import PagedAttentionMetadata

log = logging.getLogger(__name__)


@dataclass
class PreparedBatch:
    """One step's inputs as host lists; device tensors are made by the path that runs it."""

    tokens: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    device: torch.device | str | None
    logit_rows: list[int]  # rows of hidden whose logits are needed
    sample_at: list[int]  # index into logit rows of each sampling sequence
    samplers: list[Sequence]
    prompt_lp: list[tuple[Sequence, int, int, int]]  # (seq, first logit row, start pos, count)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_only(self) -> bool:
        """One token per row, every row samples, no prompt log-probs: logits rows = rows."""
        return len(self.tokens) == len(self.query_lens) == len(self.samplers) and not self.prompt_lp

    def to_device(
        self, attention_backend: str = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        meta = PagedAttentionMetadata.from_lists(self.query_lens, self.context_lens,
                                                 self.block_tables, self.block_size, self.device,
                                                 backend=attention_backend)  # fmt: skip
        ids = torch.tensor(self.tokens, dtype=torch.int64, device=self.device)
        positions = torch.tensor(self.positions, dtype=torch.int64, device=self.device)
        return ids, positions, meta


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
    return PreparedBatch(ids, positions, q_lens, ctx_lens, tables, block_size, device,
                         logit_rows, sample_at, samplers, prompt_lp)  # fmt: skip


class ModelRunner:
    """Runs `model` (rollout.models.DecoderLM or compatible) over prepared batches; pure-decode
    steps go through `graphs` (rollout.engine.cuda_graphs) when the engine set it. Attention
    runs on `attention_backend` ("torch" or "flex", InferenceConfig.resolve_attention_backend)."""

    def __init__(
        self, model: nn.Module, graphs: DecodeGraphs | None = None, attention_backend: str = "torch"
    ) -> None:
        self.model = model
        self.graphs = graphs
        self.attention_backend = attention_backend

    def logits(
        self, prep: PreparedBatch, kv_cache: torch.Tensor,
        routes: list[torch.Tensor] | None = None,
        replay: tuple[torch.Tensor, torch.Tensor] | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """Logits [len(prep.logit_rows), V] in logit-row order (None when no row needs them);
        the new tokens' K/V land in kv_cache. `routes` (routing replay) receives each MoE
        layer's experts [prep.num_tokens, k]; `replay` (experts, mask) routes recomputed
        positions to their recorded experts (eager path: decode rows are never replayed).
        `token_ids`, a device tensor, replaces `prep.tokens` (async scheduling: the previous
        step's samples, which the host has not read yet).

        A step that fails on the flex backend (a kernel the device or compiler refuses) is
        rerun on the torch backend, which the runner keeps from then on: it costs speed, never
        the engine. The rerun rewrites the K/V the failed try wrote, with the same values."""
        try:
            return self._logits(prep, kv_cache, routes, replay, token_ids)
        except Exception:
            if self.attention_backend != "flex":
                raise
            log.exception("flex attention failed; attention runs on the torch backend from now on")
            self.attention_backend = "torch"
            if self.graphs is not None:
                self.graphs.clear()
                self.graphs.attention_backend = "torch"
            return self._logits(prep, kv_cache, routes, replay, token_ids)

    def _logits(
        self, prep: PreparedBatch, kv_cache: torch.Tensor,
        routes: list[torch.Tensor] | None = None,
        replay: tuple[torch.Tensor, torch.Tensor] | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        graphs = self.graphs
        if (
            graphs is not None
            and prep.decode_only
            and replay is None
            and graphs.accepts(len(prep.tokens), max(map(len, prep.block_tables)))
        ):
            try:
                return graphs.logits(prep.tokens, prep.positions, prep.context_lens,
                                     prep.block_tables, prep.block_size, kv_cache, routes,
                                     token_ids)  # fmt: skip
            except Exception:  # a capture the device refuses costs speed, never the engine
                if self.attention_backend == "flex":
                    raise  # flex may be to blame: `logits` retries on the torch backend first
                log.exception("CUDA graph decode failed; decoding eagerly from now on")
                graphs.clear()
                self.graphs = None
        input_ids, positions, meta = prep.to_device(self.attention_backend)
        if token_ids is not None:
            input_ids = token_ids
        if routes is None:
            hidden = self.model.forward_paged(input_ids, positions, meta, kv_cache)
        else:
            routes.clear()  # a failed graph replay may have left some
            hidden = self.model.forward_paged(input_ids, positions, meta, kv_cache,
                                              routes=routes, replay=replay)  # fmt: skip
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


def serving_model(
    model: nn.Module, config: InferenceConfig
) -> tuple[nn.Module, torch.device, torch.dtype]:
    """`model` checked for what an engine needs (.config, .forward_paged, no sliding window
    shorter than a sequence), moved to the config's device and dtype, in eval mode and in the
    config's batch-invariant mode; with that device and dtype. ValueError naming the misfit."""
    model_config = getattr(model, "config", None)
    if model_config is None or not hasattr(model, "forward_paged"):
        raise ValueError(
            "model must expose .config and .forward_paged (rollout.models.DecoderLM; "
            "rollout.models.from_transformers converts a transformers model)"
        )
    window = getattr(model_config, "sliding_window", None)
    if window is not None and window < config.max_sequence_length:
        raise ValueError(
            f"the model's sliding_window={window} is shorter than max_sequence_length="
            f"{config.max_sequence_length}: sliding-window attention is not supported; "
            f"serve at most {window} tokens per sequence"
        )
    param = next(model.parameters())
    device = torch.device(config.device) if config.device is not None else param.device
    dtype = config.torch_dtype or param.dtype
    if param.device != device or param.dtype != dtype:
        model.to(device=device, dtype=dtype)
    model = model.eval()
    set_batch_invariant(model, config.batch_invariant, dtype, device)
    return model, device, dtype


def set_batch_invariant(
    model: nn.Module, on: bool, dtype: torch.dtype, device: torch.device
) -> None:
    """Switch `model` to the batch-invariant ops after checking this machine gives them
    (rollout.models.batch_invariant.check_machine raises BatchInvariantUnsupported naming the
    op), or back to the default ops; ValueError for a model without the mode."""
    if not on:
        if hasattr(model, "batch_invariant"):
            model.batch_invariant = False
        return
    if not hasattr(model, "batch_invariant"):
        raise ValueError(
            "InferenceConfig.batch_invariant needs a rollout.models.DecoderLM "
            f"(got {type(model).__name__})"
        )
    bi.check_machine(dtype, device)
    model.batch_invariant = True
