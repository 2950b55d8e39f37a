"""Text rewards: one decoded response and its ground truth in, a score in [0, 1] out.

Pure string functions with no tokenizer or tensors, so each is tested in one line. The batch side
(decoding, routing by data_source, checking what a function returns) is in `miniverl.rewards.batch`.
"""

from __future__ import annotations

import math
import re

# GSM8K solutions end with "#### <number>" (the dataset's own convention, and verl's strict parser).
GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9][0-9.,]*)")
# Two numbers are equal when they agree to this relative tolerance (answers such as 0.1 + 0.2 written
# as 0.30000000000000004 by a model must still match 0.3).
NUMERIC_REL_TOL = 1e-6
NUMERIC_ABS_TOL = 1e-9
BOXED_COMMANDS = ("\\boxed", "\\fbox")
# A number as written in free text: sign, digits with optional thousands commas, optional decimals. A minus sign
# counts only where it cannot be a binary minus ("5-3" is 5 and 3; "= -2" and "-2" are -2).
FREE_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
# LaTeX decoration that does not change a final answer's value.
LATEX_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$", "^\\circ", "^{\\circ}")


def exact_match(response: str, ground_truth: str) -> float:
    """1.0 when the response equals the ground truth exactly (the built-in tasks), else 0.0."""
    return float(response == ground_truth)


def to_number(text: str) -> float | None:
    """The value of a plain numeric answer (`1,234`, `-3.5`, `\\frac{3}{4}`, `3/4`, `50\\%`), else None."""
    s = text.strip().rstrip(".").replace("\\%", "").replace("%", "")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators only: "1,234" but not "1,2"
    frac = re.fullmatch(r"-?\\[dt]?frac\{(-?[0-9.]+)\}\{(-?[0-9.]+)\}", s) or re.fullmatch(r"(-?[0-9.]+)/([0-9.]+)", s)
    try:
        if frac:
            sign = -1.0 if s.startswith("-\\") else 1.0
            return sign * float(frac.group(1)) / float(frac.group(2))
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def normalize_answer(text: str) -> str:
    """Strip LaTeX decoration, `\\text{}` wrappers, spaces and a trailing period; `\\dfrac` -> `\\frac`."""
    s = text
    for noise in LATEX_NOISE:
        s = s.replace(noise, "")
    s = re.sub(r"\\(?:text|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", s).rstrip(".")


def answers_equal(answer: str, ground_truth: str) -> bool:
    """Numerically equal when both parse as numbers, else equal after normalize_answer."""
    a, g = normalize_answer(answer), normalize_answer(ground_truth)
    x, y = to_number(a), to_number(g)
    if x is not None and y is not None:
        return math.isclose(x, y, rel_tol=NUMERIC_REL_TOL, abs_tol=NUMERIC_ABS_TOL)
    return a == g


def extract_gsm8k(response: str) -> str | None:
    """The number after the last `####` in the response, or None."""
    found = GSM8K_ANSWER.findall(response)
    return found[-1].rstrip(".") if found else None


def gsm8k(response: str, ground_truth: str) -> float:
    """1.0 when the response's last `#### <number>` equals the ground truth's number (commas ignored)."""
    answer = extract_gsm8k(response)
    truth = extract_gsm8k(ground_truth) or ground_truth  # verl rows hold the bare number; raw GSM8K the solution
    return float(answer is not None and answers_equal(answer, truth))


def last_boxed(response: str) -> str | None:
    """The contents of the last `\\boxed{...}` (braces balanced) or `\\boxed x`, or None."""
    start = max(response.rfind(cmd) for cmd in BOXED_COMMANDS)
    if start < 0:
        return None
    rest = response[start:].split("{", 1) if "{" in response[start:] else None
    head = response[start:].split(" ", 1)
    if rest is None or (len(head) == 2 and len(head[0]) < len(rest[0])):  # "\boxed 5" form
        return head[1].split("$")[0].strip() if len(head) == 2 else None
    depth, out = 1, []
    for ch in rest[1]:
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return "".join(out)
        out.append(ch)
    return None  # unbalanced: the answer was cut off


def boxed(response: str, ground_truth: str) -> float:
    """1.0 when the last `\\boxed{}` answer equals the ground truth (numerically, or after normalization)."""
    answer = last_boxed(response)
    truth = last_boxed(ground_truth) or ground_truth
    return float(answer is not None and answers_equal(answer, truth))


def last_number(response: str) -> str | None:
    """The last number written in free text ("27 + 82 = 109." -> "109"; "1,234" -> "1234"), or None."""
    found = FREE_NUMBER.findall(response)
    return found[-1].replace(",", "") if found else None


def extract_numeric(response: str) -> str | None:
    """The response's final numeric answer: its last `#### n` (GSM8K), else its last `\\boxed{n}`, else the last
    number in the text; None when it holds none. A marked answer wins over later numbers, so "#### 12. Check: 3"
    answers 12."""
    for marked in (extract_gsm8k(response), last_boxed(response)):
        if marked is not None and to_number(normalize_answer(marked)) is not None:
            return marked
    return last_number(response)


def numeric(response: str, ground_truth: str) -> float:
    """1.0 when the response's final number (extract_numeric) equals the ground truth's number, else 0.0.

    For free-form answers of real models ("27 + 82 = 109", "The answer is 109."). A ground truth that is not a
    number scores nothing: this reward compares numbers only (use boxed or exact_match for other answers)."""
    answer, truth = extract_numeric(response), extract_numeric(ground_truth)  # both parse as numbers, or None
    return float(answer is not None and truth is not None and answers_equal(answer, truth))
