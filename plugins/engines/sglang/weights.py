"""Weight sync into SGLang: size-bounded buckets through update_weights_from_tensor.

One sync: (begin_weight_update where the version requires it), one update per bucket with
flush_cache=False, (end_weight_update), then one flush_cache, since the radix cache holds KV of
the old weights. Every reply is checked: SGLang reports a refused update as (False, message).
Buckets hold plain tensors in the engine's dtype (half the traffic of fp32 master weights; the
engine would round the same way). With FlattenedTensorBucket (0.5.5+; one dtype per bucket before
0.5.14) a bucket travels as one flat uint8 tensor plus metadata, else as (name, tensor) pairs; the
payload holds only str, tensors and SGLang's metadata class, which 0.5.23's unpickling allow-list
requires. A tensor over the budget travels alone. A sync's buckets stay referenced until its end:
SGLang answers once the copies are queued, not done (peak: one model copy in the engine dtype).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from minirl_plugins.engines.sglang.api import SGLangAPI

Named = list[tuple[str, torch.Tensor]]


def plain_tensor(tensor: torch.Tensor, dtype: torch.dtype, copy: bool) -> torch.Tensor:
    """A contiguous plain torch.Tensor (no Parameter or DTensor) in the engine dtype; with copy,
    never the actor's own memory, which the next optimizer step overwrites."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    tensor = tensor.detach()
    if tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)  # a new tensor already
    elif copy:
        tensor = tensor.clone()
    return tensor.contiguous().as_subclass(torch.Tensor)


def buckets(weights: Iterable[tuple[str, torch.Tensor]], budget_bytes: int, split_dtypes: bool) -> Iterator[Named]:
    """Consecutive (name, tensor) groups of at most budget_bytes (one dtype each if split_dtypes)."""
    bucket: Named = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        dtype_change = split_dtypes and bucket and bucket[-1][1].dtype != tensor.dtype
        if bucket and (size + nbytes > budget_bytes or dtype_change):
            yield bucket
            bucket, size = [], 0
        bucket.append((str(name), tensor))
        size += nbytes
    if bucket:
        yield bucket


def check(result, what: str) -> None:
    """Raise unless an SGLang reply reports success: (success, message) or an object with .success.
    A reply of neither shape raises too: a sync whose outcome cannot be read is not a success."""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        success, message = result[0], (result[1] if len(result) > 1 else "")
    elif hasattr(result, "success"):
        success, message = result.success, getattr(result, "message", "")
    else:
        raise RuntimeError(f"sglang {what}: unrecognised reply {result!r}; cannot tell whether it succeeded")
    if success is not True:
        raise RuntimeError(f"sglang {what} failed: {message or result!r}; the engine may not hold the actor's weights")


class WeightSync:
    """Sends named tensors to one SGLang Engine (tensor parallel 1)."""

    def __init__(self, api: SGLangAPI, engine, dtype: torch.dtype, bucket_megabytes: int):
        self.api, self.engine, self.dtype = api, engine, dtype
        self.budget = int(bucket_megabytes) << 20
        self.flattened = api.bucket_cls is not None
        self.last_num_buckets = 0

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        plain = ((name, plain_tensor(t, self.dtype, copy=not self.flattened)) for name, t in weights)
        split = self.flattened and not self.api.bucket_multi_dtypes
        sent: list = []  # kept alive until the sync ends (see the module docstring)
        if self.api.weight_session:
            check(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            for bucket in buckets(plain, self.budget, split):
                sent.append(self._send(bucket))
        finally:  # a failed sync must not leave the session open for the next one
            ended = self.engine.end_weight_update() if self.api.weight_session else (True, "")
        check(ended, "end_weight_update")
        check(self.engine.flush_cache(), "flush_cache after the weight update")
        self.last_num_buckets = len(sent)
        if not sent:
            raise RuntimeError("sglang weight sync: the actor gave no weights to send")

    def _send(self, bucket: Named):
        if not self.flattened:
            check(self.engine.update_weights_from_tensor(bucket, load_format=None, flush_cache=False), "weight update")
            return bucket
        flat = self.api.bucket_cls(named_tensors=bucket)
        payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        per_rank = [self.api.serializer.serialize(payload, output_str=True)]  # tensor parallel 1: one rank
        result = self.engine.update_weights_from_tensor(per_rank, load_format="flattened_bucket", flush_cache=False)
        check(result, "weight update (flattened bucket)")
        return payload
