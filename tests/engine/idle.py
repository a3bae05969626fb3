"""Between tests that share one engine: nothing runs, nothing is cached, and every block is
free and accounted for."""

from __future__ import annotations

from engine import LLMEngine


def reset_to_idle(engine: LLMEngine) -> None:
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    engine.pool.reset_cache()
    engine.kv.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
