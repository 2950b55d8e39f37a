"""Will the run fit the card? Each actor's planned GPU memory, from the config and the models' shapes alone.

No weight is read and nothing starts: a model's size comes from its safetensors headers, or, for a model with only
its config.json at hand (a hub id whose weights are not downloaded yet), from the model built on the meta device.
Each actor plans inside its share of the card (its resources.<actor>.num_gpus of the card, less its CUDA context,
as the actors cap themselves: miniverl/process.py emulated_cap_gib), as setup/actor_plans.py says;
where the config leaves the shares or the learner's layout null, setup/layout.py chooses them first.

`python -m miniverl.fit` prints the plan; every GPU run logs the same lines before Ray starts and refuses what the
calibrated models say cannot fit (setup/prepare.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miniverl.config import MiniVerlConfig
from miniverl.errors import ConfigError
from miniverl.models.loading import ModelSize, model_size
from miniverl.models.memory import GIB, human
from miniverl.setup.actor_plans import ActorPlan, learner_plan, rollout_plan, scorer_plan, teacher_sizes
from miniverl.setup.layout import choose_compile, choose_layout, choose_shares


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
        """The modelled peak of the card the actors share, as nvidia-smi sees it: each one's expected reserved peak
        (ActorPlan.reserved_bytes), what its process holds outside torch (outside_bytes) and its CUDA context; a
        scorer on a GPU of its own is not on it."""
        return sum(a.reserved_bytes + a.outside_bytes for a in self.actors if not a.own_gpu) + self.context_bytes

    @property
    def refusals(self) -> list[str]:
        """What the run refuses: the card's problems and those of the calibrated models."""
        return self.problems + [f"{a.role}: {a.problem}" for a in self.actors if a.problem and a.calibrated]

    @property
    def warnings(self) -> list[str]:
        return [f"{a.role}: {a.problem}" for a in self.actors if a.problem and not a.calibrated]

    def record(self) -> dict:
        """The plan in GiB as summary.json keeps it (key "plan"): each actor's share, weights, modelled peak, the size
        it chose and which measured peak the model stands for, the CUDA contexts and the whole card, so a run's
        measured peaks can be set against what it planned (bench/e2e_report.py plan_check)."""
        return {
            "card_gib": self.card_bytes / GIB,
            "contexts": self.contexts,
            "contexts_gib": self.context_bytes / GIB,
            "device_peak_gib": self.device_peak_bytes / GIB,
            "actors": {
                a.role: {
                    "fraction": a.fraction,
                    "share_gib": a.share_bytes / GIB,
                    "weights_gib": a.weight_bytes / GIB,
                    "peak_gib": a.peak_bytes / GIB,
                    "reserved_gib": a.reserved_bytes / GIB,
                    "outside_gib": a.outside_bytes / GIB,
                    "tokens": a.tokens,
                    "calibrated": a.calibrated,
                    "measured_as": a.measured_as,
                    "own_gpu": a.own_gpu,
                }
                for a in self.actors
            },
        }

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
            f" {human(self.device_peak_bytes)} of {human(self.card_bytes)} (as nvidia-smi counts it: what the"
            " allocators reserve and what is outside them)"
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
    from miniverl.models.lora import adapter_params
    from miniverl.process import COLOCATED_CONTEXT_GIB, CUDA_CONTEXT_GIB

    total, source = card
    lora = cfg.model.lora
    adapter = adapter_params(sizes["student"].config, lora.rank, lora.target_modules)  # a meta-device build: once
    cfg, compiled, compile_lines = choose_compile(cfg, sizes["student"], kernels)  # it sizes the learner's activations
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
        learner_plan(cfg, objective, sizes["student"], adapter, vocab, share("learner"), fractions["learner"], kernels),
        scorer_plan(
            cfg,
            objective,
            teacher_sizes(sizes),
            vocab,
            share("scorer"),
            fractions["scorer"],
            kernels,
        ),
        rollout_plan(cfg, sizes["student"], adapter, share("rollout"), fractions["rollout"]),
    ]
    absent = {"scorer"} if cfg.model.teacher_is_self else set()  # no process at all (the learner scores)
    for a in actors:
        if a.share_bytes <= 0 and a.role not in absent:
            a.problem = (
                f"resources.{a.role}.num_gpus={a.fraction:g} of the card is no more than its {CUDA_CONTEXT_GIB} GiB"
                " CUDA context; give it a larger share"
            )
            a.calibrated = True
    for a in actors:
        a.own_gpu = own_scorer_gpu and a.role == "scorer"
    contexts = 1 if res.colocate else sum(not a.own_gpu and a.role not in absent for a in actors)
    context = COLOCATED_CONTEXT_GIB if res.colocate else CUDA_CONTEXT_GIB
    return FitPlan(
        total,
        source,
        actors,
        int(contexts * context * 2**30),
        contexts,
        problems,
        {**compiled, **shares, **layout},
        share_lines + layout_lines + compile_lines,
    )


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


def short_prompts_hint(longest: int, max_prompt_length: int, paged_engine: bool = False) -> str | None:
    """A note for a GPU run whose first prompts are far shorter than data.max_prompt_length: the memory plan sizes the
    rollout's decode cache and prefill, and the scorer's and learner's rows, for prompts of that length
    (lab/results/mopd-gpu.md, 2026-12-06: four teachers' learner got 5,179-token micro-batches planned for 320-token
    prompts where the prompts had 10; at 64 the plan gives it 9,584). It suggests twice the longest prompt in 64-token
    steps, where that is at most half the setting; None otherwise. A paged engine (vLLM, SGLang:
    RolloutConfig.paged_engine) takes its share whatever the prompts, so with one only the learner and scorer gain."""
    suggest = max(64, -(-2 * longest // 64) * 64)  # twice the longest seen, in 64-token steps
    if 2 * suggest > max_prompt_length:  # too little to gain (the default's 32-token plan included)
        return None
    return (
        f"note: the prompts read so far are at most {longest} tokens, and the memory plan is for prompts of"
        f" data.max_prompt_length={max_prompt_length}. If yours stay short, data.max_prompt_length={suggest} plans"
        " for them: "
        + ("" if paged_engine else "a smaller rollout share where the shares are chosen (null), ")
        + "larger learner micro-batches and scorer forwards (a longer prompt is then filtered: metric"
        " data/overlong_filtered)"
    )
