"""The KV cache layout header: what both ends of a transfer must agree on before a byte moves."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from engine import kv_quant

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int8: "int8",
}
_ITEM_SIZES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}

# kv_cache: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim], contiguous,
# so block b is the byte range [b * bytes_per_block, (b + 1) * bytes_per_block). An int8 cache's
# rows carry their scale after the values (engine/kv_quant.py): head_dim + 2 bytes each.
KV_CACHE_NDIM = 6


@dataclass(frozen=True, slots=True)
class KVLayout:
    model_id: str
    dtype: str  # "float32" | "bfloat16" | "float16" | "int8": the cache's, which both ends share
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in _ITEM_SIZES:
            raise ValueError(f"dtype must be one of {sorted(_ITEM_SIZES)}, got {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def bytes_per_block(self) -> int:
        rows = self.num_layers * 2 * self.block_size * self.num_kv_heads
        width = kv_quant.row_width(self.head_dim, quantized=self.dtype == "int8")
        return rows * width * _ITEM_SIZES[self.dtype]

    def mismatch(self, other: KVLayout) -> str | None:
        """Every differing field as 'field: expected <self>, got <other>'; None when equal."""
        diffs = [
            f"{f.name}: expected {getattr(self, f.name)}, got {getattr(other, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        return "; ".join(diffs) or None

    @classmethod
    def of(cls, model_id: str, kv_cache: torch.Tensor) -> KVLayout:
        if kv_cache.ndim != KV_CACHE_NDIM or kv_cache.shape[2] != 2:
            raise ValueError(
                "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got shape {tuple(kv_cache.shape)}"
            )
        if kv_cache.dtype not in DTYPE_NAMES:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not one of {list(DTYPE_NAMES)}")
        _, num_layers, _, block_size, num_kv_heads, width = kv_cache.shape
        dtype = DTYPE_NAMES[kv_cache.dtype]
        head_dim = width - kv_quant.SCALE_BYTES if dtype == "int8" else width
        return cls(
            model_id=model_id,
            dtype=dtype,
            block_size=block_size,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """Parse a peer's layout; raises ValueError on anything malformed (it is network input)."""
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"malformed KV layout {data!r}: {e}") from e
