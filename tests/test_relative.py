"""The nightly measured against a frozen reference (gate/relative.py, `distbench nightly`) and its history on
ratios (history/series.py's from_nights): on a host whose speed flips and then changes mid-run, a ratio keeps
still where both sides are slowed alike, a slowdown of one side is found at its commit, and a change of reference
is carried across without a step. Synthetic servers play gate/ab.py's protocol, so each case takes under a
second; the real processes run in the slow tier."""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distbench.cli import main
from distbench.config import RunConfig
from distbench.gate import ab as gate_ab
from distbench.gate import relative, stats
from distbench.gate.relative import SCHEMA, Bridge, Night, NightRow, Reference, load_night, save_night
from distbench.history import report
from distbench.history.series import from_nights
from extras import need


@pytest.fixture(autouse=True, scope="module")
def history_extra() -> None:
    """The ratio series' change points are ruptures' search (the history extra, which `.[test]` brings)."""
    need("ruptures")


#: fsdp_full at one rank on GPT-2 124M: a host-bound row (device busy 0.67-0.85 on one H200)
CFG = RunConfig(
    strategy="fsdp_full",
    world_size=1,
    model="gpt2-124m",
    precision="bf16-amp",
    micro_batch=8,
    global_batch=8,
    steps=20,
    windows=10,
    warmup=5,
    deterministic=False,
)


