"""ServerArgs: a dataclass up to 0.5.14, a msgspec Struct from 0.5.20 (fields in
`__struct_fields__`, no dataclass fields). Either way an unknown keyword is a TypeError.

The fake keeps the fields minirl passes plus a few neighbours; the real class has hundreds.
"""

import dataclasses
from typing import Optional

from sglang._profile import at_least

FIELDS = {
    "model_path": None,
    "tokenizer_path": None,
    "skip_tokenizer_init": False,
    "load_format": "auto",
    "dtype": "auto",
    "trust_remote_code": False,
    "context_length": None,
    "mem_fraction_static": None,
    "max_running_requests": None,
    "enable_memory_saver": False,
    "tp_size": 1,
    "dp_size": 1,
    "base_gpu_id": 0,
    "gpu_id_step": 1,
    "random_seed": None,
    "port": 30000,
    "nccl_port": None,
    "log_level": "info",
    "disable_cuda_graph": False,
    "disable_radix_cache": False,
    "kv_cache_dtype": "auto",
    "quantization": None,
}
if at_least("0.5.5"):
    FIELDS["enable_weights_cpu_backup"] = False
if at_least("0.5.14"):
    FIELDS.update(cuda_graph_max_bs_decode=None, cuda_graph_max_bs_prefill=None)
else:
    FIELDS["cuda_graph_max_bs"] = None


def _check_values(args) -> None:
    if args.model_path is None:  # the real field has no default
        raise TypeError("ServerArgs.__init__() missing required argument: 'model_path'")


if at_least("0.5.20"):

    class ServerArgs:
        __struct_fields__ = tuple(FIELDS)

        def __init__(self, **kwargs):
            unknown = sorted(set(kwargs) - set(FIELDS))
            if unknown:
                raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")
            for name, default in FIELDS.items():
                setattr(self, name, kwargs.get(name, default))
            _check_values(self)

else:
    ServerArgs = dataclasses.make_dataclass(
        "ServerArgs", [(name, Optional[object], dataclasses.field(default=d)) for name, d in FIELDS.items()]
    )
    ServerArgs.__post_init__ = _check_values
