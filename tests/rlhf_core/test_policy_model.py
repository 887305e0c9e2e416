"""rlhf_core.policy_model: the one seam for causal and encoder-decoder (T5) policies."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_core.generation import Sampling, decode
from rlhf_core.models import LoraConfig, ModelConfig, ReferencePolicy, load_policy, load_tokenizer
from rlhf_core.policy_model import is_encoder_decoder, policy_logprobs, split_rows

T5 = ModelConfig(name_or_path="tiny-t5-facts")
PROMPTS = ["<|user|>Tell me about Mira.<|end|><|assistant|>", "<|user|>Hi<|end|><|assistant|>",
           "<|user|>Tell me about Tom. Notes: Tom eats rice.<|end|><|assistant|>"]  # fmt: skip
COMPLETIONS = ["Mira lives in Oslo.<|end|>", "Tom plays golf, and Tom eats figs.<|end|>",
               "A<|end|>"]  # fmt: skip


@pytest.fixture(scope="module")
def t5():
    torch.manual_seed(0)
    model = load_policy(T5).eval()
    with torch.no_grad():  # a trained-looking model: perturb the seeded init so logits vary
        model.shared.weight[model.config.pad_token_id] = 0  # tied: start token would predict pad
        for p in model.parameters():
            p.add_(torch.randn_like(p) * p.std() * 0.5)
    return model, load_tokenizer(T5, padding_side="right")


def flat_rows(tok, side: str):
    """[prompt | completion] rows padded on `side`, with target_mask (B, S - 1) on completions."""
    rows, starts = [], []
    for p, c in zip(PROMPTS, COMPLETIONS, strict=True):
        p_ids = tok(p, add_special_tokens=False)["input_ids"]
        c_ids = tok(c, add_special_tokens=False)["input_ids"]
        rows.append(p_ids + c_ids)
        starts.append(len(p_ids))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    target = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for b, (r, s) in enumerate(zip(rows, starts, strict=True)):
        off = 0 if side == "right" else width - len(r)
        ids[b, off : off + len(r)] = torch.tensor(r)
        mask[b, off : off + len(r)] = 1
        target[b, off + s - 1 : off + len(r) - 1] = True
    return ids, mask, target, rows, starts


def reference_logprobs(model, prompt_ids, completion_ids):
    """Unbatched float64 log p(y_t | x, y_<t) from the raw logits: the paper's formula."""
    start = model.config.decoder_start_token_id
    dec_in = torch.tensor([[start] + completion_ids[:-1]])
    logits = model(input_ids=torch.tensor([prompt_ids]), decoder_input_ids=dec_in).logits[0]
    logp = torch.log_softmax(logits.double(), -1)
    return logp[torch.arange(len(completion_ids)), torch.tensor(completion_ids)]


@pytest.mark.parametrize("side", ["right", "left"])
def test_seq2seq_logprobs_equal_unbatched_float64_under_padding(t5, side):
    model, tok = t5
    model64 = copy.deepcopy(model).double()
    ids, mask, target, rows, starts = flat_rows(tok, side)
    batched = policy_logprobs(model64, ids, mask, target)
    batched32 = policy_logprobs(model, ids, mask, target)
    assert batched.shape == target.shape
    for b, (r, s) in enumerate(zip(rows, starts, strict=True)):
        want = reference_logprobs(model64, r[:s], r[s:])
        got = batched[b][target[b]]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        torch.testing.assert_close(batched32[b][target[b]].double(), want, rtol=0, atol=2e-5)
        assert (batched[b][~target[b]] == 0).all()
    assert batched.min() < -1.0  # real log-probs, not a degenerate model


def test_seq2seq_logprobs_entropy_and_gradient(t5):
    model, tok = t5
    ids, mask, target, *_ = flat_rows(tok, "right")
    model = copy.deepcopy(model).train()
    logps, entropy = policy_logprobs(model, ids, mask, target, with_entropy=True)
    assert (entropy[target] > 0).all() and (entropy[~target] == 0).all()
    logps[target].sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)  # encoder and decoder both


def test_split_rows_rejects_non_contiguous_targets(t5):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    target = torch.tensor([[True, False, True, False]])
    with pytest.raises(ValueError, match="contiguous"):
        split_rows(ids, torch.ones_like(ids), target, pad_id=0)


def test_seq2seq_greedy_decode_equals_transformers_generate(t5):
    model, _ = t5
    tok = load_tokenizer(T5, padding_side="left")
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    assert enc["attention_mask"][1, 0] == 0  # left-padded
    ours = decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=24,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    theirs = model.generate(
        **enc,
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        decoder_start_token_id=model.config.decoder_start_token_id,
    )[:, 1:]  # fmt: skip  (generate's rows start with the decoder start token)
    new = ours[:, enc["input_ids"].shape[1] :]
    assert torch.equal(ours[:, : enc["input_ids"].shape[1]], enc["input_ids"])
    n = min(new.shape[1], theirs.shape[1])
    assert n > 3
    assert torch.equal(new[:, :n], theirs[:, :n])
    assert len(set(map(tuple, new.tolist()))) > 1  # the prompts really condition the output


