"""vLLM's sampling options: each penalty picks exactly what a plain reference implementation of
vLLM's formula picks on HF transformers' logits; min_tokens, logit_bias, min_p, top-k/top-p."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine import InvalidRequestError, SamplingParams
from engine import sampling as sampler

PROMPT = "The cat sat on the mat. The dog sat on the"
PLAIN = [1171, 30, 378, 2644, 2643, 335, 260, 2767, 506, 1171, 30, 378]  # " mat. The cat sat..."
PENALTIES = {
    "presence": ({"presence_penalty": 2.0}, [*PLAIN[:9], 4463, 30, 198]),  # "... dog's bed.\n"
    "frequency": ({"frequency_penalty": 0.7}, [*PLAIN[:9], 4463, 30, 378]),  # "... bed. The"
    "repetition": (
        {"repetition_penalty": 1.5},
        [4463, 28, 284, 339, 436, 8001, 281, 957, 9192, 645, 1041, 2422],  # " bed, and I was"
    ),
    "all": (
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
        [4463, 28, 284, 260, 2644, 436, 8001, 281, 253, 9192, 411, 2581],
    ),
}
CHAT_QUESTION = "What is 2+2? Answer with one number."


def vllm_penalized(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """vLLM's formula, one token at a time: the repetition penalty divides positive logits and
    multiplies negative ones of tokens in the prompt or the output; the frequency penalty is
    subtracted per occurrence in the output, the presence penalty once per output token."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        if out[token] > 0:
            out[token] = out[token] / params.repetition_penalty
        else:
            out[token] = out[token] * params.repetition_penalty
    for token, count in Counter(output).items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def test_penalties_pick_what_vllms_formula_picks(llm, hf_logits):
    prompt = llm.tokenizer.encode(PROMPT)
    cases = {name: SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **fields)
             for name, (fields, _) in PENALTIES.items()}  # fmt: skip
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # All in one batch, beside a request without penalties.
    outputs = llm.generate([PROMPT] * (len(cases) + 1), [plain, *cases.values()])
    assert outputs[0].token_ids == PLAIN
    for (name, params), out in zip(cases.items(), outputs[1:], strict=True):
        assert out.token_ids == PENALTIES[name][1], name
        logits = hf_logits(prompt + out.token_ids)
        for i, token in enumerate(out.token_ids):
            reference = vllm_penalized(
                logits[len(prompt) - 1 + i], prompt, out.token_ids[:i], params
            )
            top2 = reference.topk(2)
            assert token == top2.indices[0], (name, i)
            assert top2.values[0] - top2.values[1] > 1e-3, (name, i)  # not a near-tie
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached(llm, hf_logits):
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}])
    eos = llm.tokenizer.eos_token_id
    free = llm.generate([chat], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert free.token_ids == [504, 2988, 314, 216, 36, 30, eos]  # "The answer is 4."
    held = llm.generate([chat], SamplingParams(max_tokens=16, temperature=0.0, min_tokens=10))[0]
    assert held.token_ids[:6] == free.token_ids[:6]
    assert eos not in held.token_ids[:10]
    prompt = llm.tokenizer.encode(chat)
    # Where EOS was the argmax, the pick is the best other token.
    logits = hf_logits(prompt + held.token_ids)[len(prompt) + 5]
    logits[eos] = float("-inf")
    assert held.token_ids[6] == logits.argmax()
    dot = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[30])
    assert llm.generate([chat], dot)[0].token_ids == free.token_ids[:6]
    dot_late = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[30], min_tokens=8)
    late = llm.generate([chat], dot_late)[0].token_ids
    assert late[:5] == free.token_ids[:5] and 30 not in late[:8] and eos not in late[:8]


def test_logit_bias_adds_to_the_logits(llm, hf_logits):
    prompt = llm.tokenizer.encode(PROMPT)
    forced = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={"42": 100})
    assert llm.generate([PROMPT], forced)[0].token_ids == [42, 42, 42, 42]
    # Pushing the greedy token down by 100 leaves HF's second best.
    banned = SamplingParams(max_tokens=1, temperature=0.0, logit_bias={PLAIN[0]: -100.0})
    second = hf_logits(prompt)[-1].topk(2).indices[1]
    assert llm.generate([PROMPT], banned)[0].token_ids == [second]


def test_min_p_one_and_tiny_top_p_are_greedy(llm):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    min_p = SamplingParams(max_tokens=6, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True)
    top_p = SamplingParams(max_tokens=6, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True)
    outputs = llm.generate([PROMPT] * 3, [greedy, min_p, top_p])
    assert outputs[0].token_ids == outputs[1].token_ids == outputs[2].token_ids == PLAIN[:6]


def reference_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """One row: keep the top_k largest (ties kept), then the most likely tokens until their
    probability reaches top_p (ties with the last kept token kept)."""
    out = logits.clone()
    if top_k is not None:
        out[out < out.topk(top_k).values[-1]] = float("-inf")
    if top_p == 1.0:
        return out
    probs = torch.softmax(out.double(), dim=-1)  # float64, as the sampler's nucleus mass
    ordered = probs.sort(descending=True).values
    mass = ordered.cumsum(dim=0)
    last = ordered[int((mass < top_p).sum())]  # the first token at which the mass reaches top_p
    out[probs < last] = float("-inf")
    return out


