"""Issue 34's peers harness: miniVERL against TRL and Unsloth at their fastest, in one sitting on one GPU.

    python -m lab.bench.peers --student /tmp/m/student --teacher /tmp/m/teacher --out peers-out \
        [--shapes 16x1x512,64x4x512] [--cells all | trl-distill-vllm,miniverl-gkd-16g,...] [--steps 5] \
        [--cell-timeout 540] [--unsloth-site /tmp/site-unsloth] [--gpu 0] [--cpu] [--prompt-len 3:8] [--stop-median 0]

Every cell of every shape runs in its own process, one after the other (the same GPU, models, built-in reverse
prompts, sampling at temperature 1 on-policy, and the same rows x tokens per optimizer step), with nvidia-smi
sampling the whole device every 200 ms. A shape is PROMPTS x SAMPLES x TOKENS (the new tokens of every row). Each
cell writes `<out>/<shape>/<cell>.json` (seconds per step and of them the seconds generating, trained tokens/s,
whole-device peak, the loss it optimises, its settings and versions, or `status: failed` with why) and its log;
`<out>/peers.md` and `<out>/peers.json` hold every cell, failures included. A peer that is not installed, cannot run
here, times out or runs out of memory is a failed cell with the reason, never a crash of the harness. TRL and Unsloth
update in micro-batches of the most rows up to FIRST_MICRO_ROWS that their scripts accept and, when torch runs out of
memory, try again at half in a fresh process (micro_batches): each peer runs the largest micro-batch that fits, as its
users would set it.

Realistic shapes, the same in every cell (the defaults pass nothing: the cells of before):
- `--prompt-len LO:HI` (default 3:8, the task's own): the reverse task's strings of LO..HI characters. miniVERL gets
  `data.min_len=LO data.max_len=HI data.max_prompt_length=` the longest such prompt in the student's tokens (HI
  letters, the task's `>` and the character tokenizer's BOS: HI + 2; built-in prompts are never cut, a longer one
  stops the run); the peers' scripts `--prompt-len`, drawing the same stream (peer_prompts.step_examples, the
  held-out prompts drawn at the same bounds). A shape whose longest row passes either model's max_position_embeddings
  is refused.
- `--stop-median M` (default 0: none): rows end on stop_set(M, the student's vocabulary, STOP_SEED) besides the
  models' EOS, ~ln 2 x V / M ids, so on a random model's nearly uniform next-token law the median length is ~M.
  miniVERL gets `rollout.stop_token_ids=[...]` (unioned with the student's EOS); TRL and Unsloth `--stop-ids`: the
  model's `generation_config.eos_token_id` list (what transformers' generate stops on and TRL masks after) and vLLM's
  SamplingParams `stop_token_ids` (their scripts' docstrings cite the source lines).
- `--peer-attention flash` (default `default`): the peers' scripts `--flash-attention`, keeping their training
  forwards' SDPA off cuDNN as miniVERL's actors are (ProcessSettings.cudnn_attention=False: cuDNN plans every new shape,
  peers.md run 10); by default they run torch's own choice. Each peer's JSON records which (`settings.attention`).
Each cell's JSON records the bounds, the median and the number of stop ids. Trained tokens stay the rows' real
tokens when lengths vary: a peer's are rows x the median over the timed steps of the mean completion length its
trainer logs (its mask's tokens over its rows, the stop token included); miniVERL's the median of `response_tokens`.

The cells (facts read in the pinned wheels' source, TRL 1.16.0 / 1.15.0 and Unsloth 2026.10.9):
- trl-distill-vllm: `trl.DistillationTrainer` (stable in 1.16; `trl.experimental.distillation` is a deprecated
  alias; GKDTrainer warns that lmbda=1 at temperature 1 is "fully covered" by it). Always on-policy; the loss is the
  generalized JSD over the full vocabulary through TRL's chunked divergence kernel (`kernels/chunked_divergence.py`:
  the [rows, T, V] logits never exist). `use_vllm=True, vllm_mode="colocate"` (the default mode),
  gradient_checkpointing (on by default), bf16; the whole step is one generation batch (`per_device_train_batch_size`
  x `gradient_accumulation_steps`). `use_liger_kernel` only patches the model's layers through transformers (no
  trainer of TRL 1.16 uses a Liger distillation loss): set when liger_kernel imports (lab/device/liger.txt).
- trl-distill-hf: the same with transformers' `generate` (what TRL does without vLLM).
- trl-topk: not offered synchronously. TRL 1.16's teacher top-k (`teacher_top_k`, default 8, + a tail bucket) is in
  `experimental.async_distillation` / `experimental.server_distillation`, which score with vLLM *servers* over HTTP,
  and at beta != 0 narrow the support to two tokens (the teacher's top-1 and the sampled one). Recorded as failed.
- unsloth-grpo: Unsloth's `FastLanguageModel` (its LoRA kernels, `use_gradient_checkpointing="unsloth"`,
  `fast_inference=True`: vLLM generation) with TRL 1.15's GRPOTrainer as Unsloth patches it, the exact-match reward
  of the reverse task. GRPO needs groups of 2+: a shape of N=1 runs as P/2 x 2 (the same rows and tokens).
- miniverl-*: `python -m miniverl.main +experiment=gkd_4080` (on --cpu: `+experiment=gkd`) at the shape, GKD top-64
  or PG-k1 with the same exact-match reward (GRPO-normalized, reward_coef 1), under `resources.emulate_gpu_gib=16`
  (-16g) and without caps (-free); miniverl-gkd-full-16g: GKD over the full vocabulary (TRL's loss), where the step's
  support fits FULL_SUPPORT_MAX_GIB of host memory (16 x 1 x 512 does; 64 x 4 x 512, 74 GiB, does not).

Importing this module imports no trl, unsloth, vllm or torch; bad arguments are refused before anything runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lab.bench.e2e_report import training_steps
from lab.bench.peer_prompts import DEFAULT_PROMPT_LEN, EVAL_PROMPTS, TASK, longest_prompt_tokens
from lab.bench.random_stops import stop_set

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SHAPES = "16x1x512,64x4x512"  # the shapes: the old comparison's and the recipe's
WARMUP_STEPS = 1  # the first step compiles kernels, captures graphs and grows the allocator: not timed
SMI_PERIOD_MS = 200
# --stop-median's ids are stop_set(M, the student's vocabulary, STOP_SEED): seed 7 is the decode profile's and the
# rollout runs' (stop_set(150, 151936, 7), 702 ids), so a realistic peers cell stops on the ids those runs measured
STOP_SEED = 7
LOG_TAIL_LINES = 40  # of a failed cell's log, kept in its JSON
OOM_PATTERNS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")
# what a smaller micro-batch can cure: torch's allocation failures (an engine that cannot start in its memory says
# "out of memory" in other words, and halving the update would not help it)
RETRY_PATTERNS = ("torch.OutOfMemoryError", "CUDA out of memory")
# A peer that splits its update (--micro-batch) starts at this many rows a forward (all of the recipe's 64 x 4) and
# halves on an out-of-memory, at most MAX_HALVINGS times, each try in a fresh process: the largest micro-batch that
# fits is what "its fastest" means for a TRL or Unsloth user. (Run 3 started at 64 rows, which fitted both peers.)
FIRST_MICRO_ROWS = 256
MAX_HALVINGS = 3
# The host memory the full-vocabulary miniVERL cell may ask for: one step's teacher support over the whole vocabulary
# is 4.6 GiB at 16 x 1 x 512 and 74 GiB at 64 x 4 x 512 (a 151,936-token vocabulary); above this the cell is not run.
FULL_SUPPORT_MAX_GIB = 16


@dataclass(frozen=True)
class Shape:
    """Rows of one optimizer step: `prompts` x `samples`, each generating `tokens` new tokens."""

    prompts: int
    samples: int
    tokens: int

    @property
    def name(self) -> str:
        return f"{self.prompts}x{self.samples}x{self.tokens}"

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    def grouped(self) -> Shape:
        """The same rows in groups of at least two samples (GRPO's group baseline needs two)."""
        if self.samples >= 2:
            return self
        if self.prompts % 2:
            raise ValueError(f"shape {self.name}: GRPO needs 2 samples per prompt, and {self.prompts} prompts is odd")
        return Shape(self.prompts // 2, 2, self.tokens)


def parse_prompt_len(text: str) -> tuple[int, int]:
    """`LO:HI`: the reverse task's string lengths in characters (each prompt is LO..HI letters and a `>`)."""
    m = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if not m:
        raise ValueError(f"{text!r}: write LO:HI, the reverse task's string lengths in characters, e.g. 100:320")
    lo, hi = int(m[1]), int(m[2])
    if lo < 1:
        raise ValueError(f"{text!r}: LO must be >= 1 (a prompt of {lo} characters has nothing to reverse), e.g. 1:{hi}")
    if lo > hi:
        raise ValueError(f"{text!r}: LO {lo} > HI {hi}; write the shorter bound first: {hi}:{lo}")
    return lo, hi


def parse_shape(text: str) -> Shape:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text.strip())
    if not m or min(int(g) for g in m.groups()) < 1:
        raise ValueError(f"shape {text!r}: write PROMPTS x SAMPLES x TOKENS as three positive integers, e.g. 16x1x512")
    return Shape(*(int(g) for g in m.groups()))


@dataclass(frozen=True)
class Plan:
    """What the harness was asked to run, checked."""

    student: Path
    teacher: Path
    out: Path
    shapes: tuple[Shape, ...]
    cells: tuple[str, ...]
    steps: int
    cell_timeout: int
    unsloth_site: Path | None
    gpu: int
    cpu: bool
    prompt_len: tuple[int, int] = DEFAULT_PROMPT_LEN  # the reverse task's string lengths, characters
    prompt_tokens: int = 0  # the longest such prompt in the student's tokens (0: the default bounds, not computed)
    stop_median: int = 0  # --stop-median (0: no stop ids beyond the models' EOS)
    stop_ids: tuple[int, ...] = ()  # stop_set(stop_median, the student's vocabulary, STOP_SEED), every cell's
    miniverl_overrides: tuple[str, ...] = ()  # --miniverl-overrides: Hydra overrides added to every miniVERL cell
    peer_attention: str = "default"  # --peer-attention: "flash" keeps the peers' SDPA off cuDNN, as miniVERL's actors

    @property
    def default_prompts(self) -> bool:
        """The default bounds: every cell gets today's command line (miniVERL its experiment's data section)."""
        return self.prompt_len == DEFAULT_PROMPT_LEN


@dataclass(frozen=True)
class Cell:
    """One peer setting. `command` returns the child's argv (it writes its JSON to the path it is given), or
    raises NotRunnable with why it cannot run here."""

    name: str
    peer: str
    loss: str
    modules: tuple[str, ...]  # importable modules it needs in its environment
    command: Callable[[Plan, Shape, Path], list[str]]
    reads: str = "json"  # "json": the child's JSON; "miniverl": the run's metrics.jsonl
    gpu_only: str = ""  # why it cannot run with --cpu ("" = it can)
    site: bool = False  # runs with --unsloth-site first on its PYTHONPATH
    group: Callable[[Shape], int] | None = None  # takes --micro-batch in whole groups of this many rows (None: not)


class NotRunnable(Exception):
    """A cell that cannot run here; the message is the reason recorded in its failed cell."""


@dataclass
class CellResult:
    cell: str
    peer: str
    shape: str
    loss: str
    status: str = "ok"  # ok | failed
    reason: str = ""
    prompts: int = 0
    samples: int = 0
    tokens: int = 0
    prompt_len: list[int] = field(default_factory=list)  # [LO, HI]: the reverse task's string lengths, characters
    stop_median: int = 0  # --stop-median (0: none)
    stop_ids: int = 0  # how many ids beyond the models' EOS end a row (the same set in every cell)
    step_seconds: list[float] = field(default_factory=list)
    median_step_s: float | None = None
    # per step, the seconds spent generating inside it (TRL's weight sync + generate; miniVERL's time/generate, the
    # refresh apart); the median over the timed steps; None where the cell did not say
    generate_seconds: list[float] = field(default_factory=list)
    median_generate_s: float | None = None
    trained_tokens_per_step: float | None = None
    trained_tokens_per_s: float | None = None
    smi_peak_mib: float | None = None
    settings: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    log_tail: list[str] = field(default_factory=list)


def _trl_command(vllm: bool) -> Callable[[Plan, Shape, Path], list[str]]:
    def command(plan: Plan, shape: Shape, out_json: Path) -> list[str]:
        args = [
            sys.executable,
            str(ROOT / "lab" / "peers" / "trl_distill.py"),
            *_models(plan),
            "--out",
            str(out_json),
        ]
        args += [*_shape_args(shape), "--steps", str(plan.steps), "--beta", "0.5", *_peer_args(plan)]
        return args + (["--vllm"] if vllm else []) + (["--cpu"] if plan.cpu else [])

    return command


def _trl_topk(plan: Plan, shape: Shape, out_json: Path) -> list[str]:
    raise NotRunnable(
        "not offered synchronously: TRL 1.16's teacher top-k (teacher_top_k + a tail bucket) exists only in "
        "experimental.async_distillation / server_distillation, which need vLLM servers over HTTP for the student "
        "and the teacher, and narrow the support to 2 tokens at beta != 0; the harness does not start servers yet"
    )


def _unsloth(plan: Plan, shape: Shape, out_json: Path) -> list[str]:
    grouped = shape.grouped()
    args = [sys.executable, str(ROOT / "lab" / "peers" / "unsloth_grpo.py"), "--student", str(plan.student)]
    return [*args, "--out", str(out_json), *_shape_args(grouped), "--steps", str(plan.steps), *_peer_args(plan)]


def full_support_gib(plan: Plan, shape: Shape) -> tuple[float, int]:
    """The host memory (GiB) of one step's full-vocabulary teacher support (rows x tokens x vocabulary x 4 B, what
    miniVERL's objective.teacher_topk=0 gathers), and the teacher's vocabulary."""
    vocab = int(json.loads((plan.teacher / "config.json").read_text())["vocab_size"])
    return shape.rows * shape.tokens * vocab * 4 / 2**30, vocab


def _miniverl(objective: str, capped: bool, full: bool = False) -> Callable[[Plan, Shape, Path], list[str]]:
    def command(plan: Plan, shape: Shape, out_json: Path) -> list[str]:
        budget = []
        if full:  # TRL's loss: the whole vocabulary, which miniVERL ships as the step's support
            gib, vocab = full_support_gib(plan, shape)
            if gib > FULL_SUPPORT_MAX_GIB:
                raise NotRunnable(
                    f"the step's full-vocabulary teacher support is {gib:,.0f} GiB of host memory (rows x tokens x"
                    f" {vocab:,} x 4 B), over the harness's {FULL_SUPPORT_MAX_GIB} GiB: miniVERL ships the teacher's"
                    " top-K (objective.teacher_topk) and refuses a support above trainer.vocab_memory_budget_gib"
                )
            from miniverl.config.trainer import TrainerConfig  # the default budget: never lowered here

            default = TrainerConfig().vocab_memory_budget_gib
            budget = ["objective.teacher_topk=0", f"trainer.vocab_memory_budget_gib={max(int(gib) + 2, default):g}"]
        if objective == "pg_k1":
            shape = shape.grouped()  # the same groups as Unsloth's GRPO, for the same task reward
        experiment = "gkd" if plan.cpu else "gkd_4080"
        args = [sys.executable, "-m", "miniverl.main", f"+experiment={experiment}"]
        args += [f"model.student.path={plan.student}", f"model.teacher.path={plan.teacher}", "data.train_files=[]"]
        args += [f"data.prompts_per_step={shape.prompts}", f"rollout.n={shape.samples}"]
        args += [f"rollout.max_new_tokens={shape.tokens}", f"objective={objective}"]
        args += [f"data.eval_prompts={EVAL_PROMPTS}", "trainer.eval_every=0", f"trainer.total_steps={plan.steps}"]
        args += ["trainer.save_checkpoint=false", "resources.dashboard=false", "tracking=disabled"]
        args += ["tracking.progress_bar=false", "tracking.plots=false", f"hydra.run.dir={out_json.with_suffix('')}"]
        if objective == "pg_k1":
            args += ["objective.reward_coef=1.0", "rollout.temperature=1.0", "rollout.top_k=0", "rollout.top_p=1.0"]
        if not plan.default_prompts:  # built-in prompts are tokenized raw: no chat template to add
            lo, hi = plan.prompt_len
            args += [f"data.min_len={lo}", f"data.max_len={hi}", f"data.max_prompt_length={plan.prompt_tokens}"]
        if plan.stop_ids:  # unioned with the student's EOS ids (miniverl/models/stops.py)
            args += [f"rollout.stop_token_ids=[{','.join(map(str, plan.stop_ids))}]"]
        args += budget + (["resources.emulate_gpu_gib=16"] if capped else [])

        def key(override: str) -> str:  # `+a.b=1`, `~a.b`, `a.b=1` -> a.b
            return override.split("=", 1)[0].lstrip("+~")

        ours = {key(a) for a in args[3:]}
        clash = [o for o in plan.miniverl_overrides if key(o) in ours]
        if clash:
            raise NotRunnable(
                f"--miniverl-overrides {' '.join(clash)}: the harness sets that key for this cell (its shape, steps,"
                " prompts or caps); change the harness option that sets it instead"
            )
        return args + list(plan.miniverl_overrides)

    return command


def _models(plan: Plan) -> list[str]:
    return ["--student", str(plan.student), "--teacher", str(plan.teacher)]


def _shape_args(shape: Shape) -> list[str]:
    return ["--prompts", str(shape.prompts), "--samples", str(shape.samples), "--max-new-tokens", str(shape.tokens)]


def _peer_args(plan: Plan) -> list[str]:
    """A peer script's prompt bounds, stop ids and attention setting; none at the defaults (the command line of
    before)."""
    args = [] if plan.default_prompts else ["--prompt-len", "{}:{}".format(*plan.prompt_len)]
    args += ["--stop-ids", ",".join(map(str, plan.stop_ids))] if plan.stop_ids else []
    return args + (["--flash-attention"] if plan.peer_attention == "flash" else [])


GKD_FULL = "generalized JSD beta 0.5 over the full vocabulary (TRL's chunked kernel), on-policy"
GKD_TOPK = "generalized JSD beta 0.5 over the teacher's top-64 + tail, on-policy"
GKD_FULL_MINIVERL = "generalized JSD beta 0.5 over the full vocabulary (objective.teacher_topk=0), on-policy"
PG_K1 = "PG-k1: -sum rho_t (log p - log q_old)_t + GRPO-normalized exact-match reward (coef 1), per token"
GRPO = "GRPO (TRL 1.15 as Unsloth patches it): clipped ratio x group-normalized exact-match reward"
VLLM_GPU = "vLLM generation needs CUDA"
UNSLOTH = ("unsloth", "trl", "vllm")


def _one_row(shape: Shape) -> int:  # TRL splits its step's rows anywhere
    return 1


def _grpo_group(shape: Shape) -> int:  # GRPO's micro-batches hold whole groups
    return shape.grouped().samples


def micro_batches(rows: int, group: int) -> list[int]:
    """The rows per forward a splitting peer tries, in order: the most rows, up to FIRST_MICRO_ROWS, that are whole
    groups of `group` rows dividing `rows` (what its script accepts), then each half that still is, on each
    out-of-memory, MAX_HALVINGS times at most."""
    first = next(m for m in range(min(rows, FIRST_MICRO_ROWS), 0, -1) if rows % m == 0 and m % group == 0)
    sizes = [first]
    while len(sizes) <= MAX_HALVINGS:
        half = sizes[-1] // 2
        if half < group or half % group or rows % half:
            break
        sizes.append(half)
    return sizes


CELLS = {
    c.name: c
    for c in (
        Cell(
            "trl-distill-vllm", "TRL", GKD_FULL, ("trl", "vllm"), _trl_command(True), gpu_only=VLLM_GPU, group=_one_row
        ),
        Cell("trl-distill-hf", "TRL", GKD_FULL, ("trl",), _trl_command(vllm=False), group=_one_row),
        Cell("trl-topk", "TRL", "generalized JSD over the teacher's top-k", ("trl",), _trl_topk),
        Cell("unsloth-grpo", "Unsloth", GRPO, UNSLOTH, _unsloth, gpu_only=VLLM_GPU, site=True, group=_grpo_group),
        Cell("miniverl-gkd-16g", "miniVERL", GKD_TOPK, (), _miniverl("gkd", True), "miniverl", "16 GB caps need CUDA"),
        Cell("miniverl-gkd-free", "miniVERL", GKD_TOPK, (), _miniverl("gkd", False), "miniverl"),
        Cell("miniverl-pg_k1-16g", "miniVERL", PG_K1, (), _miniverl("pg_k1", True), "miniverl", "16 GB caps need CUDA"),
        Cell("miniverl-pg_k1-free", "miniVERL", PG_K1, (), _miniverl("pg_k1", False), "miniverl"),
        Cell(  # TRL's own loss, for a comparison at the same objective where the step's support fits the host
            "miniverl-gkd-full-16g",
            "miniVERL",
            GKD_FULL_MINIVERL,
            (),
            _miniverl("gkd", True, full=True),
            "miniverl",
            "16 GB caps need CUDA",
        ),
    )
}


def parse_args(argv: list[str] | None = None) -> Plan:
    ap = argparse.ArgumentParser(prog="python -m lab.bench.peers", description=__doc__.splitlines()[0])
    ap.add_argument("--student", required=True, type=Path, help="student model directory (the 0.5B shape on the GPU)")
    ap.add_argument("--teacher", required=True, type=Path, help="teacher model directory (same tokenizer)")
    ap.add_argument("--out", required=True, type=Path, help="folder for the cells' JSON, logs and peers.md")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"PxNxT,... (default {DEFAULT_SHAPES})")
    ap.add_argument("--cells", default="all", help=f"all, or some of: {','.join(CELLS)}")
    ap.add_argument("--steps", type=int, default=5, help=f"optimizer steps per cell; the first {WARMUP_STEPS} untimed")
    ap.add_argument(
        "--cell-timeout",
        type=int,
        default=540,
        help="seconds before one try of a cell is stopped (a failed cell); TRL and Unsloth may try 4 micro-batches",
    )
    ap.add_argument("--unsloth-site", type=Path, help="folder put first on the Unsloth cell's PYTHONPATH (its bundle)")
    ap.add_argument("--gpu", type=int, default=0, help="the GPU index nvidia-smi samples")
    ap.add_argument("--cpu", action="store_true", help="allow a run without CUDA (a smoke test with tiny models)")
    ap.add_argument(
        "--prompt-len",
        default="{}:{}".format(*DEFAULT_PROMPT_LEN),
        help="LO:HI, the reverse task's string lengths in characters (default %(default)s: the task's own)",
    )
    ap.add_argument(
        "--peer-attention",
        choices=("default", "flash"),
        default="default",
        help="the peers' training attention: torch's default (cuDNN first on Hopper, a plan for every new shape) or"
        " flash only, the setting miniVERL's actors run with (ProcessSettings.cudnn_attention=False)",
    )
    ap.add_argument(
        "--miniverl-overrides",
        default="",
        help="Hydra overrides added to every miniVERL cell, space-separated (e.g. 'trainer.compile_layers=false')",
    )
    ap.add_argument(
        "--stop-median",
        type=int,
        default=0,
        help="rows stop on ~ln2 x vocabulary / M ids too: on a random model, a median length of ~M (0: no stops)",
    )
    a = ap.parse_args(argv)
    try:
        shapes = tuple(parse_shape(s) for s in a.shapes.split(","))
    except ValueError as e:
        ap.error(f"--shapes: {e}")
    cells = tuple(CELLS) if a.cells == "all" else tuple(c.strip() for c in a.cells.split(","))
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        ap.error(f"--cells: unknown {', '.join(unknown)}; choose from all, {', '.join(CELLS)}")
    if a.steps <= WARMUP_STEPS:
        ap.error(f"--steps={a.steps}: need more than the {WARMUP_STEPS} warm-up step(s) to time one")
    if a.cell_timeout < 1:
        ap.error(f"--cell-timeout={a.cell_timeout}: must be >= 1 second")
    try:
        prompt_len = parse_prompt_len(a.prompt_len)
    except ValueError as e:
        ap.error(f"--prompt-len {e}")
    if a.stop_median < 0:
        ap.error(f"--stop-median={a.stop_median}: give the median response length in tokens, or 0 for no stop ids")
    self_teacher = str(a.teacher) == "self"  # model.teacher.path=self: miniVERL's cells only (the peers need a model)
    for name in ("student",) if self_teacher else ("student", "teacher"):
        if not (getattr(a, name) / "config.json").is_file():
            ap.error(f"--{name}={getattr(a, name)}: not a model directory (no config.json)")
    if self_teacher and any(CELLS[c].peer != "miniVERL" for c in cells):
        ap.error("--teacher self (the student's base as teacher) runs miniVERL's cells only: name them with --cells")
    if a.unsloth_site is not None and not a.unsloth_site.is_dir():
        ap.error(f"--unsloth-site={a.unsloth_site}: no such folder; unpack the unsloth bundle there first")
    if not a.cpu and not _cuda_visible():
        ap.error("no CUDA GPU here; run on the GPU machine, or pass --cpu for a smoke test with tiny models")
    overrides = tuple(a.miniverl_overrides.split())
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        ap.error(
            f"--miniverl-overrides: {' '.join(bad)} is not a Hydra override; write key=value, e.g."
            " trainer.compile_layers=false"
        )
    configs = {name: _model_config(getattr(a, "student" if self_teacher else name)) for name in ("student", "teacher")}
    stop_ids = stop_set(a.stop_median, configs["student"]["vocab_size"], STOP_SEED) if a.stop_median else ()
    prompt_tokens = 0
    if prompt_len != DEFAULT_PROMPT_LEN:  # the default keeps today's cells, which checked no positions either
        prompt_tokens = _longest_prompt_tokens(a.student, prompt_len[1])
        for shape in shapes:  # vLLM refuses a context past it; transformers would run RoPE beyond what the model saw
            for name, config in configs.items():
                positions = config.get("max_position_embeddings")
                if positions is not None and prompt_tokens + shape.tokens > positions:
                    ap.error(
                        f"--prompt-len {a.prompt_len} with shape {shape.name}: rows of up to {prompt_tokens} prompt +"
                        f" {shape.tokens} new tokens = {prompt_tokens + shape.tokens} pass the {name}'s"
                        f" max_position_embeddings {positions} (config.json); lower HI or the shape's TOKENS"
                    )
    return Plan(
        *(a.student, a.teacher, a.out, shapes, cells, a.steps, a.cell_timeout, a.unsloth_site, a.gpu, a.cpu),
        *(prompt_len, prompt_tokens, a.stop_median, stop_ids, overrides, a.peer_attention),
    )


