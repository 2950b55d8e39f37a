"""Every setting is checked before Ray starts, naming the key and the fix."""

from __future__ import annotations

import pytest
import torch

from miniverl.config import validate
from miniverl.errors import ConfigError
from miniverl.setup.preflight import check_lora_targets, has_wandb_credentials, linear_layer_names
from tests.test_config import load, with_models


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.student.dtype=bf16", "model.student.dtype='bf16': use auto or one of float32, bfloat16, float16"),
        ("model.teacher.dtype=fp32", "model.teacher.dtype='fp32'"),
        ("model.lora.rank=0", "model.lora.rank=0: a LoRA adapter needs rank >= 1"),
        ("model.lora.alpha=0", "model.lora.alpha=0.0: must be > 0"),
        ("model.lora.dropout=1.0", r"model.lora.dropout=1.0: must be in \[0, 1\)"),
        ("model.lora.target_modules=[]", "model.lora.target_modules is empty"),
        ("trainer.save_every=-1", "trainer.save_every=-1"),
        ("trainer.keep_checkpoints=0", "trainer.keep_checkpoints=0: keep at least 1"),
        ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite='ignore': use skip or stop"),
        ("trainer.resume=''", "trainer.resume is empty"),
        ("trainer.staleness=2", r"trainer.staleness=2: use 0 \(strict sync\) or 1"),
        ("trainer.staleness=-1", r"trainer.staleness=-1: use 0 \(strict sync\) or 1"),
        # issue 17: each of these failed late (after Ray) or without the key and value
        ("resources.torch_threads=-1", "resources.torch_threads=-1: use 0 \\(half the cores\\) or a thread count"),
        ("rollout.top_k=-1", "rollout.top_k=-1: use 0 \\(off\\)"),
        ("rollout.top_p=1.5", "rollout.top_p=1.5: use a value in \\(0, 1\\]"),
        ("data.train_files=[7]", "data.train_files=\\[7\\]: give a file path or a list of them"),
        ("data.max_unencodable_rows=-1", "data.max_unencodable_rows=-1"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(load(override))


def test_lora_targets_are_checked_against_the_models_linear_layers(student_dir):
    names = linear_layer_names(str(student_dir))
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= names
    check_lora_targets(str(student_dir), ["q_proj", "down_proj"])
    with pytest.raises(ConfigError, match=r"names \['query_key_value'\], which the student .* linear layers are"):
        check_lora_targets(str(student_dir), ["q_proj", "query_key_value"])


def test_wandb_credentials_come_from_the_environment_or_netrc(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert not has_wandb_credentials()
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert has_wandb_credentials()
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert has_wandb_credentials()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model.lora.target_modules=[q_proj,c_attn]",), r"names \['c_attn'\]"),
        (("tracking=online",), "tracking.wandb_mode=online but no wandb credentials"),
        (("resources.device=cpu", "resources.emulate_gpu_gib=16"), "resources.emulate_gpu_gib=16.0 caps GPU memory"),
        (("resources.device=cpu", "model.student.dtype=float16"), "model.student.dtype=float16 is a GPU dtype"),
        # issue 17: gpus on the CPU failed after Ray suggesting resources.device=cpu; scorer_gpus was ignored
        (
            ("resources.device=cpu", "resources.gpus=4"),
            r"resources.gpus=4 and .* ask for 4 GPUs, but this machine has 0",
        ),
        (("resources.device=cpu", "resources.scorer_gpus=2"), r"resources.scorer_gpus=2 gives the teacher GPUs"),
    ],
)
def test_model_credential_and_device_checks_fail_before_ray(
    student_dir, teacher_dir, tmp_path, monkeypatch, overrides, message
):
    import ray

    from miniverl.main import train

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with wandb credentials
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert not ray.is_initialized()
    cfg = with_models(student_dir, teacher_dir, *overrides)
    with pytest.raises(ConfigError, match=message):
        train(cfg, tmp_path / "run", {}, log=lambda *_: None)
    assert not ray.is_initialized()  # refused before Ray started
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_emulated_card_counts_each_actors_cuda_context():
    """Each actor's torch cap is its share of the card less its CUDA context (0.66 GiB measured), so the
    whole device stays inside the card; a share that leaves nothing is refused before Ray."""
    from miniverl.process import CUDA_CONTEXT_GIB, emulated_cap_gib, emulated_card_gib
    from miniverl.setup.preflight import check_device_settings

    # the card the caps are cut from: set and on CUDA only (the CPU and an unset or 0 card: no caps)
    assert emulated_card_gib(16, "cuda") == 16
    assert emulated_card_gib(16, "cpu") is None and emulated_card_gib(None, "cuda") is None
    assert emulated_card_gib(0, "cuda") is None
    assert emulated_cap_gib(16, 0.3, "x") == pytest.approx(4.8 - CUDA_CONTEXT_GIB)
    shares = {"rollout": 0.4, "scorer": 0.3, "learner": 0.3}
    caps = sum(emulated_cap_gib(16, f, a) for a, f in shares.items())
    assert caps + 3 * CUDA_CONTEXT_GIB == pytest.approx(16)
    check_device_settings(load("resources.emulate_gpu_gib=16"), "cuda")
    with pytest.raises(ConfigError, match=r"resources.learner.num_gpus=0.03 of resources.emulate_gpu_gib=16 is 0.48"):
        check_device_settings(load("resources.emulate_gpu_gib=16", "resources.learner.num_gpus=0.03"), "cuda")


