"""A prompt file's `teacher_prompt` column: each row's own privileged context for the teacher, encoded as the prompt
is, carried with the rollout and scored after; refused in one line when some rows lack it, when it is not a prompt,
when it would be cut, or when it opens the answer otherwise than the student's prompt."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from miniverl.config import validate
from miniverl.config.data import DataConfig
from miniverl.data.build import build_prompt_source
from miniverl.data.files import Columns
from miniverl.data.stream import FilePromptSource
from miniverl.data.templates import encode_prompt
from miniverl.errors import ConfigError
from miniverl.process import ProcessSettings
from miniverl.step.controller import rollout_metrics
from miniverl.workers.scorer import ScorerWorker
from tests.chat_models import write_jsonl, write_parquet
from tests.data.test_chat_task import rollouts_of
from tests.data.test_prompt_files import source
from tests.test_config import load

HINT = {"role": "system", "content": "Hint: a number plus itself is twice the number."}


def question(i: int) -> str:
    return f"What is {i} + {i}?"


def rows_with_context(count: int, form: str = "messages") -> list[dict]:
    """Plain rows whose teacher sees a hint (chat messages) or the hint and the question as one text."""
    rows = []
    for i in range(count):
        shown = [HINT, {"role": "user", "content": question(i)}] if form == "messages" else f"{HINT['content']} {i}?"
        rows.append({"prompt": question(i), "answer": str(2 * i), "teacher_prompt": shown})
    return rows


@pytest.fixture(scope="module")
def chat_tok(chat_student_dir):
    return AutoTokenizer.from_pretrained(str(chat_student_dir))


def in_order(tok, path, **kw):
    """The stream over `path` in file order, its rows also the held-out set (so row i is s0-i)."""
    return source(tok, [path], val=[path], shuffle=False, **kw)


@pytest.mark.parametrize("form", ["messages", "text"])
def test_the_column_is_each_rows_teacher_prompt_behind_the_template(tmp_path, chat_tok, form):
    rows = rows_with_context(6, form)
    s = in_order(chat_tok, write_jsonl(tmp_path / "p.jsonl", rows))
    batch = s.batch(0, 3)
    shown = [r["teacher_prompt"] for r in rows[:3]]
    shown = [m if isinstance(m, list) else [{"role": "user", "content": m}] for m in shown]
    assert batch.teacher_prompt_ids == [encode_prompt(chat_tok, m, True) for m in shown]
    assert batch.prompt_ids == [
        encode_prompt(chat_tok, [{"role": "user", "content": question(i)}], True) for i in range(3)
    ]
    assert "Hint" in chat_tok.decode(batch.teacher_prompt_ids[0]) and "Hint" not in chat_tok.decode(batch.prompt_ids[0])
    assert s.eval_batch(2).teacher_prompt_ids == batch.teacher_prompt_ids[:2]  # evaluation scores after them too
    assert "the teacher's prompt from column teacher_prompt" in s.describe()


def test_a_file_without_the_column_gives_no_teacher_prompts(tmp_path, chat_tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": question(i), "answer": "0"} for i in range(6)])
    assert in_order(chat_tok, path).batch(0, 3).teacher_prompt_ids is None


def test_verl_parquet_rows_take_the_column_too(tmp_path, chat_tok):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question(i)}],
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "teacher_prompt": [HINT, {"role": "user", "content": question(i)}],
        }
        for i in range(6)
    ]
    batch = in_order(chat_tok, write_parquet(tmp_path / "t.parquet", rows)).batch(0, 2)
    assert batch.teacher_prompt_ids == [encode_prompt(chat_tok, r["teacher_prompt"], True) for r in rows[:2]]


def test_the_run_builder_carries_them_to_the_rollout_and_the_scorer_scores_after_them(
    tmp_path, chat_tok, chat_teacher_dir
):
    """build_prompt_source (what a run calls) on a file with the column; the rollout batch's teacher prompts are those
    ids, the responses unchanged, and the scorer's scores are those of the responses after the teacher prompts."""
    path = write_jsonl(tmp_path / "p.jsonl", rows_with_context(8))
    d = DataConfig(train_files=[str(path)], prompts_per_step=2, eval_prompts=2, max_prompt_length=200)
    batch = build_prompt_source(d, chat_tok, 1, log=lambda _: None).batch(0, 2)
    rollouts = rollouts_of(batch)
    view = rollouts.teacher_view()
    for row in range(len(rollouts)):
        assert view.prompts[row][view.prompt_mask[row].bool()].tolist() == batch.teacher_prompt_ids[row // 2]
    assert torch.equal(view.responses, rollouts.responses)
    scorer = ScorerWorker(str(chat_teacher_dir), "float32", 4, ProcessSettings("cpu"))
    with_context, direct = scorer.score(rollouts, 8), scorer.score(view, 8)
    plain = rollouts.rows(0, len(rollouts))
    plain.teacher_prompts = plain.teacher_prompt_mask = None
    without = scorer.score(plain, 8)
    assert torch.equal(with_context.teacher_log_probs, direct.teacher_log_probs)
    mask = rollouts.response_mask.bool()
    assert not torch.allclose(with_context.teacher_log_probs[mask], without.teacher_log_probs[mask])
    metrics = rollout_metrics(rollouts, torch.zeros(len(rollouts)))
    lengths = [len(batch.teacher_prompt_ids[row // 2]) for row in range(len(rollouts))]
    assert metrics["teacher_prompt_tokens"] == pytest.approx(sum(lengths) / len(lengths))
    assert "teacher_prompt_tokens" not in rollout_metrics(plain, torch.zeros(len(plain)))


def refusal(*args, **kw) -> str:
    """The one-line ConfigError of building the stream and its first step."""
    with pytest.raises(ConfigError) as e:
        in_order(*args, **kw).batch(0, 2)
    assert "\n" not in str(e.value)
    return str(e.value)


GOOD = {"prompt": "2+2?", "answer": "4", "teacher_prompt": "Hint: 2+2 is four. 2+2?"}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": "1+1?", "answer": "2"}', "teacher_prompt is missing or null"),  # the column in some rows only
        ('{"prompt": "1+1?", "answer": "2", "teacher_prompt": null}', "teacher_prompt is missing or null"),
        ('{"prompt": "1+1?", "answer": "2", "teacher_prompt": 12}', r"teacher_prompt is a number \(12\), not text"),
        ('{"prompt": "1+1?", "answer": "2", "teacher_prompt": []}', "teacher_prompt is an empty list of messages"),
        ('{"prompt": "1+1?", "answer": "2", "teacher_prompt": ""}', "teacher_prompt is an empty string"),
        (
            '{"prompt": "1+1?", "answer": "2", "teacher_prompt": [{"role": "user", "content": ""}]}',
            "teacher_prompt holds only empty messages",
        ),
        ('{"prompt": "1+1?", "answer": "2", "teacher_prompt": ["hint"]}', r"teacher_prompt message 0 is \"hint\""),
    ],
)
def test_a_row_without_a_teacher_prompt_it_can_score_after_is_refused_by_line(tmp_path, chat_tok, line, problem):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([json.dumps(GOOD), json.dumps(GOOD), line, json.dumps(GOOD)]) + "\n")
    message = refusal(chat_tok, path)
    assert message.startswith(f"data.train_files: {path} line 3: ") and problem.replace("\\", "") in message.replace(
        "\\", ""
    )
    assert "give every row a teacher_prompt" in message


def test_the_column_in_the_training_file_only_is_refused(tmp_path, chat_tok):
    train = write_jsonl(tmp_path / "t.jsonl", rows_with_context(4))
    val = write_jsonl(tmp_path / "v.jsonl", [{"prompt": question(i), "answer": "0"} for i in range(4)])
    with pytest.raises(ConfigError, match=r"^data.train_files rows have a teacher_prompt column and data.val_files"):
        source(chat_tok, [train], val=[val])


def test_an_overlong_teacher_prompt_is_filtered_and_counted_or_refused_never_cut(tmp_path, chat_tok):
    rows = rows_with_context(8)
    for r in rows[::2]:  # every other teacher prompt far over the limit; every student prompt well under it
        r["teacher_prompt"][0] = {"role": "system", "content": "Hint:" + " step" * 80}
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    limit = 120
    s = in_order(chat_tok, path, limit=limit)
    batch = s.batch(0, 3)
    assert [r["answer"] for r in rows[1::2][:3]] == batch.ground_truth  # the rows whose teacher prompt fits
    assert all(len(ids) <= limit for ids in batch.teacher_prompt_ids) and s.overlong_count >= 1
    assert all(chat_tok.decode(ids).endswith("<|im_start|>assistant\n") for ids in batch.teacher_prompt_ids)
    message = refusal(chat_tok, path, limit=limit, overlong="error")
    assert message.startswith("data.train_files row 0: its teacher_prompt has ")
    assert f"more than data.max_prompt_length={limit}" in message and "data.overlong=filter" in message
    with pytest.raises(ConfigError, match=r"every training prompt \(or its teacher_prompt\) is longer"):
        in_order(chat_tok, path, limit=20).batch(0, 2)


def test_a_teacher_prompt_that_opens_the_answer_otherwise_is_refused(tmp_path, chat_student_dir):
    """A template whose assistant opener depends on the chat (a blank line after `assistant` when there is a system
    message): the response would follow `assistant\\n\\n` for the teacher and `assistant\\n` for the student."""
    tok = AutoTokenizer.from_pretrained(str(chat_student_dir))
    tok.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if messages[0]['role'] == 'system' %}{{- '\\n' }}{%- endif %}{%- endif %}"
    )
    path = write_jsonl(tmp_path / "p.jsonl", rows_with_context(4))
    message = refusal(tok, path)
    assert message.startswith("data.train_files row 0: the teacher prompt ends with ids ")
    assert "the two open the answer differently" in message and "or drop the column" in message
    text = write_jsonl(tmp_path / "t.jsonl", rows_with_context(4, "text"))  # one user message: the same opener
    assert in_order(tok, text).batch(0, 2).teacher_prompt_ids


