"""pdserve vs llama.cpp's llama-server: the same GGUF, the same machine, the same guidellm load.

One run builds llama-server once (from the llama.cpp vendored in the llama-cpp-python sdist,
Release, CPU only, cached under ~/.cache/pdserve), then, one system at a time so they never
share the cores, starts each system on a free port, sends it one untimed warm-up request,
drives it with guidellm (synthetic prompts of --prompt-tokens tokens asking for exactly
--output-tokens, a concurrent profile of --streams streams, --requests requests), and stops it
(its whole process group).

llama-server gets one slot per stream (--parallel), a context of slots x (prompt + output +
margin) tokens so every slot holds a whole request, and --threads threads (default: all cores,
as many as `pdserve up` divides among its workers). guidellm runs from its own venv with
HF_HUB_OFFLINE=1 and the tokenizer pdserve converts from the GGUF.

Metrics, from guidellm's per-request records (its JSON report), not its aggregates:
- successful / errored: the numbers of successful and errored requests (incomplete ones, cut
  by --max-seconds, count as neither).
- req_per_s: successful requests / (last successful request's end - first request's start).
- output_tok_per_s: the successful requests' output tokens over the same span.
- ttft_p50_s, ttft_p99_s: time to first token of the successful requests (first token's time -
  request start), nearest-rank percentiles.
- itl_p50_ms: median over successful requests with at least 2 output tokens of
  (latency - ttft) / (output_tokens - 1), the mean gap between a request's tokens.
- ratios: pdserve / llama-server of req_per_s, output_tok_per_s, ttft_p50_s and itl_p50_ms
  (above 1 means pdserve is faster for the first two, slower for the last two).

Prints progress to stderr and, as the last line of stdout, one JSON object: per system the
metrics above, "ratios" and the run's settings. Not part of `make test`: it builds llama.cpp
(~10 min on 2 cores, once) and installs guidellm (once).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# bench/engine.py would shadow the engine package: import from the repository root instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import httpx  # noqa: E402

from engine.model_files import DEFAULT_MODEL, cache_root, gguf_source, resolve_model  # noqa: E402
from pdserve.redis_server import free_port  # noqa: E402

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
GUIDELLM = "guidellm==0.8.1"
TORCH = "torch==2.13.0"  # guidellm requires torch: pinned and installed alone, first (CPU build)
SYSTEMS = ("llama-server", "pdserve")
HOST = "127.0.0.1"
CONTEXT_MARGIN_TOKENS = 64  # chat template and special tokens around the synthetic prompt
STARTUP_TIMEOUT_S = 900.0  # pdserve converts the GGUF and warms every length bucket first


@dataclass(frozen=True, slots=True)
class Load:
    streams: int
    requests: int
    prompt_tokens: int
    output_tokens: int
    max_seconds: float


@dataclass(frozen=True, slots=True)
class Summary:
    req_per_s: float
    output_tok_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_ms: float | None
    successful: int
    errored: int


def log(message: str) -> None:
    print(f"[vs_llamacpp] {message}", file=sys.stderr, flush=True)


def run_logged(args: Sequence[str | Path], what: str, log_path: Path, **kwargs: Any) -> None:
    """Runs a set-up step with its output in log_path; raises with the log's tail on failure."""
    log(f"{what} (log: {log_path})")
    started_s = time.monotonic()
    log_path.parent.mkdir(parents=True, exist_ok=True)  # a fresh machine has no cache yet
    with log_path.open("ab") as out:
        rc = subprocess.run([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT,
                            check=False, **kwargs).returncode  # fmt: skip
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{what} failed (exit {rc}):\n{tail}")
    log(f"{what}: done in {time.monotonic() - started_s:.0f} s")


# --- llama-server: built once --------------------------------------------------------------


def llama_server_binary() -> Path:
    """The cached llama-server, built first when missing."""
    root = cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON.split('==')[1]}"
    binary = root / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    source = _vendored_llama_cpp(root)
    cmake = _cmake(root)
    build_log = root / "build.log"
    started_s = time.monotonic()
    run_logged([cmake, "-S", source, "-B", root / "build", "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_CUDA=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF"],
               "llama.cpp: cmake configure", build_log)  # fmt: skip
    jobs = str(os.cpu_count() or 1)
    run_logged([cmake, "--build", root / "build", "--config", "Release", "--target",
                "llama-server", f"-j{jobs}"],
               f"llama.cpp: building llama-server with -j{jobs} (~10 min on 2 cores)",
               build_log)  # fmt: skip
    assert binary.is_file(), f"the build finished without {binary}"
    log(f"llama-server built in {time.monotonic() - started_s:.0f} s: {binary}")
    return binary