def test_the_colocated_process_is_capped_below_the_card_by_its_measured_context():
    """Issue 15, qlora-4080.md run 9: the colocated process (one context, three roles, an NF4 teacher) holds 0.97 GiB
    outside torch's allocator, not one actor's 0.66; capped as one actor, the 12 GiB layout peaked at 12.3 GiB."""
    from miniverl.process import COLOCATED_CONTEXT_GIB, emulated_cap_gib

    measured_outside_allocator_gib = (12_603 - 11_610) / 1024  # nvidia-smi peak less torch's reserved peak, MiB
    cap = emulated_cap_gib(12, 1.0, "the colocated shares", COLOCATED_CONTEXT_GIB)
    assert cap + measured_outside_allocator_gib <= 12
    assert emulated_cap_gib(12, 1.0, "x") + measured_outside_allocator_gib > 12  # one actor's context: too little


def test_a_cache_dir_that_is_a_file_names_the_key(tmp_path):
    """Issue 17: model.cache_dir=<a file> was a NotADirectoryError traceback."""
    file = tmp_path / "cache"
    file.write_text("")
    with pytest.raises(ConfigError, match=r"model.cache_dir='.*cache' is a file, not a directory"):
        validate(load(f"model.cache_dir={file}"))


def test_a_model_path_that_is_a_file_says_so(student_dir, tmp_path):
    """Issue 17: model.student.path=<a file> said "does not exist"."""
    from miniverl.setup.prepare import prepare

    file = tmp_path / "model.safetensors"
    file.write_text("")
    cfg = with_models(file, student_dir)
    with pytest.raises(ConfigError, match=r"model.student.path='.*model.safetensors' is a file, not a model directory"):
        prepare(cfg, log=lambda *_: None)


def test_a_custom_reward_with_the_wrong_signature_fails_before_ray(student_dir, teacher_dir, tmp_path):
    """Issue 17: clear, but only after Ray was up (21 s in), when the first row was scored."""
    from miniverl.setup.prepare import prepare

    (tmp_path / "reward.py").write_text("def score(response, answer):\n    return 1.0\n")
    cfg = with_models(student_dir, teacher_dir, f"reward.custom_function={tmp_path}/reward.py:score")
    with pytest.raises(ConfigError, match=r"signature score\(response, answer\) cannot take the four arguments"):
        prepare(cfg, log=lambda *_: None)


