"""shards: what every rank holds against layout statements written from the config alone
(`check.py`, `layouts.py`, `layout_book.py`, `linears.py`, `layout_compare.py`)."""
