"""Runs tests/distributed/test_fsdp2_gpu.py's comparisons on one GPU (world 1), for a machine without two.

The test's worker and assertions, bf16 and offload included, minus the 2-rank NCCL part.

    python3 dev/gpu_fsdp2_world1.py
"""

import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
import test_fsdp2_gpu as t  # noqa: E402

# a spawned worker re-runs this module's top level, so it sees the same one-GPU settings
t.BASE = tuple(x for x in t.BASE if not x.startswith("trainer.n_gpus_per_node")) + ("trainer.n_gpus_per_node=1",)

if __name__ == "__main__":
    from minirl.dist.launchers import spawn

    out = os.path.join(os.environ.get("OUT", "."), "fsdp2_world1.json")
    assert spawn.spawn(t._worker, 1, (out,)) == 0
    results = json.load(open(out))
    print(json.dumps(results, indent=1))
    failed = []
    for name in dir(t):
        if name.startswith("test_"):
            try:
                getattr(t, name)(results)
                print("PASS", name)
            except AssertionError as exc:
                failed.append(name)
                print("FAIL", name, exc)
    sys.exit(1 if failed else 0)
