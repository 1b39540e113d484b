"""Stand-ins for vLLM's model runner and a tree proposer, for verifier tests without an engine.

The fake runner has only attributes that vllm_treespec.verify.verifier.RUNNER_ATTRIBUTES lists (and its input batch
only INPUT_BATCH_ATTRIBUTES; tests/unit/test_runner_contract.py checks both), filled the way vLLM fills them between
``_prepare_inputs`` and ``_sample``: linear positions, ``query_start_loc`` over root + drafts per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer

MAX_MODEL_LEN = 32


@dataclass
class FakeRequest:
    req_id: str
    tokens: list[int]  # committed tokens (prompt + output), the newest last
    blocks: list[int]  # its row of the block table
    sampling_params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    prompt_len: int | None = None  # tokens of the prompt; None: all committed tokens but the newest

    @property
    def num_prompt(self) -> int:
        return len(self.tokens) - 1 if self.prompt_len is None else self.prompt_len

    @property
    def num_computed(self) -> int:
        """Tokens with K/V before this step: all but the newest, which is this step's root."""
        return len(self.tokens) - 1


def fake_runner(requests: list[FakeRequest], max_nodes: int = 8, block_size: int = 4, *, uses_mrope: bool = False,
                pipeline_parallel_size: int = 1, data_parallel_size: int = 1, is_attention_free: bool = False,
                kv_cache_specs: list | None = None) -> SimpleNamespace:
    num_blocks = max(len(r.blocks) for r in requests)
    table = np.zeros((len(requests), num_blocks), np.int32)
    token_ids = np.zeros((len(requests), MAX_MODEL_LEN), np.int64)
    for i, r in enumerate(requests):
        table[i, : len(r.blocks)] = r.blocks
        token_ids[i, : len(r.tokens)] = r.tokens
    if kv_cache_specs is None:
        kv_cache_specs = [FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)]
    input_batch = SimpleNamespace(
        req_ids=[r.req_id for r in requests],
        req_id_to_index={r.req_id: i for i, r in enumerate(requests)},
        num_reqs=len(requests),
        num_tokens_no_spec=np.array([len(r.tokens) for r in requests], np.int32),
        num_prompt_tokens=np.array([r.num_prompt for r in requests], np.int32),
        token_ids_cpu=token_ids,
        num_computed_tokens_cpu=np.array([r.num_computed for r in requests], np.int32),
        block_table=[SimpleNamespace(block_size=block_size, block_table=SimpleNamespace(np=table))],
        sampling_metadata=None,
    )
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=max_nodes),
        max_model_len=MAX_MODEL_LEN,
        vllm_config=SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=pipeline_parallel_size,
                                            data_parallel_size=data_parallel_size),
            model_config=SimpleNamespace(is_attention_free=is_attention_free)),
        uses_mrope=uses_mrope,
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in kv_cache_specs]),
        input_batch=input_batch,
        requests={r.req_id: SimpleNamespace(sampling_params=r.sampling_params) for r in requests},
        query_start_loc=SimpleNamespace(np=np.zeros(len(requests) + 1, np.int32)),
        positions=torch.zeros(64, dtype=torch.int64),
    )


def schedule(runner: SimpleNamespace, scheduled: dict[str, list[int]]) -> tuple[SimpleNamespace, np.ndarray]:
    """What vLLM does up to ``_prepare_inputs``: every row runs its root plus its scheduled drafts at linear
    positions. Returns (scheduler output, num_scheduled_tokens per row)."""
    input_batch = runner.input_batch
    num_scheduled = np.array([1 + len(scheduled.get(r, ())) for r in input_batch.req_ids], np.int32)
    runner.query_start_loc.np[:] = np.concatenate([[0], np.cumsum(num_scheduled)])
    runner.positions.zero_()
    for i, n in enumerate(num_scheduled):
        start = runner.query_start_loc.np[i]
        runner.positions[start: start + n] = torch.arange(n) + int(input_batch.num_computed_tokens_cpu[i])
    return SimpleNamespace(scheduled_spec_decode_tokens={r: list(d) for r, d in scheduled.items() if d}), num_scheduled


class FakeProposer(TreeProposer):
    """Returns the trees it is given, by request id; records what the verifier hands it."""

    def __init__(self, trees: dict[str, DraftTree | None], wants_target_logits: bool = False) -> None:
        super().__init__(None)
        self.trees = trees
        self.wants_target_logits = wants_target_logits
        self.contexts: list[ProposeContext] = []
        self.observed: list[ProposeContext] = []  # steps the budget did not draft
        self.verified: list = []
        self.finished: list[set[str]] = []

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        self.contexts.append(ctx)
        return [self.trees.get(r) for r in ctx.req_ids]

    def observe(self, ctx: ProposeContext) -> None:
        self.observed.append(ctx)

    def on_verified(self, results) -> None:
        self.verified.extend(results)

    def on_requests_finished(self, req_ids: set[str]) -> None:
        self.finished.append(req_ids)


def _record_compaction(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    self.moves.append((src.tolist(), dst.tolist()))


def tree_attention_impl():
    """This platform's tree attention impl, uninitialised, compacting through ``compact_tree_kv`` (as the device
    backends do) into a record: ``impl.moves`` = [(source slots, destination slots)] per compaction."""
    from vllm_treespec.verify.support import tree_attention_impls

    cls = type("RecordingTreeImpl", (tree_attention_impls()[0],), {"compact_tree_kv": _record_compaction})
    impl = cls.__new__(cls)
    impl.moves = []
    return impl


def recording_layer(impl=None) -> SimpleNamespace:
    """An attention layer as the verifier sees it (``kv_cache``, ``impl``, ``layer_name``)."""
    return SimpleNamespace(kv_cache=torch.zeros(1), impl=tree_attention_impl() if impl is None else impl,
                           layer_name="l0")
