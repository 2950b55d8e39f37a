"""rollout=sglang on the CPU (issue 37): its settings, what is refused before Ray, and the backend's own arithmetic
and bookkeeping against a stand-in engine. The engine itself runs only on a GPU with sglang installed
(tests/rollout/test_sglang_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miniverl.config import validate
from miniverl.errors import ConfigError
from miniverl.models.lora import LoraSettings
from miniverl.rollout import require_engine
from miniverl.rollout.sampling import SamplingParams
from miniverl.rollout.sglang import (
    PROFILE_FRACTION,
    SGLANG_GRAPHS_GIB,
    SglangBackend,
    SglangSettings,
    completion,
    engine_overhead_bytes,
    memory_plan,
    request_params,
    settings_from_config,
)
from tests.test_config import load

GIB = 2**30


def settings(**kw) -> SglangSettings:
    base = dict(
        attention_backend="triton",
        mem_fraction_static=None,
        chunked_prefill_size=2048,
        batch_invariant=False,
        max_running_requests=64,
        context_length=256,
        gpu_share=0.4,
        gpu_cap_gib=None,
    )
    return SglangSettings(**(base | kw))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.sglang.attention_backend=fa4"], "rollout.sglang.attention_backend='fa4': use one of triton"),
        (
            ["rollout.sglang.mem_fraction_static=0"],
            r"rollout.sglang.mem_fraction_static=0.0: a fraction of the free memory",
        ),
        (
            ["rollout.sglang.chunked_prefill_size=0"],
            "rollout.sglang.chunked_prefill_size=0: a positive number of tokens",
        ),
        (
            ["rollout.sglang.max_running_requests=0"],
            "rollout.sglang.max_running_requests=0: a positive number of rows, or null",
        ),
        (
            ["rollout=sglang", "resources.colocate=true"],
            "resources.colocate=true with rollout=sglang: SGLang runs its scheduler in processes of its own",
        ),
        (
            ["rollout=sglang", "model.student.quantization=nf4"],
            "model.student.quantization=nf4 with rollout=sglang: SGLang's 4-bit path has not been measured",
        ),
    ],
)
def test_sglang_settings_and_combinations_are_refused_before_ray(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load(*overrides))


def test_a_good_sglang_config_passes_and_its_settings_follow_the_run():
    cfg = load(
        "rollout=sglang",
        "rollout.sglang.mem_fraction_static=0.3",
        "data.prompts_per_step=8",
        "rollout.n=4",
        "rollout.vllm.max_num_seqs=5",  # vLLM's own knob: not SGLang's
    )
    validate(cfg)
    s = settings_from_config(cfg, 0.4, 12.0, cfg.rollout.largest_call(cfg.data))  # as setup/prepare.py sizes it
    assert s.mem_fraction_static == 0.3 and s.gpu_share == 0.4 and s.gpu_cap_gib == 12.0
    assert s.chunked_prefill_size == 2048  # SGLang's own for a card under 20 GB, whatever card the run is on
    assert s.max_running_requests == max(8 * 4, cfg.data.eval_prompts)  # the run's largest generate call
    assert s.context_length == cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    assert s.batch_invariant is False  # the default: as exact and faster (sglang-gpu/run3.md)
    cfg.rollout.sglang.max_running_requests = 12
    assert settings_from_config(cfg, 0.4, 12.0, 32).max_running_requests == 12  # a bound below the largest call
    cfg.rollout.sglang.max_running_requests = 1000
    assert settings_from_config(cfg, 0.4, 12.0, 32).max_running_requests == 32  # never above it


def test_sglang_on_the_cpu_or_without_the_package_is_refused_with_the_fix(monkeypatch):
    with pytest.raises(ConfigError, match="rollout=sglang needs a CUDA GPU but this run computes on the CPU"):
        require_engine("sglang", "cpu")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="rollout=sglang but SGLang is not installed; install sglang 0.5.17"):
        require_engine("sglang", "cuda")
    with pytest.raises(ConfigError, match="rollout=sglang needs a CUDA GPU; use rollout=hf_cached on the CPU"):
        SglangBackend("unused", None, torch.bfloat16, "cpu", settings())


def test_the_kv_pool_is_the_share_or_the_cap_less_the_weights_and_the_engines_overhead():
    """SGLang's static fraction is of the memory free when its scheduler starts (sglang-gpu/run3.md's engine took its
    0.041 of what the other actors' loading left), so the pool is sized here: the actor's budget less the weights, the
    adapter and the overhead (graphs, 36 bytes per row decoded at once and vocabulary entry, a bounded chunk of prompt
    log-probs), in tokens. That run's scheduler (256 rows, Qwen2.5's vocabulary) read 4,754 MiB once started with a
    static part of 3.0-3.3 GiB and one 0.66 GiB context: its graphs and the shared output buffer are within the
    model's."""
    total, vocab, token = 140 * GIB, 151936, 12 * 2**10
    overhead = engine_overhead_bytes(256, vocab) / GIB
    assert overhead == pytest.approx(0.8 + (256 * 36 + 256 * 10) * vocab / GIB) and 2.45 < overhead < 2.5
    started = (4754 - 3.0 * 1024) / 1024 - 0.66  # sglang-gpu/run3.md, after start, with the smaller static part
    assert started - 0.05 < SGLANG_GRAPHS_GIB + 256 * vocab * 4 / GIB < started + 0.05
    assert engine_overhead_bytes(64, vocab) < engine_overhead_bytes(256, vocab)  # fewer rows at once: less
    weights, adapter = int(0.92 * GIB), int(0.07 * GIB)
    one = engine_overhead_bytes(64, vocab)
    fraction, tokens = memory_plan(settings(gpu_cap_gib=4.94), total, vocab, weights, adapter, token)
    assert fraction == PROFILE_FRACTION and tokens == (int(4.94 * GIB) - weights - adapter - one) // token
    shared = int(0.4 * total - 0.66 * GIB)  # no cap: the share less the actor's context, as the planner shares it
    assert (
        memory_plan(settings(), total, vocab, weights, adapter, token)[1] == (shared - weights - adapter - one) // token
    )
    assert memory_plan(settings(mem_fraction_static=0.25), total, vocab, weights, adapter, token) == (0.25, None)
    with pytest.raises(ConfigError, match=r"leaving 0.00 GiB for the KV pool.* rollout.sglang.max_running_requests"):
        memory_plan(settings(gpu_cap_gib=2.5, max_running_requests=256), total, vocab, weights, adapter, token)
    fewer = memory_plan(settings(gpu_cap_gib=2.5, max_running_requests=16), total, vocab, weights, adapter, token)
    assert fewer[1] * token >= 256 * token  # fewer rows at once: a pool for at least one 256-token row


