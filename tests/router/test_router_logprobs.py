"""logprobs through the whole system, with the official openai client: the values are HF
transformers' fp32 log-softmax of the greedy tokens, the alternatives in order, in OpenAI's
completions and chat shapes, streamed or not."""

from __future__ import annotations

import openai
import pytest
import torch
from openai import OpenAI
from router_harness import MODEL, one_torch_thread

from engine import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "1, 1, 2, 3, 5, 8,"]
NUM_TOKENS = 6
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(llm, hf_logits) -> dict[str, tuple[list[int], torch.Tensor]]:
    """prompt -> (the engine's greedy token ids, HF's log-softmax at each of their positions)."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    with one_torch_thread():
        outputs = llm.generate(PROMPTS, params)
        found = {}
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            logits = hf_logits(out.prompt_token_ids + out.token_ids)
            rows = logits[len(out.prompt_token_ids) - 1 : -1]  # [NUM_TOKENS, vocab]
            found[prompt] = (out.token_ids, torch.log_softmax(rows, dim=-1))
    return found


def _text(llm, token_id: int) -> str:
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_logprobs(client, llm, reference, stream):
    for prompt in PROMPTS:
        token_ids, logprobs = reference[prompt]
        request = dict(model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                       logprobs=5, extra_body={"ignore_eos": True})  # fmt: skip
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(stream=True, **request)]
            text = "".join(c.text for c in chunks)
            got = [c.logprobs for c in chunks if c.logprobs is not None]
            tokens = [t for lp in got for t in lp.tokens]
            values = [v for lp in got for v in lp.token_logprobs]
            tops = [top for lp in got for top in lp.top_logprobs]
            offsets = [o for lp in got for o in lp.text_offset]
        else:
            choice = client.completions.create(**request).choices[0]
            text, lp = choice.text, choice.logprobs
            tokens, values, tops, offsets = (
                lp.tokens,
                lp.token_logprobs,
                lp.top_logprobs,
                lp.text_offset,
            )
        assert tokens == [_text(llm, t) for t in token_ids]
        assert "".join(tokens) == text
        assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
        for i, token_id in enumerate(token_ids):
            assert abs(values[i] - logprobs[i, token_id].item()) < TOLERANCE, (prompt, i)
            top = logprobs[i].topk(5)
            # The 5 most likely in order (the greedy token first, so no extra sampled entry).
            assert list(tops[i]) == [_text(llm, t) for t in top.indices.tolist()], (prompt, i)
            for value, want in zip(tops[i].values(), top.values.tolist(), strict=True):
                assert abs(value - want) < TOLERANCE


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs(client, llm, hf_logits, stream):
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages))
    request = dict(model=MODEL, messages=messages, max_tokens=NUM_TOKENS, temperature=0,
                   logprobs=True, top_logprobs=3)  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **request))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        choice = client.chat.completions.create(**request).choices[0]
        entries, text = choice.logprobs.content, choice.message.content
    with one_torch_thread():
        want = llm.generate([prompt_ids], SamplingParams(max_tokens=NUM_TOKENS, temperature=0))
    token_ids = want[0].token_ids
    assert [e.token for e in entries] == [_text(llm, t) for t in token_ids]
    assert text == want[0].text
    logprobs = torch.log_softmax(hf_logits(prompt_ids + token_ids)[len(prompt_ids) - 1 :], -1)
    for i, (entry, token_id) in enumerate(zip(entries, token_ids, strict=True)):
        assert entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - logprobs[i, token_id].item()) < TOLERANCE
        top = logprobs[i].topk(3)
        assert [t.token for t in entry.top_logprobs] == [
            _text(llm, t) for t in top.indices.tolist()
        ]
        assert max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, top.values.tolist(),
                                                         strict=True)) < TOLERANCE  # fmt: skip


def test_top_logprobs_without_logprobs_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, top_logprobs=2
        )
    assert refused.value.body["param"] == "top_logprobs"
