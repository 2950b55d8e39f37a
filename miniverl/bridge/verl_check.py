"""Checks of exported files by verl itself, run with the verl virtualenv's python (scripts/make_verl_venv.sh).

    python -m miniverl.bridge.verl_check config EXPORT_DIR [PROBES.json]   compose + validate the overrides with
                                                   verl's config; score probe rows with the exported reward
    python -m miniverl.bridge.verl_check prompts EXPORT_DIR TOKENIZER_DIR   verl's tokens of the exported prompts
    python -m miniverl.bridge.verl_check dataproto BATCH_DIR    build a verl DataProto from a batch directory
    python -m miniverl.bridge.verl_check algos BATCH_DIR OUT    verl's kl_penalty and GRPO advantages -> OUT

Each prints one JSON object. It imports only the bridge modules that need torch and safetensors, so it
runs beside verl's own pins (tests/bridge/test_verl_backed.py calls it as a subprocess).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

KL_KINDS = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")


def _stub_vllm_lora_rank_check() -> None:
    """verl's validate_config imports vLLM to look up its LoRA ranks; vLLM needs CUDA and is not installed
    here. Stand in for that one import with verl's own fallback bound (ranks up to 512)."""
    try:
        import vllm  # noqa: F401

        return
    except ImportError:
        pass
    from miniverl.bridge.checks import VLLM_MAX_LORA_RANK

    def get_vllm_max_lora_rank(lora_rank: int) -> int:
        if not 0 < lora_rank <= VLLM_MAX_LORA_RANK:
            raise ValueError(f"lora_rank must be in (0, {VLLM_MAX_LORA_RANK}], got {lora_rank}")
        return lora_rank

    module = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    module.get_vllm_max_lora_rank = get_vllm_max_lora_rank
    sys.modules[module.__name__] = module


# (data_source, response, ground truth) rows the exported reward is probed with when no probe file is given
DEFAULT_PROBES = [["reverse", "cba", "cba"], ["reverse", "cb", "cba"], ["reverse", "cba ", "cba"]]


def check_config(export_dir: str, probes_file: str | None = None) -> dict:
    import verl
    import yaml
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from miniverl.bridge.translate import flatten, hydra_value

    overrides = flatten(yaml.safe_load((Path(export_dir) / "verl_overrides.yaml").read_text()))
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=[f"{k}={hydra_value(v)}" for k, v in overrides.items()])
    _stub_vllm_lora_rank_check()
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    # The dataclass configs run their own checks on construction (distillation pool, loss mode, ...).
    built = {}
    for key in ("algorithm", "distillation", "actor_rollout_ref.rollout", "actor_rollout_ref.actor"):
        built[key] = type(omega_conf_to_dataclass(OmegaConf.select(cfg, key))).__name__
    # verl loads the exported reward file itself and calls it the way its naive reward manager does; its
    # own default_compute_score scores the same rows where it knows the data_source (None where it does not)
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.reward_score import default_compute_score

    reward = get_custom_reward_fn(cfg)
    probes = json.loads(Path(probes_file).read_text()) if probes_file else DEFAULT_PROBES
    probe, verl_default = [], []
    for source, text, truth in probes:
        probe.append(reward(data_source=source, solution_str=text, ground_truth=truth, extra_info={"num_turns": None}))
        try:
            verl_default.append(float(default_compute_score(source, text, truth)))
        except NotImplementedError:
            verl_default.append(None)
    composed = {k: OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(cfg, k)}))["v"] for k in overrides}
    return {
        "ok": True,
        "verl_version": verl.__version__,
        "dataclasses": built,
        "composed": composed,
        "need_critic": need_critic(cfg),
        "need_reference_policy": need_reference_policy(cfg),
        "reward_probe": probe,
        "verl_default_probe": verl_default,
    }


def check_prompts(export_dir: str, tokenizer_dir: str) -> dict:
    """The exported training prompts as verl tokenizes them: its RLHFDataset reads data/train.parquet and
    its chat-template code renders each row with the exported custom_chat_template (set on the tokenizer,
    as verl's agent loop does), or with the tokenizer's own template when the export sets none."""
    import tempfile

    import yaml
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.tokenizer.chat_template import apply_chat_template, normalize_token_ids

    from miniverl.bridge.translate import flatten

    ov = flatten(yaml.safe_load((Path(export_dir) / "verl_overrides.yaml").read_text()))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if ov["actor_rollout_ref.model.custom_chat_template"] is not None:  # as verl's agent loop sets it
        tok.chat_template = ov["actor_rollout_ref.model.custom_chat_template"]
    data_cfg = {"max_prompt_length": ov["data.max_prompt_length"], "truncation": ov["data.truncation"]}
    with tempfile.TemporaryDirectory() as cache:
        dataset = RLHFDataset(ov["data.train_files"], tok, OmegaConf.create({**data_cfg, "cache_dir": cache}))
        rows = [dataset[i] for i in range(len(dataset))]
    return {
        "uid": [r["extra_info"]["uid"] for r in rows],
        "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
        "prompt_ids": [normalize_token_ids(apply_chat_template(tok, list(r["raw_prompt"]))) for r in rows],
    }


def check_dataproto(batch_dir: str) -> dict:
    from miniverl.bridge.batches import to_dataproto

    proto = to_dataproto(batch_dir)
    return {
        "type": type(proto).__module__ + "." + type(proto).__name__,
        "len": len(proto),
        "tensors": {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in proto.batch.items()},
        "non_tensors": {k: [str(x) for x in v] for k, v in proto.non_tensor_batch.items()},
        "meta_info": proto.meta_info,
    }


def check_algos(batch_dir: str, out: str) -> dict:
    """verl's core_algos on the exported tensors: kl_penalty(old_log_probs, ref_log_prob) per estimator and
    compute_grpo_outcome_advantage(token_level_rewards, response_mask, uid), saved as safetensors to `out`."""
    import numpy as np
    from safetensors.torch import save_file
    from verl.trainer.ppo import core_algos

    from miniverl.bridge.batches import load_tensors

    t, manifest = load_tensors(batch_dir)
    results = {
        f"kl_{kind}": core_algos.kl_penalty(t["old_log_probs"], t["ref_log_prob"], kind).contiguous()
        for kind in KL_KINDS
    }
    uid = np.array(manifest["non_tensors"]["uid"], dtype=object)
    for norm in (True, False):
        adv, _returns = core_algos.compute_grpo_outcome_advantage(
            t["token_level_rewards"], t["response_mask"], uid, norm_adv_by_std_in_grpo=norm
        )
        results[f"grpo_norm_{norm}"] = adv.contiguous()
    save_file(results, out)
    return {"written": sorted(results)}


def main(argv: list[str]) -> int:
    commands = {"config": check_config, "prompts": check_prompts, "dataproto": check_dataproto, "algos": check_algos}
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(commands[argv[0]](*argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
