"""Split a list of layers into contiguous virtual stages, and explain the split in a table.

Three methods (the ones DeepSpeed's PipelineModule offers): "uniform" (equal layer counts),
"parameters" (balance the parameter count), "type:<regex>" (balance the number of layers
whose class name matches the regex, e.g. "type:Block"); and a fourth: a list of numbers,
one cost per layer (measured or estimated time: an LM head with its loss costs more than a
block, an embedding lookup almost nothing). Balancing minimises the largest stage (the
pipeline runs at the pace of its slowest stage); every stage gets >= 1 layer. With costs
and more than one chunk per rank, boundaries then move a layer at a time while that
lowers the busiest rank's total (a rank runs all of its chunks: with the V placement rank 0
holds both the first and the last chunk).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from pipezero.checks import is_number
from pipezero.pipe.schedule.placement import owner
from pipezero.pipe.spec import count_parameters, layer_name

__all__ = ["partition", "partition_uniform", "partition_balanced", "balance_ranks", "partition_table"]


def partition_uniform(num_layers: int, num_parts: int) -> list[int]:
    """Boundaries (num_parts + 1 of them) giving each part num_layers // num_parts layers, +1 for the first ones."""
    _check_counts(num_layers, num_parts)
    base, extra = divmod(num_layers, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Contiguous boundaries minimising the heaviest part; every part non-empty.

    Dynamic programming over (parts, prefix): O(parts * layers^2), instant for the few
    hundred layers of a model. Ties go to the latest boundary, so layers of weight 0
    (norms, reshapes) join the part before them.
    """
    n = len(weights)
    _check_counts(n, num_parts)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal heaviest part when the first i layers form k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost <= best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def partition(layers: Sequence[Any], num_parts: int, method: str | Sequence[float],
              ranks: Sequence[int] | None = None) -> list[int]:
    """Boundaries for `layers` over `num_parts` virtual stages by `method`; `ranks[stage]`
    (the rank running each virtual stage) lets a list of costs balance the ranks too."""
    if isinstance(method, (list, tuple)):
        costs = _check_costs(method, len(layers))
        return balance_ranks(costs, partition_balanced(costs, num_parts), ranks or range(num_parts))
    if not isinstance(method, str):
        raise TypeError(f"partition_method={method!r}: expected 'parameters', 'uniform', 'type:<regex>' "
                        "or a list of per-layer costs")
    if method == "uniform":
        return partition_uniform(len(layers), num_parts)
    if method == "parameters":
        return partition_balanced([count_parameters(layer) for layer in layers], num_parts)
    if method.startswith("type:"):
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
        weights = [1 if pattern.search(layer_name(layer)) else 0 for layer in layers]
        if not any(weights):
            names = sorted({layer_name(layer) for layer in layers})
            raise ValueError(f"partition_method={method!r} matches none of the layer classes {names}; "
                             "fix the regex (it is searched in the class name, case-insensitively)")
        return partition_balanced(weights, num_parts)
    raise ValueError(f"partition_method={method!r} is unknown; use 'parameters', 'uniform', 'type:<regex>' "
                     "or a list of per-layer costs")


def balance_ranks(costs: Sequence[float], bounds: Sequence[int], ranks: Sequence[int]) -> list[int]:
    """Move boundaries by a layer (one, two, or a run of them) while that lowers (busiest
    rank's total, heaviest stage): a local search from the stage-balanced split."""
    unit = sum(costs) or 1.0

    def score(b: Sequence[int]) -> tuple:  # rank totals, busiest first, then the heaviest stage
        stages = [sum(costs[lo:hi]) for lo, hi in zip(b, b[1:])]
        per_rank: dict[int, float] = {}
        for rank, cost in zip(ranks, stages):
            per_rank[rank] = per_rank.get(rank, 0.0) + cost
        exact = lambda v: round(v / unit, 9)  # noqa: E731 - sums in another order are equal
        return tuple(sorted(map(exact, per_rank.values()), reverse=True)), exact(max(stages))

    def moves(b: list[int]):  # boundaries i and j one layer either way, or i..j all together
        inner = range(1, len(b) - 1)
        for i in inner:
            for j in (k for k in inner if k >= i):
                for di, dj, run in ((-1, -1, True), (1, 1, True), (-1, 1, False), (1, -1, False)):
                    trial = list(b)
                    for k in range(i, j + 1) if run else {i, j}:
                        trial[k] += di if k == i else dj
                    if all(lo < hi for lo, hi in zip(trial, trial[1:])):
                        yield trial

    bounds, best = list(bounds), score(bounds)
    improved = True
    while improved:
        improved = False
        for trial in moves(bounds):
            if (trial_score := score(trial)) < best:
                bounds, best, improved = trial, trial_score, True
                break
    return bounds


def _check_costs(costs: Sequence[Any], num_layers: int) -> list[float]:
    if len(costs) != num_layers:
        raise ValueError(f"partition_method has {len(costs)} costs for {num_layers} layers; give one per layer")
    bad = [c for c in costs if not is_number(c, minimum=0)]
    if bad or not any(costs):
        raise ValueError(f"partition_method costs must be finite numbers >= 0, not all 0; got {list(costs)!r}")
    return [float(c) for c in costs]


def partition_table(layers: Sequence[Any], bounds: Sequence[int], num_stages: int, placement: str,
                    my_rank: int | None = None) -> str:
    """One screen: each virtual stage, its rank and chunk, its layers and parameter count."""
    rows = ["stage  rank  chunk  layers      params  classes"]
    total = 0
    for stage in range(len(bounds) - 1):
        rank, chunk = owner(stage, num_stages, placement)
        lo, hi = bounds[stage], bounds[stage + 1]
        params = sum(count_parameters(layer) for layer in layers[lo:hi])
        total += params
        mark = "  <- me" if rank == my_rank else ""
        rows.append(f"{stage:>5}  {rank:>4}  {chunk:>5}  {f'{lo}-{hi - 1}':<9}  {params:>8,}  "
                    f"{_classes(layers[lo:hi])}{mark}")
    rows.append(f"total {len(layers)} layers, {total:,} parameters over {num_stages} ranks")
    return "\n".join(rows)


def _classes(layers: Sequence[Any]) -> str:
    """'Embedding, Block x3, Linear': runs of the same class collapsed."""
    runs: list[list] = []
    for layer in layers:
        name = layer_name(layer)
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    text = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in runs)
    return text if len(text) <= 48 else text[:45] + "..."


def _check_counts(num_layers: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"cannot split into {num_parts} stages: need at least one")
    if num_layers < num_parts:
        raise ValueError(f"{num_layers} layers cannot fill {num_parts} virtual stages (pipe x num_chunks): "
                         "each stage needs at least one layer; use fewer stages or chunks, or more layers")
