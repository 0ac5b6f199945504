"""Refusals versus internal errors: a file that breaks a rule is refused with a message naming the place; a
bug of the reader is an "error" outcome (logged, reported as ours, never as a refusal, never a traceback)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.ingest import ingest_paths, load
from analysis.store import Store

ROOT = Path(__file__).resolve().parent.parent
HEADER = "run,step,sample,pos,sampler_logprob,trainer_logprob\n"


def token_lines(run: str, n: int = 2) -> str:
    return "".join(f"{run},0,0,{p},-0.5,-0.4\n" for p in range(n))


def test_jsonl_key_with_invalid_utf8_is_refused_at_its_line(tmp_path):
    good = b'{"run": "a", "step": 0, "sample": 0, "pos": 0, "sampler_logprob": -0.1, "trainer_logprob": -0.2}\n'
    bad = b'{"run": "a", "st\xffep": 0, "sample": 0, "pos": 1, "sampler_logprob": -0.1, "trainer_logprob": -0.2}\n'
    path = tmp_path / "keys.jsonl"
    path.write_bytes(good + bad)
    store = Store(tmp_path / "t.duckdb")
    [out] = ingest_paths(store, [path])
    assert (out.status, out.rule) == ("refused", "corrupt or truncated file")
    assert out.message == "keys.jsonl: line 2: a key is not valid UTF-8 (write the file as UTF-8 text)"
    assert store.run_names() == []


@pytest.mark.parametrize("key, value, where", [
    ("step", {"": 2**63}, "line 2 (step {'': 9223372036854775808}, sample 1)"),
    ("sampler_version", 2**64, "line 2 (step 0, sample 1)"),
    ("reward", 2**64, "line 2"), ("prompt", [1, "a"], "line 2"), ("reward", "high", "lines 1-2"),
    ("sampler_experts", [[[2**63, 1]]], "line 2 (step 0, sample 1)")])
def test_sequence_values_arrow_cannot_hold_are_refused(tmp_path, key, value, where):
    """Found when the catch-all went: these crashed inside pyarrow and were passed off as refusals."""
    first = {"run": "s", "step": 0, "sample": 0, "sampler_logprobs": [-0.1], "trainer_logprobs": [-0.2], "reward": 1}
    second = {**first, "sample": 1, key: value}
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    store = Store(tmp_path / "t.duckdb")
    [out] = ingest_paths(store, [path])
    if key == "sampler_experts":
        assert (out.status, out.rule) == ("refused", "invalid expert ids"), out.line()
        assert out.message.startswith(f"s.jsonl: {where}: 'sampler_experts' is ragged or not integers"), out.message
    else:
        assert (out.status, out.rule) == ("refused", "wrong type"), out.line()
        assert out.message.startswith(f"s.jsonl: {where}: '{key}' values have mixed or wrong types ("), out.message
    assert store.run_names() == []


@pytest.mark.parametrize("fmt", ["pt", "folder"])
def test_torch_error_with_an_empty_message_is_a_refusal(tmp_path, monkeypatch, fmt):
    """torch.load may raise with no message at all; the refusal must still be written, not crash."""
    import torch

    def no_message(*args, **kwargs):
        raise RuntimeError("")

    d = {"rollout_log_probs": -torch.rand(1, 2), "old_log_probs": -torch.rand(1, 2),
         "response_mask": torch.ones(1, 2), "step": 0, "run": "x"}
    if fmt == "pt":  # the generic tensor reader
        path = tmp_path / "d.pt"
        torch.save(d, path)
    else:  # the framework adapters' loader (slime's rollout/train dumps)
        path = tmp_path / "dump"
        (path / "rollout_data").mkdir(parents=True)
        (path / "train_data").mkdir()
        torch.save({"samples": []}, path / "rollout_data" / "0.pt")
        torch.save({"samples": []}, path / "train_data" / "0.pt")
    monkeypatch.setattr(torch, "load", no_message)
    out = ingest_paths(Store(tmp_path / "t.duckdb"), [path])
    assert out and all(o.status == "refused" and o.rule == "corrupt or truncated file" for o in out), out
    assert all("not a readable torch file (the parser gave no reason)" in o.message for o in out)


def test_a_reader_bug_is_an_internal_error_not_a_refusal(tmp_path, monkeypatch, caplog):
    def broken(unit, limits):
        yield from ()
        raise ZeroDivisionError("division by zero")

    monkeypatch.setitem(load.READERS, "csv", broken)
    (tmp_path / "a.csv").write_text(HEADER + token_lines("a"))
    (tmp_path / "b.jsonl").write_text(
        '{"run": "b", "step": 0, "sample": 0, "sampler_logprobs": [-0.1], "trainer_logprobs": [-0.2]}\n')
    store = Store(tmp_path / "t.duckdb")
    with caplog.at_level(logging.ERROR, logger="analysis.ingest.load"):
        out = {o.name: o for o in ingest_paths(store, [tmp_path / "a.csv", tmp_path / "b.jsonl"])}
    assert out["a.csv"].status == "error" and out["a.csv"].rule == ""
    assert out["a.csv"].line().startswith("error a.csv: internal error while reading this file (ZeroDivisionError)")
    assert "bug in Driftscope" in out["a.csv"].message and "Traceback" not in out["a.csv"].message
    assert out["b.jsonl"].status == "loaded" and store.run_names() == ["b"]  # the next file still loads
    [record] = [r for r in caplog.records if r.name == "analysis.ingest.load"]
    assert record.exc_info[0] is ZeroDivisionError  # the traceback is in the log


def test_a_detection_bug_is_an_internal_error(tmp_path, monkeypatch):
    def broken(fp, name):
        raise IndexError("list index out of range")

    monkeypatch.setattr(load, "detect", broken)
    (tmp_path / "a.csv").write_text(HEADER + token_lines("a"))
    [out] = ingest_paths(Store(tmp_path / "t.duckdb"), [tmp_path / "a.csv"])
    assert out.status == "error" and "(IndexError)" in out.message


@pytest.mark.slow  # two subprocesses
def test_cli_reports_an_internal_error_without_a_traceback(tmp_path):
    """The real entry point, with a reader patched to fail: one line on stderr, exit code 3."""
    (tmp_path / "a.csv").write_text(HEADER + token_lines("a"))
    code = ("import runpy, sys\n"
            "from analysis.ingest import load\n"
            "def broken(unit, limits):\n    raise KeyError('x')\n    yield\n"
            "load.READERS['csv'] = broken\n"
            f"sys.argv = ['analysis', 'ingest', {str(tmp_path / 'a.csv')!r}, '--db', {str(tmp_path / 't.duckdb')!r}]\n"
            "runpy.run_module('analysis', run_name='__main__')\n")
    for env, traceback in (({}, False), ({"DRIFT_DEBUG": "1"}, True)):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**os.environ, **env})
        assert out.returncode == 3, out.stderr
        assert any(line.startswith("error a.csv: internal error while reading this file (KeyError)")
                   for line in out.stderr.splitlines()), out.stderr
        assert ("Traceback" in out.stderr) == traceback, out.stderr
        assert len(out.stderr.splitlines()) == 1 or traceback
