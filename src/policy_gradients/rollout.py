"""Prompts, rollouts and the rollout log.

`load_prompts` turns a data source into prompt items: reasoning-gym entries (question ->
prompt, kept for the task's scorer) or file rows in any standard layout of `rlhf_core.columns`
(`data.columns` renames the user's columns): a prompt alone, a prompt with a completion or a
preference pair (the prompt is taken, the rest ignored), a conversation (`messages`; a trailing
assistant turn dropped), or Anthropic HH transcripts (`data.format: hh`: the turns up to the last
"\n\nAssistant:"). The reference answer (`data.answer_column`, or `data.columns.answer`) is
kept when the row has one; it is required only when a configured reward reads it
(`rewards.answer_needed_by`). An optional `prompt_template` wraps the last user turn (e.g. to ask
for <answer> tags) and an optional system prompt is prepended.

`generate_rollouts` samples `group_size` completions for each prompt with
`rlhf_core.generation.decode` (KV cache, left padding; each prompt encoded once and its KV cache
shared by its group) and returns token-level tensors: the completion is everything after the
(left-padded) prompt; `action_mask` is 1 through the first eos and 0 after it; a completion
without eos is `truncated`; `log_probs_behaviour` keeps the sampler's own log-prob of each token
(the distribution it drew from, after temperature and truncation).

`RolloutLog` appends every training rollout and every evaluation completion to
`rollouts.sqlite` from a background thread, so writing never blocks training.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from policy_gradients.rewards import check_answers
from rlhf_core.chat import HH_TURN, Messages, as_messages, render_prompt, split_hh_pair
from rlhf_core.columns import Columns, apply_columns, detect_layout
from rlhf_core.data import DataSource, load_rows, reasoning_gym_dataset
from rlhf_core.errors import UserError
from rlhf_core.fault_points import fault_point
from rlhf_core.generation import Sampling, decode, row_generators
from rlhf_core.policy_model import completion_values as policy_completion_values
from rlhf_core.policy_model import is_encoder_decoder
from rlhf_core.sequences import sequence_logprobs


@dataclass
class PromptSet:
    items: list[dict[str, Any]]  # prompt (rendered), messages, answer (or None), entry
    scorer: Any | None  # reasoning-gym dataset, if the prompts came from one


PROMPT_FORMATS = ("auto", "plain", "conversational", "hh")
# the standard layouts (rlhf_core.columns) a prompt can be read from: any row that has a prompt,
# a conversation, or (HH) two transcripts that share it
PROMPT_LAYOUTS = ("preference", "unpaired", "prompt_completion", "implicit_preference",
                  "messages", "prompt_only")  # fmt: skip
HH_START = "\n\nHuman:"


def hh_prompt(first: str, second: str | None, where: str) -> Messages:
    """The multi-turn prompt of an Anthropic HH transcript: its turns up to the last
    '\\n\\nAssistant:' (`split_hh_pair`; with `second`, the last one the two transcripts share);
    a transcript that ends on a Human turn is all prompt."""
    if second is None:
        second = first
        last = [m.group(1) for m in HH_TURN.finditer(first)]
        if last and last[-1] == "Human":
            first = second = first + "\n\nAssistant:"
    return split_hh_pair(first, second, where=where)[0]


def _without_reply(messages: Messages, where: str) -> Messages:
    """A conversation as a prompt: a trailing assistant turn (the data set's reply) dropped."""
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not any(m["role"] == "user" for m in messages):
        raise UserError(f"{where}: the prompt has no user turn ({len(messages)} messages)")
    return messages


def prompt_messages(row: dict[str, Any], fmt: str, where: str) -> Messages:
    """The prompt of one row (standard keys, `rlhf_core.columns`) as messages, by `fmt`:

    plain           `prompt` is the user turn's text (never parsed)
    conversational  `prompt` or `messages` is a message list; a trailing assistant turn dropped
    hh              an Anthropic HH transcript: `prompt`, or the `chosen` / `rejected` pair
    auto            by the row: message lists are conversational; a string that starts with
                    '\\n\\nHuman:', or chosen + rejected strings without a prompt, are hh;
                    any other string is plain
    """
    layout = detect_layout(row, PROMPT_LAYOUTS, where)
    value = row["messages"] if layout == "messages" else row.get("prompt")
    if layout == "implicit_preference":  # chosen + rejected, no prompt
        chosen, rejected = row["chosen"], row["rejected"]
        if isinstance(chosen, str) and isinstance(rejected, str):
            if fmt not in ("auto", "hh"):
                raise UserError(
                    f"{where}: data.format {fmt!r} needs a prompt column; these "
                    "rows are chosen/rejected transcripts (use format hh or auto)"
                )
            return hh_prompt(chosen, rejected, where)
        chosen = as_messages(chosen, where=f"{where} column 'chosen'")
        if fmt not in ("auto", "conversational"):
            raise UserError(
                f"{where}: chosen/rejected are message lists: use data.format "
                "conversational (or auto)"
            )
        return _without_reply(chosen, where)
    here = f"{where} column {'messages' if layout == 'messages' else 'prompt'!r}"
    if layout == "messages" and not isinstance(value, list):
        raise UserError(f"{here}: expected a message list, got {type(value).__name__}")
    if isinstance(value, str):
        if fmt == "conversational":
            raise UserError(
                f"{here}: data.format conversational needs a message list, got a "
                f"string: {value[:60]!r}"
            )
        if fmt == "hh" or (fmt == "auto" and value.startswith(HH_START)):
            return hh_prompt(value, None, here)
        return [{"role": "user", "content": value}]
    if fmt in ("plain", "hh"):
        raise UserError(
            f"{here}: data.format {fmt!r} needs a string prompt, got "
            f"{type(value).__name__}: {str(value)[:60]!r}"
        )
    return _without_reply(as_messages(value, where=here), here)


def load_prompts(
    source: DataSource,
    tokenizer,
    *,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    prompt_template: str = "{question}",
    system_prompt: str | None = None,
    where: str,
    limit: int | None = None,
    format: str = "auto",
    columns: Columns | None = None,
    answer_needed_by: list[str] | tuple[str, ...] = (),
) -> PromptSet:
    """The prompt items of a source (see the module docstring). `columns` (`data.columns`) and
    the older `prompt_column` / `answer_column` name the row's columns; `prompt_template` wraps
    the last user turn; `system_prompt` goes first unless the row has its own system turn.
    Rows without an answer get `answer: None`; `answer_needed_by` (the rewards that read it,
    `rewards.answer_needed_by`) makes that an error."""
    if format not in PROMPT_FORMATS:
        raise UserError(f"{where}: unknown prompt format {format!r}; choose from {PROMPT_FORMATS}")
    scorer = None
    if source.reasoning_gym is not None:
        scorer = reasoning_gym_dataset(source.reasoning_gym)
        rows: Any = [{"prompt": e["question"], "answer": e["answer"], "entry": e} for e in scorer]
        columns, format = None, "plain"
    else:
        rows = load_rows(source, field=where)
        columns = merged_columns(columns, prompt_column, answer_column)
    items = []
    for index, row in enumerate(rows):
        here = f"{where} ({source.describe()}): row {index}"
        row = apply_columns(dict(row), columns, here)
        messages = [dict(m) for m in prompt_messages(row, format, here)]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        last = messages[users[-1]]
        last["content"] = prompt_template.format(question=last["content"])
        if system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = render_prompt(tokenizer, messages, where=here)
        answer = row.get("answer")
        items.append({
            "prompt": text, "messages": messages,
            "answer": None if answer is None else str(answer), "entry": row.get("entry"),
        })  # fmt: skip
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise UserError(f"{where}: no prompts in {source.describe()}")
    check_answers(items, list(answer_needed_by), where=f"{where} ({source.describe()})")
    return PromptSet(items=items, scorer=scorer)


def merged_columns(columns: Columns | None, prompt_column: str, answer_column: str) -> Columns:
    """`data.columns` with the older `prompt_column` / `answer_column` keys folded in (a
    non-default one names the same thing as `columns.prompt` / `columns.answer`; both set to
    different columns is an error)."""
    merged = columns.model_dump() if columns is not None else {}
    for key, name in (("prompt", prompt_column), ("answer", answer_column)):
        if name == key:
            continue
        if merged.get(key) not in (None, name):
            raise UserError(
                f"data.{key}_column {name!r} and data.columns.{key} {merged[key]!r} name "
                "different columns; keep one"
            )
        merged[key] = name
    return Columns.model_validate(merged)


@dataclass
class Rollouts:
    sequence_ids: torch.Tensor  # (B, S) = left-padded prompt (P) + completion (T)
    attention_mask: torch.Tensor  # (B, S)
    action_mask: torch.Tensor  # (B, T)
    prompt_length: int  # P
    completions: list[str]
    truncated: torch.Tensor  # (B,) bool
    # (B, T) float32: each sampled token's log-prob under the distribution the sampler drew it
    # from (after temperature and truncation), 0 off the action mask; None when not recorded
    log_probs_behaviour: torch.Tensor | None = None

    def completion_token_ids(self) -> list[list[int]]:
        """Each completion's tokens through its eos (or all T if truncated)."""
        tokens = self.sequence_ids[:, self.prompt_length :].tolist()
        lengths = self.action_mask.sum(-1).tolist()
        return [row[: int(n)] for row, n in zip(tokens, lengths, strict=True)]


@torch.no_grad()
def generate_rollouts(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    *,
    group_size: int,
    max_new_tokens: int,
    sampling: Sampling,
    seeds: list[int] | None = None,
    behaviour_logprobs: bool = False,
) -> Rollouts:
    """`group_size` sampled completions per prompt, grouped consecutively (rows g*G ... g*G+G-1).
    With `behaviour_logprobs`, the rollouts keep the sampler's own log-prob of each token
    (`rlhf_core.generation.decode`'s `with_logprobs`).

    `seeds` (one per prompt): completion j of prompt g is drawn with its own generator seeded
    from (seeds[g], j), so a rollout does not depend on how prompts are split across processes
    or batches (a 2-process run samples exactly what a 1-process run does). Without them the
    global torch RNG is used."""
    if tokenizer.padding_side != "left":
        raise UserError("generate_rollouts needs a left-padding tokenizer")
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    was_training = model.training
    model.eval()
    try:
        generator = None
        if seeds is not None:
            rows = [seed * 1_000_003 + j for seed in seeds for j in range(group_size)]
            generator = row_generators(rows, device)
        out = decode(  # each prompt encoded once, its KV cache shared by its group
            model, enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            sampling=sampling, generator=generator, group_size=group_size,
            with_logprobs=behaviour_logprobs,
        )  # fmt: skip
    finally:
        model.train(was_training)
    out, behaviour = out if behaviour_logprobs else (out, None)
    prompt_length = enc["input_ids"].shape[1]
    ids = out[:, :prompt_length]
    mask = enc["attention_mask"].repeat_interleave(group_size, dim=0)
    completion = out[:, prompt_length:]
    is_eos = completion == tokenizer.eos_token_id
    # 1 through the first eos: positions whose count of earlier eos tokens is zero
    before_first_eos = (is_eos.long().cumsum(-1) - is_eos.long()) == 0
    action_mask = before_first_eos.long()
    truncated = ~is_eos.any(-1)
    texts = tokenizer.batch_decode(completion.masked_fill(action_mask == 0, tokenizer.pad_token_id),
                                   skip_special_tokens=True)  # fmt: skip
    sequence_ids = torch.cat(
        [ids, completion.masked_fill(action_mask == 0, tokenizer.pad_token_id)], 1
    )
    attention_mask = torch.cat([mask, action_mask], dim=1)
    if behaviour is not None:
        behaviour = behaviour.masked_fill(action_mask == 0, 0.0)
    return Rollouts(sequence_ids, attention_mask, action_mask, prompt_length, texts, truncated,
                    behaviour)  # fmt: skip


def completion_logprobs(
    model: torch.nn.Module, rollouts_ids: torch.Tensor, attention_mask: torch.Tensor,
    prompt_length: int, *, temperature: float, with_entropy: bool = False,
    action_mask: torch.Tensor | None = None,
) -> Any:  # fmt: skip
    """Log-probs (B, T) of the completion tokens under logits / temperature (the sampling
    distribution); with `with_entropy`, also the per-token entropies (B, T).

    Only the completion positions (`action_mask` (B, T); by default every completion position)
    are scored (`rlhf_core.sequences.sequence_logprobs`: a causal LM's head runs on them alone,
    fused with the log-softmax; an encoder-decoder model encodes the prompt and scores the
    completion with its decoder); positions outside the mask are 0. With an `action_mask` and a
    causal LM, the rows that share a prompt (a group) share one encoding of it
    (`rlhf_core.prefix.shared_prompt_logprobs`: equal log-probs, gradients summed over the
    group as with separate rows)."""

    batch, total = rollouts_ids.shape
    if action_mask is not None and not is_encoder_decoder(model):
        p = prompt_length
        prompt_and_completion = {
            "prompt_ids": rollouts_ids[:, :p], "prompt_mask": attention_mask[:, :p],
            "completion_ids": rollouts_ids[:, p:], "completion_mask": attention_mask[:, p:],
        }  # fmt: skip
        out = sequence_logprobs(
            model, prompt_and_completion, temperature=temperature, with_entropy=with_entropy
        )
        keep = action_mask.bool()
        if with_entropy:
            return tuple(torch.where(keep, x, torch.zeros_like(x)) for x in out)
        return torch.where(keep, out, torch.zeros_like(out))
    target = torch.zeros(batch, total - 1, dtype=torch.bool, device=rollouts_ids.device)
    if action_mask is None:
        target[:, prompt_length - 1 :] = True
    else:
        target[:, prompt_length - 1 :] = action_mask.bool()
    rows = {"input_ids": rollouts_ids, "attention_mask": attention_mask, "target_mask": target}
    out = sequence_logprobs(model, rows, temperature=temperature, with_entropy=with_entropy)
    if with_entropy:
        logps, entropy = out
        return logps[:, prompt_length - 1 :], entropy[:, prompt_length - 1 :]
    return out[:, prompt_length - 1 :]


def completion_values(
    value_model: torch.nn.Module,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
) -> torch.Tensor:
    """V(s_t) for each completion token t, (B, T): the value head at the position that predicts
    token t (aligned with `completion_logprobs`; `rlhf_core.policy_model.completion_values`)."""
    return policy_completion_values(value_model, ids, attention_mask, prompt_length)


class RolloutLog:
    """Appends rollouts to `<run_dir>/rollouts.sqlite` on a background thread.

    Three tables (schema and example queries: docs/policy_gradients/rollout_log.md):

    - `rollouts`: every training sample, one row per completion: the step, the sampler's epoch,
      the prompt's index in the training set, the sample's index within its group, the texts,
      total reward, reward components (JSON), sequence advantage, length, truncation, and the
      version of the weights that sampled it (the training steps they had taken: step - 1
      synchronously, up to `rollout.max_staleness` fewer with asynchronous rollouts).
    - `eval_rollouts`: every held-out completion of every evaluation (`kind` greedy / sampled),
      with the same columns but no advantage.
    - `turns`: with an environment, every turn of every training episode: its trajectory id,
      turn index, role (assistant / environment), text, tools called or answering, reward.

    All are indexed on `step`. `write` / `write_eval` only queue rows; one thread owns the
    connection and commits, so the training thread never waits on the disk. `flush(step)`,
    before checkpoint-<step>, records in `log_marks` each table's last row; a resume from that
    checkpoint keeps exactly the rows up to them (so a final evaluation logged after the last
    checkpoint is redone, not kept twice; a log without marks keeps the rows up to the step).
    """

    COLUMNS = (
        "step INTEGER, epoch INTEGER, prompt_index INTEGER, rollout_index INTEGER, prompt TEXT, "
        "completion TEXT, reward REAL, components TEXT, advantage REAL, length INTEGER, "
        "truncated INTEGER, policy_version INTEGER"
    )
    EVAL_COLUMNS = (
        "step INTEGER, kind TEXT, prompt_index INTEGER, rollout_index INTEGER, prompt TEXT, "
        "completion TEXT, reward REAL, components TEXT, length INTEGER, truncated INTEGER"
    )
    TURN_COLUMNS = (
        "step INTEGER, prompt_index INTEGER, rollout_index INTEGER, trajectory INTEGER, "
        "turn INTEGER, role TEXT, text TEXT, tool TEXT, reward REAL"
    )
    SCHEMA = (
        f"CREATE TABLE IF NOT EXISTS rollouts ({COLUMNS})",
        f"CREATE TABLE IF NOT EXISTS eval_rollouts ({EVAL_COLUMNS})",
        f"CREATE TABLE IF NOT EXISTS turns ({TURN_COLUMNS})",
        "CREATE INDEX IF NOT EXISTS rollouts_step ON rollouts (step)",
        "CREATE INDEX IF NOT EXISTS eval_rollouts_step ON eval_rollouts (step)",
        "CREATE INDEX IF NOT EXISTS turns_step ON turns (step)",
    )

    TABLES = ("rollouts", "eval_rollouts", "turns")

    def __init__(self, path: Path, *, enabled: bool = True, resume_step: int | None = None) -> None:
        self.path, self.enabled = Path(path), enabled
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with sqlite3.connect(self.path) as conn:
            columns = [c[1] for c in conn.execute("PRAGMA table_info(rollouts)")]
            if columns and "rollout_index" not in columns:  # a log from before these columns
                conn.execute("ALTER TABLE rollouts RENAME TO rollouts_v1")
            elif columns and "policy_version" not in columns:  # before asynchronous rollouts
                conn.execute("ALTER TABLE rollouts ADD COLUMN policy_version INTEGER")
            for statement in self.SCHEMA:
                conn.execute(statement)
            conn.execute(
                "CREATE TABLE IF NOT EXISTS log_marks (step INTEGER, tbl TEXT, last INTEGER)"
            )
            # a fresh run starts empty; a resumed one drops the rows it is about to redo
            for table in self.TABLES:
                mark = conn.execute(
                    "SELECT last FROM log_marks WHERE step = ? AND tbl = ? ORDER BY rowid DESC",
                    (resume_step or 0, table),
                ).fetchone()
                if mark is not None:
                    conn.execute(f"DELETE FROM {table} WHERE rowid > ?", (mark[0] or 0,))
                conn.execute(f"DELETE FROM {table} WHERE step > ?", (resume_step or 0,))
            conn.execute("DELETE FROM log_marks WHERE step > ?", (resume_step or 0,))
        self._thread = threading.Thread(target=self._run, name="rollout-log", daemon=True)
        self._thread.start()

    def write(self, rows: list[tuple]) -> None:
        """Queue training rows, in the order of `COLUMNS`."""
        if self.enabled:
            self._queue.put(("rollouts", rows))

    def write_eval(self, rows: list[tuple]) -> None:
        """Queue evaluation rows, in the order of `EVAL_COLUMNS`."""
        if self.enabled:
            self._queue.put(("eval_rollouts", rows))

    def write_turns(self, rows: list[tuple]) -> None:
        """Queue episode turns, in the order of `TURN_COLUMNS`."""
        if self.enabled and rows:
            self._queue.put(("turns", rows))

    def _run(self) -> None:
        conn = sqlite3.connect(self.path)
        width = {"rollouts": self.COLUMNS.count(",") + 1,
                 "eval_rollouts": self.EVAL_COLUMNS.count(",") + 1,
                 "turns": self.TURN_COLUMNS.count(",") + 1, "log_marks": 3}  # fmt: skip
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                break
            table, rows = item
            if table == "log_marks":  # rows: the step of the checkpoint that follows
                rows = [(rows, t, conn.execute(f"SELECT max(rowid) FROM {t}").fetchone()[0])
                        for t in self.TABLES]  # fmt: skip
            marks = ", ".join("?" * width[table])
            conn.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
            fault_point("rollout_log.insert")
            conn.commit()
            self._queue.task_done()
        conn.close()

    def flush(self, step: int | None = None) -> None:
        """Wait until every queued row is committed; with `step` (before checkpoint-<step>:
        a resume keeps the rows up to it, so they must be on disk when it is) mark them."""
        if self._thread is not None:
            if step is not None:
                self._queue.put(("log_marks", step))
            self._queue.join()

    def close(self) -> None:
        """Flush everything queued and stop the writer."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
