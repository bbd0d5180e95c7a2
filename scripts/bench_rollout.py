"""Benchmark the native rollout engine against transformers' generate on one device.

    python scripts/bench_rollout.py                      # H200: both workloads, HF included
    python scripts/bench_rollout.py --shape tiny --device cpu --workloads smoke   # smoke test

Model: the Qwen2-1.5B shape (DeepSeek-R1-Distill-Qwen-1.5B: 28 layers, hidden 1536, 12 heads,
2 KV heads, MLP 8960, vocabulary 151936, untied head), random weights, bfloat16, EOS ignored.
Workloads (prompts x prompt tokens x new tokens): w1 = 128 x 256 x 512, w2 = 512 x 256 x 2048,
w3 = 256 x 100 x 1024 (the generation of the 32 x 8 x 1,024 training workload of docs/benchmarks.md),
l14 = 64 x 14,000 x 256 (the 28k long-context step's decode at its middle; with --kv-cache-dtype fp8).
--quantization fp8 runs the layers' GEMMs on e4m3 weights and activations; the roofline stays the
bf16 model's bytes.

Multi-turn (--multi-turn): 256 samples x 3 assistant turns x 256 tokens with 64-token tool replies
between the turns, through the agent-loop path (minirl.agent: one loop per sample, the engine
keeping each conversation's KV cache), against one 768-token turn per sample (the same model
tokens, the same path); reported: model tokens per second of each and their ratio. Then with each
tool call waiting 0.5 s, at equal turn lengths (every sample reaches its tool at the same step)
and staggered ones (128/256/384 tokens rotated over the samples, the same 768 per sample): how
long the engine sat idle while a tool was out.

Decode roofline: every decode step must read all weights it multiplies with (every parameter
except the input embedding table, of which it reads one row per sequence) plus the live KV cache
of every row; those bytes over 4.28 TB/s (H200 HBM, measured copy bandwidth) give the step's
least time. Reported: roofline time over wall time of the whole generate (prefill and host work
included), and over the device time of the decode steps alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from minirl.config.schema import RolloutConfig
from minirl.protocols import EngineContext, SamplingParams
from minirl_plugins.engines.native import build_native_engine
from minirl_plugins.engines.native.layers import paged_attention
from minirl_plugins.engines.native.weights import weights_checksum

BANDWIDTH = 4.28e12
# w3: the 32 x 8 x 1,024 training workload's generation (32 prompts x 8 samples, gsm8k prompts of
# about 100 tokens, 1,024 new)
WORKLOADS = {
    "w1": (128, 256, 512),
    "w2": (512, 256, 2048),
    "w3": (256, 100, 1024),
    "l14": (64, 14000, 256),  # the 28k step's decode half way through: 64 rows at ~14k tokens of context
    "l28": (64, 100, 27648),  # the 28k step's generation (4 prompts x 16 samples there), every row to the budget
    "smoke": (8, 16, 12),
}
SHAPES = ("qwen2-1.5b", "tiny")  # minirl.models presets (random weights)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args, device, dtype):
    from transformers import Qwen2ForCausalLM

    from minirl.models.presets import preset_config

    config = preset_config(args.shape)
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen2ForCausalLM(config).to(dtype).eval()
    rollout = RolloutConfig(
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
    )
    longest = max((sum(WORKLOADS[w][1:]) for w in args.workloads.split(",") if w), default=0)
    if args.micro or args.sweep_attention:  # their contexts index the rotary table too
        longest = max([longest] + [ctx for _, ctx in shapes(args.micro_shapes)])
    ctx = EngineContext(config, hf, device, dtype, (), 0, extra={"max_model_len": max(4096, longest + 8)})
    engine = build_native_engine(rollout, ctx)
    for name in filter(None, args.ops_off.split(",")):  # an A/B: the op's torch reference instead
        setattr(engine.ops, name, getattr(type(engine.ops), name))
        engine.ops.chosen.pop(name, None)
    return config, hf, engine


def weight_load(engine, hf, device) -> dict:
    times = []
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        engine.load_weights(hf.named_parameters())
        sync(device)
        times.append(time.perf_counter() - start)
    same = engine.checksum() == weights_checksum(hf.named_parameters(), engine.dtype)
    return {
        "weight_load_s": statistics.median(times),
        "checksum_equal": same,
        "parameters": sum(p.numel() for p in hf.parameters()),
    }


def prompts_for(batch, prompt_len, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist()


def decode_weight_bytes(hf) -> int:
    """Weight bytes one decode step reads: every parameter but an untied input embedding table,
    of which it reads one row per sequence."""
    embed = hf.get_input_embeddings().weight
    untied = embed is not hf.get_output_embeddings().weight
    return (sum(p.numel() for p in hf.parameters()) - embed.numel() * untied) * embed.element_size()


@dataclass
class StepRecord:
    """What a step read, and device events around it."""

    kind: str
    rows: int
    kv_tokens: int  # summed over the steps: tokens whose K and V the steps read
    steps: int
    start: object = None
    end: object = None


def record_steps(runner, records: list) -> None:
    """Wrap the runner's prefill and decode (instance attributes over the methods; `del` them to
    undo) so that each step appends its StepRecord."""
    for kind in ("prefill", "decode"):
        setattr(runner, kind, recorded(runner, kind, getattr(runner, kind), records))


def recorded(runner, kind: str, step, records: list):
    def run(batch, sampler):
        seqs, k = batch.seqs, getattr(batch, "num_steps", 1)
        # seqs' num_cached already counts the k scheduled tokens: step j reads num_cached - k + j + 1
        kv = k * sum(s.num_cached for s in seqs) - len(seqs) * k * (k - 1) // 2 if kind == "decode" else 0
        rec = StepRecord(kind, len(seqs), kv, k)
        if runner.device.type == "cuda":
            rec.start, rec.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            rec.start.record()
        result = step(batch, sampler)
        if rec.end is not None:
            rec.end.record()
        records.append(rec)
        return result

    return run


def run_native(engine, prompts, new_tokens, device, weight_bytes) -> dict:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    records = []
    record_steps(engine.runner, records)
    sync(device)
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    sync(device)
    wall = time.perf_counter() - start
    del engine.runner.prefill, engine.runner.decode
    generated = sum(len(c.token_ids) for c in out)
    assert generated == len(prompts) * new_tokens
    res = {"wall_s": wall, "tokens": generated, "tokens_per_s": generated / wall}
    return {**res, **roofline(engine, records, weight_bytes, device)}


def roofline(engine, records, weight_bytes, device) -> dict:
    decode = [r for r in records if r.kind == "decode"]
    floor = sum(r.steps * weight_bytes + r.kv_tokens * engine.runner.kv_bytes_per_token for r in decode) / BANDWIDTH
    res = {
        "decode_steps": sum(r.steps for r in decode),
        "roofline_s": floor,
        "weight_bytes_per_step": weight_bytes,
        "host_wait_s": engine.last_stats.get("host_wait_s"),
    }
    if device.type == "cuda":
        res["decode_device_s"] = sum(r.start.elapsed_time(r.end) for r in decode) / 1e3
        res["prefill_device_s"] = sum(r.start.elapsed_time(r.end) for r in records if r.kind == "prefill") / 1e3
    return res


class FixedTurns:
    """A bench agent loop: `turns` model turns of `tokens` each (EOS ignored), `tool` token ids
    (fixed random ones, mask 0) between them, `tool_s` seconds of tool wait before each.
    stagger: sample i's turns take (1/2, 1, 3/2, then again) x `tokens` rotated by i, the same
    model tokens per sample, so the samples reach their tools at different steps."""

    def __init__(self, turns: int, tokens: int, tool: list[int], tool_s: float = 0.0, stagger: bool = False):
        self.turns, self.tokens, self.tool, self.tool_s, self.stagger = turns, tokens, tool, tool_s, stagger

    def turn_tokens(self, sample, turn: int) -> int:
        if not self.stagger:
            return self.tokens
        shift = int(sample.request_id.split("/")[0]) + turn
        return self.tokens * (1 + shift % 3) // 2

    async def run(self, ctx, sample):
        import asyncio

        from minirl.protocols import Trajectory

        t = Trajectory(list(sample.prompt_ids), assistant_turns=0)
        context = list(sample.prompt_ids)
        for turn in range(self.turns):
            out = await ctx.generate(sample, context, self.turn_tokens(sample, turn))
            t.response_ids += out.token_ids
            t.response_mask += [1] * len(out.token_ids)
            t.logprobs += out.logprobs
            t.assistant_turns += 1
            t.metrics["cached_tokens"] = t.metrics.get("cached_tokens", 0) + out.cached_tokens
            context += out.token_ids
            if turn + 1 < self.turns:
                if self.tool_s:
                    await ctx.server.idle(asyncio.sleep(self.tool_s))
                t.response_ids += self.tool
                t.response_mask += [0] * len(self.tool)
                t.logprobs += [0.0] * len(self.tool)
                context += self.tool
        return t


def run_agents(engine, prompts, loop, device, weight_bytes: int) -> dict:
    """prompts through the agent-loop path with `loop`; model tokens per second, and the decode
    roofline of the steps it ran (a tool reply in the context is read by every later decode step)."""
    from minirl.agent.loop import AgentRollout, Sample
    from minirl.models.tokenizers import byte_tokenizer
    from minirl.plugins import Registry

    registry = Registry("agent_loops")
    registry.add("bench", lambda cfg: loop, "scripts/bench_rollout.py")
    agents = AgentRollout(RolloutConfig(), registry, None, byte_tokenizer())
    params = SamplingParams(temperature=1.0, max_new_tokens=4096, ignore_eos=True, seed=0)
    samples = [Sample(f"{i}/0", p, params) for i, p in enumerate(prompts)]
    records = []
    record_steps(engine.runner, records)
    sync(device)
    start = time.perf_counter()
    trajectories = agents.run(engine, samples, ["bench"] * len(samples))
    sync(device)
    wall = time.perf_counter() - start
    del engine.runner.prefill, engine.runner.decode
    agents.close()
    model = sum(t.response_mask.count(1) for t in trajectories)
    cached = sum(t.metrics.get("cached_tokens", 0) for t in trajectories)
    tools = agents.last_tool_time  # seconds with a tool out, and the engine's idle ones among them
    return {
        "wall_s": wall,
        "model_tokens": model,
        "tokens_per_s": model / wall,
        "cached_tokens": cached,
        "tool_wall_s": tools.wall_s,
        "engine_idle_on_tools_s": tools.engine_idle_s,
        "prefill_steps": sum(r.kind == "prefill" for r in records),
        **roofline(engine, records, weight_bytes, device),
    }


def multi_turn(engine, config, device, weight_bytes: int) -> dict:
    """256 x 3 turns x 256 tokens, 64-token tool replies; vs one turn of 768; with 0.5 s tools, at
    equal and at staggered turn lengths (the same tokens per sample). ratio: of the model
    tokens per second; roofline_ratio: of the decode rooflines, what the tool replies' KV alone
    costs (the multi-turn run's later steps read them too)."""
    prompts = prompts_for(256, 100, config.vocab_size, seed=1)
    tool = prompts_for(1, 64, config.vocab_size, seed=2)[0]
    run_agents(engine, prompts[:8], FixedTurns(3, 4, tool), device, weight_bytes)  # warm-up: kernels, graphs, extend
    single = run_agents(engine, prompts, FixedTurns(1, 768, tool), device, weight_bytes)
    multi = run_agents(engine, prompts, FixedTurns(3, 256, tool), device, weight_bytes)
    slow = run_agents(engine, prompts, FixedTurns(3, 256, tool, tool_s=0.5), device, weight_bytes)
    staggered = run_agents(engine, prompts, FixedTurns(3, 256, tool, tool_s=0.5, stagger=True), device, weight_bytes)
    out = {"single_turn": single, "multi_turn": multi, "multi_turn_tool_0.5s": slow}
    out["multi_turn_tool_0.5s_staggered"] = staggered
    out["ratio"] = multi["tokens_per_s"] / single["tokens_per_s"]
    out["roofline_ratio"] = single["roofline_s"] / multi["roofline_s"]
    print("multi-turn:", json.dumps(out), flush=True)
    return out


def run_hf(hf, prompts, new_tokens, device, full_new_tokens=None) -> dict:
    """transformers' generate; with full_new_tokens > new_tokens, also the rate of the whole run
    extrapolated from the step times (which grow linearly with the cache length)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps = []

    class StepClock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            sync(device)
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([StepClock()]),
        )
    sync(device)
    wall = time.perf_counter() - start
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    res = {"wall_s": wall, "tokens": generated, "tokens_per_s": generated / wall}
    if full_new_tokens and full_new_tokens > new_tokens and len(stamps) > 8:
        steps = torch.tensor(stamps, dtype=torch.float64).diff()[2:]  # step i+3 -> i+4, cache length grows by one each
        x = torch.arange(3, 3 + len(steps), dtype=torch.float64)
        slope, intercept = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), steps[:, None]).solution[:, 0]
        rest = torch.arange(len(stamps), full_new_tokens, dtype=torch.float64)
        total = (stamps[-1] - start) + float((intercept + slope * rest).sum())
        res.update(
            extrapolated_new_tokens=full_new_tokens,
            extrapolated_wall_s=total,
            extrapolated_tokens_per_s=full_new_tokens * ids.shape[0] / total,
            step_ms_first=float(steps[:8].mean()) * 1e3,
            step_ms_last=float(steps[-8:].mean()) * 1e3,
        )
    return res


def micro(engine, device, batch, ctx, path) -> list[str]:
    """Device time of each decode operation at one batch size, replayed from a CUDA graph."""
    import triton.testing

    spec, ops, dt = engine.spec, engine.ops, engine.dtype
    layer = engine.model.model.layers[0]
    x = torch.randn(batch, spec.hidden_size, device=device, dtype=dt)
    res = torch.randn_like(x)
    qkv = torch.randn(batch, spec.q_size + 2 * spec.kv_size, device=device, dtype=dt)
    gu = torch.randn(batch, 2 * spec.intermediate_size, device=device, dtype=dt)
    h_mid = torch.randn(batch, spec.intermediate_size, device=device, dtype=dt)
    attn_o = torch.randn(batch, spec.q_size, device=device, dtype=dt)
    logits = torch.randn(batch, spec.vocab_size, device=device, dtype=dt)
    pos = torch.full((batch,), ctx - 1, device=device)
    cos, sin = engine.runner.rope
    case = paged_case(spec, batch, ctx, device, dt, kv_dtype=engine.runner.kv.dtype)
    case[3].num_splits = paged_attention.num_splits(batch, spec.num_kv_heads, device)
    w = layer.self_attn
    timed = {
        "qkv_proj (addmm)": lambda: torch.nn.functional.linear(x, w.qkv_weight, w.qkv_bias),
        "o_proj": lambda: torch.nn.functional.linear(attn_o, w.o_proj.weight),
        "gate_up_proj": lambda: torch.nn.functional.linear(x, layer.mlp.gate_up_weight),
        "down_proj": lambda: torch.nn.functional.linear(h_mid, layer.mlp.down_proj.weight),
        "lm_head": lambda: engine.model.compute_logits(x),
        "add_rmsnorm": lambda: ops.add_rmsnorm(x, res, layer.input_layernorm.weight, 1e-6),
        "rope_store": lambda: ops.rope_store(qkv, pos, cos, sin, case[3].slot_mapping_N, *case[1:3], spec.heads),
        "silu_mul": lambda: ops.silu_mul(gu),
        "decode_attention": lambda: ops.decode_attention(*case, spec.heads, spec.head_dim**-0.5),
        "sample (fused)": lambda: ops.fast_sample(logits, engine.runner.sample_params, engine.runner.sample_seed),
    }
    lines = [f"-- decode ops, batch {batch}, context {ctx} (us; graph replay; bytes = weights/KV read)"]
    for name, fn in timed.items():
        fn()
        bench = triton.testing.do_bench_cudagraph
        us = bench(fn) * 1e3
        lines.append(f"{name:20} {us:9.1f}")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def paged_case(spec, batch, ctx, device, dtype, kv_dtype):
    """One layer's paged KV cache with shuffled pages (random_paged_case), every row at `ctx`
    tokens and writing its last token's slot."""
    case = paged_attention.random_paged_case(device, dtype, batch, spec.heads, max_len=ctx, kv_dtype=kv_dtype)
    meta = case[3]
    meta.ctx_lens_B.fill_(ctx)
    meta.slot_mapping_N = meta.page_table[:, -1].long() * meta.page_size + (ctx - 1) % meta.page_size
    return case


LAUNCHES = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (32, 4, 3))  # block_n, warps, stages


