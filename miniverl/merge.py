"""`python -m miniverl.merge RUN_OR_CHECKPOINT_DIR OUT_DIR [--dtype stored]`: a run's trained policy as a standalone
model directory (the base student with its LoRA adapter merged in), e.g. a stronger teacher for another run
(`model.teacher.path=OUT_DIR`).

RUN_OR_CHECKPOINT_DIR is a run directory of `python -m miniverl.main` (its newest checkpoint that passes its integrity
check is merged) or one `checkpoints/step_<k>` folder. The base is the student the checkpoint's saved config names
(model.student.path: a built-in model, a directory, a .gguf file or a short name, resolved as a run resolves it). The
adapter must hash to the policy digest the checkpoint recorded, as a resumed run's must. The merge is computed in fp32
on the CPU and saved in `--dtype` (default `stored`: the base's own dtype, from its config.json), with the base's
tokenizer and `build.json` (where it came from, the digest it was proven against, the versions that made it). OUT_DIR
is written atomically and never overwritten. Exit status 0 when written, 2 for a refusal (one line naming the fix).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import sys
import time
from pathlib import Path
from typing import Any

from miniverl.errors import ConfigError, MiniVerlError

ERROR_EXIT_CODE = 2
RECORD_FILE = "build.json"
STORED_DTYPE = "stored"  # --dtype: the base's dtype as its config.json records it
MERGE_DTYPE = "float32"  # W + s B A is computed at full precision, whatever the output's dtype
VERSIONED = ("miniverl", "torch", "transformers", "peft")
WEIGHT_GLOBS = ("*.safetensors", "*.bin")  # the base's weight files, whose SHA-256 build.json records


def log(line: str) -> None:
    print(f"[miniverl] merge: {line}", flush=True)


def find_checkpoint(source: Path) -> Path:
    """The checkpoint folder `source` names: itself when it holds a state.json, else its run's newest checkpoint that
    passes its integrity check (newer corrupt ones are named and skipped)."""
    from miniverl.checkpoints.files import STATE_FILE
    from miniverl.checkpoints.store import CHECKPOINTS_DIR, list_checkpoints, scan

    if not source.is_dir():
        what = "is not a directory" if source.exists() else "does not exist"
        raise ConfigError(
            f"{source} {what}; pass a run directory of python -m miniverl.main (its hydra.run.dir) or one of its"
            f" {CHECKPOINTS_DIR}/step_<k> folders"
        )
    if (source / STATE_FILE).is_file():
        return source
    found = list_checkpoints(source)
    if not found:
        raise ConfigError(
            f"{source} holds no checkpoint (no {CHECKPOINTS_DIR}/step_<k> folder and no {STATE_FILE}); pass a run"
            " directory that saved one (trainer.save_checkpoint=true, every trainer.save_every steps and at the end)"
            f" or a {CHECKPOINTS_DIR}/step_<k> folder"
        )
    path, skipped = scan(source)
    for bad in skipped:
        log(f"skipping a checkpoint that cannot be used: {bad.error}")
    if path is None:
        raise ConfigError(
            f"none of the {len(found)} checkpoints of {source} passes its integrity check (the newest: "
            f"{skipped[0].error.reason}); the run's adapters are lost, train again"
        )
    return path


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT_DIR {out} is a file; pass a new directory for the merged model")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"OUT_DIR {out} exists and is not empty; refusing to overwrite it: pass a new directory")


def saved_models(state: dict[str, Any], where: Path):
    """(ModelConfig, DataConfig) of the checkpoint's saved config, under this miniverl's schema: what resolves the
    student as the run resolved it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from miniverl.config import DataConfig, ModelConfig

    try:
        return tuple(
            OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), state["config"][section]))
            for schema, section in ((ModelConfig, "model"), (DataConfig, "data"))
        )
    except (OmegaConfBaseException, KeyError, TypeError) as e:
        raise ConfigError(
            f"the saved config of checkpoint {where} does not fit this miniverl's schema ({e.__class__.__name__}:"
            f" {str(e).splitlines()[0] if str(e) else e!r}); merge it with the miniverl version that wrote it"
        ) from e


