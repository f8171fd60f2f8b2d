"""Hub ids `Org/Name[@revision]` resolve from the local Hugging Face cache (`HF_HUB_CACHE`)
without touching the network, to the snapshot of the revision asked for, and the case records
where it came from (`case.source`: hub id, revision, snapshot hash). A missing revision is a
one-line usage error; a download happens only with `--download`."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from conftest import GOLDEN

import freetoken.engine.resolve as resolve
from freetoken_verify.cases.catalogue import CaseError, resolve_case
from freetoken_verify.cli import main

_MAIN = "a" * 40
_V1 = "b" * 40


def _make_cache(tmp_path: Path, monkeypatch) -> Path:
    """A cache holding Org/Tiny at two commits: `main` -> _MAIN, tag `v1` -> _V1."""
    cache = tmp_path / "hub"
    repo = cache / "models--Org--Tiny"
    for commit, ref in ((_MAIN, "main"), (_V1, "v1")):
        snapshot = repo / "snapshots" / commit
        shutil.copytree(GOLDEN / "tiny-llama", snapshot)
        (snapshot / "meta.json").unlink()
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("arg, commit, revision", [
    ("Org/Tiny", _MAIN, "main"),
    ("Org/Tiny@v1", _V1, "v1"),
    (f"Org/Tiny@{_V1}", _V1, _V1),
])
def test_hub_id_resolves_to_the_cached_snapshot(tmp_path, monkeypatch, no_network, arg, commit,
                                                revision):
    """The revision picks the snapshot; the source names id, revision and snapshot hash."""
    _make_cache(tmp_path, monkeypatch)
    case = resolve_case(arg)
    assert case.folder.name == commit and not case.bundled
    assert case.source == {"path": str(case.folder), "hub_id": "Org/Tiny",
                           "revision": revision, "snapshot": commit}


def test_uncached_revision_is_refused_without_network(capsys, tmp_path, monkeypatch,
                                                       no_network):
    """A revision the cache lacks: exit 2, one line naming it and --download."""
    _make_cache(tmp_path, monkeypatch)
    with pytest.raises(CaseError, match="at revision 'v2'.*--download"):
        resolve_case("Org/Tiny@v2")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "Org/Tiny@v2", "--tp", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "Org/Tiny@v2" in err[0], err


def test_download_only_when_asked(tmp_path, monkeypatch):
    """Without --download the hub is asked for local files only; with it, it may download
    (configs, safetensors and tokenizer files only); with HF_HUB_OFFLINE set, --download is
    refused instead of silently ignored."""
    import huggingface_hub

    calls = []
    snapshot = _make_cache(tmp_path, monkeypatch) / "models--Org--Tiny" / "snapshots" / _V1

    def fake_snapshot_download(repo, revision=None, cache_dir=None, local_files_only=False,
                               allow_patterns=None, etag_timeout=None):
        assert "*.safetensors" in allow_patterns and "*.bin" not in allow_patterns
        assert etag_timeout == resolve.HUB_TIMEOUT, "file requests are bounded"
        calls.append((repo, revision, local_files_only))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(resolve, "_probe_hub", lambda repo, revision: calls.append("probe"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    resolve_case("Org/Other@v1")
    resolve_case("Org/Other@v1", download=True)
    assert calls == [("Org/Other", "v1", True), "probe", ("Org/Other", "v1", False)]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CaseError, match="HF_HUB_OFFLINE"):
        resolve_case("Org/Other@v1", download=True)


def test_local_cases_record_their_path(tmp_path):
    """A bundled case and a folder record their path (no hub fields)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / "tiny-qwen3", folder)
    assert resolve_case(str(folder)).source == {"path": str(folder.resolve())}
    assert resolve_case("tiny-qwen3").source == {"path": str(GOLDEN / "tiny-qwen3")}


def test_engine_commands_take_a_revision_from_the_cache(tmp_path, monkeypatch, no_network):
    """`LLM`, `freetoken generate` and `freetoken plan` resolve `Org/Name@revision` as the
    harness does (one resolver), from the cache, without a download hint they have no flag
    for."""
    from click.testing import CliRunner

    from freetoken.cli import main as freetoken_main
    from freetoken.engine.resolve import ModelNotFound, resolve_model

    _make_cache(tmp_path, monkeypatch)
    assert resolve_model("Org/Tiny@v1").name == _V1
    assert resolve_model("Org/Tiny").name == _MAIN
    out = CliRunner().invoke(freetoken_main, ["plan", "--model", "Org/Tiny@v1", "--tp", "2",
                                              "--tensor", "embed_tokens"])
    assert out.exit_code == 0 and "model.embed_tokens.weight" in out.output, out.output
    with pytest.raises(ModelNotFound, match="at revision 'v9'") as info:
        resolve_model("Org/Tiny@v9")
    assert "--download" not in str(info.value), str(info.value)


@pytest.fixture
def silent_endpoint(monkeypatch):
    """A hub endpoint on loopback that accepts connections and never answers, as HF_ENDPOINT;
    closed after the test."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    yield endpoint
    stop.set()
    thread.join(timeout=5)
    for conn in accepted:
        conn.close()
    server.close()


def test_download_from_an_endpoint_that_never_answers_is_bounded(tmp_path, monkeypatch,
                                                                  silent_endpoint):
    """`--download` against an endpoint that accepts and never answers fails within the hub
    timeout with one line naming the endpoint and the timeout (the hub client asks for the
    repository's metadata with no timeout: still waiting at 75 s before)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(resolve, "HUB_TIMEOUT", 1.0)
    start = time.monotonic()
    with pytest.raises(CaseError) as info:
        resolve_case("Org/Tiny", download=True)
    assert time.monotonic() - start < 60, "the download was not bounded"
    message = str(info.value)
    assert silent_endpoint in message and "did not answer within 1 s" in message, message
