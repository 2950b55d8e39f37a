"""Every default of the product, as structured-config dataclasses registered with Hydra's ConfigStore.

YAML files under conf/ only select and override; a key that is not a field here, or a value of the
wrong type, fails in Hydra before anything starts. What types cannot express, each section checks in its
own `check` method, under its fields (ranges, names); `validate` runs those, then the checks that combine
sections, then the files the config names, and every refusal names the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miniverl.data.files import check_paths
from miniverl.errors import ConfigError

NONFINITE_POLICIES = ("skip", "stop")
OVERLONG_POLICIES = ("filter", "error")  # data.overlong
STALENESS_LEVELS = (0, 1)  # trainer.staleness: policy versions a batch may lag the learner
PROBE_EVERY = 16  # trainer.probe_every's default (miniverl/step/sync.py takes it from here too)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass
class DataConfig:
    task: str = "reverse"  # a name in miniverl.data.tasks.TASKS, or several joined by + (mixed row by row)
    min_len: int = 3  # problem size bounds (characters to reverse, digits to add)
    max_len: int = 8
    prompts_per_step: int = 32  # G: prompt groups per step (each sampled rollout.n times)
    eval_prompts: int = 64  # fixed held-out prompts for the start/periodic/final evaluation (built-ins: never trained)
    max_prompt_length: int = 32  # tokens, after the chat template; a longer prompt is never cut (data.overlong)
    seed: int = 0
    # Prompt files (jsonl or verl-schema parquet). Empty: prompts come from the built-in data.task.
    # A path or a list of paths (verl's docs write data.train_files=train.parquet); typed Any because
    # OmegaConf has no str-or-list type, normalized to a list in __post_init__ and checked in validate.
    train_files: Any = field(default_factory=list)
    val_files: Any = field(default_factory=list)  # empty: hold out data.eval_prompts training rows
    prompt_key: str = "prompt"  # plain jsonl: the column with the prompt (text, or a list of chat messages)
    answer_key: str = "answer"  # plain jsonl: the column with the ground truth; '' = the prompts have no answers
    default_data_source: str = "jsonl"  # plain jsonl rows without a data_source column (picks the reward)
    chat_template: bool = True  # wrap prompts with the tokenizer's chat template; false = raw text prompts
    overlong: str = "filter"  # a prompt over max_prompt_length: filter (skip and count) | error (stop)
    shuffle: bool = True  # seeded reshuffle every epoch; false = file order
    # Prompt rows allowed to hold characters the student's tokenizer cannot encode (dropped, or turned into
    # its unknown token); they are skipped and counted. More such rows than this refuses the run, naming them.
    max_unencodable_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("train_files", "val_files"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value] if value else [])
            elif isinstance(value, list | tuple):
                setattr(self, name, list(value))

    def check(self) -> None:
        """data's own values. Whether the prompt files exist is check_files' (it reads the disk)."""
        from miniverl.data.tasks import TASKS, task_names

        _require(self.prompts_per_step > 0, f"data.prompts_per_step={self.prompts_per_step}: must be >= 1")
        _require(self.eval_prompts > 0, f"data.eval_prompts={self.eval_prompts}: must be >= 1")
        _require(
            0 < self.min_len <= self.max_len,
            f"data.min_len/max_len={self.min_len}/{self.max_len}: need 0 < min_len <= max_len",
        )
        _require(self.max_prompt_length > 0, f"data.max_prompt_length={self.max_prompt_length}: must be >= 1")
        _require(
            self.overlong in OVERLONG_POLICIES,
            f"data.overlong={self.overlong!r}: use filter (skip and count over-long prompts) or error (stop on the"
            " first)",
        )
        _require(
            not self.val_files or self.train_files,
            "data.val_files is set but data.train_files is empty; give the training file too (data.train_files=[...])",
        )
        for key, files in (("data.train_files", self.train_files), ("data.val_files", self.val_files)):
            _require(
                isinstance(files, list) and all(isinstance(f, str) and f for f in files),
                f"{key}={files!r}: give a file path or a list of them ({key}=train.jsonl or {key}=[a.jsonl,b.jsonl])",
            )
        _require(
            self.max_unencodable_rows >= 0,
            f"data.max_unencodable_rows={self.max_unencodable_rows}: use 0 (refuse any) or a row count to skip",
        )
        for task in task_names(self.task):
            TASKS.require(task)


@dataclass
class ModelSpec:
    path: str = "builtin:student"  # builtin:student | builtin:teacher | a model directory | a hub id
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    # none | nf4: bitsandbytes 4-bit NF4, double quantization, bf16 compute (CUDA only). An nf4 student
    # trains a LoRA adapter on the 4-bit base (QLoRA); the rollout side serves that same 4-bit base
    # (rollout=vllm in adapter mode, or hf_reference), never a bf16 copy (DESIGN.md: 1.66 vs 0.10 nats).
    quantization: str = "none"

    def check(self, key: str) -> None:
        """`key`: where this spec sits (model.student, model.teacher), as the messages name it."""
        from miniverl.models.loading import DTYPES, QUANTIZATIONS

        _require(
            self.dtype == "auto" or self.dtype in DTYPES,
            f"{key}.dtype={self.dtype!r}: use auto or one of {', '.join(DTYPES)}",
        )
        _require(
            self.quantization in QUANTIZATIONS,
            f"{key}.quantization={self.quantization!r}: use one of {', '.join(QUANTIZATIONS)}",
        )


@dataclass
class LoraConfig:
    rank: int = 32
    alpha: float = 64.0
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    init_seed: int = 0

    def check(self) -> None:
        _require(self.rank >= 1, f"model.lora.rank={self.rank}: a LoRA adapter needs rank >= 1 (e.g. 16)")
        _require(self.alpha > 0, f"model.lora.alpha={self.alpha}: must be > 0 (commonly 2 x rank)")
        _require(0 <= self.dropout < 1, f"model.lora.dropout={self.dropout}: must be in [0, 1)")
        _require(len(self.target_modules) > 0, "model.lora.target_modules is empty: name at least one linear layer")


@dataclass
class ModelConfig:
    student: ModelSpec = field(default_factory=lambda: ModelSpec(path="builtin:student"))
    teacher: ModelSpec = field(default_factory=lambda: ModelSpec(path="builtin:teacher"))
    lora: LoraConfig = field(default_factory=LoraConfig)
    cache_dir: str = "~/.cache/miniverl"  # where built-in models are cached
    # A built-in teacher below this greedy accuracy on its task stops the run: distilling from a teacher
    # that cannot do the task teaches nothing (data.task=addition built one with accuracy 0.000).
    builtin_min_teacher_accuracy: float = 0.8
    # Several teachers, one per data source (docs/multi_teacher.md). Empty: model.teacher scores every row,
    # as it always has. Non-empty: named teachers replace model.teacher (leave it at its default), each row is
    # scored by teacher_by_source[its data_source], else by default_teacher; every teacher must get a route.
    teachers: dict[str, ModelSpec] = field(default_factory=dict)
    teacher_by_source: dict[str, str] = field(default_factory=dict)  # data_source -> a name in model.teachers
    default_teacher: str | None = None  # the teacher of sources teacher_by_source does not name (None: none)

    def check(self) -> None:
        """The model section's own values, the named teachers and their routes included (they read no other
        section: which data sources reach a teacher is known only when prepare reads the prompts). Whether
        cache_dir is a directory is check_files' (it reads the disk)."""
        from miniverl.setup.teachers import check_teacher_routes

        self.lora.check()
        self.student.check("model.student")
        self.teacher.check("model.teacher")
        check_teacher_routes(self, ModelConfig().teacher)  # model.teacher's default, from its field above
        _require(
            0 <= self.builtin_min_teacher_accuracy <= 1,
            f"model.builtin_min_teacher_accuracy={self.builtin_min_teacher_accuracy}: must be in [0, 1]",
        )


