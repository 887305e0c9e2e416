"""rlhf_core.encoding: the one truncation rule, pair encoding, step encoding and padding."""

from __future__ import annotations

import pytest

from rlhf_core.encoding import encode_completions, encode_pairs, encode_steps, fit_lengths
from rlhf_core.models import ModelConfig, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")


def fit(prompt, completion, *, max_length, max_prompt_length):
    """fit_lengths for one completion, as (prompt, completion, completion was cut)."""
    p, (c,), _, (cut,) = fit_lengths(
        prompt, [completion], max_length=max_length, max_prompt_length=max_prompt_length
    )
    return p, c, cut


def test_fit_lengths_keeps_the_end_of_the_prompt():
    prompt, completion = list(range(10)), [100, 101, 102]
    p, c, cut = fit(prompt, completion, max_length=8, max_prompt_length=None)
    assert p == [5, 6, 7, 8, 9] and c == completion and not cut
    p, c, cut = fit(prompt, completion, max_length=3, max_prompt_length=None)
    assert p == [9] and c == [100, 101] and cut
    p, c, cut = fit(prompt, completion, max_length=100, max_prompt_length=4)
    assert p == [6, 7, 8, 9] and not cut


def test_step_encoding_keeps_whole_steps_and_one_token_separators(tok):
    enc = encode_steps(tok, ["p"], [["abc", "de", "fghij"]], separator="\n", max_length=8,
                       max_prompt_length=1)  # fmt: skip
    assert tok.decode(enc[0].completion_ids) == "abc\nde\n" and enc[0].dropped_steps == 1
    assert enc[0].step_ends == [3, 6]
    cut = encode_steps(tok, ["p"], [["abcdefghij"]], separator="\n", max_length=5,
                       max_prompt_length=1)  # fmt: skip
    assert tok.decode(cut[0].completion_ids) == "abc\n" and cut[0].dropped_steps == 1
    with pytest.raises(ValueError, match="must be exactly one token"):
        encode_steps(tok, ["p"], [["a"]], separator="<step>", max_length=8)


def test_a_pair_shares_one_prompt_cut_by_the_longer_completion():
    prompt, chosen, rejected = list(range(10)), [100, 101], [200, 201, 202, 203]
    p, (c, r), p_cut, cuts = fit_lengths(
        prompt, [chosen, rejected], max_length=9, max_prompt_length=None
    )
    assert p == [5, 6, 7, 8, 9] and (c, r) == (chosen, rejected) and p_cut and cuts == [0, 0]
    # an explicit budget: the prompt keeps its last N, then completions get the room left
    p, (c, r), p_cut, cuts = fit_lengths(
        prompt, [chosen, rejected], max_length=9, max_prompt_length=6
    )
    assert p == [4, 5, 6, 7, 8, 9] and c == chosen and r == [200, 201, 202] and cuts == [0, 1]
    p, _, p_cut, _ = fit_lengths(prompt, [chosen], max_length=100, max_prompt_length=None)
    assert p == prompt and not p_cut


def test_encoded_pairs_end_with_eos_and_share_the_prompt(tok):
    (pair,) = encode_pairs(tok, ["x" * 40], [("ab", "a much longer answer")], max_length=24)
    chosen, rejected = pair
    assert chosen.prompt_ids == rejected.prompt_ids and chosen.prompt_truncated
    assert len(chosen.prompt_ids) + len(rejected.completion_ids) == 24
    assert chosen.completion_ids[-1] == tok.eos_token_id and not chosen.truncated
    (one,) = encode_completions(tok, ["x" * 40], ["ab"], max_length=24)
    assert len(one.prompt_ids) == 24 - len(one.completion_ids)
    with pytest.raises(ValueError, match="same number of completions"):
        encode_pairs(tok, ["a", "b"], [("x",), ("y", "z")], max_length=8)
