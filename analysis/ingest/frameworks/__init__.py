"""Importers for RL frameworks' own dumps (FORMATS.md): prime-rl token exports and annotated traces, slime and
miles `--dump-details`, verl per-step batch dumps. Each turns its layout into SCHEMA.md's canonical batches; `load.py` registers
their folder adapters and readers.
"""
from analysis.ingest.frameworks import miles, primerl, primerl_traces, slime, verl

# Order matters only for files two layouts could both claim; the verl sniffer skips slime's folders, slime's
# adapter skips miles' (train_data/{id}_{rank}.pt).
FOLDER_ADAPTERS = (primerl.adapter, primerl_traces.adapter, miles.adapter, slime.adapter, verl.adapter)
# Dict layouts the generic tensor reader hands over (a lone verl dump, outside a folder the adapter claims).
TENSOR_LAYOUTS = ((miles.is_train_dump, miles.lone_train_dump), (verl.is_verl_dict, verl.dict_batches))

__all__ = ["FOLDER_ADAPTERS", "TENSOR_LAYOUTS", "miles", "primerl", "primerl_traces", "slime", "verl"]
