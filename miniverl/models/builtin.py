"""The embedded default models: a teacher and a smaller student trained on a built-in task by our own code.

No machine here reaches a model hub, so the default experiment distils between two tiny Qwen2-architecture
models built from a `transformers` config. The teacher is trained to high accuracy; the student gets a
short warm-up so that it starts partly competent (on-policy distillation needs samples that resemble the
task). Both are cached under `<cache_dir>/builtin/<task>-<key>/`, where the key hashes everything
that determines the weights, so changing the task or the recipe builds new models instead of reusing
stale ones. `python scripts/build_models.py` builds them ahead of time; the main job builds them on
first use, unless the package ships them: `miniverl/models/shipped/<key>/<role>/` holds the models of the
default experiments' recipes at the precision they are stored in (fp16 values; loaded as fp32), with their build
record, so a first run on a small machine starts in seconds. `python scripts/build_models.py --ship` rebuilds those
and `--check` compares a fresh build with them.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from miniverl.data.tasks import Example, draw_examples, task_names

BUILD_RECIPE_VERSION = 2  # bump when the training code changes what it produces (2: early stop, fp16 storage)
MAX_POSITIONS = 64  # longest prompt + answer of the built-in tasks is far below this
# One thread: a step of these tiny models is 0.18 s with 1 thread and 0.16 s with 2 on idle cores, but 0.31 s
# against 0.79 s beside two busy processes (OpenMP threads wait on each other; lab/results/default-run-cpu.md).
BUILD_THREADS = 1
STORAGE_DTYPE = torch.float16  # weights are rounded to it before the accuracy is measured and the model is saved
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")  # what save_pretrained writes
CHECK_EXAMPLES = 128  # a check of the early stop: ~0.2 s on one core
RECORDED_LOSSES = 10  # the build record keeps the first steps' losses: a test retrains them to show the recipe holds


@dataclass(frozen=True)
class ArchSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class SftSpec:
    steps: int  # per task: a mixture of k tasks (data.task=reverse+sort) trains k x steps, so each task sees as much
    batch_size: int
    lr: float
    seed: int
    # Every `check_every` steps the greedy accuracy on CHECK_EXAMPLES fresh problems; training stops once it reaches
    # `stop_accuracy` (None: never, the whole schedule runs).
    stop_accuracy: float | None = None
    check_every: int = 100


# Sized so both build in well under 3 minutes on 2 CPU cores (measured: lab/results/default-run-cpu.md).
TEACHER_ARCH = ArchSpec(128, 4, 4, 2, 384)
STUDENT_ARCH = ArchSpec(64, 2, 4, 2, 192)
TEACHER_SFT = SftSpec(steps=1200, batch_size=64, lr=3e-3, seed=1, stop_accuracy=1.0)
STUDENT_SFT = SftSpec(steps=250, batch_size=64, lr=3e-3, seed=2)


@dataclass(frozen=True)
class BuiltinRecipe:
    task: str
    min_len: int
    max_len: int
    teacher_arch: ArchSpec = TEACHER_ARCH
    student_arch: ArchSpec = STUDENT_ARCH
    teacher_sft: SftSpec = TEACHER_SFT
    student_sft: SftSpec = STUDENT_SFT
    version: int = BUILD_RECIPE_VERSION

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return f"{self.task}-{hashlib.sha256(blob).hexdigest()[:12]}"


BUILD_REPORT_SECONDS = 5.0  # a progress line at least this often while a model builds (a busy box took 30 min)
BUILTIN_PREFIX = "builtin:"
BUILTIN_ROLES = ("teacher", "student")
TASK_SEPARATOR = "/"  # builtin:teacher/sort = the built-in teacher of data.task=sort (several teachers per run)


def parse_builtin_ref(path: str, default_task: str, field: str = "model path") -> tuple[str, str] | None:
    """`builtin:<role>[/<task>]` -> (role, task), the task defaulting to data.task; None for any other path."""
    from miniverl.data.tasks import TASKS, task_names
    from miniverl.errors import ConfigError

    if not path.startswith(BUILTIN_PREFIX):
        return None
    role, _, task = path[len(BUILTIN_PREFIX) :].partition(TASK_SEPARATOR)
    if role not in BUILTIN_ROLES or (TASK_SEPARATOR in path and not task):
        raise ConfigError(
            f"{field}={path!r}: built-in models are builtin:student and builtin:teacher (of data.task), or"
            f" builtin:<role>/<task> for another task's model (e.g. builtin:teacher/sort)"
        )
    for name in task_names(task or default_task):
        if name not in TASKS:
            raise ConfigError(f"{field}={path!r}: no built-in task {name!r}; known: {', '.join(TASKS.names())}")
    return role, task or default_task


def builtin_dir(cache_dir: str | Path, recipe: BuiltinRecipe) -> Path:
    return Path(cache_dir).expanduser() / "builtin" / recipe.key()


def ensure_builtin_models(
    cache_dir: str | Path,
    recipe: BuiltinRecipe,
    log=print,
    roles: tuple[str, ...] = BUILTIN_ROLES,
    use_shipped: bool = True,
) -> dict[str, Path]:
    """Return {"teacher": dir, "student": dir}: whatever of `roles` is missing from the cache is copied from the
    shipped models when the package has this recipe's (and `use_shipped`), and built otherwise."""
    root = builtin_dir(cache_dir, recipe)
    paths = {role: root / role for role in BUILTIN_ROLES}
    for role in roles:
        if (paths[role] / "build.json").exists():
            continue
        shipped = shipped_dir(recipe, role)
        if use_shipped and (shipped / "build.json").exists():
            install_shipped(shipped, paths[role])
            log(
                f"[miniverl] the built-in {role} for task {recipe.task!r} ships with miniverl (cached in {paths[role]})"
            )
            continue
        log(f"[miniverl] building the built-in {role} for task {recipe.task!r} (cached in {paths[role]})")
        build_model(paths[role], recipe, *role_spec(recipe, role), log)
    return paths


