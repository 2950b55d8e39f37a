"""What the vLLM backend needs to know, as plain values, and the arithmetic that must not need a GPU to test.

Nothing here imports vLLM: `import miniverl` and the CPU tests never do. The backend itself is
miniverl/rollout/vllm.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from miniverl.atomic import atomic_dir
from miniverl.errors import ConfigError

# LoRA ranks vLLM 0.26 can be started with (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Memory the engine needs beside weights and KV cache when we size the KV cache ourselves: CUDA graphs,
# the sampler's [rows, V] fp32 logits (256 rows x 152k vocab = 0.15 GiB), activations of the profile run
# and the CUDA context's share. vLLM's own profile run measures this when it sizes the cache; under a 16 GB
# emulation cap that profile sees the whole H200 free, so the KV size must come from us (issue 8).
ENGINE_OVERHEAD_GIB = 1.5
# What the engine's process holds outside torch's caching allocator besides its CUDA context, which the cap
# (torch.cuda.set_per_process_memory_fraction) does not limit and torch's numbers do not show: nvidia-smi saw the
# 7B recipe's vLLM process at 4.82 GiB where torch had reserved 3.53 (0.63 GiB beyond a 0.66 GiB context; H100,
# lab/results/fit-planner.md, 2026-12-06, 0b59ed3), and three earlier vLLM runs' whole cards 0.53-0.66 GiB over their
# actors' reserved peaks and three contexts. The fit planner adds it to the card (setup/actor_plans.py rollout_plan).
ENGINE_OUTSIDE_TORCH_GIB = 0.6
# resources.rollout.num_gpus left null with vLLM: the engine takes its whole share up front and sizes its KV cache
# from what the share leaves, so no modelled peak says what it needs (setup/layout.py choose_shares)
AUTO_SHARE = 0.4


# The engine's fixed choices: until 2026-12-07 rollout.vllm keys that no recipe, README line or test set (issue 75,
# lab/results/config-surface.md). CUDA graphs on (enforce_eager off): engine start ~90 s instead of ~30, the decode
# lab/results/rollout-rl-sizes.md measured. Prefix caching on: a prompt's samples share their prefill. vLLM's async
# scheduling off: the raw-vLLM profiles that turned it on (lab/results/decode-profile.md, 2026-12-04) measured a bare
# engine without log-probs or row seeds, not this backend. No sleep between steps: level-1 sleep frees the weights and
# KV cache for other actors (2.01 GiB in the vLLM GPU tests, lab/results/rollout-rl-sizes.md) and reloads them every
# step. Adapter versions are written to shared memory, one at a time.
# Row seeds (seeding=row): one request per sampled row, seeded by the row's seed, so a row's tokens depend on its seed
# alone (the project's rule; "prompt", one request with n samples per prompt, is a bench's comparison). The engine core
# in the actor's process (engine_process=inprocess): a merged refresh hands the engine's model GPU tensors in place,
# which a child process would get pickled through a socket every step; vLLM's own child process is a bench's choice.
SEEDING = ("row", "prompt")  # the seedings a VllmSettings may hold (row: a run's)
ENGINE_PROCESSES = ("inprocess", "subprocess")  # where the engine core may run (inprocess: a run's)
ENFORCE_EAGER = False
PREFIX_CACHING = True
ASYNC_SCHEDULING = False
SLEEP_BETWEEN_STEPS = False
ADAPTER_ROOT = "/dev/shm"


@dataclass(frozen=True)
class VllmSettings:
    """The `rollout.vllm` config section plus what the builder derives from the rest of the run, and the engine's fixed
    choices (the constants above)."""

    refresh: str  # adapter: a new LoRA request per version; merged: adapter merged into the base in place
    max_num_seqs: int  # rows the engine decodes at once
    # largest decode batch captured as a CUDA graph: a run's max_num_seqs (every batch it decodes); a bench may set less
    cudagraph_capture_size: int
    max_num_batched_tokens: int  # tokens one engine step prefills; 0 = vLLM's default
    max_model_len: int  # prompt + response tokens of the longest row
    gpu_share: float  # the fraction of the device Ray gave this actor
    gpu_cap_gib: float | None  # the 16 GB emulation cap of this actor (None: no cap)
    kv_cache_gib: float | None  # explicit KV budget; None derives it
    quantization: str  # model.student.quantization: nf4 serves the base through vLLM's bitsandbytes loader
    # The engine's fixed choices: a run always gets these; the lab's benches set them on the settings they build
    # (lab/bench/runner.py, lab/conf/bench/rollout-rl-sizes-vllm.yaml).
    seeding: str = SEEDING[0]  # row: one request (and seed) per sampled row; prompt: one with n samples per prompt
    engine_process: str = ENGINE_PROCESSES[0]  # inprocess: engine core inside the actor; subprocess: vLLM's child
    enforce_eager: bool = ENFORCE_EAGER  # True turns CUDA graphs off
    enable_prefix_caching: bool = PREFIX_CACHING
    async_scheduling: bool = ASYNC_SCHEDULING
    sleep_between_steps: bool = SLEEP_BETWEEN_STEPS  # sleep(level=1) after generating, wake before the next use
    adapter_root: str = ADAPTER_ROOT  # where adapter versions are written (shared memory, not the run directory)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM can be started with that holds a rank-`rank` adapter."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ConfigError(
        f"model.lora.rank={rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; lower model.lora.rank"
        " or use rollout.vllm.refresh=merged (no LoRA kernels, any rank)"
    )


def served_weight_bytes(model_dir: str, dtype: torch.dtype, quantization: str) -> int:
    """Bytes of the base model the engine holds: its safetensors headers' parameters (no weights loaded) in
    `dtype`, or NF4-sized linear layers when the student is served 4-bit (the fit planner's sizing,
    models/loading.py ModelSize)."""
    from miniverl.models.loading import checkpoint_numel, load_model_config, model_size

    if not checkpoint_numel(model_dir):
        raise ConfigError(f"{model_dir!r} has no *.safetensors weights; rollout=vllm loads safetensors checkpoints")
    config = load_model_config(model_dir, "model.student.path", "pass a saved model directory")
    return model_size(model_dir, config).weight_bytes(quantization, torch.finfo(dtype).bits // 8)


def memory_plan(
    s: VllmSettings, total_bytes: int, weight_bytes: int, adapter_bytes: int = 0
) -> tuple[float, int | None]:
    """(gpu_memory_utilization, kv_cache_memory_bytes or None) for the engine.

    vLLM's gpu_memory_utilization is a fraction of the *whole* device, and vLLM refuses to start when less
    than that is free (vllm/v1/worker/utils.py request_memory). Without a cap the actor's Ray share is that
    fraction and vLLM profiles the KV size itself. Under the 16 GB emulation cap the utilization becomes
    cap / device (so the free-memory check asks for what the cap allows) and the KV size is explicit:
    cap - weights - adapter - ENGINE_OVERHEAD_GIB (what the fit planner plans: setup/actor_plans.py), or
    rollout.vllm.kv_cache_gib.
    """
    explicit = None if s.kv_cache_gib is None else int(s.kv_cache_gib * 2**30)
    if s.gpu_cap_gib is None:
        return s.gpu_share, explicit
    cap = int(s.gpu_cap_gib * 2**30)
    held = weight_bytes + adapter_bytes
    kv = explicit if explicit is not None else cap - held - int(ENGINE_OVERHEAD_GIB * 2**30)
    if kv <= 0 or kv + held > cap:
        raise ConfigError(
            f"the vLLM rollout actor's cap is {s.gpu_cap_gib:.2f} GiB (resources.rollout.num_gpus={s.gpu_share:g} x"
            f" resources.emulate_gpu_gib), the student's weights and adapter take {held / 2**30:.2f} GiB and the"
            f" engine needs ~{ENGINE_OVERHEAD_GIB} GiB besides, leaving {kv / 2**30:.2f} GiB for the KV cache; raise"
            " resources.rollout.num_gpus or set rollout.vllm.kv_cache_gib smaller"
        )
    return min(1.0, cap / total_bytes), kv


def adapter_config(rank: int, alpha: float, target_modules: tuple[str, ...], base: str) -> dict:
    """A peft adapter_config.json for the learner's adapter (plain LoRA: no DoRA, no rsLoRA, no bias)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(target_modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "lora_dropout": 0.0,
        "base_model_name_or_path": base,
    }


