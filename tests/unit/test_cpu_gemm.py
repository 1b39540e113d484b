"""The Numba CPU linear (vllm_treespec.cpu_gemm) and the patch that chooses it (no engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_treespec.cpu_gemm import KERNEL_VERSION, NumbaLinear, holds_only_bf16_values, ours_is_faster, time_against

# (out_features, in_features): a weight of one partial 8-column tile, one of several 2-tile blocks whose last block
# has 1 tile and whose last tile is partial, and a wide input dimension
SHAPES = [(7, 33), (131, 577), (45, 1536)]


def _reference(x, weight, bias):
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("leading", [(2, 5), (1, 7), (2,)])  # 10 rows: 6 + 4 in blocks; 7: 6 + 1; 2: alone
def test_the_linear_is_x_times_the_weight_in_the_weights_dtype(dtype, shape, with_bias, leading):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
    bias = torch.randn(shape[0], generator=generator).to(dtype) if with_bias else None
    x = torch.randn(*leading, shape[1], generator=generator).to(dtype)  # leading dimensions are kept
    out = NumbaLinear(weight)(x, weight, bias)
    assert out.shape == (*leading, shape[0]) and out.dtype == dtype
    want = _reference(x, weight, bias)
    if dtype == torch.float32:
        # one fp32 sum in order over K terms: each partial sum rounds once (the classic bound K * u * sum|terms|)
        bound = shape[1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T) + 1e-6
        assert torch.all((out.double() - want).abs() <= bound)
    else:  # fp32 sums rounded once to bf16: within one bf16 rounding of the exact product
        assert torch.all((out.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-6)
    assert NumbaLinear(weight)(x[:0], weight, bias).shape == (0, *leading[1:], shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype):
    """Batch invariance: the same row alone, first or last of a batch of any size gives the same bits (a call's
    last rows go through register blocks of other shapes, 1 x 8 and 2 x 4 tiles among them, which sum in the same
    order; the weight's 17 tiles make groups of 8, 8 and 1)."""
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(SHAPES[1], generator=generator) * 0.05).to(dtype)
    linear = NumbaLinear(weight)
    x = torch.randn(13, weight.shape[1], generator=generator).to(dtype)  # row blocks of 6, 6 and 1
    batch = linear(x)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(13)])
    assert torch.equal(batch, alone)
    assert torch.equal(linear(x[3:8]), batch[3:8])
    assert torch.equal(linear(x[2:11]), batch[2:11])
    for rows in (2, 7, 8):  # a 2 x 4 block alone; a 6-row block and a 1 x 8 or 2 x 4 block after it
        assert torch.equal(linear(x[:rows]), batch[:rows])


def test_an_fp32_layers_direct_call_gives_the_bits_of_the_general_path():
    """A 2-D contiguous fp32 input without bias goes straight to the kernel; every other call is reshaped and
    copied first. Both must give the same bits (an engine mixes them: leading dimensions, strided views)."""
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(SHAPES[1], generator=generator) * 0.05).to(torch.float32)
    linear = NumbaLinear(weight)
    x = torch.randn(9, weight.shape[1], generator=generator)
    direct = linear(x)
    strided = x.t().contiguous().t()  # the same values, not contiguous: the general path
    assert not strided.is_contiguous() and torch.equal(linear(strided), direct)
    assert torch.equal(linear(x[None])[0], direct)  # a leading dimension: the general path
    assert direct.dtype == torch.float32 and direct.shape == (9, weight.shape[0])
    assert linear(x[:0]).shape == (0, weight.shape[0])
    kept = direct.clone()
    direct += 1.0  # the result is the caller's own tensor: changing it changes no later call
    assert torch.equal(linear(x), kept)


