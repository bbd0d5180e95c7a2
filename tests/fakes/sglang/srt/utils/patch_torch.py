"""0.5.x home of monkey_patch_torch_reductions."""

from sglang._profile import require

require("sglang.srt.utils.patch_torch", since="0.5.0")

from sglang.srt._reductions import monkey_patch_torch_reductions  # noqa: E402, F401
