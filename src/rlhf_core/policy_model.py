"""The policy-model seam: what a trainer asks of a policy, for causal and encoder-decoder models.

Every package keeps one layout for a prompt and its completion, the flat row the causal path
uses: `input_ids` (B, S) with `attention_mask`, and `target_mask` (B, S - 1), where
target_mask[b, t] says token input_ids[b, t + 1] is a completion token to score. Both model
kinds read that layout:

    causal LM (Qwen3, Llama, GPT-2 ...)    log p(x_{t+1} | x_{<=t}) over the whole row
    encoder-decoder (T5 via AutoModelForSeq2SeqLM)
                                           each row splits at its first target token: the attended
                                           tokens before it are the encoder input (the prompt,
                                           left-padded), the target tokens the decoder labels,
                                           teacher-forced from the decoder start token; the
                                           encoder runs once per row

So trainers never branch on the model kind; they call

    policy_logprobs(model, input_ids, attention_mask, target_mask)   (B, S - 1) log-probs
    completion_values(value_model, ids, attention_mask, prompt_length)   V(s_t), (B, T)
    rlhf_core.generation.decode(...)       our KV-cache decode loop (encoder once for T5)
    rlhf_core.models.load_policy(cfg)      AutoModelForCausalLM or AutoModelForSeq2SeqLM by the
                                           config's `is_encoder_decoder`; LoRA targets per
                                           architecture (T5: q, k, v, o, wi, wo)

The reference policy (`ReferencePolicy`: a frozen copy, or the LoRA policy with its adapter
disabled) is model-agnostic and needs nothing here. PPO's value model for T5 is a
`ScalarHeadModel` on the T5 backbone (`AutoModel` = `T5Model`, encoder + decoder): V(s_t) is the
head on the decoder state that predicts completion token t. `share_policy_encoder` makes it read
the prompt through the policy's encoder instead of its own (Fine-Grained RLHF shares its T5
policy and value models): one encoder, trained by the policy loss and the value loss together.

Encoder-decoder limits: the completion targets of a row must be contiguous (a prompt followed by
its completion; true of SFT, DPO and RL rows); the LM head runs on every decoder position (no
fused selective head as for causal models: `causal_lm_selected_logprobs`); several processes
(DDP) are not tested with T5.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_core.logprobs import causal_lm_selected_logprobs, token_logprobs


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP/FSDP (`.module`) and peft (`get_base_model()`) wrappers.
    peft injects its adapters into the base model's layers, so running the base runs them."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def is_encoder_decoder(model: torch.nn.Module) -> bool:
    """True for an encoder-decoder transformers model (T5, BART ...), however wrapped."""
    config = getattr(base_model(model), "config", None)
    return bool(getattr(config, "is_encoder_decoder", False))


def decoder_start_id(model: torch.nn.Module) -> int:
    config = base_model(model).config
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = config.pad_token_id
    if start is None:
        raise ValueError("encoder-decoder model: no decoder_start_token_id and no pad_token_id")
    return int(start)


def shift_right(labels: torch.Tensor, start_id: int) -> torch.Tensor:
    """Decoder inputs for teacher forcing: [start, y_1, ..., y_{T-1}] for labels (B, T)."""
    start = torch.full_like(labels[:, :1], start_id)
    return torch.cat([start, labels[:, :-1]], dim=1)


def split_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, target_mask: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat rows -> (encoder ids (B, P) left-padded, encoder mask, labels (B, T) right-padded,
    label mask), splitting each row at its first target token (see the module docstring)."""
    if target_mask.shape != (input_ids.shape[0], input_ids.shape[1] - 1):
        raise ValueError(
            f"target_mask must be (B, S - 1) = {(input_ids.shape[0], input_ids.shape[1] - 1)}, "
            f"got {tuple(target_mask.shape)}"
        )
    is_target = torch.zeros_like(input_ids, dtype=torch.bool)
    is_target[:, 1:] = target_mask.bool()
    prompts, labels = [], []
    for b in range(input_ids.shape[0]):
        where = is_target[b].nonzero().squeeze(-1)
        first = int(where[0]) if len(where) else input_ids.shape[1]
        if len(where) and int(where[-1]) - first + 1 != len(where):
            raise ValueError(
                f"row {b}: an encoder-decoder policy needs contiguous completion targets "
                f"(a prompt, then its completion); got target positions {where.tolist()}"
            )
        attended = attention_mask[b, :first].bool()
        prompts.append(input_ids[b, :first][attended])
        labels.append(input_ids[b, where])
    p_len = max(1, max(len(p) for p in prompts))
    t_len = max(1, max(len(x) for x in labels))
    device = input_ids.device
    enc = torch.full((len(prompts), p_len), pad_id, dtype=input_ids.dtype, device=device)
    enc_mask = torch.zeros_like(enc)
    lab = torch.full((len(prompts), t_len), pad_id, dtype=input_ids.dtype, device=device)
    lab_mask = torch.zeros_like(lab)
    for b, (p, y) in enumerate(zip(prompts, labels, strict=True)):
        if len(p):
            enc[b, p_len - len(p) :], enc_mask[b, p_len - len(p) :] = p, 1
        lab[b, : len(y)], lab_mask[b, : len(y)] = y, 1
    return enc, enc_mask, lab, lab_mask


