"""Data sources (rlhf_core.data): local files, the vendored data, reasoning-gym, and the resumable
seeded EpochSampler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rlhf_core.config import ConfigError, StrictModel, validate_config
from rlhf_core.data import (
    DataSource,
    EpochSampler,
    ReasoningGymSource,
    check_heldout_seeds,
    is_local_path,
    load_rows,
    reasoning_gym_dataset,
)

DATA = Path(__file__).resolve().parents[2] / "data"
ROWS = [
    {"prompt": "a", "completion": "x", "score": 1.0},
    {"prompt": "bb", "completion": "y", "score": 0.5},
    {"prompt": "ccc", "completion": "z", "score": -1.0},
]
SPELL = {"task": "spell_backward", "size": 8, "seed": 1, "config": {"max_word_len": 6}}


class Wrapper(StrictModel):
    train: DataSource


# ----------------------------------------------------------------------------- DataSource


def test_data_source_needs_exactly_one_of_path_or_reasoning_gym():
    with pytest.raises(ValidationError, match="exactly one of 'path' or 'reasoning_gym'"):
        DataSource()
    with pytest.raises(ValidationError, match="exactly one of 'path' or 'reasoning_gym'"):
        DataSource(path="data/x.jsonl", reasoning_gym=SPELL)
    assert DataSource(path="data/x.jsonl").describe() == "data/x.jsonl[train]"
    rg = DataSource(reasoning_gym=SPELL)
    assert rg.describe() == "reasoning_gym:spell_backward(size=8, seed=1)"


def test_data_source_errors_through_a_config_name_the_key():
    with pytest.raises(ConfigError, match="exactly one of") as info:
        validate_config(Wrapper, {"train": {"split": "test"}}, "cfg.yaml")
    assert "cfg.yaml" in str(info.value) and "train" in str(info.value)
    with pytest.raises(ConfigError, match="train.limit"):
        validate_config(Wrapper, {"train": {"path": "x.jsonl", "limit": 0}}, "cfg.yaml")
    with pytest.raises(ConfigError, match="unknown key 'train.file'"):
        validate_config(Wrapper, {"train": {"file": "x.jsonl"}}, "cfg.yaml")


@pytest.mark.parametrize(
    ("path", "local"),
    [
        ("data/x.jsonl", True),
        ("x.parquet", True),
        ("./somewhere", True),
        ("/abs/dir", True),
        ("Anthropic/hh-rlhf", False),
        ("gsm8k", False),
    ],
)
def test_is_local_path(path, local):
    assert is_local_path(path) is local


# ----------------------------------------------------------------------------- load_rows


def write_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def write_json(path: Path) -> Path:
    path.write_text(json.dumps(ROWS))
    return path


def write_parquet(path: Path) -> Path:
    import datasets

    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    return path


@pytest.mark.parametrize(
    ("name", "writer"),
    [("rows.jsonl", write_jsonl), ("rows.json", write_json), ("rows.parquet", write_parquet)],
)
def test_load_rows_local_files(tmp_path, name, writer):
    path = writer(tmp_path / name)
    ds = load_rows(DataSource(path=str(path)))
    assert len(ds) == 3
    assert [dict(row) for row in ds] == ROWS
    assert len(load_rows(DataSource(path=str(path), limit=2))) == 2
    assert len(load_rows(DataSource(path=str(path), limit=50))) == 3


def test_load_rows_keeps_the_first_rows_with_limit(tmp_path):
    ds = load_rows(DataSource(path=str(write_jsonl(tmp_path / "rows.jsonl")), limit=2))
    assert ds["prompt"] == ["a", "bb"]


def test_offset_and_limit_select_disjoint_slices(tmp_path):
    path = str(write_jsonl(tmp_path / "rows.jsonl"))
    head = list(load_rows(DataSource(path=path, limit=1))["prompt"])
    tail = list(load_rows(DataSource(path=path, offset=1))["prompt"])
    assert head + tail == list(load_rows(DataSource(path=path))["prompt"])
    assert list(load_rows(DataSource(path=path, offset=1, limit=1))["prompt"]) == tail[:1]
    assert len(load_rows(DataSource(path=path, offset=10))) == 0


def test_load_rows_vendored_hh_rlhf():
    path = DATA / "hh-rlhf" / "harmless-base-test.jsonl.gz"
    ds = load_rows(DataSource(path=str(path)))
    assert len(ds) == 2312
    assert sorted(ds.column_names) == ["chosen", "rejected"]
    row = ds[0]
    assert row["chosen"].startswith("\n\nHuman:") and row["rejected"].startswith("\n\nHuman:")
    # the two share the dialogue up to the last Assistant turn
    cut = row["chosen"].rfind("\n\nAssistant:")
    assert cut > 0 and row["rejected"][:cut] == row["chosen"][:cut]


@pytest.mark.parametrize(("name", "rows"), [("test.jsonl", 1319), ("train-2000.jsonl", 2000)])
def test_load_rows_vendored_gsm8k(name, rows):
    ds = load_rows(DataSource(path=str(DATA / "gsm8k" / name)))
    assert len(ds) == rows
    assert sorted(ds.column_names) == ["answer", "question"]
    assert all("\n#### " in answer for answer in ds["answer"])


def test_load_rows_missing_file_names_field_and_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"train\.path") as info:
        load_rows(DataSource(path=str(missing)), field="train")
    assert str(missing) in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"data\.path: data file not found: data/nope"):
        load_rows(DataSource(path="data/nope.jsonl"))


def test_load_rows_unsupported_suffix(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"eval\.path: .*rows\.csv.*unsupported suffix '\.csv'"):
        load_rows(DataSource(path=str(path)), field="eval")


# ----------------------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_dataset_is_deterministic_per_seed():
    first = reasoning_gym_dataset(ReasoningGymSource(**SPELL))
    again = reasoning_gym_dataset(ReasoningGymSource(**SPELL))
    other = reasoning_gym_dataset(ReasoningGymSource(**{**SPELL, "seed": 2}))
    assert len(first) == 8
    questions = [first[i]["question"] for i in range(8)]
    assert questions == [again[i]["question"] for i in range(8)]
    assert questions != [other[i]["question"] for i in range(8)]
    for i in range(8):
        entry = first[i]
        word = entry["metadata"]["word"]
        assert entry["answer"] == word[::-1] and 3 <= len(word) <= 6


@pytest.mark.parametrize(
    "source",
    [
        {"task": "no_such_task", "size": 2},
        {"task": "spell_backward", "size": 2, "config": {"no_such_option": 1}},
        # reasoning-gym validates configs with `assert`
        {"task": "spell_backward", "size": 2, "config": {"min_word_len": 0}},
    ],
)
def test_reasoning_gym_bad_task_or_config_names_it(source):
    with pytest.raises(ValueError, match=f"reasoning_gym task '{source['task']}'"):
        reasoning_gym_dataset(ReasoningGymSource(**source))


def test_nearby_reasoning_gym_seeds_share_examples():
    """Why check_heldout_seeds exists: example i of seed s is example i + 1 of seed s - 1."""
    one = reasoning_gym_dataset(ReasoningGymSource(**SPELL))
    two = reasoning_gym_dataset(ReasoningGymSource(**{**SPELL, "seed": 2}))
    assert [two[i]["question"] for i in range(7)] == [one[i + 1]["question"] for i in range(7)]


def test_check_heldout_seeds():
    train = DataSource(reasoning_gym=SPELL)  # seeds [1, 9)
    for seed in (2, 8, -6):  # ranges overlapping [1, 9)
        heldout = DataSource(reasoning_gym={**SPELL, "seed": seed})
        with pytest.raises(ValueError, match="overlaps the training range"):
            check_heldout_seeds(train, heldout)
    for seed in (9, -7, 10_000_000):  # touching or far away: no shared example
        check_heldout_seeds(train, DataSource(reasoning_gym={**SPELL, "seed": seed}))
    other_task = {**SPELL, "task": "chain_sum", "config": {}}
    check_heldout_seeds(train, DataSource(reasoning_gym=other_task))
    check_heldout_seeds(train, DataSource(path="data/x.jsonl"))
    check_heldout_seeds(train, None)


# ----------------------------------------------------------------------------- EpochSampler


def epochs(sampler: EpochSampler, n: int) -> list[list[int]]:
    """n whole epochs, read with a batch size that divides the epoch."""
    return [sampler.next_batch(sampler.num_items) for _ in range(n)]


def test_every_index_once_per_epoch_in_a_new_order():
    sampler = EpochSampler(12, seed=3)
    orders = [sum((sampler.next_batch(4) for _ in range(3)), []) for _ in range(3)]
    for order in orders:
        assert sorted(order) == list(range(12))
    assert len({tuple(o) for o in orders}) == 3  # a fresh permutation each epoch
    assert orders[0] != list(range(12))
    assert sampler.epoch == 2 and sampler.offset == 12


def test_batches_cross_epoch_boundaries():
    sampler = EpochSampler(10, seed=0)
    batches = [sampler.next_batch(4) for _ in range(5)]  # 20 indices = exactly 2 epochs
    flat = sum(batches, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert sampler.epoch_float == pytest.approx(2.0)
    assert len(sampler.next_batch(25)) == 25  # a batch larger than the dataset


def test_sampler_is_deterministic_across_instances():
    assert epochs(EpochSampler(20, seed=7), 3) == epochs(EpochSampler(20, seed=7), 3)
    assert epochs(EpochSampler(20, seed=7), 1) != epochs(EpochSampler(20, seed=8), 1)


def test_sampler_without_shuffle_is_sequential():
    sampler = EpochSampler(5, seed=0, shuffle=False)
    assert [sampler.next_batch(3) for _ in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]


def test_restored_sampler_continues_with_the_same_batches(tmp_path):
    uninterrupted = EpochSampler(10, seed=5)
    reference = [uninterrupted.next_batch(4) for _ in range(8)]

    sampler = EpochSampler(10, seed=5)
    for _ in range(3):  # stop mid-epoch (offset 2 of epoch 1)
        sampler.next_batch(4)
    state = sampler.state_dict()
    assert state == {"epoch": 1, "offset": 2, "num_items": 10}
    torch.save(state, tmp_path / "state.pt")  # the way a checkpoint stores it

    restored = EpochSampler(10, seed=5)
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert restored.epoch_float == pytest.approx(1.2)
    assert [restored.next_batch(4) for _ in range(5)] == reference[3:]


def test_sampler_refuses_a_changed_dataset():
    state = EpochSampler(10, seed=0).state_dict()
    with pytest.raises(ValueError, match="had 10 items, this one has 11"):
        EpochSampler(11, seed=0).load_state_dict(state)


def test_empty_sampler_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        EpochSampler(0, seed=0)