def role_spec(recipe: BuiltinRecipe, role: str) -> tuple[ArchSpec, SftSpec]:
    return (recipe.teacher_arch, recipe.teacher_sft) if role == "teacher" else (recipe.student_arch, recipe.student_sft)


def shipped_dir(recipe: BuiltinRecipe, role: str) -> Path:
    return SHIPPED_DIR / recipe.key() / role


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_model(target: Path, recipe: BuiltinRecipe, arch: ArchSpec, sft: SftSpec, log=print) -> None:
    """Train one model of `arch` on the recipe's task with `sft` and save it (with the tokenizer) to `target`."""
    from transformers import AutoTokenizer

    from miniverl.atomic import atomic_dir
    from miniverl.models.tokenizer import save_char_tokenizer

    # another process building the same model may finish first: its copy is kept (keep_existing)
    with atomic_dir(target, keep_existing=True) as tmp, torch_threads(BUILD_THREADS):
        save_char_tokenizer(tmp)
        tok = AutoTokenizer.from_pretrained(str(tmp))
        model = initial_model(tok, arch, sft.seed)
        start = time.perf_counter()
        record = sft_train(model, tok, recipe, sft, log)
        with torch.no_grad():  # the stored precision is the model: accuracy is measured on what is saved
            for param in model.parameters():
                param.copy_(param.to(STORAGE_DTYPE))
        acc = greedy_accuracy(model, tok, recipe, n=256, seed=sft.seed + 1000)
        model.save_pretrained(str(tmp))
        info = {
            "recipe": asdict(recipe),
            "greedy_accuracy": acc,
            "train_seconds": time.perf_counter() - start,
            "threads": BUILD_THREADS,
            **record,
        }
        (tmp / "build.json").write_text(json.dumps(info, indent=2))
        log(
            f"[miniverl] built {target.name}: greedy accuracy {acc:.3f} after {record['steps_run']} steps"
            f" in {info['train_seconds']:.0f}s"
        )