def _seq2seq_selected_logprobs(model, input_ids, attention_mask, target_mask, temperature, entropy):
    """`policy_logprobs` for an encoder-decoder model: log p(y_t | x, y_<t) of each target."""
    pad_id = base_model(model).config.pad_token_id
    enc, enc_mask, labels, label_mask = split_rows(input_ids, attention_mask, target_mask, pad_id)
    logits = model(
        input_ids=enc, attention_mask=enc_mask,
        decoder_input_ids=shift_right(labels, decoder_start_id(model)),
        decoder_attention_mask=label_mask, use_cache=False,
    ).logits  # fmt: skip
    picked = token_logprobs(logits, labels, temperature=temperature, with_entropy=entropy)
    picked = picked if entropy else (picked,)
    select, keep = target_mask.bool(), label_mask.bool()
    outs = []
    for values in picked:
        out = torch.zeros(select.shape, dtype=values.dtype, device=values.device)
        outs.append(out.masked_scatter(select, values[keep]))
    return tuple(outs) if entropy else outs[0]


def policy_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, S - 1) of the target tokens of flat rows (0 off targets), and with
    `with_entropy` the entropies; causal or encoder-decoder (see the module docstring)."""
    if is_encoder_decoder(model):
        return _seq2seq_selected_logprobs(
            model, input_ids, attention_mask, target_mask, temperature, with_entropy
        )
    return causal_lm_selected_logprobs(
        model, input_ids, attention_mask, target_mask, temperature=temperature,
        with_entropy=with_entropy,
    )  # fmt: skip


def completion_values(
    value_model: Any, ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
) -> torch.Tensor:
    """V(s_t) for each completion token t of rows [left-padded prompt (P) | completion (T)],
    (B, T): the value head where completion token t is predicted. `value_model` is a
    `rlhf_core.scalar_head.ScalarHeadModel` (a causal or an encoder-decoder backbone)."""
    model = value_model.module if hasattr(value_model, "module") else value_model
    if not is_encoder_decoder(model.backbone):
        return value_model(ids, attention_mask)[..., 0][:, prompt_length - 1 : -1]
    # through the value model's own forward, so a DDP or FSDP2 wrapper's hooks run
    start = decoder_start_id(model.backbone)
    return value_model(
        ids[:, :prompt_length], attention_mask[:, :prompt_length],
        decoder_input_ids=shift_right(ids[:, prompt_length:], start),
    )[..., 0]  # fmt: skip


def share_policy_encoder(value_model: Any, policy: torch.nn.Module) -> None:
    """The encoder-decoder `value_model` (a `rlhf_core.scalar_head.ScalarHeadModel`) reads the
    prompt through `policy`'s encoder (LoRA layers included) from now on; its own encoder layers
    are dropped. The encoder stays the policy's: the value model's parameters (so its optimizer
    and saved directory) leave it out, and the value loss's gradient reaches it through the
    policy's parameters, stepped by the policy's optimizer. Values equal the unshared model's
    while the two encoders are equal (tested). Call it before the models are wrapped for
    distribution; single process (a DDP or FSDP2 value model does not own the encoder it runs)."""
    if not (is_encoder_decoder(policy) and is_encoder_decoder(value_model.backbone)):
        raise ValueError(
            "share_policy_encoder: the policy and the value model must both be encoder-decoder "
            "models (T5)"
        )
    policy_config = base_model(policy).config
    value_config = base_model(value_model.backbone).config
    if policy_config.hidden_size != value_config.hidden_size:
        raise ValueError(
            f"share_policy_encoder: the policy's encoder width {policy_config.hidden_size} is "
            f"not the value model's {value_config.hidden_size}"
        )
    value_model.share_encoder(base_model(policy).get_encoder())
