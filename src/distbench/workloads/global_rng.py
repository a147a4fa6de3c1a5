"""The process's global random generators, which users' models draw from: torch's CPU generator (torch.rand on
the host, a sampler's randperm), each CUDA device's (nn.Dropout, SDPA's dropout_p, masking on the device),
numpy's global RandomState and Python's `random` (data augmentation).

A resume must put every one of them back as each rank left it, or the resumed run draws other masks and
augmentations than the uninterrupted one. States are held as tensors and plain values, so a checkpoint holding
them loads through torch.load(weights_only=True). CUDA's are taken for every visible device, as HF's Trainer
and Lightning do: a rank may use devices besides its own. A device's generator is host-side state (a seed and
an offset), which torch.manual_seed already sets for every visible device in every rank.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch

#: What `capture` holds, one entry per generator (CUDA's is a list over the visible devices).
GENERATORS = ("torch", "cuda", "numpy", "python")


def seed_all(seed: int) -> None:
    """Seed every global generator alike (torch's seeds each CUDA device too), so that a model built from
    `seed` is the same on every rank whichever generator its initialisation draws from."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def capture() -> dict[str, Any]:
    """Every global generator's state. CUDA's only once CUDA is initialised: reading it earlier would
    initialise CUDA in a process that never used it (the pytest process)."""
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    name, keys, pos, has_gauss, gauss = legacy
    version, internal, gauss_next = random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": {"version": int(version), "internal": torch.tensor(internal), "gauss_next": gauss_next},
    }


def restore(state: dict[str, Any]) -> None:
    """Put back what `capture` took; KeyError, TypeError or ValueError on a state of another shape. CUDA
    states are restored for the devices this process has (a device it lacks cannot have drawn here)."""
    missing = [g for g in GENERATORS if g not in state]
    if missing:
        raise KeyError(f"no state for the {', '.join(missing)} generator(s)")
    cuda = list(state["cuda"])
    if cuda and torch.cuda.is_available():
        for index, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, index)
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["internal"].tolist()), p["gauss_next"]))
    torch.set_rng_state(state["torch"])


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Run code that may seed or draw (a user's model factory probed for its vocabulary) without moving any
    global generator: what is inside leaves training's random streams where they were."""
    saved = capture()
    try:
        yield
    finally:
        restore(saved)
