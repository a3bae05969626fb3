"""The device setting end to end on the CPU: resolution and validation, where the tensors live
(in process and in worker processes started with --device cpu / PDSERVE_DEVICE=cpu), the static
decode step that CUDA graphs replay (run eagerly here), and the backend self-check.

The tests detect the machine: what holds only where torch sees no CUDA device is skipped on a
CUDA host, which checks the matching positive behaviour instead (auto picks cuda:0 in bfloat16,
cuda is accepted, a device index past the last one is refused)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from engine import LLM, EngineConfig, InvalidRequestError, SamplingParams
from engine.attention import (
    AttentionSpec,
    BackendUnusableError,
    TorchSDPABackend,
    check_against_sdpa,
)
from engine.attention_choice import select_backend
from engine.cuda_graphs import DecodeGraphs
from pdserve.cli import app
from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from tests.cluster import Cluster

NO_CUDA = f"torch {torch.__version__} sees no CUDA device"
HAS_CUDA = torch.cuda.is_available()
NUM_CUDA = torch.cuda.device_count() if HAS_CUDA else 0
no_cuda_only = pytest.mark.skipif(
    HAS_CUDA, reason="asserts the behaviour where torch sees no CUDA device; this host has one"
)
cuda_only = pytest.mark.skipif(
    not HAS_CUDA, reason="asserts the behaviour where torch sees a CUDA device; this host has none"
)


@no_cuda_only
def test_auto_picks_the_cpu_here_with_float32():
    assert not torch.cuda.is_available()
    for config in (EngineConfig(), EngineConfig(device="auto", dtype="auto")):
        assert (config.device, config.dtype) == ("cpu", "float32")
    assert EngineConfig(device="cpu", dtype="bfloat16").dtype == "bfloat16"


@cuda_only
def test_auto_picks_the_first_cuda_device_with_bfloat16():
    for config in (EngineConfig(), EngineConfig(device="auto", dtype="auto")):
        assert (config.device, config.dtype) == ("cuda:0", "bfloat16")
    assert (EngineConfig(device="cuda").device, EngineConfig(device="cuda:0").device) == (
        "cuda:0",
        "cuda:0",
    )
    assert (EngineConfig(device="cpu").device, EngineConfig(device="cpu").dtype) == (
        "cpu",
        "float32",
    )


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("gpu", "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        ("cuda:x", "device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
        ("cuda:01", "device must be auto, cpu, cuda or cuda:N, got 'cuda:01'"),
        ("CPU", "device must be auto, cpu, cuda or cuda:N, got 'CPU'"),
        pytest.param("cuda", f"device cuda asked for, but {NO_CUDA}", marks=no_cuda_only),
        pytest.param("cuda:1", f"device cuda:1 asked for, but {NO_CUDA}", marks=no_cuda_only),
        pytest.param(
            f"cuda:{NUM_CUDA}",
            f"device cuda:{NUM_CUDA} asked for, but torch sees {NUM_CUDA} CUDA device(s): "
            f"cuda:0..cuda:{NUM_CUDA - 1}",
            marks=cuda_only,
            id="cuda:past-the-last",
        ),
    ],
)
def test_bad_or_absent_devices_are_refused_with_the_reason(device, message):
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}"):
        EngineConfig(device=device)


def _plain(output: str) -> str:
    """Typer's error box without its frame and line breaks."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())


def test_the_cli_refuses_a_bad_device_before_starting_a_worker():
    runner = CliRunner()
    flag = runner.invoke(app, ["prefill", "--device", "gpu"])
    assert flag.exit_code == 2
    assert (
        "Invalid value for '--device' (env var: 'PDSERVE_DEVICE'): device must be auto, cpu, "
        "cuda or cuda:N, got 'gpu'"
    ) in _plain(flag.output)
    if HAS_CUDA:  # cuda is there: a device past the last one is the absent one
        absent = f"cuda:{NUM_CUDA}"
        reason = f"torch sees {NUM_CUDA} CUDA device(s): cuda:0..cuda:{NUM_CUDA - 1}"
    else:
        absent, reason = "cuda", NO_CUDA
    env = runner.invoke(app, ["decode"], env={"PDSERVE_DEVICE": absent})
    assert env.exit_code == 2
    assert f"device {absent} asked for, but {reason}" in _plain(env.output)


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_weights_kv_cache_and_backend_live_on_the_cpu(llm):
    runner = llm.engine.runner
    assert {t.device for t in runner.model.tensors()} == {torch.device("cpu")}
    assert {t.dtype for t in runner.model.tensors()} == {torch.float32}
    assert (runner.kv_cache.device, runner.kv_cache.dtype) == (torch.device("cpu"), torch.float32)
    assert runner.attention.name == "cpu_paged"  # decode reads the paged cache in place
    assert runner.graphs is None  # CUDA graphs are a no-op on the CPU
    info = "pdserve_engine_tensors_info"
    assert _sample(info, device="cpu", dtype="float32", tensor="weights") == 1.0
    assert _sample(info, device="cpu", dtype="float32", tensor="kv_cache") == 1.0
    assert _sample("pdserve_engine_attention_info", backend="cpu_paged", cuda_graphs="off") == 1.0


