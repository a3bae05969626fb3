"""`python -m pdserve ARGS` runs `pdserve ARGS`; the launcher starts its children this way.

A child of the launcher (PDSERVE_LAUNCHER_PID set) first arranges to die with it, before the
CLI loads. Not a preexec_fn: Python code between fork and exec, in a process with busy gRPC
threads (a benchmark's clients), crashed about one child in four (SIGSEGV, SIGABRT).

This entry point sits above both pdserve.cli and pdserve.launcher, so the launcher, a library
that sim and the tests use, never imports the CLI (pyproject.toml, [tool.importlinter])."""

import os
import sys

from pdserve.launcher import _LAUNCHER_PID_ENV, _die_with_parent

if _LAUNCHER_PID_ENV in os.environ:
    _die_with_parent(int(os.environ[_LAUNCHER_PID_ENV]))

from pdserve.cli import app  # noqa: E402 (after the line above: the child follows the launcher first)

app(args=sys.argv[1:], prog_name="pdserve")
