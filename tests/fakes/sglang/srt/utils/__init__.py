"""MultiprocessingSerializer: ForkingPickler out, the version's unpickling rules in.

0.4.10 unpickles anything; 0.5.14 allows module prefixes minus a deny-list; 0.5.23 allows an
exact list of globals (builtins, torch tensors and storages, SGLang's bucket metadata), so a
payload holding any other class is refused there. The lists below keep the entries a CPU payload
can need; the real lists are longer (CUDA, sparse and quantized tensors).
"""

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler

from sglang._profile import VERSION, at_least

_PREFIXES_0_5_14 = ("builtins.", "collections.", "copyreg.", "functools.", "itertools.", "types.", "torch.")
_PREFIXES_0_5_14 += ("multiprocessing.resource_sharer.", "multiprocessing.reduction.", "sglang.srt.")
_DENY_0_5_14 = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"), ("os", "system")}
_ALLOWED_0_5_23 = {
    *(("builtins", n) for n in ("bool", "bytes", "bytearray", "dict", "float", "int", "list", "set", "str", "tuple")),
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "dtype"),
    *(("torch", n) for n in ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "bool")),
    ("torch.nn.parameter", "Parameter"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "_load_from_bytes"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if not _allowed(module, name):
            raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        return super().find_class(module, name)


def _allowed(module: str, name: str) -> bool:
    if at_least("0.5.23"):
        return (module, name) in _ALLOWED_0_5_23
    if at_least("0.5.14"):
        return (module, name) not in _DENY_0_5_14 and (module + ".").startswith(_PREFIXES_0_5_14)
    return True


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        data = buf.getvalue()
        return base64.b64encode(data).decode("utf-8") if output_str else data

    @staticmethod
    def deserialize(data):
        if isinstance(data, str):
            data = base64.b64decode(data, validate=True)
        if not at_least("0.5.14"):
            return ForkingPickler.loads(data)
        return SafeUnpickler(io.BytesIO(data)).load()


__all__ = ["MultiprocessingSerializer", "SafeUnpickler", "VERSION"]