def initial_model(tok, arch: ArchSpec, seed: int):
    """The untrained model a build starts from: a function of the architecture, the tokenizer and the seed."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **asdict(arch),
    )
    return Qwen2ForCausalLM(config)


def install_shipped(shipped: Path, target: Path) -> None:
    """Copy a shipped model (fp16 values) into the cache as the fp32 model a local build saves."""
    from transformers import Qwen2ForCausalLM

    from miniverl.atomic import atomic_dir

    with atomic_dir(target, keep_existing=True) as tmp:
        copy_beside_weights(shipped, tmp)
        Qwen2ForCausalLM.from_pretrained(str(shipped), dtype=torch.float32).save_pretrained(str(tmp))


def ship_model(built: Path, shipped: Path) -> None:
    """Store a built model at its storage precision under `shipped` (what install_shipped reads back)."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(built), dtype=torch.float32)
    if any(not torch.equal(p, p.to(STORAGE_DTYPE).float()) for p in model.parameters()):
        raise ValueError(f"{built} holds weights that {STORAGE_DTYPE} cannot store exactly: rebuild it")
    if shipped.exists():
        shutil.rmtree(shipped)
    shipped.mkdir(parents=True)
    model.to(STORAGE_DTYPE).save_pretrained(str(shipped))
    copy_beside_weights(built, shipped)


def copy_beside_weights(source: Path, target: Path) -> None:
    """Copy what a model directory holds besides what save_pretrained writes: the tokenizer files, the build record."""
    for f in source.iterdir():
        if f.name not in MODEL_FILES:
            shutil.copy2(f, target / f.name)


def _examples(recipe: BuiltinRecipe, rng: random.Random, n: int) -> list[Example]:
    """A mixed recipe (task `reverse+sort`) trains on its tasks in turn, as the run's prompts come."""
    return [ex for _, ex in draw_examples(recipe.task, rng, recipe.min_len, recipe.max_len, n)]