def test_seq2seq_sampled_decode_is_seeded_and_scores_its_own_tokens(t5):
    from rlhf_core.generation import row_generators

    model, _ = t5
    tok = load_tokenizer(T5, padding_side="left")
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    args = {"max_new_tokens": 12, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "sampling": Sampling(temperature=1.0)}  # fmt: skip
    a = decode(model, **enc, generator=row_generators([1, 2, 3], "cpu"), **args)
    b = decode(model, **enc, generator=row_generators([1, 2, 3], "cpu"), **args)
    c = decode(model, **enc, generator=row_generators([4, 5, 6], "cpu"), **args)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_t5_lora_targets_and_adapter_reference(t5):
    _, tok = t5
    torch.manual_seed(0)
    cfg = T5.model_copy(update={"lora": LoraConfig(r=4, alpha=8)})
    policy = load_policy(cfg)
    assert is_encoder_decoder(policy)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    for module in ("q", "k", "v", "o", "wi", "wo"):
        assert any(f".{module}.lora_A" in n for n in trainable), module
    assert all("lora_" in n for n in trainable)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    ids, mask, target, *_ = flat_rows(tok, "right")
    reference = ReferencePolicy(policy, "adapter")
    with reference.model() as ref:
        ref_logps = policy_logprobs(ref, ids, mask, target)
    plain = load_policy(T5).eval()
    torch.testing.assert_close(ref_logps, policy_logprobs(plain, ids, mask, target))
    assert not torch.allclose(policy_logprobs(policy.eval(), ids, mask, target), ref_logps)


def test_seq2seq_group_sampling_encodes_each_prompt_once(t5):
    from rlhf_core.generation import row_generators

    model, _ = t5
    tok = load_tokenizer(T5, padding_side="left")
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    args = {"max_new_tokens": 12, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "sampling": Sampling(temperature=1.0)}  # fmt: skip
    seeds = list(range(3 * len(PROMPTS)))
    shared = decode(model, **enc, generator=row_generators(seeds, "cpu"), group_size=3, **args)
    repeated = decode(
        model, enc["input_ids"].repeat_interleave(3, 0),
        enc["attention_mask"].repeat_interleave(3, 0), generator=row_generators(seeds, "cpu"),
        **args,
    )  # fmt: skip
    assert torch.equal(shared, repeated)


def test_a_t5_value_model_sharing_the_policy_encoder(t5, tmp_path):
    """share_policy_encoder: the value model reads the prompt through the policy's own encoder
    (same values while the encoders are equal), owns no encoder layers, and the value loss's
    gradient reaches the policy's encoder."""
    from rlhf_core.policy_model import completion_values, share_policy_encoder
    from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel

    policy, tok = t5
    policy = copy.deepcopy(policy).train()
    torch.manual_seed(1)
    value = ScalarHeadModel.from_config(T5, ScalarHeadInfo(kind="value"))
    with torch.no_grad():  # the value model starts from the policy's weights, as PPO's does
        value.backbone.load_state_dict(policy.state_dict(), strict=False)
    ids, mask, _, _, _ = flat_rows(tok, "left")
    prompt_length = 12
    with torch.no_grad():
        before = completion_values(value, ids, mask, prompt_length)
    share_policy_encoder(value, policy)
    assert not any("encoder.block" in name for name, _ in value.named_parameters())
    policy_encoder = {id(p) for p in policy.get_encoder().parameters()}
    assert not policy_encoder & {id(p) for p in value.parameters()}
    shared = completion_values(value, ids, mask, prompt_length)
    torch.testing.assert_close(shared, before, rtol=0, atol=1e-6)
    shared.sum().backward()
    layer = policy.get_encoder().block[0].layer[0].SelfAttention.q.weight
    assert layer.grad is not None and layer.grad.abs().sum() > 0
    value.save_pretrained(tmp_path / "value")  # without the encoder; re-shared after loading
    again = ScalarHeadModel.from_config(T5, value.info, weights_from=tmp_path / "value")
    share_policy_encoder(again, policy)
    with torch.no_grad():
        torch.testing.assert_close(
            completion_values(again, ids, mask, prompt_length), shared, rtol=0, atol=1e-6
        )
    with torch.no_grad():  # truly the policy's: moving its encoder moves the values
        layer.add_(0.5)
        assert not torch.allclose(completion_values(value, ids, mask, prompt_length), before)
    with pytest.raises(ValueError, match="both be encoder-decoder"):
        share_policy_encoder(value, load_policy(ModelConfig(name_or_path="tiny-qwen3")))
