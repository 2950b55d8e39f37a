"""RolloutWorker: serves the published policy through one backend and stamps samples with its version."""

from __future__ import annotations

import time

import torch

from miniverl.batches import PromptBatch, RolloutBatch
from miniverl.errors import PolicyMismatchError
from miniverl.models.loading import torch_dtype
from miniverl.models.lora import LoraSettings
from miniverl.policy import PolicyIdentity, PolicySnapshot, ServedPolicy
from miniverl.process import ProcessSettings, gpu_uuid, memory_report, setup_process
from miniverl.rollout import BACKENDS, Completion
from miniverl.rollout.sampling import SamplingParams, row_seeds


class RolloutWorker:
    def __init__(
        self,
        backend: str,
        model_path: str,
        lora: LoraSettings,
        dtype: str,
        process: ProcessSettings,
        backend_options: dict | None = None,
    ) -> None:
        """`backend_options`: extra keyword arguments of that backend (vllm: `settings`), built by the run."""
        self.device = setup_process(process)
        self.backend = BACKENDS.get(backend)(
            model_path=model_path,
            lora=lora,
            dtype=torch_dtype(dtype, self.device),
            device=self.device,
            **(backend_options or {}),
        )
        self.served: PolicyIdentity | None = None
        self.window = (0.0, 0.0)  # wall-clock start and end (epoch s) of the last generate call

    def load_policy(self, snapshot: PolicySnapshot) -> PolicyIdentity:
        """Load the snapshot and serve under its name. No digest here: the probe proves what is served. A
        snapshot left on the learner's GPU (`snapshot.shared`) is copied out of the learner's buffer device to
        device, and finished before this returns: the learner rewrites that buffer at its next publish."""
        self.backend.load_adapter(snapshot.tensors())
        if snapshot.shared is not None:
            # the copies ran on this caller's stream; the device's others may be busy (a colocated learner's update)
            torch.cuda.current_stream().synchronize()
        self.served = snapshot.identity
        return self.served

    def serve(self, snapshot: PolicySnapshot, probe: list[list[int]] | None = None, repeats: int = 1) -> ServedPolicy:
        """Load the snapshot and report what is served now, in one call (miniverl/step/sync.py proves it): the
        name received, the backend's digest of the adapter its serving path reads (`served_digest`), and the
        probe through the serving path `repeats` times (none without a probe; see `_probe_recomposed`)."""
        start = time.perf_counter()
        identity = self.load_policy(snapshot)
        loaded = time.perf_counter()
        digest = self.backend.served_digest()
        digested = time.perf_counter()
        probes = [self._probe_recomposed(probe, i) for i in range(repeats)] if probe else []
        seconds = {
            "load": loaded - start,
            "served_digest": digested - loaded,
            "served_probe": time.perf_counter() - digested,
        }
        return ServedPolicy(identity, digest, probes, seconds)

    def _probe_recomposed(self, probe: list[list[int]], repeat: int) -> list[list[float]]:
        """The probe's log-probs, the repeats after the first computed in another batch make-up (the sequences
        reversed, the first one again at the end: another order and row count), mapped back. The strict-sync change
        test takes two probes of the same weights as the replica's noise floor, and later refreshes probe other
        batches (recent rollouts join the fixed probe). Padding, which moved an fp32 hf_cached's log-probs by
        1.4e-6 nats on the CPU, is gone (`probe_logprobs` scores each length alone); the row count is left, and on
        a GPU a GEMM's rounding may follow its shape: repeats of one make-up would not see that."""
        if repeat == 0:
            return self.probe_logprobs(probe)
        out = self.probe_logprobs([*probe[::-1], probe[0]])
        return out[: len(probe)][::-1]

    def device_uuid(self) -> str | None:
        """The physical GPU this replica serves on (None on the CPU); see LearnerWorker.device_uuid."""
        return gpu_uuid(self.device)

    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The probe through the backend's serving path (see RolloutBackend.probe_logprobs), one call per sequence
        length: a batch pads its shorter sequences, and padding moves their log-probs by rounding, so a sequence
        would score differently beside other company from one refresh to the next (the probe's recent rollouts
        change). Without padding a deterministic replica scores each sequence the same whatever joins it."""
        by_length: dict[int, list[int]] = {}
        for i, seq in enumerate(sequences):
            by_length.setdefault(len(seq), []).append(i)
        out: list[list[float]] = [[] for _ in sequences]
        for rows in by_length.values():
            for i, logprobs in zip(rows, self.backend.probe_logprobs([sequences[i] for i in rows])):
                out[i] = logprobs
        return out

    def probe_tolerance(self) -> float:
        """Nats the served probe may sit from the learner's for this backend and dtype."""
        return self.backend.probe_tolerance

    def generate(self, prompts: PromptBatch, params: SamplingParams, first_row: int = 0) -> RolloutBatch:
        """params.n samples per prompt from the served policy, rows grouped by prompt.

        `first_row` is the index of this call's first row in the whole step (replicas get shards).
        """
        if self.served is None:
            raise PolicyMismatchError("the rollout worker serves no published policy yet; call load_policy first")
        start = time.time()
        seeds = row_seeds(params.seed, len(prompts) * params.n, first_row)
        completions = self.backend.generate(prompts.prompt_ids, params, seeds)
        batch = to_rollout_batch(prompts, completions, params.n, self.served.version)
        self.window = (start, time.time())
        return batch

    def busy_window(self) -> tuple[float, float]:
        """When the last generate call ran (wall-clock epoch seconds, this host's clock): the controller
        measures how long a rollout overlapped the learner's update (trainer.staleness=1)."""
        return self.window

    def memory(self) -> dict[str, float]:
        return memory_report(self.device)


