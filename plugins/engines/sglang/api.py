"""The part of SGLang's API this plugin uses, and what the installed version offers of it.

The USED_* lists name every import path, method, keyword argument and server argument the plugin
touches; scripts/check_sglang_api.py reads a downloaded SGLang wheel's source against them, so a
release that drops one fails CI. detect() inspects the installed package (signatures, attributes,
importable modules; never the version string alone) for the features the plugin then uses.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from minirl.errors import UserError

INSTALL_HINT = "pip install 'minirl[sglang]'"

ENGINE = "sglang.srt.entrypoints.engine"

# (module, class or None, method or attribute, keyword arguments it must accept, required)
USED_METHODS = [
    (ENGINE, "Engine", "__init__", ("**kwargs",), True),
    (ENGINE, "Engine", "generate", ("input_ids", "sampling_params", "return_logprob"), True),
    (ENGINE, "Engine", "update_weights_from_tensor", ("named_tensors", "load_format", "flush_cache"), True),
    (ENGINE, "Engine", "flush_cache", (), True),
    (ENGINE, "Engine", "release_memory_occupation", ("tags",), True),
    (ENGINE, "Engine", "resume_memory_occupation", ("tags",), True),
    (ENGINE, "Engine", "shutdown", (), True),
    (ENGINE, "Engine", "begin_weight_update", (), False),  # 0.5.21+: required around updates
    (ENGINE, "Engine", "end_weight_update", (), False),
    ("sglang.srt.utils", "MultiprocessingSerializer", "serialize", ("obj", "output_str"), True),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket", "__init__", ("named_tensors",), False),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket", "get_flattened_tensor", (), False),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket", "get_metadata", (), False),
]

# argument annotations that must name a type: (module, class, method, argument, text in the
# annotation, lower case, "typing." dropped). step() sends one sampling dict per request.
USED_ANNOTATIONS = [
    (ENGINE, "Engine", "generate", "sampling_params", "list[dict"),
]

# Not used, on purpose: abort_request, pause_generation, continue_generation. The offline Engine
# has none of them in 0.4.10 to 0.5.23 (only the async TokenizerManager does), and step() runs
# each turn to its end, so nothing is in flight inside SGLang to abort or pause (engine.py).

# names that must be importable from a module: (module, name, required)
USED_NAMES = [
    ("sglang.srt.constants", "GPU_MEMORY_TYPE_KV_CACHE", True),
    ("sglang.srt.constants", "GPU_MEMORY_TYPE_WEIGHTS", True),
    ("sglang.srt.constants", "GPU_MEMORY_TYPE_CUDA_GRAPH", False),  # 0.5.x
]

# one of each group must exist (the function moved between versions)
USED_ONE_OF = [
    [
        ("sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions"),  # 0.5.x
        ("sglang.srt.patch_torch", "monkey_patch_torch_reductions"),  # 0.4.x
    ],
]

# ServerArgs fields the plugin passes to Engine(**kwargs)
USED_SERVER_ARGS = tuple(
    """model_path skip_tokenizer_init load_format dtype mem_fraction_static enable_memory_saver tp_size
    base_gpu_id random_seed port nccl_port log_level disable_cuda_graph context_length max_running_requests
    kv_cache_dtype quantization""".split()
)

# keys of the per-request sampling_params dict (SamplingParams fields)
USED_SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos")

# string literals the plugin reads from outputs or sends as formats: (file in the package, literal)
USED_LITERALS = [
    ("srt/managers/tokenizer_manager.py", "output_token_logprobs"),
    ("srt/managers/tokenizer_manager.py", "finish_reason"),
    ("srt/managers/tokenizer_manager.py", "cached_tokens"),
    ("srt/managers/schedule_batch.py", "length"),
]


@dataclass(frozen=True)
class SGLangAPI:
    """What the installed SGLang offers, found by inspection."""

    version: str
    engine_cls: type
    serializer: Any  # MultiprocessingSerializer
    patch_reductions: Callable[[], None]
    bucket_cls: type | None  # FlattenedTensorBucket; None: send named tensors
    bucket_multi_dtypes: bool  # one flattened bucket may mix dtypes
    weight_session: bool  # begin_weight_update / end_weight_update exist (and are required)
    memory_tags: tuple[str, ...]  # what release_memory frees: the KV cache (and CUDA graphs)
    server_args: frozenset[str]


def import_sglang():
    """The sglang package, or a UserError naming the extra to install."""
    try:
        return importlib.import_module("sglang")
    except ImportError as exc:
        raise UserError(
            f"rollout.name = 'sglang' needs SGLang, which is not installed ({exc}); "
            f"install it with {INSTALL_HINT}, or use rollout.name = 'native'"
        ) from exc


def detect() -> SGLangAPI:
    sglang = import_sglang()
    engine_cls = importlib.import_module(ENGINE).Engine
    _check_engine(engine_cls)
    bucket_cls = _optional(
        lambda: importlib.import_module("sglang.srt.weight_sync.tensor_bucket").FlattenedTensorBucket
    )
    constants = importlib.import_module("sglang.srt.constants")
    tags = [constants.GPU_MEMORY_TYPE_KV_CACHE]
    if hasattr(constants, "GPU_MEMORY_TYPE_CUDA_GRAPH"):
        tags.append(constants.GPU_MEMORY_TYPE_CUDA_GRAPH)
    return SGLangAPI(
        version=str(getattr(sglang, "__version__", "unknown")),
        engine_cls=engine_cls,
        serializer=importlib.import_module("sglang.srt.utils").MultiprocessingSerializer,
        patch_reductions=_patch_reductions(),
        bucket_cls=bucket_cls,
        bucket_multi_dtypes=bool(getattr(bucket_cls, "supports_multi_dtypes", False)),
        weight_session=hasattr(engine_cls, "begin_weight_update") and hasattr(engine_cls, "end_weight_update"),
        memory_tags=tuple(tags),
        server_args=server_arg_names(importlib.import_module("sglang.srt.server_args").ServerArgs),
    )


def server_arg_names(server_args_cls) -> frozenset[str]:
    """Field names of ServerArgs: a dataclass up to 0.5.14, a msgspec Struct from 0.5.20."""
    if dataclasses.is_dataclass(server_args_cls):
        return frozenset(f.name for f in dataclasses.fields(server_args_cls))
    return frozenset(getattr(server_args_cls, "__struct_fields__", ()))


def _check_engine(engine_cls) -> None:
    for module, _cls, method, kwargs, required in USED_METHODS:
        if module != ENGINE or not required or method == "__init__":
            continue
        if not hasattr(engine_cls, method):
            unsupported(f"Engine has no method {method}")
        absent = [k for k in kwargs if k not in inspect.signature(getattr(engine_cls, method)).parameters]
        if absent:
            unsupported(f"Engine.{method} takes no {absent}")
    for _module, _cls, method, arg, text in USED_ANNOTATIONS:
        annotation = inspect.signature(getattr(engine_cls, method)).parameters[arg].annotation
        if annotation is not inspect.Parameter.empty and text not in annotation_text(annotation):
            unsupported(f"Engine.{method}'s {arg} is annotated {annotation}, not a list of one per request")


def annotation_text(annotation) -> str:
    """An annotation (object or string) as comparable text: lower case, no spaces, no "typing."."""
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return text.replace("typing.", "").replace(" ", "").lower()


def unsupported(what: str):
    """Raise the UserError for an SGLang this plugin cannot drive, saying `what` is missing."""
    raise UserError(
        f"rollout.name = 'sglang': the installed SGLang is not supported ({what}); minirl supports "
        f"0.4.10 to 0.5.23 (docs/plugins.md); install one with {INSTALL_HINT}"
    )


def _patch_reductions() -> Callable[[], None]:
    for module, name in USED_ONE_OF[0]:
        found = _optional(lambda m=module, n=name: getattr(importlib.import_module(m), n))
        if found is not None:
            return found
    unsupported("no monkey_patch_torch_reductions in sglang.srt.utils.patch_torch or sglang.srt.patch_torch")


def _optional(get):
    try:
        return get()
    except (ImportError, AttributeError):
        return None