def test_prompt_files_accept_a_string_or_a_list():
    """Issue 17: data.train_files=path/train.parquet (verl's docs) was a Hydra type error."""
    cfg = load("data.train_files=data/train.parquet", "data.val_files=[a.jsonl,b.jsonl]")
    assert cfg.data.train_files == ["data/train.parquet"] and cfg.data.val_files == ["a.jsonl", "b.jsonl"]
    assert load().data.train_files == []


def test_gpus_asked_for_must_exist_unless_an_existing_ray_cluster_has_them():
    """Issue 17: resources.gpus=4 resources.device=cpu failed after Ray started, suggesting resources.device=cpu."""
    from miniverl.setup.preflight import check_gpu_request

    cpu_two = load("resources.device=cpu", "resources.gpus=2", "resources.scorer_gpus=1")
    with pytest.raises(ConfigError, match=r"ask for 3 GPUs, but this machine has 0 .* drop resources.gpus"):
        check_gpu_request(cpu_two, "cpu", cuda_devices=0, ray_running=False)
    check_gpu_request(cpu_two, "cpu", cuda_devices=0, ray_running=True)  # a cluster with logical GPUs (tests)
    check_gpu_request(load("resources.gpus=2", "resources.ray_address=auto"), "cuda", 0, False)  # checked there
    with pytest.raises(ConfigError, match=r"ask for 2 GPUs, but this machine has 1 CUDA devices"):
        check_gpu_request(load("resources.gpus=2"), "cuda", cuda_devices=1, ray_running=False)
    check_gpu_request(load(), "cuda", cuda_devices=1, ray_running=False)  # the default: one GPU
    check_gpu_request(load(), "cpu", cuda_devices=0, ray_running=False)


def test_a_teacher_its_scorer_share_cannot_hold_is_refused_before_any_actor(student_dir, teacher_dir, monkeypatch):
    """On the GPU (qlora-4080.md run 7, 2026-12-02): a 12 GiB emulated card left the 1.5B bf16 teacher's scorer no
    room, and the scorer said so only after Ray had started and the student had loaded. On an emulated card the share
    is known in the driver, so prepare refuses it with the same arithmetic; what fits passes, and a 4-bit teacher is
    left to the scorer."""
    import miniverl.setup.prepare as prep
    from miniverl.models.loading import checkpoint_numel

    monkeypatch.setattr(prep, "resolve_device", lambda requested: "cuda")  # only config and files are read
    # shares that isolate the scorer (not a placement): 0.04 GiB for it, 1.1 GiB for the learner, whose own check
    # (the next test) passes at every row length here
    card = ("resources.emulate_gpu_gib=4", "resources.rollout.num_gpus=0.2", "resources.scorer.num_gpus=0.175")
    card += ("resources.learner.num_gpus=0.5",)
    quiet = lambda *_: None  # noqa: E731
    assert checkpoint_numel(str(teacher_dir)) > 0 and checkpoint_numel(str(teacher_dir / "missing")) == 0
    prep.prepare(with_models(student_dir, teacher_dir, *card), log=quiet)  # 43 MB hold short rows of a tiny teacher
    long_rows = with_models(student_dir, teacher_dir, *card, "rollout.max_new_tokens=60000")
    with pytest.raises(ConfigError, match=r"the teacher scorer's memory share of .* cannot hold one row of 6\d{4} tok"):
        prep.prepare(long_rows, log=quiet)
    four_bit = with_models(
        student_dir, teacher_dir, *card, "rollout.max_new_tokens=60000", "model.teacher.quantization=nf4"
    )
    prep.prepare(four_bit, log=quiet)  # its loaded size is the scorer's to count (bitsandbytes is a dependency)


