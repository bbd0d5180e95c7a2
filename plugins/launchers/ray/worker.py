"""The actor one rank lives in. Its runtime_env sets torchrun's variables before torch starts, so
`run` goes through `init_from_env` like every other launcher. A plain synchronous actor on
purpose: `run` executes on the main thread, where the trainer's SIGTERM/SIGINT handler can be
installed.
"""

from __future__ import annotations

import os
import sys

from minirl.dist.launchers import Report, report_of


class RankActor:
    def __repr__(self) -> str:
        # Ray prefixes the lines this actor prints with its repr: "(rank3 pid=..., ip=...)"
        return f"rank{os.environ.get('RANK', '?')}"

    def pid(self) -> int:
        return os.getpid()

    def run(self, cfg, job, cwd: str) -> Report | None:
        """Run job on this rank; None when it finished, else its report (never raises)."""
        from minirl.dist import spmd
        from minirl.plugins import PluginManager

        if os.path.isdir(cwd):
            os.chdir(cwd)  # relative paths of the config mean what they mean on the driver
        try:
            dist = spmd.init_from_env(cfg, _device_index())
            job(cfg, PluginManager(cfg.plugins.modules), dist)
            return None
        except BaseException as exc:  # noqa: BLE001 - every end is reported, the driver decides
            return report_of(exc)
        finally:
            spmd.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()


def _device_index() -> int | None:
    """This rank's CUDA device: Ray shows an actor only its own GPU (cuda:0), unless the cluster
    runs with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, when it is the GPU Ray assigned."""
    import ray

    gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    if not gpus:
        return None
    return int(gpus[0]) if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") else 0
