"""The random streams a checkpoint carries, one file per rank (rng/rank<r>.pt): torch's CPU and
CUDA generators, python's and numpy's, so a resumed run draws what an uninterrupted one would."""

from __future__ import annotations

import io
import os
import random
from typing import Any

import numpy as np
import torch

from minirl.dist.context import DistContext
from minirl.errors import UserError


def capture(device: torch.device) -> bytes:
    """This process's random streams (torch CPU and CUDA, python, numpy) as the bytes of rng/rank<r>.pt."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos)},
        "numpy_gauss": {"has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def restore(path: str, dist: DistContext, trainer_state: dict) -> None:
    """This rank's random streams from checkpoint `path` (new, seeded ones for a rank it lacks)."""
    file = os.path.join(path, "rng", f"rank{dist.rank}.pt")
    if not os.path.isfile(file):
        # a larger world than the checkpoint's: this rank's streams are new (seeded), so the run
        # continues correctly but not bit-identically to an uninterrupted one
        seed = int(trainer_state.get("seed", 0)) + 7919 * int(trainer_state["step"]) + dist.rank
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        return
    try:
        state = torch.load(file, weights_only=True)
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss"]))
        npy, gauss = state["numpy"], state["numpy_gauss"]
        keys = npy["keys"].numpy().astype(np.uint32)
        np.random.set_state((npy["kind"], keys, npy["pos"], gauss["has_gauss"], gauss["cached"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and dist.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], dist.device)
    except Exception as exc:  # noqa: BLE001 - a damaged file of any kind
        raise UserError(
            f"checkpoint file {file} is unreadable ({type(exc).__name__}: {exc}); resume from an older checkpoint"
        ) from None
