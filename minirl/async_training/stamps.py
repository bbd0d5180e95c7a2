"""Which weight version sampled each token: an EngineServer that stamps the turns it hands back,
so that the agent loops run unchanged. The trainer measures a sample's staleness by its oldest
token (minirl.async_training.batches)."""

from __future__ import annotations

from minirl.agent.server import EngineServer
from minirl.protocols import SamplingParams, TurnOutput


class StampingServer(EngineServer):
    def __init__(self, engine, ordered: bool = False):
        super().__init__(engine, 0, ordered=ordered)
        self.stamps: dict[str, list[int]] = {}  # request id -> the version of each model token so far

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TurnOutput:
        version = self.engine.weight_version  # an engine without per-token versions: the version at submit
        out = await super().generate(request_id, prompt_ids, params)
        stamped = out.versions if out.versions is not None else [version] * len(out.token_ids)
        self.stamps.setdefault(request_id, []).extend(stamped)
        return out

    def take(self, request_id: str, mask: list[int]) -> list[int]:
        """Per response token of the finished request (mask: its response_mask), the version."""
        return token_versions(mask, self.stamps.pop(request_id, []))


def token_versions(mask: list[int], model_versions: list[int]) -> list[int]:
    """Per response token, the weight version that sampled it: the model tokens take the turns'
    versions in order, a tool token the version of the model token before it (the first turn's
    first, at the start). A loop that did not keep every sampled token: all take the oldest."""
    if not model_versions:
        return [0] * len(mask)
    if sum(mask) != len(model_versions):
        return [min(model_versions)] * len(mask)
    out, it, last = [], iter(model_versions), model_versions[0]
    for m in mask:
        if m:
            last = next(it)
        out.append(last)
    return out