def attention_settings(kv_dtype) -> list[dict]:
    """Every decode attention launch the sweep times; an fp8 cache also through float16 dots."""
    upcasts = (False, True) if kv_dtype.itemsize == 1 else (False,)
    return [
        dict(splits=splits, block_n=block_n, num_warps=warps, num_stages=stages, min_chunk=min_chunk, fp8_f16=f16)
        for splits in (1, 2, 4, 8, 16)
        for block_n, warps, stages in LAUNCHES
        for min_chunk in ((64, 256) if splits > 1 else (1 << 20,))
        for f16 in upcasts
    ]


def sweep_attention(engine, device, path, shapes=((128, 512), (512, 1280))) -> list[str]:
    """Decode attention launch settings against KV bytes read, at (batch, context) shapes."""
    import triton.testing

    spec, kv_dtype = engine.spec, engine.runner.kv.dtype
    lines = ["-- decode attention sweep: batch ctx splits block_n warps stages min_chunk [f16] -> us, TB/s"]
    best = {}
    heads = (spec.heads, spec.head_dim**-0.5)
    for batch, ctx in shapes:
        case = paged_case(spec, batch, ctx, device, engine.dtype, kv_dtype=kv_dtype)
        kv_bytes = 2 * batch * ctx * spec.num_kv_heads * spec.head_dim * kv_dtype.itemsize
        for setting in attention_settings(kv_dtype):
            cfg = dict(setting)
            case[3].num_splits = cfg.pop("splits")
            try:
                fn = lambda case=case, cfg=cfg: paged_attention.decode_attention_triton(*case, *heads, config=cfg)
                fn()
                us = triton.testing.do_bench_cudagraph(fn) * 1e3
            except Exception as exc:  # a config that does not compile (resources)
                lines.append(f"{batch} {ctx} {setting} failed: {type(exc).__name__}")
                continue
            lines.append(
                f"{batch:4} {ctx:5} {setting['splits']:3} {cfg['block_n']:4} {cfg['num_warps']} {cfg['num_stages']} "
                f"{cfg['min_chunk']:7} {'f16' if cfg['fp8_f16'] else '   '} {us:8.1f} {kv_bytes / us / 1e6:6.2f}"
            )
            if us < best.get((batch, ctx), (1e9,))[0]:
                best[(batch, ctx)] = (us, setting)
    lines += [f"best {k}: {v[0]:.1f} us, {v[1]}" for k, v in best.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def release_check(engine, device) -> dict:
    if device.type != "cuda":
        return {}
    sync(device)
    before = torch.cuda.memory_reserved(device)
    engine.release_memory()
    after = torch.cuda.memory_reserved(device)
    engine.resume_memory()
    return {
        "reserved_before_gb": before / 1e9,
        "reserved_after_release_gb": after / 1e9,
        "kv_cache_gb": engine.runner.num_pages * engine.cfg.page_size * engine.runner.kv_bytes_per_token / 1e9,
    }


def kernel_profile(engine, prompts, device, path) -> None:
    """Per-kernel device time of a few eager decode steps (graphs hide kernels from the profiler)."""
    if device.type != "cuda":
        return
    use_graphs = engine.runner.use_graphs
    engine.runner.use_graphs = False
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=0)
    engine.generate(prompts, params)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        engine.generate(prompts, params)
    engine.runner.use_graphs = use_graphs
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    with open(path, "w") as f:
        f.write(table)
    print(table[:6000])


