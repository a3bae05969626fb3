"""The fused C++ layer steps (FusedCPUOps) against the torch ones (TorchOps) they replace: the
same values to float rounding for a decode row and a prompt chunk, the same cache slots written
and no others, and a slot outside the cache refused before anything is written."""

import pytest
import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.model import FusedCPUOps, RotaryEmbedding, TorchOps

CFG = ModelConfig(
    hidden_size=96,
    intermediate_size=160,
    num_layers=1,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=10,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    attention_bias=False,
)
BLOCK, NUM_BLOCKS = 4, 12
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def ops():
    return FusedCPUOps(CFG, cpu_kernels.load()), TorchOps(CFG)


def _rows(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 37])  # a decode row; a chunk split over threads
def test_norms_and_silu_match_torch(ops, rows):
    fused, reference = ops
    x, delta = _rows(rows, CFG.hidden_size, 0), _rows(rows, CFG.hidden_size, 1)
    weight = _rows(1, CFG.hidden_size, 2)[0]
    torch.testing.assert_close(fused.norm(x, weight), reference.norm(x, weight), **TOL)

    want_x, want_h = reference.add_norm(x.clone(), delta, weight)
    residual = x.clone()
    got_x, got_h = fused.add_norm(residual, delta, weight)
    assert got_x is residual  # the residual stream is updated in place
    torch.testing.assert_close(got_x, want_x, **TOL)
    torch.testing.assert_close(got_h, want_h, **TOL)

    gate_up = _rows(rows, 2 * CFG.intermediate_size, 3)
    torch.testing.assert_close(fused.silu_mul(gate_up), reference.silu_mul(gate_up), **TOL)


def _cache() -> torch.Tensor:
    # One layer's view of a block-major cache [blocks, layers, 2, block, Hkv, D], as the model
    # passes it: the page stride spans every layer.
    shape = (NUM_BLOCKS, 3, 2, BLOCK, CFG.num_kv_heads, CFG.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(9))[:, 1]


@pytest.mark.parametrize("rows", [1, 21])
def test_rope_store_matches_torch_and_writes_only_its_slots(ops, rows):
    fused, reference = ops
    width = (CFG.num_heads + 2 * CFG.num_kv_heads) * CFG.head_dim
    qkv = _rows(rows, width, 4)
    positions = torch.arange(300, 300 + rows)
    rope = RotaryEmbedding(CFG, torch.float32, torch.device("cpu")).at(positions)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=torch.Generator().manual_seed(5))[:rows]
    meta = AttentionMetadata(slot_block_ids=slots // BLOCK, slot_offsets=slots % BLOCK, plan=None)

    want_cache, got_cache = _cache(), _cache()
    want = reference.rope_store(qkv.clone(), rope, want_cache, meta)
    got = fused.rope_store(qkv.clone(), rope, got_cache, meta)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (rows, g.shape[1], CFG.head_dim)
        torch.testing.assert_close(g, w, **TOL)
    torch.testing.assert_close(got_cache, want_cache, **TOL)
    untouched = torch.ones(NUM_BLOCKS, BLOCK, dtype=torch.bool)
    untouched[meta.slot_block_ids, meta.slot_offsets] = False
    assert torch.equal(got_cache.transpose(1, 2)[untouched], _cache().transpose(1, 2)[untouched])


@pytest.mark.parametrize(("block", "offset"), [(NUM_BLOCKS, 0), (-1, 0), (0, BLOCK)])
def test_rope_store_refuses_a_slot_outside_the_cache(ops, block, offset):
    fused, _ = ops
    width = (CFG.num_heads + 2 * CFG.num_kv_heads) * CFG.head_dim
    qkv = _rows(2, width, 6)
    rope = RotaryEmbedding(CFG, torch.float32, torch.device("cpu")).at(torch.tensor([0, 1]))
    meta = AttentionMetadata(
        slot_block_ids=torch.tensor([0, block]), slot_offsets=torch.tensor([1, offset]), plan=None
    )
    cache = _cache()
    with pytest.raises(RuntimeError, match=rf"row 1: slot \({block}, {offset}\) is outside"):
        fused.rope_store(qkv.clone(), rope, cache, meta)
    assert torch.equal(cache, _cache())  # checked before any row is written
