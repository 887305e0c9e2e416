"""Reading a reward from per-token scores: pooling, and scoring text with a scalar-head model.

    pool_last_token(scores, attention_mask)   -> (B, ...) at each row's last non-pad token, correct
                                                 under left padding, right padding or none
    pool_completion(scores, mask, pooling)    -> (B, ...): last, mean or sum over the completion
                                                 tokens `mask` marks
    TextScoring                               the text methods of `rlhf_core.scalar_head.
                                                 ScalarHeadModel`: `score`, `pooled_scores`,
                                                 `token_scores`, `step_scores`, `segment_scores`

Text is scored exactly as it was trained on (`rlhf_core.encoding`): the prompt rendered with the
chat template and cut by the one truncation rule (the model's `info.max_length`,
`max_prompt_length`), the completion ending with eos; a PRM completion is its steps, each followed
by the one-token step separator. Sequences run in batches sorted by length, right-padded.
What `score` returns per row is listed in `rlhf_core.scalar_head`.

Not here: the model, its forward and its files (`rlhf_core.scalar_head`,
`rlhf_core.scalar_head_format`), the reward models' training forwards (`reward_models.models`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from rlhf_core.chat import Messages, render_prompt
from rlhf_core.encoding import (
    EncodedCompletion,
    encode_completions,
    encode_segments,
    encode_steps,
    last_token_index,
    pad_sequences,
)
from rlhf_core.scalar_head_format import POOLINGS


def pool_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values (B, T, ...) at each row's last set mask position -> (B, ...)."""
    if values.shape[:2] != attention_mask.shape:
        raise ValueError(
            f"pool_last_token: values {tuple(values.shape)} must start with the mask's shape "
            f"{tuple(attention_mask.shape)}"
        )
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, last_token_index(attention_mask).to(values.device)]


def pool_completion(values: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """values (B, T, ...) pooled over the positions `mask` (B, T) marks -> (B, ...): the last
    marked position, or the mean or sum over the marked positions (a row with none: 0 for sum,
    nan for mean, an error for last). Unmarked positions (padding: garbage) never enter."""
    if pooling == "last":
        return pool_last_token(values, mask)
    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r}: expected one of {POOLINGS}")
    if values.shape[:2] != mask.shape:
        raise ValueError(
            f"pool_completion: values {tuple(values.shape)} must start with the mask's shape "
            f"{tuple(mask.shape)}"
        )
    keep = mask.bool().view(*mask.shape, *([1] * (values.dim() - 2)))
    total = torch.where(keep, values, torch.zeros((), dtype=values.dtype)).sum(1)
    return total / keep.sum(1).to(values.dtype) if pooling == "mean" else total


