"""One file's batches on their way to the database, and what they build up as they pass.

`FileRows.items` checks each read batch (validate.normalise) and gives the (table, rows) items to insert: the
batch's rows, and the side rows it adds (expert-load counts, the tokens its routing rows refer to, token
summaries). What the checks and summaries after the insert need to know of the whole file stays on the object:
its keys (order, runs, step range), whether its expert-load counts were summed, its token summaries.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa

from analysis.ingest import precision, summary_stream
from analysis.ingest.keys import StepCounts, TableKeys, TokenFlips, expert_load, routing_tokens
from analysis.ingest.validate import Batch, normalise
from analysis.key_runs import run_codes
from analysis.summaries import fulldist
from analysis.summaries import schema as S

# The temporary table of the tokens that key-ordered routing rows refer to, one row each with its flip counts
# (keys.TokenFlips), filled while the file streams.
STAGED_TOKENS = "_staged_routing_tokens"
# Tables whose rows are side rows of a load (stream.insert_items): appended between the streamed INSERTs.
SIDE_TABLES = ("expert_load", STAGED_TOKENS, *summary_stream.TOKEN_TABLES)


def with_file_id(data: pa.Table, fid: int) -> pa.Table:
    """`data` with the file_id column of file `fid`."""
    return data.append_column("file_id", pa.array(np.full(data.num_rows, fid, np.int32)))


class FileRows:
    """The per-batch state of one file's load.

    `summarised`: the file's token rows are a sample whose summaries (and expert load) come in a summary file of
    their own. `large`: the file's token summaries are appended to the summary tables as they come; a small
    file's wait in `held` and go with its transaction's other summary rows."""

    def __init__(self, name: str, fid: int, run: str | None, summarised: bool, large: bool):
        self.name, self.fid, self.run, self.summarised = name, fid, run, summarised
        self.keys = {t: TableKeys(t) for t in ("tokens", "routing", "sequences", "topk")}
        self.topk = TopkSums()  # the full-distribution sums of the file's top-k rows (schema.TOPK_SUMS)
        self.counts = StepCounts()  # expert-load rows summed across batches where the file is in key order
        self.flips = TokenFlips()  # the tokens key-ordered routing rows refer to, one row each
        self.summaries = None if summarised else summary_stream.StepSummaries()
        self.held: list[tuple[str, pa.Table]] | None = None if large or summarised else []
        self.floor: float | None = None  # the log-probs' rounding (precision.py), judged on the first token batch
        self._floor_seen = False

    def items(self, batches: Iterable[Batch], w) -> Iterator[tuple[str, pa.Table]]:
        """(table, rows) to insert: each batch checked, its rows (with run codes of the Writer `w`) and the side
        rows it adds, then the side rows held back for the file's end."""
        for batch in batches:
            yield from self._batch(batch, w)
        yield from self._side("expert_load", self.counts.finish())
        if self.keys["routing"].ordered:
            yield from self._side(STAGED_TOKENS, self.flips.finish())
        if self.summaries is not None:
            yield from self._summary_rows(self.summaries.finish())

    def _batch(self, batch: Batch, w) -> Iterator[tuple[str, pa.Table]]:
        # runs: the run_codes of the run column, found once per batch for the keys, summaries and rows
        data, experts, runs = normalise(self.name, batch, self.run, self.fid)
        if data.num_rows == 0:
            return
        keys = self.keys[batch.table]
        keys.add(data, runs)
        if batch.table == "tokens" and not self._floor_seen:
            self.floor, self._floor_seen = precision.logprob_floor(data), True
        if batch.table == "tokens" and self.summaries is not None:
            # in the worker that checks a large file's batches: a thread of their own did not pay once the file was
            # read in another (the 40M-token tokens file alone took 0.18 s longer with it, six pairs)
            yield from self._summary_rows(self.summaries.feed(data, runs))
        if batch.table == "topk":
            if not self.summarised:
                self.topk.add(data, experts, runs)
            experts = None
        if experts is not None:
            # per-batch results go to the database, which spills: nothing here grows with the file
            if not self.summarised:
                part = expert_load(data, experts.S, experts.T, experts.t_rows, runs)
                yield from self._side("expert_load", self.counts.add(part, keys.ordered))
            if keys.ordered:
                yield from self._side(STAGED_TOKENS, self.flips.add(routing_tokens(data)))
        yield batch.table, w.coded(batch.table, data, runs)

    def _side(self, table: str, part: pa.Table | None) -> Iterator[tuple[str, pa.Table]]:
        if part is not None:
            yield table, with_file_id(part, self.fid) if table == "expert_load" else part

    def _summary_rows(self, out: list[tuple[str, pa.Table]]) -> Iterator[tuple[str, pa.Table]]:
        if self.held is None:
            yield from ((table, with_file_id(data, self.fid)) for table, data in out)
        else:
            self.held.extend(out)

    def runs(self) -> list[str]:
        return sorted(set().union(*(k.runs for k in self.keys.values())))

    def keep_summaries(self, tx) -> bool:
        """Store the token summaries computed while the file streamed (already appended to the summary tables, or
        `held` rows that join the transaction's other summary rows); False where the stream gave up, after
        deleting the rows it appended before (the caller then runs the SQL)."""
        s = self.summaries
        if s is None:
            return False
        if not s.ok:
            if self.held is None and s.emitted:
                for table in summary_stream.TOKEN_TABLES:
                    tx.w.execute(f"DELETE FROM {table} WHERE file_id = ?", [self.fid])
            return False
        for table, data in self.held or ():
            tx.append(table, with_file_id(data, self.fid))
        return True


