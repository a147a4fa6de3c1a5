"""Invariants: checkpoints round-trip exactly, reshard across world sizes, and bad ones fail clearly."""

from __future__ import annotations

import dataclasses
import io
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import mutants
import rank_jobs
import tier_cases
from distbench.errors import CheckpointError
from distbench.invariants.checks import SINGLE_PROCESS_REFERENCE, assert_losses_match, assert_resume_exact
from distbench.invariants.export import full_state_dict_from_checkpoint
from distbench.runtime.pool import JobError
from distbench.strategies import REGISTRY
from distbench.strategies.checkpoint_files import MANIFEST, write_manifest
from distbench.strategies.fsdp1 import LORA_ONE_RANK_WHY
from recipe_jobs import BF16, LORA, refuses_lora


@pytest.mark.default_cases(
    "single-ws1",
    "ddp-ws2",
    "fsdp_full-ws2",
    "fsdp_grad-ws2",
    "fsdp_hybrid-ws2",
    "zero1-ws2",
    "zero2-ws2",
    "zero3-ws2",
    "zero3_offload-ws2",
)
def test_checkpoint_roundtrip(suite, strategy, world_size):
    """Train k steps, save, build everything fresh, load, train on to n: steps k+1..n are bitwise equal to
    the uninterrupted run, so optimizer state, LR schedule, RNG and data position were all restored."""
    _assert_roundtrip(suite, strategy, world_size)


@pytest.mark.up_to_world_size(2)
@pytest.mark.strategies("ddp", "fsdp_full", "fsdp1_full", "zero3")
@pytest.mark.default_cases("ddp-ws2", "fsdp_full-ws2", "zero3-ws2")
def test_lora_checkpoint_roundtrip(suite, strategy, world_size):
    """The same with LoRA: the adapters and their optimizer state come back exactly beside frozen base weights
    that have none (torch's state dict, DCP, DeepSpeed's engine checkpoint; ZeRO-2, saved and loaded by the same
    trainer code, is left out for the CPU tier's time). The run is the one the LoRA parity test checked."""
    if refuses_lora(strategy, world_size):
        pytest.skip(f"refused, as the LoRA parity test asserts: {LORA_ONE_RANK_WHY}")
    _assert_roundtrip(suite, strategy, world_size, **LORA)


@pytest.mark.up_to_world_size(2)
@pytest.mark.strategies("zero0")
@pytest.mark.default_cases("zero0-ws2")
def test_bf16_checkpoint_roundtrip(suite, strategy, world_size):
    """The same in bf16 without ZeRO, where the DeepSpeed engine's own bf16 wrapper holds the fp32 master weights
    and Adam's moments (BF16_Optimizer up to 0.17.5, the fp16 wrapper at bf16 since): its checkpoint must carry
    them. DeepSpeed 0.17.6 saved none of that state for bf16 at stage 0 and failed to load it (the zoo's
    ds-0.17.6-bf16-stage0-checkpoint); from #7586 on it loaded without it, so a resumed run restarted Adam from
    zero, until 0.18.5 (#7786)."""
    _assert_roundtrip(suite, strategy, world_size, **BF16)


@pytest.mark.up_to_world_size(2)
@pytest.mark.strategies("zero0")
@pytest.mark.default_cases("zero0-ws2")
def test_bf16_checkpoint_restores_adams_state(suite, strategy, world_size):
    """What the round trip above rests on, read directly: a fresh bf16 zero0 trainer that loads the checkpoint
    saved after step k holds the optimizer state (AdamW's step count and both moments, on each rank) of one that
    trained k steps. Unlike the round trip it does not depend on what the steps after k do, so it passes under
    DeepSpeed 0.18.5, which fixed the checkpoint (#7786) but still never zeroed bf16 stage-0 gradients (the
    zoo's other stage-0 case, which makes the round trip fail there)."""
    from rank_jobs import deepspeed_adam_state

    cfg = suite.config(strategy, world_size, **BF16)
    run = suite.checkpointed_run(cfg)
    kept = suite.run_job(world_size, deepspeed_adam_state, cfg=cfg, steps=run["save_at"])
    loaded = suite.run_job(world_size, deepspeed_adam_state, cfg=cfg, resume_from=str(run["checkpoint"]))
    assert all(s[0] > 0 and s[1] > 0 for rank in kept for s in rank), f"no Adam state after training: {kept}"
    assert loaded == kept, (
        f"{strategy} ws{world_size} bf16: Adam's state [step, |exp_avg|^2, |exp_avg_sq|^2] per parameter after "
        f"loading the checkpoint of step {run['save_at']} is {loaded[0][:3]}..., after training to it "
        f"{kept[0][:3]}..."
    )


