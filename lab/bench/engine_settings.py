"""The engines' settings of a bench's plan (lab.bench runner, decode_profile), built without a config and checked as
validate checks rollout.vllm and rollout.sglang: a plan's attributes are rollout.<engine> keys no validate has seen.
A run's settings come from a config validate has checked (the backends' settings_from_config), so the product
checks them once, there."""

from __future__ import annotations

from dataclasses import fields

from miniverl.config import SglangRolloutConfig, VllmRolloutConfig, check_quantized_rollout
from miniverl.errors import ConfigError
from miniverl.rollout.sglang import BATCH_INVARIANT, SglangSettings
from miniverl.rollout.vllm_settings import ENGINE_PROCESSES, SEEDING, VllmSettings


def check_vllm_settings(s: VllmSettings) -> None:
    """validate's checks of rollout.vllm (config/rollout.py, config/checks.py) for a bench's vllm plan."""
    section = VllmRolloutConfig(**{f.name: getattr(s, f.name) for f in fields(VllmRolloutConfig)})
    section.check()
    section.check_batched_tokens(s.max_num_seqs)
    check_quantized_rollout(s.quantization, "vllm", s.refresh)
    # A bench's own settings (a run has VllmSettings' defaults for them: rollout/vllm_settings.py).
    if s.cudagraph_capture_size < 1:
        raise ConfigError(f"the bench's vllm cudagraph_capture_size={s.cudagraph_capture_size}: a positive batch size")
    if s.seeding not in SEEDING:
        raise ConfigError(f"the bench's vllm seeding={s.seeding!r}: use one of {', '.join(SEEDING)}")
    if s.engine_process not in ENGINE_PROCESSES:
        raise ConfigError(
            f"the bench's vllm engine_process={s.engine_process!r}: use one of {', '.join(ENGINE_PROCESSES)}"
        )
    if s.refresh == "merged" and s.engine_process != "inprocess":
        raise ConfigError(
            "the bench's vllm refresh=merged loads weights into the engine's model in place, which needs"
            " engine_process=inprocess"
        )


def sglang_settings(rows: int, context: int, attributes: dict) -> SglangSettings:
    """A bench's SGLang engine: sized for its widest call and longest row, half the GPU and rollout.sglang's defaults
    unless `attributes` (rollout.sglang keys, batch_invariant or gpu_share) say otherwise, checked as validate checks
    rollout.sglang."""
    a = {"gpu_share": 0.5} | dict(attributes)
    share = a.pop("gpu_share")
    batch_invariant = a.pop("batch_invariant", BATCH_INVARIANT)  # a bench's own setting (a run's: rollout/sglang.py)
    known = {f.name for f in fields(SglangRolloutConfig)}
    if set(a) - known:
        raise ConfigError(
            f"the bench's sglang settings {sorted(set(a) - known)} are not rollout.sglang keys; use"
            f" {', '.join(sorted(known))}, batch_invariant or gpu_share"
        )
    if not (isinstance(share, int | float) and 0 < share <= 1):
        raise ConfigError(f"the bench's sglang gpu_share={share!r}: a fraction of the GPU in (0, 1]")
    section = SglangRolloutConfig(**a)
    section.check()
    return SglangSettings(
        section.attention_backend,
        section.mem_fraction_static,
        section.chunked_prefill_size,
        bool(batch_invariant),
        section.running_rows(rows),
        context,
        share,
        None,
    )
