"""Patch of ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``: a measured choice of CPU linear.

vLLM picks each dense layer's CPU GEMM once, at load time (zentorch, sgl-kernel, oneDNN, else torch's linear). On a
CPU without AVX-512 its bf16 choice is torch's fallback, whose time grows linearly with the rows of a step, so every
verified tree token costs about a decode step. After vLLM's choice this patch times it against
:class:`vllm_treespec.cpu_gemm.NumbaLinear` on the layer's weight shape, the weight out of cache as in a step (once
per shape and dtype, ~1-2 s per model), and keeps the faster (:func:`vllm_treespec.cpu_gemm.ours_is_faster`).
When vLLM would remove the layer's weight, ours holds what it multiplies by and the layer's weight is removed as
vLLM does. It applies to every CPU engine of a process where the plugin is enabled, speculative or not, so that no
speculation is measured with the same linear as the tree methods.

The choices are kept on disk (``<cache>/cpu_linear/<key>.json``, keyed by the CPU, torch, vLLM, Numba and the
thread count): every engine on a machine then runs the same linear on the same weights, so a speculative engine and
a plain one sum in the same order (where the two linears are close in time a fresh timing could pick either, and
fp32 outputs would then differ by rounding), and later engines start without timing. A corrupt or foreign file is
ignored with one log line and timed again.

``VLLM_TREESPEC_CPU_LINEAR``: ``auto`` (default: measured), ``vllm`` (vLLM's choice, untimed), ``numba`` (ours
wherever it applies, untimed).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import msgspec
import torch
from vllm.model_executor.layers import utils as layer_utils

from vllm_treespec.patches import is_patched, wrap_function

logger = logging.getLogger("vllm.treespec")

DISPATCH_PARAMS = ("layer", "remove_weight")
LINEAR_ENV = "VLLM_TREESPEC_CPU_LINEAR"
LINEAR_CHOICES = ("auto", "vllm", "numba")

CACHE_SUBDIR = "cpu_linear"

#: (dtype, out_features, in_features, fp32 holding only bf16 values) -> ours is used; one timing per shape and machine
_choices: dict[tuple[torch.dtype, int, int, bool], bool] = {}


class ChoiceKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a timing depends on besides the shape."""
    device: str
    torch_version: str
    vllm_version: str
    numba_version: str
    torch_threads: int
    kernel: str = ""  # vllm_treespec.cpu_gemm.KERNEL_VERSION: a choice made against an older kernel is made again


class ChoiceRecord(msgspec.Struct, forbid_unknown_fields=True):
    key: ChoiceKey
    ours: dict[str, bool] = {}  # "<dtype> <out>x<in>[ bf16-values]" -> ours is faster


def _choice_key() -> ChoiceKey:
    import numba
    import vllm

    from vllm_treespec.cpu_gemm import KERNEL_VERSION
    from vllm_treespec.device_defaults import device_name

    return ChoiceKey(device=device_name(), torch_version=str(torch.__version__), vllm_version=str(vllm.__version__),
                     numba_version=str(numba.__version__), torch_threads=torch.get_num_threads(),
                     kernel=KERNEL_VERSION)


def _shape_name(shape: tuple[torch.dtype, int, int, bool]) -> str:
    return f"{str(shape[0])[6:]} {shape[1]}x{shape[2]}" + (" bf16-values" if shape[3] else "")


def _cache_path(key: ChoiceKey) -> Path:
    from vllm_treespec.settings import default_cache_dir

    digest = hashlib.sha256(msgspec.json.encode(key)).hexdigest()[:16]
    return default_cache_dir() / CACHE_SUBDIR / f"{digest}.json"


def _read_choices(key: ChoiceKey) -> dict[str, bool]:
    """The choices saved on this machine for ``key``; {} (one log line if the file is bad) when there are none."""
    path = _cache_path(key)
    try:
        record = msgspec.json.decode(path.read_bytes(), type=ChoiceRecord)
    except FileNotFoundError:
        return {}
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as error:
        logger.warning("vllm_treespec CPU linear: ignoring the unreadable choices %s (%s); timing again", path, error)
        return {}
    if record.key != key:
        logger.warning("vllm_treespec CPU linear: ignoring the choices %s made for another machine or version; "
                       "timing again", path)
        return {}
    return record.ours


