"""The resume config check: keys that change the math refuse a resume, keys added to minirl after
a checkpoint was written count as their defaults (an upgrade alone never blocks a resume)."""

from __future__ import annotations

import dataclasses

import pytest

from minirl.checkpoint.resume import check_config, config_differences
from minirl.config.load import load_config, to_toml
from minirl.errors import UserError


def _defaults(cfg) -> dict:
    return {name: dataclasses.asdict(type(section)()) for name, section in cfg.sections.items()}


def _saved_without(cfg, section: str, key: str) -> dict:
    """cfg's dict as an older minirl, which had no `section.key`, would have written it."""
    saved = cfg.to_dict()
    del saved[section][key]
    return saved


def test_a_key_the_checkpoint_lacks_counts_as_its_default():
    cfg = load_config(None)
    saved = _saved_without(cfg, "actor", "tis_imp_ratio_cap")
    assert config_differences(saved, cfg.to_dict(), _defaults(cfg)) == []
    # without the defaults, the missing key would read as None and block the resume
    assert config_differences(saved, cfg.to_dict()) == ["actor.tis_imp_ratio_cap = None (checkpoint) vs -1.0 (now)"]


def test_a_new_key_set_away_from_its_default_is_a_change():
    cfg = load_config(None, ["actor.tis_imp_ratio_cap=2.0"])
    saved = _saved_without(cfg, "actor", "tis_imp_ratio_cap")
    diffs = config_differences(saved, cfg.to_dict(), _defaults(cfg))
    assert diffs == ["actor.tis_imp_ratio_cap = -1.0 (checkpoint) vs 2.0 (now)"]


def test_check_config_refuses_a_math_change_and_names_the_key():
    saved = to_toml(load_config(None, ["actor.clip_ratio=0.3"]))
    cfg = load_config(None)
    with pytest.raises(UserError, match=r"actor\.clip_ratio = 0\.3 \(checkpoint\) vs 0\.2 \(now\)"):
        check_config(saved, cfg.to_dict(), "runs/x/ckpt_3", ignore=False, defaults=_defaults(cfg))
    assert check_config(saved, cfg.to_dict(), "runs/x/ckpt_3", ignore=True, defaults=_defaults(cfg))


def test_lora_keys_change_the_math_but_the_merged_export_does_not():
    saved = to_toml(load_config(None, ["model.lora_rank=8", "model.lora_save_merged=true"]))
    same_math = load_config(None, ["model.lora_rank=8"])
    assert check_config(saved, same_math.to_dict(), "runs/x/ckpt_3", ignore=False, defaults=_defaults(same_math)) == []
    other_rank = load_config(None, ["model.lora_rank=16"])
    with pytest.raises(UserError, match=r"model\.lora_rank = 8 \(checkpoint\) vs 16 \(now\)"):
        check_config(saved, other_rank.to_dict(), "runs/x/ckpt_3", ignore=False, defaults=_defaults(other_rank))
