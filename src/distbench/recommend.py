"""Which strategy to train a model with on N GPUs: each candidate's largest micro-batch, ranked by throughput.

A candidate is a strategy with activation checkpointing off or on. For each, the search doubles the
micro-batch from 1 until a probe does not fit (out of memory, or less memory left than the headroom asked
for) or the ceiling is reached, then bisects between the last fit and the first miss, so the answer is the
exact largest fitting micro-batch unless the probe budget runs out first (then it is a lower bound, and
`capped` says so). Where the probes measured device memory, up to GUIDED_PROBES of them go where the peaks
of the two largest probes that ran, extended linearly, put the edge: on one H200 a doubling search spent 8-9
probes a candidate and was still cut short at GPT-2 Large's edge; the guesses only choose where to look, so
the answer stays exact whatever the memory does. A probe that fails for any other reason rules the candidate
out. The largest fit's own result is the candidate's evidence: its tokens/s and peak memory are what the
ranking uses.

For a cluster that is not here (`--predict`), nothing runs: each strategy's training state per GPU comes from
the memory model (`Predicted`), and those whose state fits rank by the memory they leave for activations.

No CLI and no training here: the search takes a `probe` callable (micro-batch -> result dict, the schema
results.py writes), so tests drive it with a made-up memory limit; commands/recommend.py supplies probes
that run the benchmark. `agreement` holds the ranking against a measured table (`distbench run`'s results)
at the same GPU count and says where and why the two order strategies differently.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30

#: A probe: benchmark one micro-batch size, return its result (status "ok", "oom" or "error").
Probe = Callable[[int], dict[str, Any]]


@dataclass(frozen=True)
class Candidate:
    """A strategy with activation checkpointing off or on; None: the strategy cannot run here at all."""

    strategy: str
    activation_checkpointing: bool | None

    @property
    def label(self) -> str:
        return self.strategy + (" +AC" if self.activation_checkpointing else "")


@dataclass(frozen=True)
class Headroom:
    """Device memory a fit must leave free: the larger of an absolute amount and a fraction of the GPU's."""

    bytes: int = 0
    fraction: float = 0.0

    def required(self, total: int) -> int:
        return max(self.bytes, int(self.fraction * total))

    def __str__(self) -> str:
        return f"{self.fraction:.0%} of device memory" if self.fraction else f"{self.bytes / GIB:.2f} GiB"


@dataclass
class Outcome:
    """One candidate's search: every probe's (micro-batch, result), the largest fit, or why it was ruled out."""

    candidate: Candidate
    probes: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    best: dict[str, Any] | None = None  # the result at the largest micro-batch that fit
    ruled_out: str | None = None  # why no micro-batch is recommended (None when best is set)
    capped: bool = False  # the probe budget ran out before the search closed: best is a lower bound

    @property
    def micro_batch(self) -> int | None:
        return self.best["config"]["micro_batch"] if self.best else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.best["metrics"].get("tokens_per_s") if self.best else None


def peak_bytes(result: dict[str, Any]) -> int | None:
    """The result's peak device memory: NVML's device-level use where sampled (it sees the CUDA context and
    NCCL's buffers, which torch's counters miss), else the allocator's reserved peak; None on CPU."""
    m = result.get("metrics") or {}
    return m.get("nvml_mem_used_peak_bytes") or m.get("mem_reserved_peak_bytes")


def total_bytes(result: dict[str, Any]) -> int | None:
    """The smallest GPU's memory among the result's ranks, on the scale peak_bytes uses: NVML's total beside
    NVML's peak (its "used" counts the driver's reservation, which torch's total leaves out: on an H200 a
    probe that ran read 140.05 GiB used of torch's 139.8), torch's beside the allocator's; None on CPU."""
    nvml = bool((result.get("metrics") or {}).get("nvml_mem_used_peak_bytes"))
    ranks = result.get("per_rank") or []
    totals = [r.get("nvml_mem_total_bytes") for r in ranks] if nvml else []
    if not totals or not all(totals):  # results from before NVML's total was kept: torch's
        totals = [r.get("mem_total_bytes") for r in ranks]
    known = [t for t in totals if t]
    return min(known) if known else None