def _vendored_llama_cpp(root: Path) -> Path:
    """The llama.cpp source inside the llama-cpp-python sdist, downloaded and unpacked once."""
    name, version = LLAMA_CPP_PYTHON.split("==")
    source = root / f"{name.replace('-', '_')}-{version}" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    sdist_dir = root / "sdist"
    sdists = sorted(sdist_dir.glob("*.tar.gz"))
    if not sdists:
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    LLAMA_CPP_PYTHON, "-d", sdist_dir],
                   f"downloading the {LLAMA_CPP_PYTHON} sdist", root / "download.log")  # fmt: skip
        sdists = sorted(sdist_dir.glob("*.tar.gz"))
    log(f"unpacking {sdists[0].name}")
    with tarfile.open(sdists[0]) as sdist:
        sdist.extractall(root, filter="data")
    assert (source / "CMakeLists.txt").is_file(), f"no llama.cpp at {source}"
    return source


def _cmake(root: Path) -> Path:
    """The system's cmake, or PyPI's installed into the bench's venv."""
    found = shutil.which("cmake")
    if found:
        return Path(found)
    python = guidellm_python()
    cmake = python.parent / "cmake"
    if not cmake.is_file():
        run_logged([python, "-m", "pip", "install", "--quiet", "cmake"],
                   "installing cmake from PyPI", root / "build.log")  # fmt: skip
    return cmake


# --- guidellm: its own venv ----------------------------------------------------------------


def guidellm_python() -> Path:
    """The python of guidellm's venv, created once. torch goes in first, pinned and alone, and
    stays pinned (a constraint) while pip resolves guidellm: an unpinned torch would pull a
    multi-GB CUDA build."""
    venv = cache_root() / f"guidellm-{GUIDELLM.split('==')[1]}-venv"
    python, installed = venv / "bin" / "python", venv / ".installed"
    if installed.is_file():
        return python
    setup_log = cache_root() / "guidellm-setup.log"
    if not python.is_file():
        run_logged([sys.executable, "-m", "venv", venv], f"creating {venv}", setup_log)
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    pip = [python, "-m", "pip", "install", "--quiet", "-c", constraints]
    run_logged([*pip, TORCH], f"installing {TORCH} (alone, first)", setup_log)
    run_logged([*pip, GUIDELLM], f"installing {GUIDELLM}", setup_log)
    installed.touch()
    return python