def test_raw_text_prompts_end_alike_or_are_refused(tmp_path, student_dir):
    """Without a chat template there is no opener: the teacher's prompt must end with the student's last token."""
    tok = AutoTokenizer.from_pretrained(str(student_dir))

    def raw(rows, name):
        path = write_jsonl(tmp_path / name, rows)
        return FilePromptSource([str(path)], [str(path)], Columns(), tok, False, 64, "filter", False, 2, 0)

    rows = [{"prompt": f"{w}>", "answer": w[::-1], "teacher_prompt": f"ab>{w}>"} for w in ("abc", "xyz", "qrs", "cab")]
    assert raw(rows, "p.jsonl").batch(0, 2).teacher_prompt_ids == [tok(f"ab>{w}>")["input_ids"] for w in ("abc", "xyz")]
    rows[0]["teacher_prompt"] = "ab>abc"  # the answer would follow `c`, not `>`
    with pytest.raises(ConfigError, match="row 0: the teacher prompt ends with ids"):
        raw(rows, "q.jsonl").batch(0, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("data.teacher_demonstrations=2", "data.train_files=[p.jsonl]"),
            "data.teacher_demonstrations=0 and give each row its teacher context in a teacher_prompt column",
        ),
        (("data.prompt_key=teacher_prompt",), "data.prompt_key=teacher_prompt: that column is the teacher's own"),
        (("data.answer_key=teacher_prompt",), "data.answer_key=teacher_prompt: that column is the teacher's own"),
    ],
)
def test_config_refusals_before_any_file_is_read(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load(*overrides))