def _model_config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def _longest_prompt_tokens(student: Path, max_len: int) -> int:
    """The most tokens a prompt of at most `max_len` characters takes under the student's tokenizer (peer_prompts)."""
    from transformers import AutoTokenizer  # not at import time: the module stays light

    return longest_prompt_tokens(max_len, AutoTokenizer.from_pretrained(student))


def _cuda_visible() -> bool:
    import torch  # not at import time: the module stays light

    return torch.cuda.is_available()


def cell_env(plan: Plan, cell: Cell) -> dict[str, str]:
    """The child's environment: the project importable, the Unsloth site first for its cell, one GPU."""
    env = dict(os.environ)
    paths = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    if cell.site and plan.unsloth_site is not None:
        paths.insert(0, str(plan.unsloth_site))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(PYTHONUNBUFFERED="1", TRL_EXPERIMENTAL_SILENCE="1", CUDA_VISIBLE_DEVICES=str(plan.gpu))
    return env


PREFLIGHT = """
import importlib.metadata as md, importlib.util as u, json, sys
mods = sys.argv[1:]
def version(m):
    try:
        return md.version(m)
    except md.PackageNotFoundError:
        return None
found = {m: u.find_spec(m) is not None for m in mods}
print(json.dumps({"missing": [m for m in mods if not found[m]],
                  "versions": {m: version(m) for m in [*mods, "torch", "transformers", "peft"]}}))
"""


