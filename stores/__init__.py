"""rankkit's zarr v3 store: captured scores, tokens, spans and oracles, one group per example.

    w = stores.create("runs/a.zarr", run_meta)          # or resume: same run metadata required
    if not w.is_complete(example_id):
        w.write_example(example_id, attrs=..., tokens=..., scores={"fastkv": scores})
    s = stores.open("runs/a.zarr")                      # read-only
    s.scores_frame(reduce="sum")                        # example, probe, layer, token, score

Layout and crash-safety rules: ``rankkit.stores.schema`` and ``rankkit.stores.writer``; what a
read checks: ``rankkit.stores.manifest``; ``stores.verify(path)`` checks a whole store.
"""

from rankkit.names import decode_name, encode_name

from .reader import ArrayGroup, ExampleRecord, ReadOnce, Store, describe, open
from .schema import SCHEMA_VERSION, SCORE_DTYPE_KEY, SCORE_DTYPES, check_score_dtype
from .verify import VerifyReport, verify
from .writer import StoreWriter, check_removable, create, is_rankkit_store, remove

__all__ = [
    "SCHEMA_VERSION",
    "SCORE_DTYPES",
    "SCORE_DTYPE_KEY",
    "ArrayGroup",
    "ExampleRecord",
    "ReadOnce",
    "Store",
    "StoreWriter",
    "check_removable",
    "check_score_dtype",
    "VerifyReport",
    "create",
    "decode_name",
    "describe",
    "encode_name",
    "is_rankkit_store",
    "open",
    "remove",
    "verify",
]
