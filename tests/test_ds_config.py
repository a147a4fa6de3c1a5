"""The DeepSpeed config merge: harness keys win, user keys pass through, conflicts and bad files are refused."""

from __future__ import annotations

import json

import pytest

from distbench.config import RunConfig
from distbench.errors import ConfigError
from distbench.strategies.ds_config import build_ds_config

CFG = RunConfig(strategy="zero2", world_size=2, global_batch=8, micro_batch=2)


def build(
    user=None, cfg: RunConfig = CFG, stage: int = 2, offload: bool = False, n_params: int | None = None
) -> dict:
    return build_ds_config(cfg, stage, offload, user, n_params=n_params)


def test_harness_keys_follow_the_run_config():
    ds = build()
    assert (
        ds["train_batch_size"],
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
    ) == (8, 2, 2)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True}  # as DeepSpeed's users run it
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert "optimizer" not in ds and "scheduler" not in ds


def test_no_gradient_clipping_by_default_for_parity_with_ddp():
    assert build()["gradient_clipping"] == 0.0


def test_bucket_sizes_are_capped_at_the_model_size_and_user_values_win():
    small = build(n_params=1234)["zero_optimization"]
    assert small["reduce_bucket_size"] == small["allgather_bucket_size"] == 1234
    big = build(n_params=10**10)["zero_optimization"]
    assert big["reduce_bucket_size"] == big["allgather_bucket_size"] == 500_000_000
    mine = build({"zero_optimization": {"reduce_bucket_size": 77}}, n_params=1234)["zero_optimization"]
    assert mine["reduce_bucket_size"] == 77 and mine["allgather_bucket_size"] == 1234


def test_bf16_precision_enables_the_bf16_section():
    assert build(cfg=CFG.replace(precision="bf16"))["bf16"] == {"enabled": True}


def test_offload_puts_optimizer_and_parameters_on_cpu():
    zero = build(stage=3, offload=True)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu"} and zero["offload_param"] == {"device": "cpu"}
    assert build(stage=3, offload=True)["zero_force_ds_cpu_optimizer"] is False


def test_keys_the_harness_does_not_control_pass_through():
    user = {
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "overlap_comm": True,
            "reduce_bucket_size": 1000,
            "stage3_prefetch_bucket_size": 2000,
        },
    }
    ds = build(user, stage=3)
    assert ds["gradient_clipping"] == 1.0
    assert ds["zero_optimization"] == {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": 1000,
        "stage3_prefetch_bucket_size": 2000,
    }


def test_matching_harness_values_are_accepted():
    ds = build(
        {
            "train_batch_size": 8,
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 2},
            "bf16": {"enabled": False},
        }
    )
    assert ds["train_batch_size"] == 8


def test_auto_takes_the_harness_value_or_deepspeed_default():
    ds = build(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"},
        }
    )
    assert ds["train_batch_size"] == 8 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_clipping"] == 0.0 and ds["bf16"] == {"enabled": False}
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True}


def test_hf_style_optimizer_and_scheduler_sections_that_agree_are_dropped():
    user = {
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": CFG.lr, "betas": list(CFG.betas), "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_max_lr": "auto"}},
    }
    ds = build(user)
    assert "optimizer" not in ds and "scheduler" not in ds


def test_an_optimizer_section_is_refused_when_the_run_uses_sgd():
    """An AdamW section that agrees with the run's lr would be dropped silently; under SGD it describes an
    optimizer that does not run."""
    with pytest.raises(ConfigError, match="algorithm is 'sgd'"):
        build({"optimizer": {"type": "AdamW", "params": {"lr": CFG.lr}}}, CFG.replace(algorithm="sgd"))
    assert "optimizer" not in build(None, CFG.replace(algorithm="sgd"))


@pytest.mark.parametrize("bad", [{"algorithm": "adam"}, {"momentum": 1.0}, {"momentum": -0.1}])
def test_the_update_rule_is_validated(bad):
    with pytest.raises(ConfigError):
        CFG.replace(**bad)


def test_the_users_dict_is_not_modified():
    user = {"bfloat16": {"enabled": False}, "optimizer": {"type": "AdamW"}, "gradient_clipping": "auto"}
    before = json.dumps(user, sort_keys=True)
    build(user)
    assert json.dumps(user, sort_keys=True) == before