def check_mergeable(model, where: Path) -> None:
    if model.student.quantization != "none":
        raise ConfigError(
            f"checkpoint {where} trained its adapter on a {model.student.quantization} (4-bit) student"
            f" (model.student.quantization={model.student.quantization}): merged into the 4-bit base the weights"
            " would be quantized again (lossy), and merged into the full-precision base they give a model the"
            " adapter was never trained against; serve that run's policy as base + adapter, or train with"
            " model.student.quantization=none to get a checkpoint that merges"
        )


def check_adapter_file(checkpoint: Path, adapter: dict, recorded: str) -> None:
    """The adapter's saved tensors (`adapter`, read from the checkpoint) must carry the digest state.json recorded
    (read_state has checked the files' SHA-256 already: this catches a state.json whose recorded policy is not the
    adapter beside it)."""
    from miniverl.policy import digest_matches

    if not digest_matches(adapter, recorded):
        raise ConfigError(
            f"the adapter of checkpoint {checkpoint} does not hash to the policy digest its state.json recorded"
            f" ({recorded[:16]}...); the checkpoint is corrupt or was edited: merge an older one (pass its"
            " step_<k> folder)"
        )


def out_dtype(choice: str, base: Path) -> str:
    """The dtype name the merged weights are saved in: `choice`, or for `stored` the base's config.json dtype
    (transformers 5 writes `dtype`, older ones `torch_dtype`; a config without either is fp32, from_pretrained's
    default)."""
    from miniverl.models.loading import DTYPES

    if choice != STORED_DTYPE:
        return choice
    config = json.loads((base / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype") or MERGE_DTYPE
    return stored if stored in DTYPES else MERGE_DTYPE


def weight_digests(base: Path) -> dict[str, str]:
    from miniverl.checkpoints.files import file_digest

    files = sorted({f for pattern in WEIGHT_GLOBS for f in base.glob(pattern)})
    return {f.name: file_digest(f.resolve()) for f in files}  # a hub snapshot's files are links into its blobs


def base_record(ref: str, base: Path) -> dict[str, Any]:
    """What build.json says of the base: the config's reference, the directory it resolved to, its weight files'
    SHA-256 and, for a converted GGUF file, the file it came from and that file's SHA-256 (models/gguf.py)."""
    from miniverl.models.gguf import read_record

    record = {"ref": ref, "path": str(base.resolve()), "sha256": weight_digests(base)}
    converted = read_record(base)
    if converted:
        record["converted_from"] = {k: converted.get(k) for k in ("source", "source_sha256")}
    return record


def merge(source: str | Path, out: str | Path, dtype: str = STORED_DTYPE) -> Path:
    """Write the policy of the checkpoint `source` names (find_checkpoint) as a model directory `out`; returns it.

    Every refusal (a missing or empty source, an `out` that holds files, a quantized student, an adapter that does
    not hash to its recorded digest) comes before a model is loaded. `dtype`: stored (the base's) or a DTYPES name.
    """
    from safetensors.torch import load_file

    from miniverl.checkpoints.files import ADAPTER_WEIGHTS
    from miniverl.checkpoints.store import load_valid_state
    from miniverl.models.loading import DTYPES, load_tokenizer
    from miniverl.models.lora import LoraSettings
    from miniverl.setup.prepare import resolve_model_paths

    source, out = Path(source).expanduser(), Path(out).expanduser()
    if dtype != STORED_DTYPE and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use {STORED_DTYPE} (the base's) or one of {', '.join(DTYPES)}")
    check_out_dir(out)
    checkpoint = find_checkpoint(source)
    state = load_valid_state(checkpoint)
    model_cfg, data_cfg = saved_models(state, checkpoint)
    check_mergeable(model_cfg, checkpoint)
    adapter = load_file(str(checkpoint / ADAPTER_WEIGHTS))  # read once: proven here, loaded into the model below
    check_adapter_file(checkpoint, adapter, state["policy_digest"])
    log(f"checkpoint {checkpoint}: step {state['step']}, policy v{state['policy_version']}")

    started = time.perf_counter()
    base = Path(resolve_model_paths(model_cfg, data_cfg, log=log, roles=("student",))["student"])
    saved_as = out_dtype(dtype, base)
    lora = LoraSettings.from_config(model_cfg.lora)
    merged = merged_policy(checkpoint, state, adapter, base, lora).to(DTYPES[saved_as])
    tokenizer = load_tokenizer(str(base), "model.student.path", "re-save the base model's tokenizer")
    record = {
        "source": str(source.resolve()),
        "checkpoint": str(checkpoint.resolve()),
        "step": state["step"],
        "policy_version": state["policy_version"],
        "policy_digest": state["policy_digest"],
        "run_miniverl_version": state.get("miniverl_version"),  # the miniverl that trained it
        "base": base_record(model_cfg.student.path, base),
        "lora": {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)},
        "merged_in": MERGE_DTYPE,
        "dtype": saved_as,
        "versions": {pkg: package_version(pkg) for pkg in VERSIONED},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    log(f"saving the merged model in {saved_as} to {out}")
    write_model(out, merged, tokenizer, record, base)
    size = sum(f.stat().st_size for f in out.iterdir())
    took = time.perf_counter() - started
    log(f"wrote {out} ({size / 1e6:,.1f} MB) in {took:.0f} s; use it as model.teacher.path={out}")
    return out


def merged_policy(checkpoint: Path, state: dict[str, Any], adapter: dict, base: Path, lora):
    """The base at `base` with the checkpoint's `adapter` tensors merged in, in MERGE_DTYPE on the CPU, after the
    restored adapter is proven against the digest the checkpoint recorded (as the learner's load_checkpoint does)."""
    from miniverl.models.loading import DTYPES
    from miniverl.models.lora import build_lora_model, load_adapter_state
    from miniverl.workers.learner_checkpoint import check_restored

    log(f"loading the base {base} in {MERGE_DTYPE} and the adapter (rank {lora.rank}, alpha {lora.alpha})")
    model = build_lora_model(str(base), lora, DTYPES[MERGE_DTYPE], "cpu")
    load_adapter_state(model, adapter)
    identity = check_restored(str(checkpoint), model, int(state["policy_version"]), state["policy_digest"])
    log(f"the restored adapter hashes to the recorded policy {identity.short()}; merging")
    return model.merge_and_unload()


def write_model(out: Path, merged, tokenizer, record: dict[str, Any], base: Path) -> None:
    """`merged`, `tokenizer` and `record` (build.json) into `out` at once (miniverl/atomic.py), after the written
    directory passes what a run checks of model.teacher.path=OUT_DIR: its files, and the tokenizer probe against the
    base's tokenizer."""
    from miniverl.atomic import atomic_dir
    from miniverl.models.hub import check_model_dir
    from miniverl.models.loading import load_tokenizer
    from miniverl.models.tokenizer_match import check_same_tokenizer

    with atomic_dir(out, fsync=True) as tmp:
        merged.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        check_model_dir(tmp, "the merged model", "report it: the merge wrote a directory a run cannot load")
        saved_tok = load_tokenizer(str(tmp), "the merged model", "report it: the merge wrote a broken tokenizer")
        check_same_tokenizer(tokenizer, saved_tok, str(base), str(out), merged.config.vocab_size)
        if out.is_dir():
            out.rmdir()  # the empty directory check_out_dir accepted; one with files in it by now is not removed


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # miniverl run from a checkout without an install
        return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m miniverl.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT_DIR")
    parser.add_argument("out", metavar="OUT_DIR")
    parser.add_argument("--dtype", default=STORED_DTYPE, help="stored (the base's dtype), float32, bfloat16, float16")
    args = parser.parse_args(argv)
    try:
        merge(args.source, args.out, args.dtype)
    except MiniVerlError as e:
        print(f"miniverl.merge: error: {e}", file=sys.stderr)
        return ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
