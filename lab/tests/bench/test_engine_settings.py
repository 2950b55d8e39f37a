"""The engines' settings of a bench's plan (lab/bench/engine_settings.py): built without a config, refused as
validate refuses rollout.vllm and rollout.sglang (tests/test_config_sections.py refuses each through validate)."""

from __future__ import annotations

import pytest

from lab.bench.engine_settings import check_vllm_settings, sglang_settings
from miniverl.config import MiniVerlConfig
from miniverl.errors import ConfigError
from miniverl.rollout.vllm_settings import VllmSettings, settings_from_config


def settings(**kw) -> VllmSettings:
    cfg = MiniVerlConfig()
    rows = cfg.rollout.engine_rows(cfg.data)
    return settings_from_config(cfg, kw.pop("share", 0.4), kw.pop("cap", None), rows).__class__(
        **(settings_from_config(cfg, 0.4, None, rows).__dict__ | kw)
    )


@pytest.mark.parametrize(
    ("field", "value", "names"),
    [
        ("refresh", "copy", "rollout.vllm.refresh"),
        ("engine_process", "thread", "the bench's vllm engine_process='thread': use one of inprocess, subprocess"),
        ("seeding", "batch", "the bench's vllm seeding='batch': use one of row, prompt"),
        ("kv_cache_gib", 0.0, "rollout.vllm.kv_cache_gib"),
        ("max_num_batched_tokens", 8, r"rollout.vllm.max_num_batched_tokens=8 is below the \d+ rows"),
        ("cudagraph_capture_size", 0, "the bench's vllm cudagraph_capture_size=0: a positive batch size"),
    ],
)
def test_bad_settings_name_the_key(field, value, names):
    """Settings built without a config (the bench's plans) get validate's checks of rollout.vllm
    (tests/test_config_sections.py refuses each of these through validate)."""
    check_vllm_settings(settings())
    with pytest.raises(ConfigError, match=names):
        check_vllm_settings(settings(**{field: value}))


def test_merged_refresh_needs_the_engine_in_process():
    with pytest.raises(ConfigError, match="engine_process=inprocess"):
        check_vllm_settings(settings(refresh="merged", engine_process="subprocess"))
    with pytest.raises(ConfigError, match="refresh=merged: merging the adapter into 4-bit weights"):
        check_vllm_settings(settings(refresh="merged", quantization="nf4"))


def test_a_bench_sglang_engine_is_sized_for_its_call_and_refuses_unknown_keys():
    s = sglang_settings(256, 612, {})
    assert (s.context_length, s.gpu_share, s.gpu_cap_gib) == (612, 0.5, None)
    assert sglang_settings(256, 612, {"gpu_share": 0.3}).gpu_share == 0.3
    with pytest.raises(ConfigError, match=r"\['attention'\] are not rollout.sglang keys"):
        sglang_settings(256, 612, {"attention": "triton"})
    with pytest.raises(ConfigError, match="gpu_share=1.5"):
        sglang_settings(256, 612, {"gpu_share": 1.5})