def test_a_student_its_learner_share_cannot_hold_is_refused_before_any_actor(student_dir, teacher_dir, monkeypatch):
    """The learner's twin of the scorer check (issue 35: "will it fit?" before anything loads): on an emulated card
    prepare refuses rows or a token budget the learner's share cannot hold, with the arithmetic the learner would
    print after loading; adapter parameters are counted on the meta device as peft makes them; a 4-bit student is
    left to the learner."""
    import miniverl.setup.prepare as prep
    from miniverl.models.lora import LoraSettings, adapter_params, build_lora_model
    from miniverl.models.sizing import fit_tokens
    from miniverl.process import CUDA_CONTEXT_GIB
    from miniverl.workers.token_budget import learner_shape

    lora = load().model.lora
    model = build_lora_model(str(student_dir), LoraSettings.from_config(lora), torch.bfloat16, "cpu")  # as on a GPU
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapter_params(model.get_base_model().config, lora.rank, lora.target_modules) == trainable > 0

    monkeypatch.setattr(prep, "resolve_device", lambda requested: "cuda")  # only config and files are read
    card = ("resources.emulate_gpu_gib=8", "resources.rollout.num_gpus=0.15", "resources.scorer.num_gpus=0.45")
    card += ("resources.learner.num_gpus=0.1375",)  # 0.44 GiB: weights, adapter state, 128 MiB of runtime, then rows
    quiet = lambda *_: None  # noqa: E731
    said = []
    prep.prepare(with_models(student_dir, teacher_dir, *card), log=said.append)
    # the plan (miniverl/setup/fit.py, as `python -m miniverl.fit` prints it) is the learner's own sizing of the
    # loaded model (workers/token_budget.py learner_shape, fit_tokens)
    share = int((8 * 0.1375 - CUDA_CONTEXT_GIB) * 2**30)
    tokens = fit_tokens(learner_shape(model), share, 0, False, 1)  # the budget: the most that fits, any row length
    at = said.index("[miniverl] memory plan for a 8.0 GiB card (resources.emulate_gpu_gib):")
    chunk, checkpointing, compiled, learner, scorer, _, _, verdict = said[at + 1 : at + 9]
    # trainer.logprob_chunk_tokens and trainer.gradient_checkpointing were left null: chosen, and said why
    assert chunk == "[miniverl]   trainer.logprob_chunk_tokens=0 (chosen: a 43-token vocabulary's logits are small)"
    assert checkpointing.startswith("[miniverl]   trainer.gradient_checkpointing=false (chosen: micro-batches of up to")
    # this machine has no Triton-capable GPU: the learner would not compile its layers here, and is told why
    assert compiled.startswith("[miniverl]   trainer.compile_layers=false (chosen: no Triton on this GPU")
    assert learner.startswith("[miniverl]   learner") and f"micro-batches of up to {tokens:,} tokens" in learner
    assert "forwards of up to" in scorer and verdict == "[miniverl]   => fits"
    long_rows = with_models(student_dir, teacher_dir, *card, "rollout.max_new_tokens=200000")
    with pytest.raises(ConfigError, match=r"the learner's memory share of .* cannot hold one row of 200032 tokens"):
        prep.prepare(long_rows, log=quiet)
    budget = ("trainer.max_tokens_per_micro_batch=300000", "trainer.gradient_checkpointing=false")
    with pytest.raises(ConfigError, match=r"trainer.max_tokens_per_micro_batch=300000 would peak the learner at"):
        prep.prepare(with_models(student_dir, teacher_dir, *card, *budget), log=quiet)
    assert tokens < 150_000  # without checkpointing; with it 171,835 fit
    # checkpointing left null: chosen to hold the explicit budget
    chosen = with_models(student_dir, teacher_dir, *card, "trainer.max_tokens_per_micro_batch=150000")
    said.clear()
    prep.prepare(chosen, log=said.append)
    assert chosen.trainer.gradient_checkpointing is True and "[miniverl]   => fits" in said
    four_bit = with_models(
        student_dir, teacher_dir, *card, "rollout.max_new_tokens=200000", "model.student.quantization=nf4"
    )
    prep.prepare(four_bit, log=quiet)  # its loaded size is the learner's to count


