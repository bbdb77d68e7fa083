"""Local JSON data read through the datasets library's own JSON reader, keeping only the text.

The library takes the columns and types of every JSON record from the first 10 MiB of the
first file and casts each later chunk to them: a field that appears later (`meta`), a column
that was null at first and holds values later, or an int column that later holds 2.5 stopped
the run hours in (CastError, ArrowInvalid), though training reads one column. This builder
drops the other columns from each chunk before that cast, so only the text column's type is
inferred and checked. The stream, its shards and its saved position are the library's, so
checkpoints and resumes are unchanged (rows are never dropped: a chunk without the column
becomes empty documents).

This subclasses the library's JSON builder and overrides `_cast_table`, a private method:
`datasets` is pinned in requirements.txt (and so in the image), and tests/unit/test_failures.py
checks the method is still there.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datasets import IterableDatasetDict


def open_text_json(data_files: dict[str, list[str]], text_column: str) -> IterableDatasetDict:
    """The splits of local JSON (lines) files as streaming datasets of `text_column` alone."""
    builder = _text_json_builder()(data_files=data_files, text_column=text_column)
    return builder.as_streaming_dataset()


@cache
def _text_json_builder() -> type:
    """The builder class, made on first use: importing datasets takes seconds."""
    import pyarrow as pa
    from datasets.packaged_modules.json.json import Json, JsonConfig

    @dataclass
    class TextJsonConfig(JsonConfig):
        text_column: str = "text"

    class TextJson(Json):
        BUILDER_CONFIG_CLASS = TextJsonConfig

        def _cast_table(self, pa_table: pa.Table, json_field_paths=()) -> pa.Table:
            column, features = self.config.text_column, self.info.features
            if column in pa_table.column_names:
                pa_table = pa_table.select([column])
            elif features is not None and column in features:  # a chunk without any text
                kind = features.arrow_schema.field(column).type
                pa_table = pa.table({column: pa.nulls(pa_table.num_rows, kind)})
            # else the first chunk lacks the column: left whole, so the reader names the
            # columns there are ("has no column 'body' (columns: ...)")
            return super()._cast_table(pa_table, json_field_paths)

    return TextJson
