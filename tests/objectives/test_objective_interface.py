"""The objective contract (miniverl/objectives/interface.py): every registered objective meets it, and one that does
not is refused when it is built, naming what it lacks."""

from __future__ import annotations

import types

import pytest

from miniverl.objectives import OBJECTIVES, Objective, SupportObjective, build_objective
from miniverl.objectives.interface import missing_members
from tests.test_config import load


@pytest.mark.parametrize("name", sorted(OBJECTIVES.names()))
def test_every_registered_objective_meets_the_contract(name):
    objective = build_objective(load(f"objective={name}").objective)
    assert isinstance(objective, Objective) and missing_members(objective) == []
    # an objective with per-token terms also gives the fused head's closed-form path its support
    assert isinstance(objective, SupportObjective) == (objective.token_terms is not None)


def test_gkd_has_terms_and_pg_k1_reads_only_sampled_log_probs():
    gkd = build_objective(load("objective=gkd").objective)
    pg = build_objective(load("objective=pg_k1").objective)
    assert gkd.token_terms is not None and gkd.teacher_support_k == 64
    assert pg.token_terms is None and pg.teacher_support_k is None and pg.closed_form_head


def test_an_objective_missing_part_of_the_contract_is_refused_by_name(monkeypatch):
    class Partial:
        """PG-k1's shape without `sampler_tolerance` and `loss`."""

        teacher_support_k, loss_temperature, closed_form_head, token_terms = None, 1.0, True, None
        needs_reference = needs_current_logprobs = False

        @classmethod
        def from_config(cls, cfg):
            return cls()

        def prepare(self, *a, **kw): ...

        def token_loss(self, *a): ...

        def loss_from_terms(self, *a): ...

    monkeypatch.setattr(OBJECTIVES, "get", lambda name: Partial)
    with pytest.raises(TypeError, match=r"objective 'partial' \(Partial\) lacks sampler_tolerance, loss of the"):
        build_objective(types.SimpleNamespace(name="partial"))
    Partial.token_terms = lambda self, logits, scores: logits  # terms, but no support_ids / support_terms
    Partial.sampler_tolerance, Partial.loss = None, lambda self, *a: None
    with pytest.raises(TypeError, match="lacks support_ids, support_terms of the objective contract"):
        build_objective(types.SimpleNamespace(name="partial"))
