"""Stream events survive clients that split lines the way Python's str.splitlines() does
(httpx's iter_lines, which guidellm reads OpenAI streams with): a generated token may hold a
character that ends a line there."""

from __future__ import annotations

import json

import httpx

from router.http_api.openai_format import SSE_DONE, sse

TEXT = "a\x85b\u2028c\u2029d\ne\u00e9\u4e2d"  # NEL, LS, PS, a newline, Latin, CJK


def test_every_event_is_one_line_to_a_splitlines_reader():
    chunk = {"choices": [{"index": 0, "text": TEXT}]}
    response = httpx.Response(200, content=sse(chunk) + SSE_DONE)
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(line.removeprefix("data: ")) for line in lines[:-1]] == [chunk]


def test_text_outside_the_line_breaks_stays_as_it_was_written():
    assert sse({"text": "e\u00e9\u4e2d"}) == 'data: {"text": "e\u00e9\u4e2d"}\n\n'.encode()
