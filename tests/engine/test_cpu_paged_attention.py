"""The CPU paged decode kernel against SDPA: any context length (one block, a partial last block,
several 256-token chunks), scattered block tables, the real cache's page stride, mixed steps."""

import pytest
import torch

from engine.attention import AttentionSpec, StepLayout, TorchSDPABackend, gather_kv
from engine.cpu_paged_backend import CPUPagedBackend

BLOCK = 16
NUM_BLOCKS = 160
LAYERS = 3  # the layer view keeps the block-major cache's page stride


def _spec(dtype=torch.float32) -> AttentionSpec:
    return AttentionSpec(9, 3, 64, BLOCK, dtype, torch.device("cpu"))


def _step(spec, layout, seed=0):
    """A random cache, queries and the fresh K/V of each request's queries (already cached)."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, LAYERS, 2, BLOCK, spec.num_kv_heads, spec.head_dim)
    layer = torch.randn(shape, generator=g).to(spec.dtype)[:, 1]
    q = torch.randn(sum(layout.query_lens), spec.num_heads, spec.head_dim, generator=g)
    q = q.to(spec.dtype)
    ks, vs = [], []
    for i, n in enumerate(layout.query_lens):
        context = layout.context_lens[i]
        k, v = gather_kv(layer, torch.tensor(layout.block_tables[i]), context, spec.dtype)
        ks.append(k[context - n :])
        vs.append(v[context - n :])
    return q, layer, torch.cat(ks), torch.cat(vs)


def _tables(context_lens, seed=1):
    """Scattered, non-overlapping blocks for each request."""
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for context in context_lens:
        n = -(-context // BLOCK)
        tables.append(order[:n])
        order = order[n:]
    return tables


@pytest.fixture(scope="module")
def backends():
    spec = _spec()
    return CPUPagedBackend(spec), TorchSDPABackend(spec)


def _both(backends, layout, seed=0):
    paged, sdpa = backends
    q, layer, k, v = _step(paged.spec, layout, seed)
    got = paged.forward(q, layer, paged.plan(layout), k, v)
    want = sdpa.forward(q, layer, sdpa.plan(layout), k, v)
    return got, want


@pytest.mark.parametrize("contexts", [[1], [2], [16], [17], [255, 256, 257], [1000, 3, 600]])
def test_decode_matches_sdpa_at_every_context_length(backends, contexts):
    layout = StepLayout([1] * len(contexts), contexts, _tables(contexts))
    got, want = _both(backends, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_mixed_step_runs_prefills_through_sdpa_and_decodes_through_the_kernel(backends):
    # A fresh prompt, a chunk after 300 cached tokens, and two decodes.
    contexts = [40, 308, 700, 33]
    layout = StepLayout([40, 8, 1, 1], contexts, _tables(contexts, seed=2))
    got, want = _both(backends, layout, seed=3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [128, 32])  # the other vectorized size; the generic loops
def test_other_head_sizes_match_sdpa(head_dim):
    spec = AttentionSpec(8, 2, head_dim, BLOCK, torch.float32, torch.device("cpu"))
    paged, sdpa = CPUPagedBackend(spec), TorchSDPABackend(spec)
    contexts = [1, 3, 16, 37, 300]  # keys in fours, a remainder, whole and partial blocks
    layout = StepLayout([1] * len(contexts), contexts, _tables(contexts, seed=6))
    q, layer, k, v = _step(spec, layout, seed=7)
    got = paged.forward(q, layer, paged.plan(layout), k, v)
    want = sdpa.forward(q, layer, sdpa.plan(layout), k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_cache_matches_sdpa_within_bf16_rounding():
    spec = _spec(torch.bfloat16)
    paged, sdpa = CPUPagedBackend(spec), TorchSDPABackend(spec)
    contexts = [300, 20]
    layout = StepLayout([1, 1], contexts, _tables(contexts, seed=4))
    q, layer, k, v = _step(spec, layout, seed=5)
    got = paged.forward(q, layer, paged.plan(layout), k, v)
    want = sdpa.forward(q, layer, sdpa.plan(layout), k, v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_kernel_refuses_tensors_it_cannot_read(backends):
    paged, _ = backends
    kernel = paged._kernel
    q = torch.randn(1, 9, 64)
    layer = torch.randn(4, 2, BLOCK, 3, 64)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block tables and lengths are int32"):
        kernel.paged_decode_attention(q, layer, torch.tensor([[0]]), lens)
    with pytest.raises(RuntimeError, match="each block of the layer view must be contiguous"):
        heads_major = torch.randn(4, 2, 3, BLOCK, 64).transpose(2, 3)  # same shape, other strides
        kernel.paged_decode_attention(q, heads_major, torch.tensor([[0]], dtype=torch.int32), lens)
