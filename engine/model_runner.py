"""The model runner: owns the weights and the KV cache tensor; turns a scheduled batch into one
forward pass and the sampled next tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import AttentionMetadata, PrefillSegment, select_backend
from engine.config import EngineConfig, ModelConfig
from engine.model import LlamaModel
from engine.request import Request
from engine.sampling import sample

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def completes_pass(self) -> bool:
        """After this step the request has KV for all its tokens and needs a next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: Path) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.model = LlamaModel(model_config, model_dir, self.dtype, self.device)
        self.attention = select_backend(config.attention_backend, self.device)
        self.kv_cache = torch.zeros(
            config.num_blocks,
            model_config.num_layers,
            2,
            config.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def execute(self, batch: list[ScheduledRequest]) -> dict[str, int]:
        """Runs one forward pass over the batch; returns the next token of every request whose
        pass completed in this step."""
        sampled, logits = self.forward(batch)
        if not sampled:
            return {}
        token_ids = sample(logits, [r.params for r in sampled], [r.generator for r in sampled])
        return {r.request_id: t for r, t in zip(sampled, token_ids, strict=True)}

    def forward(self, batch: list[ScheduledRequest]) -> tuple[list[Request], torch.Tensor]:
        """Writes the batch's new KV into the cache; returns the requests that need a next token
        and their last-position logits [n, vocab] (float32)."""
        input_ids, positions, meta = self._prepare(batch)
        rows, sampled = [], []
        token_end = 0
        for item in batch:
            token_end += item.num_new_tokens
            if item.completes_pass:
                rows.append(token_end - 1)
                sampled.append(item.request)
        logit_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.forward(
            input_ids, positions, self.kv_cache, meta, self.attention, logit_rows
        )
        return sampled, logits

    def _prepare(self, batch: list[ScheduledRequest]):
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_block_ids: list[int] = []  # the block each new token's KV goes to
        prefills: list[PrefillSegment] = []
        decode_rows: list[int] = []
        decode_requests: list[Request] = []
        for item in batch:
            r, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            token_start = len(input_ids)
            input_ids.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            slot_block_ids.extend(r.block_ids[p // bs] for p in range(start, end))
            if item.num_new_tokens == 1 and start > 0:
                decode_rows.append(token_start)
                decode_requests.append(r)
            else:
                table = torch.tensor(r.block_ids[: -(-end // bs)], device=self.device)
                prefills.append(PrefillSegment(token_start, len(input_ids), start, table))
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_block_ids=torch.tensor(slot_block_ids, dtype=torch.long, device=self.device),
            slot_offsets=pos % bs,
            prefills=prefills,
            **self._decode_metadata(decode_rows, decode_requests),
        )
        return torch.tensor(input_ids, dtype=torch.long, device=self.device), pos, meta

    def _decode_metadata(self, rows: list[int], requests: list[Request]) -> dict:
        bs = self.config.block_size
        context_lens = [r.num_computed_tokens + 1 for r in requests]
        max_blocks = max((-(-n // bs) for n in context_lens), default=0)
        # Padding points at block 0; the mask hides it.
        tables = [r.block_ids[: -(-n // bs)] for r, n in zip(requests, context_lens, strict=True)]
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        lens = torch.tensor(context_lens, dtype=torch.long)
        mask = None
        if requests:
            mask = torch.arange(max_blocks * bs).unsqueeze(0) < lens.unsqueeze(1)
            mask = mask[:, None, None, :].to(self.device)
        return {
            "decode_token_ids": torch.tensor(rows, dtype=torch.long, device=self.device),
            "decode_block_tables": torch.tensor(tables, dtype=torch.long, device=self.device)
            if tables
            else torch.empty(0, 0, dtype=torch.long, device=self.device),
            "decode_context_lens": lens.to(self.device),
            "decode_mask": mask,
        }
