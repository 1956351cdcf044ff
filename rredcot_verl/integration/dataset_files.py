"""The local training and validation files as verl reads them, for the launch checks (thin).

verl 0.9.1's ``RLHFDataset`` takes ``.parquet`` files, and ``.json`` / ``.jsonl`` files through ``datasets``' JSON
loader (``verl/utils/dataset/rl_dataset.py``); anything else it refuses when it builds the dataset, after Ray has
started. The launch checks read a few columns or the first rows of the same files: parquet with pyarrow (one column
at a time, cheap), JSON with the loader verl uses, so that both read the same rows.
"""

from __future__ import annotations

from pathlib import Path

PARQUET = ".parquet"
JSON = (".json", ".jsonl")
VERL_FORMATS = (PARQUET, *JSON)


def format_refusal(file, key: str) -> str | None:
    """The one-line refusal of a local file verl cannot read (by its ending, as verl decides), or None."""
    if str(file).endswith(VERL_FORMATS):
        return None
    return (f"{key} file {str(file)!r} is neither parquet nor JSON: verl reads {', '.join(VERL_FORMATS)} files "
            "(by their ending)")  # fmt: skip


def _json_rows(file):
    import datasets

    return datasets.load_dataset("json", data_files=str(file))["train"]


def column_names(file) -> list[str]:
    """The file's columns."""
    if str(file).endswith(PARQUET):
        import pyarrow.parquet as pq

        return list(pq.read_schema(file).names)
    return list(_json_rows(file).column_names)


def read_column(file, column: str) -> list:
    """Every row's ``column`` (the file must have it: ``column_names``)."""
    if str(file).endswith(PARQUET):
        import pyarrow.parquet as pq

        return pq.read_table(file, columns=[column]).column(0).to_pylist()
    return list(_json_rows(file)[column])


def first_rows(file, columns, count: int) -> list[dict]:
    """The first ``count`` rows (all where fewer), each a dict of those of ``columns`` the file has."""
    present = [column for column in columns if column in column_names(file)]
    if str(file).endswith(PARQUET):
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(file).iter_batches(batch_size=count, columns=present), None)
        return [] if batch is None else batch.to_pylist()
    rows = _json_rows(file)
    return rows.select(range(min(count, len(rows)))).select_columns(present).to_list()


def is_local_file(file) -> bool:
    """A file on this machine (not a ``scheme://`` location verl copies at start)."""
    return "://" not in str(file) and Path(str(file)).is_file()
