"""The learner's adapter as the rest of the run sees it: published under its name, probed, swapped for another.

`PolicyPublisher.publish` names the adapter (version and digest) and hands out its weights; the strict-sync probe
(miniverl/served_policy.py) is drawn and scored here, under the learner's own adapter or a trial snapshot's
(the conformance gate's); `swapped` puts another adapter in for a block (a trial's, a published version's for the
sampler-gap check, workers/sampler_gap.py). The learner (workers/learner.py) holds one and keeps the version count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from miniverl.models.logprobs import sequence_logprobs
from miniverl.models.lora import adapter_state, check_adapter_names, live_adapter
from miniverl.policy import FlatCopy, PolicyIdentity, PolicySnapshot, weights_digest
from miniverl.served_policy import PROBE_TOKENS, draw_probe

if TYPE_CHECKING:
    from peft import PeftModel


class PolicyPublisher:
    def __init__(self, model: PeftModel, params: list[torch.nn.Parameter]) -> None:
        """`model`: the learner's student with its adapter; `params`: the adapter's trainable parameters."""
        self.model = model
        self.params = params
        self._outbox: FlatCopy | None = None  # the adapter's own tensors and the flat buffer it is published in

    def publish(
        self, version: int, include_weights: bool, on_device: bool
    ) -> tuple[PolicySnapshot, dict[str, torch.Tensor]]:
        """The policy's snapshot (see LearnerWorker.publish_policy) under `version` and the adapter's digest, and
        the adapter's CPU copies the learner keeps for the sampler-gap check (those of the snapshot when it
        carries them). O(adapter) work: one multi-tensor copy into the buffer and its digest, on the adapter's
        device."""
        outbox = self.adapter_outbox()
        digest = outbox.digest()  # waits for the copy: a replica mapping the buffer reads finished bytes
        weights = outbox.cpu_copies() if include_weights and not on_device else {}
        kept = weights or outbox.cpu_copies()
        identity = PolicyIdentity(version, digest)
        return PolicySnapshot(identity, weights, outbox.shared() if include_weights and on_device else None), kept

    def adapter_outbox(self) -> FlatCopy:
        """The adapter's own tensors (no copy) and the flat buffer they are published in, found once: peft's
        get_peft_model_state_dict walks every module of the model (40-70 ms of Python at the 0.5B shape with r32
        on every linear layer, measured on the CPU), while the tensors stay the same ones (the optimizer and
        load_adapter_state write them in place). Found again should a parameter's storage ever be replaced, so
        the digest always names what the model computes with."""
        storage = {p.data_ptr() for p in self.params}
        if self._outbox is None or any(t.data_ptr() not in storage for t in self._outbox.tensors.values()):
            self._outbox = FlatCopy(live_adapter(self.model))
        return self._outbox

    def probe_sequences(self) -> list[list[int]]:
        """The run's fixed strict-sync probe, drawn from this student's vocabulary (miniverl/served_policy.py)."""
        cfg = self.model.get_base_model().config
        return draw_probe(cfg.vocab_size, getattr(cfg, "max_position_embeddings", PROBE_TOKENS))

    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The learner's log-probs of the probe under the current policy (peft model, eval mode, no grad)."""
        self.model.eval()  # update() sets train mode again; LoRA dropout must not touch the probe
        return sequence_logprobs(self.model, sequences)

    def trial_snapshot(self, seed: int, std: float) -> PolicySnapshot:
        """A non-zero adapter for the conformance gate (lora_B ~ N(0, std), lora_A as trained), under a
        name no published policy carries (version -1). The learner's own adapter is unchanged: at v0
        lora_B is 0, where a wrong merge or a dropped adapter term serves exactly what it should."""
        g = torch.Generator().manual_seed(seed)
        weights = {
            k: (torch.randn(v.shape, generator=g) * std).to(v.dtype) if "lora_B" in k else v
            for k, v in sorted(adapter_state(self.model).items())
        }
        return PolicySnapshot(PolicyIdentity(-1, weights_digest(weights)), weights)

    def probe_logprobs_with(self, snapshot: PolicySnapshot, sequences: list[list[int]]) -> list[list[float]]:
        """probe_logprobs under another adapter (a trial snapshot's), then the learner's own is put back."""
        with self.swapped(snapshot.weights):
            return self.probe_logprobs(sequences)

    @contextmanager
    def swapped(self, weights: dict[str, torch.Tensor], partial: bool = False) -> Iterator[None]:
        """The model under another adapter (a trial snapshot's, a published version's; with `partial`, only the
        named tensors replaced) inside the block; the learner's own adapter is put back afterwards, also when the
        block raises. One multi-tensor copy each way into the adapter's own tensors: no module walk, and the
        learner's own values stay on its device."""
        live = self.adapter_outbox().tensors
        check_adapter_names(live, weights, partial)
        names = sorted(weights)
        targets = [live[k] for k in names]
        with torch.no_grad():
            own = [t.clone() for t in targets]
            torch._foreach_copy_(targets, [weights[k].to(t.device, t.dtype) for k, t in zip(names, targets)])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(targets, own)
