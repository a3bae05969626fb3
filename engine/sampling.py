"""The sampler: one batched pass over a step's logits, in vLLM's order. First the stages that
can change any row's pick, greedy included (logit bias, min_tokens, penalties); then greedy rows
take the argmax, and sampled rows get temperature, min_p, top-k and top-p as masks over all of
them at once and one draw each from their own generator."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine.request import Request, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_output import apply_grammar_masks

# A stage edits logits [n, vocab] (float32, row i is requests[i]) in place. LOGITS_STAGES run
# in order before the greedy pick; a new per-row processor (a grammar mask) is one more entry.
LogitsStage = Callable[[torch.Tensor, Sequence[Request]], None]

# Rows are picked with logits[index], not index_select: on an oversubscribed CPU torch's
# parallel index_select of [32, vocab] took ~230 ms with 2 threads (3 ms indexed).

# Top-p looks for its cut among each row's most likely tokens first: on a CPU a top-k of this
# width costs a small fraction of a full-vocabulary sort. A row whose nucleus is wider goes
# again with WIDENING x as many, up to a full sort, so the result never depends on the width
# (nor, therefore, on the batch).
TOP_P_CANDIDATES = 256
WIDENING = 16


def make_generator(
    params: SamplingParams, device: str, num_drawn: int = 0
) -> torch.Generator | None:
    """One generator per request, so a seeded request samples the same tokens in any batch.
    num_drawn: tokens sampled already (a request resumed after a move): each took exactly one
    draw (_draw), so skipping as many continues the seeded stream where it was."""
    if params.is_greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
        return generator
    generator.manual_seed(params.seed)
    for _ in range(num_drawn):
        torch.rand(1, generator=generator, device=device)
    return generator


@torch.inference_mode()
def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """logits: [n, vocab] float32, row i for requests[i], which needs a next token (the
    sampler may edit them in place). The tokens come to the host once, in one copy at the end
    (on CUDA, the step's only host sync without logprobs). A request that asks for logprobs
    gets its token's appended to request.logprobs."""
    logprob_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    # Raw logprobs, before any stage edits the logits: [m, vocab], one op for the batch.
    raw = None
    if logprob_rows:
        raw = torch.log_softmax(logits[_index(logprob_rows, logits.device)], -1)
    for stage in LOGITS_STAGES:
        stage(logits, requests)
    token_ids = logits.argmax(dim=-1)
    rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
    if rows:
        index = _index(rows, logits.device)
        drawn = _draw(logits[index], [requests[i] for i in rows])
        token_ids.index_copy_(0, index, drawn)
    if raw is not None:
        _record_logprobs(raw, token_ids, [requests[i] for i in logprob_rows], logprob_rows)
    return token_ids.tolist()


def _record_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[Request], rows: list[int]
) -> None:
    """raw: [m, vocab] log-softmax of the rows that asked; token_ids: [n] the batch's picks."""
    picked = token_ids[_index(rows, raw.device)].unsqueeze(1)  # [m, 1]
    num_top = max(r.params.logprobs or 0 for r in requests)
    top = raw.topk(num_top, dim=-1) if num_top else None
    # Three device-to-host copies, for the whole batch.
    picked_ids, picked_lp = picked.squeeze(1).tolist(), raw.gather(1, picked).squeeze(1).tolist()
    top_ids = top.indices.tolist() if top is not None else [[]] * len(requests)
    top_lp = top.values.tolist() if top is not None else [[]] * len(requests)
    for i, r in enumerate(requests):
        k = r.params.logprobs or 0
        pairs = tuple(zip(top_ids[i][:k], top_lp[i][:k], strict=True))
        r.logprobs.append(TokenLogprobs(picked_ids[i], picked_lp[i], pairs))


