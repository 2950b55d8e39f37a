"""The prompts a peer of the harness (lab.bench.peers) trains on: miniVERL's own training stream.

miniVERL's run of a harness cell draws step s's prompts with `training_examples` (built-in reverse task, data.seed 0,
the held-out evaluation prompts excluded, strings of the harness's --prompt-len characters); a peer's script draws the
same ones here, so every cell of a shape sees the same prompts in the same order. Peers get the raw text, as miniVERL
feeds it (no chat template).
"""

from __future__ import annotations

import random

from miniverl.data.tasks import TASKS

# The stream both sides draw from; the harness (peers.py) passes the same values to miniVERL's run of a cell.
EVAL_PROMPTS = 8  # miniVERL's held-out prompts for these runs; the peers draw the same training prompts
TASK, TASK_MIN_LEN, TASK_MAX_LEN, DATA_SEED = "reverse", 3, 8, 0  # miniVERL's data defaults (config.py)
DEFAULT_PROMPT_LEN = (TASK_MIN_LEN, TASK_MAX_LEN)  # --prompt-len's default: nothing passed, the cells of before

PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # a peer's chat rows as raw text
FIRST_STEP = 0  # miniVERL draws its first training step's prompts at index 0 (step/cadence.py; logged as step 1)


def step_examples(prompts: int, steps: int, lengths: tuple[int, int] = DEFAULT_PROMPT_LEN) -> list[tuple[str, str]]:
    """(prompt, answer) for `prompts` prompts of each of `steps` optimizer steps, step after step, the task's strings
    `lengths` (LO, HI) characters long: miniVERL's data.min_len / data.max_len, which bound its held-out prompts too."""
    from miniverl.data.prompts import held_out_prompts, training_examples  # torch: not at import, peers.py stays light

    task = (TASK, *lengths, DATA_SEED)
    exclude = held_out_prompts(*task, EVAL_PROMPTS)
    return [
        (ex.prompt, ex.answer)
        for step in range(FIRST_STEP, FIRST_STEP + steps)
        for _, ex in training_examples(*task, step, prompts, exclude)
    ]


def step_prompts(prompts: int, steps: int, samples: int, lengths: tuple[int, int] = DEFAULT_PROMPT_LEN) -> list[str]:
    """Every step's prompts, each repeated `samples` times: the rows of a trainer that samples once per row."""
    return [p for p, _ in step_examples(prompts, steps, lengths) for _ in range(samples)]


def longest_prompt_tokens(max_len: int, tokenizer) -> int:
    """The most tokens a prompt of the task's strings of at most `max_len` characters takes, encoded as miniVERL
    encodes built-in prompts (`tokenizer(prompt)`, raw text): the prompt's characters (`max_len` letters and the
    task's `>`, drawn here so that a change of the task's format is counted) plus what the tokenizer adds to any text
    (the character tokenizer's BOS). Exact for the character tokenizer (a token a character); a byte-level BPE
    tokenizer (Qwen's) never takes more tokens than a string has ASCII characters."""
    longest = TASKS.get(TASK)(random.Random(0), max_len, max_len).prompt
    return len(longest) + len(tokenizer("")["input_ids"])
