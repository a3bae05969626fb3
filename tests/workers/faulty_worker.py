"""`pdserve` with one injected fault: the model runner raises when a batch holds a request whose
prompt starts with POISON, as a hardware fault or an engine bug would. For engine-death tests."""

from __future__ import annotations

import sys

from engine.model_runner import ModelRunner

POISON = [4242, 4242, 4242]
_execute = ModelRunner.execute


def _faulty_execute(self, batch):
    if any(item.request.token_ids[: len(POISON)] == POISON for item in batch):
        raise RuntimeError("injected fault")
    return _execute(self, batch)


if __name__ == "__main__":
    ModelRunner.execute = _faulty_execute
    from pdserve.cli import app

    sys.exit(app())
