"""``graft``: prune-then-graft hybrid draft trees (Graft, "Draft Less, Retrieve More", arXiv 2605.20104), with a node
budget that shrinks as the batch grows (ECHO, arXiv 2604.09603).

Reads each request's committed tokens (``ctx.committed(i)``) and, after every verify step, the target's top
``successor_k`` tokens and their probabilities at all verified tree rows (``wants_target_topk``; ``on_verified`` sees
tree rows only). Per request and step:

1. **Draft.** A model drafter (:class:`ModelDrafter`; the EAGLE-3 or KV-aware head of ``eagle_checkpoint``, drafting
   EAGLE-2 dynamic trees as ``eagle_tree`` / ``kv_aware`` do) drafts a scored tree, which graft takes level by level.
   Without a head (``eagle_checkpoint`` "none", or "auto" and no default head trained for the served model) the
   draft is the retrieval tree of the source that is most confident at the first checkpoint (ties: the order of
   ``sources``), read level by level, and the log says so once.
2. **Prune.** After the draft reaches each checkpoint depth d, the best path confidence ``exp(max cumulative
   log-prob at depth d)`` is compared with that checkpoint's threshold; below it, drafting stops and the rest of the
   budget is freed. With a head this happens inside the head's expansion too ("draft less": the pruned levels are
   never drafted), and the stopped tree keeps only the nodes at least as likely as that best path.
3. **Graft.** The freed budget is filled best-first by path confidence from the other sources, at the root, under
   the deepest retained draft node, or both (``graft_position``); identical paths are merged, draft nodes always stay.
   Sources: a top-k successor table (Token Recycling, arXiv 2408.08696) refreshed online from the target's
   distribution at every verified row, accepted or rejected, and seeded from committed bigrams; suffix automata over
   the request's prompt + output, finished outputs and an optional corpus datastore; an n-gram index.
4. **Calibrate.** Path confidences multiply each source's step probabilities passed through the verifier's
   :class:`~vllm_treespec.verify.calibration.AcceptanceCalibration`: the rate at which the target accepted that
   source's nodes of that raw confidence, learned online from every verified draft (``calibrate_acceptance``; with
   ``calibrate_by_match_length`` the suffix and n-gram sources by the length of the context suffix they matched too;
   graft names its sources in ``acceptance_sources`` and marks each node's in ``node_sources``, and returns the raw
   numbers, which the verifier calibrates for the step budget). Nodes below ``min_node_confidence`` are left out.
   Without a head, the draft source is chosen on calibrated confidences too; the pruning checkpoints compare the raw
   numbers, which their thresholds were chosen on.

Budgets and the head. Under the engine's step budget (``cost_budget``, on by default: :mod:`vllm_treespec.cost`)
graft drafts ``budget`` nodes per request (default ``num_speculative_tokens``) with no confidence floor, the verifier
keeps the nodes whose calibrated acceptance pays for their measured cost, and the head drafts only while a
:class:`~vllm_treespec.cost.allocate.DraftGate` expects its trees to gain more than its measured time per step
costs. Without a step-cost model (or with ``cost_budget`` false) the tables of
:mod:`vllm_treespec.device_defaults` decide instead: on CPU the head drafts only while the batch has at most
``model_draft_max_batch`` requests (default 1), and the budget shrinks as the batch grows — from the calibration
file's measured table, else ``knee_tokens / batch - 1`` when ``knee_tokens`` is given or off CPU, else a table
measured on CPU (:data:`vllm_treespec.device_defaults.DEFAULT_CPU_BUDGET_TABLE`). Explicit options win over both.
``vllm-treespec graft calibrate`` (:mod:`vllm_treespec.tools.graft_calibrate`) replays greedy outputs of the target
offline to pick the thresholds and measures the step cost to build that table.

Modules: :mod:`.options` (the options), :mod:`.calibration` (the calibration file), :mod:`.budget` (the adaptive
budget), :mod:`.drafter` (the model drafter), :mod:`.growth` (the draft, grown and pruned), :mod:`.sources` (the
retrieval sources), :mod:`.assemble` (draft + grafts = the tree), :mod:`.proposer` (:class:`GraftProposer`).
"""

from vllm_treespec.device_defaults import DEFAULT_CPU_BUDGET_TABLE, DEFAULT_KNEE_TOKENS, DEFAULT_MODEL_DRAFT_MAX_BATCH
from vllm_treespec.verify.calibration import ACCEPTANCE_BINS, ACCEPTANCE_PRIOR_TRIALS, AcceptanceCalibration

from .assemble import AssembledTree, assemble, assemble_tree
from .budget import BudgetCurve, budget_curve
from .calibration import CALIBRATION_VERSION, GraftCalibration, check_checkpoints, check_thresholds, load_calibration
from .drafter import MODEL_SOURCE, EagleModelDrafter, ModelDrafter, load_model_drafter
from .growth import (DraftGrowth, DraftLevel, draft_tree_levels, first_checkpoint_confidence, grow_draft,
                     grow_draft_tree, grow_retrieved, tree_levels)
from .options import DEFAULT_CHECKPOINTS, DEFAULT_THRESHOLDS, GraftOptions, GraftPosition, SourceName
from .proposer import GraftProposer, GraftStats
from .sources import FALLBACK_VOCAB_SIZE, SEED_CONFIDENCE, RetrievalSources

__all__ = [
    "ACCEPTANCE_BINS", "ACCEPTANCE_PRIOR_TRIALS", "CALIBRATION_VERSION", "DEFAULT_CHECKPOINTS",
    "DEFAULT_CPU_BUDGET_TABLE", "DEFAULT_KNEE_TOKENS", "DEFAULT_MODEL_DRAFT_MAX_BATCH", "DEFAULT_THRESHOLDS",
    "FALLBACK_VOCAB_SIZE", "MODEL_SOURCE", "SEED_CONFIDENCE", "AcceptanceCalibration", "AssembledTree", "BudgetCurve",
    "DraftGrowth", "DraftLevel", "EagleModelDrafter", "GraftCalibration", "GraftOptions", "GraftPosition",
    "GraftProposer", "GraftStats", "ModelDrafter", "RetrievalSources", "SourceName", "assemble", "assemble_tree",
    "budget_curve", "check_checkpoints", "check_thresholds", "draft_tree_levels", "first_checkpoint_confidence",
    "grow_draft", "grow_draft_tree", "grow_retrieved", "load_calibration", "load_model_drafter", "tree_levels",
]
