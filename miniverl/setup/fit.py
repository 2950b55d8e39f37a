"""Will the run fit the card? Each actor's planned GPU memory, from the config and the models' shapes alone.

No weight is read and nothing starts: a model's size comes from its safetensors headers, or, for a model with only
its config.json at hand (a hub id whose weights are not downloaded yet), from the model built on the meta device.
Each actor plans inside its share of the card (its resources.<actor>.num_gpus of the card, less its CUDA context,
as the actors cap themselves: miniverl/process.py emulated_cap_gib):
- learner: weights, the adapter with its AdamW state, and the micro-batch the calibrated peak model
  (models/sizing.py) chooses: what the learner itself will choose after loading;
- scorer: every teacher's weights and the forward size the scorer will choose (models/sizing.py scorer_tokens);
- rollout: vLLM takes its whole share up front (weights, ENGINE_OVERHEAD_GIB, the KV cache: rollout/vllm_settings.py
  memory_plan), and so does SGLang (weights, a prefill chunk's logits and its context: rollout/sglang.py
  engine_overhead_bytes, the KV pool); the HF backends hold the weights, a bf16 copy of the adapter, the decode cache of every row of the
  step at full length (data.max_prompt_length + rollout.max_new_tokens: the longest a step can ask for) and the
  sampler's fp32 logits and the prefill's activations, calibrated on hf_cached (ROLLOUT_FIXED_BYTES).
NF4 weights are estimated (models/loading.py NF4_BYTES_PER_PARAM for the decoder's linear layers, the rest in 16
bits). The learner and scorer models are calibrated on the GPU (models/sizing.py); the rollout's model is fitted to
five H200 cells and not yet checked on shapes outside them, and the NF4 estimate not at all, so a plan they put over
its share is reported, not refused.

`python -m miniverl.fit` prints the plan; every GPU run logs the same lines before Ray starts and refuses what the
calibrated models say cannot fit (setup/prepare.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miniverl.config import MiniVerlConfig
from miniverl.errors import ConfigError
from miniverl.models.loading import ModelSize, model_size
from miniverl.models.memory import human

# The HF rollout (hf_cached) beside its weights, adapter and decode cache, at its peak (the first decode step after
# the prefill): per row the sampler's fp32 [V] logits (ROLLOUT_LOGIT_COPIES of them), per prompt the prefill's
# transient activations (each prompt token's MLP and hidden-size intermediates, PREFILL_TOKEN_BYTES_PER_*; each
# prompt's fp32 attention scores and mask, PREFILL_SCORE_COPIES of [heads + 1, P, P]) and ROLLOUT_FIXED_BYTES.
# Fitted on the H200 to five hf_cached cells of the 0.5B shape (docs/benchmarks/fit-planner.md: 128-512 rows,
# 64-600-token prompts, 512 and 1,024 new tokens; each within 0.5%), measured when hf_cached ran every prompt through
# one prefill pass; it now runs passes of PREFILL_TOKENS (rollout/hf_cached.py), which the plan counts, unmeasured.
# Two earlier models missed shapes they were not fitted to by up to 21% and 9%, so this one is reported as an
# estimate until a GPU run checks it on new shapes.
ROLLOUT_LOGIT_COPIES = 1.25
PREFILL_TOKEN_BYTES_PER_INTERMEDIATE = 7.7  # gate, up and their product in 16 bits, x1.29 as fitted
PREFILL_TOKEN_BYTES_PER_HIDDEN = 20.6  # about 10 [P, hidden] 16-bit tensors alive in a layer
PREFILL_SCORE_COPIES = 1.6
ROLLOUT_FIXED_BYTES = int(0.30 * 2**30)
ADAPTER_COPY_BYTES = 2  # the rollout's copy of the adapter, in the base's 16-bit dtype
KV_BYTES = 2  # keys and values in the model's 16-bit dtype


@dataclass
class ActorPlan:
    """One actor's plan: its share of the card (the cap it runs under), the weights it holds, its modelled peak,
    what it will choose (a line), and what does not fit (None when it fits)."""

    role: str
    fraction: float
    share_bytes: int
    weight_bytes: int
    peak_bytes: int
    choice: str
    problem: str | None = None
    calibrated: bool = True  # False: arithmetic on shapes, not checked against a measured peak (reported only)


@dataclass
class FitPlan:
    """Every actor's plan on one card, the CUDA contexts beside them, and what would not fit."""

    card_bytes: int
    card_source: str
    actors: list[ActorPlan]
    context_bytes: int
    contexts: int
    problems: list[str] = field(default_factory=list)  # the card's own (shares over the whole card)
    # what the plan chose where the config left it null, by dotted key (resources.<actor>.num_gpus,
    # trainer.logprob_chunk_tokens, trainer.gradient_checkpointing), and one line per chosen value saying why
    layout: dict = field(default_factory=dict)
    layout_lines: list[str] = field(default_factory=list)

    @property
    def device_peak_bytes(self) -> int:
        """The modelled whole-device peak: every actor's modelled peak and every CUDA context."""
        return sum(a.peak_bytes for a in self.actors) + self.context_bytes

    @property
    def refusals(self) -> list[str]:
        """What the run refuses: the card's problems and those of the calibrated models."""
        return self.problems + [f"{a.role}: {a.problem}" for a in self.actors if a.problem and a.calibrated]

    @property
    def warnings(self) -> list[str]:
        return [f"{a.role}: {a.problem}" for a in self.actors if a.problem and not a.calibrated]

    def lines(self) -> list[str]:
        out = [f"memory plan for a {human(self.card_bytes)} card ({self.card_source}):", *self.layout_lines]
        for a in self.actors:
            mark = "" if a.problem is None else ("  DOES NOT FIT" if a.calibrated else "  over its share (estimate)")
            out.append(
                f"  {a.role:<8} {a.fraction:>5.2f} of the card = {human(a.share_bytes)} share; weights"
                f" {human(a.weight_bytes)}; modelled peak {human(a.peak_bytes)}; {a.choice}{mark}"
            )
        out.append(
            f"  device   {self.contexts} CUDA context(s) {human(self.context_bytes)}; modelled peak of the whole card"
            f" {human(self.device_peak_bytes)} of {human(self.card_bytes)}"
        )
        verdict = "fits" if not (self.refusals or self.warnings) else "does not fit"
        out.append(f"  => {verdict}" + ("" if verdict == "fits" else ": " + "; ".join(self.refusals + self.warnings)))
        return out


