"""FlattenedTensorBucket (0.5.5+): many tensors as one flat uint8 tensor plus metadata.

From 0.5.14 tensors are viewed as bytes, so one bucket may mix dtypes (supports_multi_dtypes);
the fake plays no version between, where mixing dtypes was unsupported.
"""

from dataclasses import dataclass

import torch
from sglang._profile import require

require("sglang.srt.weight_sync.tensor_bucket", since="0.5.5")


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    supports_multi_dtypes = True

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is None:
            if flattened_tensor is None or metadata is None:
                raise ValueError("Must provide either named_tensors or both flattened_tensor and metadata")
            self.flattened_tensor, self.metadata = flattened_tensor, metadata
            return
        if not named_tensors:
            raise ValueError("Cannot create empty tensor bucket")
        pieces, self.metadata, start = [], [], 0
        for name, tensor in named_tensors:
            flat = tensor.flatten().view(torch.uint8)
            pieces.append(flat)
            self.metadata.append(
                FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start, start + flat.numel(), flat.numel())
            )
            start += flat.numel()
        self.flattened_tensor = torch.cat(pieces)

    def get_flattened_tensor(self):
        return self.flattened_tensor

    def get_metadata(self):
        return self.metadata

    def reconstruct_tensors(self):
        return [
            (m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
            for m in self.metadata
        ]