def test_an_fp32_weight_of_bf16_values_is_kept_as_bf16_and_multiplies_the_same():
    """A bf16 checkpoint run in fp32: the weight is stored as its bf16 bits (half the bytes) and the output is the
    fp32 weight's, bit for bit (the same fp32 products summed in the same order)."""
    generator = torch.Generator().manual_seed(11)
    weight = (torch.randn(SHAPES[1], generator=generator) * 0.05).to(torch.bfloat16).float()
    x = torch.randn(5, weight.shape[1], generator=generator)
    compact = NumbaLinear(weight)
    assert holds_only_bf16_values(weight) and compact.compact and compact.packed.dtype == np.uint16
    out = compact(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(x, weight, None), rtol=0, atol=1e-5)
    # the same values kept as fp32 run the fp32 kernel: identical bits
    wide = NumbaLinear(weight, keep_bf16_values=False)
    assert not wide.compact and wide.packed.dtype == np.float32
    assert torch.equal(wide(x), out)
    nudged = weight.clone()  # one value off bf16: kept as fp32
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(1.0))
    assert not NumbaLinear(nudged).compact
    assert not holds_only_bf16_values(weight.to(torch.bfloat16))  # bf16 weights are bf16 already


def test_a_weight_it_cannot_take_is_refused_by_name():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        NumbaLinear(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D"):
        NumbaLinear(torch.zeros(4, 4, 4))


def test_the_choice_weighs_every_row_count_equally_and_times_cold_weights(monkeypatch):
    assert ours_is_faster({1: (1.0, 2.0), 8: (1.0, 1.0)})
    assert not ours_is_faster({1: (1.2, 1.0), 8: (1.0, 1.0), 32: (1.0, 1.0)})
    # twice as slow at one row is not bought back by 1.5x faster at two others (2 + 0.67 + 0.67 > 3)
    assert not ours_is_faster({1: (2.0, 1.0), 8: (1.0, 1.5), 32: (1.0, 1.5)})
    from vllm_treespec import cpu_gemm

    assert cpu_gemm.last_level_cache_bytes() > 0
    evictions = []
    monkeypatch.setattr(cpu_gemm.CacheEvictor, "__call__", lambda self: evictions.append(len(self.buffer)))
    weight = torch.randn(16, 32)
    times = time_against(weight, lambda x, w, b: torch.nn.functional.linear(x, w, b), rows=(1, 3), repeats=1)
    assert set(times) == {1, 3} and all(t > 0 for pair in times.values() for t in pair)
    # the caches are emptied before every timed call (2 row counts x 2 linears x 1 repeat), by reading twice the LLC
    assert len(evictions) == 4 and evictions[0] * 8 >= min(2 * cpu_gemm.last_level_cache_bytes(), 512 << 20)


class _Layer(torch.nn.Module):
    def __init__(self, dtype=torch.bfloat16, shape=(12, 20)):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(shape).to(dtype), requires_grad=False)


@pytest.fixture
def dispatch(monkeypatch, tmp_path):
    """vLLM's dispatch, patched, with a stand-in for the original that records its calls; choices saved under
    a temporary cache."""
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
    monkeypatch.setenv("VLLM_TREESPEC_CACHE", str(tmp_path))
    # the installed patch calls vLLM's dispatch; the same wrapper is called here with the stand-in
    return (lambda layer, remove_weight: cpu_gemm.dispatch_wrapper(original, layer, remove_weight)), calls, cpu_gemm


def test_numba_mode_installs_ours_and_removes_the_layers_weight_as_vllm_would(dispatch, monkeypatch):
    run, calls, cpu_gemm = dispatch
    monkeypatch.setenv(cpu_gemm.LINEAR_ENV, "numba")
    layer = _Layer()
    weight = layer.weight.detach().clone()
    run(layer, True)
    assert isinstance(layer.cpu_linear, NumbaLinear) and layer.weight.numel() == 0  # ours holds it
    assert calls == [False] and cpu_gemm.kernel_summary() == f"numba {KERNEL_VERSION}"
    x = torch.randn(3, 20).to(torch.bfloat16)
    assert torch.equal(layer.cpu_linear(x, layer.weight, None), NumbaLinear(weight)(x))
    kept = _Layer(shape=(12, 21))
    run(kept, False)  # an embedding's weight (vLLM passes remove_weight=False) stays
    assert kept.weight.numel() == 12 * 21 and isinstance(kept.cpu_linear, NumbaLinear)


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


