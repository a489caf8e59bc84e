"""Routing statistics: where the copies of a token go when its top-k experts are spread over EP ranks.

Balanced (or group- / node-limited) routing is sampled by Monte Carlo; the placement of EP ranks on NVLink
domains decides which copies cross the NIC. The per-rank load imbalance of real routing is a plan input
(``Plan.imbalance``) or solved in :mod:`moetrain.plan.model.predict`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from moetrain.plan.constants import ROUTING_SAMPLES


@dataclass(frozen=True)
class RoutingStats:
    """Expected copies of one token per dispatch, by where they go (balanced routing, Monte Carlo).

    Attributes:
        same_domain_ranks: distinct destination ranks in the sender's NVLink domain, the sender excluded.
        remote_domains: distinct destination domains other than the sender's (one NIC copy each).
        remote_domain_ranks: distinct destination ranks in those domains (NVLink forwarding there).
        ranks: all distinct destination ranks, the sender included.
        same_domain_pairs, remote_pairs: (token, expert) pairs whose expert is on another rank of the sender's
            domain / in another domain -- the rows an ``alltoall`` dispatcher sends (no deduplication).
    """

    same_domain_ranks: float
    remote_domains: float
    remote_domain_ranks: float
    ranks: float
    same_domain_pairs: float = 0.0
    remote_pairs: float = 0.0


@lru_cache(maxsize=4096)
def routing_stats(n_experts: int, top_k: int, ep: int, ranks_per_domain: int, n_groups: int = 1,
                  n_limited_groups: int = 1, node_limit: int | None = None,
                  samples: int = ROUTING_SAMPLES, seed: int = 0) -> RoutingStats:
    """Monte-Carlo estimate of the destinations of a token's k experts under balanced routing.

    Experts are placed in order, E/EP per rank; ranks fill NVLink domains of ``ranks_per_domain``. Each token
    draws k distinct experts uniformly among its candidates: all experts; or those of ``n_limited_groups`` random
    groups out of ``n_groups`` (group-limited routing; forced-balanced benchmarks keep it); or, with
    ``node_limit`` M, those of M random domains (DeepSeek-V3 node-limited routing). A dispatcher sends one copy
    per destination rank (tokens for several experts of one rank travel once), and across domains one copy per
    destination domain, forwarded over NVLink there (DeepEP / HybridEP).
    """
    if ep <= 1:
        return RoutingStats(0.0, 0.0, 0.0, 1.0, 0.0, 0.0)
    rng = np.random.default_rng(seed)
    per_rank = n_experts // ep
    r = max(1, min(ranks_per_domain, ep))
    n_dom = math.ceil(ep / r)
    src = rng.integers(0, ep, size=samples)
    if node_limit is not None and node_limit < n_dom:
        doms = np.argsort(rng.random((samples, n_dom)), axis=1)[:, :node_limit]
        per_dom = n_experts // n_dom
        cand = (doms[:, :, None] * per_dom + np.arange(per_dom)[None, None, :]).reshape(samples, -1)
    elif n_groups > 1 and n_limited_groups < n_groups:
        gsize = n_experts // n_groups
        groups = np.argsort(rng.random((samples, n_groups)), axis=1)[:, :n_limited_groups]
        cand = (groups[:, :, None] * gsize + np.arange(gsize)[None, None, :]).reshape(samples, -1)
    else:
        cand = np.broadcast_to(np.arange(n_experts), (samples, n_experts))
    pick = np.argsort(rng.random(cand.shape), axis=1)[:, :top_k]
    experts = np.take_along_axis(cand, pick, axis=1)
    ranks = experts // per_rank
    doms_of = ranks // r
    src_dom = (src // r)[:, None]
    # (token, expert) pairs by destination, without deduplication
    pair_dom = ranks // r
    same_pairs = float(np.mean(np.sum((pair_dom == src_dom) & (ranks != src[:, None]), axis=1)))
    remote_pairs = float(np.mean(np.sum(pair_dom != src_dom, axis=1)))
    same, rdoms, rranks, allr = 0.0, 0.0, 0.0, 0.0
    for i in range(samples):
        ur = np.unique(ranks[i])
        ud = ur // r
        allr += len(ur)
        same += np.count_nonzero((ud == src_dom[i, 0]) & (ur != src[i]))
        rem = ud != src_dom[i, 0]
        rranks += np.count_nonzero(rem)
        rdoms += len(np.unique(ud[rem]))
    del doms_of
    return RoutingStats(float(same / samples), float(rdoms / samples), float(rranks / samples),
                        float(allr / samples), same_pairs, remote_pairs)


def ranks_per_domain(ep: int, domain: int) -> int:
    """EP ranks that share an NVLink domain: all of them if the group fits, else the largest divisor of EP that
    fits (schedulers place aligned blocks, e.g. 64 GPUs of a 72-GPU NVL72 rack)."""
    if ep <= domain:
        return ep
    return max(d for d in range(1, domain + 1) if ep % d == 0)