def test_what_the_plan_chose_is_applied_and_kept_in_the_setup(student_dir, teacher_dir, monkeypatch):
    """Null shares and layout are chosen before Ray and applied to the config the actors start from; the setup keeps
    them by dotted key (summary.json's `chosen`, the tracker's config), so a run's record says what it ran with.
    On the CPU only the layout is chosen (0 and off) and the shares stay null (placement.replica_share counts Ray's)."""
    import miniverl.setup.prepare as prep

    quiet = lambda *_: None  # noqa: E731
    cpu = prep.prepare(with_models(student_dir, teacher_dir), log=quiet)
    layout = {"trainer.logprob_chunk_tokens": 0, "trainer.gradient_checkpointing": False}
    layout["trainer.compile_layers"] = False  # on the CPU compiling would cost more than it saves
    assert cpu.chosen == {"rollout.backend": "hf_cached", **layout}  # rollout.backend=auto, the default
    kept = prep.prepare(
        with_models(student_dir, teacher_dir, "trainer.gradient_checkpointing=true", "rollout=hf_reference"), log=quiet
    )
    # a value the config sets is not "chosen"
    assert kept.chosen == {"trainer.logprob_chunk_tokens": 0, "trainer.compile_layers": False}

    monkeypatch.setattr(prep, "resolve_device", lambda requested: "cuda")  # only config and files are read
    cfg = with_models(student_dir, teacher_dir, "resources.emulate_gpu_gib=8", "resources.scorer.num_gpus=0.3")
    said = []
    gpu = prep.prepare(cfg, log=said.append)
    shares = {k: v for k, v in gpu.chosen.items() if k.startswith("resources.")}
    assert set(shares) == {"resources.rollout.num_gpus", "resources.learner.num_gpus"}  # the scorer's was set
    assert shares["resources.rollout.num_gpus"] + shares["resources.learner.num_gpus"] == pytest.approx(0.7)
    for key, value in gpu.chosen.items():  # applied: the actors are sized and placed from these
        section, *rest = key.split(".")
        node = getattr(cfg, section)
        for name in rest[:-1]:
            node = getattr(node, name)
        assert getattr(node, rest[-1]) == value, key
        assert any(line.split("]", 1)[1].lstrip().startswith(f"{key}=") and "(chosen: " in line for line in said), key
    assert cfg.resources.scorer.num_gpus == 0.3
    # the plan it printed is kept too (summary.json "plan"): the numbers of its lines, so measured peaks can be set
    # against it after the run; the CPU plans nothing
    assert cpu.plan is None and kept.plan is None
    planned = gpu.plan["actors"]
    assert list(planned) == ["learner", "scorer", "rollout"] and gpu.plan["card_gib"] == 8
    assert planned["scorer"]["fraction"] == 0.3 and planned["rollout"]["measured_as"] == "reserved"
    device_line = next(line for line in said if "modelled peak of the whole card" in line)
    assert f"card {gpu.plan['device_peak_gib']:.1f} GiB of 8.0 GiB" in device_line


