"""Tier x strategy x world-size cases written out, for tests whose CPU cases do not all fit the default tier.

The plugin's `strategy`/`world_size` parametrization puts every case of a test in one tier; these cases carry
their own marks instead: `nightly` on the CPU cases left out of the default tier, which repeat what its cases
show for another strategy or world size (run by `pytest -m nightly`),
`gpu` on the GPU tier's (ids ending in -gpu, as the plugin names them), `world_size` for the plugin's skips and
lanes, and a skip naming the reason where the strategy cannot run the case. The test takes `device_type`
(which the `suite` fixture reads), `strategy_name` and `ws`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import pytest

from distbench.strategies import REGISTRY

ARGNAMES = "device_type,strategy_name,ws"


def cases(
    strategies: Iterable[str] | None = None,
    *,
    fast: Collection[tuple[str, int]] = (),
    gpu: Iterable[str] | None = None,
    world_sizes: Iterable[int] = (1, 2),
    precision: str = "fp32",
    prefix: tuple[str, ...] = (),
) -> list:
    """CPU cases of `strategies` (default: all) at `world_sizes`, all but the `fast` (strategy, world size)
    pairs marked nightly, then GPU cases of `gpu` (default: the same strategies). `prefix` values come first in
    each case, and in its id."""
    names = list(REGISTRY) if strategies is None else list(strategies)
    sizes = list(world_sizes)
    out = []
    for device_type, names_here in (("cpu", names), ("cuda", names if gpu is None else list(gpu))):
        for name in names_here:
            for ws in sizes:
                marks = [pytest.mark.world_size(ws)]
                if device_type == "cuda":
                    marks.append(pytest.mark.gpu)
                elif (name, ws) not in fast:
                    marks.append(pytest.mark.nightly)
                reason = REGISTRY[name].unsupported_reason(device_type, ws, precision=precision)
                if reason:
                    marks.append(pytest.mark.skip(reason=reason))
                sfx = "-gpu" if device_type == "cuda" else ""
                out.append(
                    pytest.param(
                        device_type,
                        *prefix,
                        name,
                        ws,
                        id="-".join([*prefix, f"{name}-ws{ws}{sfx}"]),
                        marks=marks,
                    )
                )
    return out