def test_each_row_is_one_request_with_its_own_seed_and_sglangs_top_k():
    params = SamplingParams(n=2, max_new_tokens=9, temperature=0.7, top_k=0, top_p=0.9, stop_token_ids=(2, 5))
    p = request_params(params, 1234)
    assert p == {
        "max_new_tokens": 9,
        "temperature": 0.7,
        "top_k": -1,  # ours 0 = off, SGLang's -1
        "top_p": 0.9,
        "stop_token_ids": [2, 5],
        "sampling_seed": 1234,
    }
    assert request_params(SamplingParams(n=1, max_new_tokens=4, top_k=20), 0)["top_k"] == 20


def test_an_output_becomes_a_row_and_a_mismatch_stops_the_run():
    out = {"output_ids": [7, 8, 2], "meta_info": {"output_token_logprobs": [(-0.1, 7, None), (-0.2, 8, None),
                                                                           (-0.3, 2, None)],
                                                  "finish_reason": {"type": "stop", "matched": 2}}}  # fmt: skip
    row = completion(out)
    assert row.token_ids == [7, 8, 2] and row.logprobs == [-0.1, -0.2, -0.3] and row.finished
    out["meta_info"]["finish_reason"] = {"type": "length", "length": 3}
    assert not completion(out).finished
    out["meta_info"]["output_token_logprobs"] = out["meta_info"]["output_token_logprobs"][:2]
    with pytest.raises(RuntimeError, match="returned 3 token ids but 2 log-probs"):
        completion(out)