def test_the_verl_bridge_refuses_the_column_it_would_drop(tmp_path):
    from miniverl.bridge.data import file_rows

    path = write_jsonl(tmp_path / "p.jsonl", rows_with_context(6))
    d = DataConfig(train_files=[str(path)], eval_prompts=2)
    with pytest.raises(ConfigError, match="teacher_prompt column .* verl 0.9.1's teacher scores the student's prompt"):
        file_rows(d)


def test_a_run_with_the_student_as_its_own_teacher_prepares_the_column(tmp_path, chat_student_dir):
    """The driver's setup (before Ray) of a file run with model.teacher.path=self: its prompt stream gives the teacher
    prompts, and says so; the tokenizer probe reads them too."""
    from miniverl.setup.prepare import prepare

    path = write_jsonl(tmp_path / "p.jsonl", rows_with_context(8))
    logs = []
    cfg = load(
        f"model.student.path={chat_student_dir}",
        "model/teacher=self",
        f"data.train_files=[{path}]",
        "data.max_prompt_length=200",
        "data.prompts_per_step=2",
        "data.eval_prompts=2",
        "trainer.total_steps=2",
    )
    setup = prepare(cfg, log=logs.append)
    assert all(ids for ids in setup.prompts.batch(0, 2).teacher_prompt_ids) and setup.eval_batch.teacher_prompt_ids
    assert any("the teacher's prompt from column teacher_prompt" in line for line in logs)


@pytest.mark.parametrize("first", ["with", "without"])
def test_the_column_in_one_training_file_only_is_refused_by_line(tmp_path, chat_tok, first):
    """Whichever file comes first (datasets itself fails when the one without the column does)."""
    files = {
        "with": write_jsonl(tmp_path / "a.jsonl", rows_with_context(3)),
        "without": write_jsonl(tmp_path / "b.jsonl", [{"prompt": question(i), "answer": "0"} for i in range(3)]),
    }
    order = [files[first], files["without" if first == "with" else "with"]]
    with pytest.raises(ConfigError, match=r"b.jsonl line 1: teacher_prompt is missing or null; give every row a"):
        source(chat_tok, order, eval_prompts=1)