@dataclass
class VllmRolloutConfig:
    """rollout=vllm only (miniverl/rollout/vllm.py); docs/benchmarks/rollout-rl-sizes.md measured the choices."""

    refresh: str = "adapter"  # adapter: a new LoRA request per version | merged: adapter merged into the base in place
    enforce_eager: bool = False  # True turns CUDA graphs off (engine start ~30 s instead of ~90 s)
    engine_process: str = "inprocess"  # inprocess: engine core in the actor | subprocess: vLLM's own child process
    seeding: str = "row"  # row: one seed per sampled row (the project's rule) | prompt: one seed per prompt, n samples
    max_num_seqs: int = 0  # rows decoded at once; 0 = the largest rollout batch of the run
    cudagraph_capture_size: int = 0  # largest decode batch with a CUDA graph; 0 = max_num_seqs
    # prompt tokens one engine step prefills (chunked prefill); 0 = vLLM's default (16,384). Its activations are not
    # in the engine's fixed overhead: a 1.5B student's MLP alone takes ~0.3 GiB per 16k-token chunk
    max_num_batched_tokens: int = 0
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    sleep_between_steps: bool = False  # sleep(level=1) after generating: weights to host memory, KV cache freed
    kv_cache_gib: float | None = None  # explicit KV cache size; null = derived from the actor's GPU share
    adapter_root: str = "/dev/shm"  # adapter versions are written here (shared memory), one at a time

    def check(self) -> None:
        """The engine's sizes are counts (0 = derived); the choices and the sizes' combinations are checked by
        rollout/vllm_settings.py once the engine's sizes, which other sections imply, are derived."""
        for key in ("max_num_seqs", "cudagraph_capture_size", "max_num_batched_tokens"):
            value = getattr(self, key)
            _require(value >= 0, f"rollout.vllm.{key}={value}: use 0 (derived) or a positive count")