class StandInEngine:
    """The calls SglangBackend makes of sglang.Engine, recorded."""

    def __init__(self, flushes: bool = True) -> None:
        self.calls: list[tuple] = []
        self.flushes = flushes

    def load_lora_adapter_from_tensors(self, name, tensors, config):
        self.calls.append(("load", name, sorted(tensors), config["r"]))

    def unload_lora_adapter(self, name):
        self.calls.append(("unload", name))

    def flush_cache(self):
        self.calls.append(("flush",))
        return self.flushes

    def generate(self, input_ids, sampling_params, return_logprob, lora_path=None, logprob_start_len=None):
        self.calls.append(("generate", len(input_ids), lora_path))
        if logprob_start_len == 0:
            return [{"meta_info": {"input_token_logprobs": [(None, s[0], None)] + [(-1.0, t, None) for t in s[1:]]}}
                    for s in input_ids]  # fmt: skip
        return [{"output_ids": [3], "meta_info": {"output_token_logprobs": [(-0.5, 3, None)],
                                                  "finish_reason": {"type": "stop"}}} for _ in input_ids]  # fmt: skip


def stand_in(engine: StandInEngine) -> SglangBackend:

    backend = object.__new__(SglangBackend)  # no engine start: __init__ needs CUDA and sglang
    backend.lora = LoraSettings(4, 8.0, 0.0, ("q_proj",), 0)
    backend.engine, backend.version, backend.adapter, backend._weights = engine, 0, None, {}
    return backend


def test_every_version_is_a_new_adapter_the_old_one_unloaded_and_the_cache_flushed():
    engine = StandInEngine()
    backend = stand_in(engine)
    w = {"a.lora_A.weight": torch.ones(4, 8)}
    backend.load_adapter(w)
    backend.load_adapter(w)
    assert engine.calls == [
        ("load", "miniverl-v1", ["a.lora_A.weight"], 4),
        ("flush",),
        ("load", "miniverl-v2", ["a.lora_A.weight"], 4),
        ("unload", "miniverl-v1"),
        ("flush",),
    ]
    assert backend.served_digest() is None  # proven by the probe at every refresh
    rows = backend.generate([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=4), [10, 11, 12, 13])
    assert len(rows) == 4 and engine.calls[-1] == ("generate", 4, ["miniverl-v2"] * 4)  # served: the newest
    assert backend.probe_logprobs([[1, 2, 3]]) == [[-1.0, -1.0]]  # positions 1.. of the sequence
    with pytest.raises(ValueError, match="need one seed per completion"):
        backend.generate([[1, 2]], SamplingParams(n=2, max_new_tokens=4), [10])


def test_a_refused_flush_stops_the_run():
    backend = stand_in(StandInEngine(flushes=False))
    with pytest.raises(RuntimeError, match="refused to flush its radix cache after loading policy version 1"):
        backend.load_adapter({"a.lora_A.weight": torch.ones(4, 8)})


