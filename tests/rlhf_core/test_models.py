"""The tiny world presets (rlhf_core.tiny) and model/tokenizer loading (rlhf_core.models)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from rlhf_core.chat import DEFAULT_CHAT_TEMPLATE, render_prompt
from rlhf_core.logprobs import causal_lm_token_logprobs
from rlhf_core.models import (
    ModelConfig,
    ReferencePolicy,
    is_peft_model,
    load_policy,
    load_tokenizer,
    resolve_model_path,
    with_padding_side,
)
from rlhf_core.tiny import (
    PRESETS,
    SPECIAL_TOKENS,
    build_gpt2_tokenizer,
    cache_root,
    is_preset,
    preset_dir,
)

TINY = ModelConfig(name_or_path="tiny-qwen3", dtype="fp32", attention="sdpa")
TINY_LORA = ModelConfig(
    name_or_path="tiny-qwen3", dtype="fp32", attention="sdpa", lora={"r": 4, "alpha": 8}
)


@pytest.fixture(scope="module")
def char_tok():
    return load_tokenizer(TINY, padding_side="right")


def batch(vocab_size: int, seed: int = 0, rows: int = 3, width: int = 10):
    """Random token ids (no special tokens) with left padding of different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIAL_TOKENS), vocab_size, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, : 2 * i] = 0
        ids[i, : 2 * i] = 0
    return ids, mask


