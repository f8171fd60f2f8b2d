"""Imported by the rank group's fork server only (a preload of `launch._mp_context`), never
by anything else: the fork server hands the signal dispositions it had after its preloads to
every process it forks, so a rank starts with SIGINT ignored. Otherwise a Ctrl-C that reaches
the terminal's process group while a rank is still starting up (unpickling its arguments,
importing the main module) prints a KeyboardInterrupt traceback from that rank, after the
parent's own last line; the parent alone decides teardown."""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
