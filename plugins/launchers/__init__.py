"""The launchers of one machine: `local` (this process, or one spawned worker per device) and
`torchrun` (this process is one of torchrun's workers). See minirl.dist.launchers."""

from __future__ import annotations

from minirl import hookimpl
from minirl.dist.launchers.local import launch_local, launch_torchrun


@hookimpl
def minirl_launchers():
    return {"local": launch_local, "torchrun": launch_torchrun}
