"""The engine's C++ CPU kernels (engine/csrc/): built together into one extension module, once
per machine and CPU instruction set, by `make kernels` (`python -m engine.cpu_kernels`, which
`make run` and `make test` run first) or else on first use.

The paged decode attention (engine/cpu_paged_backend.py), the int4 (Q4_1) and Q8_0 linears
of quantized layers and the lm_head (engine/quantization.py) and the decoder layer's fused
element-wise steps (engine/model.py, FusedCPUOps) live there. Building takes about a
minute on 2 cores (torch's cpp_extension with ninja), cached under $TORCH_EXTENSIONS_DIR, by
default ~/.cache/torch_extensions, in a folder of its own for each checkout and version of the
sources (an edit builds anew; old folders stay until removed); a machine without a C++
compiler gets an error from load(), which each caller turns into its fallback (load_or_none: a
logged warning and None).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))

# Instruction sets to build for, by what torch's own kernels dispatch to on this CPU: named
# explicitly (not -march=native), so one cache directory never serves another CPU a binary it
# cannot run. Without errno, sqrt is one instruction; exp stays glibc's scalar expf (libmvec's
# vector variants are declared only under -ffast-math, and round differently).
_ISA_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]


@cache
def load():
    """The compiled extension module (built on first call, then loaded from the cache). Raises
    ImportError, OSError or RuntimeError where it cannot be built (no compiler or headers)."""
    from torch.utils import cpp_extension

    isa = torch.backends.cpu.get_cpu_capability()
    if shutil.which("ninja") is None:
        # The pip ninja package puts its binary beside the venv's python, which is not on PATH
        # when the venv's python is run by path (the launcher's workers, tests).
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    flags = _FLAGS + _ISA_FLAGS.get(isa, [])
    log.info("loading the engine's CPU kernels for %s (built once per machine)", isa)
    return cpp_extension.load(
        name=f"pdserve_cpu_kernels_{isa.lower()}_{_build_key(flags)}",
        sources=[str(s) for s in SOURCES],
        extra_cflags=flags,
        verbose=False,
    )


def _build_key(flags: list[str]) -> str:
    """The build's own name: torch keeps one build folder per extension name, so two checkouts
    (or a checkout and an installed copy) sharing a name rebuilt it each time the other one
    loaded (about a minute each). Keyed by where the sources are, what they say and the flags."""
    digest = hashlib.sha256(" ".join(flags).encode())
    for path in sorted(SOURCES[0].parent.iterdir()):
        digest.update(str(path.resolve()).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def load_or_none(fallback: str):
    """load(), or None where the kernels cannot be built, logging what runs instead."""
    try:
        return load()
    except (ImportError, OSError, RuntimeError) as e:  # no compiler, ninja or headers
        log.warning("%s (the C++ kernels did not build: %s)", fallback, e)
        return None


if __name__ == "__main__":  # `make kernels`: build now rather than at a first start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_or_none("the engine will use torch ops instead")