def preflight(cell: Cell, env: dict[str, str]) -> dict:
    """Which of the cell's modules its environment lacks, and the versions it would run (no module is imported)."""
    done = subprocess.run(
        [sys.executable, "-c", PREFLIGHT, *cell.modules], env=env, capture_output=True, text=True, timeout=60
    )
    if done.returncode:
        return {"missing": list(cell.modules), "versions": {}, "error": done.stderr.strip()[-500:]}
    return json.loads(done.stdout)


class SmiSampler:
    """nvidia-smi's whole-device memory.used every 200 ms while a cell runs; peak None without nvidia-smi."""

    def __init__(self, gpu: int, csv: Path) -> None:
        self.proc = None
        self.csv = csv
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "-i", str(gpu), "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
            with csv.open("w") as f:
                self.proc = subprocess.Popen([*query, f"-lms={SMI_PERIOD_MS}"], stdout=f, stderr=subprocess.DEVNULL)

    def stop(self) -> float | None:
        if self.proc is None:
            return None
        time.sleep(2 * SMI_PERIOD_MS / 1000)  # one more sample after the cell's exit
        self.proc.terminate()
        self.proc.wait()
        values = [float(x) for x in self.csv.read_text().split() if x.strip().replace(".", "", 1).isdigit()]
        return max(values, default=None)


