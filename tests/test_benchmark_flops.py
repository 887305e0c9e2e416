"""`benchmarks.flops` counts what torch's own FLOP counter counts.

The side-by-side benchmarks split each ratio into a work ratio (these counts) and a rate ratio;
the counts must be right for that split to mean anything. torch's `FlopCounterMode` counts the
matmuls an eager forward dispatches: the linear layers, the LM head and eager attention's two
batched products (every score of the L x L block, as the CPU kernels compute it)."""

import ast
import importlib.util
import sys

import torch
from conftest import REPO
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3Config, Qwen3ForCausalLM

# loaded from its file: under pytest the repository root is not on sys.path, and pysbd (the
# sentence segmenter) installs a top-level package also named `benchmarks`
_spec = importlib.util.spec_from_file_location(
    "rlhf_lab_benchmark_flops", REPO / "benchmarks/flops.py"
)
flops = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(flops)
Shapes, per_cpu_second, segment_score_entries = (
    flops.Shapes,
    flops.per_cpu_second,
    flops.segment_score_entries,
)


def _model() -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=301, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def test_shapes_count_the_models_linear_weights():
    model = _model()
    shapes = Shapes.of(model.config)
    head = model.get_output_embeddings()
    body = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    )
    assert shapes.body_params == body
    assert shapes.head_params == head.weight.numel()
    assert shapes.attn_width == 4 * 16 * 3


def test_forward_count_equals_torchs_flop_counter():
    model = _model()
    model.config._attn_implementation = "eager"
    rows, length = 3, 11
    ids = torch.randint(0, 301, (rows, length))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids)
    counted = counter.get_total_flops() / 1e9
    ours = Shapes.of(model.config).forward_gflop(rows * length, rows * length, rows * length**2)
    assert abs(ours - counted) <= 1e-9 * max(1.0, counted)


def test_train_count_is_the_documented_multiples_of_the_forward():
    shapes = Shapes.of(_model().config)
    body, head, scores = 1000, 300, 50_000
    forward_parts = (
        shapes.forward_gflop(body, 0, 0),
        shapes.forward_gflop(0, head, 0),
        shapes.forward_gflop(0, 0, scores),
    )
    # matmuls 1 + 2, the fused head 1 + 1 (recomputed logits) + 2, attention 1 + 2.5
    expected = 3 * forward_parts[0] + 4 * forward_parts[1] + 3.5 * forward_parts[2]
    assert abs(shapes.train_gflop(body, head, scores) - expected) <= 1e-12


def test_segments_and_rates():
    segments = torch.tensor([[0, 0, 5], [0, 5, 12], [1, 0, 3]])
    assert segment_score_entries(segments) == 25 + 49 + 9
    # 100 GFLOP over 50 tokens at 10 tokens per CPU-second: 5 CPU-seconds, 20 GFLOP per second
    assert per_cpu_second(100.0, 50, 10.0) == 20.0


def _bench_models() -> dict[str, dict[str, int]]:
    """`benchmarks.workload.BENCH_MODELS`, read from the file's literal (importing the module
    needs the repository root on sys.path, see above)."""
    tree = ast.parse((REPO / "benchmarks/workload.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "BENCH_MODELS":
            return ast.literal_eval(node.value)
    raise AssertionError("benchmarks/workload.py defines no BENCH_MODELS")


def _bench_shapes(name: str) -> tuple[Qwen3Config, Shapes]:
    """A benchmark model's config as `model_dir` builds it (GPT-2 vocabulary, tied embeddings,
    head_dim = hidden / heads) and its `Shapes`."""
    arch = _bench_models()[name]
    config = Qwen3Config(
        vocab_size=50257, tie_word_embeddings=True,
        head_dim=arch["hidden_size"] // arch["num_attention_heads"], **arch,
    )  # fmt: skip
    return config, Shapes.of(config)


def test_real_proportion_shapes_have_a_real_head_share():
    # the LM head's share of a position's forward matmul FLOPs (Qwen3-0.6B: ~26%)
    for name in ("real", "wide"):
        _, shapes = _bench_shapes(name)
        share = shapes.head_params / (shapes.head_params + shapes.body_params)
        assert 0.20 <= share <= 0.30, (name, share)


def test_wide_differs_from_real_in_width_depth_and_gqa_ratio():
    real, _ = _bench_shapes("real")
    wide, _ = _bench_shapes("wide")
    assert wide.hidden_size != real.hidden_size
    assert wide.num_hidden_layers != real.num_hidden_layers

    def gqa(c: Qwen3Config) -> float:
        return c.num_attention_heads / c.num_key_value_heads

    assert gqa(wide) != gqa(real)
    # the same MLP proportion (3x hidden): the differences are width, depth and GQA ratio
    assert wide.intermediate_size / wide.hidden_size == real.intermediate_size / real.hidden_size
