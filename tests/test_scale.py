"""The CPU scale tier (`pytest -m scale`): world sizes 4 and 8 on gloo, against the single-process reference.

Every strategy that runs on CPU trains to the reference's losses, final parameters and last gradients at 4 and
8 ranks; fsdp_hybrid as 2 x 2 at 4 and as 2 x 4 and 4 x 2 at 8 (its meshes are checked in test_meshes.py);
checkpoints written by 8 ranks continue at 1, 2 and 4, and one written by 4 at 8 (DCP, DeepSpeed's universal
checkpoint), their losses against the reference's; gpt2-uneven, whose dimensions 4 divides and 8 does not, goes
through parity and resharding with padded shards. Each invariant has a bite (tests/mutants.py) that is
harmless at 4 ranks and fails it at 8. Not in the default run (addopts deselects `scale`): CI runs it nightly
(.github/workflows/scale.yml); docs/scale.md has its times.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

import mutants
from distbench.config import RunConfig
from distbench.invariants.checks import (
    SINGLE_PROCESS_REFERENCE,
    assert_losses_match,
    assert_params_and_grads_match,
)
from distbench.strategies import REGISTRY

pytestmark = pytest.mark.scale

#: 16 samples a step in micro-batches of 1: 4 micro-batches a rank at 4 ranks, 2 at 8, 16 on one.
WORKLOAD = {"global_batch": 16, "micro_batch": 1}
UNEVEN = "gpt2-uneven"
#: Every strategy that runs on CPU at more than one rank.
CPU_STRATEGIES = [n for n, s in REGISTRY.items() if s.cpu and s.max_world_size is None]
#: The strategies gpt2-uneven goes through: FSDP2's dim-0 chunks, ZeRO-1/2's flat partitions, ZeRO-3's
#: per-parameter ones each pad differently.
UNEVEN_STRATEGIES = ["fsdp_full", "zero2", "zero3"]
#: fsdp_hybrid's 4 x 2 mesh at 8 ranks (its default on one node is 2 x 4).
FOUR_BY_TWO = {"replicate": 4}


def _config(suite, model: str, strategy: str, ws: int, options: dict[str, Any] | None = None) -> RunConfig:
    return suite.config(strategy, ws, model=model, options=options or {}, **WORKLOAD)


def _param(*values: Any, ws: int, id: str) -> Any:
    return pytest.param(*values, id=id, marks=pytest.mark.world_size(ws))


def _parity_cases() -> list:
    mesh = {4: "-2x2", 8: "-2x4"}  # fsdp_hybrid's default on one node
    cases = [
        _param(
            "gpt2-tiny", name, ws, None, ws=ws, id=f"{name}{mesh[ws] if name == 'fsdp_hybrid' else ''}-ws{ws}"
        )
        for ws in (4, 8)
        for name in CPU_STRATEGIES
    ]
    cases.append(_param("gpt2-tiny", "fsdp_hybrid", 8, FOUR_BY_TWO, ws=8, id="fsdp_hybrid-4x2-ws8"))
    return cases + [
        _param(UNEVEN, name, ws, None, ws=ws, id=f"{UNEVEN}-{name}-ws{ws}")
        for ws in (4, 8)
        for name in UNEVEN_STRATEGIES
    ]


@pytest.mark.parametrize("model,strategy_name,ws,options", _parity_cases())
def test_parity_at_scale(suite, model, strategy_name, ws, options):
    """Losses, final full parameters and last-step gradients match the reference; every rank reports the same
    global losses."""
    cfg = _config(suite, model, strategy_name, ws, options)
    run, ref = suite.checkpointed_run(cfg), suite.reference(cfg)
    what = f"{strategy_name} {options or ''} ws{ws} {model}"
    assert all(r == run["losses"] for r in run["per_rank_losses"]), f"{what}: ranks report different losses"
    assert_losses_match(run["losses"], ref["losses"], what, against=SINGLE_PROCESS_REFERENCE)
    assert_params_and_grads_match(run, ref, cfg.lr, what)


#: (saved, loaded) world sizes: a checkpoint of 8 ranks at 1, 2 and 4, and one of 4 at 8.
RESHARDS = [(8, 1), (8, 2), (8, 4), (4, 8)]


def _reshard_cases() -> list:
    """By loaded world size first: each test needs the pool of its loaded size (the saved runs are the parity
    tests'), and the suite keeps 3 pools alive, so cycling through 1, 2, 4 and 8 would restart one each time."""
    chosen = [("gpt2-tiny", "fsdp_full"), ("gpt2-tiny", "zero3")] + [(UNEVEN, s) for s in UNEVEN_STRATEGIES]
    return [
        _param(model, name, a, b, ws=max(a, b), id=f"{model}-{name}-ws{a}-to-ws{b}")
        for a, b in RESHARDS
        for model, name in chosen
    ]


def _resumed(suite, saved: RunConfig, checkpoint: str, loaded_ws: int) -> list[float]:
    """The losses of `saved`'s run continued from `checkpoint` at `loaded_ws` ranks (resharded)."""
    return suite.train(saved.resized(loaded_ws), resume_from=checkpoint, reshard=True)[0]["losses"]


@pytest.mark.parametrize("model,strategy_name,saved_ws,loaded_ws", _reshard_cases())
def test_resharding_at_scale(suite, model, strategy_name, saved_ws, loaded_ws, tmp_path):
    """A checkpoint saved half-way at one world size continues at another to the reference's losses: DCP for
    fsdp_full, DeepSpeed's universal checkpoint for ZeRO. On a copy: DeepSpeed's load converts the checkpoint
    in place, and the session's is read-only to its tests."""
    saved = _config(suite, model, strategy_name, saved_ws)
    run = suite.checkpointed_run(saved)
    k = run["save_at"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run["checkpoint"], ckpt)
    assert_losses_match(
        _resumed(suite, saved, str(ckpt), loaded_ws),
        suite.reference(saved)["losses"][k:],
        f"{strategy_name} {model} saved at ws{saved_ws}, resumed at ws{loaded_ws}",
        against=SINGLE_PROCESS_REFERENCE,
    )


# --- bites: each defect is harmless at 4 ranks and fails its invariant at 8 -------------------------------


@pytest.mark.parametrize(
    "ws", [pytest.param(ws, id=f"ws{ws}", marks=pytest.mark.world_size(ws)) for ws in (4, 8)]
)
def test_parity_catches_gradients_averaged_within_a_node(suite, ws):
    """DDP averaging each node's 4 ranks and never across nodes (mutants node_local_reduce) is every rank at 4
    and two diverging halves at 8."""
    cfg = _config(suite, "gpt2-tiny", "ddp", ws)
    ref = suite.reference(cfg)["losses"]
    losses = suite.run_job(ws, mutants.train, mutation="node_local_reduce", cfg=cfg)[0]["losses"]
    if ws == 4:
        assert_losses_match(
            losses, ref, "ddp ws4 averaging within its one node", against=SINGLE_PROCESS_REFERENCE
        )
        return
    with pytest.raises(AssertionError, match="diverges from the single-process reference"):
        assert_losses_match(
            losses, ref, "ddp ws8 averaging within each node", against=SINGLE_PROCESS_REFERENCE
        )


@pytest.mark.parametrize(
    "ws", [pytest.param(ws, id=f"ws{ws}", marks=pytest.mark.world_size(ws)) for ws in (4, 8)]
)
def test_uneven_parity_catches_a_gather_that_assumes_even_shards(suite, ws):
    """fsdp_full's full parameters gathered as if each rank held an equal share (mutants even_shard_gather):
    gpt2-uneven's shards are equal at 4 ranks and padded at 8."""
    cfg = _config(suite, UNEVEN, "fsdp_full", ws)
    run = suite.run_job(
        ws, mutants.train, mutation="even_shard_gather", cfg=cfg, return_params=True, return_grads=True
    )[0]
    ref = suite.reference(cfg)
    if ws == 4:
        assert_params_and_grads_match(run, ref, cfg.lr, "fsdp_full ws4 gpt2-uneven, even-shard gather")
        return
    with pytest.raises(AssertionError, match="parameter"):
        assert_params_and_grads_match(run, ref, cfg.lr, "fsdp_full ws8 gpt2-uneven, even-shard gather")


@pytest.mark.world_size(8)
@pytest.mark.parametrize("strategy_name", ["fsdp_full", "zero3"], ids=lambda s: f"{s}-ws8")
def test_resharding_catches_a_second_node_that_saved_a_fresh_optimizer(suite, strategy_name, tmp_path):
    """Ranks 4-7 of a checkpoint written by 8 save zeroed optimizer moments (mutants
    second_node_fresh_optimizer, a no-op at 4 ranks): continued at 2 ranks, the losses leave the reference's."""
    saved = _config(suite, "gpt2-tiny", strategy_name, 8)
    k = suite.checkpointed_run(saved)["save_at"]  # the unmutated run's, which the parity tests share
    suite.run_job(
        8,
        mutants.train,
        mutation="second_node_fresh_optimizer",
        cfg=saved,
        save_at=k,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    with pytest.raises(AssertionError, match="diverges from the single-process reference"):
        assert_losses_match(
            _resumed(suite, saved, str(tmp_path / "ckpt"), 2),
            suite.reference(saved)["losses"][k:],
            f"{strategy_name} saved at ws8 with the second node's optimizer reset, resumed at ws2",
            against=SINGLE_PROCESS_REFERENCE,
        )