def test_a_gpu_run_whose_prompts_are_far_shorter_than_planned_is_told_the_setting_that_plans_for_them(
    student_dir, teacher_dir, monkeypatch
):
    """mopd-gpu.md run 2 (2026-12-06): four NF4 teachers' learner got 5,179-token micro-batches because the plan sized
    every row for 320-token prompts, and the prompts had 10 tokens. The run says so, with the value to set; not where
    the prompts come near the limit, and not on the CPU (no plan)."""
    import miniverl.setup.prepare as prep
    from miniverl.setup.fit import short_prompts_hint

    assert short_prompts_hint(17, 32) is None and short_prompts_hint(161, 320) is None
    assert short_prompts_hint(10, 32) is None  # the default's limit: nothing smaller to suggest
    hint = short_prompts_hint(10, 320)
    assert "at most 10 tokens" in hint and "data.max_prompt_length=320" in hint
    assert "data.max_prompt_length=64 plans" in hint and "data/overlong_filtered" in hint
    assert "data.max_prompt_length=128 plans" in short_prompts_hint(60, 320)  # twice the longest, in 64s
    assert short_prompts_hint(100, 320) is None  # 256 of 320: too little to gain
    assert "a smaller rollout share" in hint  # an HF rollout's share follows its rows; vLLM's and SGLang's do not
    from miniverl.config.rollout import RolloutConfig

    engines = [RolloutConfig(backend=b).paged_engine for b in ("vllm", "sglang", "hf_cached", "hf_reference")]
    assert engines == [True, True, False, False]
    paged = short_prompts_hint(10, 320, paged_engine=True)
    assert "rollout share" not in paged and "larger learner" in paged

    said: list[str] = []
    prep.prepare(with_models(student_dir, teacher_dir, "data.max_prompt_length=300"), log=said.append)
    assert not any("prompts read so far" in line for line in said)  # the CPU plans nothing
    monkeypatch.setattr(prep, "resolve_device", lambda requested: "cuda")  # only config and files are read
    card = ("resources.emulate_gpu_gib=16", "data.max_prompt_length=300")
    prep.prepare(with_models(student_dir, teacher_dir, *card), log=said.append)
    note = [line for line in said if "prompts read so far" in line]
    assert len(note) == 1 and "data.max_prompt_length=300" in note[0] and "data.max_prompt_length=64 plans" in note[0]
    said.clear()
    prep.prepare(with_models(student_dir, teacher_dir, "resources.emulate_gpu_gib=16"), log=said.append)  # 32
    assert not any("prompts read so far" in line for line in said)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_what_the_launcher_hands_the_actors_is_resolved_before_ray(student_dir, teacher_dir, monkeypatch, backend):
    """The placement, the adapter's settings and the rollout engine's settings come out of prepare (setup/records.py
    Setup), not out of the launcher after Ray started: on the CPU the one-replica placement and no engine; on an
    emulated card the engine sized for the rollout's chosen share, its cap, and the run's rows."""
    import miniverl.setup.prepare as prep
    from miniverl.models.lora import LoraSettings
    from miniverl.process import emulated_cap_gib
    from miniverl.setup.placement import plan_placement

    quiet = lambda *_: None  # noqa: E731
    cfg = with_models(student_dir, teacher_dir)
    cpu = prep.prepare(cfg, log=quiet)
    assert cpu.placement == plan_placement(cfg.resources, 0) and cpu.placement.count["rollout"] == 1
    assert cpu.lora == LoraSettings.from_config(cfg.model.lora) and cpu.engine is None
    assert cpu.teacher_precisions == {"teacher": (cfg.model.teacher.dtype, cfg.model.teacher.quantization)}

    monkeypatch.setattr(prep, "resolve_device", lambda requested: "cuda")  # only config and files are read
    monkeypatch.setattr(prep, "require_engine", lambda backend, device: None)  # no engine is started here
    cfg = with_models(student_dir, teacher_dir, f"rollout={backend}", "resources.emulate_gpu_gib=8")
    gpu = prep.prepare(cfg, log=quiet)
    share = gpu.chosen["resources.rollout.num_gpus"]  # the plan's choice, applied
    assert gpu.placement == plan_placement(cfg.resources, 1) and gpu.placement.num_gpus["rollout"] == share
    assert (gpu.engine.gpu_share, gpu.engine.gpu_cap_gib) == (share, emulated_cap_gib(8, share, "rollout share"))
    rows = cfg.rollout.engine_rows(cfg.data) if backend == "vllm" else cfg.rollout.largest_call(cfg.data)
    assert (gpu.engine.max_num_seqs if backend == "vllm" else gpu.engine.max_running_requests) == rows
    over = ("resources.emulate_gpu_gib=8", "resources.rollout.num_gpus=0.6", "resources.scorer.num_gpus=0.5")
    bad = with_models(student_dir, teacher_dir, *over)
    with pytest.raises(ConfigError, match="add up to 1.1 of one GPU"):  # refused before Ray, as before
        prep.prepare(bad, log=quiet)
