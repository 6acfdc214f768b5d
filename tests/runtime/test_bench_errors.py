"""deepinfer-bench's bad input: one `error:` line and exit code 2, checked before the artifact loads or the server
is asked for work; online failures (a refused key, every request or some refused) are errors too, not a table of
NaN. The online cases need no server: nothing listens on a free port, and httpx's mock transport plays one."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from ports import free_port

from deepinfer.runtime import bench


def fails(capsys, *argv: str) -> str:
    """bench.main(argv) exits 2 with one `error:` line on stderr; returns that line."""
    with pytest.raises(SystemExit) as e:
        bench.main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def no_engine(monkeypatch):
    """Loading the engine fails the test: the flags' errors come first."""
    from deepinfer.runtime.engine import Engine
    monkeypatch.setattr(Engine, "from_artifact", lambda *a, **k: pytest.fail("the engine was loaded"))


@pytest.mark.parametrize("flags, names", [
    (["--prompt-lens", "abc"], "--prompt-lens 'abc'"),
    (["--prompt-lens", ""], "--prompt-lens ''"),
    (["--prompt-lens", "32,-5"], "--prompt-lens '32,-5'"),
    (["--concurrency", "x"], "--concurrency 'x'"),
    (["--concurrency", "4,0"], "--concurrency '4,0'"),
    (["--max-tokens", "0"], "--max-tokens 0 must be at least 1"),
    (["--prefix-len", "-1"], "--prefix-len -1 must be at least 0"),
    (["--seed", "-1"], "--seed -1 must be at least 0"),
    (["--max-tokens", "x"], "argument --max-tokens: invalid int value: 'x'"),
])
def test_offline_flags_are_checked_before_the_artifact_opens(flags, names, tmp_path, capsys, no_engine):
    err = fails(capsys, "offline", str(tmp_path / "missing"), *flags)
    assert names in err and "missing" not in err


def test_offline_prompts_past_the_context_limit_are_an_error(checkpoints, compile_artifact, capsys, no_engine):
    """The rows that do not fit were skipped silently (an all-skipped run printed an empty table, exit 0): now
    they are named with the limit, from the manifest alone. A 1-token request may fill the context (the engine's
    rule)."""
    art = str(compile_artifact(checkpoints["base"]))          # context limit 128
    err = fails(capsys, "offline", art, "--prompt-lens", "32,100,200", "--max-tokens", "32")
    assert "--prompt-lens 100,200" in err and "longer than 96 tokens" in err and "context limit 128" in err
    err = fails(capsys, "offline", art, "--prompt-lens", "129", "--max-tokens", "1")
    assert "--prompt-lens 129" in err and "longer than 128 tokens" in err
    assert "--max-tokens 200" in fails(capsys, "offline", art, "--prompt-lens", "8", "--max-tokens", "200")


def test_offline_tpot_of_one_token_is_na(checkpoints, compile_artifact, capsys):
    """--max-tokens 1: no tokens after the first, so no TPOT (was a ZeroDivisionError)."""
    art = str(compile_artifact(checkpoints["base"]))
    bench.main(["offline", art, "--prompt-lens", "6", "--concurrency", "2", "--max-tokens", "1", "--json"])
    [row] = json.loads(capsys.readouterr().out)
    assert row["tpot_ms_median"] != row["tpot_ms_median"] and row["ttft_ms_median"] > 0     # NaN
    bench.main(["offline", art, "--prompt-lens", "6", "--concurrency", "2", "--max-tokens", "1"])
    assert capsys.readouterr().out.splitlines()[1].split()[4:6] == ["n/a", "n/a"]


