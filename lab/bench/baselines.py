"""What a user would run instead of miniVERL, measured in the same bench call: plain vLLM and HF generate.

These are bench-only backends (not in miniverl.rollout.BACKENDS, not selectable by `rollout=`). They take
the same prompts, adapter and lengths as the product's backends; the knobs a variant turns are keyword
arguments from the bench file's `attributes`.
"""

from __future__ import annotations

import os

import torch

from miniverl.models.lora import LoraSettings, adapter_state, build_lora_model, load_adapter_state
from miniverl.rollout import Completion
from miniverl.rollout.hf_reference import left_pad
from miniverl.rollout.sampling import SamplingParams


class RawVllm:
    """`vllm.LLM.generate` used plainly: the adapter as a LoRA request, no strict-sync bookkeeping.
    `logprobs=False` skips the sampled-token log-probs (then the oracle cannot judge the cell). `seeding="none"`
    (the default, what a plain user runs): one unseeded request per prompt with n samples, vLLM's batched sampler;
    "row": the product's one seeded request per row; "prompt": one request per prompt seeded by its first row's
    seed (miniverl.rollout.vllm.sampling_requests)."""

    def __init__(
        self,
        model_path: str,
        lora: LoraSettings,
        dtype: torch.dtype,
        device: str,
        max_num_seqs: int,
        max_model_len: int,
        logprobs: bool = True,
        enforce_eager: bool = False,
        engine_process: str = "inprocess",
        async_scheduling: bool = False,
        gpu_memory_utilization: float = 0.5,
        seeding: str = "none",
    ) -> None:
        from miniverl.rollout.vllm import REQUEST_SEEDINGS

        if seeding not in REQUEST_SEEDINGS:
            raise ValueError(f"raw_vllm seeding={seeding!r}: use none (vLLM's batched sampler), row or prompt")
        self.seeding = seeding
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if engine_process == "inprocess" else "1"
        from vllm import LLM

        from miniverl.models.lora import adapter_template
        from miniverl.rollout.vllm_settings import AdapterStore, adapter_config, vllm_lora_rank

        self.logprobs = logprobs
        self.lora = lora
        self.model_path = model_path
        self.llm = LLM(
            model=model_path,
            skip_tokenizer_init=True,
            dtype=str(dtype).removeprefix("torch."),
            enforce_eager=enforce_eager,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            async_scheduling=async_scheduling,
            gpu_memory_utilization=gpu_memory_utilization,
            compilation_config=None if enforce_eager else {"max_cudagraph_capture_size": max_num_seqs},
            enable_lora=True,
            max_lora_rank=vllm_lora_rank(lora.rank),
            max_loras=1,
        )
        self.store = AdapterStore(
            f"/dev/shm/miniverl-raw-{os.getpid()}", adapter_config(lora.rank, lora.alpha, lora.target_modules, "")
        )
        self._weights = adapter_template(model_path, lora, dtype)
        self.request = None

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        return self._weights

    def load_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        from vllm.lora.request import LoRARequest

        self._weights = weights
        self.request = LoRARequest("raw", 1, str(self.store.write(1, weights)))

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        from miniverl.rollout.vllm import completions, sampling_requests

        requests, sampling = sampling_requests(prompts, params, seeds, self.seeding, self.logprobs)
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.request)
        return completions(outputs, self.logprobs)

    def close(self) -> None:
        from miniverl.rollout.vllm import shutdown_engine

        self.store.close()
        shutdown_engine(self.llm)
        del self.llm


class HFGenerate:
    """Hugging Face `model.generate` on the peft model (unmerged LoRA, dynamic cache), n samples per prompt.

    It returns no log-probs: keeping every step's [rows, V] scores alive would not fit at these sizes, so the
    oracle does not judge its cells. `model` is the transformers model inside the peft wrapper: the bench's
    time cap hooks its forward, which peft's generate calls directly (a hook on the wrapper never fired: the
    first RL-size run let model.generate run 75 s past a 40 s cap).
    """

    def __init__(self, model_path: str, lora: LoraSettings, dtype: torch.dtype, device: str) -> None:
        self.device = device
        self.peft = build_lora_model(model_path, lora, dtype, device).eval()
        self.model = self.peft.get_base_model()

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        return adapter_state(self.peft)

    def load_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        load_adapter_state(self.peft, weights)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        ids, mask = left_pad(prompts)
        torch.manual_seed(params.seed)
        out = self.peft.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=True,
            temperature=params.temperature,
            top_k=params.top_k or None,
            top_p=params.top_p,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.max_new_tokens,  # equal work: no row stops early
            num_return_sequences=params.n,
            pad_token_id=0,
        )
        tokens = out[:, ids.shape[1] :].tolist()
        return [Completion(t, [], False) for t in tokens]


BASELINES = {"raw_vllm": RawVllm, "hf_generate": HFGenerate}
