"""The layout a run gets where its config leaves it null, chosen from the models' shapes and the card before Ray
starts (each choice printed with why): compiled decoder layers (trainer.compile_layers), the actors' shares of the
card (resources.<actor>.num_gpus), the learner's LM-head chunk (trainer.logprob_chunk_tokens) and gradient
checkpointing (trainer.gradient_checkpointing). Each memory candidate is judged by the actors' plans
(setup/actor_plans.py)."""

from __future__ import annotations

from miniverl.errors import ConfigError
from miniverl.models.loading import ModelSize
from miniverl.models.memory import human
from miniverl.setup.actor_plans import (
    learner_enough_tokens,
    learner_plan,
    learner_shape,
    rollout_plan,
    scorer_plan,
    step_rows,
    teacher_sizes,
)

# The shares a run gets where resources.<actor>.num_gpus is null (issue 34: gkd's old fixed 0.4 / 0.3 / 0.3 left the
# rollout 1.2 GiB it did not use at 64 x 4 x 512 and 4.4 GiB at 16 x 1 x 256, while the scorer's 0.3 held forwards of
# 2,386 tokens beside a bf16 1.5B teacher where gkd_4080's 0.35 held 8,080: its scoring took 2.19 s against 1.47 s
# a step; lab/results/peers.md, 2026-12-04, ef71425). In steps of SHARE_STEP of the card:
# - the HF rollout: its modelled peak (the step's or the evaluation's rows, the larger) plus ROLLOUT_SHARE_MARGIN,
#   and its CUDA context, but never more than leaves the learner and the scorer a row each (a rollout too large for
#   the card is then reported over its share with its fixes); vLLM and SGLang, which size their KV caches from
#   whatever their share leaves: vllm_settings.AUTO_SHARE;
# - the learner: the least share whose micro-batches hold actor_plans.CHECKPOINT_FREE_TOKENS tokens or the step's,
#   whichever is less (or an explicit trainer.max_tokens_per_micro_batch): from 16k to 32k tokens a micro-batch
#   trained only 4% faster (lab/results/learner-throughput.md, 2026-12-01); but never so much that the scorer's
#   forwards fall under SCORER_ENOUGH_TOKENS (or the step's) where a smaller learner share leaves them that:
#   2,386-token forwards scored a step in 2.19 s against 1.47 s at 8,080, and 32,768 gained only 4% on 8,080
#   (peers.md, 2026-12-04; decode-profile.md, 2026-12-05), while compiled 12,991-token micro-batches trained within
#   1.5% of the hand-set recipe (peers.md, 2026-12-05, 6c8e93b).
#   Where no share holds what is enough, the learner takes what leaves the scorer that, or one row for it;
# - the scorer: the rest of the card, since its forwards, and the step's scoring with them, grow with its share.
# A share the config sets is kept, and the ones left null divide what it leaves.
ROLLOUT_SHARE_MARGIN = 0.10
SCORER_ENOUGH_TOKENS = 8000
SHARE_STEP = 0.01


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
    if cfg.model.teacher_is_self and "scorer" in unset:  # no scorer process: the learner scores
        chosen["scorer"] = 0
        why["scorer"] = "no scorer: the learner scores with its adapter disabled (model.teacher.path=self)"
    if "rollout" in unset:
        if cfg.rollout.paged_engine:  # their KV cache fills what a share leaves
            chosen["rollout"] = round(AUTO_SHARE * steps)
            why["rollout"] = (
                "vLLM sizes its KV cache from what its share leaves: its default share"
                if cfg.rollout.backend == "vllm"
                else "SGLang sizes its KV pool from what its share leaves: vLLM's default share"
            )
        else:
            peak = rollout_plan(cfg, sizes["student"], adapter, 0, 0.0).peak_bytes
            need = least_steps(peak * (1 + ROLLOUT_SHARE_MARGIN))
            room = steps - sum(kept.get(a, chosen.get(a, least[a])) for a in on_card if a != "rollout")
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
        scorer_enough = fits.scorer_enough(steps)  # the least share whose forwards hold what is enough
        chosen["learner"], why["learner"] = fits.learner_steps(left - least["scorer"], left - scorer_enough)
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
        self.shape = learner_shape(cfg, sizes["student"], adapter, vocab)
        self.teachers = teacher_sizes(sizes)
        self.objective, self.vocab, self.kernels, self.share_bytes = objective, vocab, kernels, share_bytes
        self.longest_row = cfg.longest_row
        self.enough = learner_enough_tokens(cfg)

    def learner_tokens(self, k: int) -> int:
        """The learner's micro-batch tokens in k steps (0: not one row)."""
        from miniverl.models.sizing import fit_tokens

        closed = self.objective.closed_form_head and self.kernels
        try:
            return fit_tokens(self.shape, self.share_bytes(k), self.chunk, self.checkpointing, self.longest_row, closed)
        except ConfigError:
            return 0

    def scorer_tokens(self, k: int) -> int:
        """The scorer's forward tokens in k steps (0: not one row)."""
        plan = scorer_plan(
            self.trial, self.objective, self.teachers, self.vocab, self.share_bytes(k), k * SHARE_STEP, self.kernels
        )
        return plan.tokens

    def scorer_fits(self, k: int) -> bool:
        return self.scorer_tokens(k) > 0

    def scorer_enough(self, steps: int) -> int:
        """The fewest steps whose forwards hold SCORER_ENOUGH_TOKENS or the step's tokens (`steps` when none do)."""
        enough = min(SCORER_ENOUGH_TOKENS, step_rows(self.trial) * self.longest_row)
        return next((k for k in range(1, steps) if self.scorer_tokens(k) >= enough), steps)

    def least(self, role: str, steps: int) -> int:
        """The fewest steps in which `role` holds one row (1 when none does: its plan then names the problem)."""
        holds = self.scorer_fits if role == "scorer" else (lambda k: self.learner_tokens(k) >= self.longest_row)
        return next((k for k in range(1, steps) if holds(k)), 1)

    def learner_steps(self, most: int, polite: int) -> tuple[int, str]:
        """The least share (at most `most` steps, the scorer's one row beside it) whose micro-batches hold what is
        enough, but no more than `polite` steps (what leaves the scorer's forwards enough) where the learner holds
        one row in that; and why."""
        most = max(most, 1)
        holds_row = polite >= 1 and self.learner_tokens(min(polite, most)) >= self.longest_row
        cap = min(polite, most) if holds_row else most
        for k in range(1, cap + 1):
            if self.learner_tokens(k) >= self.enough:
                return k, f"the least share whose micro-batches hold {self.enough:,} tokens"
        short = f"no share holds micro-batches of {self.enough:,} tokens"
        if cap < most:
            return cap, f"what leaves the scorer forwards of {SCORER_ENOUGH_TOKENS:,} tokens: {short} beside them"
        return most, f"all the scorer leaves: {short}"