class TopkSums:
    """schema.TOPK_SUMS per (run, step, sample) of a file's top-k rows, summed batch by batch (any order): the
    summary_seq rows and, their totals per step, the summary_step rows (n_tokens 0 both) that carry the file's
    full-distribution columns."""

    def __init__(self):
        self._sums: dict[tuple[str, int, int], np.ndarray] = {}

    def add(self, data: pa.Table, mats: dict[str, np.ndarray], runs=None) -> None:
        names, index = runs if runs is not None else run_codes(data.column("run"))
        step = data.column("step").to_numpy()
        sample = data.column("sample").to_numpy()
        keys, group = np.unique(np.stack([np.asarray(index), step, sample]), axis=1, return_inverse=True)
        sums = fulldist.topk_sums(mats["sampler_topk_ids"], mats["sampler_topk_logprobs"], mats["trainer_topk_ids"],
                                  mats["trainer_topk_logprobs"], group.reshape(-1).astype(np.int64), keys.shape[1])
        run_names = names.to_pylist()
        for g in range(keys.shape[1]):
            key = (run_names[int(keys[0, g])], int(keys[1, g]), int(keys[2, g]))
            self._sums[key] = self._sums.get(key, 0.0) + sums[g]

    def seq_rows(self, fid: int) -> pa.Table | None:
        """The summary_seq rows (one per sequence), with file_id `fid`; None without top-k rows."""
        return self._table(sorted(self._sums), [self._sums[k] for k in sorted(self._sums)], fid, sample=True)

    def rows(self, fid: int) -> pa.Table | None:
        """The summary_step rows, with file_id `fid`; None without top-k rows."""
        steps: dict[tuple[str, int], np.ndarray] = {}
        for k in sorted(self._sums):  # in key order: a step's sequences added in one order
            steps[k[:2]] = steps.get(k[:2], 0.0) + self._sums[k]
        return self._table(sorted(steps), [steps[k] for k in sorted(steps)], fid)

    @staticmethod
    def _table(keys: list[tuple], sums: list[np.ndarray], fid: int, sample: bool = False) -> pa.Table | None:
        if not keys:
            return None
        v = np.array(sums)
        cols = {"run": pa.array([k[0] for k in keys], pa.string()), "step": pa.array([k[1] for k in keys], pa.int64())}
        if sample:
            cols["sample"] = pa.array([k[2] for k in keys], pa.int64())
        cols["n_tokens"] = pa.array(np.zeros(len(keys), np.int64))
        for j, name in enumerate(S.TOPK_SUM_NAMES):
            cols[name] = pa.array(np.rint(v[:, j]).astype(np.int64) if name.startswith("n_") else v[:, j])
        return with_file_id(pa.table(cols), fid)
