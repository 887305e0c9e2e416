"""The CUDA-only engines and the decode loop on CUDA: greedy `rlhf_core.generation.decode` gives
transformers `generate`'s tokens; FSDP2 (`rlhf_core.distributed.shard_model`) at world size 1
trains with bf16 mixed precision, and again with its shards offloaded to CPU memory; a QLoRA step
(4-bit NF4 base through bitsandbytes, where it is installed) moves the adapter and nothing else.

FSDP2 runs in this process on a one-process group: the trainers refuse `train.engine: fsdp2`
with one process (`rlhf_core.distributed.resolve_engine`), so the sharding seam is driven here
directly, with the library's own fused log-prob path run as the root unit's forward."""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch
from cuda_world import DEVICE, finite, needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]


def test_greedy_decode_equals_generate_on_cuda():
    from rlhf_core.generation import decode
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

    cfg = ModelConfig(name_or_path="tiny-qwen3", dtype="fp32")  # bf16 greedy could part at ties
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = load_policy(cfg, DEVICE).eval()
    tok = load_tokenizer(cfg, padding_side="left")
    prompts = ["<|user|>ab<|end|><|assistant|>", "<|user|>a much longer prompt<|end|><|assistant|>"]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(DEVICE)
    assert enc["attention_mask"][0, 0] == 0  # the short prompt really is left-padded
    kwargs = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    ours = decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=24, **kwargs)
    theirs = model.generate(**enc, max_new_tokens=24, do_sample=False, **kwargs)
    n = min(ours.shape[1], theirs.shape[1])  # generate may stop at the same eos or run on pads
    assert torch.equal(ours[:, :n], theirs[:, :n])
    assert (theirs[:, n:] == tok.pad_token_id).all()


@pytest.fixture(scope="module")
def one_process_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # CPU-offloaded shards take gloo, CUDA tensors NCCL
    backend = "cpu:gloo,cuda:nccl" if DEVICE.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE.index or 0)  # set_device needs an index, not 'cuda'
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("cpu_offload", [False, True], ids=["bf16", "bf16-cpu-offload"])
def test_fsdp2_world_size_one_trains_in_bf16_mixed_precision(one_process_group, cpu_offload):
    from torch.distributed.tensor import DTensor

    from rlhf_core.distributed import FSDPConfig, shard_model
    from rlhf_core.logprobs import causal_lm_selected_logprobs, masked_sum
    from rlhf_core.models import ModelConfig, load_policy

    if cpu_offload and DEVICE.type != "cuda":
        pytest.skip("CPU offload moves shards from GPU to CPU memory: it needs a CUDA device")
    torch.manual_seed(0)
    model = load_policy(ModelConfig(name_or_path="tiny-qwen3", dtype="fp32"), DEVICE).train()
    before = {n: p.detach().clone().cpu() for n, p in model.named_parameters()}
    fsdp = FSDPConfig(mixed_precision="bf16", cpu_offload=cpu_offload)
    model = shard_model(model, fsdp, DEVICE)
    params = list(model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params)
    assert all(p.dtype == torch.float32 for p in params)  # fp32 shards, bf16 compute
    where = {p.to_local().device.type for p in params}
    assert where == ({"cpu"} if cpu_offload else {DEVICE.type}), where
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 100, (4, 24), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    target = torch.zeros(4, 23, dtype=torch.bool, device=DEVICE)
    target[:, 8:] = True
    losses = []
    for _ in range(3):
        logps = causal_lm_selected_logprobs(model, ids, mask, target)
        loss = -masked_sum(logps, target) / target.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    assert finite(losses) and losses[-1] < losses[0], losses
    # at world size 1 the local shard is the whole tensor (no padding, no gather needed)
    after = {n: p.to_local().detach().cpu() for n, p in model.named_parameters()}
    assert after.keys() == before.keys()
    moved = [n for n in after if not torch.equal(after[n], before[n])]
    assert len(moved) == len(after), sorted(set(after) - set(moved))


@pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes is not installed (its wheel is carried only where it fits: "
    "scripts/gpu_wheels.txt)",
)
def test_qlora_step_updates_only_the_adapter():
    from rlhf_core.models import ModelConfig, load_policy

    cfg = ModelConfig(name_or_path="tiny-qwen3", lora={"r": 4, "alpha": 8},
                      quantization={"bits": 4, "compute_dtype": "bf16"})  # fmt: skip
    torch.manual_seed(0)
    model = load_policy(cfg, DEVICE).train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for layer in model.modules():  # lora_B starts at 0: move it so every adapter tensor trains
        if hasattr(layer, "lora_B"):
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.02)
    before.update({n: p.detach().clone() for n, p in trainable.items()})
    opt = torch.optim.AdamW(trainable.values(), lr=1e-3)
    ids = torch.randint(6, 100, (2, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert finite([loss])
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == (name in trainable), name
