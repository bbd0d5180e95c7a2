"""The fake offline Engine: the real one's method names, signatures, return shapes and refusals.

Per version: update_weights_from_tensor serializes (name, tensor) lists once per TP rank and
passes "flattened_bucket" payloads through (0.5.5+; 0.4.10 has no such format); 0.5.21+ refuse
an update outside begin_weight_update()/end_weight_update() with (False, message), 0.5.x refuse
to release memory while requests run (an assert) and raise KeyError when resuming a tag that is
not released. Memory is only "paused" with enable_memory_saver; generating while the KV cache or
the weights are paused, or loading into paused weights, raises (on a GPU it would read freed
memory). Everything runs in this process on the CPU; base_gpu_id is recorded, not used.

Like the real offline Engine of every version played, it has no abort_request, pause_generation
or continue_generation (SGLang has them only on its async TokenizerManager and HTTP server).
generate takes one sampling_params dict for the batch or a list of one per request; flushing
the cache, a flushing weight update and releasing the KV cache empty the radix cache whose
matches meta_info["cached_tokens"] counts (srt/managers/scheduler.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
from sglang._profile import at_least
from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import MultiprocessingSerializer


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


class Engine:
    def __init__(self, **kwargs):
        kwargs.setdefault("log_level", "error")
        self.server_args = ServerArgs(**kwargs)
        args = self.server_args
        if not args.skip_tokenizer_init:
            raise OSError(f"Can't load tokenizer for '{args.model_path}' (the fake has no tokenizer)")
        if args.tp_size != 1 or args.dp_size != 1:
            raise NotImplementedError("the fake plays tp_size = dp_size = 1")
        if args.enable_memory_saver:
            import torch_memory_saver  # noqa: F401  (the real adapter imports it)
        self.scheduler = Scheduler(args)
        self.offload_tags: set = set()  # 0.5.x bookkeeping
        self.paused: set = set()  # what the memory saver holds paused
        self.session_open = False
        self.running = 0
        self.calls: list = []  # (method, detail), for tests
        self.generate_args: list = []  # (input_ids, sampling_params) of each generate call, for tests

    # ------------------------------------------------------------------------ generation

    def generate(
        self,
        prompt: Optional[Union[List[str], str]] = None,
        sampling_params: Optional[Union[List[Dict], Dict]] = None,
        input_ids: Optional[Union[List[List[int]], List[int]]] = None,
        image_data=None,
        return_logprob: Optional[Union[List[bool], bool]] = False,
        logprob_start_len: Optional[Union[List[int], int]] = None,
        top_logprobs_num: Optional[Union[List[int], int]] = None,
        token_ids_logprob: Optional[Union[List[List[int]], List[int]]] = None,
        lora_path: Optional[List[Optional[str]]] = None,
        custom_logit_processor: Optional[Union[List[str], str]] = None,
        return_hidden_states: bool = False,
        stream: bool = False,
        rid: Optional[Union[List[str], str]] = None,
    ) -> Union[Dict, List[Dict]]:
        if prompt is not None or input_ids is None:
            raise ValueError("with skip_tokenizer_init, pass input_ids (token ids), not text")
        if stream or image_data is not None or top_logprobs_num or token_ids_logprob or lora_path:
            raise NotImplementedError("the fake serves plain token-id requests")
        self._require_resident("generate")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        batch = [input_ids] if single else list(input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"{len(params)} sampling_params for a batch of {len(batch)} requests")
        sps = [self.scheduler.normalize(dict(sp)) for sp in params]
        self.calls.append(("generate", len(batch)))
        self.generate_args.append((copy.deepcopy(input_ids), copy.deepcopy(sampling_params)))
        self.running += 1
        try:
            outputs = self.scheduler.generate(batch, sps, bool(return_logprob))
        finally:
            self.running -= 1
        return outputs[0] if single else outputs

    # ------------------------------------------------------------------------ weights

    def update_weights_from_tensor(
        self,
        named_tensors: List[Tuple[str, torch.Tensor]],
        load_format: Optional[str] = None,
        flush_cache: bool = True,
    ):
        """Update weights from tensors; returns (success, message)."""
        if load_format == "flattened_bucket" and at_least("0.5.5"):
            payloads = list(named_tensors)  # already serialized, one per TP rank
        else:
            payloads = [MultiprocessingSerializer.serialize(named_tensors) for _ in range(self.server_args.tp_size)]
        self.calls.append(("update_weights_from_tensor", load_format))
        if at_least("0.5.21") and not self.session_open:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if "weights" in self.paused:
            raise RuntimeError("fake sglang: loading into released weights (the GPU memory is paused)")
        data = MultiprocessingSerializer.deserialize(payloads[0])  # scheduler side, TP rank 0
        success, message = self._load(data, load_format)
        if success and flush_cache:
            self.flush_cache()
        return success, message

    def _load(self, data, load_format):
        if load_format is None:
            return self.scheduler.load_weights(data)
        if load_format == "flattened_bucket" and at_least("0.5.5"):
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

            bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
            return self.scheduler.load_weights(bucket.reconstruct_tensors())
        raise NotImplementedError(f"Unknown load_format={load_format}")

    if at_least("0.5.21"):

        def begin_weight_update(self, selector: str = "all"):
            """Open a weight-update session; close it with end_weight_update()."""
            if self.session_open:
                return False, "a weight-update session is already open; call end_weight_update() first"
            self.session_open = True
            self.calls.append(("begin_weight_update", selector))
            return True, "Success"

        def end_weight_update(self):
            if not self.session_open:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self.session_open = False
            self.calls.append(("end_weight_update", None))
            return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush_cache", None))
        if self.running == 0:
            self.scheduler.flush()
        return FlushCacheReqOutput(success=self.running == 0)

    # ------------------------------------------------------------------------ memory

    def release_memory_occupation(self, tags: Optional[List[str]] = None):
        if at_least("0.5.14"):
            assert self.running == 0, "release_memory_occupation should be called only when server is idle."
        tags = list(tags) if tags else list(GPU_MEMORY_ALL_TYPES)
        if at_least("0.5.14"):
            self.offload_tags.update(tags)
        self.calls.append(("release_memory_occupation", tuple(tags)))
        if "kv_cache" in tags:
            self.scheduler.flush()  # the radix cache's KV is freed with the pool
        for tag in tags:
            if tag in GPU_MEMORY_ALL_TYPES and self.server_args.enable_memory_saver:
                if tag in self.paused:
                    raise RuntimeError(f"fake sglang: {tag} paused twice")
                self.paused.add(tag)

    def resume_memory_occupation(self, tags: Optional[List[str]] = None):
        tags = list(tags) if tags else list(GPU_MEMORY_ALL_TYPES)
        if at_least("0.5.14"):
            for tag in tags:
                self.offload_tags.remove(tag)  # KeyError for a tag that was not released
        self.calls.append(("resume_memory_occupation", tuple(tags)))
        for tag in tags:
            was_paused = tag in self.paused
            self.paused.discard(tag)
            if was_paused and tag == "weights" and not getattr(self.server_args, "enable_weights_cpu_backup", False):
                self._scramble_weights()  # paused weight memory comes back uninitialised

    def _scramble_weights(self):
        with torch.no_grad():
            for p in self.scheduler.model.parameters():
                p.fill_(float("nan"))

    def _require_resident(self, what: str):
        if self.paused & {"kv_cache", "weights"}:
            raise RuntimeError(f"fake sglang: {what} while {sorted(self.paused)} are released")

    def shutdown(self):
        self.calls.append(("shutdown", None))
        self.scheduler = None