# The layout a run gets where trainer.logprob_chunk_tokens or trainer.gradient_checkpointing is null (issue 34: a user
# who did not copy the 4080 recipe got 917-token micro-batches, no chunking, and a learner ~5x slower per token):
# - LM-head chunks: none below SMALL_VOCAB (a micro-batch's logits at once are cheap there, as on the built-in models'
#   40-token vocabulary); above it the largest of AUTO_CHUNKS with which the learner and the scorer both fit (1,024
#   tokens was the fastest chunk measured: lab/results/learner-throughput.md, 2026-12-02, and its confirm3);
# - gradient checkpointing: on when it lets the learner's micro-batches grow and they are short without it (under
#   actor_plans.CHECKPOINT_FREE_TOKENS or the step's tokens, or under an explicit trainer.max_tokens_per_micro_batch,
#   as actor_plans.learner_enough_tokens says). Per token
#   it recomputes the forward (~30%), but a micro-batch costs far more when small: 802-token micro-batches without
#   it trained 2.7k tokens/s where 20,072-token ones with it trained 21k; from 16k to 32k tokens a micro-batch
#   gained only 4% (learner-throughput.md's exploratory cells, 2026-12-01).
SMALL_VOCAB = 32768
AUTO_CHUNKS = (1024, 512, 256, 128)
# trainer.compile_layers where it is null: on a GPU with Triton, for a bf16 (or fp32) student of a model type whose
# decoder layers were compiled and checked (the built-in and Qwen2.5 shapes: tests/models/test_compiled.py, and on an
# H200 the 12 GiB recipe and the one-behind runs, separate and colocated, where the compiled learner and the
# rollout's graph captures take turns: lab/results/qlora-4080.md, 2026-12-02 to 12-03, decode-profile.md, 2026-12-04 to
# 12-05). It trained 1.68x eager's tokens/s at the 12 GiB layout's share (learner-throughput.md, 2026-12-03, efc4eff);
# the first update compiles (about 75 s at 0.5B). Elsewhere off, with the reason; trainer.compile_layers=true asks for
# it anyway (a graph break is then an error, not a silent slow path).
COMPILE_TESTED_MODEL_TYPES = ("qwen2",)
# ... and of at least this many decoder (linear-layer) parameters: the measured gain was at the 0.5B shape (~360M of
# them); the built-in models (tens of thousands) train a step in milliseconds, which tens of seconds of compiling
# would not repay in a run of a few hundred steps.
COMPILE_MIN_DECODER_PARAMS = 100_000_000