class TextScoring:
    """Scoring text: mixed into `rlhf_core.scalar_head.ScalarHeadModel`, whose `info`, `head`,
    `tokenizer` and forward (`self(input_ids, attention_mask)` -> (B, T, head_dim)) it reads."""

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("no tokenizer: set model.tokenizer (from_pretrained sets it)")
        return self.tokenizer

    @torch.no_grad()
    def _run(self, sequences: list[list[int]], batch_size: int) -> list[torch.Tensor]:
        """Per-token scores (len_i, head_dim) on the CPU for each sequence, batched by length."""
        tokenizer = self._require_tokenizer()
        device = self.head.weight.device
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
        was_training = self.training
        self.eval()
        try:
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                ids, mask = pad_sequences([sequences[i] for i in rows], tokenizer.pad_token_id)
                scores = self(ids.to(device), mask.to(device)).float().cpu()
                for b, i in enumerate(rows):
                    out[i] = scores[b, : len(sequences[i])]
        finally:
            self.train(was_training)
        return out

    def _encode(
        self, prompts: list[str | Messages], completions: list[str]
    ) -> list[EncodedCompletion]:
        tokenizer = self._require_tokenizer()
        texts = [render_prompt(tokenizer, p, where=f"prompts[{i}]") for i, p in enumerate(prompts)]
        return encode_completions(
            tokenizer, texts, list(completions), max_length=self.info.max_length,
            max_prompt_length=self.info.max_prompt_length,
        )  # fmt: skip

    def pooled_scores(
        self, prompts: list[str | Messages], completions: list[str], *, batch_size: int = 16
    ) -> torch.Tensor:
        """The head's raw output at each sequence's last token, (B, head_dim); with
        `info.pooling` mean or sum, its mean or sum over the completion's tokens."""
        encoded = self._encode(prompts, completions)
        scores = self._run([e.prompt_ids + e.completion_ids for e in encoded], batch_size)
        if not scores:
            return torch.zeros(0, self.info.head_dim)
        if self.info.pooling == "last":
            return torch.stack([s[-1] for s in scores])
        return torch.stack([
            pool_completion(s[None, len(e.prompt_ids) :], torch.ones(1, len(s) - len(e.prompt_ids)),
                            self.info.pooling)[0]
            for s, e in zip(scores, encoded, strict=True)
        ])  # fmt: skip

    def token_scores(
        self, prompts: list[str | Messages], completions: list[str], *, batch_size: int = 16
    ) -> list[torch.Tensor]:
        """The head's raw output at every completion token (eos included), (len_i, head_dim)."""
        encoded = self._encode(prompts, completions)
        scores = self._run([e.prompt_ids + e.completion_ids for e in encoded], batch_size)
        return [s[len(e.prompt_ids) :] for s, e in zip(scores, encoded, strict=True)]

    def step_scores(
        self, prompts: list[str | Messages], steps: list[list[str]], *, batch_size: int = 16
    ) -> list[torch.Tensor]:
        """PRM: P(step is not an error) at each kept step's separator, (n_steps_i,)."""
        if self.info.kind != "prm":
            raise ValueError(f"step_scores needs a 'prm' model, this one is {self.info.kind!r}")
        tokenizer = self._require_tokenizer()
        texts = [render_prompt(tokenizer, p, where=f"prompts[{i}]") for i, p in enumerate(prompts)]
        encoded = encode_steps(
            tokenizer, texts, [list(s) for s in steps], separator=self.info.step_separator,
            max_length=self.info.max_length, max_prompt_length=self.info.max_prompt_length,
        )  # fmt: skip
        scores = self._run([e.prompt_ids + e.completion_ids for e in encoded], batch_size)
        out = []
        for s, e in zip(scores, encoded, strict=True):
            at_ends = s[[len(e.prompt_ids) + j for j in e.step_ends]]
            out.append(1 - at_ends.softmax(-1)[:, 0])
        return out

    def segment_scores(
        self, prompts: list[str | Messages], completions: list[str], *, batch_size: int = 16,
        alone: bool = False,
    ) -> list[torch.Tensor]:  # fmt: skip
        """Segment model: the class logits (n_i, head_dim) at the token ending each segment of
        each completion, in the order of `segment(completion, info.segment_level)`; segments cut
        off by `max_length` get no row. `alone`: each segment is scored as a completion of its
        own after the prompt, without the completion's earlier segments (a judgment that needs
        only the prompt, such as a sentence's facts against the notes, then reads every segment
        where the model saw most of its training segments: first)."""
        if self.info.kind != "segment":
            raise ValueError(
                f"segment_scores needs a 'segment' model, this one is {self.info.kind!r}"
            )
        if alone:
            from rlhf_core.segmentation import segment

            parts = [
                [s.text.strip() for s in segment(c, self.info.segment_level)] for c in completions
            ]
            flat = self.segment_scores(
                [p for p, ss in zip(prompts, parts, strict=True) for _ in ss],
                [s for ss in parts for s in ss], batch_size=batch_size,
            )  # fmt: skip
            out, k = [], 0
            for ss in parts:
                rows = [x[-1:] for x in flat[k : k + len(ss)]]  # its last segment ends it
                k += len(ss)
                kept = next((i for i, r in enumerate(rows) if len(r) == 0), len(rows))
                out.append(torch.cat([torch.zeros(0, self.info.head_dim), *rows[:kept]]))
            return out
        tokenizer = self._require_tokenizer()
        texts = [render_prompt(tokenizer, p, where=f"prompts[{i}]") for i, p in enumerate(prompts)]
        encoded = encode_segments(
            tokenizer, texts, list(completions), level=self.info.segment_level,
            max_length=self.info.max_length, max_prompt_length=self.info.max_prompt_length,
        )  # fmt: skip
        scores = self._run([e.prompt_ids + e.completion_ids for e in encoded], batch_size)
        return [
            s[[len(e.prompt_ids) + j for j in e.step_ends]]
            for s, e in zip(scores, encoded, strict=True)
        ]

    def split_steps(self, completion: str) -> list[str]:
        """A PRM completion given as one string, split at the step separator (empty steps go)."""
        return [s for s in completion.split(self.info.step_separator) if s.strip()]

    def score(
        self,
        prompts: list[str | Messages],
        completions: list[str] | list[list[str]],
        *,
        batch_size: int = 16,
        step_reduction: Literal["min", "prod", "last"] = "min",
    ) -> torch.Tensor:
        """One reward per (prompt, completion), (B,); see the module docstring for each kind.

        PRM completions may be step lists or strings (split at the step separator); a completion
        with no steps scores 1.0 (no step is an error)."""
        kind = self.info.kind
        if kind == "segment":
            raise ValueError(
                "score: a 'segment' model has one score per segment; use segment_scores"
            )
        if kind == "prm":
            steps = [self.split_steps(c) if isinstance(c, str) else c for c in completions]
            per_step = self.step_scores(prompts, steps, batch_size=batch_size)
            reduce = {"min": lambda p: p.min(), "prod": lambda p: p.prod(), "last": lambda p: p[-1]}
            if step_reduction not in reduce:
                raise ValueError(f"step_reduction {step_reduction!r}: expected min, prod or last")
            return torch.stack(
                [reduce[step_reduction](p) if len(p) else torch.tensor(1.0) for p in per_step]
            )
        if self.info.head_dim != 1:
            raise ValueError(
                f"score: a {kind!r} model with head_dim {self.info.head_dim} has no single "
                "reward; use pooled_scores"
            )
        pooled = self.pooled_scores(prompts, list(completions), batch_size=batch_size)[:, 0]
        return torch.sigmoid(pooled) if kind == "orm" else pooled