def headroom_bytes(result: dict[str, Any]) -> int | None:
    """Device memory the configuration left unused on its fullest GPU (total minus peak), None when unknown."""
    peak, total = peak_bytes(result), total_bytes(result)
    return None if peak is None or total is None else total - peak


def error_line(result: dict[str, Any]) -> str:
    """The exception a failed probe raised ("Type: message", from the first failing rank's traceback), else
    the error's first line: what a ruled-out row shows."""
    lines = (result.get("error") or "").splitlines()
    ranks = [i for i, ln in enumerate(lines) if ln.startswith("===== rank ")]
    for start, end in zip(ranks, [*ranks[1:], len(lines)], strict=True):
        body = [ln.strip() for ln in lines[start + 1 : end] if ln.strip()]
        if body and "(" in lines[start]:  # a rank that raised, "===== rank 0: error (Type) ====="
            return body[-1]
    return lines[0] if lines else f"status {result.get('status')}"


def misfit(result: dict[str, Any], headroom: Headroom) -> str | None:
    """Why a probe that did not fail outright does not fit (out of memory, or less left than the headroom),
    None when it fits. Unknown memory (CPU) passes the headroom test: there is nothing to hold it against."""
    if result["status"] == "oom":
        return "out of memory"
    left, total = headroom_bytes(result), total_bytes(result)
    if left is not None and total is not None and left < headroom.required(total):
        return f"leaves {left / GIB:.2f} GiB free, less than the {headroom} headroom"
    return None


#: Probes per candidate placed at the edge the measured peaks predict; the rest double and bisect.
GUIDED_PROBES = 4
#: While no probe has missed, a guess goes at most this many times the largest fit (guesses from small
#: micro-batches, where fixed costs dominate the peak, can be far off).
GUIDED_REACH = 4


def predicted_edge(ran: list[tuple[int, dict[str, Any]]], headroom: Headroom) -> int | None:
    """The largest micro-batch whose peak stays within the device's memory less the headroom, extended
    linearly from the peaks of the two largest probes that ran; None where memory is unknown (CPU) or did
    not grow with the micro-batch."""
    known = sorted(
        (mb, peak, total)
        for mb, r in ran
        if r["status"] == "ok" and (peak := peak_bytes(r)) and (total := total_bytes(r))
    )
    if len(known) < 2:
        return None
    (m1, p1, _), (m2, p2, total) = known[-2:]
    if p2 <= p1:
        return None
    per_sample = (p2 - p1) / (m2 - m1)
    return m2 + math.floor((total - headroom.required(total) - p2) / per_sample)


def search(
    candidate: Candidate,
    probe: Probe,
    *,
    max_micro_batch: int,
    max_probes: int,
    headroom: Headroom = Headroom(),
    start: int = 1,
) -> Outcome:
    """The largest micro-batch up to `max_micro_batch` that fits, in at most `max_probes` probes: doubling
    from `start`, then bisecting between the last fit and the first miss, with up to GUIDED_PROBES probes
    at the edge the measured peaks predict instead. `start` skips the doubling a variant needing less
    memory has already done (activation checkpointing on after off)."""
    out = Outcome(candidate)
    fit, miss = 0, None  # largest micro-batch known to fit, smallest known not to
    guided = 0
    while len(out.probes) < max_probes:
        if not out.probes:
            mb = min(start, max_micro_batch)
        elif miss is None:
            if fit == max_micro_batch:
                break
            mb = min(2 * fit, max_micro_batch) if fit else 1
        elif miss - fit > 1:
            mb = (fit + miss) // 2
        else:
            break
        # a guess needs a peak it has not used yet (the last probe ran); while doubling, GUIDED_REACH x the fit
        fresh = out.probes and out.probes[-1][1]["status"] == "ok" and guided < GUIDED_PROBES
        guess = predicted_edge(out.probes, headroom) if fresh else None
        if guess is not None:
            top = max_micro_batch if miss is None else miss - 1
            reach = min(top, GUIDED_REACH * max(fit, 1)) if miss is None else top
            if fit < reach:
                mb = min(max(guess, fit + 1), reach)
                guided += guess <= reach  # a jump cut to the reach is a longer doubling, not a guess
        result = probe(mb)
        out.probes.append((mb, result))
        if result["status"] == "error":
            out.ruled_out = f"micro-batch {mb} failed: {error_line(result)}"
            out.best = None
            return out
        why = misfit(result, headroom)
        if why is None:
            fit, out.best = mb, result
        else:
            miss = mb
            if mb == 1:  # nothing smaller to try
                out.ruled_out = f"micro-batch 1 does not fit: {why}"
                return out
    out.capped = fit < max_micro_batch and (miss is None or miss - fit > 1)
    return out


