"""`pdserve up`'s start-up progress, its one owner: each process's phase (pdserve.phase) and
the seconds since start-up began. On a terminal a live table; otherwise one line per change,
`decode-0: warming (12 s)`, for logs and tests to read."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from pdserve.phase import Phase

Phases = dict[str, Phase]  # process name -> its phase now
_STYLE = {"starting": "dim", "loading": "yellow", "warming": "cyan", "ready": "bold green"}


class StartupProgress:
    def __init__(self, echo: Callable[[str], None], live: bool) -> None:
        self._echo = echo
        self._started_s = time.monotonic()
        self._reached: dict[str, tuple[Phase, float]] = {}  # name -> phase, seconds it came
        self._live: Any = None
        if live:
            from rich.live import Live

            self._live = Live(auto_refresh=False, transient=False)

    def __enter__(self) -> StartupProgress:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.update(self._table(), refresh=True)
            self._live.stop()

    def __call__(self, phases: Phases) -> None:
        now_s = time.monotonic() - self._started_s
        for name, phase in phases.items():
            if name not in self._reached or self._reached[name][0] != phase:
                self._reached[name] = (phase, now_s)
                if self._live is None:
                    self._echo(f"{name}: {phase} ({now_s:.0f} s)")
        if self._live is not None:
            self._live.update(self._table(), refresh=True)

    def _table(self) -> Any:
        from rich.table import Table

        now_s = time.monotonic() - self._started_s
        table = Table(title="pdserve up: start-up", title_justify="left", box=None)
        for column in ("process", "phase", "elapsed"):
            table.add_column(column)
        for name, (phase, reached_s) in self._reached.items():
            seconds = reached_s if phase == "ready" else now_s  # ready: when it got there
            table.add_row(name, f"[{_STYLE[phase]}]{phase}", f"{seconds:.0f} s")
        return table
