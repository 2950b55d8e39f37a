"""The prompts a peer of the harness (miniverl.bench.peers) trains on: miniVERL's own training stream.

miniVERL's run of a harness cell draws step s's prompts with `training_examples` (built-in reverse task, data.seed 0,
the held-out evaluation prompts excluded); a peer's script draws the same ones here, so every cell of a shape sees
the same prompts in the same order. Peers get the raw text, as miniVERL feeds it (no chat template).
"""

from __future__ import annotations

from miniverl.bench.peers import DATA_SEED, EVAL_PROMPTS, TASK, TASK_MAX_LEN, TASK_MIN_LEN
from miniverl.data.prompts import held_out_prompts, training_examples

PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # a peer's chat rows as raw text
FIRST_STEP = 0  # miniVERL draws its first training step's prompts at index 0 (step/cadence.py; logged as step 1)


def step_examples(prompts: int, steps: int) -> list[tuple[str, str]]:
    """(prompt, answer) for `prompts` prompts of each of `steps` optimizer steps, step after step."""
    task = (TASK, TASK_MIN_LEN, TASK_MAX_LEN, DATA_SEED)
    exclude = held_out_prompts(*task, EVAL_PROMPTS)
    return [
        (ex.prompt, ex.answer)
        for step in range(FIRST_STEP, FIRST_STEP + steps)
        for _, ex in training_examples(*task, step, prompts, exclude)
    ]


def step_prompts(prompts: int, steps: int, samples: int) -> list[str]:
    """Every step's prompts, each repeated `samples` times: the rows of a trainer that samples once per row."""
    return [p for p, _ in step_examples(prompts, steps) for _ in range(samples)]