def failure_reason(returncode: int | None, log_lines: list[str], timeout: int) -> str:
    """Why a child failed, from its exit status and log: timeout, out of memory, a missing module, or the last error."""
    if returncode is None:
        return f"timed out after {timeout} s (--cell-timeout)"
    text = "\n".join(log_lines)
    if any(p in text for p in OOM_PATTERNS):
        oom = next(line for line in reversed(log_lines) if any(p in line for p in OOM_PATTERNS))
        return f"out of memory: {oom.strip()[:300]}"
    missing = re.findall(r"No module named '([^']+)'", text)
    if missing:
        return f"missing module {missing[-1]} (exit {returncode})"
    errors = [line.strip() for line in log_lines if re.match(r"\s*[\w.]*(Error|Exception)\b", line)]
    last = errors[-1] if errors else next((line.strip() for line in reversed(log_lines) if line.strip()), "")
    return f"exit {returncode}: {last[:300]}"


def read_miniverl_run(run_dir: Path, shape: Shape) -> dict:
    """Step seconds and trained tokens per step from a miniverl.main run's metrics.jsonl (training steps only)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: the run wrote no metrics")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = training_steps(rows)
    tokens = [r["response_tokens"] for r in steps[WARMUP_STEPS:] if "response_tokens" in r]
    timed = steps[WARMUP_STEPS:] or steps
    phases = sorted({k for r in timed for k in r if k.startswith(("time/generate", "time/score", "time/update"))})
    return {
        "step_seconds": [r["time/step"] for r in steps],
        "generate_seconds": [r["time/generate"] for r in steps] if all("time/generate" in r for r in steps) else None,
        "trained_tokens_per_step": statistics.median(tokens) if tokens else float(shape.rows * shape.tokens),
        "settings": {
            "experiment metrics": str(metrics),
            # each phase's median over the timed steps (the update's own split included: time/update/<part>)
            "phase medians (s)": {k: statistics.median(r[k] for r in timed if k in r) for k in phases},
        },
    }


def run_cell(plan: Plan, cell: Cell, shape: Shape, log=print) -> CellResult:
    """One cell in its own process; every way it can fail becomes a failed CellResult."""
    folder = plan.out / shape.name
    folder.mkdir(parents=True, exist_ok=True)
    out_json = folder / f"{cell.name}.json"
    r = CellResult(cell.name, cell.peer, shape.name, cell.loss, prompts=shape.prompts, samples=shape.samples)
    r.tokens = shape.tokens
    r.prompt_len, r.stop_median, r.stop_ids = list(plan.prompt_len), plan.stop_median, len(plan.stop_ids)
    env = cell_env(plan, cell)
    try:
        if plan.cpu and cell.gpu_only:
            raise NotRunnable(f"{cell.gpu_only}; not run with --cpu")
        r.command = cell.command(plan, shape, out_json)
        check = preflight(cell, env)
        r.versions = check["versions"]
        if check["missing"]:
            raise NotRunnable(f"not importable here: {', '.join(check['missing'])} (stage its device bundle)")
    except (NotRunnable, ValueError) as e:
        return _failed(r, str(e), log)
    command = r.command
    sizes = micro_batches(shape.rows, cell.group(shape)) if cell.group else [None]
    tried: list[str] = []  # each micro-batch that ran out of memory, and where
    for i, micro in enumerate(sizes):
        if micro is not None:
            r.command = [*command, "--micro-batch", str(micro)]
        log(f"  {shape.name} {cell.name}: {' '.join(r.command[1:])[:200]}")
        returncode, lines, peak = _run_child(plan, r.command, env, folder, cell.name)
        r.smi_peak_mib = peak  # the try that counts: an out-of-memory try's peak is the card's
        oom = returncode not in (0, None) and any(p in "\n".join(lines) for p in RETRY_PATTERNS)
        if not (oom and i + 1 < len(sizes)):
            break
        tried.append(f"{micro} rows: {failure_reason(returncode, lines, plan.cell_timeout)[:160]}")
        log(f"  {shape.name} {cell.name}: out of memory at {micro} rows a forward; again at {sizes[i + 1]}")
    if returncode != 0:
        r.log_tail = lines[-LOG_TAIL_LINES:]
        r.settings = {"micro-batches out of memory": tried} if tried else {}
        return _failed(r, failure_reason(returncode, lines, plan.cell_timeout), log)
    try:
        got = (
            read_miniverl_run(out_json.with_suffix(""), shape)
            if cell.reads == "miniverl"
            else json.loads(out_json.read_text())
        )
    except (OSError, ValueError, KeyError) as e:
        return _failed(r, f"finished but its results could not be read: {e}", log)
    if cell.reads == "miniverl":
        r.prompts, r.samples = _shape_from_command(r.command, shape)
    else:
        r.prompts, r.samples = got.get("prompts", r.prompts), got.get("samples", r.samples)
    r.step_seconds = [float(s) for s in got["step_seconds"]]
    r.settings, r.versions = got.get("settings", {}), {**r.versions, **got.get("versions", {})}
    if tried:
        r.settings["micro-batches out of memory"] = tried
    if cell.reads == "miniverl" and plan.miniverl_overrides:
        r.settings["overrides"] = list(plan.miniverl_overrides)
    timed = r.step_seconds[WARMUP_STEPS:] or r.step_seconds
    r.median_step_s = statistics.median(timed)
    generation = [float(s) for s in got.get("generate_seconds") or []]
    if len(generation) == len(r.step_seconds) and any(generation):  # all zero: the wrapped method never ran
        r.generate_seconds = generation
        r.median_generate_s = statistics.median(generation[WARMUP_STEPS:] or generation)
    r.trained_tokens_per_step = float(got["trained_tokens_per_step"])
    r.trained_tokens_per_s = r.trained_tokens_per_step / r.median_step_s if r.median_step_s > 0 else None
    log(f"  {shape.name} {cell.name}: {r.median_step_s:.2f} s/step, {r.trained_tokens_per_s or 0:,.0f} tokens/s")
    return r


def _run_child(plan: Plan, command: list[str], env: dict[str, str], folder: Path, name: str):
    """One try of a cell in its own process, nvidia-smi sampling: (exit status or None on timeout, its log's lines,
    the whole device's peak MiB). The log and samples of the last try are kept as <cell>.log and <cell>_smi.csv."""
    log_file = folder / f"{name}.log"
    sampler = SmiSampler(plan.gpu, folder / f"{name}_smi.csv")
    with log_file.open("w") as f:
        child = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            returncode = child.wait(timeout=plan.cell_timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            returncode = None
    peak = sampler.stop()
    return returncode, log_file.read_text(errors="replace").splitlines(), peak


def _shape_from_command(command: list[str], shape: Shape) -> tuple[int, int]:
    got = dict(a.split("=", 1) for a in command if a.startswith(("data.prompts_per_step=", "rollout.n=")))
    return int(got.get("data.prompts_per_step", shape.prompts)), int(got.get("rollout.n", shape.samples))


def _failed(r: CellResult, reason: str, log) -> CellResult:
    r.status, r.reason = "failed", reason
    log(f"  {r.shape} {r.cell}: FAILED: {reason}")
    return r


def table(results: list[CellResult]) -> str:
    """The markdown table of every cell, failures included."""
    head = (
        "| shape | cell | peer | rows (P x N) | s/step | of it generating | trained tokens/s | nvidia-smi peak | loss"
        " | status |"
    )
    lines = [head, "|---|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in results:
        step = f"{r.median_step_s:.2f}" if r.median_step_s is not None else "-"
        generating = f"{r.median_generate_s:.2f}" if r.median_generate_s is not None else "-"
        tps = f"{r.trained_tokens_per_s:,.0f}" if r.trained_tokens_per_s is not None else "-"
        peak = f"{r.smi_peak_mib:,.0f} MiB" if r.smi_peak_mib is not None else "-"
        status = "ok" if r.status == "ok" else f"failed: {r.reason}".replace("|", "/")
        rows = f"{r.prompts * r.samples} ({r.prompts} x {r.samples})"
        cells = (r.shape, r.cell, r.peer, rows, step, generating, tps, peak, r.loss, status)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(plan: Plan, results: list[CellResult], argv: list[str]) -> str:
    """peers.md: the command, the machine, the versions each cell saw, and the table."""
    machine = f"{platform.node()} ({platform.platform()}, python {platform.python_version()})"
    versions = sorted({f"{k} {v}" for r in results for k, v in r.versions.items() if v})
    stops = (
        f"rows also stop on {len(plan.stop_ids)} ids (stop_set median {plan.stop_median}, seed {STOP_SEED})"
        if plan.stop_ids
        else "rows stop only on the models' EOS"
    )
    return "\n".join(
        [
            "# Peers harness results",
            "",
            f"Command: `python -m lab.bench.peers {' '.join(argv)}`",
            f"Machine: {machine}; GPU index {plan.gpu}{' (CPU run)' if plan.cpu else ''}",
            f"Versions seen by the cells: {', '.join(versions) or '-'}",
            f"Steps per cell: {plan.steps} (the first {WARMUP_STEPS} untimed; medians of the rest)",
            f"Prompts: the {TASK} task's strings of {plan.prompt_len[0]}-{plan.prompt_len[1]} characters; {stops}",
            "",
            table(results),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plan = parse_args(argv)
    plan.out.mkdir(parents=True, exist_ok=True)
    results: list[CellResult] = []
    total = len(plan.shapes) * len(plan.cells)
    for shape in plan.shapes:
        for name in plan.cells:
            print(f"[{len(results) + 1}/{total}] {shape.name} {name} ({time.strftime('%H:%M:%S')})", flush=True)
            r = run_cell(plan, CELLS[name], shape, log=lambda s: print(s, flush=True))
            (plan.out / shape.name / f"{name}.result.json").write_text(json.dumps(asdict(r), indent=2))
            results.append(r)
            # rewritten after every cell: a session that ends mid-run keeps the cells done so far
            (plan.out / "peers.json").write_text(json.dumps([asdict(x) for x in results], indent=2))
            (plan.out / "peers.md").write_text(report(plan, results, argv))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