def rank(outcomes: Iterable[Outcome]) -> list[Outcome]:
    """Fitting candidates first, fastest first (ties: less peak memory), then the ruled-out ones in the
    order they were given."""
    outcomes = list(outcomes)
    fitting = [o for o in outcomes if o.best is not None]
    fitting.sort(key=lambda o: (-(o.tokens_per_s or 0.0), peak_bytes(o.best or {}) or 0))
    return fitting + [o for o in outcomes if o.best is None]


def tokens_per_s_range(result: dict[str, Any]) -> tuple[float, float]:
    """A result's tokens/s at its p90 and p10 step times (its slowest and fastest usual steps)."""
    tps = float((result.get("metrics") or {}).get("tokens_per_s") or 0.0)
    st = result.get("step_time_s") or {}
    if not st.get("p10") or not st.get("p90"):
        return tps, tps
    return tps * st["median"] / st["p90"], tps * st["median"] / st["p10"]


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    (lo_a, hi_a), (lo_b, hi_b) = tokens_per_s_range(a), tokens_per_s_range(b)
    return lo_a <= hi_b and lo_b <= hi_a


def rivals(ranked: list[Outcome]) -> list[Outcome]:
    """The fitting candidates whose p10-p90 step-time range, as tokens/s, overlaps the top one's: with a few
    timed steps per probe their order behind the top is noise, not merit."""
    if not ranked or ranked[0].best is None:
        return []
    floor = tokens_per_s_range(ranked[0].best)[0]
    return [o for o in ranked[1:] if o.best is not None and tokens_per_s_range(o.best)[1] >= floor]


def table_rows(
    results: list[dict[str, Any]], gpus: int, found: dict[str, list[str]]
) -> dict[str, dict[str, Any]]:
    """A measured table's configurations at `gpus` GPUs, one run each (the fastest of its repeats), by
    strategy; with `flagged`: its warnings in `found` (plausibility.check of the table)."""
    rows: dict[str, dict[str, Any]] = {}
    for r in results:
        c = r.get("config") or {}
        if r.get("status") != "ok" or c.get("world_size") != gpus or c.get("activation_checkpointing"):
            continue
        tps = (r.get("metrics") or {}).get("tokens_per_s") or 0.0
        if tps > ((rows.get(c["strategy"]) or {}).get("metrics") or {}).get("tokens_per_s", 0.0):
            rows[c["strategy"]] = {**r, "flagged": found.get(r["id"], [])}
    return rows


def agreement(
    ranked: list[Outcome], results: list[dict[str, Any]], gpus: int, found: dict[str, list[str]]
) -> list[str]:
    """Whether recommend's order at `gpus` GPUs agrees with a measured table's (`results`, a `distbench run`,
    `found` its plausibility warnings), one line per pair of strategies both measured (checkpointing off)
    that the two order differently, with why: a flagged table figure, an order inside either's step-time
    spread, or micro-batches that differ (recommend measures each strategy at its largest, without
    accumulation; the table all at one)."""
    table = table_rows(results, gpus, found)
    mine = {
        o.candidate.strategy: o.best for o in ranked if o.best and not o.candidate.activation_checkpointing
    }
    both = [s for s in sorted(mine, key=lambda s: -float(mine[s]["metrics"]["tokens_per_s"])) if s in table]
    if len(both) < 2:
        return [
            f"nothing to compare: the table has {len(table)} strategy(ies) at {gpus} GPUs, {len(both)} of them here"
        ]
    lines = []
    for i, a in enumerate(both):
        for b in both[i + 1 :]:  # recommend has a above b
            ta, tb = (table[s]["metrics"]["tokens_per_s"] for s in (a, b))
            if ta >= tb:
                continue
            lines.append(
                f"{a} above {b} here, below it in the table ({ta:,.0f} vs {tb:,.0f}): {_why(a, b, mine, table)}"
            )
    top = both[0]
    head = max(table, key=lambda s: table[s]["metrics"]["tokens_per_s"])
    verdict = (
        f"agrees with the table at {gpus} GPUs: both put {top} first"
        if head == top and not lines
        else f"differs from the table at {gpus} GPUs in {len(lines)} pair(s); the table's fastest is {head}"
    )
    return [verdict, *lines]


