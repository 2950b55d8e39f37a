"""The model section: the student, its LoRA adapter and the teacher or teachers, and the checks of their values."""

from __future__ import annotations

from dataclasses import dataclass, field

from miniverl.config.base import require
from miniverl.errors import ConfigError

SINGLE_TEACHER_ROLE = "teacher"  # setup.paths key of model.teacher; named teachers are "teachers.<name>"
# model.teacher.path=self: the teacher is the student's own frozen base (its LoRA adapter disabled), scored by the
# learner where the student's weights already are; no teacher model is loaded and no scorer actor starts. With
# data.teacher_demonstrations it is privileged-context self-distillation (docs/objectives.md).
TEACHER_SELF = "self"


@dataclass
class ModelSpec:
    # builtin:student | builtin:teacher | a model directory | a hub id | a .gguf file | a shipped model's short name
    # (smollm2-135m-instruct; miniverl/models/gguf.py SHORT_NAMES): a GGUF is converted once into cache_dir;
    # model.teacher only: self (TEACHER_SELF), the student's own base with its adapter disabled
    path: str = "builtin:student"
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
    cache_dir: str = "~/.cache/miniverl"  # where built-in models and GGUF conversions are cached
    # A built-in teacher below this greedy accuracy on its task stops the run: distilling from a teacher
    # that cannot do the task teaches nothing (data.task=addition built one with accuracy 0.000).
    builtin_min_teacher_accuracy: float = 0.8
    # Several teachers, one per data source (docs/multi_teacher.md). Empty: model.teacher scores every row,
    # as it always has. Non-empty: named teachers replace model.teacher (leave it at its default), each row is
    # scored by teacher_by_source[its data_source], else by default_teacher; every teacher must get a route.
    teachers: dict[str, ModelSpec] = field(default_factory=dict)
    teacher_by_source: dict[str, str] = field(default_factory=dict)  # data_source -> a name in model.teachers
    default_teacher: str | None = None  # the teacher of sources teacher_by_source does not name (None: none)

    def teacher_roles(self) -> dict[str, ModelSpec]:
        """The run's teachers by setup role: {"teacher": model.teacher} or {"teachers.<name>": spec, ...}.

        A role reads as the config key under `model.` (errors say `model.teachers.sort.path=...`)."""
        if not self.teachers:
            return {SINGLE_TEACHER_ROLE: self.teacher}
        return {f"teachers.{name}": spec for name, spec in self.teachers.items()}

    @property
    def teacher_is_self(self) -> bool:
        """model.teacher.path=self (TEACHER_SELF): the student's base scores, in the learner; no scorer actor."""
        return not self.teachers and self.teacher.path == TEACHER_SELF

    def paths(self) -> dict[str, str]:
        """{role: model path} for the student and every teacher ("teacher" or "teachers.<name>")."""
        return {"student": self.student.path, **{role: spec.path for role, spec in self.teacher_roles().items()}}

    def check(self) -> None:
        """The model section's own values, the named teachers and their routes included (they read no other
        section: which data sources reach a teacher is known only when prepare reads the prompts). Whether
        cache_dir is a directory is check_files' (it reads the disk)."""
        self.lora.check()
        self.student.check("model.student")
        self.teacher.check("model.teacher")
        self.check_self_teacher()
        self.check_teachers()
        require(
            0 <= self.builtin_min_teacher_accuracy <= 1,
            f"model.builtin_min_teacher_accuracy={self.builtin_min_teacher_accuracy}: must be in [0, 1]",
        )

    def check_self_teacher(self) -> None:
        """model.teacher.path=self takes the student's weights as they are: nothing of its own to set, and the student
        must be a model (a base to disable the adapter on), not `self` too."""
        require(
            self.student.path != TEACHER_SELF,
            "model.student.path=self: only the teacher can be the student's own base; give the student a model"
            " (a directory, hub id, .gguf, smollm2-135m-instruct or builtin:student)",
        )
        for name, spec in self.teachers.items():
            require(
                spec.path != TEACHER_SELF,
                f"model.teachers.{name}.path=self: the student's own base is a teacher only as the single"
                " model.teacher (model.teacher.path=self, without model.teachers); beside named teachers it is not"
                f" supported yet, so give model.teachers.{name} a model path",
            )
        if self.teacher.path != TEACHER_SELF:
            return
        default = ModelSpec()
        require(
            (self.teacher.dtype, self.teacher.quantization) == (default.dtype, default.quantization),
            f"model.teacher.path=self with model.teacher.dtype={self.teacher.dtype} and"
            f" quantization={self.teacher.quantization}: the teacher is the student's base as the learner holds it"
            " (model.student.dtype, model.student.quantization); drop model.teacher.dtype and"
            " model.teacher.quantization",
        )

    def check_teachers(self) -> None:
        """The named teachers and their routes, before any model is resolved: names, routes, dtypes. Which data
        sources reach a teacher is checked once prepare has read the prompts (miniverl/routing.py)."""
        teachers, routes, default = self.teachers, self.teacher_by_source, self.default_teacher
        if not teachers:
            if routes or default is not None:
                raise ConfigError(
                    "model.teacher_by_source / model.default_teacher route rows to named teachers, but"
                    " model.teachers is empty; define them as model.teachers.<name> (path, dtype, quantization),"
                    " or drop the routes to use the single model.teacher"
                )
            return
        if self.teacher != ModelConfig().teacher:  # model.teacher left at its default (the field above)
            raise ConfigError(
                f"model.teacher is set ({self.teacher.path}) and so is model.teachers ({', '.join(teachers)}): with"
                " named teachers model.teacher is not used; move it into model.teachers.<name> and route to it"
            )
        known = ", ".join(sorted(teachers))
        for name, spec in teachers.items():
            if not spec.path:
                raise ConfigError(f"model.teachers.{name}.path is empty: give a model directory, hub id or builtin ref")
            spec.check(f"model.teachers.{name}")  # dtype and quantization, as for model.student and model.teacher
        for source, name in routes.items():
            if name not in teachers:
                raise ConfigError(
                    f"model.teacher_by_source.{source}={name!r} is not a teacher; model.teachers has: {known}."
                    f" Route it to one of those, or add model.teachers.{name}.path=..."
                )
        if default is not None and default not in teachers:
            raise ConfigError(f"model.default_teacher={default!r} is not a teacher; model.teachers has: {known}")
        unused = sorted(set(teachers) - set(routes.values()) - {default})
        if unused:
            raise ConfigError(
                f"model.teachers.{unused[0]} gets no rows: no model.teacher_by_source entry routes to it and it is not"
                f" model.default_teacher; route a source to it ('+model.teacher_by_source.<data_source>={unused[0]}'),"
                " make it the default, or remove it (every teacher holds its weights in the scorer)"
            )
