"""The record the driver's setup hands on (setup/prepare.py load_setup fills it): what Ray, the actors, the loop and
the summary read of the models, prompts and rewards checked before any actor starts. A leaf of the setup folder, so
that what reads it does not import the code that fills it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miniverl.batches import PromptBatch
from miniverl.data.build import PromptStream
from miniverl.models.lora import LoraSettings
from miniverl.objectives import Objective
from miniverl.rewards import SourceReward
from miniverl.rollout.sampling import SamplingParams
from miniverl.routing import TeacherRouting
from miniverl.setup.placement import Placement


@dataclass
class Setup:
    """Everything checked and loaded in the driver before any actor starts."""

    device: str
    paths: dict[str, str]
    tokenizer: Any
    prompts: PromptStream  # prompts.batch(step, g): the step's prompts, a pure function of (seed, step)
    eval_batch: PromptBatch
    stop_token_ids: tuple[int, ...]
    vocab_size: int  # logits compared by distillation (the student's; the scorer drops a teacher's extra)
    reward_fn: SourceReward
    objective: Objective  # objectives/interface.py; built once here, used by every part after
    sampling: SamplingParams  # the training steps' sampling settings (each step sets its own seed)
    routing: TeacherRouting | None = None  # several teachers (model.teachers); None: model.teacher scores all
    # what was chosen where the config left it null or auto, by dotted key (rollout.backend; setup/layout.py: the GPU
    # shares and the learner's layout on a GPU; the layout's CPU values), as the run applied it: in summary.json and
    # the tracker's config
    chosen: dict[str, Any] = field(default_factory=dict)
    # What the launcher hands the actors, resolved here before Ray (a share that does not add up is refused before
    # any actor starts): where each replica goes, the adapter both the learner and the rollout build, the rollout
    # engine's settings (rollout/vllm_settings.VllmSettings or rollout/sglang.SglangSettings; None for the HF
    # backends), and each teacher role's (dtype, quantization).
    placement: Placement | None = None
    lora: LoraSettings | None = None
    engine: Any = None
    teacher_precisions: dict[str, tuple[str, str]] = field(default_factory=dict)
    # the memory plan the run printed (setup/fit.py FitPlan.record: GiB per actor and the whole card) on a GPU, None on
    # the CPU: in summary.json, so the measured peaks can be checked against it (bench/e2e_report.py)
    plan: dict | None = None
