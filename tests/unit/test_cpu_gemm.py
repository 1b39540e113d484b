"""The Numba CPU linear (vllm_treespec.cpu_gemm) and the patch that chooses it (no engine)."""

from __future__ import annotations

import pytest
import torch

from vllm_treespec.cpu_gemm import NumbaLinear, chunk_rows, ours_is_faster, time_against

# (out_features, in_features): a weight that is one partial chunk, one with several chunks and a ragged last chunk
# whose row count is not a multiple of the 4-column block, and a wide input dimension
SHAPES = [(7, 33), (2 * chunk_rows(577) + 6, 577), (45, 1536)]


def _reference(x, weight, bias):
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_linear_is_x_times_the_weight_in_the_weights_dtype(dtype, shape, with_bias):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
    bias = torch.randn(shape[0], generator=generator).to(dtype) if with_bias else None
    x = torch.randn(2, 5, shape[1], generator=generator).to(dtype)  # leading dimensions are kept
    out = NumbaLinear(weight)(x, weight, bias)
    assert out.shape == (2, 5, shape[0]) and out.dtype == dtype
    want = _reference(x, weight, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)  # fp32 sums over <= 1536 terms
    else:  # fp32 sums rounded once to bf16: within one bf16 rounding of the exact product
        assert torch.all((out.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-6)
    assert NumbaLinear(weight)(x[:0], weight, bias).shape == (0, 5, shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype):
    """Batch invariance: the same row alone, first or last of an odd or even batch gives the same bits (an odd
    last row is computed as its own pair)."""
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(SHAPES[1], generator=generator) * 0.05).to(dtype)
    linear = NumbaLinear(weight)
    x = torch.randn(9, weight.shape[1], generator=generator).to(dtype)
    batch = linear(x)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(9)])
    assert torch.equal(batch, alone)
    assert torch.equal(linear(x[3:8]), batch[3:8])


def test_a_weight_it_cannot_take_is_refused_by_name():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        NumbaLinear(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D"):
        NumbaLinear(torch.zeros(4, 4, 4))


def test_the_choice_weighs_every_row_count_equally():
    assert ours_is_faster({1: (1.0, 2.0), 8: (1.0, 1.0)})
    assert not ours_is_faster({1: (1.2, 1.0), 8: (1.0, 1.0), 32: (1.0, 1.0)})
    # twice as slow at one row is not bought back by 1.5x faster at two others (2 + 0.67 + 0.67 > 3)
    assert not ours_is_faster({1: (2.0, 1.0), 8: (1.0, 1.5), 32: (1.0, 1.5)})
    weight = torch.randn(16, 32)
    times = time_against(weight, lambda x, w, b: torch.nn.functional.linear(x, w, b), rows=(1, 3), repeats=1)
    assert set(times) == {1, 3} and all(t > 0 for pair in times.values() for t in pair)


class _Layer(torch.nn.Module):
    def __init__(self, dtype=torch.bfloat16, shape=(12, 20)):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(shape).to(dtype), requires_grad=False)


@pytest.fixture
def dispatch(monkeypatch):
    """vLLM's dispatch, patched, with a stand-in for the original that records its calls."""
    from vllm.model_executor.layers import utils as layer_utils

    from vllm_treespec.patches import cpu_gemm

    cpu_gemm.install()
    calls = []

    def original(layer, remove_weight):
        calls.append(remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)

    assert layer_utils.dispatch_cpu_unquantized_gemm.__vllm_treespec_original__ is not original
    monkeypatch.setattr(cpu_gemm, "_choices", {})
    # the installed patch calls vLLM's dispatch; the same wrapper is called here with the stand-in
    return (lambda layer, remove_weight: cpu_gemm.dispatch_wrapper(original, layer, remove_weight)), calls, cpu_gemm


def test_numba_mode_installs_ours_and_keeps_the_weight(dispatch, monkeypatch):
    run, calls, cpu_gemm = dispatch
    monkeypatch.setenv(cpu_gemm.LINEAR_ENV, "numba")
    layer = _Layer()
    run(layer, True)
    assert isinstance(layer.cpu_linear, NumbaLinear) and layer.weight.numel() == 12 * 20
    assert calls == [False] and cpu_gemm.kernel_summary() == "numba"
    x = torch.randn(3, 20).to(torch.bfloat16)
    assert torch.equal(layer.cpu_linear(x, layer.weight, None), NumbaLinear(layer.weight)(x))


def test_when_vllms_linear_is_faster_vllms_own_dispatch_runs_as_it_would_have(dispatch, monkeypatch):
    run, calls, cpu_gemm = dispatch
    monkeypatch.setenv(cpu_gemm.LINEAR_ENV, "auto")
    monkeypatch.setattr("vllm_treespec.cpu_gemm.time_against", lambda weight, current: {1: (2.0, 1.0)})
    layer = _Layer(torch.float32)
    run(layer, True)
    assert not isinstance(layer.cpu_linear, NumbaLinear)
    assert calls == [False, True] and layer.weight.numel() == 0  # removed, as vLLM's dispatch does
    other = _Layer(torch.float32)
    run(other, False)  # same shape: the choice is reused, not timed again, and vLLM's linear stays
    assert calls == [False, True, False] and cpu_gemm.kernel_summary() == "vllm"


def test_vllm_mode_and_layers_it_cannot_take_go_straight_to_vllm(dispatch, monkeypatch):
    run, calls, cpu_gemm = dispatch
    monkeypatch.setenv(cpu_gemm.LINEAR_ENV, "vllm")
    run(_Layer(), True)
    monkeypatch.setenv(cpu_gemm.LINEAR_ENV, "auto")
    run(_Layer(torch.float16), True)
    assert calls == [True, True] and cpu_gemm._choices == {}


def test_a_bad_mode_names_the_variable(monkeypatch):
    from vllm_treespec.patches import cpu_gemm

    monkeypatch.setenv(cpu_gemm.LINEAR_ENV, "fast")
    with pytest.raises(ValueError, match="VLLM_TREESPEC_CPU_LINEAR='fast'"):
        cpu_gemm.apply()


def test_a_failed_timing_keeps_vllms_linear(dispatch, monkeypatch):
    run, calls, cpu_gemm = dispatch
    monkeypatch.setenv(cpu_gemm.LINEAR_ENV, "auto")

    def broken(weight, current):
        raise RuntimeError("no timer")

    monkeypatch.setattr("vllm_treespec.cpu_gemm.time_against", broken)
    layer = _Layer()
    run(layer, True)
    assert not isinstance(layer.cpu_linear, NumbaLinear) and calls == [False, True]


def test_under_torch_compile_the_linear_is_one_opaque_op():
    """vLLM's CPU engines compile the model unless enforce_eager: the kernel must be traceable (a custom op)."""
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(SHAPES[1], generator=generator) * 0.05).to(torch.bfloat16)
    linear = NumbaLinear(weight)
    x = torch.randn(4, weight.shape[1], generator=generator).to(torch.bfloat16)
    compiled = torch.compile(lambda v, w: linear(v, w, None) * 2, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, weight), linear(x) * 2)
