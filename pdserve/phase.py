"""A process's start-up phase, for `pdserve up`'s progress. The launcher names a file in
PDSERVE_PHASE_FILE; the worker writes the phase it enters there (whole, replaced at once);
no file yet means the process is still starting (Python and torch importing)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal, get_args

PHASE_FILE_ENV = "PDSERVE_PHASE_FILE"
Phase = Literal["starting", "loading", "warming", "ready"]
PHASES: tuple[Phase, ...] = get_args(Phase)

log = logging.getLogger(__name__)


def report(phase: Phase) -> None:
    """The worker's side; nothing when the launcher did not start it."""
    path = os.environ.get(PHASE_FILE_ENV)
    if not path:
        return
    try:
        Path(f"{path}.tmp").write_text(phase)
        os.replace(f"{path}.tmp", path)
    except OSError as e:  # progress only: never a reason for a worker to fail
        log.warning("could not write start-up phase to %s: %s", path, e)


def read(path: Path) -> Phase:
    """The launcher's side."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return "starting"
    return text if text in PHASES else "starting"  # type: ignore[return-value]
