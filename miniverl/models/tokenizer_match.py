"""Do the teacher and the student read token ids alike? Checked in the driver, before Ray.

Distillation hands the teacher the student's token ids and compares the two distributions id by id, so
an id must mean the same text to both, and the teacher must have made the same ids of the same text (a
teacher fed another tokenizer's segmentation scores text it never saw written that way). Both fail
silently: the loss is finite, only wrong. `check_same_tokenizer` compares, in this order:

1. how both encode a fixed set of texts (PROBE_TEXTS: prose, digits and arithmetic, code, unicode,
   whitespace runs), and the run's own first prompts (`check_prompts_encode_alike`);
2. the id of every token the student's tokenizer has. A token only the teacher has is accepted past the
   student's logits (`student_logits`): the scorer drops those logits (shared_vocab_size in
   models/loading.py), so the student never sees them. Inside that range it is a real teacher token
   where the student has padding, and the teacher's mass on it would teach the student to emit a
   padding id: refused;
3. bos and eos (the stop the student's rollouts end on, the one the teacher expects a turn to end on).
   pad is not compared: the scorer packs rows without padding (models/packing.py) and the losses mask
   it, so no model reads a padded position;
4. the chat template rendered for one system and one user message (when both tokenizers have one):
   the special tokens that frame the turns, and the tokens after the last one, where the response starts
   (check_same_chat_format).

Same-family tokenizers pass all four (Qwen2.5-0.5B and 7B share one tokenizer of 151,665 tokens; their
151,936 vs 152,064 logits are shared_vocab_size's business).
"""

from __future__ import annotations

from collections.abc import Sequence

from miniverl.errors import ConfigError

PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it?",
    "What is 27 + 82? 27 + 82 = 109. 3.14159 * 2 = 6.28318, and 1,000,000 - 1 = 999999.",
    "def add(a, b):\n    return a + b  # the sum\n\nprint(add(2, 3))",
    "Unicode: café, naïve, Straße, 東京, Привет, 😀, “quotes” — ½ °C",
    "  two leading spaces,\ttabs\t\tand    runs of spaces\n\n\nthree newlines   ",
)
CHAT_PROBE = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 27 + 82?"},
)
PROMPTS_PROBED = 4  # the run's first prompts also probed (check_prompts_encode_alike): a decode and two encodes each
SHOWN = 3  # tokens shown on each side of the first difference
FIX = "pick a teacher of the student's tokenizer family (or a student of the teacher's)"


def check_same_tokenizer(student, teacher, student_path: str, teacher_path: str, student_logits: int) -> None:
    """ConfigError naming the first difference where the teacher would read the student's ids otherwise than
    the student means them (module docstring); `student_logits`: the student's output layer size."""
    for text in PROBE_TEXTS:
        check_encodes_alike(student, teacher, text, teacher_path, add_special_tokens=True)
    # the student's special tokens written out: a tokenizer that does not treat one as special splits it
    specials = "Hello" + "".join(student.all_special_tokens) + " world"
    check_encodes_alike(student, teacher, specials, teacher_path, add_special_tokens=False)
    check_same_ids(student, teacher, student_path, teacher_path, student_logits)
    for name in ("bos", "eos"):
        s, t = getattr(student, f"{name}_token_id"), getattr(teacher, f"{name}_token_id")
        if s != t:
            raise ConfigError(
                f"the teacher's {name} token is {_token(teacher, t)} and the student's {_token(student, s)}"
                f" (teacher {teacher_path!r}, student {student_path!r}): rollouts would start or stop where the"
                f" teacher does not expect it; {FIX}, e.g. both instruct or both base models of one release"
            )
    check_same_chat_format(student, teacher, teacher_path)


def check_same_chat_format(student, teacher, teacher_path: str) -> None:
    """CHAT_PROBE rendered by both templates (when both have one) must hold the same added tokens in the same order
    (the turn structure) and end with the same tokens after the last of them (the assistant opener: where the
    response starts). The text between added tokens may differ: a default system prompt, a date line (Llama-3.2's
    template writes today's date, 3.1's a fixed one) is content the teacher reads like any prompt text."""
    s_chat, t_chat = render_chat(student), render_chat(teacher)
    if s_chat is None or t_chat is None:
        return
    s_ids = list(student(s_chat, add_special_tokens=False)["input_ids"])
    t_ids = list(teacher(t_chat, add_special_tokens=False)["input_ids"])
    s_added, t_added = set(student.added_tokens_decoder), set(teacher.added_tokens_decoder)
    s_turns, t_turns = [i for i in s_ids if i in s_added], [i for i in t_ids if i in t_added]
    where = f"teacher {teacher_path!r}; {FIX}, or set data.chat_template=false"
    if s_turns != t_turns:
        at = first_difference(s_turns, t_turns)
        raise ConfigError(
            f"the teacher's chat template frames a system and a user message with {_window(teacher, t_turns, at)}"
            f" but the student's with {_window(student, s_turns, at)}: first difference at special token {at}; the"
            f" teacher would score the student's prompts in a turn format it was not tuned on ({where})"
        )
    s_tail, t_tail = _after_last(s_ids, s_added), _after_last(t_ids, t_added)
    if s_tail != t_tail:
        at = first_difference(s_tail, t_tail)
        raise ConfigError(
            f"the teacher's chat template opens the answer with {_window(teacher, t_tail, at)} after its last special"
            f" token but the student's with {_window(student, s_tail, at)}: the student's responses would start"
            f" where the teacher does not answer ({where})"
        )


