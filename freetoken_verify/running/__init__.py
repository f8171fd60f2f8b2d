"""One run of the harness, from typed options to written reports: the plan, the rank groups per TP
size, the inputs checked before any rank starts, progress, `--list` and the bug-catalogue runner."""
