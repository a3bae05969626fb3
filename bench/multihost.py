"""KV transfer and time to first token across separate hosts vs on one host, per backend, with
the link between the hosts limited by tc's tbf to 10 Gbit/s and to 1 Gbit/s. Root only.

Hosts are network namespaces of this machine (pdserve.netns), so the other host's bytes cross
a real link (veth, bridge, veth) and UCX has no shared memory to use: `same_host` is the usual
one-machine setup (loopback; NIXL's UCX may pick shared memory), the link names the cross-host
case.
- transfer_gb_s: a 64 MiB transfer between two processes (bench/kvtransfer.py's), 1e9 bytes/s
  over the median of the repeats.
- ttft: a 3,000-token prompt's time to first token, Decode.Generate called on a decode worker
  whose prefill worker is on its host or across the link; a new prompt each time (no prefix
  hits). kv_exposed_s is the part of it spent on KV still in flight after the prompt's last
  chunk was computed (the rest of the transfer overlapped compute), kv_hidden_fraction that
  overlap: 1 - exposed / (the prompt's KV bytes at the measured transfer rate).

Run: sudo .venv/bin/python -m bench.multihost [--rounds N]. Prints a table, then one JSON line
(the last line of stdout): {"transfer_gb_s": {backend: {link: x}}, "ttft_cross_vs_same_host":
{backend: {link: ratio}}, ...}.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import grpc

from bench.kvtransfer import BenchProcess, MiB, connect, gbps_of, measure, start_receiver
from pdserve.netns import Host, Network
from pdserve.redis_server import RedisServer
from pdserve.registry import Registry, WorkerInfo
from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc

BACKENDS = ("nixl", "tcp")
LINKS = ("10gbit", "1gbit")
PLACEMENTS = ("same_host", *LINKS)
TRANSFER_MIB = 64
TRANSFER_REPEATS = 5
PROMPT_TOKENS = 3000
# The model's KV per prompt token on the CPU (fp32): layers * (K, V) * kv heads * head dim * 4.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def measure_transfers(network: Network, sender_host: Host, receiver_host: Host) -> dict:
    """{backend: {placement: GB/s}} of TRANSFER_MIB transfers, the placements in turn."""
    pairs = {
        "same_host": (BenchProcess(fill=0), BenchProcess(fill=1)),
        "cross": (BenchProcess(0, receiver_host), BenchProcess(1, sender_host)),
    }
    for receiver, sender in pairs.values():
        receiver.ready()
        sender.ready()
        metadata, _ = receiver.call(start_receiver)
        sender.call(connect, metadata, 0)  # no gRPC sink used here
    seconds: dict = {b: {p: [] for p in PLACEMENTS} for b in BACKENDS}
    for placement in PLACEMENTS:
        receiver, sender = pairs["same_host" if placement == "same_host" else "cross"]
        limited = placement in LINKS
        with network.rate_limited(receiver_host, placement) if limited else nullcontext():
            for repeat in range(TRANSFER_REPEATS + 1):  # the first: a warm-up
                for backend in BACKENDS:
                    request_id = f"{backend}-{placement}-{repeat}"
                    elapsed = measure(receiver, sender, backend, request_id, TRANSFER_MIB)
                    if repeat > 0:
                        seconds[backend][placement].append(elapsed)
    for pair in pairs.values():
        for process in pair:
            process.stop()
    return {b: {p: gbps_of(TRANSFER_MIB * MiB, s) for p, s in by.items()}
            for b, by in seconds.items()}  # fmt: skip


class Workers:
    """pdserve worker processes of one backend, each on a host or on this machine's loopback,
    their output (UCX's protocol choices among it) in log_dir."""

    def __init__(self, redis_url: str, backend: str, log_dir: Path) -> None:
        self.redis_url, self.backend, self.log_dir = redis_url, backend, log_dir
        self.processes: list[subprocess.Popen] = []

    def start(self, role: str, host: Host | None) -> WorkerInfo:
        worker_id = f"{role}-{self.backend}-{host.name if host else 'local'}"
        command = [
            sys.executable, "-m", "pdserve.cli", role, "--redis-url", self.redis_url,
            "--port", "0", "--metrics-port", "0", "--threads", "1", "--worker-id", worker_id,
            "--kv-backend", self.backend, "--no-warmup", "--log-level", "warning",
        ]  # fmt: skip
        if host is not None:
            command = host.command([*command, "--host", host.address,
                                    "--advertise-host", host.address])  # fmt: skip
        log = (self.log_dir / f"{worker_id}.log").open("w")
        environment = {"UCX_PROTO_INFO": "y"}  # prints the transport of each operation
        self.processes.append(subprocess.Popen(
            ["env", *(f"{k}={v}" for k, v in environment.items()), *command],
            stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
        registry = Registry(self.redis_url)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if found := [w for w in registry.workers(role) if w.worker_id == worker_id]:
                return found[0]
            if self.processes[-1].poll() is not None:
                raise RuntimeError(f"{worker_id} exited; see {log.name}")
            time.sleep(0.2)
        raise TimeoutError(f"{worker_id} did not register")

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait(timeout=30)


def prompt(index: int) -> list[int]:
    """PROMPT_TOKENS token ids; each index its own from the first block on (no prefix hits)."""
    return [(13 * j + 101 * index) % 5000 + 200 for j in range(PROMPT_TOKENS)]


def first_token(decode: WorkerInfo, prefill: WorkerInfo, index: int) -> tuple[float, float]:
    """(TTFT seconds seen by the caller, the KV transfer time left after the last chunk)."""
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    request = wpb.DecodeRequest(
        prompt_token_ids=prompt(index), prefill_address=prefill.address,
        params=pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    )  # fmt: skip
    started = time.perf_counter()
    first = next(iter(stub.Generate(request, timeout=300)))
    return time.perf_counter() - started, first.ttft.kv_transfer_s


def measure_ttft(network: Network, hosts: tuple[Host, Host], redis_url: str, rounds: int,
                 log_dir: Path) -> tuple[dict, dict]:  # fmt: skip
    """({backend: {placement: median TTFT}}, {backend: {placement: median exposed KV s}})."""
    prefill_host, decode_host = hosts
    ttft: dict = {b: {p: [] for p in PLACEMENTS} for b in BACKENDS}
    exposed: dict = {b: {p: [] for p in PLACEMENTS} for b in BACKENDS}
    index = 0
    for backend in BACKENDS:
        workers = Workers(redis_url, backend, log_dir)
        try:
            pairs = {"same_host": (workers.start("prefill", None), workers.start("decode", None)),
                     "cross": (workers.start("prefill", prefill_host),
                               workers.start("decode", decode_host))}  # fmt: skip
            for _, (prefill, decode) in pairs.items():  # warm-up: first-call costs
                first_token(decode, prefill, index := index + 1)
            for _ in range(rounds):  # the placements in turn: other load hits them alike
                for placement in PLACEMENTS:
                    prefill, decode = pairs["same_host" if placement == "same_host" else "cross"]
                    limit = (network.rate_limited(decode_host, placement)
                             if placement in LINKS else nullcontext())  # fmt: skip
                    with limit:
                        seconds, kv_s = first_token(decode, prefill, index := index + 1)
                    ttft[backend][placement].append(seconds)
                    exposed[backend][placement].append(kv_s)
        finally:
            workers.stop()
    median = lambda d: {b: {p: round(statistics.median(v), 3) for p, v in by.items()}  # noqa: E731
                        for b, by in d.items()}  # fmt: skip
    return median(ttft), median(exposed)


_PUT_TABLE = re.compile(r"remote memory write by ucp_put.*?\n(?:.*\n){3}((?:.*\|.*\n)+?).*\+-")


def ucx_write_transports(log_dir: Path) -> dict[str, list[str]]:
    """The transports UCX chose for NIXL's writes, per worker: its protocol tables' Config
    column (e.g. tcp/eth0 across hosts, cma/memory on one host)."""
    found = {}
    for log in sorted(log_dir.glob("prefill-nixl-*.log")):
        rows = "".join(m.group(1) for m in _PUT_TABLE.finditer(log.read_text(errors="replace")))
        configs = {row.rsplit("|", 2)[-2].strip() for row in rows.splitlines() if "|" in row}
        found[log.stem] = sorted(c for c in configs if c and c != "Config")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="TTFT samples per placement")
    args = parser.parse_args()
    started = time.perf_counter()
    with Network() as network, tempfile.TemporaryDirectory(prefix="pdserve-multihost-") as logs:
        redis_host, prefill_host, decode_host = (network.host(n) for n in
                                                 ("redis", "prefill", "decode"))  # fmt: skip
        log_dir = Path(logs)
        with RedisServer(redis_host.address, 6379, launcher=redis_host.command([])) as redis:
            transfer = measure_transfers(network, prefill_host, decode_host)
            ttft, exposed = measure_ttft(network, (prefill_host, decode_host), redis.url,
                                         args.rounds, log_dir)  # fmt: skip
        transports = ucx_write_transports(log_dir)
    kv_bytes = PROMPT_TOKENS * KV_BYTES_PER_TOKEN
    result = {
        "transfer_gb_s": transfer,
        "ttft_cross_vs_same_host": {
            b: {link: round(ttft[b][link] / ttft[b]["same_host"], 3) for link in LINKS}
            for b in BACKENDS
        },  # fmt: skip
        "ttft_s": ttft,
        "kv_exposed_s": exposed,
        "kv_hidden_fraction": {
            b: {
                p: round(max(0.0, 1 - exposed[b][p] / (kv_bytes / (transfer[b][p] * 1e9))), 3)
                for p in PLACEMENTS
            }
            for b in BACKENDS
        },  # fmt: skip
        "ucx_write_transports": transports,
        "prompt_tokens": PROMPT_TOKENS,
        "transfer_mib": TRANSFER_MIB,
    }
    print(f"{'':>10}" + "".join(f"{p:>22}" for p in PLACEMENTS))
    for b in BACKENDS:
        print(f"{b:>10}" + "".join(
            f"{transfer[b][p]:>8.3f} GB/s {ttft[b][p]:>6.2f} s" for p in PLACEMENTS))  # fmt: skip
    print(f"({time.perf_counter() - started:.0f} s)")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
