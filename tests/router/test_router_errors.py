"""Errors at the router's boundary, with OpenAI's error body (HTTP) or a status (gRPC): API
key, malformed and invalid requests, limits, oversized bodies."""

from __future__ import annotations

import json
import math

import grpc
import httpx
import pytest
from router_harness import MODEL

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY_BYTES = 32 * 1024
MAX_PROMPT_TOKENS = 64


def body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4} | fields).encode()


@pytest.fixture(scope="module")
def router(cluster):
    from router_harness import InProcessRouter

    from router.settings import RouterSettings

    settings = RouterSettings(redis_url=cluster.redis_url, http_port=0, grpc_port=0,
                              api_key=KEY, max_body_bytes=MAX_BODY_BYTES,
                              max_prompt_tokens=MAX_PROMPT_TOKENS)  # fmt: skip
    started = InProcessRouter(settings)
    yield started
    started.stop()


def post(router, content: bytes, headers=AUTH, path="/v1/completions") -> httpx.Response:
    return httpx.post(f"{router.http_url}{path}", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **headers})  # fmt: skip


INVALID = "invalid_request_error"


def case(
    name: str, content: bytes, status: int, param: str | None, code: str | None, message: str,
    type_: str = INVALID, headers: dict[str, str] = AUTH, path: str = "/v1/completions",
):  # fmt: skip
    return pytest.param(content, headers, path, status, type_, param, code, message, id=name)


def chat(**fields: object) -> bytes:
    return json.dumps({"model": MODEL} | fields).encode()


LONG = "context_length_exceeded"
HTTP_ERRORS = [
    # name, request body -> status, param, code, start of the message (and type, headers, path)
    case("no-api-key", body(), 401, None, "invalid_api_key", "missing or wrong API key",
         "authentication_error", headers={}),
    case("wrong-api-key", body(), 401, None, "invalid_api_key", "missing or wrong API key",
         "authentication_error", headers={"Authorization": "Bearer wrong"}),
    case("malformed-json", b'{"model": "smollm2-135m", "prompt": ', 400, None, None,
         "request body is not valid JSON"),
    case("invalid-utf8", b'{"model": "smollm2-135m", "prompt": "caf\xe9"}', 400, None, None,
         "request body is not valid UTF-8"),
    case("lone-surrogate", b'{"model": "smollm2-135m", "prompt": "\\ud800"}', 400, "prompt",
         None, "prompt is not valid Unicode"),
    case("not-an-object", b"[1, 2]", 400, None, None, "request body must be a JSON object"),
    case("negative-max-tokens", body(max_tokens=-1), 400, None, None,
         "max_tokens must be at least 1, got -1"),
    case("negative-temperature", body(temperature=-0.5), 400, None, None,
         "temperature must be >= 0"),
    case("over-long-prompt", body(prompt=" ".join(["word"] * 200)), 400, "prompt", LONG,
         "prompt has 200 tokens; this server takes at most 64"),
    case("over-the-context", body(max_tokens=9000), 400, "max_tokens", LONG,
         "this model's maximum context length is 8192 tokens"),
    case("empty-prompt", body(prompt=""), 400, "prompt", None, "prompt is empty"),
    case("n-above-16", body(n=17), 400, "n", None, "n: Input should be less than or equal to 16"),
    case("best-of", body(best_of=2), 400, "best_of", None, "best_of is not supported by this"),
    case("two-prompts", body(prompt=["a", "b"]), 400, "prompt", None, "2 prompts in one request"),
    case("prompt-of-the-wrong-type", body(prompt=5), 400, "prompt.str", None,
         "prompt.str: Input should be"),
    case("unsupported-option", body(suffix="!"), 400, "suffix", None,
         "suffix is not supported by this server"),
    case("unknown-model", body(model="gpt-4o"), 404, "model", "model_not_found",
         "model 'gpt-4o' does not exist"),
    case("no-chat-messages", chat(messages=[]), 400, "messages", None,
         "messages: List should have at least 1 item", path="/v1/chat/completions"),
    case("non-text-chat-part",
         chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages",
         None, "only text content parts", path="/v1/chat/completions"),
    case("oversized-body", body(prompt="x" * MAX_BODY_BYTES), 413, None, None,
         "request body of 32"),
    case("unknown-path", b"", 404, None, None, "POST /v1/nowhere: Not Found", path="/v1/nowhere"),
    # Hostile values a fuzzer finds (test_router_fuzz.py searches for more).
    case("top-k-2-to-the-63", body(top_k=2**63), 400, "top_k", None,
         "top_k: Input should be less than 4294967296"),
    case("max-tokens-2-to-the-70", body(max_tokens=2**70), 400, "max_tokens", LONG,
         "this model's maximum context length is 8192 tokens"),
    case("infinite-temperature", body()[:-1] + b', "temperature": 1e400}', 400, "temperature",
         None, "temperature: Input should be a finite number"),
    case("nan-top-p", body()[:-1] + b', "top_p": NaN}', 400, None, None,
         "request body is not valid JSON: NaN is not a JSON number"),
    case("deeply-nested", body()[:-1] + b', "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
         400, None, None, "request body is nested too deeply"),
    case("lone-surrogate-stop", body(stop=["\ud800"]), 400, "stop", None,
         "stop: Value error, stop strings must be valid Unicode"),
]  # fmt: skip


