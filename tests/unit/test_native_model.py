"""The native engine's decoder computes what transformers computes, for every supported family.

Random weights (biases and norms perturbed too), float32 on CPU: logits must agree tightly; in
bfloat16 within the dtype's rounding. Parameter names must be transformers' own, so checkpoints
and actor weights load name for name.
"""

import pytest
import torch

from minirl_plugins.engines.native import build_native_engine
from tests.tiny_models import engine_context, tiny_config, tiny_hf_model

FAMILIES = [
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen3", {}),
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _pair(family, overrides, dtype=torch.float32, std=0.05):
    cfg = tiny_config(family, **overrides)
    hf = tiny_hf_model(cfg, seed=1, std=std, dtype=dtype)
    return hf, build_native_engine(None, engine_context(cfg, actor=hf, dtype=dtype))


@pytest.mark.parametrize("family,overrides", FAMILIES)
def test_parameter_names_match_transformers(family, overrides):
    hf, eng = _pair(family, overrides)
    assert [n for n, _ in eng.model.named_parameters()] == [n for n, _ in hf.named_parameters()]


@pytest.mark.parametrize("family,overrides", FAMILIES)
def test_logits_match_transformers_float32(family, overrides):
    hf, eng = _pair(family, overrides)
    tokens = torch.randint(0, 300, (77,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    got = eng.logits(tokens)
    assert (got - ref).abs().max().item() < 1e-4 * ref.abs().max().item() + 1e-5


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_logits_match_transformers_bfloat16(family):
    hf, eng = _pair(family, {}, dtype=torch.bfloat16)
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    got = eng.logits(tokens).float()
    rel = (got - ref).norm() / ref.norm()
    assert rel < 2e-2, rel


def test_unknown_family_is_a_clear_error():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type"):
        build_native_engine(None, engine_context(GPT2Config()))


def test_unknown_weight_name_is_an_error():
    hf, eng = _pair("qwen2", {})
    with pytest.raises(ValueError, match="no parameter"):
        eng.load_weights([("model.layers.0.self_attn.nope.weight", torch.zeros(1))])


def test_unsupported_rope_type_is_a_user_error_naming_the_fix():
    """A checkpoint with a rope scaling the engine lacks must say so and point to rollout.name = 'hf'."""
    from minirl.errors import UserError
    from minirl_plugins.engines.native.layers.rotary import inv_frequencies

    with pytest.raises(UserError, match=r"rope_type = 'yarn'.*rollout.name = 'hf'"):
        inv_frequencies({"rope_theta": 10000.0, "rope_type": "yarn"}, 64)
