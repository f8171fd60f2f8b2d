"""`freetoken generate` from the command line: a working run, a TP size that cannot split the
model and bad sampling values or prompt ids (exit 2, one line, before any rank starts), and a
rank that fails while loading (exit 2 naming the rank, no rank process left behind); SIGTERM
while generating stops everything with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
from conftest import GOLDEN, make_broken_checkpoint


def _run_cli(*args: str, tag: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, FREETOKEN_TEST_TAG=tag or uuid.uuid4().hex)
    return subprocess.run([sys.executable, "-m", "freetoken.cli", "generate", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def _tagged_processes(tag: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("FREETOKEN_TEST_TAG") == tag:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def test_generate_prints_text_and_ids():
    """A TP=2 run over the bundled tokenizer prints the decoded text and the new token ids;
    its stderr, not a terminal, carries no progress bar."""
    result = _run_cli("--model", str(GOLDEN / "tiny-qwen3"), "--tp", "2", "--prompt", "hello",
                      "--prompt-ids", "1,2,3", "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ids:") == 2 and "text:" in result.stdout, result.stdout
    assert "\r" not in result.stderr and "loading:" not in result.stderr, result.stderr[-300:]


def test_one_vocabulary_with_the_harness():
    """`generate` takes a bundled case by name, `--max-new-tokens` (the harness's name; the old
    `--max-tokens` still works and gives the same ids) and the dtype aliases `fp32` / `bf16`;
    `plan` takes case names too; `freetoken --version` names the version and commit."""
    new = _run_cli("--model", "tiny-llama", "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                   "--dtype", "fp32")
    old = _run_cli("--model", str(GOLDEN / "tiny-llama"), "--prompt-ids", "1,2,3",
                   "--max-tokens", "3", "--dtype", "float32")
    assert new.returncode == 0 and old.returncode == 0, new.stderr + old.stderr
    ids = [line for line in new.stdout.splitlines() if line.startswith("ids:")]
    assert len(ids) == 1 and ids[0].count(",") == 2 and new.stdout == old.stdout, new.stdout
    plan = subprocess.run([sys.executable, "-m", "freetoken.cli", "plan", "--model",
                           "tiny-llama", "--tp", "2", "--tensor", "embed"],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0 and "rank 1: rows 151:301" in plan.stdout, plan.stdout
    version = subprocess.run([sys.executable, "-m", "freetoken.cli", "--version"],
                             capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("freetoken "), version
    assert "(commit " in version.stdout, "run from a checkout: the commit is named"


def test_unsplittable_tp_is_a_one_line_usage_error():
    """tp=3 cannot split 8 attention heads: exit 2 with one line naming the dimension, before
    any rank starts."""
    result = _run_cli("--model", str(GOLDEN / "tiny-llama"), "--tp", "3", "--prompt-ids", "1")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: num_attention_heads=8 cannot be split across tp_size=3"], lines


def test_rank_failing_while_loading_names_the_rank_and_leaves_nothing(tmp_path):
    """A checkpoint whose k_proj has the wrong shape makes the ranks raise while loading: bad
    input, so the command exits 2 with a line naming a rank and the tensor, and no process
    it started survives."""
    folder = make_broken_checkpoint(GOLDEN, tmp_path)
    tag = uuid.uuid4().hex
    result = _run_cli("--model", str(folder), "--tp", "2", "--prompt-ids", "1,2", tag=tag)
    assert result.returncode == 2, result.stderr
    # Before it only the loading progress bar (rank 0) may be on stderr, not a traceback.
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank ") and "k_proj.weight" in last, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    deadline = time.monotonic() + 10
    while _tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tagged_processes(tag), "rank processes survived the failed command"


def test_bad_sampling_and_empty_model_are_one_line_usage_errors():
    """`--temperature nan`, a seed past 2**63 and `--model ''` (an unset variable) exit 2 with
    one line, before any rank starts."""
    tiny = str(GOLDEN / "tiny-llama")
    for args, needle in ((["--model", tiny, "--temperature", "nan"],
                          "temperature must be a finite number"),
                         (["--model", tiny, "--temperature", "1", "--seed", str(2**64)],
                          "seed must be in [0, 2**63), got 18446744073709551616"),
                         (["--model", ""], "empty model name")):
        result = _run_cli(*args, "--tp", "2", "--prompt-ids", "1")
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr


def test_prompt_ids_outside_the_vocabulary_refused_before_any_rank_starts(tmp_path):
    """`--tp 2 --prompt-ids 1,99999` is refused from the config's vocabulary before any rank
    starts: on a checkpoint whose weights cannot load, the vocabulary error is the one line
    printed (ranks that had started would have failed loading first)."""
    folder = make_broken_checkpoint(GOLDEN, tmp_path)
    result = _run_cli("--model", str(folder), "--tp", "2", "--prompt-ids", "1,99999")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert lines == ["error: prompt 0: token ids [99999] outside the vocabulary [0, 301)"], lines


def test_sigterm_while_generating_stops_everything(tmp_path):
    """SIGTERM while the ranks generate: exit 143 with the one line `interrupted by SIGTERM:
    rank processes stopped` (the driver thread and the signal's unwinding must not both close
    the rank group's pipes: that was an `OSError: Bad file descriptor` traceback, exit 1), no
    rank process left and the group's directory removed."""
    tag = uuid.uuid4().hex
    prompts = [arg for k in range(64) for arg in ("--prompt-ids", f"{k + 1},2")]
    env = dict(os.environ, FREETOKEN_TEST_TAG=tag, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "freetoken.cli", "generate", "--model",
                             str(GOLDEN / "tiny-llama"), "--tp", "2", *prompts, "--max-tokens",
                             "500", "--ignore-eos"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_ranks_generating(tag, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-2000:]
    assert stderr.strip().splitlines()[-1:] == ["interrupted by SIGTERM: rank processes "
                                                "stopped"] and "Traceback" not in stderr, stderr
    assert not list(tmp_path.glob("freetoken-ranks-*")), list(tmp_path.iterdir())
    deadline = time.monotonic() + 10
    while _tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tagged_processes(tag), "rank processes survived SIGTERM"


def _wait_ranks_generating(tag: str, parent: subprocess.Popen) -> None:
    """Until a rank has spent a second of CPU (loading the tiny model takes a fraction).
    Ranks are the fork server's children: the server itself (the parent's child) spends
    seconds importing torch."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert parent.poll() is None, f"generate ended before the signal: {parent.stderr.read()}"
        for pid in _tagged_processes(tag):
            try:
                rank = psutil.Process(pid)
                if parent.pid not in (pid, rank.ppid()) and rank.cpu_times().user >= 1.0:
                    return
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError("the ranks never started generating")