def shapes(text: str) -> list[tuple[int, int]]:
    """ "128x512,512x1280" -> [(128, 512), (512, 1280)]"""
    return [tuple(int(v) for v in shape.split("x")) for shape in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2-1.5b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workloads", default="w1,w2")
    p.add_argument("--hf", default="w1,w2", help="workloads to also run with transformers generate ('' for none)")
    p.add_argument(
        "--hf-max-new-tokens",
        type=int,
        default=256,
        help="new tokens for transformers on w2 (its full run would take many minutes)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--kv-cache-dtype", default="auto", help="rollout.kv_cache_dtype: auto, fp8, fp8_e5m2")
    p.add_argument("--quantization", default="none", help="rollout.quantization: none, fp8 (e4m3 GEMMs)")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--ops-off",
        default="",
        help="ops to run as the class default (the torch reference; None: unfused), e.g. gate_up_silu",
    )
    p.add_argument("--profile-kernels", action="store_true")
    p.add_argument("--micro", action="store_true", help="time each decode operation")
    p.add_argument(
        "--micro-shapes", default="128x512,512x1280", help="batch x context of each --micro table and --sweep-attention"
    )
    p.add_argument("--sweep-attention", action="store_true", help="time decode attention launch settings")
    p.add_argument("--multi-turn", action="store_true", help="also the multi-turn agent workload")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "argv": sys.argv,
    }
    config, hf, engine = build(args, device, dtype)
    results["ops"], results["fp8_matrices"] = engine.ops.chosen, engine.fp8_matrices
    try:  # diagnostics: a failure here must not cost the benchmark
        if args.sweep_attention:
            path = os.path.join(args.out, "attention_sweep.txt")
            print("\n".join(sweep_attention(engine, device, path, shapes(args.micro_shapes))), flush=True)
        if args.micro:
            for batch, ctx in shapes(args.micro_shapes):
                print("\n".join(micro(engine, device, batch, ctx, os.path.join(args.out, "micro.txt"))), flush=True)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        print(f"diagnostics failed: {exc}", flush=True)
    results["weights"] = weight_load(engine, hf, device)
    weight_bytes = decode_weight_bytes(hf)
    print("ops:", engine.ops.chosen, "| weights:", results["weights"], flush=True)
    for name in args.workloads.split(","):
        batch, prompt_len, new = WORKLOADS[name]
        prompts = prompts_for(batch, prompt_len, config.vocab_size)
        run_native(engine, prompts, 4, device, weight_bytes)  # warm-up: compiles kernels, captures this batch's graph
        res = {"native": run_native(engine, prompts, new, device, weight_bytes)}
        print(name, "native", res["native"], flush=True)
        if name in args.hf.split(","):
            hf_new = min(new, args.hf_max_new_tokens) if name == "w2" else new
            res["hf"] = run_hf(hf, prompts, hf_new, device, full_new_tokens=new)
            print(name, "hf", res["hf"], flush=True)
        results[name] = res
    if args.multi_turn:
        results["multi_turn"] = multi_turn(engine, config, device, weight_bytes)
    results["release"] = release_check(engine, device)
    if args.profile_kernels:
        kernel_profile(engine, prompts_for(128, 256, config.vocab_size), device, os.path.join(args.out, "kernels.txt"))
    with open(os.path.join(args.out, "bench_rollout.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print_table(results, args)
    return 0


def print_table(r: dict, args) -> None:
    print(f"\n== rollout benchmark: {r['device']}, torch {r['torch']}, shape {args.shape}")
    w = r["weights"]
    print(
        f"weight load: {w['parameters'] / 1e9:.2f}B params in {w['weight_load_s'] * 1e3:.1f} ms, "
        f"checksum equal: {w['checksum_equal']}"
    )
    print(
        f"{'workload':8} {'native tok/s':>12} {'wall s':>8} {'roofline s':>10} {'frac e2e':>8} "
        f"{'frac decode':>11} {'hf tok/s':>9} {'speed-up':>8}"
    )
    for name in args.workloads.split(","):
        n, h = r[name]["native"], r[name].get("hf")
        dec = n["roofline_s"] / n["decode_device_s"] if "decode_device_s" in n else float("nan")
        hf_tps = h.get("extrapolated_tokens_per_s", h["tokens_per_s"]) if h else float("nan")
        print(
            f"{name:8} {n['tokens_per_s']:12.0f} {n['wall_s']:8.2f} {n['roofline_s']:10.3f} "
            f"{n['roofline_s'] / n['wall_s']:8.1%} {dec:11.1%} {hf_tps:9.0f} {n['tokens_per_s'] / hf_tps:8.1f}"
        )
    for name in args.workloads.split(","):
        h = r[name].get("hf") or {}
        if "extrapolated_tokens_per_s" in h:
            print(
                f"{name}: hf measured {h['tokens']} tokens at {h['tokens_per_s']:.0f} tok/s (step "
                f"{h['step_ms_first']:.1f} -> {h['step_ms_last']:.1f} ms); the full run extrapolated from "
                f"step times: {h['extrapolated_wall_s']:.0f} s, {h['extrapolated_tokens_per_s']:.0f} tok/s (used above)"
            )
    if "multi_turn" in r:
        m = r["multi_turn"]
        for name in ("single_turn", "multi_turn", "multi_turn_tool_0.5s", "multi_turn_tool_0.5s_staggered"):
            x = m[name]
            device_s = ""
            if "decode_device_s" in x:
                device_s = f", device: decode {x['decode_device_s']:.2f} s, prefill {x['prefill_device_s']:.2f} s"
            print(
                f"{name:30} {x['model_tokens']:9d} model tokens in {x['wall_s']:6.2f} s = "
                f"{x['tokens_per_s']:8.0f} tok/s, {x['cached_tokens']} prompt tokens reused from the KV cache; "
                f"{x['prefill_steps']} prefill steps, decode roofline {x['roofline_s']:.3f} s "
                f"({x['roofline_s'] / x['wall_s']:.1%} of wall){device_s}"
            )
        print(
            f"multi-turn / single-turn model-token throughput: {m['ratio']:.1%} (their decode rooflines: "
            f"{m['roofline_ratio']:.1%}, the tool replies' KV read by later steps)"
        )
        for name, turns in (("multi_turn_tool_0.5s", "equal turns"), ("multi_turn_tool_0.5s_staggered", "staggered")):
            slow = m[name]
            print(
                f"0.5 s tools, {turns}: a tool out for {slow['tool_wall_s']:.2f} s of the run, the engine idle "
                f"(nothing else to decode) for {slow['engine_idle_on_tools_s']:.2f} s of them"
            )
    if r["release"]:
        rel = r["release"]
        print(
            f"release_memory: reserved {rel['reserved_before_gb']:.1f} GB -> {rel['reserved_after_release_gb']:.1f} GB "
            f"(KV cache {rel['kv_cache_gb']:.1f} GB)"
        )


if __name__ == "__main__":
    sys.exit(main())