@dataclass
class RolloutConfig:
    backend: str = "hf_reference"  # a name in miniverl.rollout.BACKENDS
    n: int = 2  # N: samples per prompt
    temperature: float = 1.0  # sampling temperature (0 = greedy); the loss temperature is separate
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 16
    seed: int = 0
    # Extra stop ids on top of the tokenizer's EOS and every EOS id in the model's generation_config.
    stop_token_ids: list[int] = field(default_factory=list)
    vllm: VllmRolloutConfig = field(default_factory=VllmRolloutConfig)

    def check(self) -> None:
        """The sampling settings, and rollout.vllm's own sizes (its choices and combinations are checked by
        rollout/vllm_settings.py once the engine's sizes, which other sections imply, are derived)."""
        from miniverl.rollout import BACKENDS
        from miniverl.step.seeds import MAX_BASE_SEED

        _require(
            0 <= self.seed < MAX_BASE_SEED,
            f"rollout.seed={self.seed}: must be in [0, {MAX_BASE_SEED}) so no two seeds of a run collide"
            " (miniverl/step/seeds.py)",
        )
        _require(
            all(i >= 0 for i in self.stop_token_ids), f"rollout.stop_token_ids={self.stop_token_ids}: ids must be >= 0"
        )
        _require(self.n >= 1, f"rollout.n={self.n}: need at least one sample per prompt")
        _require(self.max_new_tokens >= 1, f"rollout.max_new_tokens={self.max_new_tokens}: must be >= 1")
        _require(self.temperature > 0, f"rollout.temperature={self.temperature}: training samples need temperature > 0")
        _require(self.top_k >= 0, f"rollout.top_k={self.top_k}: use 0 (off) or a token count >= 1")
        _require(0 < self.top_p <= 1, f"rollout.top_p={self.top_p}: use a value in (0, 1] (1 = off)")
        BACKENDS.require(self.backend)
        self.vllm.check()


@dataclass
class ObjectiveConfig:
    """The `objective` config group: one dataclass per objective below, each holding only its own settings,
    so a key another objective owns (`+experiment=pg_k1 objective.beta=0.9`) fails before Ray instead of
    being ignored. Choose one with `objective=<name>` (or an experiment); `name` only says which it is."""

    name: str = "???"  # a name in miniverl.objectives.OBJECTIVES (set by each objective's dataclass)

    def check(self) -> None:
        """The name is a known objective, and this group holds that objective's settings."""
        from miniverl.objectives import OBJECTIVES

        OBJECTIVES.require(self.name)
        _require(
            type(self) is OBJECTIVE_CONFIGS[self.name],
            f"objective.name={self.name} but the objective group holds {type(self).__name__}'s settings; choose the"
            f" objective with objective={self.name} (or +experiment={self.name}), not objective.name",
        )


@dataclass
class GkdObjectiveConfig(ObjectiveConfig):
    """Direct GKD: generalized JSD per response token against the teacher's support (docs/objectives.md)."""

    name: str = "gkd"
    beta: float = 0.5  # 0 = forward KL(p||q), 1 = reverse KL(q||p), between: generalized JSD
    loss_temperature: float = 1.0  # divides teacher and student logits in the loss; rollout.temperature is separate
    teacher_topk: int = 64  # K teacher tokens plus one tail bucket (a lower bound); 0 = full vocabulary

    def check(self) -> None:
        super().check()
        _require(0 <= self.beta <= 1, f"objective.beta={self.beta}: must be in [0, 1]")
        _require(self.loss_temperature > 0, f"objective.loss_temperature={self.loss_temperature}: must be > 0")
        _require(
            self.teacher_topk >= 0, f"objective.teacher_topk={self.teacher_topk}: use 0 (full vocabulary) or K >= 1"
        )


@dataclass
class PgK1ObjectiveConfig(ObjectiveConfig):
    """PG-k1: policy gradient with the per-token k1 advantage log p_teacher - log q_sampler. Samples at
    temperature 1 with no top-k/top-p (validate enforces it)."""

    name: str = "pg_k1"
    discount: float = 0.0  # gamma of the discounted k1 return (0 = per-token reverse KL, 1 = sequence KL)
    # Truncated importance sampling cap on q_theta / q_sampler (verl: about 2); inf = off, and then the
    # conformance gate refuses a sampler outside PG-k1's tolerance.
    is_cap: float = 2.0
    kl_coef: float = 0.0  # reference-KL penalty folded into the per-token reward (0 = off)
    kl_kind: str = "k1"  # k1|k2|k3 (verl aliases kl|mse|low_var_kl) and abs
    reward_coef: float = 0.0  # weight of the GRPO-normalized task reward added to every token's advantage

    def check(self) -> None:
        """PG-k1's own ranges; what it asks of the rollout is check_objective's."""
        from miniverl.objectives.kl import KL_KINDS

        super().check()
        _require(0 <= self.discount <= 1, f"objective.discount={self.discount}: must be in [0, 1]")
        _require(self.is_cap >= 1, f"objective.is_cap={self.is_cap}: must be >= 1 (verl uses about 2)")
        _require(self.kl_kind in KL_KINDS, f"objective.kl_kind={self.kl_kind!r}: use one of {', '.join(KL_KINDS)}")