def masked_equal(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> bool:
    keep = mask[:, 1:].bool()
    return torch.equal(a[keep], b[keep])


# ----------------------------------------------------------------------------- tokenizers


def test_char_tokenizer_round_trip(char_tok):
    text = 'Hello, world! Is 2+2=4? "Yes" -- (mostly); ok: [a_b] {c} ~x~ \\ /path\n\tend.'
    ids = char_tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert char_tok.unk_token_id not in ids
    assert char_tok.decode(ids) == text


def test_char_tokenizer_special_tokens(char_tok):
    assert char_tok.eos_token == "<|end|>"
    assert char_tok.pad_token == "<|pad|>"
    assert char_tok.pad_token_id != char_tok.eos_token_id
    assert char_tok.padding_side == "right"
    for token in SPECIAL_TOKENS:
        ids = char_tok(token, add_special_tokens=False)["input_ids"]
        assert ids == [char_tok.convert_tokens_to_ids(token)], token
    ids = char_tok("<|user|>hi<|end|>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4
    assert char_tok.decode(ids, skip_special_tokens=True) == "hi"
    assert 90 < len(char_tok) < 120


def test_char_tokenizer_unknown_character(char_tok):
    ids = char_tok("a\u00e9b", add_special_tokens=False)["input_ids"]
    assert ids[1] == char_tok.unk_token_id
    assert len(ids) == 3


def test_char_chat_template(char_tok):
    assert render_prompt(char_tok, "What is 2+2?") == "<|user|>What is 2+2?<|end|><|assistant|>"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    text = char_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert (
        text
        == "<|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>hello<|end|><|user|>bye<|end|>"
    )
    with pytest.raises(Exception, match="unknown chat role"):
        char_tok.apply_chat_template(
            [{"role": "tool", "content": "x"}], tokenize=False, add_generation_prompt=True
        )


def test_chat_template_override():
    cfg = TINY.model_copy(update={"chat_template": "{{ messages[0]['content'] }}!"})
    tok = load_tokenizer(cfg, padding_side="left")
    assert render_prompt(tok, "hey") == "hey!"


def test_gpt2_tokenizer_is_real():
    tok = build_gpt2_tokenizer()
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok.eos_token == "<|endoftext|>"
    assert tok.pad_token is None
    assert len(tok) == 50257


def test_gpt2_preset_tokenizer_gets_pad_and_default_template():
    cfg = ModelConfig(name_or_path="tiny-qwen3-gpt2")
    with pytest.warns(UserWarning) as record:
        tok = load_tokenizer(cfg, padding_side="left")
    messages = [str(w.message) for w in record]
    assert any("no pad token" in m and "<|endoftext|>" in m for m in messages), messages
    assert any("no chat template" in m for m in messages), messages
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    assert tok.pad_token_id == tok.eos_token_id == 50256
    assert tok.padding_side == "left"
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert render_prompt(tok, "Hi") == "\n\nHuman: Hi\n\nAssistant:"
    # left padding really pads on the left
    enc = tok(["a", "a b c"], padding=True, return_tensors="pt")
    assert enc["attention_mask"][0].tolist() == [0, 0, 1]
    assert enc["input_ids"][0, 0].item() == 50256


def test_tokenizer_with_pad_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok = load_tokenizer(TINY, padding_side="left")
    assert tok.padding_side == "left"


def test_with_padding_side_copies(char_tok):
    left = with_padding_side(char_tok, "left")
    assert left.padding_side == "left"
    assert char_tok.padding_side == "right"
    enc = left(["ab", "abcd"], padding=True)
    assert enc["attention_mask"][0] == [0, 0, 1, 1]


# ----------------------------------------------------------------------------- presets


def test_presets_listed():
    assert {"tiny-qwen3", "tiny-qwen3-arith", "tiny-qwen3-gpt2"} <= set(PRESETS)
    assert is_preset("tiny-qwen3")
    assert not is_preset("Qwen/Qwen3-0.6B")
    with pytest.raises(KeyError, match="tiny-qwen3"):
        preset_dir("tiny-nope")


def test_tiny_model_is_a_real_qwen3(char_tok):
    model = load_policy(TINY)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.model_type == "qwen3"
    assert model.config.hidden_size == 128
    assert model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(char_tok)
    assert model.config.eos_token_id == char_tok.eos_token_id
    assert model.config.pad_token_id == char_tok.pad_token_id
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.50e6 < n_params < 0.56e6, n_params
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device.type == "cpu"


def test_resolve_model_path_presets_and_local_dirs(tmp_path):
    assert resolve_model_path("tiny-qwen3") == str(preset_dir("tiny-qwen3"))
    assert (preset_dir("tiny-qwen3") / "config.json").is_file()
    local = tmp_path / "my.model" / "v1.0"
    local.mkdir(parents=True)
    assert resolve_model_path(str(local)) == str(local)


@pytest.mark.parametrize(
    "hub_id", ["gpt2", "Qwen/Qwen3-0.6B", "Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.1-8B"]
)
def test_resolve_model_path_passes_hub_ids_through(hub_id):
    # hub ids often contain dots; they must not be mistaken for missing local files
    assert resolve_model_path(hub_id) == hub_id


@pytest.mark.parametrize(
    "missing", ["./nope/model", "/definitely/not/here", "~/nope-rlhf-lab/x", "runs/sft/ckpt-10"]
)
def test_resolve_model_path_missing_local_path(missing):
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_path(missing)


def test_load_missing_local_model_raises():
    with pytest.raises(FileNotFoundError, match="nope"):
        load_policy(ModelConfig(name_or_path="./nope/model"))
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(ModelConfig(name_or_path="./nope/model"), padding_side="left")


def test_preset_build_is_deterministic(monkeypatch, tmp_path):
    original_dir = preset_dir("tiny-qwen3")
    original = load_policy(TINY).state_dict()
    monkeypatch.setenv("RLHF_LAB_CACHE", str(tmp_path / "cache"))
    assert cache_root() == tmp_path / "cache"  # read at call time
    fresh_dir = preset_dir("tiny-qwen3")
    assert fresh_dir.is_relative_to(tmp_path)
    assert fresh_dir.name == original_dir.name  # same spec digest
    fresh = load_policy(TINY).state_dict()
    assert fresh.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, fresh[name]), name
    # the weights are not trivial: seeded random init, not zeros/constants
    emb = fresh["model.embed_tokens.weight"]
    assert emb.std() > 0
    tok_a = json.loads((original_dir / "tokenizer.json").read_text())
    tok_b = json.loads((fresh_dir / "tokenizer.json").read_text())
    assert tok_a["model"] == tok_b["model"]
    # a second call reuses the built directory
    assert preset_dir("tiny-qwen3") == fresh_dir


# ----------------------------------------------------------------------------- reference policy


@pytest.fixture(scope="module")
def lora_policy():
    torch.manual_seed(0)
    policy = load_policy(TINY_LORA)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        n = 0
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
                n += 1
    assert n > 0
    return policy


def test_lora_policy_setup(lora_policy):
    assert is_peft_model(lora_policy)
    trainable = [n for n, p in lora_policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_adapter_reference_equals_base_model(lora_policy):
    ids, mask = batch(lora_policy.config.vocab_size)
    base = load_policy(TINY)
    base.eval()
    assert not is_peft_model(base)
    with torch.no_grad():
        base_logps = causal_lm_token_logprobs(base, ids, mask)
        lora_policy.eval()
        policy_logps = causal_lm_token_logprobs(lora_policy, ids, mask)
    # the perturbed adapter really changes the outputs
    assert not torch.allclose(policy_logps, base_logps, atol=1e-3)

    lora_policy.train()
    ref = ReferencePolicy(lora_policy, mode="adapter")
    ref_logps = ref.token_logprobs(ids, mask)
    assert torch.equal(ref_logps, base_logps)
    assert lora_policy.training  # training mode restored after the context

    # the adapter is active again afterwards
    lora_policy.eval()
    with torch.no_grad():
        after = causal_lm_token_logprobs(lora_policy, ids, mask)
    assert torch.equal(after, policy_logps)
    assert not torch.allclose(after, base_logps, atol=1e-3)


def test_adapter_reference_shares_weights(lora_policy):
    ref = ReferencePolicy(lora_policy, mode="adapter")
    with ref.model() as m:
        assert m is lora_policy
        assert not m.training


def test_adapter_reference_temperature(lora_policy):
    ids, mask = batch(lora_policy.config.vocab_size, seed=2)
    ref = ReferencePolicy(lora_policy, mode="adapter")
    t1 = ref.token_logprobs(ids, mask)
    t2 = ref.token_logprobs(ids, mask, temperature=2.0)
    assert not masked_equal(t1, t2, mask)


def test_adapter_mode_needs_lora():
    with pytest.raises(ValueError, match="adapter"):
        ReferencePolicy(load_policy(TINY), mode="adapter")


def test_unknown_reference_mode():
    with pytest.raises(ValueError, match="unknown reference mode"):
        ReferencePolicy(torch.nn.Linear(2, 2), mode="shared")


def test_frozen_reference_uses_the_given_model_without_a_copy():
    model = torch.nn.Linear(2, 2)
    ref = ReferencePolicy(model, mode="frozen")
    with ref.model() as inner:
        assert inner is model and not inner.training
    assert not any(p.requires_grad for p in model.parameters())


def test_copy_reference_is_frozen_and_independent():
    torch.manual_seed(0)
    policy = load_policy(TINY)
    policy.train()
    ref = ReferencePolicy(policy, mode="copy")
    with ref.model() as m:
        assert m is not policy
        ref_params = list(m.parameters())
    assert ref_params and not any(p.requires_grad for p in ref_params)
    assert all(p.requires_grad for p in policy.parameters())  # the policy is not frozen
    assert policy.training

    ids, mask = batch(policy.config.vocab_size, seed=3)
    before = ref.token_logprobs(ids, mask)
    assert not before.requires_grad
    with ref.model() as m:
        ref_state = {k: v.clone() for k, v in m.state_dict().items()}

    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    logps = causal_lm_token_logprobs(policy, ids, mask)
    loss = -(logps * mask[:, 1:]).sum() / mask[:, 1:].sum()
    loss.backward()
    optimizer.step()

    policy.eval()
    with torch.no_grad():
        after_policy = causal_lm_token_logprobs(policy, ids, mask)
    assert not masked_equal(after_policy, before, mask)  # the policy moved
    after_ref = ref.token_logprobs(ids, mask)
    assert torch.equal(after_ref, before)  # the reference did not
    with ref.model() as m:
        for name, tensor in m.state_dict().items():
            assert torch.equal(tensor, ref_state[name]), name


def test_lora_with_gradient_checkpointing_trains_adapter_only():
    cfg = TINY_LORA.model_copy(update={"gradient_checkpointing": True})
    model = load_policy(cfg)
    base = model.get_base_model()
    assert base.is_activation_checkpointing
    model.train()
    ids, mask = batch(model.config.vocab_size, seed=4)
    # inputs to the checkpointed blocks require grad even though the embeddings are frozen
    assert model.get_input_embeddings()(ids).requires_grad
    logps = causal_lm_token_logprobs(model, ids, mask)
    (-(logps * mask[:, 1:]).sum()).backward()
    for name, param in model.named_parameters():
        if "lora_" in name:
            assert param.grad is not None, name
            if "lora_B" in name:  # B starts at zero, so only B gets a non-zero first gradient
                assert param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name