def test_each_paged_backend_needs_its_device():
    spec = AttentionSpec(9, 3, 64, 16, torch.bfloat16, torch.device("cpu"))
    for name in ("flashinfer", "flash_attn"):
        with pytest.raises(ValueError, match=f"^attention_backend {name} needs a CUDA device"):
            select_backend(name, spec)
    assert select_backend("auto", spec).name == "cpu_paged"
    on_cuda = AttentionSpec(9, 3, 64, 16, torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match="^attention_backend cpu_paged needs a CPU device"):
        select_backend("cpu_paged", on_cuda)


def test_an_int8_cache_decodes_through_sdpa():
    spec = AttentionSpec(9, 3, 64, 16, torch.float32, torch.device("cpu"), kv_quantized=True)
    assert select_backend("auto", spec).name == "sdpa"
    with pytest.raises(BackendUnusableError, match="^reads a float KV cache"):
        select_backend("cpu_paged", spec)


class _OffByOne(TorchSDPABackend):
    """A backend that attends one position short: the self-check must catch it."""

    def forward(self, q, layer_cache, plan, new_k, new_v):
        return super().forward(q, layer_cache, plan, new_k, new_v).roll(1, dims=0)


def test_self_check_rejects_a_backend_that_disagrees_with_sdpa():
    spec = AttentionSpec(9, 3, 64, 16, torch.float32, torch.device("cpu"))
    check_against_sdpa(TorchSDPABackend(spec), atol=1e-6)  # SDPA agrees with itself
    with pytest.raises(BackendUnusableError, match="^self-check against SDPA failed"):
        check_against_sdpa(_OffByOne(spec), atol=3e-2)


PROMPTS = ["1, 2, 3, 4,", "The capital of France is", "Hello, my name is Tom and I"]