def _assert_roundtrip(suite, strategy: str, world_size: int, **overrides: Any) -> None:
    cfg = suite.config(strategy, world_size, **overrides)
    run = suite.checkpointed_run(cfg)
    resumed = suite.train(cfg, resume_from=run["checkpoint"])[0]
    assert_resume_exact(
        resumed, run["losses"], run["save_at"], f"{strategy} ws{world_size} {overrides or ''}"
    )


@pytest.mark.slow  # four ranks on two cores: 10 s
@pytest.mark.world_size(4)
def test_ddp_resumes_exactly_at_four_ranks(suite):
    """From 3 ranks up, a ring all-reduce sums each element in an order set by its offset in the bucket, and
    DDP rebuilds its buckets after the first step: a resumed run drifted by an ulp (4x H200 and gloo alike)
    until deterministic configurations kept the first layout. The CPU tier's world sizes stop at 2."""
    _assert_roundtrip(suite, "ddp", 4)


def _pairs(device_type: str) -> list:
    sizes = [1, 2] if device_type == "cpu" else [1, 2, 4]
    marks = [pytest.mark.gpu] if device_type == "cuda" else []
    sfx = "-gpu" if device_type == "cuda" else ""
    # The world_size mark tells the plugin (skips, lanes) it needs max(a, b) ranks, not the default 1.
    return [
        pytest.param(
            device_type, a, b, id=f"ws{a}-to-ws{b}{sfx}", marks=[*marks, pytest.mark.world_size(max(a, b))]
        )
        for a in sizes
        for b in sizes
        if a != b
    ]


@pytest.mark.parametrize("device_type,saved_ws,loaded_ws", _pairs("cpu") + _pairs("cuda"))
@pytest.mark.parametrize("strategy_name", ["fsdp_full", "fsdp_grad", "zero2", "zero3"])
def test_resharding(suite, device_type, strategy_name, saved_ws, loaded_ws, tmp_path):
    """A checkpoint saved at one world size continues at another and matches the reference: DCP for FSDP2,
    DeepSpeed's universal checkpoint for ZeRO. On a copy: DeepSpeed's load converts the checkpoint in place,
    and the session's is read-only to its tests."""
    from distbench.runtime.pool import cuda_device_count

    if device_type == "cuda" and max(saved_ws, loaded_ws) > cuda_device_count():
        pytest.skip(f"needs {max(saved_ws, loaded_ws)} CUDA devices")
    saved = suite.config(strategy_name, saved_ws)
    run = suite.checkpointed_run(saved)
    k = run["save_at"]
    ckpt = _copy(run, tmp_path)
    resumed = suite.train(saved.resized(loaded_ws), resume_from=str(ckpt), reshard=True)[0]
    assert resumed["start_step"] == k
    ref = suite.reference(saved)["losses"]
    assert_losses_match(
        resumed["losses"],
        ref[k:],
        f"{strategy_name} saved at ws{saved_ws}, resumed at ws{loaded_ws}",
        against=SINGLE_PROCESS_REFERENCE,
    )


@pytest.mark.slow  # a world-size-2 pool and a 5 s wait
@pytest.mark.world_size(2)
def test_a_resharded_deepspeed_load_converts_after_every_rank_checked_the_checkpoint(suite, tmp_path):
    """Rank 0 converts a checkpoint of another world size to DeepSpeed's universal format inside it: a rank
    still checking the files against the manifest would find the conversion's and refuse the checkpoint while
    the others wait for it (at 8 gloo ranks on 2 cores, 4 ranks refused it and 4 hung). Here rank 1 lists the
    files 5 s after reading the manifest."""
    saved = suite.config("zero2", 1)
    run = suite.checkpointed_run(saved)
    k = run["save_at"]
    losses = suite.run_job(
        2,
        rank_jobs.train_listing_checkpoint_files_late,
        rank=1,
        seconds=5.0,
        cfg=saved.replace(world_size=2),
        resume_from=str(_copy(run, tmp_path)),
        reshard=True,
    )[0]["losses"]
    assert_losses_match(
        losses,
        suite.reference(saved)["losses"][k:],
        "zero2 saved at ws1, resumed at ws2",
        against=SINGLE_PROCESS_REFERENCE,
    )


