"""The reference prompts the user chooses: `--prompts-file` (text tokenized with the model's
tokenizer, or JSON lists of ids checked against the vocab), `--seed` and `--max-new-tokens`.
Bad prompts are refused before any rank starts, naming the file, prompt and position."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_run import assert_refused, run_cli
from conftest import GOLDEN

from freetoken_verify.cases.catalogue import PROMPT_LENS, reference_prompts, resolve_case
from freetoken_verify.cases.tiny import VOCAB
from freetoken_verify.checks import VerifyOptions
from freetoken_verify.reference.sources import prompts_for, reference_source


def _make_file(tmp_path: Path, name: str, content) -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_text_prompts_round_trip_through_the_tokenizer(tmp_path):
    """Each non-empty line becomes one prompt whose ids decode back to that line; a bundled
    case with user prompts is compared with live HF, not its stored golden."""
    from transformers import AutoTokenizer

    lines = ["the quick brown fox", "tensor parallel inference splits every weight"]
    path = _make_file(tmp_path, "p.txt", "\n".join([lines[0], "", lines[1]]) + "\n")
    case = resolve_case("tiny-llama")
    options = VerifyOptions(prompts_file=str(path))
    prompts, num_new = prompts_for(case, options)
    tokenizer = AutoTokenizer.from_pretrained(case.folder)
    assert [tokenizer.decode(p, skip_special_tokens=True) for p in prompts] == lines
    assert num_new == 16 and reference_source(case, options) == "hf"


def test_seed_and_max_new_tokens_choose_the_random_prompts():
    """`--seed N` gives the seeded prompts of seed N (default 0), `--max-new-tokens` the
    continuation length; different seeds give different prompts."""
    case = resolve_case("tiny-qwen3")
    default, _ = prompts_for(case, VerifyOptions(reference="hf"))
    seeded, num_new = prompts_for(case, VerifyOptions(seed=7, max_new_tokens=5))
    assert default == reference_prompts(0, PROMPT_LENS, VOCAB)
    assert seeded == reference_prompts(7, PROMPT_LENS, VOCAB) and seeded != default
    assert num_new == 5


@pytest.mark.parametrize("content, needle", [
    ([[1, 2], [3, 301]], "prompt 1 position 1: token id 301 is outside tiny-llama's vocab"),
    ([[1, 2], [3, "a"]], "prompt 1 position 1: 'a' is not a token id"),
    ([[1, -1]], "prompt 0 position 1: -1 is not a token id"),
    ([[1], []], "prompt 1 is not a non-empty list"),
    ({"prompts": [[1]]}, "must hold a non-empty list of lists"),
    ("[[1, 2]", "is not valid JSON"),
])
def test_bad_json_prompts_are_refused(capsys, tmp_path, content, needle):
    """A JSON prompts file with a bad id names the prompt and position."""
    path = _make_file(tmp_path, "p.json", content)
    assert_refused(capsys, ["--model", "tiny-llama", "--tp", "1", "--prompts-file", str(path)],
                   needle)


def test_text_prompts_need_a_tokenizer(capsys, tmp_path):
    """Text prompts for a checkpoint without a tokenizer: one line asking for token ids."""
    folder = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / "tiny-llama", folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "meta.json"):
        (folder / name).unlink()
    path = _make_file(tmp_path, "p.txt", "hello world\n")
    assert_refused(capsys, ["--model", str(folder), "--tp", "1", "--prompts-file", str(path)],
                   "has no usable tokenizer", ".json")


def test_other_prompt_refusals(capsys, tmp_path):
    """An empty or missing file, a prompt too long for the model, or user prompts with the
    stored golden."""
    empty = _make_file(tmp_path, "empty.txt", "\n \n")
    assert_refused(capsys, ["--model", "tiny-llama", "--prompts-file", str(empty)],
                   "no non-empty line")
    long = _make_file(tmp_path, "long.json", [[1] * 510])
    assert_refused(capsys, ["--model", "tiny-llama", "--prompts-file", str(long)],
                   "prompt 0 (510 tokens) plus 16 new tokens exceeds")
    assert_refused(capsys, ["--model", "tiny-llama", "--reference", "golden", "--seed", "3"],
                   "stored golden covers its own prompts")
    assert_refused(capsys, ["--model", "tiny-llama", "--prompts-file", str(tmp_path / "no.txt")],
                   "--prompts-file: cannot read", "no.txt")


def test_json_prompts_drive_the_golden_check(capsys, tmp_path):
    """JSON prompts and --max-new-tokens reach the engine and the live HF reference: golden
    passes and counts exactly prompts x new tokens greedy steps."""
    path = _make_file(tmp_path, "p.json", [[5, 6, 7], [300, 0, 150, 151, 2]])
    report = tmp_path / "r.json"
    code, out, err = run_cli(capsys, "--model", "tiny-llama", "--tp", "1", "--checks", "golden",
                          "--prompts-file", str(path), "--max-new-tokens", "3", "--seed", "9",
                          "--report-json", str(report))
    assert code == 0, out + err
    metrics = json.loads(report.read_text())["results"][0]["metrics"]
    assert metrics["greedy_total"] == 2 * 3, metrics
