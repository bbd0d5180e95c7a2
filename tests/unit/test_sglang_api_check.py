"""scripts/check_sglang_api.py turns CI red when SGLang drops an API the plugin uses, and when it
cannot fetch SGLang at all: a check that passes because the registry was unreachable would hide
exactly the breakage it exists to catch. Runs on small synthetic wheels; CI runs the real one."""

import importlib.util
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_sglang_api", ROOT / "scripts" / "check_sglang_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ENGINE = """
class Engine(EngineBase):
    def __init__(self, **kwargs): ...
    def generate(self, prompt=None, sampling_params: Optional[Union[List[Dict], Dict]] = None, input_ids=None,
                 return_logprob=False): ...
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True): ...
    def flush_cache(self): ...
    def release_memory_occupation(self, tags=None): ...
    def resume_memory_occupation(self, tags=None): ...
    def shutdown(self): ...
    def begin_weight_update(self, selector="all"): ...
    def end_weight_update(self): ...
"""
SERVER_ARGS = (
    "model_path skip_tokenizer_init load_format dtype mem_fraction_static enable_memory_saver tp_size base_gpu_id "
    "random_seed port nccl_port log_level disable_cuda_graph context_length max_running_requests kv_cache_dtype "
    "quantization"
).split()
FILES = {
    "sglang/srt/entrypoints/engine.py": ENGINE,
    "sglang/srt/utils/__init__.py": "from sglang.srt.utils.common import *\n",
    "sglang/srt/utils/common.py": "class MultiprocessingSerializer:\n    def serialize(obj, output_str=False): ...\n",
    "sglang/srt/utils/patch_torch.py": "def monkey_patch_torch_reductions(): ...\n",
    "sglang/srt/weight_sync/tensor_bucket.py": (
        "class FlattenedTensorBucket:\n    def __init__(self, named_tensors=None): ...\n"
        "    def get_flattened_tensor(self): ...\n    def get_metadata(self): ...\n"
    ),
    "sglang/srt/constants.py": 'GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"\nGPU_MEMORY_TYPE_WEIGHTS = "weights"\n'
    'GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"\n',
    "sglang/srt/server_args.py": "class ServerArgs:\n" + "".join(f"    {f}: int = 0\n" for f in SERVER_ARGS),
    "sglang/srt/sampling/sampling_params.py": "class SamplingParams:\n    def __init__(self, max_new_tokens=128, "
    "temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=None, ignore_eos=False): ...\n",
    "sglang/srt/managers/tokenizer_manager.py": 'x = ["output_token_logprobs", "finish_reason", "cached_tokens"]\n',
    "sglang/srt/managers/schedule_batch.py": 'y = {"type": "length"}\n',
}


def _wheel(tmp_path, **replace) -> Path:
    path = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**FILES, **replace}.items():
            z.writestr(name, text)
    return path


def test_a_complete_release_passes(checker, tmp_path, capsys):
    assert checker.main(["--archive", str(_wheel(tmp_path))]) == 0
    assert "0 missing" in capsys.readouterr().out


def test_a_dropped_method_or_keyword_fails(checker, tmp_path, capsys):
    no_flush_kw = ENGINE.replace("load_format=None, flush_cache=True", "load_format=None")
    wheel = _wheel(tmp_path, **{"sglang/srt/entrypoints/engine.py": no_flush_kw.replace("def shutdown", "def stop")})
    assert checker.main(["--archive", str(wheel)]) == 1
    out = capsys.readouterr().out
    assert "MISSING   sglang.srt.entrypoints.engine.Engine.shutdown" in out
    assert "update_weights_from_tensor(flush_cache)" in out


def test_a_removed_server_arg_or_moved_module_fails(checker, tmp_path, capsys):
    args = FILES["sglang/srt/server_args.py"].replace("    nccl_port: int = 0\n", "")
    wheel = _wheel(tmp_path, **{"sglang/srt/server_args.py": args, "sglang/srt/utils/patch_torch.py": ""})
    assert checker.main(["--archive", str(wheel)]) == 1
    out = capsys.readouterr().out
    assert "ServerArgs.nccl_port" in out and "monkey_patch_torch_reductions" in out


def test_a_generate_without_per_request_sampling_params_fails(checker, tmp_path, capsys):
    """step() sends one sampling dict per request; a release whose generate takes a single dict
    only, or that stops reporting cached_tokens, must fail the check."""
    one_dict = ENGINE.replace("Optional[Union[List[Dict], Dict]]", "Optional[Dict]")
    tokenizer = 'x = ["output_token_logprobs", "finish_reason"]\n'
    files = {"sglang/srt/entrypoints/engine.py": one_dict, "sglang/srt/managers/tokenizer_manager.py": tokenizer}
    assert checker.main(["--archive", str(_wheel(tmp_path, **files))]) == 1
    out = capsys.readouterr().out
    assert "MISSING   sglang.srt.entrypoints.engine.Engine.generate(sampling_params: ...list[dict...)" in out
    assert "mentions 'cached_tokens'" in out


def test_an_unreachable_registry_fails_loudly(checker, monkeypatch, capsys):
    def offline(*args):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(checker, "pip", offline)
    assert checker.main([]) == 2
    assert "FAILED to fetch SGLang" in capsys.readouterr().err