def card_bytes(cfg: MiniVerlConfig, device_total: int | None) -> tuple[int, str]:
    """The card the plan is for: resources.emulate_gpu_gib, else the visible GPU (`device_total` bytes)."""
    if cfg.resources.emulate_gpu_gib is not None:
        return int(cfg.resources.emulate_gpu_gib * 2**30), "resources.emulate_gpu_gib"
    if device_total:
        return device_total, "this machine's GPU 0"
    raise ConfigError(
        "no card to plan for: this machine has no GPU and resources.emulate_gpu_gib is not set; name the card, e.g."
        " resources.emulate_gpu_gib=16 for a 16 GB RTX 4080"
    )


def plan_fit(
    cfg: MiniVerlConfig,
    objective,
    sizes: dict[str, ModelSize],
    vocab: int,
    card: tuple[int, str],
    kernels: bool = True,
) -> FitPlan:
    """The plan of `cfg` on `card` ((bytes, where it came from)): `objective` the built objective, `sizes` by role
    ("student" and every teacher's role), `vocab` the logits distillation compares, `kernels` whether the learner and
    scorer will use the Triton vocabulary passes (a CUDA machine with Triton: models/vocab_kernels.py)."""
    from miniverl.process import COLOCATED_CONTEXT_GIB, CUDA_CONTEXT_GIB
    from miniverl.setup.preflight import adapter_params

    total, source = card
    adapter = adapter_params(sizes["student"].config, cfg.model.lora)  # a meta-device build: once
    cfg, shares, share_lines = choose_shares(cfg, objective, sizes, adapter, vocab, total, kernels)
    res = cfg.resources
    fractions = {"rollout": res.rollout.num_gpus, "scorer": res.scorer.num_gpus, "learner": res.learner.num_gpus}
    own_scorer_gpu = res.scorer_gpus > 0
    if own_scorer_gpu:
        fractions["scorer"] = 1.0
    problems = []
    shared = sum(f for role, f in fractions.items() if not (own_scorer_gpu and role == "scorer"))
    if shared > 1.0 + 1e-9:
        problems.append(
            f"the actors' resources.*.num_gpus add up to {shared:g} of one GPU; lower them to at most 1 in all"
        )

    def share(role: str) -> int:
        return int((total / 2**30 * fractions[role] - CUDA_CONTEXT_GIB) * 2**30)  # as emulated_cap_gib rounds

    cfg, layout, layout_lines = choose_layout(cfg, objective, sizes, adapter, vocab, share, fractions, kernels)
    actors = [
        _learner(cfg, objective, sizes["student"], adapter, vocab, share("learner"), fractions["learner"], kernels),
        _scorer(
            cfg,
            objective,
            teacher_sizes(sizes),
            vocab,
            share("scorer"),
            fractions["scorer"],
            kernels,
        ),
        _rollout(cfg, sizes["student"], adapter, share("rollout"), fractions["rollout"]),
    ]
    for a in actors:
        if a.share_bytes <= 0:
            a.problem = (
                f"resources.{a.role}.num_gpus={a.fraction:g} of the card is no more than its {CUDA_CONTEXT_GIB} GiB"
                " CUDA context; give it a larger share"
            )
            a.calibrated = True
    contexts = 1 if res.colocate else len(actors)
    context = COLOCATED_CONTEXT_GIB if res.colocate else CUDA_CONTEXT_GIB
    return FitPlan(
        total,
        source,
        actors,
        int(contexts * context * 2**30),
        contexts,
        problems,
        {**shares, **layout},
        share_lines + layout_lines,
    )