def _save_choice(key: ChoiceKey, name: str, ours: bool) -> None:
    """Add one choice to the file (read, merge, written atomically); a failure costs a timing next time only."""
    from vllm_treespec.settings import write_json_atomically

    path = _cache_path(key)
    try:
        write_json_atomically(path, ChoiceRecord(key=key, ours={**_read_choices(key), name: ours}))
    except OSError as error:
        logger.warning("vllm_treespec CPU linear: cannot save the choice to %s (%s)", path, error)


def linear_mode() -> str:
    mode = os.environ.get(LINEAR_ENV, "auto").strip().lower() or "auto"
    if mode not in LINEAR_CHOICES:
        raise ValueError(f"{LINEAR_ENV}={mode!r} is not one of {', '.join(LINEAR_CHOICES)} "
                         "(auto: the faster of vLLM's CPU linear and ours, timed at load)")
    return mode


def kernel_summary() -> str:
    """What this process's dense layers use, for the step-cost cache key: ``vllm``, ``numba <kernel>`` or ``mixed
    <kernel>`` (a curve measured with another version of ours is measured again)."""
    used = set(_choices.values())
    if not used or used == {False}:
        return "vllm"
    from vllm_treespec.cpu_gemm import KERNEL_VERSION

    return f"{'mixed' if len(used) == 2 else 'numba'} {KERNEL_VERSION}"


def _eligible(layer: torch.nn.Module) -> bool:
    from vllm_treespec.cpu_gemm import DTYPES

    weight = getattr(layer, "weight", None)
    return (isinstance(weight, torch.Tensor) and not weight.is_meta and weight.dim() == 2
            and weight.dtype in DTYPES and weight.device.type == "cpu" and weight.numel() > 0)


def _choose(original, layer: torch.nn.Module, remove_weight: bool, mode: str) -> bool:
    """Whether ``layer`` should use ours; leaves vLLM's linear installed (built without removing the weight)."""
    from vllm_treespec import cpu_gemm  # numba: imported where a CPU model loads, not at plugin registration

    weight = layer.weight
    shape = (weight.dtype, int(weight.shape[0]), int(weight.shape[1]), cpu_gemm.holds_only_bf16_values(weight))
    original(layer, remove_weight=False)
    if mode == "numba":
        _choices[shape] = True
        return True
    if shape in _choices:
        return _choices[shape]
    key = _choice_key()
    name = _shape_name(shape)
    saved = _read_choices(key).get(name)
    if saved is not None:
        _choices[shape] = saved
        logger.info("vllm_treespec CPU linear %s: %s (chosen earlier on this machine)", name,
                    "ours" if saved else "vLLM's")
        return saved
    times = cpu_gemm.time_against(weight, layer.cpu_linear)
    _choices[shape] = cpu_gemm.ours_is_faster(times)
    logger.info("vllm_treespec CPU linear %s: %s (time ours / vLLM's: %s rows)", name,
                "ours" if _choices[shape] else "vLLM's",
                ", ".join(f"{ours / theirs:.2f} at {n}" for n, (ours, theirs) in times.items()))
    _save_choice(key, name, _choices[shape])
    return _choices[shape]


def dispatch_wrapper(original, layer, remove_weight):
    """The patched dispatch: vLLM's, then ours where it is faster (see the module docstring)."""
    mode = linear_mode()
    if mode == "vllm" or not _eligible(layer):
        return original(layer, remove_weight)
    try:
        use_ours = _choose(original, layer, remove_weight, mode)
    except Exception as error:  # noqa: BLE001 - a failed timing must not stop the model from loading
        logger.warning("vllm_treespec CPU linear: timing failed (%s); vLLM's linear is kept", error)
        use_ours = False
    if use_ours:
        from vllm_treespec.cpu_gemm import NumbaLinear

        layer.cpu_linear = NumbaLinear(layer.weight)  # holds its weight; vLLM's handler (and its copy) goes
        if remove_weight:  # as vLLM's dispatch does: an fp32 weight kept as bf16 bits frees its fp32 copy
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)
    elif remove_weight:
        original(layer, remove_weight)  # vLLM's own dispatch, exactly as it would have run
    return None


def install() -> None:
    """Wrap the dispatch (idempotent). :func:`apply` calls it on CPU; tests call it directly."""
    if not is_patched(layer_utils, "dispatch_cpu_unquantized_gemm"):
        wrap_function(layer_utils, "dispatch_cpu_unquantized_gemm", DISPATCH_PARAMS)(dispatch_wrapper)


def apply() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        linear_mode()  # a bad value fails here, at start-up, naming the variable
        install()
