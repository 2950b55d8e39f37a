"""The vLLM backend's CPU-side parts: settings, memory arithmetic, adapter folders, the merge, and the
errors a user sees when vLLM cannot run. vLLM itself runs only in tests/rollout/test_vllm_gpu.py."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from miniverl.config import MiniVerlConfig
from miniverl.errors import ConfigError
from miniverl.models.lora import LoraSettings, adapter_state, build_lora_model
from miniverl.rollout import require_engine
from miniverl.rollout.sampling import SamplingParams, row_seeds
from miniverl.rollout.vllm import sampling_requests
from miniverl.rollout.vllm_settings import (
    ENGINE_OVERHEAD_GIB,
    AdapterStore,
    VllmSettings,
    adapter_config,
    base_linear_weights,
    memory_plan,
    merged_weights,
    served_weight_bytes,
    settings_from_config,
    vllm_lora_rank,
)

GIB = 2**30
LORA = LoraSettings(4, 8.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 0)


def settings(**kw) -> VllmSettings:
    cfg = MiniVerlConfig()
    rows = cfg.rollout.engine_rows(cfg.data)
    return settings_from_config(cfg, kw.pop("share", 0.4), kw.pop("cap", None), rows).__class__(
        **(settings_from_config(cfg, 0.4, None, rows).__dict__ | kw)
    )


def test_importing_the_backend_module_does_not_import_vllm():
    import miniverl.rollout.vllm  # noqa: F401

    assert "vllm" not in sys.modules


def test_settings_from_config_size_the_engine_for_the_run():
    cfg = MiniVerlConfig()
    cfg.data.prompts_per_step, cfg.rollout.n, cfg.data.eval_prompts = 64, 4, 32
    cfg.data.max_prompt_length, cfg.rollout.max_new_tokens = 100, 512
    s = settings_from_config(cfg, 0.4, 6.4, cfg.rollout.engine_rows(cfg.data))  # as setup/prepare.py sizes it
    assert (s.max_num_seqs, s.cudagraph_capture_size, s.max_model_len) == (256, 256, 612)
    assert (s.gpu_share, s.gpu_cap_gib, s.refresh, s.seeding) == (0.4, 6.4, "adapter", "row")


def test_lora_rank_rounds_up_to_what_vllm_supports_and_refuses_above():
    assert [vllm_lora_rank(r) for r in (1, 2, 16, 17, 300, 512)] == [1, 8, 16, 32, 320, 512]
    with pytest.raises(ConfigError, match=r"model.lora.rank=513.*refresh=merged"):
        vllm_lora_rank(513)


def test_memory_plan_uncapped_uses_the_ray_share():
    assert memory_plan(settings(gpu_share=0.4), 140 * GIB, 1 * GIB) == (0.4, None)
    assert memory_plan(settings(gpu_share=0.4, kv_cache_gib=3.0), 140 * GIB, GIB) == (0.4, 3 * GIB)


def test_memory_plan_under_a_cap_gives_an_explicit_kv_budget():
    util, kv = memory_plan(settings(gpu_share=0.4, gpu_cap_gib=6.4), 140 * GIB, 1 * GIB)
    assert util == pytest.approx(6.4 / 140)
    assert kv == int(6.4 * GIB) - GIB - int(ENGINE_OVERHEAD_GIB * GIB)


def test_memory_plan_refuses_a_cap_the_weights_do_not_fit_with_the_numbers():
    with pytest.raises(
        ConfigError, match=r"cap is 1.60 GiB.*weights and adapter take 1.25 GiB.*resources.rollout.num_gpus"
    ):
        memory_plan(settings(gpu_share=0.1, gpu_cap_gib=1.6), 140 * GIB, GIB, GIB // 4)
    with pytest.raises(ConfigError, match="kv_cache_gib smaller"):
        memory_plan(settings(gpu_cap_gib=6.0, kv_cache_gib=5.5), 140 * GIB, GIB)


def test_a_vllm_engine_that_cannot_run_here_is_explained(monkeypatch):
    require_engine("hf_cached", "cpu")  # the HF backends run their engine in-process, on either device
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*rollout=hf_cached"):
        require_engine("vllm", "cpu")
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install -e '.\[vllm\]'"):
        require_engine("vllm", "cuda")


def test_a_vllm_run_on_the_cpu_stops_before_any_actor(student_dir, teacher_dir):
    from miniverl.setup.prepare import prepare
    from tests.test_config import with_models

    cfg = with_models(student_dir, teacher_dir, "rollout=vllm", "resources.device=cpu")
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        prepare(cfg, log=lambda *_: None)


def test_adapter_store_keeps_one_version_and_cleans_up(tmp_path):
    store = AdapterStore(str(tmp_path / "shm"), adapter_config(4, 8.0, ("q_proj",), "base"))
    w = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 8)}
    for v in (1, 2, 3):
        path = store.write(v, w)
    assert store.versions() == ["v3"] and path == tmp_path / "shm" / "v3"
    assert {p.name for p in path.iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    store.close()
    assert not (tmp_path / "shm").exists()


def test_merged_weights_equal_peft_merge(random_model_dir):
    """W + (alpha/r) B A under the checkpoint's names is exactly what peft's merge serves."""
    model = build_lora_model(str(random_model_dir), LORA, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    adapter = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in adapter_state(model).items()}
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, adapter)
    expected = {k: v for k, v in model.merge_and_unload().state_dict().items() if k.endswith("proj.weight")}
    base = base_linear_weights(str(random_model_dir), list(adapter), torch.float32)
    merged = merged_weights(base, adapter, LORA.alpha / LORA.rank, "cpu")
    assert set(merged) == set(expected) and len(merged) == 7 * 2
    for k, v in merged.items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-6)


def test_served_weight_bytes_read_headers_and_size_an_nf4_student_in_four_bits(random_model_dir):
    """bf16 serving bytes of every tensor in the checkpoint, whatever dtype it was saved in (fp32 here); an NF4
    student's linear layers in NF4 (the 7B recipe's vLLM rollout was refused on the GPU when its 1.5B NF4 student was
    sized in bf16: 2.88 GiB instead of ~1.1)."""
    from safetensors.torch import load_file

    from miniverl.models.loading import NF4_BYTES_PER_PARAM

    tensors = load_file(str(next(Path(random_model_dir).glob("*.safetensors"))))
    assert all(t.dtype == torch.float32 for t in tensors.values())
    numel = sum(t.numel() for t in tensors.values())
    assert served_weight_bytes(str(random_model_dir), torch.bfloat16, "none") == 2 * numel
    linear = sum(t.numel() for k, t in tensors.items() if k.endswith("proj.weight"))
    assert served_weight_bytes(str(random_model_dir), torch.bfloat16, "nf4") == int(
        linear * NF4_BYTES_PER_PARAM + 2 * (numel - linear)
    )
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        served_weight_bytes(str(Path(random_model_dir).parent), torch.bfloat16, "none")


def test_nf4_student_is_served_quantized_and_never_merged():
    """vLLM must serve the learner's 4-bit base (adapter mode); merging into NF4 would re-quantize it, which validate
    refuses before the settings are built."""
    from miniverl.config import validate

    cfg = MiniVerlConfig()
    cfg.rollout.backend, cfg.model.student.quantization = "vllm", "nf4"
    validate(cfg)
    assert settings_from_config(cfg, 0.4, None, 8).quantization == "nf4"
    cfg.rollout.vllm.refresh = "merged"
    with pytest.raises(ConfigError, match="refresh=merged: merging the adapter into 4-bit weights"):
        validate(cfg)
    assert settings_from_config(MiniVerlConfig(), 0.4, None, 8).quantization == "none"


@pytest.mark.parametrize("backend", ["vllm", "hf_cached"])
@pytest.mark.parametrize("override", ["rollout.vllm.refresh=copy", "rollout.vllm.kv_cache_gib=0"])
def test_a_misspelled_vllm_option_fails_in_validate_before_ray(override, backend):
    """Whichever backend the run uses, a CPU run with rollout=hf_cached too: rollout.vllm's own values are checked as
    every section's are (its sizes always were), so a typo never waits for the day the backend changes."""
    from miniverl.config import validate
    from tests.test_config import load

    with pytest.raises(ConfigError, match=override.split("=")[0]):
        validate(load(f"rollout={backend}", "resources.device=cpu", override))
    validate(load(f"rollout={backend}", "resources.device=cpu"))


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16"])
def test_merged_refresh_is_refused_in_half_precision(dtype):
    """A bf16 merge rounds small updates away while the learner applies LoRA unmerged (issue 16)."""
    from miniverl.config import validate
    from tests.test_config import load

    with pytest.raises(ConfigError, match=rf"refresh=merged with model.student.dtype={dtype} .*refresh=adapter"):
        validate(load("rollout=vllm", "rollout.vllm.refresh=merged", f"model.student.dtype={dtype}"))
    validate(load("rollout=vllm", "rollout.vllm.refresh=merged", "model.student.dtype=float32"))
    validate(load("rollout=vllm", f"model.student.dtype={dtype}"))  # adapter mode is fine


