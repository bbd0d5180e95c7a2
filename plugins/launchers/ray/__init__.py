"""The `ray` launcher: the same SPMD job on the nodes of a Ray cluster (docs/multinode.md). Ray is
imported only when this launcher runs; without it the error names the extra to install.
"""

from __future__ import annotations

from minirl import hookimpl
from minirl.errors import UserError


def launch_ray(cfg, pm, job) -> int:
    """Run job on nnodes x (n_gpus_per_node GPUs, or world_size / nnodes CPU workers) Ray actors."""
    try:
        import ray  # noqa: F401 - only to name the missing extra
    except ModuleNotFoundError as exc:
        from minirl.dist.launchers import choose

        _, why = choose(cfg.trainer)
        raise UserError(
            f"the ray launcher (chosen because {why}) needs Ray, which is not installed: pip install 'minirl[ray]'"
        ) from exc
    from minirl_plugins.launchers.ray.driver import launch

    return launch(cfg, pm, job)


@hookimpl
def minirl_launchers():
    return {"ray": launch_ray}