OBJECTIVE_CONFIGS: dict[str, type[ObjectiveConfig]] = {"gkd": GkdObjectiveConfig, "pg_k1": PgK1ObjectiveConfig}


def foreign_objective_key(objective: str, key: str) -> str | None:
    """The error for `objective.<key>` under `objective`, or None when that objective owns the key."""
    import dataclasses

    schema = OBJECTIVE_CONFIGS.get(objective)
    if schema is None:
        return None  # an unknown objective name is reported on its own
    own = [f.name for f in dataclasses.fields(schema)]
    if key in own:
        return None
    owners = [n for n, c in OBJECTIVE_CONFIGS.items() if key in {f.name for f in dataclasses.fields(c)}]
    msg = f"objective.{key} is not a setting of objective {objective} (its settings: {', '.join(own)})"
    if owners:
        return (
            f"{msg}; it belongs to objective {owners[0]}. Fix: drop objective.{key}, or train {owners[0]}"
            f" (objective={owners[0]}, or +experiment={owners[0]})"
        )
    return f"{msg}. Fix: check the spelling"


@dataclass
class RewardConfig:
    # auto: chosen per row by data_source (miniverl.rewards.SOURCE_REWARDS: gsm8k sources -> gsm8k, math
    # sources -> boxed, built-in tasks -> exact_match); or one name of miniverl.rewards.REWARDS for all rows.
    name: str = "auto"
    by_source: dict[str, str] = field(default_factory=dict)  # data_source -> reward name, before auto
    custom_function: str | None = None  # path/to/file.py:name, called as fn(data_source, response, ground_truth,
    # extra_info) on decoded text; overrides name and by_source

    def check(self) -> None:
        """The reward names exist. miniverl/rewards owns this check, and it also looks for custom_function's
        file: the one check of a section that reads the disk (parsing and finding the file are one function)."""
        from miniverl.rewards import check_reward_config

        check_reward_config(self)