@pytest.mark.parametrize("content, headers, path, status, type_, param, code, message", HTTP_ERRORS)
def test_http_errors_use_openais_error_shape(
    router, content, headers, path, status, type_, param, code, message
):
    response = post(router, content, headers, path)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (type_, param, code)
    assert error["message"].startswith(message), error["message"]


def test_oversized_chunked_body_without_content_length_gets_413(router):
    def chunks():
        for _ in range(8):
            yield b" " * (MAX_BODY_BYTES // 4)

    response = httpx.post(f"{router.http_url}/v1/completions", content=chunks(), headers=AUTH,
                          timeout=60)  # fmt: skip
    assert response.status_code == 413
    assert response.json()["error"]["message"].startswith("request body of")


def test_unknown_extension_fields_are_ignored_and_the_key_opens_the_door(router):
    response = post(router, body(max_tokens=2, temperature=0, some_vendor_field={"x": 1}))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{router.http_url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{router.http_url}/health", timeout=10).status_code == 200  # for probes


WITH_KEY = (("authorization", f"Bearer {KEY}"),)
GRPC_ERRORS = [
    # (request, metadata) -> (status, start of the details)
    pytest.param(pb.GenerateRequest(text="Hi"), (), grpc.StatusCode.UNAUTHENTICATED,
                 "missing or wrong API key", id="no-api-key"),
    pytest.param(pb.GenerateRequest(), WITH_KEY, grpc.StatusCode.INVALID_ARGUMENT,
                 "the request has no prompt", id="no-prompt"),
    pytest.param(pb.GenerateRequest(text="Hi", params=pb.SamplingParams(max_tokens=0)),
                 WITH_KEY, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1",
                 id="zero-max-tokens"),
    pytest.param(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 65)), WITH_KEY,
                 grpc.StatusCode.INVALID_ARGUMENT, "prompt has 65 tokens", id="over-long-prompt"),
    pytest.param(pb.GenerateRequest(text="Hi", params=pb.SamplingParams(temperature=math.nan)),
                 WITH_KEY, grpc.StatusCode.INVALID_ARGUMENT, "temperature must be finite, got nan",
                 id="nan-temperature"),
]  # fmt: skip


@pytest.mark.parametrize("request_, metadata, code, details", GRPC_ERRORS)
def test_grpc_errors(router, request_, metadata, code, details):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.grpc_address))
    for call in (stub.Complete, lambda r, **kw: list(stub.Generate(r, **kw))):
        with pytest.raises(grpc.RpcError) as error:
            call(request_, metadata=metadata, timeout=60)
        assert error.value.code() == code
        assert error.value.details().startswith(details), error.value.details()
