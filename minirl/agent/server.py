"""One engine, many agent loops: the engine steps while the loops wait for it or for their tools.

Every loop is an asyncio task on one event loop. A loop is *busy* while it runs its own code,
and idle while it awaits the engine (EngineServer.generate) or a tool (EngineServer.idle). The
server steps the engine only when no loop is busy: every request a loop is about to submit is
then in the engine's queue, so a batch of single-turn loops submits exactly what generate()
would, in the same order, and samples the same tokens. While some loops wait for a slow tool,
the others' requests keep decoding: the engine steps whenever nobody is busy, whatever the tools
are doing, and tools run in threads or processes, not on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from minirl.protocols import RolloutEngine, SamplingParams, TurnOutput

T = TypeVar("T")


class EngineServer:
    def __init__(self, engine: RolloutEngine, num_loops: int):
        self.engine = engine
        self.busy = num_loops  # every loop starts running its own code
        self.turns: dict[str, asyncio.Future] = {}
        self.wake = asyncio.Event()
        self.steps = 0

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TurnOutput:
        """Submit one request (n = 1) and wait for its turn to finish."""
        future = asyncio.get_running_loop().create_future()
        self.engine.submit(request_id, prompt_ids, params)
        self.turns[request_id] = future
        self._went_idle()
        return await future  # the server counted this loop busy again when it set the result

    async def idle(self, awaitable: Awaitable[T]) -> T:
        """Await something other than the engine (a tool call) without holding the engine up."""
        self._went_idle()
        try:
            return await awaitable
        finally:
            self.busy += 1

    def loop_finished(self) -> None:
        self._went_idle()

    def _went_idle(self) -> None:
        self.busy -= 1
        self.wake.set()

    async def serve(self) -> None:
        """Step the engine whenever no loop is busy and it has work; until cancelled."""
        while True:
            if self.busy > 0 or not self.engine.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            turns = self.engine.step()
            self.steps += 1
            for turn in turns:
                future = self.turns.pop(turn.request_id, None)
                if future is not None and not future.done():
                    self.busy += 1  # its loop runs again from here on
                    future.set_result(turn)
            await asyncio.sleep(0)  # let the loops woken above (and finished tools) run

    def abort_all(self) -> None:
        """A loop failed: stop every request still in the engine and drain it."""
        for request_id in list(self.turns):
            self.engine.abort(request_id)
        while self.engine.has_work():
            self.engine.step()
        self.turns.clear()