def step_rows(cfg: MiniVerlConfig) -> int:
    """Rows of one step on one GPU (each GPU's replicas take a contiguous share of the prompt groups)."""
    return max(cfg.data.prompts_per_step * cfg.rollout.n // max(cfg.resources.gpus or 1, 1), 1)


# The shares a run gets where resources.<actor>.num_gpus is null (issue 34: gkd's old fixed 0.4 / 0.3 / 0.3 left the
# rollout 1.2 GiB it did not use at 64 x 4 x 512 and 4.4 GiB at 16 x 1 x 256, while the scorer's 0.3 held forwards of
# 2,386 tokens beside a bf16 1.5B teacher where gkd_4080's 0.35 held 8,080: its scoring took 2.19 s against 1.47 s
# a step; docs/benchmarks/peers.md run 1). In steps of SHARE_STEP of the card:
# - the HF rollout: its modelled peak (the step's or the evaluation's rows, the larger) plus ROLLOUT_SHARE_MARGIN,
#   and its CUDA context, but never more than leaves the learner and the scorer a row each (a rollout too large for
#   the card is then reported over its share with its fixes); vLLM, which sizes its KV cache from whatever its
#   share leaves: vllm_settings.AUTO_SHARE;
# - the learner: the least share whose micro-batches hold CHECKPOINT_FREE_TOKENS tokens or the step's, whichever
#   is less (or an explicit trainer.max_tokens_per_micro_batch): from 16k to 32k tokens a micro-batch trained only
#   4% faster (docs/benchmarks/learner-throughput.md diag2);
# - the scorer: the rest of the card, since its forwards, and the step's scoring with them, grow with its share.
# A share the config sets is kept, and the ones left null divide what it leaves.
ROLLOUT_SHARE_MARGIN = 0.10
SHARE_STEP = 0.01


def teacher_sizes(sizes: dict[str, ModelSize]) -> dict[str, ModelSize]:
    """The teachers' entries of `sizes` (every role but the student's, as setup's paths hold them)."""
    return {role: size for role, size in sizes.items() if role != "student"}


def choose_shares(cfg, objective, sizes: dict[str, ModelSize], adapter: int, vocab: int, total: int, kernels: bool):
    """`cfg` with every null resources.<actor>.num_gpus chosen for a card of `total` bytes (the rules above), the
    chosen values by dotted key, and a line for each saying why."""
    import dataclasses
    import math

    from miniverl.process import CUDA_CONTEXT_GIB
    from miniverl.rollout.vllm_settings import AUTO_SHARE

    res = cfg.resources
    actors = ("rollout", "learner", "scorer")
    unset = [a for a in actors if getattr(res, a).num_gpus is None]
    if not unset:
        return cfg, {}, []
    steps = round(1 / SHARE_STEP)
    card_gib = total / 2**30

    def share_bytes(k: int) -> int:  # as plan_fit's share(): k steps of the card less a CUDA context
        return int((card_gib * k / steps - CUDA_CONTEXT_GIB) * 2**30)

    def least_steps(nbytes: float) -> int:  # the fewest steps whose share holds `nbytes` beside the context
        return max(1, math.ceil(round((nbytes / 2**30 + CUDA_CONTEXT_GIB) / card_gib * steps, 6)))

    fits = _ShareFits(cfg, objective, sizes, adapter, vocab, kernels, share_bytes)
    own_gpu = {"scorer"} if res.scorer_gpus > 0 else set()
    on_card = [a for a in actors if a not in own_gpu]
    kept = {a: round(getattr(res, a).num_gpus * steps) for a in on_card if a not in unset}
    # what the learner and the scorer need at the least (one row each), so that a rollout too large for the card is
    # reported over its own share with its fixes, not as the others' shares too small
    least = {"learner": fits.least("learner", steps), "scorer": fits.least("scorer", steps)}
    chosen: dict[str, int] = {a: steps for a in own_gpu if a in unset}
    why: dict[str, str] = {a: f"a GPU of its own (resources.scorer_gpus={res.scorer_gpus})" for a in chosen}
    if "rollout" in unset:
        if cfg.rollout.backend in ("vllm", "sglang"):  # paged engines: their KV cache fills what a share leaves
            chosen["rollout"] = round(AUTO_SHARE * steps)
            why["rollout"] = (
                "vLLM sizes its KV cache from what its share leaves: its default share"
                if cfg.rollout.backend == "vllm"
                else "SGLang sizes its KV pool from what its share leaves: vLLM's default share"
            )
        else:
            peak = _rollout(cfg, sizes["student"], adapter, 0, 0.0).peak_bytes
            need = least_steps(peak * (1 + ROLLOUT_SHARE_MARGIN))
            room = steps - sum(kept.get(a, least[a]) for a in on_card if a != "rollout")
            chosen["rollout"] = max(min(need, room), 1)
            why["rollout"] = (
                f"its modelled peak {human(peak)} + {ROLLOUT_SHARE_MARGIN:.0%} and its CUDA context"
                if chosen["rollout"] == need
                else f"what the learner and the scorer leave, short of its modelled peak {human(peak)}"
            )
    left = steps - sum({**kept, **chosen}.get(a, 0) for a in on_card)
    rest = [a for a in ("learner", "scorer") if a in unset and a not in chosen]
    if len(rest) == 1:
        chosen[rest[0]], why[rest[0]] = max(left, 0), "the rest of the card"
    elif rest:
        chosen["learner"], why["learner"] = fits.learner_steps(left - least["scorer"])
        chosen["scorer"], why["scorer"] = max(left - chosen["learner"], 0), "the rest of the card"
    resources = dataclasses.replace(
        res, **{a: dataclasses.replace(getattr(res, a), num_gpus=k / steps) for a, k in chosen.items()}
    )
    values = {f"resources.{a}.num_gpus": chosen[a] / steps for a in actors if a in chosen}
    lines = [f"  {key}={value:.2f} (chosen: {why[key.split('.')[1]]})" for key, value in values.items()]
    return dataclasses.replace(cfg, resources=resources), values, lines


class _ShareFits:
    """What the learner and the scorer hold in a share of k steps, with the layout each would get at its best (the
    largest LM-head chunk, checkpointing unless the config turns it off)."""

    def __init__(self, cfg, objective, sizes, adapter: int, vocab: int, kernels: bool, share_bytes) -> None:
        import dataclasses

        t = cfg.trainer
        self.chunk = t.logprob_chunk_tokens
        if self.chunk is None:
            self.chunk = 0 if vocab < SMALL_VOCAB else AUTO_CHUNKS[0]
        self.checkpointing = t.gradient_checkpointing is not False
        self.trial = dataclasses.replace(
            cfg,
            trainer=dataclasses.replace(t, logprob_chunk_tokens=self.chunk, gradient_checkpointing=self.checkpointing),
        )
        self.shape = _learner_shape(cfg, sizes["student"], adapter, vocab)
        self.teachers = teacher_sizes(sizes)
        self.objective, self.vocab, self.kernels, self.share_bytes = objective, vocab, kernels, share_bytes
        self.longest_row = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
        self.enough = t.max_tokens_per_micro_batch or min(step_rows(cfg) * self.longest_row, CHECKPOINT_FREE_TOKENS)

    def learner_tokens(self, k: int) -> int:
        """The learner's micro-batch tokens in k steps (0: not one row)."""
        from miniverl.models.sizing import fit_tokens

        closed = self.objective.closed_form_head and self.kernels
        try:
            return fit_tokens(self.shape, self.share_bytes(k), self.chunk, self.checkpointing, self.longest_row, closed)
        except ConfigError:
            return 0

    def scorer_fits(self, k: int) -> bool:
        plan = _scorer(
            self.trial, self.objective, self.teachers, self.vocab, self.share_bytes(k), k * SHARE_STEP, self.kernels
        )
        return plan.problem is None

    def least(self, role: str, steps: int) -> int:
        """The fewest steps in which `role` holds one row (1 when none does: its plan then names the problem)."""
        holds = self.scorer_fits if role == "scorer" else (lambda k: self.learner_tokens(k) >= self.longest_row)
        return next((k for k in range(1, steps) if holds(k)), 1)

    def learner_steps(self, most: int) -> tuple[int, str]:
        """The least share (at most `most` steps) whose micro-batches hold what is enough, and why."""
        for k in range(1, max(most, 1) + 1):
            if self.learner_tokens(k) >= self.enough:
                return k, f"the least share whose micro-batches hold {self.enough:,} tokens"
        return max(most, 1), f"all the scorer leaves: no share holds micro-batches of {self.enough:,} tokens"


# The layout a run gets where trainer.logprob_chunk_tokens or trainer.gradient_checkpointing is null (issue 34: a user
# who did not copy the 4080 recipe got 917-token micro-batches, no chunking, and a learner ~5x slower per token):
# - LM-head chunks: none below SMALL_VOCAB (a micro-batch's logits at once are cheap there, as on the built-in models'
#   40-token vocabulary); above it the largest of AUTO_CHUNKS with which the learner and the scorer both fit (1,024
#   tokens was the fastest chunk measured: docs/benchmarks/learner-throughput.md diag10 and confirm3);
# - gradient checkpointing: on when it lets the learner's micro-batches grow and they are short without it (under
#   CHECKPOINT_FREE_TOKENS or the step's tokens, or under an explicit trainer.max_tokens_per_micro_batch). Per token
#   it recomputes the forward (~30%), but a micro-batch costs far more when small: 802-token micro-batches without
#   it trained 2.7k tokens/s where 20,072-token ones with it trained 21k (diag6 vs diag5); from 16k to 32k tokens a
#   micro-batch gained only 4% (diag2).
SMALL_VOCAB = 32768
AUTO_CHUNKS = (1024, 512, 256, 128)
CHECKPOINT_FREE_TOKENS = 16384


def _learner_shape(cfg, size: ModelSize, adapter: int, vocab: int):
    from miniverl.models.loading import torch_dtype
    from miniverl.models.sizing import model_shape

    spec = cfg.model.student
    weights = size.weight_bytes(spec.quantization, torch_dtype(spec.dtype, "cuda").itemsize)
    return model_shape(size.config, vocab, weights, adapter, quantized=spec.quantization != "none")


def _checkpointing_pays(cfg, objective, shape, share: int, chunk: int, kernels: bool) -> tuple[bool, str]:
    """Whether the learner should recompute activations, and why (a line's tail)."""
    from miniverl.models.sizing import fit_tokens

    closed = objective.closed_form_head and kernels
    longest_row = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    fits = {}
    for on in (False, True):
        try:
            fits[on] = fit_tokens(shape, share, chunk, on, longest_row, closed)
        except ConfigError:
            fits[on] = 0
    # an explicit trainer.max_tokens_per_micro_batch is what the micro-batches must hold
    enough = cfg.trainer.max_tokens_per_micro_batch or min(step_rows(cfg) * longest_row, CHECKPOINT_FREE_TOKENS)

    def up_to(tokens: int) -> str:
        return f"up to {tokens:,} tokens" if tokens else "not one row"

    sizes = f"micro-batches of {up_to(fits[False])} without it, {up_to(fits[True])} with it"
    if fits[False] >= enough or fits[False] >= fits[True]:
        return False, f"{sizes}: enough without"
    return True, f"{sizes}: short without"


def choose_layout(
    cfg, objective, sizes: dict[str, ModelSize], adapter: int, vocab: int, share, fractions: dict, kernels: bool
):
    """`cfg` with trainer.logprob_chunk_tokens and trainer.gradient_checkpointing set where they are null (the
    rules above), the chosen values, and a line for each value chosen. `share(role)`: an actor's share in bytes."""
    import dataclasses

    t = cfg.trainer
    if t.logprob_chunk_tokens is not None and t.gradient_checkpointing is not None:
        return cfg, {}, []
    shape = _learner_shape(cfg, sizes["student"], adapter, vocab)
    if t.logprob_chunk_tokens is not None:
        chunks = [t.logprob_chunk_tokens]
    else:
        chunks = [0] if vocab < SMALL_VOCAB else list(AUTO_CHUNKS)
    teachers = teacher_sizes(sizes)
    for chunk in chunks:  # the largest chunk with which both fit; else the smallest (its plan says what does not)
        checkpointing, why = t.gradient_checkpointing, None
        if checkpointing is None:
            checkpointing, why = _checkpointing_pays(cfg, objective, shape, share("learner"), chunk, kernels)
        trial = dataclasses.replace(
            cfg, trainer=dataclasses.replace(t, logprob_chunk_tokens=chunk, gradient_checkpointing=checkpointing)
        )
        learner = _learner(
            trial, objective, sizes["student"], adapter, vocab, share("learner"), fractions["learner"], kernels
        )
        scorer = _scorer(trial, objective, teachers, vocab, share("scorer"), fractions["scorer"], kernels)
        fits = learner.problem is None and scorer.problem is None
        if fits:
            break
    layout, lines = {}, []
    if t.logprob_chunk_tokens is None:
        layout["trainer.logprob_chunk_tokens"] = chunk
        reason = f"the largest of {', '.join(map(str, AUTO_CHUNKS))} with which the learner and the scorer fit"
        if vocab < SMALL_VOCAB:
            reason = f"a {vocab:,}-token vocabulary's logits are small"
        elif not fits:
            reason = f"the smallest of {', '.join(map(str, AUTO_CHUNKS))}: with none do the learner and the scorer fit"
        lines.append(f"  trainer.logprob_chunk_tokens={chunk} (chosen: {reason})")
    if t.gradient_checkpointing is None:
        layout["trainer.gradient_checkpointing"] = checkpointing
        lines.append(f"  trainer.gradient_checkpointing={str(checkpointing).lower()} (chosen: {why})")
    return trial, layout, lines


def _learner(
    cfg, objective, size: ModelSize, adapter: int, vocab: int, share: int, fraction: float, kernels: bool
) -> ActorPlan:
    """`adapter`: the LoRA adapter's parameters (setup/preflight.py adapter_params)."""
    from miniverl.models.sizing import check_token_budget, fit_tokens, learner_peak_bytes

    spec, t = cfg.model.student, cfg.trainer
    shape = _learner_shape(cfg, size, adapter, vocab)
    weights = shape.weight_bytes
    closed = objective.closed_form_head and kernels
    longest_row = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    step_tokens = step_rows(cfg) * longest_row
    plan = ActorPlan("learner", fraction, share, weights, 0, "", calibrated=spec.quantization == "none")
    try:
        if t.max_tokens_per_micro_batch:
            tokens = t.max_tokens_per_micro_batch
            check_token_budget(shape, share, tokens, t.logprob_chunk_tokens, t.gradient_checkpointing, closed)
        else:
            tokens = fit_tokens(shape, share, t.logprob_chunk_tokens, t.gradient_checkpointing, longest_row, closed)
    except ConfigError as e:
        plan.problem, tokens = str(e), longest_row
    used = min(tokens, step_tokens)  # a micro-batch never holds more than the step's rows
    plan.peak_bytes = learner_peak_bytes(shape, used, t.logprob_chunk_tokens, t.gradient_checkpointing, closed)
    plan.choice = (
        f"micro-batches of up to {tokens:,} tokens (the step: {step_tokens:,} at most)"
        if plan.problem is None
        else f"not one row of {longest_row:,} tokens (the peak shown is that row's)"
    )
    return plan


def _scorer(
    cfg, objective, sizes: dict[str, ModelSize], vocab: int, share: int, fraction: float, kernels: bool
) -> ActorPlan:
    from miniverl.models.loading import torch_dtype
    from miniverl.models.sizing import check_scorer_fits, model_shape, scorer_chunk_entry_bytes, scorer_peak_bytes
    from miniverl.routing import teacher_specs

    specs, t = teacher_specs(cfg.model), cfg.trainer
    weights = sum(
        sizes[r].weight_bytes(s.quantization, torch_dtype(s.dtype, "cuda").itemsize) for r, s in specs.items()
    )
    entry = scorer_chunk_entry_bytes(objective.teacher_support_k, objective.loss_temperature, vocab, kernels)
    longest_row = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    quantized = any(s.quantization != "none" for s in specs.values())
    plan = ActorPlan("scorer", fraction, share, weights, 0, "", calibrated=not quantized)
    shapes = [  # one process holds every teacher
        model_shape(sizes[r].config, vocab, weights, quantized=specs[r].quantization != "none") for r in specs
    ]
    try:
        tokens = min(check_scorer_fits(s, share, t.logprob_chunk_tokens, entry, longest_row) for s in shapes)
        if t.max_tokens_per_micro_batch:
            tokens = min(tokens, t.max_tokens_per_micro_batch)
    except ConfigError as e:
        plan.problem, tokens = str(e), longest_row
    used = min(tokens, step_rows(cfg) * longest_row)
    plan.peak_bytes = max(scorer_peak_bytes(s, used, t.logprob_chunk_tokens, entry) for s in shapes)
    plan.choice = (
        f"forwards of up to {tokens:,} tokens"
        if plan.problem is None
        else f"not one row of {longest_row:,} tokens (the peak shown is that row's)"
    )
    return plan


def _rollout(cfg, size: ModelSize, adapter: int, share: int, fraction: float) -> ActorPlan:
    """`adapter`: the LoRA adapter's parameters (setup/preflight.py adapter_params)."""
    from miniverl.models.loading import torch_dtype
    from miniverl.rollout.vllm_settings import ENGINE_OVERHEAD_GIB

    spec, r = cfg.model.student, cfg.rollout
    c = size.config
    weights = size.weight_bytes(spec.quantization, torch_dtype(spec.dtype, "cuda").itemsize)
    adapter_bytes = adapter * ADAPTER_COPY_BYTES
    rows = step_rows(cfg)
    columns = cfg.data.max_prompt_length + r.max_new_tokens
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * KV_BYTES
    plan = ActorPlan("rollout", fraction, share, weights, 0, "", calibrated=False)
    if r.backend == "sglang":  # SGLang takes its static fraction of the device, less its overhead, whole at start
        from miniverl.rollout.sglang import engine_overhead_bytes

        overhead = engine_overhead_bytes(r.sglang.chunked_prefill_size, c.vocab_size)
        kv = share - weights - adapter_bytes - overhead
        plan.peak_bytes = weights + adapter_bytes + overhead + max(kv, 0)
        at_once = max(kv, 0) // kv_per_token // max(columns, 1)
        plan.choice = (
            f"SGLang KV pool {human(max(kv, 0))}: {min(at_once, rows)} of the step's {rows} rows at full length at"
            f" once ({human(overhead)} of engine overhead beside it: a {r.sglang.chunked_prefill_size}-token prefill"
            " chunk's logits and the context, measured once in run 2)"
        )
        if kv <= 0:
            plan.problem = (
                f"SGLang's weights ({human(weights)}), adapter and {human(overhead)} engine overhead (a"
                f" {r.sglang.chunked_prefill_size}-token prefill chunk's fp32 logits and its CUDA context) leave"
                f" nothing for the KV pool in a {human(share)} share; raise resources.rollout.num_gpus or lower"
                " rollout.sglang.chunked_prefill_size"
            )
        return plan
    if r.backend == "vllm":
        overhead = int(ENGINE_OVERHEAD_GIB * 2**30)
        explicit = r.vllm.kv_cache_gib
        kv = int(explicit * 2**30) if explicit is not None else share - weights - adapter_bytes - overhead
        plan.peak_bytes = weights + adapter_bytes + overhead + max(kv, 0)
        at_once = max(kv, 0) // kv_per_token // max(columns, 1)
        plan.choice = (
            f"vLLM KV cache {human(max(kv, 0))}: {min(at_once, rows)} of the step's {rows} rows at full length at once"
        )
        if kv <= 0 or plan.peak_bytes > share:
            plan.problem = (
                f"vLLM's weights ({human(weights)}), adapter and ~{ENGINE_OVERHEAD_GIB} GiB engine overhead leave"
                f" {human(kv) if kv > 0 else 'nothing'} for the KV cache in a {human(share)} share; raise"
                " resources.rollout.num_gpus, set rollout.vllm.kv_cache_gib smaller"
                + (" or quantize the student (model.student.quantization=nf4)" if spec.quantization == "none" else "")
            )
            plan.calibrated = True  # the engine refuses this itself at start (vllm_settings.memory_plan)
        return plan
    from miniverl.rollout.decode_cache import CACHE_COLUMN_QUANTUM

    columns = -(-columns // CACHE_COLUMN_QUANTUM) * CACHE_COLUMN_QUANTUM  # the cache grows in these steps
    p = cfg.data.max_prompt_length
    per_prompt = p * (
        PREFILL_TOKEN_BYTES_PER_INTERMEDIATE * c.intermediate_size + PREFILL_TOKEN_BYTES_PER_HIDDEN * c.hidden_size
    )
    per_prompt += PREFILL_SCORE_COPIES * (c.num_attention_heads + 1) * p * p * 4  # fp32 scores of every head, mask

    def parts(rows: int, prompts: int) -> tuple[int, int, int]:
        """The decode cache, the sampler's logits and the prefill of a generate call of `rows` rows."""
        if r.backend == "hf_cached":  # its prefill goes in passes of at most PREFILL_TOKENS padded tokens
            from miniverl.rollout import hf_cached

            prompts = min(prompts, max(1, hf_cached.PREFILL_TOKENS // max(p, 1)))
        return (
            rows * columns * kv_per_token,
            int(rows * c.vocab_size * 4 * ROLLOUT_LOGIT_COPIES),
            int(prompts * per_prompt),
        )

    # a step's rows, or the evaluation's (data.eval_prompts greedy rows, one per prompt) when they are more
    eval_rows = -(-cfg.data.eval_prompts // max(cfg.resources.gpus or 1, 1))
    calls = [parts(rows, -(-rows // r.n)), parts(eval_rows, eval_rows)]
    cache, logits, prefill = max(calls, key=sum)
    plan.peak_bytes = weights + adapter_bytes + ROLLOUT_FIXED_BYTES + cache + logits + prefill
    widest = rows if (cache, logits, prefill) == calls[0] else eval_rows
    plan.choice = (
        f"decode cache {widest} rows x {columns:,} tokens = {human(cache)}, sampler logits {human(logits)},"
        f" prefill {human(prefill)}" + ("" if widest == rows else " (the evaluation's rows: more than a step's)")
    )
    if plan.peak_bytes > share:
        fixes = [
            "fewer rows (data.prompts_per_step, rollout.n" + (", data.eval_prompts)" if widest != rows else ")"),
            "shorter ones (data.max_prompt_length, rollout.max_new_tokens)",
            "a larger resources.rollout.num_gpus",
            *(["an NF4 student"] if spec.quantization == "none" else []),
        ]
        plan.problem = (
            f"the {r.backend} rollout's weights, adapter copy, decode cache, sampler logits and prefill come to"
            f" {human(plan.peak_bytes)}, over its {human(share)} share; {', '.join(fixes[:-1])} or {fixes[-1]}"
        )
    return plan


def apply_choices(cfg: MiniVerlConfig, choices: dict) -> None:
    """Set in `cfg` what a plan chose (FitPlan.layout: values by dotted key), so the actors run with it."""
    for key, value in choices.items():
        *path, name = key.split(".")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, name, value)


def card_plan(
    cfg: MiniVerlConfig, objective, paths: dict[str, str], configs: dict, vocab: int, kernels: bool | None = None
) -> FitPlan:
    """plan_fit for models at `paths` with transformers `configs` (by role), on resources.emulate_gpu_gib or this
    machine's GPU. `kernels`: whether the learner and scorer will have the Triton vocabulary passes (None: as this
    machine has them, assumed present when planned from a machine without a GPU)."""
    import torch

    from miniverl.models.vocab_kernels import kernels_available

    sizes = {role: model_size(paths[role], configs[role]) for role in paths}
    on_gpu = torch.cuda.is_available()
    total = torch.cuda.get_device_properties(0).total_memory if on_gpu else None
    if kernels is None:
        kernels = kernels_available() if on_gpu else True
    return plan_fit(cfg, objective, sizes, vocab, card_bytes(cfg, total), kernels)
