"""The drift lab's task: sort or reverse a short word, written in a readable character vocabulary.

A prompt is a word of 4-14 lowercase letters and an operator: `dcab=` asks for the letters sorted (`abcd.`),
`dcab<` for them reversed (`bacd.`). The answer ends with the end token `.`, so responses vary in length
(5-15 tokens) and the Sequences page shows real text. The reward is the share of answer positions right:

    reward = #{j : response[j] == target[j]} / max(len(response), len(target))     (both with the end token)

1 for an exact answer, 0 for nothing right; a response that stops early or runs on loses the positions it misses.
Token ids are positions in VOCAB; torch-free, so the presets and tests read it cheaply.
"""
from __future__ import annotations

import numpy as np

END, SORT, REVERSE = ".", "=", "<"
VOCAB = END + SORT + REVERSE + " " + "abcdefghijklmnopqrstuvwxyz" + "0123456789"  # 40 characters
END_ID = VOCAB.index(END)
OPS = {SORT: "sort", REVERSE: "reverse"}  # operator -> tag
MIN_LETTERS, MAX_LETTERS = 4, 14
PROMPT_LEN = MAX_LETTERS + 1          # prompts are left-padded with spaces to this length
RESPONSE_LEN = MAX_LETTERS + 1        # longest answer: every letter and the end token
_ID = {c: i for i, c in enumerate(VOCAB)}
LETTERS = np.array([_ID[c] for c in "abcdefghijklmnopqrstuvwxyz"])


def encode(text: str) -> list[int]:
    return [_ID[c] for c in text]


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def make_prompts(rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[str], list[str]]:
    """n prompts: ids (n, PROMPT_LEN) left-padded with spaces, their answers as text (with the end token), tags."""
    ids = np.full((n, PROMPT_LEN), _ID[" "], dtype=np.int64)
    answers, tags = [], []
    lengths = rng.integers(MIN_LETTERS, MAX_LETTERS + 1, size=n)
    ops = rng.integers(0, 2, size=n)
    for i in range(n):
        word = LETTERS[rng.integers(0, len(LETTERS), size=lengths[i])]
        op = SORT if ops[i] == 0 else REVERSE
        ids[i, PROMPT_LEN - lengths[i] - 1:-1] = word
        ids[i, -1] = _ID[op]
        answer = np.sort(word) if op == SORT else word[::-1]
        answers.append(decode(answer) + END)
        tags.append(OPS[op])
    return ids, answers, tags


def response_lengths(tokens: np.ndarray) -> np.ndarray:
    """Tokens of each response up to and including its first end token (all of them when it never ends)."""
    ended = tokens == END_ID
    first = np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, tokens.shape[1])
    return first.astype(np.int64)


def rewards(tokens: np.ndarray, answers: list[str]) -> np.ndarray:
    """The share of answer positions right (module docstring), per response; `tokens` (B, RESPONSE_LEN)."""
    lengths = response_lengths(tokens)
    out = np.empty(len(answers))
    for i, answer in enumerate(answers):
        target = np.array(encode(answer))
        got = tokens[i, :lengths[i]]
        n = min(len(got), len(target))
        out[i] = np.count_nonzero(got[:n] == target[:n]) / max(len(got), len(target))
    return out


def prompt_text(ids: np.ndarray) -> str:
    """A prompt as a reader sees it: without its left padding."""
    return decode(ids).lstrip(" ")
