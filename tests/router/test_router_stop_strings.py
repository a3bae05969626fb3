"""Stop strings through the whole cluster: a stop string that spans 2-3 tokens never reaches
the client, streaming or not, over the OpenAI HTTP API (completions and chat) and gRPC; the
response says finish_reason "stop" and stop_reason (vLLM's: the string or token id that
matched); include_stop_str_in_output keeps the string.

The stop strings come from a greedy run first: substrings that cross token boundaries."""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
import httpx
import pytest
from router_harness import MODEL, spanning_stop

from engine.tokenizer import TextTokenizer
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc

PROMPT = "The three most common colours of a rainbow are"
CHAT = [{"role": "user", "content": "Name three colours of a rainbow."}]
MAX_TOKENS = 24
DECOY = "\x00 never generated"  # a second stop string that never matches


@dataclass(frozen=True, slots=True)
class Reference:
    token_ids: list[int]
    pieces: list[str]  # each token's text, as streamed without stop strings

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def grpc_params(**fields: object) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **fields)


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def prompts(model_dir) -> dict[str, str]:
    """The text each API sends to the model: the chat API renders the template first."""
    return {"completions": PROMPT,
            "chat": TextTokenizer.load(model_dir).apply_chat_template(CHAT)}  # fmt: skip


@pytest.fixture(scope="module")
def references(stub, prompts) -> dict[str, Reference]:
    out = {}
    for api, text in prompts.items():
        messages = list(stub.Generate(pb.GenerateRequest(text=text, params=grpc_params()),
                                      timeout=120))  # fmt: skip
        assert all(len(m.token_ids) == 1 for m in messages)
        out[api] = Reference([m.token_ids[0] for m in messages], [m.text for m in messages])
        assert len(out[api].token_ids) == MAX_TOKENS
    return out


def http_body(api: str, stop: str, include: bool, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {
        "model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "stop": [DECOY, stop], "include_stop_str_in_output": include, "stream": stream,
    }  # fmt: skip
    return body | ({"prompt": PROMPT} if api == "completions" else {"messages": CHAT})


def sse_chunks(response: httpx.Response) -> list[dict]:
    events = [line[len("data: ") :] for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def chunk_text(choice: dict) -> str:
    return choice.get("text") or choice.get("delta", {}).get("content") or ""


CASES = [
    pytest.param(2, False, id="2-tokens"),
    pytest.param(3, False, id="3-tokens"),
    pytest.param(3, True, id="3-tokens-included"),
]


@pytest.mark.parametrize("num_tokens, include", CASES)
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_http_whole_response_ends_before_the_stop(cluster, references, api, num_tokens, include):
    ref = references[api]
    stop, start, last = spanning_stop(ref.pieces, num_tokens)
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    response = httpx.post(f"{cluster.http_url}{path}", json=http_body(api, stop, include, False),
                          timeout=120)  # fmt: skip
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    text = choice["text"] if api == "completions" else choice["message"]["content"]
    assert text == ref.text[: start + len(stop) if include else start]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert response.json()["usage"]["completion_tokens"] == last + 1


@pytest.mark.parametrize("num_tokens, include", CASES)
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_http_stream_never_carries_part_of_the_stop(cluster, references, api, num_tokens, include):
    ref = references[api]
    stop, start, _ = spanning_stop(ref.pieces, num_tokens)
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    response = httpx.post(f"{cluster.http_url}{path}", json=http_body(api, stop, include, True),
                          timeout=120)  # fmt: skip
    assert response.status_code == 200, response.text
    choices = [c for chunk in sse_chunks(response) for c in chunk["choices"]]
    assert (
        "".join(chunk_text(c) for c in choices)
        == (ref.text[: start + len(stop) if include else start])
    )
    reasons = [(c["finish_reason"], c["stop_reason"]) for c in choices]
    assert reasons == [(None, None)] * (len(choices) - 1) + [("stop", stop)]


@pytest.mark.parametrize("num_tokens, include", CASES)
def test_grpc_generate_and_complete_end_before_the_stop(stub, references, num_tokens, include):
    ref = references["completions"]
    stop, start, last = spanning_stop(ref.pieces, num_tokens)
    params = grpc_params(stop=[DECOY, stop], include_stop_str_in_output=include)
    request = pb.GenerateRequest(text=PROMPT, params=params)
    messages = list(stub.Generate(request, timeout=120))
    whole = stub.Complete(request, timeout=120)
    want_text = ref.text[: start + len(stop) if include else start]
    for token_ids, text, final in (
        ([t for m in messages for t in m.token_ids], "".join(m.text for m in messages),
         messages[-1]),
        (list(whole.token_ids), whole.text, whole),
    ):  # fmt: skip
        assert token_ids == ref.token_ids[: last + 1]
        assert text == want_text
        assert (final.finish_reason, final.WhichOneof("stop_reason"), final.stop_str) == (
            "stop", "stop_str", stop,
        )  # fmt: skip
    assert all(m.WhichOneof("stop_reason") is None for m in messages[:-1])


def test_a_stop_token_id_is_the_stop_reason_on_both_apis(cluster, stub, references):
    ref = references["completions"]
    index = next(i for i, piece in enumerate(ref.pieces) if i >= 3 and piece.strip())
    token = ref.token_ids[index]
    whole = stub.Complete(pb.GenerateRequest(text=PROMPT,
                                             params=grpc_params(stop_token_ids=[token])),
                          timeout=120)  # fmt: skip
    assert list(whole.token_ids) == ref.token_ids[: index + 1]
    assert whole.text == "".join(ref.pieces[:index])
    assert (whole.finish_reason, whole.WhichOneof("stop_reason"), whole.stop_token_id) == (
        "stop", "stop_token_id", token,
    )  # fmt: skip
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stop_token_ids": [token]}  # fmt: skip
    (choice,) = httpx.post(f"{cluster.http_url}/v1/completions", json=body,
                           timeout=120).json()["choices"]  # fmt: skip
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        whole.text, "stop", token,
    )  # fmt: skip
