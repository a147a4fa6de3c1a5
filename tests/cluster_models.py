"""Users' model factories that fail on one node of a torchrun job: on the last launched rank one raises and one
hangs, while the other ranks go on to their first collective."""

from __future__ import annotations

import os
import time

from torch import nn

from user_models import tiny_lm


def fails_on_last_rank() -> nn.Module:
    if os.environ.get("RANK") is not None and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        raise RuntimeError(f"planted failure on rank {os.environ['RANK']}")
    return tiny_lm()


def hangs_on_last_rank() -> nn.Module:
    if os.environ.get("RANK") is not None and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        time.sleep(3600)
    return tiny_lm()