@pytest.fixture
def fake_vllm(monkeypatch):
    """vllm's SamplingParams and TokensPrompt as records of what a request would carry (vLLM is GPU-only)."""
    vllm, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs.TokensPrompt = lambda prompt_token_ids: tuple(prompt_token_ids)
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


PROMPTS = [[1, 2], [3]]


def test_each_seeding_hands_vllm_the_rows_own_seeds(fake_vllm):
    """row: a request per row with its own seed; prompt: a request per prompt with its first row's seed (vLLM adds
    the sample's index); none: unseeded. No mode hands one seed to several prompts."""
    params, seeds = SamplingParams(n=2, max_new_tokens=4, stop_token_ids=(9,), seed=0), row_seeds(5, 4)
    requests, sampling = sampling_requests(PROMPTS, params, seeds, "row")
    assert requests == [(1, 2), (1, 2), (3,), (3,)] and [s.seed for s in sampling] == seeds and len(set(seeds)) == 4
    assert {(s.n, s.logprobs, tuple(s.stop_token_ids), s.max_tokens) for s in sampling} == {(1, 0, (9,), 4)}
    requests, sampling = sampling_requests(PROMPTS, params, seeds, "prompt")
    assert requests == [(1, 2), (3,)] and [(s.n, s.seed) for s in sampling] == [(2, seeds[0]), (2, seeds[2])]
    requests, sampling = sampling_requests(PROMPTS, params, seeds, "none", logprobs=False)
    assert [(s.n, s.seed, s.logprobs) for s in sampling] == [(2, None, None), (2, None, None)]
    with pytest.raises(ValueError, match=r"need one seed per completion \(4\), got 3"):
        sampling_requests(PROMPTS, params, seeds[:3], "row")
    with pytest.raises(ValueError, match="seeding 'batch': use row, prompt or none"):
        sampling_requests(PROMPTS, params, seeds, "batch")


