"""`pdserve` with injected faults: the model runner raises when a batch holds a request whose
prompt starts with POISON, as a hardware fault or an engine bug would (engine-death tests); a
decode worker lets go of the blocks of a request whose id starts with UNREADABLE while a
prefill worker reads them (its second readability check fails: peer-fetch fallback tests);
once some other request has finished its prompt, a step of requests whose prompts all start
with HOLD waits until the file named by $PDSERVE_TEST_HOLD_FILE exists (at most HOLD_MAX_S):
a step still in progress when that request's reply goes out."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from engine.model_runner import ModelRunner
from kvtransfer import KVCancelledError
from kvtransfer.inbox import Inbox

POISON = [4242, 4242, 4242]
UNREADABLE = "unreadable"
HOLD = [4343, 4343, 4343]
HOLD_FILE_ENV = "PDSERVE_TEST_HOLD_FILE"
HOLD_MAX_S = 300.0
_execute = ModelRunner.execute
_check_readable = Inbox.check_readable
_checked_once: set[str] = set()
_armed = False  # a request that is not HOLD has finished its prompt


def _faulty_execute(self, batch):
    global _armed
    if any(item.request.token_ids[: len(POISON)] == POISON for item in batch):
        raise RuntimeError("injected fault")
    if _armed and all(_is_held(item.request) for item in batch):
        deadline = time.monotonic() + HOLD_MAX_S
        while not os.path.exists(os.environ[HOLD_FILE_ENV]) and time.monotonic() < deadline:
            time.sleep(0.05)
    tokens = _execute(self, batch)
    _armed = _armed or any(
        not _is_held(item.request)
        and item.request.num_computed_tokens + item.num_new_tokens >= item.request.num_prompt_tokens
        for item in batch
    )  # fmt: skip
    return tokens


def _is_held(request) -> bool:
    return request.token_ids[: len(HOLD)] == HOLD


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
