"""A plugin for the failure test: rank 1 raises at the end of step 1 (config: plugins.modules)."""

import os

from minirl import hookimpl


@hookimpl
def minirl_on_step_end(step, metrics):
    if os.environ.get("RANK") == "1":
        raise RuntimeError(f"injected failure on rank 1 after step {step}")