@dataclass
class TrainerConfig:
    total_steps: int = 400
    lr: float = 2e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # Rows per forward/backward when max_tokens_per_micro_batch is 0; the loss is normalized per optimizer step,
    # so the split never changes a number.
    micro_batch_size: int = 16
    # Padded tokens (rows x longest row, prompt + response) per forward in the learner and the scorer: rows are
    # sorted by length and grouped under this budget, laid out without inner padding (models/packing.py).
    # 0 = micro_batch_size rows of the step's longest row.
    max_tokens_per_micro_batch: int = 0
    # Response tokens whose [tokens, V] logits exist at once in the learner (and the scorer): the LM head and
    # the loss run fused, chunk by chunk, forward and backward (models/fused_head.py), so no [rows, Tr, V]
    # tensor exists. 0 = a whole micro-batch's tokens at once (fine for tiny vocabularies). null = chosen before
    # Ray: 0 on the CPU and for vocabularies under 32k; on a GPU the largest of 1024/512/256/128 with which the
    # learner and the scorer fit their shares (setup/fit.py choose_layout; the run prints the choice and why).
    logprob_chunk_tokens: int | None = None
    # Recompute decoder activations in backward (less memory, ~30% more compute per token). null = chosen before
    # Ray: off on the CPU; on a GPU on when without it the learner's micro-batches would be short (under 16k tokens
    # and the step's), so the few large micro-batches it allows are faster than many small ones.
    gradient_checkpointing: bool | None = None
    # Each decoder layer of the learner through torch.compile (miniverl/models/compiled.py): about half the kernel
    # launches of an update whose time is launches and Python; the first update compiles (about 75 s at 0.5B). On an
    # H200: 1.68x the eager learner's tokens/s (diag13a), update 1.97 s against 3.71 in the 12 GiB recipe, where
    # gkd_4080_12g turns it on; elsewhere opt-in (not measured there). Validation refuses it with an NF4 student
    # (untested) and beside a colocated one-behind rollout (trainer.staleness=1: Inductor's first-run benchmarking
    # synchronizes the device, which would break the rollout's CUDA-graph captures running beside the first update).
    compile_layers: bool = False
    # The largest vocabulary-sized buffer the run may hold (GiB): the teacher's full-vocabulary support of a
    # step (objective.teacher_topk=0) and the learner's direct-path logits are refused above it, with the
    # arithmetic (miniverl/models/memory.py).
    vocab_memory_budget_gib: float = 4.0
    eval_every: int = 100  # steps between evaluations (0 = only before and after training)
    eval_samples: int = 4  # prompt/response/reward rows per evaluation to samples.jsonl and a wandb table
    save_checkpoint: bool = True  # false: no checkpoints at all (a stopped run cannot be resumed)
    # Checkpoints go to <run dir>/checkpoints/step_<k>/ every save_every steps and after the last step
    # (0 = only after the last step); the newest keep_checkpoints of them are kept.
    save_every: int = 100
    keep_checkpoints: int = 2
    # none: start fresh (a run directory that already holds a run is refused); auto: continue the newest
    # valid checkpoint in the run directory, or start fresh if it holds none; a path: continue that checkpoint.
    resume: str = "none"
    # A resumed run continues under its saved config plus what the command line sets now; a change of data,
    # model, objective, reward or sampling (rollout.*) is refused unless this is true (checkpoints/compat.py).
    resume_allow_changes: bool = False
    # A non-finite loss or gradient: skip (drop this optimizer step, the policy stays as it was) or stop
    # (end the run with an error). Either way the poisoned update is never applied, published or saved.
    on_nonfinite: str = "stop"
    # Policy versions a training batch may lag the learner it updates (docs/objectives.md, "One-step-stale
    # rollouts"). 0: strict sync, every batch comes from the policy just published. 1: the rollout of step k+1
    # (sampled from v_k, proven served) and its scoring run while the learner updates on step k's batch.
    staleness: int = 0
    # Strict sync proves every refresh (miniverl/step/sync.py). A rollout engine that serves from adapter buffers
    # of its own (hf_reference, hf_cached) digests them after every load, and the digest must be the learner's:
    # O(adapter) work, exact in any dtype. The probe (log-probs of a few sequences through the serving path
    # against the learner's: O(model) work on both sides) proves the base model and the arithmetic, which do not
    # change between refreshes: it runs at the first refresh, on the conformance gate's trial adapter, and on
    # every probe_every-th refresh after that; at every refresh of an engine without a served digest (vLLM).
    # 1 = probe every refresh.
    probe_every: int = PROBE_EVERY
    # data_source -> weight of its rows' tokens in the step loss (sources not named weigh 1). The loss stays a sum
    # over the step's tokens divided by their count, so {sort: 4} counts a sorting token four times; empty (the
    # default) leaves the loss as it always was. docs/multi_teacher.md says why a mixture may need it.
    loss_weight_by_source: dict[str, float] = field(default_factory=dict)

    def check(self) -> None:
        """The trainer's own values. max_tokens_per_micro_batch is measured against data and rollout lengths, and
        loss_weight_by_source's keys against data.task, in check_combinations."""
        from miniverl.step.seeds import STEP_STRIDE

        _require(
            self.total_steps > 0,
            f"trainer.total_steps={self.total_steps}: need at least 1 step (e.g. trainer.total_steps=60)",
        )
        _require(self.micro_batch_size > 0, f"trainer.micro_batch_size={self.micro_batch_size}: must be >= 1")
        _require(
            self.total_steps < STEP_STRIDE,
            f"trainer.total_steps={self.total_steps}: sampling seeds are unique for fewer than {STEP_STRIDE} steps"
            " (miniverl/step/seeds.py); split the run",
        )
        _require(
            self.eval_every >= 0,
            f"trainer.eval_every={self.eval_every}: use 0 (start and end only) or a positive step count",
        )
        _require(self.lr > 0, f"trainer.lr={self.lr}: must be > 0")
        _require(
            self.save_every >= 0,
            f"trainer.save_every={self.save_every}: use 0 (only after the last step) or a positive step count",
        )
        _require(
            self.keep_checkpoints >= 1,
            f"trainer.keep_checkpoints={self.keep_checkpoints}: keep at least 1 (resume needs one)",
        )
        _require(
            self.on_nonfinite in NONFINITE_POLICIES,
            f"trainer.on_nonfinite={self.on_nonfinite!r}: use {' or '.join(NONFINITE_POLICIES)}",
        )
        _require(bool(self.resume), "trainer.resume is empty: use none, auto or a checkpoint directory")
        _require(
            self.staleness in STALENESS_LEVELS,
            f"trainer.staleness={self.staleness}: use 0 (strict sync) or 1 (the next rollout overlaps the update, one"
            " policy version behind); a larger lag is not supported (its importance correction and resume are not"
            " built)",
        )
        _require(
            self.probe_every >= 1,
            f"trainer.probe_every={self.probe_every}: use 1 (probe every refresh) or N > 1 (every N-th; each refresh"
            " is still proven by the replica's served digest where its engine has one)",
        )
        for source, weight in self.loss_weight_by_source.items():
            _require(
                isinstance(weight, int | float) and math.isfinite(weight) and weight > 0,
                f"trainer.loss_weight_by_source.{source}={weight}: a weight must be a finite number > 0 (1 = as"
                " unweighted; to drop a source, leave its rows out of the data)",
            )
        _require(
            self.logprob_chunk_tokens is None or self.logprob_chunk_tokens >= 0,
            f"trainer.logprob_chunk_tokens={self.logprob_chunk_tokens}: use 0 (a micro-batch at once), a token count"
            " such as 256, or null (chosen from the model and the memory share)",
        )
        _require(
            self.vocab_memory_budget_gib > 0,
            f"trainer.vocab_memory_budget_gib={self.vocab_memory_budget_gib}: must be > 0 (GiB)",
        )
        _require(self.eval_samples >= 0, f"trainer.eval_samples={self.eval_samples}: must be >= 0")


