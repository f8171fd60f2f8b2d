"""Shared fixtures: the bundled case folders and a CPU-only, single-threaded torch."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

# FreeToken's pytest plugin (markers `gpu` / `multi_gpu(n)`, fixture `freetoken_verify`) is
# registered through the `pytest11` entry point; an editable install made before that entry
# point existed does not advertise it, so load it by name (a no-op when the entry point, which
# carries the same name, already loaded it).
pytest_plugins = ["freetoken_verify.pytest_plugin"]

GOLDEN = Path(__file__).resolve().parent.parent / "freetoken_verify" / "golden"
BUNDLED = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"]


def pytest_configure(config):
    # Two xdist workers on two cores: more intra-op threads only contend.
    torch.set_num_threads(1)
    # Tests send SIGINT to the commands they start and want Ctrl-C's behaviour. A run started
    # as a background job of a shell without job control inherits SIGINT ignored, and so
    # would every child (an ignored signal stays ignored across exec): take Python's
    # handler, which children reset to the default at exec.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # The ranks of every group a test starts (the engine's, the harness's, the tests' own)
    # fork from one forkserver per test process: it imports what they import, once.
    from freetoken.distributed import preload_in_ranks
    from freetoken_verify.checks.ranks import RANK_MODULES

    preload_in_ranks(*RANK_MODULES)


# The modules with the longest tests (20-60 s each on two cores), longest first: they start
# first, so that under xdist no worker is left with one of them while the other has finished.
LONG_FIRST = ("verify/test_gpu_gate.py", "engine/test_kernel_paths.py",
              "models/test_qwen3_5_moe_nvfp4.py", "invariance/test_bitwise_tp.py",
              "engine/test_tp_invariant_option.py", "kernels/test_nvfp4_mma.py",
              "verify/test_shards_formats.py", "verify/test_quantized_cases.py",
              "verify/test_memory_check.py", "verify/test_api.py")


def pytest_collection_modifyitems(config, items):
    """`LONG_FIRST`'s modules run first, in its order; every other test keeps its place."""
    def rank(item) -> int:
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)


@pytest.fixture(scope="session")
def golden() -> Path:
    return GOLDEN


@pytest.fixture(autouse=True)
def _twin_cache(tmp_path_factory, monkeypatch):
    """Dequantized twins (HF's reference for a quantized checkpoint) go to one temporary
    cache per test session, never into the user's ~/.cache."""
    monkeypatch.setenv("FREETOKEN_TWIN_CACHE", str(tmp_path_factory.getbasetemp() / "twins"))


def assert_matches_hf(results, ref: dict, label: str, decode_logits: bool = False) -> None:
    """Engine results agree with an HF reference (`freetoken_verify.cases.catalogue.hf_reference`):
    prefill logits within rtol=atol=1e-4, greedy ids exactly, and optionally the decode-step
    logits within rtol 1e-4, atol 2e-4: 24 steps through the recurrent state add fp32
    rounding, and under torch's scalar kernels (ATEN_CPU_CAPABILITY=default) one step logit
    of an 81-token prompt differed from HF's by 1.1e-4."""
    for i, result in enumerate(results):
        torch.testing.assert_close(result.prompt_logits, ref[f"prefill_logits_{i}"], rtol=1e-4,
                                   atol=1e-4, msg=lambda m, i=i: f"{label} prompt {i}: {m}")
        assert result.token_ids == ref[f"greedy_ids_{i}"].tolist(), (
            f"{label} prompt {i}: greedy {result.token_ids} != HF "
            f"{ref[f'greedy_ids_{i}'].tolist()}")
        if decode_logits:
            torch.testing.assert_close(result.logits, ref[f"greedy_logits_{i}"], rtol=1e-4,
                                       atol=2e-4,
                                       msg=lambda m, i=i: f"{label} prompt {i} decode: {m}")


def record_modules(core, prompt: list[int], max_tokens: int = 1) -> dict:
    """Every module's capture (`freetoken_verify.activations.engine.Recorder`) of one TP=1
    run of `prompt` on EngineCore `core` with `max_tokens` new tokens, by key."""
    from freetoken.engine.sequence import SamplingParams
    from freetoken_verify.activations.engine import Recorder

    recorder = Recorder(core.model, core.model_config, 1)
    recorder.phase("prefill", len(prompt))
    try:
        core.generate([prompt], [SamplingParams(max_tokens=max_tokens, ignore_eos=True)])
    finally:
        recorder.remove()
    return {c.key: c for c in recorder.captures}