def guidellm_command(python: Path, target: str, load: Load, report: Path) -> list[str]:
    """One concurrent benchmark: --streams streams until --requests requests were sent.

    /v1/completions, not chat: the prompt reaches both servers as guidellm counted it, with
    no chat template around it. guidellm asks for exactly output_tokens (ignore_eos)."""
    tokenizer_dir = resolve_model(DEFAULT_MODEL)  # the tokenizer pdserve converts from the GGUF
    command = [
        str(python), "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={target},model={DEFAULT_MODEL},"
                     "request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={load.streams}",
        "--constraint", f"kind=max_requests,count={load.requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},"
                  f"output_tokens={load.output_tokens}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    if load.max_seconds > 0:
        command += ["--constraint", f"kind=max_duration,seconds={load.max_seconds:g}"]
    return command


# --- metrics from guidellm's per-request records --------------------------------------------


def summarize(report: dict[str, Any]) -> Summary:
    """The module docstring's metrics, from the one benchmark in a guidellm JSON report."""
    (benchmark,) = report["benchmarks"]
    successful = benchmark["requests"]["successful"]
    errored = benchmark["requests"]["errored"]
    if not successful:
        return Summary(0.0, 0.0, None, None, None, 0, len(errored))
    start_s = min(r["request_start_time"] for r in successful + errored
                  if r.get("request_start_time") is not None)  # fmt: skip
    span_s = max(r["request_end_time"] for r in successful) - start_s
    output_tokens = sum(r["output_tokens"] or 0 for r in successful)
    ttfts_s = sorted(r["time_to_first_token_ms"] / 1e3 for r in successful
                     if r.get("time_to_first_token_ms") is not None)  # fmt: skip
    itls_ms = sorted(
        (r["request_latency"] * 1e3 - r["time_to_first_token_ms"]) / (r["output_tokens"] - 1)
        for r in successful
        if (r.get("output_tokens") or 0) >= 2 and r.get("time_to_first_token_ms") is not None
    )
    return Summary(
        req_per_s=len(successful) / span_s,
        output_tok_per_s=output_tokens / span_s,
        ttft_p50_s=percentile(ttfts_s, 0.50),
        ttft_p99_s=percentile(ttfts_s, 0.99),
        itl_p50_ms=percentile(itls_ms, 0.50),
        successful=len(successful),
        errored=len(errored),
    )


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def ratios(pdserve: Summary, llama: Summary) -> dict[str, float | None]:
    def ratio(ours: float | None, theirs: float | None) -> float | None:
        return None if ours is None or not theirs else round(ours / theirs, 3)

    return {
        "req_per_s": ratio(pdserve.req_per_s, llama.req_per_s),
        "output_tok_per_s": ratio(pdserve.output_tok_per_s, llama.output_tok_per_s),
        "ttft_p50_s": ratio(pdserve.ttft_p50_s, llama.ttft_p50_s),
        "itl_p50_ms": ratio(pdserve.itl_p50_ms, llama.itl_p50_ms),
    }


# --- the systems under test ----------------------------------------------------------------


@contextmanager
def process_group(args: Sequence[str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A server in its own session; SIGTERM on the way out, SIGKILL for the group if it lingers."""
    log(f"starting: {shlex.join(args)} (log: {log_path})")
    with log_path.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        yield process
    finally:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=60)  # pdserve up stops its workers and Redis in order
        except subprocess.TimeoutExpired:
            log(f"pid {process.pid} ignored SIGTERM for 60 s: SIGKILL")
        _signal_group(process, signal.SIGKILL)  # whatever of the group outlived its leader
        process.wait()
        log(f"stopped pid {process.pid} (exit {process.returncode})")


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(process.pid, sig)


def wait_serving(url: str, process: subprocess.Popen[bytes], log_path: Path,
                 ready_line: str | None = None) -> float:  # fmt: skip
    """Seconds until GET url answers 200 (and log_path shows ready_line); raises with the log's
    tail if the process exits or STARTUP_TIMEOUT_S passes first."""
    started_s = time.monotonic()
    while time.monotonic() - started_s < STARTUP_TIMEOUT_S:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"exited with {process.returncode} while starting:\n{tail}")
        try:
            healthy = httpx.get(url, timeout=5).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy and (ready_line is None or ready_line in log_path.read_text(errors="replace")):
            return time.monotonic() - started_s
        time.sleep(1)
    raise TimeoutError(f"{url} not serving after {STARTUP_TIMEOUT_S:.0f} s (log: {log_path})")


def warm_up(target: str, load: Load) -> None:
    """One untimed request of the load's size: llama-server's first request otherwise costs
    several times a later one (pdserve's workers warm up before they register)."""
    body = {"model": DEFAULT_MODEL, "prompt": "hello " * load.prompt_tokens,
            "max_tokens": load.output_tokens, "ignore_eos": True}  # fmt: skip
    started_s = time.monotonic()
    response = httpx.post(f"{target}/v1/completions", json=body, timeout=STARTUP_TIMEOUT_S)
    response.raise_for_status()
    log(f"warm-up request: {time.monotonic() - started_s:.1f} s")


def llama_server_command(binary: Path, port: int, load: Load, threads: int) -> list[str]:
    """One slot per stream, each holding a whole request."""
    gguf = gguf_source(DEFAULT_MODEL)
    assert gguf is not None, f"{DEFAULT_MODEL} is a bundled GGUF"
    slot_tokens = load.prompt_tokens + load.output_tokens + CONTEXT_MARGIN_TOKENS
    return [
        str(binary), "-m", str(gguf), "--alias", DEFAULT_MODEL, "--host", HOST,
        "--port", str(port), "--parallel", str(load.streams),
        "-c", str(load.streams * slot_tokens), "--threads", str(threads),
    ]  # fmt: skip


def pdserve_command(port: int, pdserve_args: list[str]) -> list[str]:
    """`pdserve up` as `make run` starts it, plus pdserve_args, on a free HTTP port."""
    return [sys.executable, "-m", "pdserve", "up", "--http-port", str(port),
            "--grpc-port", "0", *pdserve_args]  # fmt: skip


def run_system(name: str, load: Load, threads: int, pdserve_args: list[str],
               work_dir: Path) -> Summary:  # fmt: skip
    python = guidellm_python()
    port = free_port(HOST)
    target = f"http://{HOST}:{port}"
    if name == "llama-server":
        command = llama_server_command(llama_server_binary(), port, load, threads)
        ready_line = None
    else:
        command = pdserve_command(port, pdserve_args)
        ready_line = "pdserve is up"  # the banner: every worker registered and warm
    server_log, report = work_dir / f"{name}.log", work_dir / f"{name}-guidellm.json"
    with process_group(command, server_log) as server:
        startup_s = wait_serving(f"{target}/health", server, server_log, ready_line)
        log(f"{name} serving on {target} after {startup_s:.0f} s; guidellm: {load}")
        warm_up(target, load)
        guidellm_log = work_dir / f"{name}-guidellm.log"
        # One load-generator process: asyncio drives every stream; its default (up to 10
        # spawned processes) would take cores from the server under test.
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                            "GUIDELLM__MAX_WORKER_PROCESSES": "1"}  # fmt: skip
        log(f"load average before the load: {os.getloadavg()[0]:.2f}")
        run_logged(guidellm_command(python, target, load, report), f"guidellm against {name}",
                   guidellm_log, env=env)  # fmt: skip
    summary = summarize(json.loads(report.read_text()))
    log(f"{name}: {summary}")
    return summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32, help="concurrent requests")
    parser.add_argument("--requests", type=int, default=64, help="per system")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--pdserve-args", default="", help="added to `pdserve up`, one string")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="llama-server's threads, and pdserve's --cores; 0 = all cores",
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated")
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="a system that fails is reported with its error; the next runs",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=900.0, help="per system's guidellm run; 0 = no limit"
    )
    args = parser.parse_args()
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        parser.error(f"--systems: unknown {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    return args


def main() -> None:
    args = parse_args()
    # SIGTERM unwinds like Ctrl-C: the servers' context managers stop their process groups.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load = Load(args.streams, args.requests, args.prompt_tokens, args.output_tokens,
                args.max_seconds)  # fmt: skip
    threads = args.threads or os.cpu_count() or 1
    pdserve_args = shlex.split(args.pdserve_args)
    if args.threads and "--cores" not in pdserve_args:
        pdserve_args += ["--cores", str(args.threads)]
    work_dir = Path(tempfile.mkdtemp(prefix="vs_llamacpp-"))
    log(f"logs and guidellm reports in {work_dir}")
    results: dict[str, Any] = {}
    for name in (s for s in SYSTEMS if s in args.systems.split(",")):
        try:
            results[name] = asdict(run_system(name, load, threads, pdserve_args, work_dir))
        except Exception as e:
            if not args.keep_going:
                raise
            log(f"{name} failed: {e}")
            results[name] = {"error": str(e)[-500:]}
    if all("req_per_s" in results.get(s, {}) for s in SYSTEMS):
        results["ratios"] = ratios(Summary(**results["pdserve"]),
                                   Summary(**results["llama-server"]))  # fmt: skip
    results["settings"] = asdict(load) | {
        "threads": threads, "pdserve_args": args.pdserve_args, "cpu_count": os.cpu_count(),
        "llama_cpp": LLAMA_CPP_PYTHON, "guidellm": GUIDELLM, "model": DEFAULT_MODEL,
    }  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