# ---- stages that change greedy picks too --------------------------------------------------------
def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows, token_ids, biases = [], [], []
    for i, r in enumerate(requests):
        for token_id, bias in r.params.logit_bias.items():
            rows.append(i)
            token_ids.append(token_id)
            biases.append(bias)
    if rows:
        where = (_index(rows, logits.device), _index(token_ids, logits.device))
        logits.index_put_(where, torch.tensor(biases, device=logits.device), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Until a request has min_tokens output tokens, its EOS and stop token ids cannot win."""
    rows, token_ids = [], []
    for i, r in enumerate(requests):
        if r.num_generated_tokens < r.params.min_tokens:
            ends = [*r.params.stop_token_ids, *([] if r.eos_token_id is None else [r.eos_token_id])]
            rows.extend([i] * len(ends))
            token_ids.extend(ends)
    if rows:
        where = (_index(rows, logits.device), _index(token_ids, logits.device))
        logits.index_put_(where, torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """vLLM's penalties: a repetition penalty r divides a positive logit by r and multiplies a
    negative one by r, for every token seen in the prompt or the output; then the frequency
    penalty is subtracted once per time a token was generated and the presence penalty once for
    every token generated at all. The prompt counts for the repetition penalty only (but for
    a moved request's output before the move, Request.generated_token_ids).

    Only the (row, token) entries a request has seen are touched (a few hundred, where a dense
    [rows, vocab] pass costs tens of ms on a CPU); every other entry is left as the dense
    formula would (divided by 1, minus 0)."""
    seen, outputs = _Entries(), _Entries()
    for i, r in enumerate(requests):
        p = r.params
        if p.repetition_penalty != 1.0:
            tokens = set(r.token_ids)  # prompt and output
            seen.add(i, tokens, [p.repetition_penalty] * len(tokens))
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            counts = Counter(r.generated_token_ids)
            outputs.add(i, counts, [p.frequency_penalty * c for c in counts.values()])
            outputs.extra.extend([p.presence_penalty] * len(counts))
    device = logits.device
    if seen.rows:
        where = seen.where(device)
        values, penalty = logits[where], _floats(seen.values, device)
        logits[where] = torch.where(values > 0, values / penalty, values * penalty)
    if outputs.rows:
        where = outputs.where(device)
        # x - a - b in that order, as the dense formula subtracts frequency then presence.
        logits.index_put_(where, -_floats(outputs.values, device), accumulate=True)
        logits.index_put_(where, -_floats(outputs.extra, device), accumulate=True)


@dataclass(slots=True)
class _Entries:
    """Sparse (row, token) -> value lists, one entry per distinct token of a row."""

    rows: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    extra: list[float] = field(default_factory=list)  # a second value per entry

    def add(self, row: int, token_ids: Iterable[int], values: list[float]) -> None:
        before = len(self.token_ids)
        self.token_ids.extend(token_ids)
        self.rows.extend([row] * (len(self.token_ids) - before))
        self.values.extend(values)

    def where(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return _index(self.rows, device), _index(self.token_ids, device)


# The grammar mask first, as vLLM applies it: its -inf survives every later stage.
LOGITS_STAGES: list[LogitsStage] = [
    apply_grammar_masks,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
]


# ---- sampled rows -------------------------------------------------------------------------------
def _draw(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """logits: [m, vocab] of sampled rows -> [m] token ids (int64, on the logits' device)."""
    device = logits.device
    logits = logits / _column([r.params.temperature for r in requests], device)
    if any(r.params.min_p > 0.0 for r in requests):
        probs = torch.softmax(logits, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * _column(
            [r.params.min_p for r in requests], device
        )
        logits = logits.masked_fill(probs < floor, float("-inf"))
    logits = _top_k_top_p(logits, [r.params for r in requests])
    cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)  # [m, vocab]
    # One uniform number per row from the row's own stream, in (0, 1]: the first token whose
    # cdf reaches u x total mass is a token of non-zero probability (inverse-CDF sampling).
    uniform = 1.0 - torch.cat(
        [torch.rand(1, generator=r.generator, device=device) for r in requests]
    )
    target = uniform.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logits.shape[1] - 1)


def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Masks (to -inf) what falls outside each row's top-k, then outside the smallest set of
    most likely tokens whose probability (after top-k) reaches top_p; ties with the last kept
    token are kept. A row with neither option is unchanged."""
    vocab = logits.shape[1]
    top_k = [min(p.top_k or vocab, vocab) for p in params]
    top_p = [p.top_p for p in params]
    if all(p == 1.0 for p in top_p):
        if all(k == vocab for k in top_k):
            return logits
        width = max(k for k in top_k if k < vocab)
    elif logits.device.type == "cuda":
        width = vocab  # a full sort is cheap there, and the width check would sync the host
    else:
        width = min(vocab, max([TOP_P_CANDIDATES, *(k for k in top_k if k < vocab)]))
    return _truncate_widening(logits, top_k, top_p, width)


def _truncate_widening(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], width: int
) -> torch.Tensor:
    """_truncate from `width` candidates; rows whose nucleus is wider go again with 16x as
    many, up to the whole (sorted) vocabulary."""
    vocab = logits.shape[1]
    masked, covered = _truncate(logits, top_k, top_p, width)
    if width < vocab:
        wide = (~covered).nonzero().squeeze(1)
        if wide.numel():
            rows = wide.tolist()
            redone = _truncate_widening(
                logits[wide], [top_k[i] for i in rows], [top_p[i] for i in rows],
                min(vocab, width * WIDENING),
            )  # fmt: skip
            masked.index_copy_(0, wide, redone)
    return masked


def _truncate(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k and top-p from each row's `width` most likely tokens; also returns [m] bool, True
    where that was enough (top-k within width and, with top-p, the nucleus within width)."""
    device = logits.device
    values = logits.topk(width, dim=-1).values  # [m, width], descending
    k = _index(top_k, device).unsqueeze(1)  # [m, 1]
    kth = values.gather(1, (k - 1).clamp(max=width - 1))
    logits = logits.masked_fill((k <= width) & (logits < kth), float("-inf"))
    values = values.masked_fill(torch.arange(width, device=device) >= k, float("-inf"))
    # The nucleus mass in float64: in float32 a sum over hundreds of candidates is off by ~1e-5,
    # so whether a token just at the top_p boundary is kept would depend on the order the CPU's
    # vector units add in (AVX2 and AVX-512 disagree on real rows); in float64 only an exact tie
    # is left to chance, and the specification allows either answer there.
    lse = torch.logsumexp(logits.double(), dim=-1, keepdim=True)
    probs = torch.exp(values.double() - lse)
    mass = probs.cumsum(dim=-1)
    p = torch.tensor(top_p, dtype=torch.float64, device=device).unsqueeze(1)  # [m, 1]
    # Kept: the tokens before which the mass has not yet reached top_p (at least the first).
    num_kept = torch.minimum(((mass - probs) < p).sum(dim=-1, keepdim=True), k.clamp(max=width))
    cut = values.gather(1, num_kept - 1)
    logits = logits.masked_fill((p < 1.0) & (logits < cut), float("-inf"))
    covered = (k <= width) | (p == 1.0) | (mass[:, -1:] >= p)
    return logits, covered.squeeze(1)


# ---- helpers ------------------------------------------------------------------------------------
def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """[m, 1] float32, one value per row."""
    return _floats(values, device).unsqueeze(1)
