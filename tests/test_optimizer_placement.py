"""Where optimizer state lives after a load (strategies.base.place_optimizer_state), shown on the meta device so
that the CPU tier sees a parameter that is not on the host: DeepSpeed's universal checkpoint writes AdamW's
state by hand, `step` on the host, and torch's fused AdamW on a GPU refuses that at the first step."""

from __future__ import annotations

import pytest
import torch

from distbench.strategies.base import place_optimizer_state


def _loaded_by_hand(fused: bool) -> tuple[torch.optim.AdamW, torch.nn.Parameter]:
    """An AdamW over a parameter on the meta device whose state was written on the host, as a universal load
    does; `fused` as the group says (set after construction: fused AdamW cannot be built on meta)."""
    p = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    opt = torch.optim.AdamW([p])
    opt.param_groups[0]["fused"] = fused
    opt.state[p] = {
        "step": torch.tensor(7.0, dtype=torch.float64),
        "exp_avg": torch.zeros(4, 3),
        "exp_avg_sq": torch.zeros(4, 3),
    }
    return opt, p


def _assert_placed(opt: torch.optim.AdamW, p: torch.nn.Parameter, fused: bool) -> None:
    state = opt.state[p]
    assert state["exp_avg"].device == p.device and state["exp_avg_sq"].device == p.device, state
    if fused:  # torch's fused kernels take `step` on the parameter's device, in float32
        assert (state["step"].device, state["step"].dtype) == (p.device, torch.float32), state["step"]
    else:  # the per-tensor and foreach loops keep it a host scalar, as torch's load_state_dict leaves it
        assert state["step"].device.type == "cpu" and float(state["step"]) == 7.0, state["step"]


@pytest.mark.parametrize("fused", [True, False])
def test_state_moves_beside_its_parameter(fused):
    opt, p = _loaded_by_hand(fused)
    place_optimizer_state(opt)
    _assert_placed(opt, p, fused)


def test_state_of_a_parameter_in_no_group_moves_too():
    """ZeRO-3 steps one sub-group at a time, its groups holding only that sub-group's partition: the others'
    state, keyed by parameters in no group, moves as the group's flags say (all of one AdamW)."""
    opt, p = _loaded_by_hand(fused=True)
    opt.param_groups[0]["params"] = [torch.nn.Parameter(torch.empty(1, device="meta"))]
    place_optimizer_state(opt)
    _assert_placed(opt, p, fused=True)


def test_a_placement_that_leaves_step_on_the_host_is_caught():
    """The bite: a placement that moves every tensor beside its parameter but `step` (the defect a GPU run
    met as "state_steps is on cpu") fails the check above."""
    opt, p = _loaded_by_hand(fused=True)
    state = opt.state[p]
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = state[key].to(p.device)
    with pytest.raises(AssertionError):
        _assert_placed(opt, p, fused=True)