def test_static_decode_steps_match_eager_decode_and_pad_into_the_scratch_block(llm):
    """The graphs' path without capture: 3 decodes padded to a batch of 4, static buffers,
    the SDPA static plan. Greedy tokens must equal the eager path's."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = [o.token_ids for o in llm.generate(PROMPTS, params)]
    runner = llm.engine.runner
    scratch = runner._kv_storage[runner.scratch_block]
    scratch.zero_()
    sdpa = TorchSDPABackend(runner.attention.spec)  # the backend with a static (graph) plan
    graphs = DecodeGraphs(
        runner.model, sdpa, runner._kv_storage, (1, 4), max_blocks=64,
        block_size=runner.config.block_size, pad_block=runner.scratch_block, capture=False,
    )  # fmt: skip
    runner.graphs = graphs
    runner.set_cuda_graphs(True)
    try:
        static = [o.token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        runner.graphs = None
        runner.set_cuda_graphs(False)
    assert static == eager
    assert set(graphs._steps) == {(4, 16)}  # every decode step: 3 rows padded to 4, width 16
    assert scratch.abs().sum() > 0  # the padding row wrote there, and nowhere else
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_warm_up_and_capture_steps_decode_only_in_the_scratch_block(llm):
    """capture_all's steps (what CUDA graphs capture, run eagerly here): every row a padding
    row, so the scratch block is written and not one block of the pool."""
    runner = llm.engine.runner
    storage = runner._kv_storage
    pool_before = storage[: runner.scratch_block].clone()
    storage[runner.scratch_block].zero_()
    graphs = DecodeGraphs(
        runner.model, TorchSDPABackend(runner.attention.spec), storage, (1, 2, 8), max_blocks=64,
        block_size=runner.config.block_size, pad_block=runner.scratch_block, capture=False,
    )  # fmt: skip
    graphs.capture_all()
    assert set(graphs._steps) == {(1, 16), (2, 16), (8, 16)}
    for (batch_size, _), step in graphs._steps.items():
        pad = runner.scratch_block
        assert step.ints.tolist() == [[0] * batch_size, [0] * batch_size, [pad] * batch_size,
                                      [0] * batch_size]  # fmt: skip
    assert storage[runner.scratch_block].abs().sum() > 0
    assert torch.equal(storage[: runner.scratch_block], pool_before)


@cuda_only
def test_cuda_graph_replays_give_the_eager_steps_tokens():
    """The captured graphs (fp32 on CUDA, SDPA's static plan) against the same engine's eager
    decode steps: equal greedy tokens, batch sizes padded as captured."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(device="cuda", dtype="float32", num_threads=2, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.batch_sizes == (1, 2, 4)
    graphed = [o.token_ids for o in llm.generate(PROMPTS, params)]
    runner.set_cuda_graphs(False)
    eager = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert graphed == eager
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


@pytest.fixture(scope="module")
def cpu_workers():
    """A prefill worker given --device cpu, a decode worker given PDSERVE_DEVICE=cpu."""
    cluster = Cluster(kv_backend="tcp")
    try:
        prefill = cluster.start("prefill", "--device", "cpu", wait=False)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("PDSERVE_DEVICE", "cpu")
            decode = cluster.start("decode", wait=False)
        cluster.wait_all_registered()
        yield prefill, decode
    finally:
        cluster.stop()


def test_workers_given_cpu_hold_their_tensors_on_the_cpu_and_serve(cpu_workers, llm):
    for worker in cpu_workers:
        info = "pdserve_engine_tensors_info"
        assert worker.metric(info, device="cpu", dtype="float32", tensor="weights") == 1.0
        assert worker.metric(info, device="cpu", dtype="float32", tensor="kv_cache") == 1.0
        assert worker.metric(
            "pdserve_engine_attention_info", backend="cpu_paged", cuda_graphs="off"
        )
        assert worker.metric("pdserve_kv_transfer_memory_info", backend="tcp", memory="DRAM")
    prefill, decode = cpu_workers
    prompt = llm.tokenizer.encode(PROMPTS[0])
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    request = wpb.DecodeRequest(
        prompt_token_ids=prompt,
        params=pb.SamplingParams(max_tokens=4, temperature=0.0),
        prefill_address=prefill.address,
    )
    tokens = [t for m in stub.Generate(request, timeout=300) for t in m.token_ids]
    assert tokens == [216, 37, 28, 216]  # " 5, " as the in-process engine generates it


def test_the_gpu_check_runs_its_smoke_mode_on_the_cpu():
    """bench/gpu_check.py --smoke: every section runs (tiny sizes) and the last line is JSON.
    CUDA_VISIBLE_DEVICES="" hides any GPU, so this is the CPU run on every host."""
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=600,
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["device"], result["smoke"]) == ("cpu", True)
    parity = result["parity"]
    assert (parity["fp32_token_exact"], parity["bf16_top1_agreement"], parity["ok"]) == (
        "2/2",
        1.0,
        True,
    )
    assert [(r["model"], r["tokens"]) for r in result["prefill"]] == [
        ("tiny-llama", 64), ("tiny-llama", 160), ("tiny-llama-wide", 64), ("tiny-llama-wide", 160),
    ]  # fmt: skip
    assert [(r["batch"], r["graphs_tokens_per_s"]) for r in result["decode"]] == [
        (1, None), (4, None),  # CUDA graphs are a no-op on the CPU
    ]  # fmt: skip
    transfers = [
        (r["backend"], r.get("mib"), r.get("bytes_equal", r.get("error")))
        for r in result["kv_transfer"]
    ]
    # `make setup` installs NIXL; a machine without it (a GPU image, say) reports why instead.
    nixl = (
        [("nixl", 1, True), ("nixl", 4, True)]
        if any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13"))
        else [("nixl", None, "ModuleNotFoundError: No module named 'nixl_cu13'")]
    )
    assert transfers == [*nixl, ("tcp", 1, True), ("tcp", 4, True)]
