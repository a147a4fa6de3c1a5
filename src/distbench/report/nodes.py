"""Scaling within a node and across nodes, kept apart (results of `distbench launch`, whose fingerprint names
the launched nodes and ranks per node).

Intra-node efficiency is against 1 GPU, as in the throughput table. Inter-node efficiency is tokens/s on k
nodes over k times the same strategy on one full node: it isolates what the links between nodes cost, which
the 1-GPU figure mixes with what sharing a node costs.
"""

from __future__ import annotations

from ..metrics import fmt_metric
from .tables import Cell, fmt_value, md_table, scaling_of


def span(cell: Cell) -> tuple[int, int | None]:
    """(nodes the configuration's ranks spanned, ranks per node of its launch)."""
    from ..runtime.fingerprint import nodes_spanned

    per_node = (cell.runs[0].get("env") or {}).get("ranks_per_node")
    return nodes_spanned(cell.world_size, per_node), per_node


def node_scaling_table(cells: list[Cell]) -> list[str]:
    """Strategy x GPUs with nodes, link and the efficiency that applies; [] when nothing spans nodes."""
    spans = {id(c): span(c) for c in cells}
    if all(nodes == 1 for nodes, _ in spans.values()):
        return []
    by = {(c.strategy, c.world_size): c for c in cells}
    rows = []
    for c in cells:
        nodes, per_node = spans[id(c)]
        links = (c.runs[0].get("env") or {}).get("interconnect") or {}
        tps = c.metric("tokens_per_s")
        intra = inter = None
        if nodes == 1:
            intra = scaling_of(cells, c)[1]
        else:
            full = by.get((c.strategy, per_node)) if per_node else None
            full_tps = full.metric("tokens_per_s") if full else None
            inter = tps / (nodes * full_tps) if tps and full_tps else None
        link = "inter-node" if nodes > 1 else "intra-node"
        kind = links.get("inter_node" if nodes > 1 else "intra_node")
        rows.append(
            [
                c.strategy,
                str(c.world_size),
                str(nodes),
                link + (f" ({kind})" if kind else ""),
                fmt_metric("tokens_per_s", tps),
                fmt_metric("scaling_efficiency", intra),
                fmt_value(None if inter is None else inter * 100, ".1f", "%"),
            ]
        )
    return md_table(
        [
            "Strategy",
            "GPUs",
            "Nodes",
            "Link",
            "Tokens/s",
            "Intra-node eff. (vs 1 GPU)",
            "Inter-node eff. (vs 1 full node)",
        ],
        rows,
    )
