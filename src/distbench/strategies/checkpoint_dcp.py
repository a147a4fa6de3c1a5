"""Sharded checkpoints through torch.distributed.checkpoint (DCP), shared by FSDP2 and FSDP1.

DCP stores each tensor shard with its global layout, so a checkpoint saved at one world size loads at
another (resharding). get_state_dict/set_state_dict key optimizer state by parameter name, which is what
makes optimizer state reshardable too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..errors import CheckpointError, first_line
from .base import Trainer, torch_load
from .checkpoint_files import SafeFileSystemReader, verify_manifest, weights_only_loads


class DCPCheckpointMixin(Trainer):
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def save_checkpoint(self, path: str) -> None:
        """DCP's files, without its fsync of each: the suite reads its checkpoints back in the same session
        and never after a crash of the machine, and the fsyncs cost 0.2-1.6 s per 640 MiB on the CPU tier's
        disk against 0.27 s for the write itself. The bytes written are the same."""
        Path(path).mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp_dir = os.path.join(path, "dcp")
        dcp.save(
            {"model": model_sd, "optimizer": optim_sd},
            storage_writer=dcp.FileSystemWriter(dcp_dir, sync_files=False),
        )
        if self.ctx.rank == 0:
            torch.save(
                {"scheduler": self.scheduler.state_dict(), "world_size": self.ctx.world_size},
                os.path.join(path, "trainer.pt"),
            )
        self.save_extra_state(path)
        self.seal_checkpoint(path)

    def load_checkpoint(self, path: str, *, reshard: bool = False) -> None:
        """Load a DCP checkpoint. `reshard=True` accepts one saved at another world size (fresh RNG then)."""
        verify_manifest(path)
        meta = torch_load(os.path.join(path, "trainer.pt"))
        saved_ws = int(meta["world_size"])
        if saved_ws != self.ctx.world_size and not reshard:
            raise CheckpointError(
                f"checkpoint {path} was saved at world size {saved_ws}, this run has {self.ctx.world_size}; "
                "load it with resharding (load_checkpoint(path, reshard=True) / --reshard) to continue at a "
                "new world size"
            )
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        dcp_dir = os.path.join(path, "dcp")
        SafeFileSystemReader(
            dcp_dir
        ).read_metadata()  # a refusal names the file; inside dcp.load it is wrapped
        try:
            with weights_only_loads():
                dcp.load(state, checkpoint_id=dcp_dir, storage_reader=SafeFileSystemReader(dcp_dir))
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            first = first_line(str(e)) or type(e).__name__
            raise CheckpointError(
                f"cannot load DCP checkpoint {path}: {first} (missing, truncated, or saved "
                "from a different model)"
            ) from e
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(strict=True),
        )
        self.scheduler.load_state_dict(meta["scheduler"])
        if saved_ws == self.ctx.world_size:
            self.restore_extra_state(path)
        else:
            self.load_progress(torch_load(os.path.join(path, "extra_rank0.pt")))
