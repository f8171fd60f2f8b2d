"""Reports: the formats (`formats.py`: table, JSON, JUnit, markdown), the incremental writer, the
run's identity and the JSON schema."""