def to_rollout_batch(prompts: PromptBatch, completions: list[Completion], n: int, version: int) -> RolloutBatch:
    """Left-pad prompts, right-pad responses, mask every sampled token up to and including the stop token."""
    b = len(prompts) * n
    if len(completions) != b:
        raise ValueError(f"backend returned {len(completions)} completions for {len(prompts)} prompts x n={n}")
    tp = max(map(len, prompts.prompt_ids))
    tr = max(1, max(len(c.token_ids) for c in completions))
    batch = {
        "prompts": torch.zeros((b, tp), dtype=torch.long),
        "prompt_mask": torch.zeros((b, tp), dtype=torch.long),
        "responses": torch.zeros((b, tr), dtype=torch.long),
        "response_mask": torch.zeros((b, tr), dtype=torch.long),
        "rollout_log_probs": torch.zeros((b, tr), dtype=torch.float32),
    }
    for row, c in enumerate(completions):
        p = prompts.prompt_ids[row // n]
        batch["prompts"][row, tp - len(p) :] = torch.tensor(p)
        batch["prompt_mask"][row, tp - len(p) :] = 1
        k = len(c.token_ids)
        batch["responses"][row, :k] = torch.tensor(c.token_ids, dtype=torch.long)
        batch["response_mask"][row, :k] = 1
        batch["rollout_log_probs"][row, :k] = torch.tensor(c.logprobs, dtype=torch.float32)
    if prompts.teacher_prompt_ids is not None:  # the same left padding, at the teacher prompts' own width
        tq = max(map(len, prompts.teacher_prompt_ids))
        batch["teacher_prompts"] = torch.zeros((b, tq), dtype=torch.long)
        batch["teacher_prompt_mask"] = torch.zeros((b, tq), dtype=torch.long)
        for row in range(b):
            q = prompts.teacher_prompt_ids[row // n]
            batch["teacher_prompts"][row, tq - len(q) :] = torch.tensor(q)
            batch["teacher_prompt_mask"][row, tq - len(q) :] = 1
    return RolloutBatch(
        **batch,
        uid=[u for u in prompts.uid for _ in range(n)],
        ground_truth=[a for a in prompts.ground_truth for _ in range(n)],
        policy_version=version,
        finished=torch.tensor([c.finished for c in completions], dtype=torch.bool),
        data_source=[s for s in prompts.data_source for _ in range(n)],
        extra_info=[e for e in prompts.extra_info for _ in range(n)],
    )
