"""`freetoken plan` and the layout it prints (freetoken.loading.describe): the rows and columns
printed for a rank are the ones its shard holds, packed tensors name their segments, and bad
input is one line with exit 2."""

from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner

from freetoken.cli import main
from freetoken.loading.checkpoint import CheckpointReader
from freetoken.loading.describe import describe_tensor
from freetoken.models.registry import load_config, shard_plan
from freetoken_verify.cases.catalogue import resolve_case

_RUN = re.compile(r"(-?\d+):(\d+)")


def _make_layout(case: str, tp: int, name: str):
    folder = resolve_case(case).folder
    reader = CheckpointReader(folder)
    shape, _ = reader.meta(name)
    layout = describe_tensor(shard_plan(load_config(folder), tp), name, shape)
    return layout, reader.get(name)


def _indices(text: str, what: str) -> list[int] | None:
    """The indices of `what` (rows, cols) a rank line lists, None when it lists none (whole)."""
    part = next((p for p in text.split("; ") if p.startswith(what + " ")), None)
    if part is None:
        return None
    return [i for a, b in _RUN.findall(part) for i in range(int(a), int(b))]


def _assert_rank_holds(layout, full: torch.Tensor, rank: int, tp: int, spec) -> None:
    """Rank `rank`'s shard is `full` at the rows and columns its line names."""
    rows, cols = _indices(layout.ranks[rank], "rows"), _indices(layout.ranks[rank], "cols")
    expected = full
    if rows is not None:
        expected = expected[rows]
    if cols is not None:
        expected = expected[:, cols]
    got = spec.shard(full, rank, tp, layout.name)
    assert torch.equal(got, expected), f"{layout.name} rank {rank}: {layout.ranks[rank]!r}"


@pytest.mark.parametrize("case,tp", [("tiny-llama", 2), ("tiny-qwen3.5-moe", 4)])
def test_printed_rows_and_columns_are_what_each_rank_holds(case, tp):
    """For every unpadded tensor of the case, indexing the full tensor with the printed rows
    and columns gives exactly rank r's shard."""
    folder = resolve_case(case).folder
    plan = shard_plan(load_config(folder), tp)
    reader = CheckpointReader(folder)
    checked = 0
    for name in reader.names():
        target = plan.resolve(name)
        if target.param is None or "padding" in " ".join(
                describe_tensor(plan, name, reader.meta(name)[0]).ranks):
            continue
        layout, full = _make_layout(case, tp, name)
        for rank in range(tp):
            _assert_rank_holds(layout, full, rank, tp, target.rule.spec)
        checked += 1
    assert checked > 10, f"only {checked} tensors checked"


def test_gdn_in_proj_qkv_lists_its_segments_per_rank():
    """in_proj_qkv at tp=4: every rank line names q, k and v, and the q rows of the ranks
    tile the q segment in rank order."""
    name = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
    layout, _ = _make_layout("tiny-qwen3.5-moe", 4, name)
    cfg = load_config(resolve_case("tiny-qwen3.5-moe").folder)
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    q_rows = []
    for line in layout.ranks:
        assert re.search(r"rows q \d+:\d+, k \d+:\d+, v \d+:\d+$", line), line
        q_rows += _indices(line.split(", k")[0], "rows")
    assert q_rows == list(range(key)), layout.ranks


def test_plan_command_prints_the_tensor_and_exits_0():
    """`freetoken plan --tensor` prints only the matching tensor, with rule, spec and one
    line per rank; `-h` is help."""
    folder = str(resolve_case("tiny-qwen3.5-moe").folder)
    result = CliRunner().invoke(main, ["plan", "--model", folder, "--tp", "4", "--tensor",
                                       r"layers\.0\.linear_attn\.in_proj_qkv"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("model.language_model.layers.0.linear_attn.in_proj_qkv"), lines
    assert sum(line.startswith("  rank ") for line in lines) == 4, lines
    assert "Segments" in result.output, lines
    assert CliRunner().invoke(main, ["plan", "-h"]).exit_code == 0
    assert "plan" in CliRunner().invoke(main, ["-h"]).output


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "num_attention_heads=8 cannot be split across tp_size=3"),
    (["--tp", "2", "--tensor", "("], "is not a regex"),
    (["--tp", "2", "--tensor", "no_such_tensor"], "no checkpoint tensor matches"),
])
def test_plan_command_bad_input_is_one_line_and_exit_2(args, message):
    """An unsplittable TP size, a broken regex or a regex that matches nothing: exit 2 with
    one `error:` line naming the problem."""
    folder = str(resolve_case("tiny-llama").folder)
    result = CliRunner().invoke(main, ["plan", "--model", folder, *args])
    assert result.exit_code == 2, result.output
    assert result.output.strip().count("\n") == 0 and message in result.output, result.output