class AdapterStore:
    """Policy versions as peft adapter folders under one directory in shared memory.

    `write` makes `<root>/v<version>` (weights, then config, then an atomic rename, so the engine never
    reads half a folder) and deletes every older version: adapters never pile up in /dev/shm.
    """

    def __init__(self, root: str, config: dict) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = config

    def write(self, version: int, weights: dict[str, torch.Tensor]) -> Path:
        from safetensors.torch import save_file

        final = self.root / f"v{version}"
        with atomic_dir(final) as tmp:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "adapter_model.safetensors"))
            (tmp / "adapter_config.json").write_text(json.dumps(self.config))
        for old in self.root.iterdir():
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def versions(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir())

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def merged_weights(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float, device: str
) -> dict[str, torch.Tensor]:
    """W + scale * B @ A for every adapted linear layer, under the base checkpoint's names.

    `base` maps `model.layers.0.self_attn.q_proj.weight` to W [out, in]; `adapter` holds peft's
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
    [out, r]. The sum is taken in fp32 and rounded once to W's dtype, as hf_cached merges.
    Shapes: -> {name: [out, in]} on `device`.
    """
    out = {}
    for name, a in adapter.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        w = base[f"{module}.weight"]
        delta = b.to(device, torch.float32) @ a.to(device, torch.float32)  # [out, in]
        out[f"{module}.weight"] = (w.to(device, torch.float32) + scale * delta).to(w.dtype)
    return out


def base_linear_weights(model_dir: str, adapter_names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's weights of every layer the adapter touches, in `dtype`, pinned on the CPU."""
    from safetensors import safe_open

    wanted = {
        n.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
        for n in adapter_names
        if n.endswith(".lora_A.weight")
    }
    out = {}
    for f in sorted(Path(model_dir).expanduser().glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for key in wanted & set(h.keys()):
                t = h.get_tensor(key).to(dtype)
                out[key] = t.pin_memory() if torch.cuda.is_available() else t
    missing = sorted(wanted - set(out))
    if missing:
        raise ConfigError(f"the checkpoint at {model_dir!r} lacks {missing[:3]}: the adapter does not fit this model")
    return out


def settings_from_config(cfg, gpu_share: float, gpu_cap_gib: float | None, max_num_seqs: int) -> VllmSettings:
    """The builder: `rollout.vllm` plus the sizes the rest of the run implies (the one place reading config): the
    actor's share of the GPU and its cap, and the rows the engine decodes at once (RolloutConfig.engine_rows). The
    config's values are validate's to check (config/rollout.py VllmRolloutConfig, config/checks.py)."""
    v = cfg.rollout.vllm
    return VllmSettings(
        refresh=v.refresh,
        max_num_seqs=max_num_seqs,
        cudagraph_capture_size=max_num_seqs,
        max_num_batched_tokens=v.max_num_batched_tokens,
        max_model_len=cfg.longest_row,
        gpu_share=gpu_share,
        gpu_cap_gib=gpu_cap_gib,
        kv_cache_gib=v.kv_cache_gib,
        quantization=cfg.model.student.quantization,
    )
