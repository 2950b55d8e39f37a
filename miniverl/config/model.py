"""The model section: the student, its LoRA adapter and the teacher or teachers, and the checks of their values."""

from __future__ import annotations

from dataclasses import dataclass, field

from miniverl.config.base import require


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

        require(
            self.dtype == "auto" or self.dtype in DTYPES,
            f"{key}.dtype={self.dtype!r}: use auto or one of {', '.join(DTYPES)}",
        )
        require(
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
        require(self.rank >= 1, f"model.lora.rank={self.rank}: a LoRA adapter needs rank >= 1 (e.g. 16)")
        require(self.alpha > 0, f"model.lora.alpha={self.alpha}: must be > 0 (commonly 2 x rank)")
        require(0 <= self.dropout < 1, f"model.lora.dropout={self.dropout}: must be in [0, 1)")
        require(len(self.target_modules) > 0, "model.lora.target_modules is empty: name at least one linear layer")


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
        require(
            0 <= self.builtin_min_teacher_accuracy <= 1,
            f"model.builtin_min_teacher_accuracy={self.builtin_min_teacher_accuracy}: must be in [0, 1]",
        )