def case_differences(written: Path, golden: Path) -> list[str]:
    """How a freshly written golden case differs from the committed one. Configs, weights
    (meta.json records their SHA-256) and token ids must be the same bytes; the float tensors
    of reference.safetensors and bisect.safetensors (HF's fp32 logits and module outputs)
    may differ by what another CPU's SIMD kernels
    round differently (atol 1e-4 + rtol 1e-5: observed 5e-6 on logits of magnitude 4), and
    meta.json's bf16 / fp16 baselines by 0.05 absolute or 10 % relative per number (the
    positions of their maxima not compared): `make golden` pins its numerics
    (`freetoken_verify.cases.numerics`), these bounds are for what the pin leaves."""
    def close(a, b, path: str, out: list[str]):
        if isinstance(a, dict) and isinstance(b, dict):
            if sorted(a) != sorted(b):
                out.append(f"{path}: keys {sorted(a)} != {sorted(b)}")
            for k in a.keys() & b.keys():
                if not k.endswith("_position"):     # where a maximum falls moves with it
                    close(a[k], b[k], f"{path}.{k}", out)
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                out.append(f"{path}: {len(a)} != {len(b)} entries")
            for i, (x, y) in enumerate(zip(a, b)):
                close(x, y, f"{path}[{i}]", out)
        elif isinstance(a, float) and isinstance(b, (int, float)):
            if not math.isclose(a, b, rel_tol=0.1, abs_tol=0.05):
                out.append(f"{path}: {a} != {b}")
        elif a != b:
            out.append(f"{path}: {a!r} != {b!r}")

    problems = []
    names = sorted(p.name for p in golden.iterdir())
    if names != sorted(p.name for p in written.iterdir()):
        return [f"files {sorted(p.name for p in written.iterdir())} != {names}"]
    for name in names:
        new, old = written / name, golden / name
        if name == "meta.json":
            a, b = json.loads(new.read_text()), json.loads(old.read_text())
            close(a.pop("baselines", None), b.pop("baselines", None), "meta.baselines", problems)
            if a != b:
                problems.append("meta.json differs outside its baselines")
        elif name in ("reference.safetensors", "bisect.safetensors"):
            a, b = load_file(new), load_file(old)
            if sorted(a) != sorted(b):
                problems.append(f"{name} tensors {sorted(a)} != {sorted(b)}")
            for k in sorted(a.keys() & b.keys()):
                x, y = a[k], b[k]
                if x.dtype != y.dtype or x.shape != y.shape:
                    problems.append(f"{name} {k}: {x.dtype} {tuple(x.shape)} != "
                                    f"{y.dtype} {tuple(y.shape)}")
                elif not (torch.allclose(x, y, rtol=1e-5, atol=1e-4) if x.is_floating_point()
                          else torch.equal(x, y)):
                    problems.append(f"{name} {k} differs")
        elif new.read_bytes() != old.read_bytes():
            problems.append(f"{name} differs")
    return problems


def run_compiled(args: list[str], timeout: int = 600):
    """`python args...` in a fresh process from the repository root, without
    TRITON_INTERPRET: Triton kernels there compile instead of running in the interpreter,
    which `freetoken.kernels.use_interpreter` switches on for a whole test process."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=root, timeout=timeout)


def make_broken_checkpoint(golden: Path, tmp_path: Path) -> Path:
    """tiny-llama with one k_proj weight of the wrong shape: every rank fails while loading
    (the headers are fine, so nothing refuses it before the ranks start)."""
    folder = tmp_path / "broken"
    shutil.copytree(golden / "tiny-llama", folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def short_tmpdir(tmp_path: Path) -> Path:
    """A TMPDIR for a subprocess that starts rank groups, created empty: under the system's
    temp folder with a short name derived from `tmp_path`. multiprocessing puts its unix
    sockets there, and a socket path is limited to 107 bytes, which pytest's own paths under
    xdist (`.../popen-gw1/test_<long id>_0/tmp/pymp-*/listener-*`) exceed."""
    digest = hashlib.sha1(str(tmp_path).encode()).hexdigest()[:10]
    folder = Path(tempfile.gettempdir()) / f"ft-{digest}"
    folder.mkdir(exist_ok=True)
    return folder


def shards_audit(folder, tp: int, rank: int = 0) -> dict:
    """The shards check's audit (`failures` and counts) of rank `rank` of `tp` on checkpoint
    `folder`, in this process: parameter shapes follow the TP identity, set for the call and
    forgotten after."""
    from types import SimpleNamespace

    from freetoken.distributed import TPInfo, reset_tp_info, set_tp_info
    from freetoken_verify.checks.shards import check as shards

    engine_args = {"folder": str(folder), "dtype": "auto", "num_layers": None}
    reset_tp_info()
    set_tp_info(TPInfo(rank, tp))
    try:
        return shards._audit(SimpleNamespace(rank=rank, size=tp, state={}), engine_args)
    finally:
        reset_tp_info()