def test_top_k_top_p_masks_match_a_per_row_reference(llm, hf_logits, monkeypatch):
    """Narrow and wide nuclei (the widest sorted in full) in one batch, as one row at a time."""
    ids = llm.tokenizer.encode(PROMPT)
    logits = hf_logits(ids)[-6:]  # [6, vocab]: real distributions, some flat, some peaked
    options = [(None, 0.9), (40, 0.95), (None, 0.98), (3, 1.0), (None, 1.0), (1000, 0.99)]
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in options]
    default_width = sampler.TOP_P_CANDIDATES
    for width in (8, default_width, logits.shape[1]):
        monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", width)
        masked = sampler._top_k_top_p(logits, params)
        for row, (k, p) in enumerate(options):
            kept = torch.isfinite(masked[row])
            expected = torch.isfinite(reference_top_k_top_p(logits[row], k, p))
            assert torch.equal(kept, expected), (width, k, p)
    num_kept = torch.isfinite(sampler._top_k_top_p(logits, params)).sum(dim=-1).tolist()
    assert num_kept[3] == 3 and num_kept[4] == logits.shape[1]
    assert num_kept[2] > default_width  # a nucleus wider than the default width


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"min_tokens": 17}, "min_tokens must be in [0, max_tokens=16], got 17"),
        ({"logit_bias": {5: 101.0}}, "logit_bias for token 5 must be in [-100, 100], got 101.0"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias must map token ids to numbers"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id -1 is negative"),
    ],
)
def test_bad_sampling_options_are_refused(fields, message):
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**fields)


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(InvalidRequestError, match=r"logit_bias token ids \[49152\] are outside"):
        llm.engine.make_request("bias", PROMPT, SamplingParams(logit_bias={49152: 1.0}))


def resumed_cases(llm) -> list[tuple[str, SamplingParams]]:
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}])
    return [
        (
            PROMPT,
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **PENALTIES["all"][0]),
        ),  # fmt: skip
        (chat, SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[30], min_tokens=8)),
        (
            PROMPT,
            SamplingParams(
                max_tokens=12, temperature=0.8, seed=11, frequency_penalty=0.5, ignore_eos=True
            ),
        ),  # fmt: skip
    ]


@pytest.mark.parametrize("num_prior", [1, 4])
def test_a_request_resumed_after_its_first_tokens_goes_on_as_uninterrupted(llm, num_prior):
    """A request moved mid-stream resumes from its prompt plus its output so far: counting
    that tail as output (penalties, min_tokens, max_tokens, the seeded stream), it picks the
    same tokens as the uninterrupted run."""
    cases = resumed_cases(llm)
    whole = llm.generate([prompt for prompt, _ in cases], [params for _, params in cases])
    assert [out.finish_reason for out in whole] == ["length", "stop", "length"]
    assert len(whole[1].token_ids) > 8  # min_tokens held back the stop token (see above)
    engine = llm.engine
    resumed = [
        engine.enqueue(
            engine.make_request(
                f"resumed-{num_prior}-{i}",
                out.prompt_token_ids + out.token_ids[:num_prior],
                params,
                num_prior_output_tokens=num_prior,
            )
        )  # fmt: skip
        for i, ((_, params), out) in enumerate(zip(cases, whole, strict=True))
    ]
    while engine.has_unfinished_requests():
        engine.step()
    for i, (request, out) in enumerate(zip(resumed, whole, strict=True)):
        assert request.output_token_ids == out.token_ids[num_prior:], i
        assert request.finish_reason == out.finish_reason, i
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize(
    "num_prior, fields, message",
    [
        (4, {"max_tokens": 4}, r"num_prior_output_tokens must be in \[0, 4\) \(the prompt's 12 "
                               r"tokens and max_tokens 4\), got 4"),
        (2, {"n": 2}, "a request with output before a move has one sample, not n=2"),
    ],
)  # fmt: skip
def test_a_resumed_request_that_cannot_be_is_refused(llm, num_prior, fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.make_request("resumed", PROMPT, SamplingParams(**fields),
                                num_prior_output_tokens=num_prior)  # fmt: skip


LOGPROB_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "1, 1, 2, 3, 5, 8,"]


def test_logprobs_are_the_models_raw_log_softmax(llm, hf_logits):
    """Greedy and sampled rows in one batch: logprobs are HF's fp32 log-softmax (before the
    temperature and penalties), the alternatives in order."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    sampled = SamplingParams(max_tokens=6, temperature=1.3, seed=5, ignore_eos=True, logprobs=3,
                             repetition_penalty=1.3)  # fmt: skip
    prompts = [*LOGPROB_PROMPTS, LOGPROB_PROMPTS[0]]
    outputs = llm.generate(prompts, [greedy] * 3 + [sampled])
    for prompt, out in zip(prompts, outputs, strict=True):
        prompt_ids = llm.tokenizer.encode(prompt)
        k = 3 if out is outputs[-1] else 5
        reference = torch.log_softmax(hf_logits(prompt_ids + out.token_ids), dim=-1)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        for i, lp in enumerate(out.logprobs):
            row = reference[len(prompt_ids) - 1 + i]
            assert abs(lp.logprob - row[lp.token_id].item()) < 1e-3
            top = row.topk(k)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert (
                max(abs(v - r) for (_, v), r in zip(lp.top, top.values.tolist(), strict=True))
                < 1e-3
            )
            if out is not outputs[-1]:
                assert lp.top[0][0] == lp.token_id  # greedy picks the most likely
    assert outputs[0].token_ids != outputs[-1].token_ids  # the sampled row really sampled


def test_without_logprobs_none_are_kept(llm):
    out = llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert out.logprobs is None
    with pytest.raises(InvalidRequestError, match=r"logprobs must be in \[0, 20\]"):
        SamplingParams(logprobs=21)