class Host:
    """Two variants' servers on one host: its speed flips between a fast and a slow state (x1.7, each for
    0.1-2 s, as one H200 VM's vCPUs did), and from `slow_at` seconds on the whole host is `slow_by` slower
    (a neighbour moved in). A step costs `step_s` x the host's speed now x the process's bias, x (1 + effect)
    on the slowed `side`. It plays gate/ab.py's Servers (interleaved windows) and, through `run`, whole runs."""

    def __init__(self, rng: np.random.Generator, effect: float = 0.0, side: str = "head") -> None:
        self.rng, self.effect, self.side = rng, effect, side
        self.step_s, self.now = 0.05, 0.0
        self.slow_at, self.slow_by = math.inf, 1.0
        self.state_until, self.state = 0.0, 1.0
        self.bias: dict[str, float] = {}
        self.walls: dict[str, list[float]] = {}
        self.pending: dict[str, dict] = {}

    def _speed(self) -> float:
        if self.now >= self.state_until:
            self.state_until = self.now + self.rng.uniform(0.1, 2.0)
            self.state = 1.7 if self.rng.random() < 0.5 else 1.0
        return self.state * (self.slow_by if self.now >= self.slow_at else 1.0)

    def _steps(self, side: str, n: int) -> float:
        total = 0.0
        for _ in range(n):
            dt = self.step_s * self._speed() * self.bias[side] * (1 + self.effect if side == self.side else 1)
            dt *= math.exp(self.rng.normal(0, 0.002))
            self.now += dt
            total += dt
        return total / n

    def _result(self, side: str, walls: list[float]) -> dict:
        st = float(np.median(walls))
        return {
            "status": "ok",
            "schema": "distbench.result/1",
            "id": f"{side}-{self.rng.integers(1 << 30)}",
            "metrics": {"step_time_s": st, "tokens_per_s": 8192 / st},
            "regime": {"regime": "host-bound", "busy_ratio": 0.7},
        }

    def post(self, side: str, request: dict) -> None:
        if request["op"] == "setup":
            self.bias[side] = math.exp(self.rng.normal(0, 0.005))
            self.walls[side] = []
            self.now += 15.0
            self.pending[side] = {"status": "ok"}
        elif request["op"] == "window":
            wall = self._steps(side, request["steps"])
            self.walls[side].append(wall)
            self.pending[side] = {"status": "ok", "step_s": wall}
        else:
            self.pending[side] = self._result(side, self.walls.pop(side))

    def reply(self, side: str) -> dict:
        return self.pending.pop(side)

    def run(self, side: str) -> dict:
        """A whole run: a build, then its windows back to back."""
        self.bias[side] = math.exp(self.rng.normal(0, 0.005))
        self.now += 15.0
        return self._result(side, [self._steps(side, CFG.steps // CFG.windows) for _ in range(CFG.windows)])


def commit(i: int) -> str:
    return f"{i + 1:02x}" * 20


def night(i: int, rows: list[NightRow], ref: str = "ref-a", bridge: Bridge | None = None) -> Night:
    return Night.model_validate(
        {
            "schema": SCHEMA,
            "created": f"2026-12-{i + 1:02d}T02:00:00+00:00",
            "commit": commit(i),
            "head": "this checkout",
            "reference": Reference(spec=f"tree=/refs/{ref}", describe=ref, id=ref),
            "pairs": relative.PAIRS,
            "alpha": 0.05,
            "budget_s": 600,
            "elapsed_s": 100,
            "rows": rows,
            "bridge": bridge,
        }
    )


def nights(tmp_path: Path, host: Host, n: int, *, slowed_from: int | None = None, servers: bool = True,
           host_slows_at: int | None = None) -> list[Night]:  # fmt: skip
    """`n` nights of CFG on `host`, saved under tmp_path/night-i; from night `slowed_from` on, the host's
    `side` is 3% slower; during night `host_slows_at` the whole host becomes 1.5x slower, mid-run."""
    out = []
    effect = host.effect
    for i in range(n):
        host.effect = effect if slowed_from is not None and i >= slowed_from else 0.0
        if host_slows_at == i:
            host.slow_at, host.slow_by = host.now + 40.0, 1.5  # in the night's third pair
        rows = relative.measure(
            [CFG],
            lambda c: host.run("base"),
            lambda c: host.run("head"),
            servers=host if servers else None,
        )
        out.append(night(i, rows))
        save_night(out[-1], tmp_path / f"night-{i:02d}")
    return out


def series_of(tmp_path: Path) -> dict[str, object]:
    return {s.label: s for s in from_nights([tmp_path])}


RATIO = "step_time_s head/reference fsdp_full ws1 gpt2-124m bf16-amp mb8"
ABSOLUTE = "step_time_s head fsdp_full ws1 gpt2-124m bf16-amp mb8 (nightly)"


def check_both_slowed_alike_keep_the_ratio(tmp_path: Path, servers: bool = True) -> None:
    """A/A nights on a host that flips and, in night 6, becomes 1.5x slower mid-run: every night's ratio
    within 2% of 1 (the host-bound target), and no change point in the ratios, where the absolute figures of
    the same runs moved by over 30%."""
    ns = nights(tmp_path, Host(np.random.default_rng(5)), 12, host_slows_at=6, servers=servers)
    ratios = [n.rows[0].ratios["step_time_s"].ratio for n in ns]
    assert all(abs(r - 1) < 0.02 for r in ratios), ratios
    s = series_of(tmp_path)
    found = report.analyse([s[RATIO]], alpha=0.01)
    assert not found, [report.describe(f) for f in found]
    absolute = [p.value for p in s[ABSOLUTE].points]
    assert max(absolute) / min(absolute) > 1.3  # the same runs' absolute figures moved with the host


def check_one_side_slowed_is_found(tmp_path: Path, side: str = "head") -> None:
    """Head 3% slower from night 7 on, on the same flipping host (slowed by half in night 4, both sides): the
    ratio series has a regression between nights 6 and 7, with an interval that holds 3%. (Seven nights a
    side: on ranks, a split's least-squares gain favours the middle, so in 8 + 6 nights the last good night,
    when it is the highest of its seven, is placed after the change.)"""
    nights(tmp_path, Host(np.random.default_rng(7), 0.03, side), 14, slowed_from=7, host_slows_at=4)
    found = report.analyse([series_of(tmp_path)[RATIO]], alpha=0.01)
    assert len(found) == 1, [report.describe(f) for f in found]
    (f,) = found
    assert f.worse and (f.last_good.commit, f.first_bad.commit) == (commit(6), commit(7)), report.describe(f)
    assert f.change.low < 1.03 < f.change.high
    argv = report.bisect_argv(f, None, "o", [])
    assert argv[:6] == ["distbench", "bisect", "--good", commit(6), "--bad", commit(7)]


def test_both_sides_slowed_alike_leave_the_ratio_unchanged(tmp_path):
    check_both_slowed_alike_keep_the_ratio(tmp_path)


def test_one_side_slowed_is_found_at_its_commit(tmp_path):
    check_one_side_slowed_is_found(tmp_path)


def test_the_checks_fail_on_planted_defects(tmp_path):
    """Whole runs instead of interleaved windows (each side's steps at another moment of the host's): the
    ratio moves with the host. The slowdown planted on the reference's side (a ratio the wrong way round):
    found, but as an improvement."""
    with pytest.raises(AssertionError):
        check_both_slowed_alike_keep_the_ratio(tmp_path / "runs", servers=False)
    with pytest.raises(AssertionError):
        check_one_side_slowed_is_found(tmp_path / "swapped", side="base")


def _row(ratio: float, *, head: float = 0.1) -> NightRow:
    r = relative.Ratio(ratio=ratio, low=ratio * 0.995, high=ratio * 1.005, level=0.95, gated=True,
                       verdict=stats.UNCHANGED, pairs=[ratio] * 6)  # fmt: skip
    return NightRow(label="x", config=CFG.to_dict(), pairs=6, interleave="windows",
                    head={"step_time_s": head}, reference={"step_time_s": head / ratio},
                    ratios={"step_time_s": r})  # fmt: skip


def _switch(tmp_path: Path, bridge_ratio: float | None) -> list:
    """12 nights of a head that does not change (ratio 1.00 +- 0.3%) against reference a, then from night 12
    against reference b, 10% faster than a (the ratio reads 1.10); night 12's bridge measured b / a."""
    rng = np.random.default_rng(2)
    for i in range(20):
        noise = math.exp(rng.normal(0, 0.003))
        if i < 12:
            n = night(i, [_row(noise)])
        else:
            bridge = None
            if i == 12 and bridge_ratio is not None:
                bridge = Bridge(previous=Reference(spec="tree=/refs/ref-a", describe="ref-a", id="ref-a"),
                                rows=[_row(bridge_ratio)])  # fmt: skip
            n = night(i, [_row(1.10 * noise)], ref="ref-b", bridge=bridge)
        save_night(n, tmp_path / f"night-{i:02d}")
    return [s for s in from_nights([tmp_path]) if s.ratio]


def test_a_change_of_reference_is_carried_across_without_a_step(tmp_path):
    """The night the reference changes measured the new against the old (0.909 = 1 / 1.10): the series is
    chained, ratio head/new x new/old, and has no change point; without a bridge it is two series, neither
    with a step. A chain that ignored the bridge (a bridge of 1.0) shows the 10% step: what the first check
    catches."""
    (chained,) = _switch(tmp_path / "bridged", 1 / 1.10)
    assert len(chained.points) == 20 and report.analyse([chained], alpha=0.01) == []
    assert all(abs(p.value - 1) < 0.02 for p in chained.points)
    split = _switch(tmp_path / "unbridged", None)
    assert [len(s.points) for s in split] == [12, 8] and "since reference ref-b" in split[1].label
    assert all(report.analyse([s], alpha=0.01) == [] for s in split)
    (ignored,) = _switch(tmp_path / "ignored", 1.0)
    (step,) = report.analyse([ignored], alpha=0.01)
    assert (step.last_good.commit, step.first_bad.commit) == (commit(11), commit(12))


def test_a_night_file_is_validated_and_named_when_damaged(tmp_path):
    n = night(0, [_row(1.0)])
    path = save_night(n, tmp_path)
    assert load_night(path) == n
    data = json.loads(path.read_text())
    data["rows"][0]["ratios"]["step_time_s"]["ratio"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(
        relative.NightFileError, match=r"night.json is a damaged distbench.night/1 file: rows"
    ):
        load_night(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(relative.NightFileError, match="no night.json under .*distbench nightly -o DIR"):
        relative.find_nights([tmp_path / "empty"])


def test_nights_are_found_oldest_first_whatever_their_folders_are_called(tmp_path):
    """A night's order is when it ran, not its folder's name: a runner's folders may be named by anything."""
    for name, i in (("a", 2), ("b", 0), ("c", 1)):
        save_night(night(i, [_row(1.0)]), tmp_path / name)
    found = relative.find_night_files([tmp_path])
    assert [(f.parent.name, n.commit) for f, n in found] == [
        ("b", commit(0)),
        ("c", commit(1)),
        ("a", commit(2)),
    ]
    assert relative.find_nights([tmp_path]) == [n for _, n in found]


class FakeVariant:
    """gate/variants.py's VariantProcess without a process: both variants' servers on one `Host`, the head
    `HEAD_EFFECT` slower; a reference whose interpreter is missing never gets here (parse_variant refuses it)."""

    host: Host
    started: list[str] = []

    def __init__(self, variant, workdir, device_type, log_dir) -> None:
        self.variant, self.log = variant, Path(log_dir) / f"{variant.label}.log"
        self.info: dict = {}
        self.reply_: dict | None = None

    @property
    def protocol(self) -> int:
        return 3

    def start(self) -> None:
        FakeVariant.started.append(self.variant.describe())
        self.info = {"ready": True, "protocol": 3}

    def send(self, request: dict) -> bool:
        side = self.variant.label
        self.host.post(side, request)
        self.reply_ = self.host.reply(side)
        return True

    def receive(self, timeout: float) -> dict | None:
        return self.reply_

    def run(self, cfg: dict, timeout: float) -> dict:
        return self.host.run(self.variant.label)

    def recycle(self) -> None:
        pass

    def close(self) -> None:
        pass

    def remove_checkout(self) -> None:
        pass


@pytest.fixture
def fake_servers(monkeypatch):
    from distbench.gate import variants

    FakeVariant.host, FakeVariant.started = Host(np.random.default_rng(11)), []
    monkeypatch.setattr(variants, "VariantProcess", FakeVariant)
    monkeypatch.setenv("DISTBENCH_BIND_CPUS", "")  # registered, so what run() sets is undone after the test
    return FakeVariant


ARGS = ["nightly", "--device", "cpu", "-s", "ddp", "-n", "1", "--pairs", "3"]


def test_the_command_stores_ratios_beside_both_sides_absolute_figures(tmp_path, fake_servers):
    out = tmp_path / "nights" / "1"
    assert main([*ARGS, "--reference", f"tree={Path.cwd()}", "-o", str(out)]) == 0
    n = load_night(out / "night.json")
    (row,) = n.rows
    assert row.pairs == 3 and row.interleave == "windows" and row.failed is None
    r = row.ratios["step_time_s"]
    assert r.gated and len(r.pairs) == 3 and r.low <= r.ratio <= r.high
    # each pair's windows are kept, and the pair's ratio is their trimmed mean (what a night's spread within
    # and between pairs is read from)
    played = RunConfig.from_dict(row.config)
    # 30 windows of 2 steps by default: on one H200 a lone host-bound row's A/A nights spread 3.6% at 10, 1.2% at 30
    assert (played.windows, played.steps, played.warmup) == (30, 60, 5)
    assert [len(w) for w in r.windows] == [len(played.window_steps)] * 3
    trimmed = stats.round_log_ratios([[math.log(x) for x in w] for w in r.windows])
    assert np.allclose(np.exp(trimmed), r.pairs) and len({round(x, 12) for x in r.windows[0]}) > 1
    assert all(not x.windows for k, x in row.ratios.items() if k != "step_time_s")
    assert row.head["step_time_s"] > 0 and row.reference["step_time_s"] > 0
    assert n.reference.id and n.bridge is None and not n.reference_error
    assert list((out / "runs" / "head").glob("*.json")) and list((out / "runs" / "base").glob("*.json"))
    # the next night against another reference measures the new one against the old first
    out2 = tmp_path / "nights" / "2"
    assert main([*ARGS, "--reference", f"tree={Path.cwd()},env.X=1", "-o", str(out2)]) == 0
    n2 = load_night(out2 / "night.json")
    assert n2.reference.id != n.reference.id and n2.bridge is not None
    assert n2.bridge.previous == n.reference and n2.bridge.rows[0].ratios["step_time_s"].pairs


def test_a_reference_that_cannot_start_is_named_and_heads_figures_are_stored(tmp_path, fake_servers, capsys):
    out = tmp_path / "night"
    missing = tmp_path / "deleted-venv" / "bin" / "python"
    assert main([*ARGS, "--reference", f"python={missing}", "-o", str(out)]) == 3
    n = load_night(out / "night.json")
    assert n.reference_error and str(missing) in n.reference_error and "cannot start" in n.reference_error
    (row,) = n.rows
    assert row.interleave == "none" and row.pairs == 3 and not row.ratios and row.head["step_time_s"] > 0
    said = "".join(capsys.readouterr().out.split())  # as the console wrapped it
    assert str(missing) in said and "head'sabsolutefiguresarestored" in said


def test_a_reference_whose_server_does_not_start_is_named_too(tmp_path, fake_servers, monkeypatch):
    """A reference whose interpreter exists but whose import crashes: VariantStartError, the night goes on."""
    from distbench.gate.variants import VariantStartError

    def start(self) -> None:
        if self.variant.label == "base":
            raise VariantStartError("base", "variant base (python=/x) did not start: ImportError: torch")
        self.info = {"ready": True, "protocol": 3}

    monkeypatch.setattr(FakeVariant, "start", start)
    out = tmp_path / "night"
    assert main([*ARGS, "--reference", f"tree={Path.cwd()}", "-o", str(out)]) == 3
    n = load_night(out / "night.json")
    assert "ImportError: torch" in (n.reference_error or "") and n.rows[0].head["step_time_s"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pairs", "2"], "--pairs must be at least 3"),
        (["--alpha", "0.7"], "--alpha must be between 0 and 0.5"),
        (["--head", "rev=x,tree=y"], "holds no src/distbench"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(tmp_path, argv, message, capsys):
    assert main(["nightly", "--device", "cpu", "-s", "ddp", "-n", "1", "--reference", "", *argv,
                 "-o", str(tmp_path)]) == 2  # fmt: skip
    assert message in capsys.readouterr().out


def test_the_night_plays_the_gate_fixed_pairs_without_an_early_stop(monkeypatch):
    """A night asks run_ab for min = max = `pairs`, so no row stops when it is decided."""
    seen = {}
    real = gate_ab.run_ab

    def spy(*a, **k):
        seen.update(k)
        return real(*a, **k)

    monkeypatch.setattr(relative, "run_ab", spy)
    host = Host(np.random.default_rng(1), 0.2)  # a 20% slowdown: decided after 3 pairs by the gate
    (row,) = relative.measure([CFG], lambda c: host.run("base"), lambda c: host.run("head"), servers=host)
    assert seen["min_pairs"] == seen["max_pairs"] == relative.PAIRS and row.pairs == relative.PAIRS


def test_asv_keeps_each_pairs_ratio_and_history_reads_it_as_a_ratio_series(tmp_path, monkeypatch):
    """benchmarks/bench_relative.py records a night's ratios as asv samples (one per pair), skipped without a
    night; asv's own Results code stores them, and from_asv reads them back as a ratio series whose change
    points are found like an absolute one's."""

    from distbench.history.series import from_asv

    results, runner = need("asv.results"), need("asv.runner")

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    try:
        bench = importlib.import_module("benchmarks.bench_relative")
    finally:
        sys.path.remove(str(root))
    with pytest.raises(NotImplementedError, match="no night"):
        bench.Relative().setup(bench.setup_cache(), "fsdp_full", 1)
    ratios = [1.0, 1.003, 0.998, 1.001, 0.999, 1.002, 1.0, 0.997, 1.031, 1.029, 1.033, 1.03, 1.028, 1.032]
    machine = tmp_path / "results"
    for i, ratio in enumerate(ratios):
        path = save_night(night(i, [_row(ratio)]), tmp_path / f"night-{i:02d}")
        monkeypatch.setenv(bench.ENV, str(path))
        cache = bench.setup_cache()
        track = bench.Relative()
        track.setup(cache, "fsdp_full", 1)
        got = track.track_step_time_s(cache, "fsdp_full", 1)
        assert got == {"samples": [ratio] * 6, "number": 1}
        with pytest.raises(NotImplementedError):
            track.track_host_instructions(cache, "fsdp_full", 1)  # not in this night
        r = results.Results(
            {"machine": "h200"}, {}, commit(i), 1_700_000_000_000 + i * 86_400_000, "3.11", "e", {}
        )
        res = runner.BenchmarkResult(result=[got["samples"][0]], samples=[got["samples"]], number=[1], errcode=0,
                                     stderr="", profile=None)  # fmt: skip
        bm = {
            "name": "bench_relative.Relative.track_step_time_s",
            "params": [["'fsdp_full'"], ["1"]],
            "version": "1",
        }
        r.add_result(bm, res)
        r.save(str(machine))
    (machine / "h200" / "machine.json").write_text('{"machine": "h200", "version": 1}')
    (s,) = from_asv(machine)
    assert s.ratio and s.unit == "x reference" and s.metric == "step_time_s"
    (f,) = report.analyse([s], alpha=0.01)
    assert f.worse and f.first_bad.commit == commit(8) and "side by side" in report.describe(f)


@pytest.mark.slow  # two servers, fresh gloo ranks for each of 3 pairs, then head alone: 7 min on 2 loaded cores
def test_a_real_night_on_gloo_and_one_whose_reference_venv_was_deleted(tmp_path, monkeypatch):
    """Through real processes: an A/A night stores a ratio with its interval beside both sides' figures; a
    night whose reference virtualenv was deleted names its interpreter and still stores head's figures."""

    monkeypatch.setenv("DISTBENCH_BIND_CPUS", "")
    root = Path(__file__).resolve().parents[1]
    workload = ["--device", "cpu", "-s", "ddp", "-n", "1", "-m", "gpt2-tiny", "--precision", "fp32",
                "--micro-batch", "2", "--steps", "4", "--windows", "2", "--warmup", "1", "--pairs", "3"]  # fmt: skip
    assert main(["nightly", *workload, "--reference", f"tree={root}", "-o", str(tmp_path / "n1")]) == 0
    (row,) = load_night(tmp_path / "n1" / "night.json").rows
    r = row.ratios["step_time_s"]
    assert (
        row.pairs == 3
        and r.low < r.ratio < r.high
        and row.head["step_time_s"] > 0 < row.reference["step_time_s"]
    )
    venv = tmp_path / "ref-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    assert python.exists()
    shutil.rmtree(venv)
    assert main(["nightly", *workload, "--reference", f"python={python}", "-o", str(tmp_path / "n2")]) == 3
    n = load_night(tmp_path / "n2" / "night.json")
    assert (
        str(python) in (n.reference_error or "")
        and n.rows[0].head["step_time_s"] > 0
        and not n.rows[0].ratios
    )


def _planted_src(tmp_path: Path, plant: str) -> Path:
    """A copy of this checkout's src/ under tmp_path with scripts/plants/PLANT.patch applied, as the GPU
    script's revision 1 is made."""
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    patch = root / "scripts" / "plants" / f"{plant}.patch"
    subprocess.run(["patch", "-sp1", "-i", str(patch)], cwd=tmp_path, check=True)
    return tmp_path / "src"


def test_the_gpu_scripts_host_plant_applies_and_sits_on_the_optimizer_steps_path(tmp_path):
    """scripts/plants/host-step-3pct.patch still applies to this checkout's trainer, and its busy loop runs
    right before the optimizer step (on the critical path of a host-bound step)."""
    text = (_planted_src(tmp_path, "host-step-3pct") / "distbench" / "strategies" / "base.py").read_text()
    assert "_planted_step_spin(self)\n        self.optimizer_step()" in text


BLOCK_PLANT = """
import time
from torch import nn
from distbench.strategies import base

class Trainer:  # what the plant reads of a trainer: the module it trains
    def __init__(self, model):
        self.model = model

    def trained_module(self):
        return self.model

blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
trainer = Trainer(nn.Sequential(nn.Linear(2, 2), blocks))
x = nn.Parameter(nn.init.ones_(nn.Linear(2, 2).weight))

def forward_s():
    t0 = time.perf_counter()
    for b in blocks:
        b(x)
    return time.perf_counter() - t0

base._planted_block_spin(trainer)  # step 1: one forward of each block
one = forward_s()
base._planted_block_spin(trainer)  # step 2: two micro-batches' forwards
two = forward_s() + forward_s()
base._planted_block_spin(trainer)  # step 3: spread over the 8 block forwards step 2 ran
print(one, two, forward_s() + forward_s())
"""


@pytest.mark.slow  # a Python process that imports torch: ~4 s on 2 cores
def test_the_forward_plant_applies_and_spins_its_share_of_the_period_over_the_blocks(tmp_path):
    """scripts/plants/host-forward.patch still applies to this checkout's trainer, runs at each step's start,
    and makes the forward of the model's repeated blocks (nn.ModuleList members) spin, together, its share of
    the given period each step: share 0.25 of 0.2 s is 50 ms over the 4 blocks, then over the 8 block forwards
    of a step of two micro-batches once it has seen one. Without the period it refuses to run, saying why."""
    src = _planted_src(tmp_path, "host-forward")
    text = (src / "distbench" / "strategies" / "base.py").read_text()
    assert 'step."""\n        _planted_block_spin(self)\n        total = torch.zeros(' in text
    env = {**os.environ, "PYTHONPATH": str(src), "DISTBENCH_PLANT_SHARE": "0.25"}
    env.pop("DISTBENCH_PLANT_PERIOD_S", None)
    run = [sys.executable, "-c", BLOCK_PLANT]
    refused = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "needs DISTBENCH_PLANT_PERIOD_S" in refused.stderr, refused.stderr[
        -2000:
    ]
    got = subprocess.run(
        run,
        env={**env, "DISTBENCH_PLANT_PERIOD_S": "0.2"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    steps = list(map(float, got.stdout.split()))
    assert 0.05 <= steps[0] < 0.08 and 0.1 <= steps[1] < 0.15 and 0.05 <= steps[2] < 0.08, steps  # busy cores


@pytest.mark.slow  # one gpt2-tiny rank on gloo, 3 shares x 8 rounds of 2-step windows: ~12 s on 2 idle cores
@pytest.mark.nightly  # its pinned rank shares a core with whatever else runs: on 2 busy cores the spin reads wrong
def test_the_plant_sizer_measures_the_period_and_a_share_that_slows_a_host_bound_step(tmp_path):
    """scripts/plant_size.py over host-forward on CPU, where the host is the whole step: the period it writes
    is the step without the plant, and the plant's slowdown grows with its share, near the share itself (every
    spin lies on the critical path; 0.23 and 0.96 for shares 0.25 and 1 on an idle machine), so the share it
    picks for a 50% slowdown lies between the two tried."""
    env = {**os.environ, "PYTHONPATH": str(_planted_src(tmp_path, "host-forward"))}
    flags = "-m gpt2-tiny --precision fp32 --micro-batch 2 --device cpu --warmup 4".split()
    script = Path(__file__).resolve().parents[1] / "scripts" / "plant_size.py"
    sizer = [sys.executable, str(script), str(tmp_path / "out"), *flags]
    got = subprocess.run(
        [*sizer, "--shares", "0,0.25,1", "--rounds", "8", "--target", "0.5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    record = json.loads((tmp_path / "out" / "plant-size.json").read_text())
    period = float((tmp_path / "out" / "plant-period-s").read_text())
    assert period == pytest.approx(record["period_s"], rel=1e-4)
    assert 0.5 < period / (record["step_ms_at_share_0"] / 1000) < 2
    slow = record["slowdown"]
    assert slow[0] == 0 and 0.05 < slow[1] < slow[2] and 0.4 < slow[2] < 3, slow
    assert 0.25 < float((tmp_path / "out" / "plant-share").read_text()) < 1


def test_a_references_id_follows_its_commit_interpreter_and_environment():
    """Two nights share a reference id only when they were measured against the same code, interpreter and
    environment; an empty spec (this checkout) is identified by its commit, so it changes with every commit."""
    from distbench.gate.variants import parse_variant

    def rid(spec: str) -> str:
        return relative.reference_id(parse_variant("base", spec), spec)

    assert rid("rev=HEAD") == rid("rev=HEAD") == rid("")
    assert len({rid("rev=HEAD"), rid("rev=HEAD~1"), rid("rev=HEAD,env.X=1")}) == 3


def test_a_night_on_a_gpu_runs_no_numerics(tmp_path, fake_servers, monkeypatch):
    """On a GPU the gate's servers first take the numerics' GPU workload, which reads workload flags a night's
    flags do not have: a night there must ask for no numerics at all (it raised AttributeError on one H200)."""
    from distbench.runtime import pool

    monkeypatch.setattr(pool, "cuda_device_count", lambda: 1)
    out = tmp_path / "night"
    argv = [a if a != "cpu" else "cuda" for a in ARGS]
    assert main([*argv, "-m", "gpt2-tiny", "--reference", f"tree={Path.cwd()}", "-o", str(out)]) == 0
    (row,) = load_night(out / "night.json").rows
    assert row.pairs == 3 and row.ratios["step_time_s"].pairs


def _spread_row(label: str, logs: list[float], regime: str = "host-bound") -> NightRow:
    """A night's row whose pairs' step-time ratios are exp(logs)."""
    ratio = relative.Ratio(
        ratio=1.0,
        low=0.99,
        high=1.01,
        level=0.95,
        gated=True,
        verdict="UNCHANGED",
        pairs=[math.exp(x) for x in logs],
    )
    return NightRow(
        label=label,
        config=CFG.to_dict(),
        pairs=len(logs),
        interleave="windows",
        regime=regime,
        ratios={"step_time_s": ratio},
    )


def test_a_row_gets_the_pairs_its_spread_over_the_last_nights_needs():
    """allot: the pairs' log ratios about their own night's mean, pooled over the nights: squares 0.0010125 +
    0.0008 over 2 degrees of freedom, sd 0.0301, so a host-bound row needs (2 x 0.0301 / 0.02)^2 = 9.06 -> 10
    pairs (about the mean of all four it would be 0.0390 and 15, capped at 12). The same spread in a
    device-bound row (bound 1%) is capped at the most; a steady row, a row no night measured and one measured
    with a single pair get the least; nights before the last ALLOT_NIGHTS do not count."""
    a = [
        _spread_row("noisy", [0.045, 0.0]),
        _spread_row("steady", [0.001, -0.001]),
        _spread_row("device", [0.045, 0.0], "device-bound"),
        _spread_row("single pair", [0.3]),
    ]
    b = [_spread_row("noisy", [-0.01, -0.05]), _spread_row("device", [-0.01, -0.05], "device-bound")]
    got = relative.allot(
        ["noisy", "steady", "device", "single pair", "new"], [night(0, a), night(1, b)], 4, 12
    )
    assert got == {"noisy": 10, "steady": 4, "device": 12, "single pair": 4, "new": 4}
    # (2 x 0.0255 / 0.02)^2 = 6.5 -> 7 pairs, one order played once more than the other: 8; an odd cap holds
    odd = [night(0, [_spread_row("seven", [0.018, -0.018])])]
    assert relative.allot(["seven"], odd, 4, 12) == {"seven": 8}
    assert relative.allot(["seven"], odd, 4, 7) == {"seven": 7}
    old = [night(0, a), *(night(i, []) for i in range(1, relative.ALLOT_NIGHTS + 1))]
    assert relative.allot(["noisy"], old, 4, 12) == {"noisy": 4}


def test_a_night_plays_each_row_its_own_pairs():
    """measure with a quota: each configuration plays its own number of pairs, the others --pairs."""
    host = Host(np.random.default_rng(2))
    other = CFG.replace(strategy="ddp")
    rows = relative.measure(
        [CFG, other],
        lambda c: host.run("base"),
        lambda c: host.run("head"),
        servers=host,
        pairs=3,
        quota={gate_ab.label_of(CFG): 5},
    )
    assert [r.pairs for r in rows] == [5, 3]
    assert [len(r.ratios["step_time_s"].pairs) for r in rows] == [5, 3]


def test_the_command_gives_a_row_whose_pairs_spread_more_pairs(tmp_path, fake_servers, capsys):
    """`distbench nightly` reads the earlier nights beside --output: after a night whose pairs spread 3%, the
    next gives the row (2 x 0.03 / 0.02)^2 = 9 -> up to --max-pairs 6 pairs, and says so."""
    first = tmp_path / "nights" / "1"
    assert main([*ARGS, "--reference", f"tree={Path.cwd()}", "-o", str(first)]) == 0
    data = json.loads((first / "night.json").read_text())
    data["rows"][0]["ratios"]["step_time_s"]["pairs"] = [math.exp(x) for x in (0.03, -0.03, 0.0)]
    (first / "night.json").write_text(json.dumps(data))
    second = tmp_path / "nights" / "2"
    assert main([*ARGS, "--max-pairs", "6", "--reference", f"tree={Path.cwd()}", "-o", str(second)]) == 0
    (row,) = load_night(second / "night.json").rows
    assert row.pairs == 6 and len(row.ratios["step_time_s"].pairs) == 6
    assert (
        "pairs from the spread of each row's pairs over 1 earlier night(s): ddp ws1"
        in capsys.readouterr().out
    )


def _night_files(tmp_path: Path, nights_: list[Night]) -> dict[str, object]:
    for k, n in enumerate(nights_):
        save_night(n, tmp_path / f"night-{k:02d}")
    return {s.label: s for s in from_nights([tmp_path])}


def test_a_chained_ratios_interval_is_carried_with_it_across_each_bridge(tmp_path):
    """Three references, a then b (b / a measured 0.8) then c (c / b measured 0.5): each night's ratio and
    both ends of its interval are carried to reference a's scale by the product of the bridges, 0.8 and then
    0.4; a night without a commit is left out and the nights after it are still read."""
    r = [_row(1.0), _row(1.25), _row(2.5)]  # head / a, head / b, head / c: the same head throughout
    b = Bridge(previous=Reference(spec="tree=/refs/ref-a", describe="ref-a", id="ref-a"), rows=[_row(0.8)])
    c = Bridge(previous=Reference(spec="tree=/refs/ref-b", describe="ref-b", id="ref-b"), rows=[_row(0.5)])
    nights_ = [night(0, [r[0]]), night(1, [r[0]]), night(2, [r[1]], "ref-b", b), night(3, [r[1]], "ref-b")]
    nights_ += [night(4, [r[2]], "ref-c", c).model_copy(update={"commit": ""}), night(5, [r[2]], "ref-c", c)]
    nights_ += [night(6, [r[2]], "ref-c")]
    (chained,) = [s for s in _night_files(tmp_path, nights_).values() if s.ratio]
    assert [p.commit for p in chained.points] == [commit(i) for i in (0, 1, 2, 3, 5, 6)]
    for p in chained.points:
        assert (p.value, p.low, p.high) == pytest.approx((1.0, 0.995, 1.005)), p


def test_a_bridge_without_the_configurations_ratio_starts_a_new_series(tmp_path):
    """The bridge measured the new reference against the old for another metric only: this metric's ratios
    cannot be chained, so they start a series of their own, named by the new reference."""
    other = _row(0.8)
    other = other.model_copy(update={"ratios": {"mem_allocated_peak_bytes": other.ratios["step_time_s"]}})
    b = Bridge(previous=Reference(spec="tree=/refs/ref-a", describe="ref-a", id="ref-a"), rows=[other])
    series = _night_files(tmp_path, [night(0, [_row(1.0)]), night(1, [_row(1.25)], "ref-b", b)])
    ratios = sorted((s for s in series.values() if s.ratio), key=lambda s: s.label)
    assert [[p.value for p in s.points] for s in ratios] == [[1.0], [1.25]]
    assert "since reference ref-b" in ratios[1].label


def test_heads_absolute_figures_are_series_of_the_tracked_metrics_at_each_nights_commit(tmp_path):
    """Head's own figures of each night: one series per metric with an asv track and a positive figure,
    named for the configuration, at the night's commit; an unknown metric, one without a track (tokens/s)
    and a figure of 0 are left out, whatever order they come in."""
    row = _row(1.0)
    head = {"unknown": 1.0, "tokens_per_s": 5.0, "mem_reserved_peak_bytes": 0.0, "step_time_s": 0.1}
    row = row.model_copy(update={"head": head})
    series = _night_files(tmp_path, [night(0, [row]), night(1, [row])])
    absolute = [s for s in series.values() if not s.ratio]
    assert [(s.metric, s.label) for s in absolute] == [("step_time_s", ABSOLUTE)]
    (s,) = absolute
    assert s.config == CFG.to_dict()
    assert [(p.commit, p.value) for p in s.points] == [(commit(0), 0.1), (commit(1), 0.1)]


@pytest.mark.slow  # four nights of two gpt2-tiny servers on gloo, in two calls: about 2 minutes on 2 cores
@pytest.mark.nightly  # the evidence script's mechanics; the nightly's own logic is tested above
def test_the_gpu_scripts_plant_nights_go_on_across_calls_on_cpu(tmp_path):
    """scripts/relative_nightly_gpu.sh MODE=plant on CPU, spread over two calls as over two GPU leases: the
    second call (FIRST=3) keeps the first call's nights and machine.txt, runs the plant's nights against the
    frozen reference, and writes the history, summary.md and junit.xml over all four. Whether CPU noise lets
    the history find the plant is not asked here; that every night is read, at its revision, is."""
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "MODE": "plant",
        "BEFORE": "2",
        "AFTER": "2",
        "PAIRS": "3",
        "MAX_PAIRS": "3",
        "SIZE": "0",
        "PLANT_ROW": "ddp",
        "CONFIG": "-n 1 -m gpt2-tiny --precision fp32 --micro-batch 2 --steps 4 --windows 2 --warmup 1 --device cpu",
    }
    script = ["bash", "scripts/relative_nightly_gpu.sh", str(tmp_path)]
    first = subprocess.run(script, cwd=root, env={**env, "NIGHTS": "2"}, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    assert "nights from 3 on are still to run" in first.stdout
    (tmp_path / "machine.txt").write_text("the first call's machine\n")
    second = subprocess.run(script, cwd=root, env={**env, "FIRST": "3"}, capture_output=True, text=True)
    assert second.returncode in (0, 1), second.stdout[-3000:] + second.stderr[-2000:]
    assert (tmp_path / "machine.txt").read_text() == "the first call's machine\n"
    revisions = subprocess.run(
        ["git", "-C", str(tmp_path / "repo"), "log", "--format=%H"], capture_output=True, text=True
    ).stdout.split()[::-1]
    nights = [n for _, n in relative.find_night_files([tmp_path / "nights"])]
    assert [n.commit for n in nights] == [revisions[0]] * 2 + [revisions[1]] * 2
    assert len({n.reference.id for n in nights}) == 1  # one frozen reference throughout
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| night-0{i} | revision {i > 2:d} |" in summary for i in range(1, 5)), summary
    junit = (tmp_path / "junit.xml").read_text()
    assert "the ratio series&apos;" in junit or "the ratio series'" in junit
    assert (tmp_path / "history" / "history.json").exists()
