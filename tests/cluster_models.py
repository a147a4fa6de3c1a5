"""A user's model factory that fails on one node of a torchrun job: the last launched rank raises while the
others go on to their first collective."""

from __future__ import annotations

import os

from torch import nn

from user_models import tiny_lm


def fails_on_last_rank() -> nn.Module:
    if os.environ.get("RANK") is not None and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        raise RuntimeError(f"planted failure on rank {os.environ['RANK']}")
    return tiny_lm()
