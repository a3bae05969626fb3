"""`pdserve` with injected faults: the model runner raises when a batch holds a request whose
prompt starts with POISON, as a hardware fault or an engine bug would (engine-death tests); a
decode worker lets go of the blocks of a request whose id starts with UNREADABLE while a
prefill worker reads them (its second readability check fails: peer-fetch fallback tests)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from engine.model_runner import ModelRunner
from kvtransfer import KVCancelledError
from kvtransfer.inbox import Inbox

POISON = [4242, 4242, 4242]
UNREADABLE = "unreadable"
_execute = ModelRunner.execute
_check_readable = Inbox.check_readable
_checked_once: set[str] = set()


def _faulty_execute(self, batch):
    if any(item.request.token_ids[: len(POISON)] == POISON for item in batch):
        raise RuntimeError("injected fault")
    return _execute(self, batch)


def _forgetful_check_readable(self: Inbox, request_id: str, block_ids: Sequence[int]) -> None:
    if request_id.startswith(UNREADABLE):
        if request_id in _checked_once:  # after the blocks were sent
            raise KVCancelledError(request_id, "injected: let go of the blocks during the read")
        _checked_once.add(request_id)
    _check_readable(self, request_id, block_ids)


if __name__ == "__main__":
    ModelRunner.execute = _faulty_execute
    Inbox.check_readable = _forgetful_check_readable
    from pdserve.cli import app

    sys.exit(app())
