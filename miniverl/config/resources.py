"""The resources section: the device, the GPUs and each actor's share of one, colocation and weight sync."""

from __future__ import annotations

from dataclasses import dataclass, field

from miniverl.config.base import require

# The shares where no plan chose them: a run that computes on the CPU, where the fractions only count Ray's GPU
# resources (the scale-out tests' logical GPUs), and the verl bridge's placement arithmetic. A GPU run plans its own
# (setup/layout.py choose_shares).
UNPLANNED_SHARES = {"rollout": 0.4, "scorer": 0.3, "learner": 0.3}


@dataclass
class ActorResources:
    # Fraction of one GPU (used only when resources.device resolves to cuda). null: chosen before Ray from the
    # models' shapes and the card, and printed with why (setup/layout.py choose_shares).
    num_gpus: float | None = None
    num_cpus: float = 0.5

    def check(self, key: str) -> None:
        """`key`: which actor's resources these are (resources.rollout, ...), as the message names it."""
        require(
            (self.num_gpus is None or self.num_gpus >= 0) and self.num_cpus >= 0,
            f"{key}: num_gpus (null: chosen) and num_cpus must be >= 0",
        )


WEIGHT_SYNC = ("auto", "host")  # resources.weight_sync: how the adapter reaches the rollout replicas


@dataclass
class ResourcesConfig:
    device: str = "auto"  # auto (cuda when visible to the driver) | cpu | cuda
    # GPUs of one host to spread over, one Ray placement bundle each; the one-GPU layout (a rollout, a
    # scorer and a learner rank sharing the GPU by the fractions below) repeats on every GPU.
    # None: 1 when CUDA is visible, else 0 (no GPU resources asked).
    gpus: int | None = None
    # 0: a scorer replica shares every GPU above. M > 0: M more GPUs of the same host hold one scorer
    # replica each (the teacher gets a whole GPU), and the shared GPUs hold only rollout and learner.
    scorer_gpus: int = 0
    ray_address: str | None = None  # None starts a local Ray cluster
    dashboard: bool = True  # start the Ray dashboard when the installed Ray has it
    # Torch threads per actor; 0 = half the cores, at least one (all-core pools fight each other and any other work
    # on the machine: cluster/launch.py::actor_threads).
    torch_threads: int = 0
    emulate_gpu_gib: float | None = None  # cap each actor at num_gpus * this many GiB (16 = RTX 4080)
    # How the learner's adapter reaches the rollout replicas at a refresh: auto = left in the learner's GPU
    # memory and copied device to device (CUDA IPC) when every replica shares the learner's GPU, else through
    # the host; host = always CPU copies through Ray's object store (miniverl/step/sync.py).
    weight_sync: str = "auto"
    # true: the rollout replica, the scorer and the learner run in ONE actor process, each role on its own CUDA
    # stream and thread, so their kernels can run at once (trainer.staleness=1 overlaps the next rollout with the
    # update) and the GPU holds one CUDA context instead of three (cluster/colocate.py). One GPU, HF rollouts.
    colocate: bool = False
    # With colocate: the colocated process's Python thread switch interval in ms (sys.setswitchinterval). Its roles
    # share one interpreter, so a role whose thread wants the GIL while another role runs Python waits up to this
    # long (with trainer.staleness=1 the rollout's decode loop beside the learner's launch-bound update). None:
    # Python's 5 ms. Refused without colocate (separate actors each run one role).
    switch_interval_ms: float | None = None
    # Each actor's share of the GPU (num_gpus); null shares are chosen before Ray for this card and these models:
    # the HF rollout its modelled peak + 10%, vLLM 0.4, the learner the least share holding 16k-token micro-batches
    # (short of what leaves the scorer 8,000-token forwards), the scorer the rest (setup/layout.py choose_shares;
    # `python -m miniverl.fit` prints them). Set them to place the actors yourself; a share you set is kept and the
    # null ones divide what it leaves.
    rollout: ActorResources = field(default_factory=ActorResources)
    scorer: ActorResources = field(default_factory=ActorResources)
    learner: ActorResources = field(default_factory=ActorResources)

    def check(self) -> None:
        """The placement's own values. The checks against prompt groups, the rollout backend and compiled layers
        are check_combinations'."""
        require(self.device in ("auto", "cpu", "cuda"), "resources.device must be auto, cpu or cuda")
        threads = self.torch_threads
        require(threads >= 0, f"resources.torch_threads={threads}: use 0 (half the cores) or a thread count >= 1")
        require(
            self.weight_sync in WEIGHT_SYNC,
            f"resources.weight_sync={self.weight_sync!r}: use auto (on the GPU when the rollout shares the"
            " learner's GPU) or host (CPU copies)",
        )
        g, sg = self.gpus, self.scorer_gpus
        require(g is None or g >= 0, f"resources.gpus={g}: use null (auto), 0 (CPU only) or a GPU count")
        require(sg >= 0, f"resources.scorer_gpus={sg}: use 0 (scorer shares each GPU) or a GPU count")
        if self.colocate:
            require(
                (g is None or g <= 1) and sg == 0,
                f"resources.colocate=true puts one rollout replica, scorer and learner in one process on one GPU,"
                f" but resources.gpus={g} and resources.scorer_gpus={sg} ask for more; set resources.gpus=1 (or"
                " null) and resources.scorer_gpus=0, or resources.colocate=false",
            )
        si = self.switch_interval_ms
        if si is not None:
            require(
                si > 0, f"resources.switch_interval_ms={si}: use a positive interval in ms, or null (Python's 5 ms)"
            )
            require(
                self.colocate,
                f"resources.switch_interval_ms={si} sets how a colocated process's roles take turns with Python, but"
                " resources.colocate=false runs each role in its own process; set resources.colocate=true or drop it",
            )
        require(
            sg == 0 or g != 0,
            f"resources.scorer_gpus={sg} places the teacher on dedicated GPUs, but resources.gpus=0 asks for none;"
            " set resources.gpus >= 1",
        )
        require(
            not (g == 0 and self.device == "cuda"),
            "resources.gpus=0 with resources.device=cuda asks for no GPU; set resources.gpus=1 (or null)",
        )
        for name in ("rollout", "scorer", "learner"):
            getattr(self, name).check(f"resources.{name}")
