"""Compiling ahead (model.precompile): with model.compile_layers on one CUDA process, a second process
compiles the decoder layers' graphs into inductor's on-disk caches while this one builds its
rollout engine and generates step 1's rollouts; this process's first passes then load the graphs
instead of compiling them. Nothing else changes: a graph from the cache is the graph this process
would have compiled (same bits, tests/integration/test_precompile.py).

Why: compiling is most of step 1 with compiled layers (56 s of a LoRA step 1's 70 s on the H200,
38 s of the 28k-token step's), and it is host work, while the generation before the first
compiled pass is device work. A process, not a thread: dynamo is not thread-safe, and the
compiler's Python would take the GIL from the engine's decode loop.

The twin: the same config with the decoder cut to TWIN_LAYERS layers and the vocabulary to
TWIN_VOCAB, random weights. A layer's graphs depend on its shapes and dtypes, the pass's grad
mode and which tensors need gradients, never on the depth, the vocabulary or the values; three
layers hold every variant the real model compiles (a recomputed layer and a kept one under
model.recompute_num_layers, and layer 0 as the first: under LoRA's frozen embedding its input
needed no gradient until minirl.models.compile made it need one, as every layer's does). It
runs the trainer's own passes, in the trainer's order, on one two-sequence micro-batch of about
the trainer's size (twin_tokens says why): the gradient-free passes (the prev-log-prob pass
unless on-policy, the reference's), then the update's forward and backward. The order matters:
dynamo makes a stride it saw change between two compiles of a function a symbol of its own in
the later graphs, so only the same sequence of compiles gives the same graphs. Inductor's
FX-graph and AOTAutograd caches key a compiled graph by the graph and its inputs' metadata, so
the trainer then finds each one there.

The hand-over (docs/architecture.md, "Compiling ahead"): the twin starts with the trainer
(importing torch takes seconds), touches the device only once the engine has sized its KV cache
from the free memory (`go`), and reports each pass it finished. At its first compiled pass the
trainer stops a twin that is not done (after model.precompile_wait_s, 0 by default) and compiles
what the cache lacks itself: a graph the twin has not finished costs this process its whole
compile either way, and one finished by the twin costs its tracing again when it is loaded, so
waiting for the twin never beats compiling here by more than the graph it is in the middle of.
A twin pays where the generation before the first compiled pass outlasts its compile (the 28k
step's 151 s), and a short one costs little: its work is on other cores and its device memory
meets only the generation's. A twin that fails says why once, naming its log.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time

import torch

from minirl import adapter, build
from minirl.dist import spmd
from minirl.dist.context import DistContext
from minirl.dist.launchers.spawn import exit_with_parent
from minirl.errors import describe
from minirl.forward.packed import logprob_head, packed_forward, response_logprobs
from minirl.models import assembly, lora
from minirl.models.attention import ATTN_NAME
from minirl.models.loading import random_model
from minirl.models.presets import preset_config
from minirl.plugins import PluginManager
from minirl.update.actor import logprob_temperature, on_policy

TWIN_LAYERS = 3  # layer 0, a recomputed layer, a kept one (model.recompute_num_layers)
TWIN_VOCAB = 512
TWIN_NICENESS = 10  # a twin nobody waits for yields the CPU to the trainer (twin_niceness)
# where generating is device work, which the twin's host work can overlap (tests add the CPU)
OVERLAPPING_DEVICES = ("cuda",)
NO_GRAD, UPDATE = "gradient-free passes", "update"
_GO, _DONE, _FAILED, _LEAVING = "go", "done", "failed", "leaving"


def reason_off(cfg, dist: DistContext) -> str:
    """Why no twin compiles ahead for this run ("" when one can)."""
    if not (cfg.model.precompile and cfg.model.compile_layers):
        return "off"
    if dist.world_size != 1:
        return "several processes (each rank compiles its own)"
    if dist.device.type not in OVERLAPPING_DEVICES:
        return f"a {dist.device.type} run: generating is host work there too, so there is nothing to overlap"
    from torch._functorch import config as aot_config
    from torch._inductor import config as inductor_config

    disabled = getattr(torch.compiler.config, "force_disable_caches", False)
    if disabled or not (inductor_config.fx_graph_cache and aot_config.enable_autograd_cache):
        return "inductor's caches are off (TORCHINDUCTOR_FORCE_DISABLE_CACHES or its config)"
    return ""


class Precompile:
    """The trainer's side of the twin: `go()` once the engine is built, `wait()` before every
    compiled pass (only the first waits), `metrics()` each step, `close()` at the end. Without a
    twin every call is a no-op."""

    def __init__(self, process=None, conn=None, passes: tuple[str, ...] = (), log: str = "", wait_s: float = 0.0):
        self.process, self.conn, self.passes, self.log, self.wait_s = process, conn, passes, log, wait_s
        self.finished: list[str] = []  # the twin's passes done, in its order
        self.failed = self.released = self.eof = self.leaving = self._reported = False
        self.waited_s = 0.0

    def describe(self) -> str:
        if self.process is None:
            return ""
        return (
            f"compiling ahead: a second process (pid {self.process.pid}) compiles the layers' graphs of the "
            f"{' and the '.join(self.passes)} into inductor's cache while the engine starts and generates "
            "(model.precompile)"
        )

    def go(self) -> None:
        if self.process is not None:
            self._send(_GO)

    def wait(self) -> None:
        """Before the trainer's first compiled pass: give a twin still compiling up to wait_s to
        finish every pass, then stop it either way (what it finished is in the cache). Not only
        the pass at hand's: the twin's device memory (its micro-batch is the trainer's size) then
        never adds to a pass of the trainer's."""
        if self.process is None or self.released:
            return
        self._drain()
        if not self.failed:
            self._wait_for_all()
        self.close()

    def metrics(self) -> dict[str, float]:
        """compile/precompile_wait_s, compile/precompile_passes (finished) and
        compile/precompile_unfinished (stopped or failed before them), once the twin is done with."""
        if self.process is None or self._reported or not (self.released or self.failed):
            return {}
        self._reported = True
        done = len(self.finished)
        return {
            "compile/precompile_wait_s": self.waited_s,
            "compile/precompile_passes": float(done),
            "compile/precompile_unfinished": float(len(self.passes) - done),
        }

    def close(self) -> None:
        """Stop the twin if it still runs. A twin that is done leaves by itself (a signal would cut
        its clean-up short); one still compiling gets SIGTERM, on which it unwinds and shuts its
        compile workers down (1.4-2.1 s on 2 CPU cores, measured), then SIGKILL. Not SIGKILL at
        once: the semaphores of its compile workers belong to the resource tracker it shares with
        this process, which would warn of them at this process's exit."""
        if self.process is None or self.released:
            return
        self.released = True
        self._drain()
        if self.leaving or self.eof or len(self.finished) == len(self.passes):  # on its way out
            self.process.join(timeout=30)
        for stop in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                stop()
                self.process.join(timeout=10)
        if not self.failed and os.path.exists(self.log):  # kept only to explain a failure
            os.remove(self.log)

    def _wait_for_all(self) -> None:
        """Until every pass is done, the twin fails or exits, or wait_s runs out (then close()
        stops it: not a failure, the compile note of step 1 says how far it got)."""
        start = time.perf_counter()
        while not self.failed and len(self.finished) < len(self.passes):
            left = start + self.wait_s - time.perf_counter()
            if left <= 0:
                break
            elif not self.eof and self.conn.poll(min(left, 1.0)):
                self._receive()
            elif self.eof or not self.process.is_alive():
                self._drain()
                if len(self.finished) < len(self.passes) and not self.failed:
                    self.process.join(timeout=10)
                    self._fail(f"exited with status {self.process.exitcode} before it finished")
        self.waited_s = time.perf_counter() - start

    def _drain(self) -> None:
        while not self.failed and self._poll():
            self._receive()

    def _poll(self) -> bool:
        try:
            return not self.eof and self.conn.poll()
        except (EOFError, OSError):
            self.eof = True
            return False

    def _receive(self) -> None:
        try:
            what, detail = self.conn.recv()
        except (EOFError, OSError):  # the twin exited; what it finished, it reported before
            self.eof = True
            return
        if what == _DONE:
            self.finished.append(detail)
        elif what == _LEAVING:
            self.leaving = True
        else:
            self._fail(detail)

    def _send(self, message: str) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            self._drain()

    def _fail(self, why: str) -> None:
        self.failed = True
        self.close()
        note = f"compiling ahead: the second process {why}; this process compiles the rest (log: {self.log})"
        print(f"minirl: notice: {note}", file=sys.stderr, flush=True)


def start(cfg, dist: DistContext) -> Precompile:
    """Start the twin unless `reason_off`; returns the trainer's handle (a no-op one without a twin)."""
    if reason_off(cfg, dist):
        return Precompile()
    passes = twin_passes(cfg)
    ctx = multiprocessing.get_context("spawn")  # fork would copy this process's CUDA and thread state
    ours, theirs = ctx.Pipe()
    log = os.path.join(tempfile.gettempdir(), f"minirl-precompile-{os.getpid()}.log")
    process = ctx.Process(
        target=_twin_main, args=(cfg, passes, theirs, log, os.getpid()), name="minirl-precompile", daemon=True
    )
    process.start()
    theirs.close()
    return Precompile(process, ours, passes, log, cfg.model.precompile_wait_s)


def twin_passes(cfg) -> tuple[str, ...]:
    """The passes whose graphs the twin compiles, in the trainer's order."""
    no_grad = _prev_log_prob_pass(cfg) or build.needs_reference(cfg)
    return ((NO_GRAD,) if no_grad else ()) + (UPDATE,)


def _prev_log_prob_pass(cfg) -> bool:
    """The trainer runs the prev-log-prob pass (one process: its rollouts are its own, so only
    the on-policy shortcut skips it; Trainer.on_policy)."""
    return not on_policy(cfg.actor, cfg.data.train_batch_size, cfg.algorithm.use_kl_in_reward)


# ---------------------------------------------------------------------------------------------
# the twin's process
# ---------------------------------------------------------------------------------------------


def _twin_main(cfg, passes: tuple[str, ...], conn, log: str, parent_pid: int) -> None:
    """The twin process: its output to `log`, Ctrl-C left to the trainer, at twin_niceness."""
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    os.nice(twin_niceness(cfg.model))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it ends us
    signal.signal(signal.SIGTERM, _unwind)
    threading.Thread(target=exit_with_parent, args=(parent_pid,), daemon=True).start()
    serve(conn, lambda report: run_twin(cfg, passes, report))


def twin_niceness(model_cfg) -> int:
    """How much lower the twin's CPU priority is than the trainer's (its compile workers inherit
    it). A twin the trainer does not wait for (model.precompile_wait_s = 0) only fills cores the
    trainer leaves idle: it must not take them from the engine's decode loop, whose launches
    pace the generation it overlaps. One the trainer waits for runs at the trainer's priority:
    a lower one let other work on the machine starve it (390 s for 35 s of compiling beside a
    test run on 2 cores), and that wait was the trainer's."""
    return 0 if model_cfg.precompile_wait_s > 0 else TWIN_NICENESS


def serve(conn, run) -> None:
    """The twin's side of the hand-over: wait for `go`, run(report) the passes (report(kind) after
    each), then say it is leaving; a failure is reported, then raised."""
    try:
        if conn.recv() != _GO:
            return
        run(lambda kind: conn.send((_DONE, kind)))
        conn.send((_LEAVING, ""))
    except BaseException as exc:  # the trainer compiles instead
        conn.send((_FAILED, f"failed: {describe(exc)}"))
        raise


def _unwind(signum, frame) -> None:
    """SIGTERM from the trainer: leave through the interpreter's exit, which shuts the compile
    workers down (a SIGKILL would leave their semaphores to the resource tracker's warning)."""
    raise SystemExit(0)


def run_twin(cfg, passes: tuple[str, ...], report=lambda kind: None) -> None:
    """Build the twin (this process's device, a one-rank group on CUDA as the trainer has) and
    run `passes`, calling report(kind) after each."""
    dist = spmd.single_process(cfg)
    try:
        twin_cfg = twin_config(cfg)
        dtype, attn = getattr(torch, cfg.model.dtype), cfg.model.attn_implementation or ATTN_NAME
        model = random_model(twin_model_config(cfg.model), dist.device, dtype, attn_implementation=attn)
        models = adapter.assemble(PluginManager(cfg.plugins.modules), model, twin_cfg, dist, build.needs_reference(cfg))
        for kind in passes:
            (_update_pass if kind == UPDATE else _no_grad_passes)(models, cfg, dist)
            report(kind)
    finally:
        spmd.shutdown()


def twin_config(cfg):
    """The run's config for the twin: recompute_num_layers mapped onto TWIN_LAYERS layers (the
    same variants: recomputed and kept layers where the real model has both), and a LoRA adapter
    to continue from replaced by fresh adapters of its shape (its weights fit only the full depth)."""
    m = cfg.model
    real = _model_config(m).num_hidden_layers
    layers = min(real, TWIN_LAYERS)
    recompute = m.recompute_num_layers
    if 0 < recompute < real:
        recompute = min(recompute, layers - 1)
    elif recompute >= real:
        recompute = -1
    model_cfg = dataclasses.replace(m, recompute_num_layers=recompute)
    if m.lora_adapter_path:
        saved = lora.peft_config(m)
        model_cfg = dataclasses.replace(
            model_cfg,
            lora_adapter_path="",
            lora_rank=saved.r,
            lora_alpha=saved.lora_alpha,
            target_modules=_listed(saved.target_modules),
            exclude_modules=_listed(saved.exclude_modules) or [],
            lora_dropout=saved.lora_dropout,
        )
    return dataclasses.replace(cfg, sections={**cfg.sections, "model": model_cfg})


def twin_model_config(model_cfg):
    """The model's transformers config cut to TWIN_LAYERS layers and a TWIN_VOCAB vocabulary."""
    config = _model_config(model_cfg)
    config.num_hidden_layers = min(config.num_hidden_layers, TWIN_LAYERS)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    config.vocab_size = min(config.vocab_size, TWIN_VOCAB)
    if isinstance(config.pad_token_id, int) and config.pad_token_id >= config.vocab_size:
        config.pad_token_id = None  # the embedding's padding row would lie past the cut vocabulary
    return config


def _model_config(model_cfg):
    if model_cfg.path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(os.path.expanduser(model_cfg.path), local_files_only=True)
    return preset_config(model_cfg.preset)


def _listed(value):
    """peft keeps target_modules as a set (or a regex string); the config wants a list or a string."""
    return sorted(value) if isinstance(value, (set, frozenset, list, tuple)) else value


def twin_tokens(cfg, kind: str) -> int:
    """About the tokens of the trainer's first micro-batch of `kind`: the pass's token budget
    (use_dynamic_bsz), else its sequences per micro-batch at full length. A compiled graph
    carries the sizes it was first run at as its kernels' size hints (block sizes, the configs
    autotuning picks), and inductor's cache keys ignore them, so the twin runs at the trainer's."""
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    if kind == UPDATE:
        a = cfg.actor
        return a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu * seq
    p = cfg.rollout if _prev_log_prob_pass(cfg) else cfg.ref  # the first gradient-free pass
    return p.log_prob_max_token_len_per_gpu if p.log_prob_use_dynamic_bsz else p.log_prob_micro_batch_size_per_gpu * seq


def _batch(tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two sequences of `tokens` in all (a third and two thirds), each a quarter prompt."""
    tokens = max(tokens, 8)
    lengths = (tokens // 3, tokens - tokens // 3)
    prompt = [max(1, n // 4) for n in lengths]
    prompts = [[1 + (i % 97) for i in range(p)] for p in prompt]
    responses = [[2 + (i % 89) for i in range(n - p)] for n, p in zip(lengths, prompt)]
    return prompts, responses


def _update_pass(models, cfg, dist: DistContext) -> None:
    """The update's forward and backward (minirl.update.actor: train mode, log-probs and entropies)."""
    actor = models.actor
    prompts, responses = _batch(twin_tokens(cfg, UPDATE))
    actor.train()
    logp, ent = response_logprobs(actor, prompts, responses, logprob_temperature(cfg.rollout), dist.device, True)
    (logp.sum() + ent.sum()).backward()
    actor.zero_grad(set_to_none=True)
    actor.eval()


def _no_grad_passes(models, cfg, dist: DistContext) -> None:
    """The prev-log-prob pass (unless on-policy) and the reference's, as Trainer.log_probs runs them."""
    prompts, responses = _batch(twin_tokens(cfg, NO_GRAD))
    head = logprob_head(logprob_temperature(cfg.rollout))
    with torch.no_grad():
        if _prev_log_prob_pass(cfg):
            packed_forward(models.actor, prompts, responses, dist.device, head)
            assembly.reshard(models.actor)
        if models.reference is not None:
            with models.reference() as ref:
                packed_forward(ref, prompts, responses, dist.device, head)
                assembly.reshard(ref)
