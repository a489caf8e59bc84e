"""Node-limited routing (DeepSeek-V3 report sec. 2.1.2): a token's experts on at most M nodes, the nodes chosen by
the sum of their top K / M selection scores; checked by hand and on the router, and set from the EP placement."""

from __future__ import annotations

import pytest
import torch

from moetrain.errors import ConfigError
from moetrain.model.config import tiny
from moetrain.model.moe import Router, node_limited
from moetrain.parallel.config import ParallelConfig


def test_node_limited_by_hand():
    # 8 experts on 4 nodes of 2; K = 4, M = 2: each node scored by its top 2 scores
    s = torch.tensor([[0.9, 0.0, 0.5, 0.5, 0.8, 0.05, 0.2, 0.2],
                      [0.1, 0.1, 0.3, 0.3, 0.0, 0.0, 0.95, 0.0]])
    out = node_limited(s, n_nodes=4, m=2, top_k=4)
    # row 0: node sums 0.9, 1.0, 0.85, 0.4 -> nodes 1 and 0; row 1: 0.2, 0.6, 0.0, 0.95 -> nodes 3 and 1
    keep = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(out, s.masked_fill(~keep, float("-inf")))
    assert torch.equal(node_limited(s, n_nodes=4, m=4, top_k=4), s)  # M = N: no limit
    with pytest.raises(ValueError):
        node_limited(s, n_nodes=3, m=1, top_k=4)


def test_router_keeps_each_tokens_experts_on_m_nodes():
    cfg = tiny().replace(n_expert_groups=1, n_limited_groups=1)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=1.0, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, cfg.dim, generator=torch.Generator().manual_seed(1))
    free = router(x).topk_idx_TK
    E, K = cfg.n_routed_experts, cfg.top_k
    router.node_limit = (4, 1)
    limited = router(x).topk_idx_TK
    nodes = limited // (E // 4)
    assert (nodes == nodes[:, :1]).all()  # one node per token
    assert not (free // (E // 4) == (free // (E // 4))[:, :1]).all()  # which the free routing does not give
    assert K <= E // 4


def test_node_limit_is_checked_against_the_ep_layout():
    assert ParallelConfig(ep=16, node_limit_m=1).ep_nodes == 2
    assert ParallelConfig(ep=4, node_limit_m=1).ep_nodes == 1  # one node: no limit applies
    with pytest.raises(ConfigError, match="neither a multiple nor a divisor"):
        ParallelConfig(ep=12, node_limit_m=1)
    with pytest.raises(ConfigError, match="node_limit_m=0"):
        ParallelConfig(ep=2, node_limit_m=0)