def test_a_choice_is_saved_for_the_next_process_and_a_bad_file_is_timed_again(dispatch, monkeypatch, caplog):
    run, calls, cpu_gemm = dispatch
    monkeypatch.setenv(cpu_gemm.LINEAR_ENV, "auto")
    timings = []

    def ours_faster(weight, current):
        timings.append(tuple(weight.shape))
        return {1: (1.0, 2.0)}

    monkeypatch.setattr("vllm_treespec.cpu_gemm.time_against", ours_faster)
    run(_Layer(torch.float32), True)
    assert timings == [(12, 20)]
    path = cpu_gemm._cache_path(cpu_gemm._choice_key())
    assert path.exists() and "float32 12x20" in path.read_text()
    monkeypatch.setattr(cpu_gemm, "_choices", {})  # a new process: the saved choice is used, nothing is timed
    layer = _Layer(torch.float32)
    run(layer, True)
    assert timings == [(12, 20)] and isinstance(layer.cpu_linear, NumbaLinear)
    # fp32 weights holding only bf16 values are another choice (another kernel), timed on their own
    bf16_valued = _Layer(torch.float32)
    bf16_valued.weight.data = bf16_valued.weight.data.to(torch.bfloat16).float()
    run(bf16_valued, True)
    assert timings == [(12, 20), (12, 20)] and "float32 12x20 bf16-values" in path.read_text()
    for bad in (b"{not json", b'{"key": {"device": "another CPU", "torch_version": "0", "vllm_version": "0", '
                              b'"numba_version": "0", "torch_threads": 1}, "ours": {"float32 12x20": false}}'):
        path.write_bytes(bad)
        monkeypatch.setattr(cpu_gemm, "_choices", {})
        caplog.clear()
        with caplog.at_level("WARNING", logger="vllm.treespec"):
            run(_Layer(torch.float32), True)
        assert "timing again" in caplog.text and len(timings) in (3, 4)
    assert timings[-1] == (12, 20) and len(timings) == 4 and "float32 12x20" in path.read_text()


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
    # an fp32 weight kept as bf16 bits, its layer's weight removed: the op refers to the linear, not the layer
    compact = NumbaLinear(weight.float())
    empty = torch.empty(0)
    compiled = torch.compile(lambda v, w: compact(v, w, None) + 1, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x.float(), empty), compact(x.float()) + 1)


def test_a_linears_id_comes_from_what_it_computes_and_outlives_any_one_holder():
    """A compiled graph holds the linear's id, and vLLM's compile cache hands that graph to later engines: the id is
    the same for the same weight in any engine or process, differs for another weight or dtype, and is served
    while any linear of that content lives."""
    import gc

    from vllm_treespec.cpu_gemm import numba_linear

    generator = torch.Generator().manual_seed(7)
    weight = (torch.randn(SHAPES[1], generator=generator) * 0.05).to(torch.bfloat16)
    first, second = NumbaLinear(weight), NumbaLinear(weight.clone())
    assert first.linear_id == second.linear_id
    changed = weight.clone()
    changed[3, 5] += 1
    assert NumbaLinear(changed).linear_id != first.linear_id
    as_fp32 = NumbaLinear(weight.float())  # the same bf16 bits packed, but an fp32 output
    assert as_fp32.linear_id != first.linear_id and as_fp32.compact

    x = torch.randn(3, weight.shape[1], generator=generator).to(torch.bfloat16)
    expected, linear_id = first(x), first.linear_id
    del first
    gc.collect()
    # what a graph compiled on the first linear calls: served by its twin
    assert torch.equal(torch.ops.vllm_treespec.numba_linear(x, None, linear_id), expected)
    del second
    gc.collect()
    with pytest.raises(KeyError, match="no live CPU linear"):
        numba_linear(x, None, linear_id)
    assert NumbaLinear(weight).linear_id == linear_id  # a later engine's linear answers to it again