# The shares where no plan chose them: a run that computes on the CPU, where the fractions only count Ray's GPU
# resources (the scale-out tests' logical GPUs), and the verl bridge's placement arithmetic. A GPU run plans its own
# (setup/fit.py choose_shares).
UNPLANNED_SHARES = {"rollout": 0.4, "scorer": 0.3, "learner": 0.3}


@dataclass
class ActorResources:
    # Fraction of one GPU (used only when resources.device resolves to cuda). null: chosen before Ray from the
    # models' shapes and the card, and printed with why (setup/fit.py choose_shares).
    num_gpus: float | None = None
    num_cpus: float = 0.5

    def check(self, key: str) -> None:
        """`key`: which actor's resources these are (resources.rollout, ...), as the message names it."""
        _require(
            (self.num_gpus is None or self.num_gpus >= 0) and self.num_cpus >= 0,
            f"{key}: num_gpus (null: chosen) and num_cpus must be >= 0",
        )


WEIGHT_SYNC = ("auto", "host")  # resources.weight_sync: how the adapter reaches the rollout replicas


@dataclass
class ResourcesConfig:
    device: str = "auto"  # auto (cuda when visible to the driver) | cpu | cuda
    # GPUs of one host to spread over, one Ray placement bundle each; the one-GPU layout (a rollout, a
    # scorer and a learner rank sharing the GPU by the fractions below) repeats on every GPU.
    # None: 1 when CUDA is visible, else 0 (no GPU resources asked).
    gpus: int | None = None
    # 0: a scorer replica shares every GPU above. M > 0: M more GPUs of the same host hold one scorer
    # replica each (the teacher gets a whole GPU), and the shared GPUs hold only rollout and learner.
    scorer_gpus: int = 0
    ray_address: str | None = None  # None starts a local Ray cluster
    dashboard: bool = True  # start the Ray dashboard when the installed Ray has it
    # Torch threads per actor; 0 = half the cores, at least one (all-core pools fight each other and any other work
    # on the machine: cluster/launch.py::actor_threads).
    torch_threads: int = 0
    emulate_gpu_gib: float | None = None  # cap each actor at num_gpus * this many GiB (16 = RTX 4080)
    # How the learner's adapter reaches the rollout replicas at a refresh: auto = left in the learner's GPU
    # memory and copied device to device (CUDA IPC) when every replica shares the learner's GPU, else through
    # the host; host = always CPU copies through Ray's object store (miniverl/step/sync.py).
    weight_sync: str = "auto"
    # true: the rollout replica, the scorer and the learner run in ONE actor process, each role on its own CUDA
    # stream and thread, so their kernels can run at once (trainer.staleness=1 overlaps the next rollout with the
    # update) and the GPU holds one CUDA context instead of three (cluster/colocate.py). One GPU, HF rollouts.
    colocate: bool = False
    # With colocate: the colocated process's Python thread switch interval in ms (sys.setswitchinterval). Its roles
    # share one interpreter, so a role whose thread wants the GIL while another role runs Python waits up to this
    # long (with trainer.staleness=1 the rollout's decode loop beside the learner's launch-bound update). None:
    # Python's 5 ms. Refused without colocate (separate actors each run one role).
    switch_interval_ms: float | None = None
    # Each actor's share of the GPU (num_gpus); null shares are chosen before Ray for this card and these models:
    # the HF rollout its modelled peak + 10%, vLLM 0.4, the learner the least share holding 16k-token micro-batches,
    # the scorer the rest (setup/fit.py choose_shares; `python -m miniverl.fit` prints them). Set them to place the
    # actors yourself; a share you set is kept and the null ones divide what it leaves.
    rollout: ActorResources = field(default_factory=ActorResources)
    scorer: ActorResources = field(default_factory=ActorResources)
    learner: ActorResources = field(default_factory=ActorResources)

    def check(self) -> None:
        """The placement's own values. The checks against prompt groups, the rollout backend and compiled layers
        are check_combinations'."""
        _require(self.device in ("auto", "cpu", "cuda"), "resources.device must be auto, cpu or cuda")
        threads = self.torch_threads
        _require(threads >= 0, f"resources.torch_threads={threads}: use 0 (half the cores) or a thread count >= 1")
        _require(
            self.weight_sync in WEIGHT_SYNC,
            f"resources.weight_sync={self.weight_sync!r}: use auto (on the GPU when the rollout shares the"
            " learner's GPU) or host (CPU copies)",
        )
        g, sg = self.gpus, self.scorer_gpus
        _require(g is None or g >= 0, f"resources.gpus={g}: use null (auto), 0 (CPU only) or a GPU count")
        _require(sg >= 0, f"resources.scorer_gpus={sg}: use 0 (scorer shares each GPU) or a GPU count")
        if self.colocate:
            _require(
                (g is None or g <= 1) and sg == 0,
                f"resources.colocate=true puts one rollout replica, scorer and learner in one process on one GPU,"
                f" but resources.gpus={g} and resources.scorer_gpus={sg} ask for more; set resources.gpus=1 (or"
                " null) and resources.scorer_gpus=0, or resources.colocate=false",
            )
        si = self.switch_interval_ms
        if si is not None:
            _require(
                si > 0, f"resources.switch_interval_ms={si}: use a positive interval in ms, or null (Python's 5 ms)"
            )
            _require(
                self.colocate,
                f"resources.switch_interval_ms={si} sets how a colocated process's roles take turns with Python, but"
                " resources.colocate=false runs each role in its own process; set resources.colocate=true or drop it",
            )
        _require(
            sg == 0 or g != 0,
            f"resources.scorer_gpus={sg} places the teacher on dedicated GPUs, but resources.gpus=0 asks for none;"
            " set resources.gpus >= 1",
        )
        _require(
            not (g == 0 and self.device == "cuda"),
            "resources.gpus=0 with resources.device=cuda asks for no GPU; set resources.gpus=1 (or null)",
        )
        for name in ("rollout", "scorer", "learner"):
            getattr(self, name).check(f"resources.{name}")


