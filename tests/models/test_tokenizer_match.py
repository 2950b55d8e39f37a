"""The tokenizer probe (models/tokenizer_match.py): one tokenizer family passes, padded logits included; another
family, moved ids, another eos or chat template, or a teacher-only token the student's logits cover is refused,
naming the first difference. Every tokenizer is built here (tokenizers library, no downloads)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from miniverl.errors import ConfigError
from miniverl.models.tokenizer import save_char_tokenizer
from miniverl.models.tokenizer_match import check_prompts_encode_alike, check_same_tokenizer
from tests.chat_models import BPE_VOCAB, ENDOFTEXT, IM_END, QWEN_STYLE_TEMPLATE, save_chat_tokenizer

SHIPPED = Path(__file__).resolve().parents[2] / "miniverl" / "models" / "shipped"
LOGITS = 320  # the chat student's output layer: the tokenizer's 300 ids and padding (tests/conftest.py)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "bpe"
    save_chat_tokenizer(path)
    return path


def load(path: Path):
    return AutoTokenizer.from_pretrained(str(path))


def variant(bpe_dir: Path, tmp_path: Path, name: str, edit) -> Path:
    """A copy of the BPE tokenizer with `edit(tokenizer.json dict, tokenizer_config.json dict)` applied (a
    `chat_template` the edit sets replaces the saved one)."""
    out = tmp_path / name
    shutil.copytree(bpe_dir, out)
    tok_json, cfg_json = (json.loads((out / f).read_text()) for f in ("tokenizer.json", "tokenizer_config.json"))
    edit(tok_json, cfg_json)
    (out / "tokenizer.json").write_text(json.dumps(tok_json))
    template = cfg_json.pop("chat_template", None)
    if template is not None:  # transformers 5 saves the template beside the config, and reads it from there
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg_json))
    return out


def refused(student, teacher, logits: int = LOGITS) -> str:
    with pytest.raises(ConfigError) as err:
        check_same_tokenizer(student, teacher, "student-dir", "teacher-dir", logits)
    return str(err.value)


def test_identical_tokenizers_and_a_padded_logits_teacher_pass(bpe_dir, tmp_path):
    """One tokenizer, two output layers (the teacher's padded further, as Qwen2.5-7B's 152,064 logits against
    0.5B's 151,936): the probe passes at the student's logits, which the scorer slices the teacher to."""
    student, teacher = load(bpe_dir), load(variant(bpe_dir, tmp_path, "copy", lambda t, c: None))
    for logits in (BPE_VOCAB, LOGITS):
        check_same_tokenizer(student, teacher, "s", "t", logits)


def test_the_built_in_tokenizers_pass():
    for recipe in ("reverse-affff8d0d847", "sort-439b9626e9b0", "reverse+sort-adf87e43303b"):
        for role in ("student", "teacher"):
            if (SHIPPED / recipe / role).exists():
                student = load(SHIPPED / "reverse-affff8d0d847" / "student")
                check_same_tokenizer(student, load(SHIPPED / recipe / role), "s", "t", len(student))


def test_another_tokenizer_family_is_refused_naming_the_first_differing_token(bpe_dir, tmp_path):
    """Byte-level BPE against the built-in character-level tokenizer: different ids from the first token on."""
    char = tmp_path / "char"
    save_char_tokenizer(char)
    msg = refused(load(bpe_dir), load(char))
    assert "the teacher ('teacher-dir') tokenizes" in msg and "first difference at token 0" in msg
    assert "'<bos>' (id 1)" in msg and "pick a teacher of the student's tokenizer family" in msg


def test_same_vocabulary_other_merges_is_refused(bpe_dir, tmp_path):
    """Equal vocab dicts (what main compared) but no merges: the teacher spells 'The' as 'T' 'h' 'e' where the
    student writes 'T' 'he' -- text the teacher never saw tokenized the student's way."""

    def no_merges(tok, cfg):
        tok["model"]["merges"] = []

    student, teacher = load(bpe_dir), load(variant(bpe_dir, tmp_path, "nomerge", no_merges))
    assert student.get_vocab() == teacher.get_vocab()
    msg = refused(student, teacher)
    assert "first difference at token 1 ('h' (id" in msg and "vs 'he' (id" in msg


def test_moved_special_token_ids_are_refused(bpe_dir, tmp_path):
    """The same tokens, two ids swapped (a retrained tokenizer that listed its specials in another order)."""

    def swap(tok, cfg):
        vocab = tok["model"]["vocab"]
        a, b = vocab[IM_END], vocab[ENDOFTEXT]
        vocab[IM_END], vocab[ENDOFTEXT] = b, a
        for added in tok["added_tokens"]:
            added["id"] = {a: b, b: a}.get(added["id"], added["id"])

    msg = refused(load(bpe_dir), load(variant(bpe_dir, tmp_path, "swapped", swap)))
    assert "tokenizes 'Hello<|im_end|><|endoftext|> world'" in msg  # the student's specials written out


def test_a_special_token_the_teacher_splits_is_refused(bpe_dir, tmp_path):
    """Equal vocabularies, but the teacher does not treat <|im_end|> as one token: it spells it out in bytes."""

    def not_added(tok, cfg):
        tok["added_tokens"] = [a for a in tok["added_tokens"] if a["content"] != IM_END]
        cfg.pop("added_tokens_decoder", None)
        cfg["eos_token"] = ENDOFTEXT

    msg = refused(load(bpe_dir), load(variant(bpe_dir, tmp_path, "split", not_added)))
    assert "first difference at token" in msg and "'<|im_end|>' (id 2)" in msg


def test_another_eos_is_refused(bpe_dir, tmp_path):
    """A base model's tokenizer (eos <|endoftext|>) against its instruct sibling's (eos <|im_end|>)."""

    def base_eos(tok, cfg):
        cfg["eos_token"] = ENDOFTEXT

    msg = refused(load(bpe_dir), load(variant(bpe_dir, tmp_path, "base", base_eos)))
    assert "the teacher's eos token is '<|endoftext|>' (id 0) and the student's '<|im_end|>' (id 2)" in msg
    assert "both instruct or both base" in msg


def test_another_pad_passes(bpe_dir, tmp_path):
    """No model reads a padded position (rows are packed without padding, the losses mask it)."""

    def other_pad(tok, cfg):
        cfg["pad_token"] = IM_END

    check_same_tokenizer(load(bpe_dir), load(variant(bpe_dir, tmp_path, "pad", other_pad)), "s", "t", LOGITS)


def test_a_chat_template_that_moves_the_first_response_token_is_refused(bpe_dir, tmp_path):
    """The teacher's template opens the assistant turn with a blank line: the student's responses start one
    token earlier than the teacher was tuned to answer."""

    def blank_line(tok, cfg):
        cfg["chat_template"] = QWEN_STYLE_TEMPLATE.replace("assistant\\n'", "assistant\\n\\n'")

    student, teacher = load(bpe_dir), load(variant(bpe_dir, tmp_path, "template", blank_line))
    assert teacher.chat_template != student.chat_template
    msg = refused(student, teacher)
    assert "the teacher's chat template opens the answer with [..., 'tan', 't', 'Ċ', 'Ċ'] after its last special" in msg
    assert "the student's responses would start where the teacher does not answer" in msg
    assert "data.chat_template=false" in msg


def test_a_chat_template_with_other_turn_tokens_is_refused(bpe_dir, tmp_path):
    """The teacher ends a turn with <|endoftext|> where the student writes <|im_end|>."""

    def other_turn_end(tok, cfg):
        cfg["chat_template"] = QWEN_STYLE_TEMPLATE.replace("'<|im_end|>\\n'", "'<|endoftext|>\\n'")

    student, teacher = load(bpe_dir), load(variant(bpe_dir, tmp_path, "turns", other_turn_end))
    msg = refused(student, teacher)
    assert "frames a system and a user message with ['<|im_start|>', '<|endoftext|>'" in msg
    assert "first difference at special token 1" in msg


def test_templates_that_differ_only_in_text_between_special_tokens_pass(bpe_dir, tmp_path):
    """A date line in the system turn (Llama-3.2's template writes today's date, 3.1's a fixed one): content the
    teacher reads like any prompt text, not a format."""

    def dated(tok, cfg):
        cfg["chat_template"] = QWEN_STYLE_TEMPLATE.replace(
            "'<|im_start|>' + m['role'] + '\\n'", "'<|im_start|>' + m['role'] + '\\nToday Date: 7 Dec 2026\\n'"
        )

    student, teacher = load(bpe_dir), load(variant(bpe_dir, tmp_path, "dated", dated))
    assert "Today Date" in teacher.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    check_same_tokenizer(student, teacher, "s", "t", LOGITS)


def test_a_template_that_only_writes_its_default_system_prompt_otherwise_passes(bpe_dir, tmp_path):
    """The probe gives the system message itself, so templates that differ only in the default system prompt
    (Qwen2.5-Instruct against Qwen2.5-Math-Instruct) render alike."""

    def other_default(tok, cfg):
        cfg["chat_template"] = QWEN_STYLE_TEMPLATE.replace("You are a helpful assistant.", "Reason step by step.")

    check_same_tokenizer(load(bpe_dir), load(variant(bpe_dir, tmp_path, "sys", other_default)), "s", "t", LOGITS)


def test_teacher_only_tokens_pass_past_the_students_logits_and_are_refused_inside(bpe_dir, tmp_path):
    """A teacher tuned with an added token (id 300, after the shared 300): past a 300-logit student the scorer
    drops it; inside a 320-logit one the teacher's mass there would teach the student a padding id."""
    out = tmp_path / "added"
    teacher = load(bpe_dir)
    teacher.add_tokens(["<think>"], special_tokens=True)
    teacher.save_pretrained(str(out))
    student, teacher = load(bpe_dir), load(out)
    check_same_tokenizer(student, teacher, "s", "t", BPE_VOCAB)
    msg = refused(student, teacher, LOGITS)
    assert "the teacher has '<think>' at id 300, inside the student's 320 logits" in msg
    assert "vocabulary differs" in msg


def test_the_runs_prompts_are_probed(bpe_dir, tmp_path):
    """The run's prompts (the student's ids, decoded) encode alike, or the prompt is named."""
    student = load(bpe_dir)
    text = student.apply_chat_template(
        [{"role": "user", "content": "add 82"}], tokenize=False, add_generation_prompt=True
    )
    prompt = student(text, add_special_tokens=False)["input_ids"]
    check_prompts_encode_alike(student, load(bpe_dir), [prompt], "t")

    def no_merges(tok, cfg):
        tok["model"]["merges"] = []

    with pytest.raises(ConfigError, match=r"tokenizes '<\|im_start\|>system.*first difference at token \d+"):
        check_prompts_encode_alike(student, load(variant(bpe_dir, tmp_path, "nm", no_merges)), [prompt], "t")
