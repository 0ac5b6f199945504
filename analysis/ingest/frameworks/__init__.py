"""Importers for RL frameworks' own dumps (FORMATS.md): prime-rl token exports, slime `--dump-details`,
verl per-step batch dumps. Each turns its layout into SCHEMA.md's canonical batches; `load.py` registers
their folder adapters and readers.
"""
from analysis.ingest.frameworks import primerl, slime, verl

# Order matters only for files two layouts could both claim; the verl sniffer skips slime's folders.
FOLDER_ADAPTERS = (primerl.adapter, slime.adapter, verl.adapter)
# Dict layouts the generic tensor reader hands over (a lone verl dump, outside a folder the adapter claims).
TENSOR_LAYOUTS = ((verl.is_verl_dict, verl.dict_batches),)

__all__ = ["FOLDER_ADAPTERS", "TENSOR_LAYOUTS", "primerl", "slime", "verl"]