def test_the_engine_processes_get_the_registration_shim_and_seeds_are_honoured(monkeypatch, tmp_path):
    """sglang 0.5.17 re-registers model types that transformers 5.17 has, which transformers refuses
    (sglang-gpu/run1.md on the H200); the shim, first on the PYTHONPATH the engine's processes inherit, lets it.
    Checked in a child process as the engine's scheduler would start: with the shim a second registration passes,
    without it transformers refuses it (what broke the scheduler). And the engine is asked for deterministic inference,
    without which SGLang ignores sampling_seed (sglang-gpu/run1.md: other tokens for the same seed)."""
    import os
    import subprocess
    import sys

    from miniverl.rollout import sglang as backend

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    for name in (backend.BATCH_INVARIANT_ENV, backend.MEMORY_CAP_ENV, "SGLANG_LOGPROB_CHUNK_SIZE"):
        monkeypatch.setenv(name, "restored after the test")  # the backend sets them in this process
        monkeypatch.delenv(name)
    backend.use_compat_shim()
    backend.use_compat_shim()  # once on the path, however often a backend starts
    paths = os.environ["PYTHONPATH"].split(os.pathsep)
    assert paths[0].endswith("sglang_compat") and paths[1:] == ["/elsewhere"]
    again = "from transformers import AutoConfig, PretrainedConfig\n"
    again += "class C(PretrainedConfig):\n    model_type = 'qwen2'\nAutoConfig.register('qwen2', C)\nprint('ok')\n"
    script = tmp_path / "register_again.py"
    script.write_text(again)
    shimmed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=os.environ.copy())
    assert shimmed.returncode == 0 and "ok" in shimmed.stdout, shimmed.stderr[-2000:]
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env={**os.environ,
                           "PYTHONPATH": "/elsewhere"})  # fmt: skip
    assert plain.returncode != 0 and "already used by a Transformers config" in plain.stderr

    started = {}

    class FakeSglang:
        @staticmethod
        def Engine(**kwargs):
            started.update(kwargs)
            return StandInEngine()

    monkeypatch.setitem(sys.modules, "sglang", FakeSglang)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda i: type("P", (), {"total_memory": 140 * GIB}))
    monkeypatch.setattr(backend, "adapter_template", lambda *a: {})
    qwen = {"vocab_size": 151936, "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2}
    monkeypatch.setattr(backend, "load_model_config", lambda *a: type("C", (), qwen | {"num_hidden_layers": 24}))
    monkeypatch.setattr(backend, "model_size", lambda *a: type("S", (), {"weight_bytes": lambda self, q, b: GIB})())
    backend.SglangBackend("m", LoraSettings(4, 8.0, 0.0, ("q_proj",), 0), torch.bfloat16, "cuda", settings())
    assert started["enable_deterministic_inference"] is True and "sampling_backend" not in started
    # sized from the run, not from the card: SGLang chose an 8,192-token chunk on the 80 GB H100 (sglang-gpu/run2.md)
    assert started["chunked_prefill_size"] == 2048 and started["cuda_graph_max_bs_decode"] == 64
    assert os.environ[backend.BATCH_INVARIANT_ENV] == "0"  # the default: SGLang's usual kernels (sglang-gpu/run3.md)
    assert os.environ["SGLANG_LOGPROB_CHUNK_SIZE"] == "256"  # prompt log-probs in bounded chunks (SGLang's: 2,048)
    assert backend.MEMORY_CAP_ENV not in os.environ  # no emulated card: the scheduler's allocator is not capped
    planned = int(0.4 * 140 * GIB - 0.66 * GIB) - GIB - engine_overhead_bytes(64, 151936)  # share, weights, overhead
    assert started["mem_fraction_static"] == PROFILE_FRACTION and started["max_total_tokens"] == planned // (12 * 2**10)
    backend.SglangBackend("m", LoraSettings(4, 8.0, 0.0, ("q_proj",), 0), torch.bfloat16, "cuda",
                          settings(batch_invariant=True, gpu_cap_gib=5.0))  # fmt: skip
    assert os.environ[backend.BATCH_INVARIANT_ENV] == "1" and started["enable_deterministic_inference"] is True
    assert os.environ[backend.MEMORY_CAP_ENV] == str(5 * GIB)  # an emulated card: capped at the actor's budget
    backend.SglangBackend("m", LoraSettings(4, 8.0, 0.0, ("q_proj",), 0), torch.bfloat16, "cuda", settings())
    assert backend.MEMORY_CAP_ENV not in os.environ  # a later engine without a cap does not inherit one


def test_the_shim_keeps_sglangs_batch_invariant_mode_off_when_asked_and_only_then(tmp_path):
    """SglangSettings.batch_invariant=False (a run's): deterministic inference (for the row seeds) without the
    batch-invariant kernels it turns on. In a child process started as the engine's scheduler is (the shim first on
    PYTHONPATH), a stand-in sglang.srt.batch_invariant_ops is imported and its switch called the way model_runner.py
    calls it."""

    from miniverl.rollout import sglang as backend
    from miniverl.rollout.sglang_compat import sitecustomize as shim

    assert shim.BATCH_INVARIANT_ENV == backend.BATCH_INVARIANT_ENV  # one name on both sides of the process boundary
    package = tmp_path / "sglang" / "srt" / "batch_invariant_ops"
    package.mkdir(parents=True)
    for folder in (tmp_path / "sglang", tmp_path / "sglang" / "srt"):
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("ENABLED = []\ndef enable_batch_invariant_mode():\n    ENABLED.append(1)\n")
    script = tmp_path / "runner.py"
    script.write_text(
        "from sglang.srt.batch_invariant_ops import enable_batch_invariant_mode\n"
        "enable_batch_invariant_mode()\n"
        "import sglang.srt.batch_invariant_ops as ops\n"
        "print('enabled' if ops.ENABLED else 'kept off')\n"
    )

    def run(value: str | None) -> str:
        return run_as_an_engine_process(script, tmp_path, shim.BATCH_INVARIANT_ENV, value)

    assert run("0") == "kept off"
    assert run("1") == "enabled" and run(None) == "enabled"  # the default leaves SGLang alone


def test_the_shim_caps_the_schedulers_allocator_before_its_model_runner_allocates_and_only_when_asked(tmp_path):
    """An emulated card (resources.emulate_gpu_gib): every actor's process is capped at its budget, and so is SGLang's
    scheduler, the process that builds its ModelRunner (sglang-gpu/run3.md's, uncapped, kept 7.7 GiB against a 4.9 GiB
    budget). In a child process started as the scheduler is (the shim first on PYTHONPATH), stand-ins for torch.cuda and
    SGLang's model_runner record the order: the cap on the runner's GPU first, then the runner's own start."""

    from miniverl.rollout import sglang as backend
    from miniverl.rollout.sglang_compat import sitecustomize as shim

    assert shim.MEMORY_CAP_ENV == backend.MEMORY_CAP_ENV  # one name on both sides of the process boundary
    runner = tmp_path / "sglang" / "srt" / "model_executor"
    runner.mkdir(parents=True)
    for folder in (tmp_path / "sglang", tmp_path / "sglang" / "srt", runner):
        (folder / "__init__.py").write_text("")
    (runner / "model_runner.py").write_text(
        "import torch\n"
        "class ModelRunner:\n"
        "    def __init__(self, model_config, mem_fraction_static, gpu_id, *rest):\n"
        "        torch.cuda.CALLS.append(('init', gpu_id))\n"
    )
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "class _Card:\n    total_memory = 80 * 2**30\n"
        "class cuda:\n    CALLS = []\n"
        "    get_device_properties = staticmethod(lambda gpu: _Card)\n"
        "    set_per_process_memory_fraction = staticmethod(lambda f, gpu: cuda.CALLS.append((f, gpu)))\n"
    )
    (tmp_path / "transformers").mkdir()  # the shim's other patch finds no transformers here
    (tmp_path / "transformers" / "__init__.py").write_text("raise ImportError('not in this stand-in')\n")
    script = tmp_path / "scheduler.py"
    script.write_text(
        "from sglang.srt.model_executor.model_runner import ModelRunner\n"
        "ModelRunner('config', 0.03, 0)\nModelRunner('config', 0.03, gpu_id=1)\n"
        "import torch\nprint(torch.cuda.CALLS)\n"
    )

    def run(cap: str | None) -> str:
        return run_as_an_engine_process(script, tmp_path, shim.MEMORY_CAP_ENV, cap)

    assert run(str(5 * GIB)) == "[(0.0625, 0), ('init', 0), (0.0625, 1), ('init', 1)]"  # 5 of 80 GiB, each GPU
    assert run(None) == "[('init', 0), ('init', 1)]"  # a real card: SGLang's own sizing alone


def run_as_an_engine_process(script: Path, stand_ins: Path, name: str, value: str | None) -> str:
    """`script`'s output in a child process started as SGLang starts its engine's (the shim first on PYTHONPATH, then
    the stand-in packages in `stand_ins`), with the environment variable `name` set to `value` or unset."""
    import os
    import subprocess
    import sys

    from miniverl.rollout.sglang_compat import sitecustomize as shim

    path = os.pathsep.join([str(Path(shim.__file__).parent), str(stand_ins)])
    env = {k: v for k, v in os.environ.items() if k != name} | {"PYTHONPATH": path}
    if value is not None:
        env[name] = value
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()