def _expect_checkpoint_error(suite, cfg, path, *needles, **kw) -> str:
    with pytest.raises(JobError) as info:
        suite.train(cfg, resume_from=str(path), **kw)
    err = info.value
    assert err.exc_types == {"CheckpointError"}, f"expected CheckpointError on every rank, got {err}"
    text = str(err)
    for needle in needles:
        assert needle in text, f"{needle!r} not in error:\n{text}"
    return text


@pytest.mark.parametrize("strategy_name", ["ddp", "fsdp_full"])
def test_truncated_checkpoint_fails_clearly(suite, strategy_name, tmp_path):
    cfg = suite.config(strategy_name, 1)
    run = suite.checkpointed_run(cfg)
    bad = tmp_path / "ckpt"
    shutil.copytree(run["checkpoint"], bad)
    biggest = max((p for p in bad.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = biggest.read_bytes()
    biggest.write_bytes(data[: len(data) // 3])
    _expect_checkpoint_error(suite, cfg, bad, str(bad))


@pytest.mark.parametrize("strategy_name", ["fsdp_full", "zero2"])
def test_world_size_mismatch_needs_reshard(suite, strategy_name):
    cfg = suite.config(strategy_name, 2)
    run = suite.checkpointed_run(cfg)
    _expect_checkpoint_error(
        suite, cfg.replace(world_size=1), run["checkpoint"], "saved at world size 2", "reshard"
    )


@pytest.mark.nightly  # the default tier's zero0 checkpoint is its bf16 round-trip; this one adds a run
def test_a_stage0_checkpoint_refuses_another_world_size_even_with_reshard(suite):
    """zero0's format does not reshard (no ZeRO partitions for DeepSpeed's universal conversion): asked to, its
    load says so rather than failing inside the conversion."""
    cfg = suite.config("zero0", 2)
    run = suite.checkpointed_run(cfg)
    _expect_checkpoint_error(
        suite,
        cfg.replace(world_size=1),
        run["checkpoint"],
        "without ZeRO (stage 0)",
        "at that world size only",
        reshard=True,
    )


def test_zero_stage_mismatch_fails_clearly(suite):
    run = suite.checkpointed_run(suite.config("zero2", 1))
    _expect_checkpoint_error(suite, suite.config("zero3", 1), run["checkpoint"], "saved with ZeRO stage 2")


@pytest.mark.parametrize("strategy_name", ["ddp", "fsdp_full"])
def test_other_model_checkpoint_fails_clearly(suite, strategy_name):
    cfg = suite.config(strategy_name, 1)
    run = suite.checkpointed_run(cfg)
    _expect_checkpoint_error(suite, cfg.replace(model="llama-tiny"), run["checkpoint"], run["checkpoint"])


def test_missing_checkpoint_fails_clearly(suite, tmp_path):
    _expect_checkpoint_error(suite, suite.config("ddp", 1), tmp_path / "nowhere", "missing")


def _copy(run: dict, tmp_path: Path) -> Path:
    """A copy of the run's checkpoint for a test to change or convert: the session's is read-only to tests."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run["checkpoint"], ckpt)
    return ckpt


@pytest.mark.slow  # a DeepSpeed conversion and two runs at two world sizes: 20 s of the CPU tier's 3 minutes
@pytest.mark.world_size(2)
def test_a_checkpoint_a_resharded_load_converted_still_resumes_at_its_own_world_size(suite, tmp_path):
    """DeepSpeed's resharding load adds its universal conversion to the checkpoint, manifest included: the same
    directory then still resumes exactly at the world size that saved it. A chance of test order once (a
    resharding test converted the session's shared checkpoint and a later test happened to reload it), a test
    of its own now, on its own copy."""
    cfg = suite.config("zero2", 2)
    run = suite.checkpointed_run(cfg)
    k = run["save_at"]
    ckpt = _copy(run, tmp_path)
    resharded = suite.train(cfg.replace(world_size=1), resume_from=str(ckpt), reshard=True)[0]
    assert_losses_match(
        resharded["losses"],
        suite.reference(cfg)["losses"][k:],
        "zero2 resharded 2 to 1",
        against=SINGLE_PROCESS_REFERENCE,
    )
    assert (ckpt / "latest_universal").exists(), "the resharding load left no conversion to test"
    resumed = suite.train(cfg, resume_from=str(ckpt))[0]
    assert_resume_exact(resumed, run["losses"], k, "zero2 ws2, resumed after a resharding load converted it")


def _one(root: Path, pattern: str) -> Path:
    """The file `pattern` names; {tag} is DeepSpeed's latest tag (a resharded load adds `<tag>_universal/`)."""
    if "{tag}" in pattern:
        pattern = pattern.replace("{tag}", (root / "latest").read_text().strip())
    (path,) = root.glob(pattern)
    return path


@pytest.mark.parametrize(
    "strategy_name,pattern",
    [
        ("fsdp_full", "dcp/__0_0.distcp"),
        ("zero2", "{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        ("ddp", "checkpoint.pt"),
    ],
    ids=["dcp-shard", "deepspeed-optimizer-shard", "torch-state"],
)
def test_flipped_bytes_are_a_checkpoint_error_naming_the_file(suite, strategy_name, pattern, tmp_path):
    """64 bytes flipped mid-file loaded silently (the resumed losses then differed) before the manifest."""
    cfg = suite.config(strategy_name, 1)
    bad = _copy(suite.checkpointed_run(cfg), tmp_path)
    target = _one(bad, pattern)
    data = bytearray(target.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    target.write_bytes(bytes(data))
    _expect_checkpoint_error(suite, cfg, bad, str(target), "does not match its sha256")


@pytest.mark.parametrize(
    "content,needle",
    [
        (None, f"has no {MANIFEST}"),
        ("{not json", "is malformed"),
        ('{"version": 1, "files": []}', "is malformed"),
    ],
    ids=["missing", "not-json", "wrong-layout"],
)
def test_a_checkpoint_without_a_valid_manifest_is_refused(suite, content, needle, tmp_path):
    cfg = suite.config("ddp", 1)
    bad = _copy(suite.checkpointed_run(cfg), tmp_path)
    if content is None:
        (bad / MANIFEST).unlink()
    else:
        (bad / MANIFEST).write_text(content)
    _expect_checkpoint_error(suite, cfg, bad, needle)


@pytest.mark.parametrize(
    "content",
    ["{", '{"world_size": 1}', '{"world_size": "1", "stage": 2, "offload": false}'],
    ids=["not-json", "missing-key", "wrong-type"],
)
def test_a_malformed_deepspeed_meta_file_is_a_checkpoint_error(suite, content, tmp_path):
    cfg = suite.config("zero2", 1)
    bad = _copy(suite.checkpointed_run(cfg), tmp_path)
    (bad / "distbench_deepspeed.json").write_text(content)
    write_manifest(bad)  # a consistent manifest: the file itself must be refused
    _expect_checkpoint_error(suite, cfg, bad, "distbench_deepspeed.json is malformed")


class _Payload:
    """Unpickling this creates the marker file: what a hostile pickle's code would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(target: Path, marker: Path) -> None:
    if target.name == ".metadata":
        target.write_bytes(pickle.dumps({"metadata": _Payload(marker)}))
    elif target.suffix == ".distcp":
        _plant_in_a_data_shard(target, marker)
    else:
        torch.save({"module": _Payload(marker), "optimizer_state_dict": _Payload(marker)}, target)


def _plant_in_a_data_shard(shard: Path, marker: Path) -> None:
    """Each value of a DCP checkpoint that is not a tensor (the optimizer's hyperparameters) is a pickle of its
    own inside a data shard, which DCP's planner loads with weights_only=False: every such value of `shard` is
    pointed at a hostile one appended to it. The metadata is this test's own run's, read with pickle here."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta_file = shard.parent / ".metadata"
    meta = pickle.loads(meta_file.read_bytes())
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    pickled = [
        index
        for index, info in meta.storage_data.items()
        if info.relative_path == shard.name
        and isinstance(meta.state_dict_metadata[index.fqn], BytesStorageMetadata)
    ]
    assert pickled, f"{shard} holds no pickled value to plant in"
    for index in pickled:
        meta.storage_data[index] = dataclasses.replace(
            meta.storage_data[index], offset=offset, length=len(buf.getvalue())
        )
    meta_file.write_bytes(pickle.dumps(meta))


HOSTILE = [
    ("ddp", 1, "checkpoint.pt", "load"),
    ("ddp", 1, "extra_rank0.pt", "load"),
    ("fsdp_full", 1, "trainer.pt", "load"),
    ("fsdp_full", 1, "dcp/.metadata", "load"),
    ("fsdp_full", 1, "dcp/.metadata", "export"),
    ("fsdp_full", 1, "dcp/__0_0.distcp", "load"),
    ("fsdp_full", 1, "dcp/__0_0.distcp", "export"),
    ("zero2", 1, "{tag}/mp_rank_00_model_states.pt", "load"),
    ("zero2", 1, "{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt", "load"),
    # a world-size-2 pool of its own (10 s of the CPU tier's 3 minutes): the slow tier, which CI runs too
    pytest.param(
        "zero2", 1, "{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt", "reshard", marks=pytest.mark.slow
    ),
    ("zero3", 1, "{tag}/zero_pp_rank_0_mp_rank_00_model_states.pt", "load"),
    ("zero3", 1, "{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt", "load"),
    ("zero3", 1, "{tag}/zero_pp_rank_0_mp_rank_00_model_states.pt", "export"),
    ("zero3", 1, "{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt", "export"),
]


@pytest.mark.parametrize(
    "strategy_name,ws,pattern,path",
    HOSTILE,
    ids=[f"{s}-{p.split('/')[-1]}-{how}" for s, _, p, how in (getattr(h, "values", h) for h in HOSTILE)],
)
def test_a_hostile_pickle_in_a_checkpoint_runs_no_code(suite, strategy_name, ws, pattern, path, tmp_path):
    """Every loader path, with the manifest rewritten to match: a manifest is no defence against someone who
    can write the directory, so each load itself must refuse to run the payload."""
    cfg = suite.config(strategy_name, ws)
    bad = _copy(suite.checkpointed_run(cfg), tmp_path)
    marker = tmp_path / "payload-ran"
    target = _one(bad, pattern)
    _plant(target, marker)
    write_manifest(bad)
    # a data shard's pickles are read from slices in memory: the refusal names the checkpoint, not the shard
    named = str(bad) if target.suffix == ".distcp" else target.name
    if path == "export":
        with pytest.raises(CheckpointError) as e:
            full_state_dict_from_checkpoint(bad, strategy_name)
        assert named in str(e.value), e.value
    elif path == "reshard":
        _expect_checkpoint_error(suite, cfg.replace(world_size=2), bad, named, reshard=True)
    else:
        _expect_checkpoint_error(suite, cfg, bad, named)
    assert not marker.exists(), f"loading {target} ran its payload"


#: A user's model whose training draws from every global generator: torch's host and device generators, numpy's
#: and Python's `random` (tests/user_models.py), each rank seeded apart. Four steps, saved after the second; a
#: global batch of 4 in micro-batches of 1 (accumulating at both world sizes), at the model's own length.
GLOBAL_RNG = {
    "model": "user_models:global_rng_lm",
    "seq_len": 0,
    "global_batch": 4,
    "micro_batch": 1,
    "steps": 4,
}
#: Why a resume at another world size cannot continue the global random streams: they are per rank.
RESHARDED_RNG_WHY = (
    "a resume at another world size cannot continue each rank's global random streams: the states are per "
    "rank and the ranks changed, so DCP and DeepSpeed's universal checkpoint loads start them afresh"
)
#: One strategy per checkpoint path (torch.save, DCP, DeepSpeed) at 2 ranks in the default tier, the rest nightly.
_RNG_FAST = {("ddp", 2), ("fsdp_full", 2), ("zero2", 2)}


def _global_rng_cases() -> list:
    same = tier_cases.cases(fast=_RNG_FAST)
    resharded = [
        pytest.param(
            device_type,
            name,
            2,
            id=f"{name}-ws2-to-ws1{sfx}",
            marks=[pytest.mark.skip(reason=RESHARDED_RNG_WHY), *([pytest.mark.gpu] if sfx else [])],
        )
        for device_type, sfx in (("cpu", ""), ("cuda", "-gpu"))
        for name, spec in REGISTRY.items()
        if spec.checkpoint is not None and spec.checkpoint.reshards
    ]
    return same + resharded


@pytest.mark.parametrize(tier_cases.ARGNAMES, _global_rng_cases())
def test_resume_continues_every_global_random_stream(suite, strategy_name, ws):
    """A model drawing from torch's host and device generators, numpy's and Python's `random` (nn.Dropout, SDPA
    dropout, random masking, data augmentation) resumes bitwise like its own uninterrupted run: each rank's
    generators were saved and put back, after the strategy's own load and untouched by the harness since."""
    _assert_roundtrip(suite, strategy_name, ws, **GLOBAL_RNG)


def _rng_bites() -> list:
    """Each generator left where the rebuilt process had it (CUDA's on the GPU tier only: the CPU tier has
    none), all of them, or every rank given rank 0's (GPU: 2 ranks, a device each)."""
    cpu = [
        ("cpu", m, 2)
        for m in (
            "rng_unrestored_all",
            "rng_unrestored_torch",
            "rng_unrestored_numpy",
            "rng_unrestored_python",
            "rng_rank0_everywhere",
        )
    ]
    gpu = [("cuda", "rng_unrestored_cuda", 1), ("cuda", "rng_rank0_everywhere", 2)]
    return [
        pytest.param(
            d,
            m,
            ws,
            id=f"{m}{'-gpu' if d == 'cuda' else ''}",
            marks=[pytest.mark.world_size(ws), *([pytest.mark.gpu] if d == "cuda" else [])],
        )
        for d, m, ws in cpu + gpu
    ]


@pytest.mark.parametrize("device_type,mutation,ws", _rng_bites())
def test_a_resume_that_leaves_a_global_generator_fails(suite, mutation, ws):
    """tests/mutants.py rng_*: the DDP resume's load, then from outside the generator(s) put back where the
    rebuilt rank had them (or rank 0's everywhere): the resumed losses leave the uninterrupted run's."""
    cfg = suite.config("ddp", ws, **GLOBAL_RNG)
    run = suite.checkpointed_run(cfg)
    broken = suite.run_job(ws, mutants.train, mutation=mutation, cfg=cfg, resume_from=run["checkpoint"])[0]
    with pytest.raises(AssertionError, match="differ from the uninterrupted run"):
        assert_resume_exact(broken, run["losses"], run["save_at"], f"ddp ws{ws} {mutation}")


def _generator_states() -> list:
    """torch's host generator, numpy's and Python's, read here rather than through the code under test: numpy's
    whole state (its key, position and the spare normal deviate it holds between draws), not its key alone."""
    name, keys, *rest = np.random.get_state()
    return [torch.get_rng_state(), (name, keys.copy(), *rest), random.getstate()]


def test_looking_up_a_factory_moves_no_global_generator():
    """Jobs look the model up (get_model probes a user's factory) mid-training too: a probe that seeded or drew
    would move the streams the model draws from, in the uninterrupted and the resumed run alike, unseen: numpy's
    spare normal deviate included, which the probe's factory draws through."""
    from distbench.workloads import get_model

    np.random.standard_normal(1)  # a spare deviate waiting, as a model drawn from numpy leaves one
    before = _generator_states()
    get_model("user_models:numpy_initialised_lm")  # the factory draws from numpy and Python's random
    after = _generator_states()
    assert torch.equal(before[0], after[0]), "looking the factory up moved torch's generator"
    assert (before[1][1] == after[1][1]).all(), "looking the factory up moved numpy's generator"
    assert before[1][2:] == after[1][2:], "looking the factory up moved numpy's position or spare deviate"
    assert before[2] == after[2], "looking the factory up moved Python's generator"


def test_a_factory_initialising_from_numpy_builds_the_same_model_from_the_seed():
    """Every rank must build the same weights from the run's seed, whichever generator the factory draws from."""
    from distbench.workloads import get_model

    spec = get_model("user_models:numpy_initialised_lm")
    first, second = (spec.build(1234).state_dict() for _ in range(2))
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_a_checkpoint_without_every_generators_state_is_refused(suite, tmp_path):
    """A rank's extra state as distbench saved it before numpy's and Python's generators were kept (torch's
    alone): refused naming the file, not resumed with streams the uninterrupted run never had."""
    cfg = suite.config("ddp", 1)
    bad = _copy(suite.checkpointed_run(cfg), tmp_path)
    extra = bad / "extra_rank0.pt"
    state = torch.load(extra, weights_only=True)
    state["rng"] = {"cpu": state["rng"]["torch"]}
    torch.save(state, extra)
    write_manifest(bad)
    _expect_checkpoint_error(suite, cfg, bad, str(extra), "random generator state", "re-save")
