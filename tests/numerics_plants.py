"""Planted changes of numerics, each the kind an upgrade brings into every side at once, to prove that the
numerics comparison (distbench/gate/numerics.py) and the goldens (testsuite/goldens.py) catch what the
within-installation parity cannot:

  adamw_eps        torch's AdamW with an epsilon ten times the one asked for (an optimizer upgrade)
  attention_eager  the models' attention implementation switched from SDPA to eager (a transformers upgrade)
  bf16_loss        cross-entropy computed in bf16 instead of fp32 (a model file that casts its logits)
  sdpa_<backend>    every SDPA call forced onto one backend (flash, efficient, cudnn: GPU kernels) where
                   deterministic runs take the math kernel (a torch upgrade changing SDPA's choice)
  ddp_prediv       DDP's gradients pre-divided by twice the world size before their all-reduce (a pre-divide
                   factor changed in one strategy's wrapper alone)
  accum_drop       DDP drops the gradients a rank accumulated under no_sync, so a step that accumulates
                   several micro-batches applies only its last one's (an upgrade that breaks accumulation
                   alone: a step of one micro-batch is bitwise unchanged)

The first three change what the reference computes too, so parity stays green; the last two change one
strategy only. `planted(name)` applies one in this process; `train` and `reference` run the jobs under it in
the rank pool. A variant process (`distbench ab --head path=tests/plant_site,env.DISTBENCH_NUMERICS_PLANT=...`)
gets it at interpreter start from plant_site/sitecustomize.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
PLANTS = (
    "adamw_eps",
    "attention_eager",
    "bf16_loss",
    "ddp_prediv",
    "accum_drop",
    *(f"sdpa_{b}" for b in SDPA_BACKENDS),
)
ENV = "DISTBENCH_NUMERICS_PLANT"


def _adamw_with_eps_times_ten(init: Any) -> Any:
    @functools.wraps(init)
    def planted_init(self: Any, params: Any, *args: Any, eps: float = 1e-8, **kwargs: Any) -> None:
        init(self, params, *args, eps=eps * 10, **kwargs)

    return planted_init


def _cross_entropy_in_bf16(ce: Any) -> Any:
    @functools.wraps(ce)
    def planted(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return ce(input.bfloat16(), *args, **kwargs).float()

    return planted


def _eager_attention(hf_config: Any) -> Any:
    @functools.wraps(hf_config)
    def planted(self: Any) -> Any:
        c = hf_config(self)
        c._attn_implementation = "eager"
        return c

    return planted


def _sdpa_on(backend: str) -> Any:
    def wrap(sdpa: Any) -> Any:
        @functools.wraps(sdpa)
        def planted(*args: Any, **kwargs: Any) -> torch.Tensor:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])]):
                return sdpa(*args, **kwargs)

        return planted

    return wrap


def _prediv_hook(state, bucket):  # unannotated: DDP rejects the string annotations of `from __future__`
    """DDP comm hook pre-dividing by twice the world size, then summing: the mean halved."""
    import torch.distributed as dist

    fut = dist.all_reduce(bucket.buffer().div_(2 * dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _ddp_prediv_twice(wrap: Any) -> Any:
    @functools.wraps(wrap)
    def planted(self: Any, module: Any) -> Any:
        ddp = wrap(self, module)
        ddp.register_comm_hook(None, _prediv_hook)
        return ddp

    return planted


def _ddp_dropping_unsynced_gradients(forward_backward: Any) -> Any:
    @functools.wraps(forward_backward)
    def planted(self: Any, batch: Any, sync: bool) -> torch.Tensor:
        loss = forward_backward(self, batch, sync)
        if not sync:  # a micro-batch accumulated locally: its gradients lost before the next one
            self.model.zero_grad(set_to_none=True)
        return loss

    return planted


def _targets(name: str) -> tuple[Any, str, Any]:
    """(object, attribute, wrapper of the original) of a plant."""
    from distbench.strategies.ddp import DDPTrainer
    from distbench.workloads.models import ModelSpec

    if name.startswith("sdpa_"):
        return (F, "scaled_dot_product_attention", _sdpa_on(name.removeprefix("sdpa_")))
    return {
        "adamw_eps": (torch.optim.AdamW, "__init__", _adamw_with_eps_times_ten),
        "attention_eager": (ModelSpec, "hf_config", _eager_attention),
        "bf16_loss": (F, "cross_entropy", _cross_entropy_in_bf16),
        "ddp_prediv": (DDPTrainer, "wrap", _ddp_prediv_twice),
        "accum_drop": (DDPTrainer, "forward_backward", _ddp_dropping_unsynced_gradients),
    }[name]


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    """Everything built or computed inside runs with plant `name` (module doc)."""
    if name not in PLANTS:
        raise ValueError(f"unknown plant {name!r}; one of {', '.join(PLANTS)}")
    obj, attr, wrap = _targets(name)
    with mock.patch.object(obj, attr, wrap(getattr(obj, attr))):
        yield


def apply(name: str) -> None:
    """Plant `name` for the rest of this process (a variant's interpreter: plant_site/sitecustomize.py)."""
    obj, attr, wrap = _targets(name)
    setattr(obj, attr, wrap(getattr(obj, attr)))


def train(ctx: Any, plant: str | None, **kwargs: Any) -> dict[str, Any]:
    """distbench's train job with `plant` in place (None: none), on one thread per rank on CPU as the numerics
    comparison runs it (gate/numerics.py: one_thread_on_cpu)."""
    from distbench.gate.numerics import one_thread_on_cpu
    from distbench.jobs.train import train as job

    with planted(plant) if plant else contextlib.nullcontext(), one_thread_on_cpu(ctx.device_type):
        return job(ctx, **kwargs)


def curve(ctx: Any, plant: str | None, **kwargs: Any) -> dict[str, list[float]]:
    """The numerics comparison's curve job (gate/numerics.py: curve_job) with `plant` in place (None: none)."""
    from distbench.gate.numerics import curve_job

    with planted(plant) if plant else contextlib.nullcontext():
        return curve_job(ctx, **kwargs)


def reference(ctx: Any, plant: str, **kwargs: Any) -> dict[str, Any]:
    """The independent reference with `plant` in place (what within-installation parity compares with)."""
    from distbench.jobs.checks import reference_job

    with planted(plant):
        return reference_job(ctx, **kwargs)
