"""Plain-torch paged tree attention: the oracle the tree backends are tested against.

Deliberately naive: per request, per row, float64, explicit ancestor walk. Row 0 is the root (the last committed
token), row 1+i is node i; every row sees the committed context, and a tree row sees exactly its ancestors and itself.
"""

from __future__ import annotations

import numpy as np
import torch


def reference_tree_attention(query: torch.Tensor, k_context: torch.Tensor, v_context: torch.Tensor,
                             k_tree: torch.Tensor, v_tree: torch.Tensor, parents: np.ndarray,
                             scale: float) -> torch.Tensor:
    """query [W, Hq, D]; k/v_context [C, Hkv, D]; k/v_tree [W, Hkv, D]; parents [W-1]. Returns [W, Hq, D]."""
    w, hq, _ = query.shape
    group = hq // k_tree.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for row in range(w):
        visible = [row]
        node = row - 1
        while node >= 0:
            parent = int(parents[node])
            visible.append(parent + 1)
            node = parent
        keys = torch.cat([k_context, k_tree[sorted(visible)]]).double()
        values = torch.cat([v_context, v_tree[sorted(visible)]]).double()
        for h in range(hq):
            scores = keys[:, h // group] @ query[row, h].double() * scale
            out[row, h] = torch.softmax(scores, dim=0) @ values[:, h // group]
    return out
