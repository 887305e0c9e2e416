"""The decode loop's behaviour log-probs (`decode(..., with_logprobs=True)`): the log-prob of each
sampled token under the distribution it was drawn from, after temperature and truncation.

The reference re-scores the finished sequences with one plain forward (no KV cache) and warps the
logits with its own float64 top-k / top-p / min-p written from transformers' definitions, sharing
no code with `rlhf_core.generation`.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.generation import Sampling, decode, row_generators, sample_from_logits
from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

TINY = ModelConfig(name_or_path="tiny-qwen3")
PROMPTS = ["<|user|>ab<|end|><|assistant|>", "<|user|>a longer prompt here<|end|><|assistant|>"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    torch.manual_seed(0)
    return load_policy(TINY).eval(), load_tokenizer(TINY, padding_side="left")


def warped_log_softmax(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """log of the sampling distribution (V,) in float64, -inf on removed tokens: / temperature,
    keep the top_k largest, keep a token when the mass of the tokens above it is < top_p, drop
    tokens below min_p x the top probability."""
    z = logits.double() / s.temperature
    if s.top_k:
        kth = z.sort(descending=True).values[s.top_k - 1]
        z = z.masked_fill(z < kth, float("-inf"))
    if s.top_p < 1:
        p, order = z.softmax(-1).sort(descending=True)
        above = p.cumsum(-1) - p
        removed = torch.zeros_like(z, dtype=torch.bool)
        removed[order] = above >= s.top_p
        z = z.masked_fill(removed, float("-inf"))
    if s.min_p:
        p = z.softmax(-1)
        z = z.masked_fill(p < s.min_p * p.max(), float("-inf"))
    return z.log_softmax(-1)


def sampled(model, tok, sampling: Sampling, group_size: int = 1, **kwargs):
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    seeds = range(len(PROMPTS) * group_size)
    args = {"max_new_tokens": 24, "eos_token_id": tok.eos_token_id, "sampling": sampling,
            "pad_token_id": tok.pad_token_id, "group_size": group_size, **kwargs}  # fmt: skip
    plain = decode(model, enc["input_ids"], enc["attention_mask"],
                   generator=row_generators(seeds, "cpu"), **args)  # fmt: skip
    seqs, logps = decode(model, enc["input_ids"], enc["attention_mask"], with_logprobs=True,
                         generator=row_generators(seeds, "cpu"), **args)  # fmt: skip
    mask = enc["attention_mask"].repeat_interleave(group_size, 0)
    return plain, seqs, logps, mask, enc["input_ids"].shape[1]


SAMPLINGS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_p=0.8),
    Sampling(temperature=1.3, top_k=5),
    Sampling(temperature=0.5, min_p=0.2),
    Sampling(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=repr)
def test_behaviour_logprobs_are_the_warped_distributions_and_change_no_token(
    model_and_tokenizer, sampling, group_size
):
    model, tok = model_and_tokenizer
    plain, seqs, logps, mask, p = sampled(model, tok, sampling, group_size)
    assert torch.equal(plain, seqs)  # recording them draws the same tokens
    assert logps.dtype == torch.float32 and logps.shape == (seqs.shape[0], seqs.shape[1] - p)
    full_mask = torch.cat([mask, torch.ones_like(seqs[:, p:])], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=seqs, attention_mask=full_mask, position_ids=positions).logits
    gaps = []
    for i in range(seqs.shape[0]):
        done = False
        for t in range(seqs.shape[1] - p):
            token = int(seqs[i, p + t])
            if done:  # after the row's eos: pad, log-prob 0
                assert logps[i, t] == 0
                continue
            ref = warped_log_softmax(logits[i, p + t - 1], sampling)
            assert float(logps[i, t]) == pytest.approx(float(ref[token]), abs=1e-4)
            untruncated = (logits[i, p + t - 1].double() / sampling.temperature).log_softmax(-1)
            gaps.append(float(ref[token] - untruncated[token]))
            done = token == tok.eos_token_id
    if sampling.truncates:  # truncation renormalises: the sampler's log-probs are higher
        assert min(gaps) > -1e-9 and sum(g > 1e-3 for g in gaps) > len(gaps) / 4, gaps
    else:
        assert max(abs(g) for g in gaps) < 1e-9


def test_greedy_behaviour_logprobs_are_zero(model_and_tokenizer):
    model, tok = model_and_tokenizer
    plain, seqs, logps, _, _ = sampled(model, tok, Sampling())
    assert torch.equal(plain, seqs) and torch.equal(logps, torch.zeros_like(logps))


def test_sample_from_logits_returns_the_drawn_tokens_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 4
    index, logp = sample_from_logits(logits, torch.Generator().manual_seed(1), with_logprob=True)
    assert torch.equal(index, sample_from_logits(logits, torch.Generator().manual_seed(1)))
    ref = logits.double().log_softmax(-1).gather(-1, index[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), ref, rtol=0, atol=1e-6)


def test_encoder_decoder_policy_records_behaviour_logprobs():
    from rlhf_core.policy_model import decoder_start_id

    cfg = ModelConfig(name_or_path="tiny-t5-facts")
    torch.manual_seed(0)
    model, tok = load_policy(cfg).eval(), load_tokenizer(cfg, padding_side="left")
    enc = tok(["a question", "another longer question"], return_tensors="pt", padding=True,
              add_special_tokens=False)  # fmt: skip
    sampling = Sampling(temperature=1.2, top_k=4)
    args = {"max_new_tokens": 8, "eos_token_id": tok.eos_token_id, "group_size": 2,
            "pad_token_id": tok.pad_token_id, "sampling": sampling}  # fmt: skip
    plain = decode(model, enc["input_ids"], enc["attention_mask"],
                   generator=row_generators(range(4), "cpu"), **args)  # fmt: skip
    seqs, logps = decode(model, enc["input_ids"], enc["attention_mask"], with_logprobs=True,
                         generator=row_generators(range(4), "cpu"), **args)  # fmt: skip
    assert torch.equal(plain, seqs)
    p = enc["input_ids"].shape[1]
    new = seqs[:, p:]
    assert logps.shape == new.shape
    start = torch.full_like(new[:, :1], decoder_start_id(model))
    with torch.no_grad():  # teacher forcing: the decoder's logits before each sampled token
        logits = model(
            input_ids=enc["input_ids"].repeat_interleave(2, 0),
            attention_mask=enc["attention_mask"].repeat_interleave(2, 0),
            decoder_input_ids=torch.cat([start, new[:, :-1]], 1),
        ).logits
    for i in range(new.shape[0]):
        done = False
        for t in range(new.shape[1]):
            if done:
                assert logps[i, t] == 0
                continue
            ref = warped_log_softmax(logits[i, t], sampling)[int(new[i, t])]
            assert float(logps[i, t]) == pytest.approx(float(ref), abs=1e-4)
            done = int(new[i, t]) == tok.eos_token_id