def _sft_batch(tok, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded BOS+prompt+answer+EOS with labels only on answer+EOS. Shapes: 3 x [B, T]."""
    rows, labels = [], []
    for ex in examples:
        p = tok(ex.prompt)["input_ids"]
        a = tok(ex.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    t = max(map(len, rows))
    ids = torch.full((len(rows), t), tok.pad_token_id, dtype=torch.long)
    lab = torch.full((len(rows), t), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(lb)] = torch.tensor(lb)
        mask[i, : len(r)] = 1
    return ids, mask, lab


def sft_train(model, tok, recipe: BuiltinRecipe, sft: SftSpec, log=print, stop_after: int | None = None) -> dict:
    """Supervised training on fresh task examples with AdamW and a cosine schedule with warm-up, until the schedule
    ends or the greedy accuracy reaches `sft.stop_accuracy` (or, to retrace a build's first steps, `stop_after`
    steps). Returns the build record's training part."""
    rng = random.Random(sft.seed)
    steps = sft.steps * len(task_names(recipe.task))  # each task of a mixture gets the single-task budget
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    record = {"steps_run": 0, "first_losses": [], "checks": []}
    started = last = time.monotonic()
    for step in range(steps):
        model.train()
        ids, mask, lab = _sft_batch(tok, _examples(recipe, rng, sft.batch_size))
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        done = record["steps_run"] = step + 1
        if done <= RECORDED_LOSSES:
            record["first_losses"].append(loss.item())
        if done == stop_after:
            break
        now = time.monotonic()
        if now - last >= BUILD_REPORT_SECONDS or done == steps:
            last, took = now, now - started
            left = took / done * (steps - done)
            log(f"[miniverl]   sft step {done}/{steps} loss {loss.item():.3f} ({took:.0f}s, at most ~{left:.0f}s left)")
        if sft.stop_accuracy is not None and done % sft.check_every == 0 and done < steps:
            model.eval()
            accuracy = greedy_accuracy(model, tok, recipe, n=CHECK_EXAMPLES, seed=sft.seed + 2000 + done)
            record["checks"].append({"step": done, "loss": loss.item(), "greedy_accuracy": accuracy})
            if accuracy >= sft.stop_accuracy:
                log(f"[miniverl]   sft stops at step {done}: greedy accuracy {accuracy:.3f} of {CHECK_EXAMPLES}")
                break
    model.eval()
    return record


@torch.no_grad()
def greedy_answers(model, tok, prompts: list[str], max_new_tokens: int) -> list[str]:
    """The model's greedy answer to each prompt (left-padded batch, stops at EOS), decoded."""
    ids = [tok(p)["input_ids"] for p in prompts]
    t = max(map(len, ids))
    batch = torch.full((len(ids), t), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), t), dtype=torch.long)
    for i, row in enumerate(ids):  # left padding for generation
        batch[i, t - len(row) :] = torch.tensor(row)
        mask[i, t - len(row) :] = 1
    out = model.generate(
        input_ids=batch,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return tok.batch_decode(out[:, t:], skip_special_tokens=True)


def greedy_accuracy(model, tok, recipe: BuiltinRecipe, n: int, seed: int) -> float:
    """Exact-match accuracy of greedy answers on `n` fresh examples."""
    examples = _examples(recipe, random.Random(seed), n)
    answers = greedy_answers(model, tok, [ex.prompt for ex in examples], recipe.max_len * 2 + 2)
    return sum(a == ex.answer for a, ex in zip(answers, examples)) / n


def built_accuracy(model_dir: Path) -> float:
    """The greedy accuracy a built-in model reached when it was built (from its build.json)."""
    return float(json.loads((Path(model_dir) / "build.json").read_text())["greedy_accuracy"])


# The best greedy accuracy the built-in teacher recipe reached on a task it cannot learn, at the easiest lengths tried
# (addition of 1-2 digits: 0.76, 30291ee; longer numbers are harder). A build for such a task under a higher
# model.builtin_min_teacher_accuracy ends refused, so it is refused before the build (2 minutes of training).
BUILTIN_TEACHER_CEILING = {"addition": 0.76}


def require_learnable_task(recipe: BuiltinRecipe, threshold: float, cache_dir: str | Path) -> None:
    """Refuse, before any training, a built-in teacher that would be built for a task whose measured ceiling
    (BUILTIN_TEACHER_CEILING) is below `threshold` (model.builtin_min_teacher_accuracy). A teacher already cached or
    shipped is judged by its own recorded accuracy instead (require_competent_teacher)."""
    from miniverl.errors import ConfigError

    ceiling = BUILTIN_TEACHER_CEILING.get(recipe.task)
    if ceiling is None or ceiling >= threshold:
        return
    if (builtin_dir(cache_dir, recipe) / "teacher" / "build.json").exists():
        return
    if (shipped_dir(recipe, "teacher") / "build.json").exists():
        return
    raise ConfigError(
        f"data.task={recipe.task} with a built-in teacher (builtin:teacher): the built-in recipe reaches at most"
        f" {ceiling} greedy accuracy on {recipe.task} (1-2 digits, the easiest lengths tried), below"
        f" model.builtin_min_teacher_accuracy={threshold}, so it is refused before its build (minutes of training);"
        " pass a trained teacher (model.teacher.path=DIR), or use data.task=reverse or sort"
    )


def require_competent_teacher(accuracy: float, threshold: float, recipe: BuiltinRecipe, model_dir: Path) -> None:
    """Refuse a built-in teacher that cannot do its task: distilling from it would teach nothing."""
    from miniverl.errors import ConfigError

    if accuracy < threshold:
        raise ConfigError(
            f"the built-in teacher for data.task={recipe.task} (lengths {recipe.min_len}-{recipe.max_len}) reached"
            f" greedy accuracy {accuracy:.3f}, below model.builtin_min_teacher_accuracy={threshold}: the built-in"
            f" recipe cannot learn this task at this size. It learns data.task=reverse and sort at the default"
            f" lengths (data.min_len=3, data.max_len=8); addition is beyond it at every length tried (1-2 digits"
            f" reached 0.76). Use one of those, or pass a trained teacher (model.teacher.path=DIR); cached in"
            f" {model_dir}"
        )