def _compile_pays(student: ModelSize, quantization: str, kernels: bool) -> tuple[bool, str]:
    """Whether the learner should compile its decoder layers (the rule above), and why (a line's tail)."""
    model_type = getattr(student.config, "model_type", None)
    if not kernels:
        return False, "no Triton on this GPU: Inductor generates its GPU kernels with it"
    if quantization != "none":
        return False, f"model.student.quantization={quantization}: compiling 4-bit layers is untested"
    if model_type not in COMPILE_TESTED_MODEL_TYPES:
        return False, f"compiling {model_type} decoder layers is untested (true tries it)"
    if student.linear_numel < COMPILE_MIN_DECODER_PARAMS:
        small = f"{student.linear_numel:,} decoder parameters"
        return False, f"a small student ({small}): compiling would cost more than it saves"
    return True, f"a {model_type} student on a GPU: about 1.7x eager's tokens/s; the first update compiles"


def _checkpointing_pays(
    objective, shape, share: int, chunk: int, kernels: bool, longest_row: int, enough: int
) -> tuple[bool, str]:
    """Whether the learner should recompute activations, and why (a line's tail): `enough` is the micro-batch it aims
    for (actor_plans.learner_enough_tokens), `longest_row` the longest row a step can produce."""
    from miniverl.models.sizing import fit_tokens

    closed = objective.closed_form_head and kernels
    fits = {}
    for on in (False, True):
        try:
            fits[on] = fit_tokens(shape, share, chunk, on, longest_row, closed)
        except ConfigError:
            fits[on] = 0

    def up_to(tokens: int) -> str:
        return f"up to {tokens:,} tokens" if tokens else "not one row"

    sizes = f"micro-batches of {up_to(fits[False])} without it, {up_to(fits[True])} with it"
    if fits[False] >= enough or fits[False] >= fits[True]:
        return False, f"{sizes}: enough without"
    return True, f"{sizes}: short without"


def choose_compile(cfg, student: ModelSize, kernels: bool):
    """`cfg` with trainer.compile_layers set where it is null (the rule above), the chosen value, and its line.
    Chosen before the shares and the memory layout: compiled layers hold more activations a token
    (models/sizing.py), so the learner's share and micro-batches depend on it."""
    import dataclasses

    t = cfg.trainer
    if t.compile_layers is not None:
        return cfg, {}, []
    compiled, why = _compile_pays(student, cfg.model.student.quantization, kernels)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(t, compile_layers=compiled))
    return (
        cfg,
        {"trainer.compile_layers": compiled},
        [f"  trainer.compile_layers={str(compiled).lower()} (chosen: {why})"],
    )


def choose_layout(
    cfg, objective, sizes: dict[str, ModelSize], adapter: int, vocab: int, share, fractions: dict, kernels: bool
):
    """`cfg` with trainer.logprob_chunk_tokens and trainer.gradient_checkpointing set where they are null (the rules
    above), the chosen values, and a line for each value chosen. `share(role)`: an actor's share in bytes;
    `kernels`: whether the learner's GPU has Triton."""
    import dataclasses

    t, layout, lines = cfg.trainer, {}, []
    if t.logprob_chunk_tokens is not None and t.gradient_checkpointing is not None:
        return cfg, layout, lines
    shape = learner_shape(cfg, sizes["student"], adapter, vocab)
    longest_row, enough = cfg.longest_row, learner_enough_tokens(cfg)
    if t.logprob_chunk_tokens is not None:
        chunks = [t.logprob_chunk_tokens]
    else:
        chunks = [0] if vocab < SMALL_VOCAB else list(AUTO_CHUNKS)
    teachers = teacher_sizes(sizes)
    for chunk in chunks:  # the largest chunk with which both fit; else the smallest (its plan says what does not)
        checkpointing, why = t.gradient_checkpointing, None
        if checkpointing is None:
            checkpointing, why = _checkpointing_pays(
                objective, shape, share("learner"), chunk, kernels, longest_row, enough
            )
        trial = dataclasses.replace(
            cfg, trainer=dataclasses.replace(t, logprob_chunk_tokens=chunk, gradient_checkpointing=checkpointing)
        )
        learner = learner_plan(
            trial, objective, sizes["student"], adapter, vocab, share("learner"), fractions["learner"], kernels
        )
        scorer = scorer_plan(trial, objective, teachers, vocab, share("scorer"), fractions["scorer"], kernels)
        fits = learner.problem is None and scorer.problem is None
        if fits:
            break
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