def test_the_command_prints_no_traceback(tmp_path):
    """The installed entry point: one line, exit code 2 (a ValueError traceback before)."""
    p = subprocess.run([sys.executable, "-c", "from deepinfer.cli import bench_main; bench_main()", "offline",
                        str(tmp_path), "--prompt-lens", "abc"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1 and "--prompt-lens" in p.stderr


# -- online --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, names", [
    (["--base-url", "notaurl"], "--base-url 'notaurl' is not an http(s) URL"),
    (["--base-url", "ftp://host"], "--base-url 'ftp://host'"),
    (["--concurrency", "0"], "--concurrency 0 must be at least 1"),      # hung on Semaphore(0)
    (["--concurrency", "-1"], "--concurrency -1"),
    (["--concurrency", "x"], "argument --concurrency: invalid int value: 'x'"),
    (["--num-requests", "-1"], "--num-requests -1"),
    (["--vocab", "2"], "--vocab 2 must be at least 3"),
    (["--prompt-len", "-1"], "--prompt-len -1"),
    (["--prefix-len", "-1"], "--prefix-len -1"),
    (["--max-tokens", "0"], "--max-tokens 0"),
])
def test_online_flags_are_checked_before_connecting(flags, names, capsys):
    assert names in fails(capsys, "online", "--base-url", f"http://127.0.0.1:{free_port()}", *flags)


def test_online_names_a_server_it_cannot_reach(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    for model in ([], ["--model", "m"]):
        err = fails(capsys, "online", "--base-url", url, *model)
        assert f"--base-url {url}: cannot reach the server" in err


def serve(monkeypatch, completion) -> None:
    """httpx clients talk to a fake server: /v1/models lists "m" (401 without the key "k"); a completion's
    reply is completion(request)."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer k":
            return httpx.Response(401, json={"error": {"message": "missing or wrong API key"}})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return completion(request)
    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handle), **kw))


def sse(*events) -> httpx.Response:
    return httpx.Response(200, content="".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n",
                          headers={"content-type": "text/event-stream"})


TOKENS = [{"choices": [{"text": "a"}]}] * 3 + [{"choices": [], "usage": {"completion_tokens": 3}}]
ONLINE = ["online", "--base-url", "http://bench.test", "--num-requests", "4", "--json"]


def test_online_names_a_refused_key(monkeypatch, capsys):
    """401 on /v1/models was a KeyError 'data'."""
    serve(monkeypatch, lambda r: sse(*TOKENS))
    err = fails(capsys, *ONLINE, "--api-key", "wrong")
    assert "answered HTTP 401: missing or wrong API key (check --api-key)" in err
    bench.main([*ONLINE, "--api-key", "k"])
    assert json.loads(capsys.readouterr().out)["completed"] == 4


def test_online_all_requests_failing_is_an_error(monkeypatch, capsys):
    """Every request refused was exit 0 and a table of NaN: now the first server message, and no table."""
    serve(monkeypatch, lambda r: httpx.Response(400, json={"error": {"message": "temperature=-1.0 must be >= 0"}}))
    err = fails(capsys, *ONLINE, "--api-key", "k")
    assert "all 4 requests failed; the first: HTTP 400: temperature=-1.0 must be >= 0" in err


def test_online_some_requests_failing_prints_the_results_then_fails(monkeypatch, capsys):
    """Half refused, half broken by an error event mid-stream: the numbers of the rest come out, then the count
    and the first failure as the error."""
    calls = []

    def completion(request):
        calls.append(request)
        if len(calls) == 2:
            return sse(TOKENS[0], {"error": {"message": "generation failed: boom"}})
        if len(calls) == 4:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return sse(*TOKENS)
    serve(monkeypatch, completion)
    with pytest.raises(SystemExit) as e:
        bench.main([*ONLINE, "--api-key", "k"])
    out, err = capsys.readouterr()
    r = json.loads(out)
    assert e.value.code == 2 and (r["completed"], r["failed"]) == (2, 2) and r["tpot_ms_median"] > 0
    assert err.startswith("error: 2 of 4 requests failed") and err.count("\n") == 1
    assert sorted(r["errors"]) == ["HTTP 503: busy", "error mid-stream: generation failed: boom"]