def _after_last(ids: Sequence[int], added: set[int]) -> list[int]:
    """The ids after the last one in `added` (all of them when none is)."""
    last = max((i for i, t in enumerate(ids) if t in added), default=-1)
    return list(ids[last + 1 :])


def check_prompts_encode_alike(student, teacher, prompt_ids: Sequence[Sequence[int]], teacher_path: str) -> None:
    """The run's first PROMPTS_PROBED prompts (the student's ids), as text, encode alike (check_encodes_alike)."""
    for ids in list(prompt_ids)[:PROMPTS_PROBED]:
        text = student.decode(list(ids), skip_special_tokens=False)  # specials kept: the template's are probed too
        check_encodes_alike(student, teacher, text, teacher_path, add_special_tokens=False)


def check_encodes_alike(student, teacher, text: str, teacher_path: str, add_special_tokens: bool) -> None:
    """ConfigError when the two tokenizers make different ids of `text`, naming the first differing token."""
    s = list(student(text, add_special_tokens=add_special_tokens)["input_ids"])
    t = list(teacher(text, add_special_tokens=add_special_tokens)["input_ids"])
    if s == t:
        return
    at = first_difference(s, t)
    shown = text if len(text) <= 60 else text[:57] + "..."
    raise ConfigError(
        f"the teacher ({teacher_path!r}) tokenizes {shown!r} as {_window(teacher, t, at)} but the student as"
        f" {_window(student, s, at)}: first difference at token {at} ({_token(teacher, _at(t, at))} vs"
        f" {_token(student, _at(s, at))}); {FIX}"
    )


def check_same_ids(student, teacher, student_path: str, teacher_path: str, student_logits: int) -> None:
    """Every student token at the same id in the teacher; teacher-only tokens only past `student_logits`."""
    s, t = student.get_vocab(), teacher.get_vocab()
    if s == t:
        return
    t_by_id = {i: tok for tok, i in t.items()}
    moved = sorted((i, tok) for tok, i in s.items() if t.get(tok) != i)  # missing in the teacher or at another id
    inside = sorted((i, tok) for tok, i in t.items() if tok not in s and i < student_logits)
    if not moved and not inside:
        return  # the teacher adds tokens past the student's logits only: dropped by the scorer, never scored
    if moved:
        i, tok = moved[0]
        theirs = repr(t_by_id[i]) if i in t_by_id else "no token"
        which = f"id {i} is {tok!r} to the student but {theirs} to the teacher"
    else:
        i, tok = inside[0]
        which = f"the teacher has {tok!r} at id {i}, inside the student's {student_logits} logits, where it has none"
    raise ConfigError(
        f"the teacher's vocabulary differs from the student's ({len(t)} vs {len(s)} tokens): {which}"
        f" ({len(moved)} student tokens missing or moved, {len(inside)} teacher-only tokens inside the student's"
        f" logits); {FIX} (teacher {teacher_path!r}, student {student_path!r})"
    )


def render_chat(tokenizer) -> str | None:
    """CHAT_PROBE through the tokenizer's chat template with the generation prompt; None without a template.
    A template that refuses a system message (some do) renders the user message alone."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return tokenizer.apply_chat_template(list(CHAT_PROBE), tokenize=False, add_generation_prompt=True)
    except Exception:  # jinja's raise_exception: "System role not supported" and the like
        return tokenizer.apply_chat_template(list(CHAT_PROBE[1:]), tokenize=False, add_generation_prompt=True)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where the lists differ (the shorter one's length when one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _at(ids: Sequence[int], i: int) -> int | None:
    return ids[i] if i < len(ids) else None


def _token(tokenizer, i: int | None) -> str:
    """`'Ġ27' (id 1234)`; `none` for a missing id (past the end, or no such token)."""
    return "none" if i is None else f"{tokenizer.convert_ids_to_tokens(i)!r} (id {i})"


def _window(tokenizer, ids: Sequence[int], at: int) -> str:
    """The tokens around index `at`, `...` marking what is left out."""
    lo, hi = max(at - SHOWN, 0), min(at + SHOWN + 1, len(ids))
    shown = ", ".join(repr(t) for t in tokenizer.convert_ids_to_tokens(list(ids[lo:hi])))
    return f"[{'..., ' if lo else ''}{shown}{', ...' if hi < len(ids) else ''}]"