def _why(a: str, b: str, mine: dict[str, Any], table: dict[str, dict[str, Any]]) -> str:
    flagged = [s for s in (a, b) if table[s]["flagged"]]
    if flagged:
        return f"the table's {', '.join(flagged)} figure is flagged ({table[flagged[0]]['flagged'][0].split(':')[0]})"
    if _overlap(table[a], table[b]):
        return "inside the table's step-time spread: its order is noise"
    if _overlap(mine[a], mine[b]):
        return "inside the step-time spread of recommend's probes: this order is noise"
    mb = {s: (mine[s]["config"]["micro_batch"], table[s]["config"]["micro_batch"]) for s in (a, b)}
    if any(here != there for here, there in mb.values()):
        return (
            f"different micro-batches: here {a} ran at {mb[a][0]} and {b} at {mb[b][0]} without accumulation, "
            f"the table at {mb[a][1]} and {mb[b][1]}"
        )
    return "the same micro-batches, outside both spreads: unexplained, rerun both"


def summary(outcomes: list[Outcome], evidence: dict[str, str]) -> list[dict[str, Any]]:
    """The ranked list as JSON (recommendation.json): each candidate's verdict and the result file behind every
    probe (`evidence` maps a result id to its file)."""
    rows = []
    for o in outcomes:
        best = o.best or {}
        peak, left = peak_bytes(best), headroom_bytes(best)
        rows.append(
            {
                "strategy": o.candidate.strategy,
                "activation_checkpointing": o.candidate.activation_checkpointing,
                "micro_batch": o.micro_batch,
                "tokens_per_s": o.tokens_per_s,
                "peak_bytes": peak,
                "headroom_bytes": left,
                "fits": o.best is not None,
                "ruled_out": o.ruled_out,
                "capped": o.capped,
                "evidence": evidence.get(best["id"]) if best else None,
                "probes": [
                    {"micro_batch": mb, "status": r["status"], "file": evidence.get(r["id"])}
                    for mb, r in o.probes
                ],
            }
        )
    return rows


@dataclass(frozen=True)
class Predicted:
    """A strategy's training state per GPU of a cluster, predicted by the memory model (invariants/memory.py),
    or why it cannot run there. `offload`: its state lives in host memory (none on the GPU)."""

    strategy: str
    state: dict[str, float] = field(default_factory=dict)  # device bytes of params, grads, optimizer
    ruled_out: str | None = None
    offload: bool = False

    @property
    def state_bytes(self) -> float:
        return sum(self.state.values())


def predicted_misfit(p: Predicted, gpu_bytes: int, headroom: Headroom) -> str | None:
    """Why the state does not fit a GPU of `gpu_bytes` with the headroom left free; None when it does."""
    room = gpu_bytes - headroom.required(gpu_bytes)
    if p.state_bytes <= room:
        return None
    return f"needs {p.state_bytes / GIB:.2f} GiB a GPU, more than {room / GIB:.2f} GiB" + (
        f" (the GPU's less the {headroom} headroom)" if room < gpu_bytes else ""
    )


def rank_predicted(predicted: Iterable[Predicted], gpu_bytes: int, headroom: Headroom) -> list[Predicted]:
    """Those that fit first: state kept on the GPUs before offload (its host traffic costs throughput), each
    by the most memory left for activations (the largest micro-batch, which the measured search looks for);
    then those that do not fit, nearest first; then the ruled-out ones, in the order given."""
    predicted = list(predicted)
    runs = [p for p in predicted if p.ruled_out is None]
    fits = [p for p in runs if predicted_misfit(p, gpu_bytes, headroom) is None]
    misses = [p for p in runs if p not in fits]
    return sorted(fits, key=_by_state) + sorted(misses, key=_by_state) + [p for p in predicted if p.ruled_out]


def _by_state(p: Predicted) -> tuple[bool, float]:
    return p.offload, p.state_bytes
