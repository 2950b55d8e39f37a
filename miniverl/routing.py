"""Several teachers in one run: which teacher scores a row, the step's metrics per source (the teachers' roles are
the config's: ModelConfig.teacher_roles).

Multi-teacher on-policy distillation (docs/multi_teacher.md): the config names teachers (`model.teachers.<name>`)
and routes rows to them by their verl `data_source` (`model.teacher_by_source`, then `model.default_teacher`;
the config's own checks of those names are ModelConfig.check's, miniverl/config/model.py). This leaf holds the
routing table, the check that every data source seen before Ray has a teacher, and the step metrics per source
and per teacher, for the driver's setup, the scorers and the controller alike. With `model.teachers` empty the
run has one teacher, `model.teacher`, and nothing here changes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miniverl.errors import ConfigError, MiniVerlError


class RoutingError(MiniVerlError):
    """A row's data_source has no teacher: the run stops rather than score it with the wrong one."""


@dataclass(frozen=True)
class TeacherRouting:
    """Which named teacher scores a row: `by_source[data_source]`, else `default` (None: no default)."""

    by_source: dict[str, str]
    default: str | None

    def teacher_of(self, source: str) -> str:
        name = self.by_source.get(source, self.default)
        if name is None:
            known = ", ".join(sorted(self.by_source)) or "none"
            raise RoutingError(
                f"data_source {source!r} has no teacher (model.teacher_by_source routes: {known}; no"
                f" model.default_teacher); add '+model.teacher_by_source.{source}=<teacher>' or set"
                " model.default_teacher=<teacher>"
            )
        return name

    def split(self, data_source: list[str]) -> dict[str, list[int]]:
        """Row indices per teacher, teachers in order of their first row, rows in batch order."""
        out: dict[str, list[int]] = {}
        for i, source in enumerate(data_source):
            out.setdefault(self.teacher_of(source), []).append(i)
        return out


def routing_of(model) -> TeacherRouting | None:
    """The routing of ModelConfig `model`; None for a single-teacher run (model.teachers empty)."""
    if not model.teachers:
        return None
    return TeacherRouting(dict(model.teacher_by_source), model.default_teacher)


def teacher_name(role: str) -> str:
    return role.split(".", 1)[1] if role.startswith("teachers.") else role


def check_sources_routed(routing: TeacherRouting | None, sources: list[str]) -> None:
    """Every data_source seen before training (held-out set, step 0) has a teacher: fails before Ray."""
    if routing is None:
        return
    for source in sorted(set(sources)):
        try:
            routing.teacher_of(source)
        except RoutingError as e:
            raise ConfigError(str(e)) from None


def source_kl_sums(
    data_source: list[str],
    routing: TeacherRouting,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
) -> dict[str, tuple[float, float]]:
    """Per data_source and per teacher: the k1 log-ratio of the sampled tokens summed over their response tokens,
    and the token count, keyed `by_source/<source>` and `by_teacher/<name>`. Computed where the scores are (the
    scorer: workers/teachers.py `source_kl`), so the driver fetches these numbers, not the scores. Sums, not means,
    so the parts of several scorer replicas add up. Shapes: response_mask, rollout_log_probs,
    teacher_log_probs [B, Tr]."""
    mask = response_mask.to(rollout_log_probs.dtype)
    k1 = (rollout_log_probs - teacher_log_probs) * mask  # [B, Tr]
    out: dict[str, tuple[float, float]] = {}

    def add(key: str, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long)
        out[key] = (float(k1[idx].sum()), float(mask[idx].sum()))

    for source in sorted(set(data_source)):
        add(f"by_source/{source}", [i for i, s in enumerate(data_source) if s == source])
    for name, rows in sorted(routing.split(data_source).items()):
        add(f"by_teacher/{name}", rows)
    return out


def source_metrics(
    data_source: list[str],
    routing: TeacherRouting,
    kl_sums: list[dict[str, tuple[float, float]]],
    rewards: torch.Tensor,
) -> dict[str, float]:
    """Per data_source and per teacher: the k1 reverse KL of the sampled tokens, accuracy, rows.

    Keys `by_source/<source>/{reverse_kl,accuracy,rows}` and `by_teacher/<name>/{...}`. `kl_sums`: source_kl_sums
    of each scored part of the batch (added up here); rewards [B]. The KL is the controller's reverse_kl restricted
    to those rows (tokens of the rows pooled, as the overall value; 0 for rows without response tokens).
    """
    out: dict[str, float] = {}

    def add(prefix: str, rows: list[int]) -> None:
        total = sum(part[prefix][0] for part in kl_sums if prefix in part)
        tokens = sum(part[prefix][1] for part in kl_sums if prefix in part)
        out[f"{prefix}/reverse_kl"] = total / max(tokens, 1.0)
        out[f"{prefix}/accuracy"] = float((rewards[torch.tensor(rows, dtype=torch.long)] > 0.5).float().mean())
        out[f"{prefix}/rows"] = float(len(rows))

    for source in sorted(set(data_source)):
        add(f"by_source/{source}", [i for i, s in enumerate(data_source) if s == source])
    for name, rows in sorted(routing.split(data_source).items()):
        add(f"by_teacher/{name}", rows)
    return out
