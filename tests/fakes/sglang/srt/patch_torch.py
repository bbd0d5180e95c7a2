"""0.4.x home of monkey_patch_torch_reductions (moved to sglang.srt.utils.patch_torch in 0.5)."""

from sglang._profile import require

require("sglang.srt.patch_torch", until="0.5.0")

from sglang.srt._reductions import monkey_patch_torch_reductions  # noqa: E402, F401
