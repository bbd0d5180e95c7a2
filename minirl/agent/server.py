"""One engine, many agent loops: the engine steps while the loops wait for it or for their tools
(ToolTime measures how much of the tools' time it found other samples to decode).

Every loop is an asyncio task; the server steps the engine only when no loop is busy running its
own code, so a batch of single-turn loops submits exactly what generate() would, in its order.
Ordered mode (rollout.multi_turn.deterministic) also holds the engine while tools run and resumes
their loops in call order, for reproducible multi-turn runs (docs/architecture.md, "Rollout").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Awaitable, TypeVar

from minirl.protocols import RolloutEngine, SamplingParams, TurnOutput

T = TypeVar("T")


class EngineServer:
    def __init__(self, engine: RolloutEngine, num_loops: int, ordered: bool = False):
        self.engine = engine
        self.busy = num_loops  # every loop starts running its own code
        self.turns: dict[str, asyncio.Future] = {}
        self.wake = asyncio.Event()
        self.steps = 0
        self.ordered = ordered
        self.gates: list[asyncio.Future] = []  # ordered mode: one per tool wait, in call order
        self.gates_ready = 0  # of those, the waits whose tools are back
        self.tools = ToolTime()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TurnOutput:
        """Submit one request (n = 1) and wait for its turn to finish."""
        future = asyncio.get_running_loop().create_future()
        self.engine.submit(request_id, prompt_ids, params)
        self.turns[request_id] = future
        self._went_idle()
        return await future  # the server counted this loop busy again when it set the result

    async def idle(self, awaitable: Awaitable[T]) -> T:
        """Await something other than the engine (a tool call) without holding the engine up
        (in ordered mode: holding it up, and resuming in call order)."""
        if self.ordered:
            return await self._idle_in_order(awaitable)
        self._went_idle()
        self.tools.out(1)
        try:
            return await awaitable
        finally:
            self.tools.out(-1)
            self.busy += 1

    async def _idle_in_order(self, awaitable: Awaitable[T]) -> T:
        gate = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        self._went_idle()
        self.tools.out(1)
        try:
            result = await awaitable
        finally:  # a failed or cancelled wait counts as back too: it must not hold the others
            self.tools.out(-1)
            self.gates_ready += 1
            self.wake.set()
        await gate  # opened by serve(), which counted this loop busy again
        return result

    def _open_gates(self) -> None:
        """Every tool wait is back: resume the waiting loops in the order they called."""
        gates, self.gates, self.gates_ready = self.gates, [], 0
        self.busy += len(gates)
        for gate in gates:
            if not gate.done():
                gate.set_result(None)

    def loop_finished(self) -> None:
        self._went_idle()

    def _went_idle(self) -> None:
        self.busy -= 1
        self.wake.set()

    async def serve(self, between_steps=None) -> None:
        """Step the engine whenever no loop is busy and it has work; until cancelled.
        between_steps(): awaited before each step (asynchronous training loads new weights there)."""
        while True:
            if self.gates and self.gates_ready == len(self.gates):
                self._open_gates()
            if self.busy > 0 or self.gates or not self.engine.has_work():
                self.wake.clear()
                self.tools.engine_waits(on_tools=self.busy == 0)  # with a call out: nothing to do but wait for it
                await self.wake.wait()
                self.tools.engine_resumes()
                continue
            if between_steps is not None:
                await between_steps()
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


class ToolTime:
    """How much of the time tool calls were out the engine still decoded other samples: wall_s,
    the seconds with at least one call out; engine_idle_s, those of them the engine waited with
    nothing else to do (every loop waiting on a tool, or ordered mode holding it for them). An
    idle stretch ends when the engine steps again or when the last call comes back, whichever is
    first, so the idle seconds are a part of the wall seconds."""

    def __init__(self) -> None:
        self.pending, self.since = 0, 0.0
        self.wall_s = self.engine_idle_s = 0.0
        self.idle_since: float | None = None  # the engine waits on the calls out since then

    def so_far(self) -> tuple[float, float]:
        """(wall_s, engine_idle_s) until now, open stretches included (a server that never drains,
        an asynchronous rollout rank's, is read this way)."""
        now = time.perf_counter()
        wall = self.wall_s + (now - self.since if self.pending else 0.0)
        return wall, self.engine_idle_s + (now - self.idle_since if self.idle_since is not None else 0.0)

    def out(self, change: int) -> None:
        """A call went out (+1) or came back (-1)."""
        now = time.perf_counter()
        if self.pending == 0:
            self.since = now
        self.pending += change
        if self.pending == 0:
            self.wall_s += now - self.since
            self._idle_ends(now)

    def engine_waits(self, on_tools: bool) -> None:
        """The engine stops; on_tools: no loop is running its own code, so with a call out it waits on it."""
        now = time.perf_counter()
        self._idle_ends(now)  # a stretch still open (no resume between two waits) is kept, not lost
        if on_tools and self.pending > 0:
            self.idle_since = now

    def engine_resumes(self) -> None:
        self._idle_ends(time.perf_counter())

    def _idle_ends(self, now: float) -> None:
        if self.idle_since is not None:
            self.engine_idle_s += now - self.idle_since
            self.idle_since = None


def request_level(engine) -> RolloutEngine:
    """The engine itself when it speaks the request level, else GenerateOnly over its generate()."""
    return engine if hasattr(engine, "submit") else GenerateOnly(engine)


class GenerateOnly:
    """The request level over an engine that implements only generate() (a plugin written before
    the request level existed). step() runs the queued turns that share the first one's sampling
    parameters in one generate() call; the samples "X/0", "X/1", ... of one prompt queued one after
    another go as one prompt with n, exactly as the batch rollout called generate() before. A
    continuation is prefilled again (no KV is kept between turns); step k samples with seed + k."""

    def __init__(self, engine):
        self.engine = engine
        self.queue: list[tuple[str, list[int], SamplingParams]] = []
        self.held: dict[str, list[int]] = {}
        self.aborted: list[TurnOutput] = []
        self.paused, self.steps = False, 0

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if params.n != 1:
            raise ValueError("GenerateOnly: submit one sample per request (n = 1)")
        held = self.held.get(request_id)
        if held is not None and prompt_ids[: len(held)] != held:
            raise ValueError(f"continuing request {request_id!r}: prompt_ids must start with its tokens so far")
        self.queue.append((request_id, list(prompt_ids), params))

    def step(self) -> list[TurnOutput]:
        if self.paused:
            raise RuntimeError("step() while paused; call continue_generation() first")
        out, self.aborted = self.aborted, []
        if not self.queue:
            return out
        params = self.queue[0][2]
        taken = [q for q in self.queue if q[2] == params]
        self.queue = [q for q in self.queue if q[2] != params]
        groups = _groups(taken)
        n = len(groups[0])
        if any(len(g) != n for g in groups):
            groups, n = [[q] for q in taken], 1
        seed = None if params.seed is None else params.seed + self.steps
        self.steps += 1
        completions = self.engine.generate([g[0][1] for g in groups], replace(params, n=n, seed=seed))
        for (request_id, prompt, _), c in zip([q for g in groups for q in g], completions):
            self.held[request_id] = prompt + list(c.token_ids)
            out.append(TurnOutput(request_id, list(c.token_ids), c.logprobs, c.finish_reason))
        return out

    def has_work(self) -> bool:
        return bool(self.queue or self.aborted)

    def abort(self, request_id: str) -> None:
        for i, (queued, _, _) in enumerate(self.queue):
            if queued == request_id:
                del self.queue[i]
                self.aborted.append(TurnOutput(request_id, [], [], "abort"))
                return

    def release(self, request_id: str) -> None:
        self.held.pop(request_id, None)

    def pause_generation(self) -> None:
        self.paused = True

    def continue_generation(self) -> None:
        self.paused = False

    def __getattr__(self, name: str):  # last_stats, load_weights, ...: the engine's own
        return getattr(self.engine, name)


def _groups(queued: list) -> list[list]:
    """Consecutive samples "X/k" of one prompt, together."""
    groups: list[list] = []
    for q in queued:
        last = groups[-1][-1] if groups else None
        same = last is not None and "/" in q[0] and last[0].rsplit("/", 1)[0] == q[0].rsplit("/", 1)[0]
        if same and last[1] == q[1]:
            groups[-1].append(q)
        else:
            groups.append([q])
    return groups