class _RecordingLLM:
    """vllm.LLM.generate's shape: one output per request, n completions each (a stop after one token)."""

    def generate(self, requests, sampling, **kw):
        self.sampling = sampling
        logprob = types.SimpleNamespace(logprob=-1.5)
        done = types.SimpleNamespace(token_ids=[4], logprobs=[{4: logprob}], finish_reason="stop")
        return [types.SimpleNamespace(outputs=[done] * sp.n) for sp in sampling]


def test_the_bench_vllm_peer_never_gives_every_prompt_the_same_seed(fake_vllm):
    """The peer used to seed every prompt's request with the call's one seed, so G prompts x n samples were n noise
    streams (vLLM seeds sample j with seed + j): the rows' stop hazard read 0.71x the law's on the H200
    (lab/results/decode-profile.md).
    It now samples unseeded (vLLM's batched sampler, the default) or with the product's per-row seeds."""
    from lab.bench.baselines import RawVllm

    params, seeds = SamplingParams(n=2, max_new_tokens=4, seed=0), row_seeds(5, 4)
    peer = object.__new__(RawVllm)
    peer.llm, peer.request, peer.logprobs = _RecordingLLM(), None, True
    for seeding, expected in [("none", [None, None]), ("row", seeds)]:
        peer.seeding = seeding
        out = peer.generate(PROMPTS, params, seeds)
        assert [s.seed for s in peer.llm.sampling] == expected
        assert [(c.token_ids, c.logprobs, c.finished) for c in out] == [([4], [-1.5], True)] * 4
    with pytest.raises(ValueError, match=r"raw_vllm seeding='batch': use none \(vLLM's batched sampler\), row or"):
        RawVllm("m", LORA, torch.bfloat16, "cuda", 4, 16, seeding="batch")