@pytest.mark.parametrize(
    ("user", "cfg", "key", "theirs", "ours", "fix"),
    [
        (
            {"zero_optimization": {"stage": 3}},
            CFG,
            "zero_optimization.stage",
            "3",
            "2",
            "zero1, zero2 or zero3",
        ),
        ({"train_batch_size": 16}, CFG, "train_batch_size", "16", "8", "RunConfig.global_batch"),
        (
            {"train_micro_batch_size_per_gpu": 4},
            CFG,
            "train_micro_batch_size_per_gpu",
            "4",
            "2",
            "micro_batch",
        ),
        ({"gradient_accumulation_steps": 1}, CFG, "gradient_accumulation_steps", "1", "2", "remove the key"),
        ({"fp16": {"enabled": True}}, CFG, "fp16.enabled", "True", "False", "RunConfig.precision"),
        (
            {"fp16": {"loss_scale_window": 10}},
            CFG.replace(precision="fp16"),
            "fp16.loss_scale_window",
            "10",
            "1999",
            "loss_scale_window",
        ),
        ({"bf16": {"enabled": True}}, CFG, "bf16.enabled", "True", "False", "RunConfig.precision"),
        ({"bfloat16": {"enabled": True}}, CFG, "bf16.enabled", "True", "False", "RunConfig.precision"),
        (
            {"bf16": {"enabled": False}},
            CFG.replace(precision="bf16"),
            "bf16.enabled",
            "False",
            "True",
            "precision",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            CFG,
            "zero_optimization.offload_optimizer.device",
            "'cpu'",
            "'none'",
            "zero3_offload",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
            CFG,
            "optimizer.params.lr",
            "0.1",
            "0.001",
            "RunConfig",
        ),
        ({"optimizer": {"type": "SGD"}}, CFG, "optimizer.type", "'SGD'", "AdamW", "RunConfig"),
        ({"optimizer": "AdamW"}, CFG, "optimizer", "'AdamW'", "object", "RunConfig"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
            CFG,
            "scheduler",
            "warmup_num_steps",
            "LinearLR",
            "lr_warmup_steps",
        ),
    ],
)
def test_a_conflicting_user_key_names_the_key_both_values_and_the_fix(user, cfg, key, theirs, ours, fix):
    with pytest.raises(ConfigError) as e:
        build(user, cfg=cfg)
    msg = str(e.value)
    assert f"'{key}'" in msg and theirs in msg and ours in msg and fix in msg


def test_nvme_offload_conflicts_with_zero3_offload():
    with pytest.raises(ConfigError, match=r"offload_param.device' = 'nvme'.*'cpu'"):
        build({"zero_optimization": {"offload_param": {"device": "nvme"}}}, stage=3, offload=True)


def test_offload_extras_pass_through_for_zero3_offload():
    ds = build(
        {"zero_optimization": {"offload_param": {"device": "cpu", "buffer_count": 4}}}, stage=3, offload=True
    )
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "buffer_count": 4}


def test_a_json_file_is_read(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}}))
    assert build(str(f))["zero_optimization"]["overlap_comm"] is True


@pytest.mark.parametrize(
    "text,pattern",
    [
        (
            '{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2,}\n}\n',
            r"ds\.json is not valid JSON: line 3 column",
        ),
        ("[1, 2]", r"ds\.json must hold a JSON object.*list"),
        (
            '{"gradient_clipping": 1.0, "gradient_clipping": 2.0}',
            r"ds\.json.*duplicate key 'gradient_clipping'",
        ),
    ],
    ids=["malformed-json-names-the-location", "must-hold-an-object", "duplicate-keys-refused"],
)
def test_a_bad_json_file_is_refused_naming_it(tmp_path, text, pattern):
    f = tmp_path / "ds.json"
    f.write_text(text)
    with pytest.raises(ConfigError, match=pattern):
        build(str(f))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.json does not exist"):
        build(str(tmp_path / "nope.json"))


def test_a_top_level_typo_is_refused_with_the_nearest_key():
    with pytest.raises(ConfigError, match=r"'zero_optimisation' \(did you mean 'zero_optimization'\?\)"):
        build({"zero_optimisation": {"overlap_comm": True}})


def test_a_typo_inside_zero_optimization_is_refused_by_deepspeed():
    with pytest.raises(ConfigError, match=r"rejects the ds_config.*stage3_prefetch_bucket_sise"):
        build({"zero_optimization": {"stage3_prefetch_bucket_sise": 10}})


def test_a_value_of_the_wrong_type_is_refused_by_deepspeed():
    with pytest.raises(ConfigError, match=r"rejects the ds_config.*reduce_bucket_size"):
        build({"zero_optimization": {"reduce_bucket_size": "lots"}})


def test_neither_dict_nor_path_is_refused():
    with pytest.raises(ConfigError, match="dict or a path"):
        build(42)


def test_releasing_an_engine_resets_deepspeeds_autocast_marks_where_a_release_has_them(monkeypatch):
    """A bf16-amp engine marks autocast initialized for the whole process; giving it back unmarks it. A DeepSpeed
    without the torch_autocast module (before 0.17.2, inside the project's floor of 0.16) has nothing to reset,
    and releasing an engine there must not fail: the zoo's 0.17.1 could not run a single ZeRO job."""
    import sys

    from deepspeed.runtime import torch_autocast

    from distbench.strategies.deepspeed import forget_torch_autocast

    monkeypatch.setattr(torch_autocast, "TORCH_AUTOCAST_INITIALIZED", True)
    monkeypatch.setattr(torch_autocast, "TORCH_AUTOCAST_DTYPE", "bf16")
    forget_torch_autocast()
    assert (torch_autocast.TORCH_AUTOCAST_INITIALIZED, torch_autocast.TORCH_AUTOCAST_DTYPE) == (False, None)
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.torch_autocast", None)  # as if absent: import fails
    monkeypatch.delattr("deepspeed.runtime.torch_autocast", raising=False)
    forget_torch_autocast()