@dataclass
class TrackingConfig:
    wandb_mode: str = "offline"  # offline (no account, no network) | online | disabled
    project: str = "miniverl"
    run_name: str | None = None
    progress_bar: bool = True
    plots: bool = True  # PNG curves in the run directory at the end (needs matplotlib)

    def check(self) -> None:
        _require(
            self.wandb_mode in ("offline", "online", "disabled"),
            f"tracking.wandb_mode={self.wandb_mode!r}: use offline, online or disabled",
        )


@dataclass
class MiniVerlConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=GkdObjectiveConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


SCHEMA_NAME = "miniverl_schema"


def structured_schema(objective: str | None = None):
    """MiniVerlConfig as an OmegaConf node whose `objective` holds `objective`'s dataclass (None: left to
    the config group to fill, as Hydra's composition does)."""
    from omegaconf import MISSING, OmegaConf

    node = OmegaConf.structured(MiniVerlConfig)
    schema = OBJECTIVE_CONFIGS.get(objective) if objective is not None else None
    node.objective = MISSING if schema is None else OmegaConf.structured(schema)
    return node


def register_configs() -> None:
    """Put the schema and the `objective` group's options in Hydra's ConfigStore (called by main, not at
    import)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=structured_schema())
    for name, schema in OBJECTIVE_CONFIGS.items():
        store.store(group="objective", name=name, node=schema)


def to_config(cfg) -> MiniVerlConfig:
    """The composed Hydra config as dataclasses; unknown keys are errors even when added with `+`.

    Hydra's `+key=value` force-adds a key past the schema's struct flag, so the key set of every
    structured node is compared with its dataclass fields here.
    """
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    def check(node: DictConfig, where: str) -> None:
        schema = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(schema):
            known = {f.name for f in dataclasses.fields(schema)}
            unknown = sorted(set(node.keys()) - known)
            foreign = foreign_objective_key(node.name, unknown[0]) if unknown and where == "objective." else None
            if foreign:
                raise ConfigError(foreign)
            if unknown:
                owner = where.rstrip(".") or "the root"
                raise ConfigError(f"unknown config key {where}{unknown[0]}; {owner} has: {', '.join(sorted(known))}")
        for key in node:
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                check(child, f"{where}{key}.")

    check(cfg, "")
    return OmegaConf.to_object(cfg)


def validate(cfg: MiniVerlConfig) -> None:
    """Every check of the config that runs before any model is loaded or actor started: each section's own
    values, in the order a user would fix them (what data, which models, how they sample and learn, where they
    run), then the checks that combine sections, then the files the config names."""
    check_values(cfg)
    check_files(cfg)


def check_values(cfg: MiniVerlConfig) -> None:
    """validate without the files: each section's own values, then their combinations (`python -m miniverl.fit`
    plans a run whose prompt files are elsewhere)."""
    sections = (cfg.data, cfg.model, cfg.rollout, cfg.objective, cfg.reward, cfg.trainer, cfg.resources, cfg.tracking)
    for section in sections:
        section.check()
    check_combinations(cfg)


def check_combinations(cfg: MiniVerlConfig) -> None:
    """The checks that read more than one section (each section's own values are checked already)."""
    from miniverl.rollout import check_quantized_rollout

    t, d, r, res = cfg.trainer, cfg.data, cfg.rollout, cfg.resources
    student = cfg.model.student
    check_loss_weights(t.loss_weight_by_source, d)
    check_quantized_rollout(student.quantization, r.backend, r.vllm.refresh)
    longest = d.max_prompt_length + r.max_new_tokens
    _require(
        t.max_tokens_per_micro_batch == 0 or t.max_tokens_per_micro_batch >= longest,
        f"trainer.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch}: below the longest possible row"
        f" (data.max_prompt_length {d.max_prompt_length} + rollout.max_new_tokens {r.max_new_tokens} = {longest}"
        f" tokens); use 0 (micro_batch_size rows) or at least {longest}",
    )
    check_objective(cfg.objective, r)
    g = res.gpus
    _require(
        g is None or d.prompts_per_step >= max(1, g),
        f"data.prompts_per_step={d.prompts_per_step} < resources.gpus={g}: every learner rank needs a prompt group",
    )
    _require(
        not (res.colocate and r.backend == "vllm"),
        "resources.colocate=true with rollout=vllm: vLLM runs its engine in a process of its own, so it cannot"
        " share the learner's; use rollout=hf_cached (or hf_reference), or resources.colocate=false",
    )
    _require(
        not (t.compile_layers and student.quantization != "none"),
        f"trainer.compile_layers=true with model.student.quantization={student.quantization}: compiling"
        " bitsandbytes' 4-bit layers has not been tested; set trainer.compile_layers=false (or a bf16 student)",
    )
    _require(
        not (t.compile_layers and res.colocate and t.staleness > 0),
        f"trainer.compile_layers=true with resources.colocate=true and trainer.staleness={t.staleness}:"
        " the first compiled update synchronizes the device while the colocated rollout may be capturing CUDA"
        " graphs beside it; set trainer.staleness=0, resources.colocate=false or trainer.compile_layers=false",
    )
    if r.backend == "vllm":  # the rollout.vllm options, before Ray starts (the engine is sized later)
        from miniverl.rollout.vllm_settings import AUTO_SHARE, settings_from_config

        share = AUTO_SHARE if res.rollout.num_gpus is None else res.rollout.num_gpus
        settings_from_config(cfg, share, None)
        _require(
            r.vllm.refresh != "merged" or student.dtype == "float32",
            f"rollout.vllm.refresh=merged with model.student.dtype={student.dtype} (bf16 on a GPU): a"
            " merge W + s*B*A rounded to bf16 drops small updates (at lr 1e-5, 90% of q_proj entries were unchanged"
            " after 7 updates) while the learner applies its adapter unmerged, so the engine would serve another"
            " policy than the one published; use rollout.vllm.refresh=adapter (the default), or"
            " model.student.dtype=float32",
        )


def check_objective(o: ObjectiveConfig, r: RolloutConfig) -> None:
    """What the objective asks of the rollout (its own ranges are its check method's)."""
    if isinstance(o, PgK1ObjectiveConfig):
        # PG-k1's advantage uses the sampler's log-probs of the *untempered* policy: sampling from
        # anything else makes the gradient estimate biased (DESIGN.md).
        _require(
            r.temperature == 1.0 and r.top_k == 0 and r.top_p == 1.0,
            "objective pg_k1 samples at temperature 1 with no top-k/top-p; set rollout.temperature=1"
            " rollout.top_k=0 rollout.top_p=1",
        )
        _require(
            o.reward_coef == 0 or r.n > 1,
            f"objective.reward_coef={o.reward_coef} with rollout.n=1: every GRPO group would hold one sample and its"
            " raw score would be the advantage; set rollout.n >= 2 (or objective.reward_coef=0)",
        )


def check_loss_weights(weights: dict[str, float], d: DataConfig) -> None:
    """trainer.loss_weight_by_source against the data: with a built-in task every key must be one of its data
    sources (prompt files' sources are known only as the stream reads them, so their keys are not checked). The
    weights' own range is TrainerConfig.check's."""
    from miniverl.data.tasks import task_names

    sources = task_names(d.task)
    for source, weight in weights.items():
        _require(
            bool(d.train_files) or source in sources,
            f"trainer.loss_weight_by_source.{source}={weight}: data.task={d.task} has no data_source {source!r}; its"
            f" sources are {', '.join(sources)}",
        )


def check_files(cfg: MiniVerlConfig) -> None:
    """The checks that read the disk: the prompt files exist and are of one format, and model.cache_dir is not a
    file. (A custom reward's file is looked for by RewardConfig.check, in miniverl/rewards.)"""
    d = cfg.data
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        if files:
            check_paths(files, key)  # a missing path, a directory (naming the files in it), mixed formats
    cache = Path(cfg.model.cache_dir).expanduser()
    _require(
        not cache.exists() or cache.is_dir(),
        f"model.cache_dir={cfg.model.cache_dir!r} is a file, not a directory; point it at a directory (it is"
        " created when missing), e.g. model.cache_dir=~/.cache/miniverl",
    )
