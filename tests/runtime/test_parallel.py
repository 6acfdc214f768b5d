"""Context and expert parallelism: every layout reproduces the single-rank run; collectives are counted;
a dead follower stops the leader with a clear error and no leftover processes."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from checkpoints import hf_model
from deepinfer.common.errors import RankFailure
from deepinfer.common.manifest import Manifest
from deepinfer.runtime.engine import Engine
from deepinfer.runtime.model_runner import build_inputs
from deepinfer.runtime.scheduler import ScheduledStep, StepEntry
from deepinfer.runtime.sequence import SamplingParams, Sequence
from stepper import rel_err

LAYOUTS = [(1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4)]
PROMPTS = [list(range(5, 15)), list(range(20, 67)), [9, 8, 7]]


def logits_of_steps(engine: Engine, prompt: list[int], chunks: list[tuple[str, int]]) -> list[torch.Tensor]:
    """Run a prompt through explicit steps (kind, bucket) on the engine's ranks; last-token logits per step."""
    blocks = engine.scheduler.blocks
    seq = Sequence(list(prompt), SamplingParams())
    out = []
    cc = engine.manifest.compile
    for kind, T in chunks:
        n = min(T, len(prompt) - seq.num_computed)
        blocks.allocate(seq, n)
        ctx = next(c for c in cc.context_buckets if c >= seq.num_computed + n)
        si = build_inputs(ScheduledStep(kind, T, ctx, (StepEntry(seq, seq.num_computed, n, True),)), cc)
        if engine.followers is not None:
            engine.followers.publish(si)
        out.append(engine.runner.run(si)[0])
        seq.num_computed += n
    blocks.free(seq)
    return out


STEPS = [("prefill", 32), ("decode", 4), ("decode", 4), ("decode", 1), ("prefill", 32)]


@pytest.fixture(scope="module")
def reference(checkpoints, compile_artifact):
    engine = Engine.from_artifact(compile_artifact(checkpoints["base"]))
    logits = logits_of_steps(engine, list(range(3, 3 + 45)), STEPS)
    tokens = [s.output_ids for s in engine.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))]
    return logits, tokens


@pytest.mark.parametrize("cp,ep", LAYOUTS)
def test_layout_matches_single_rank(cp, ep, checkpoints, compile_artifact, reference):
    ref_logits, ref_tokens = reference
    engine = Engine.from_artifact(compile_artifact(checkpoints["base"], cp=cp, ep=ep))
    try:
        assert engine.manifest.layout.world == max(cp, ep)
        logits = logits_of_steps(engine, list(range(3, 3 + 45)), STEPS)
        for got, want in zip(logits, ref_logits):
            assert rel_err(got, want) <= 1e-5
        batch = [s.output_ids for s in engine.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))]
        assert batch == ref_tokens
        alone = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=32, ignore_eos=True))[0].output_ids
        assert alone == ref_tokens[1]
    finally:
        engine.close()


def _routing_counts(ck, prompt: list[int], layer: int) -> torch.Tensor:
    """How many of the prompt's tokens transformers routes to each expert of one MoE layer."""
    hf = hf_model(ck)
    seen = {}
    gate = hf.model.layers[layer].mlp.gate
    h = gate.register_forward_hook(lambda mod, inp, out: seen.update(ids=out[2]) or None)
    with torch.no_grad():
        hf(torch.tensor([prompt]))
    h.remove()
    return torch.bincount(seen["ids"].flatten(), minlength=gate.weight.shape[0])


def test_overflow_on_one_rank_reruns_on_every_rank(checkpoints, compile_artifact, reference):
    """Capacity chosen so that in layer 1 only one EP rank's experts overflow: the max-all-reduced flag makes
    both ranks rerun densely (a rank-local decision would deadlock), and the logits still match."""
    ck = checkpoints["base"]
    _reruns_match_single_rank(Engine.from_artifact(compile_artifact(ck, cp=2, ep=2, moe_capacity=_one_rank_cap(ck))),
                              reference)


def _one_rank_cap(ck) -> int:
    """A capacity at which, in layer 1, only one EP rank's (of 2) experts overflow on the steps' first chunk."""
    counts = _routing_counts(ck, list(range(3, 3 + 32)), layer=1)
    half = counts.numel() // 2
    busiest = [int(counts[:half].max()), int(counts[half:].max())]
    cap = min(busiest)                       # the rank with the busier expert overflows, the other fits
    assert max(busiest) > cap, "this prompt does not overflow one rank alone"
    return cap


def _reruns_match_single_rank(engine: Engine, reference) -> None:
    try:
        got = logits_of_steps(engine, list(range(3, 3 + 45)), STEPS)
        assert engine.runner.overflow_reruns >= 1
        for g, want in zip(got, reference[0]):
            assert rel_err(g, want) <= 1e-5
    finally:
        engine.close()


def _count_collectives(art, name: str) -> dict[str, int]:
    m = Manifest.read(art)
    g = next(g for g in m.graphs if g.name == name)
    ep = torch.export.load(str(art / g.file))
    counts: dict[str, int] = {}
    for node in ep.graph.nodes:
        t = str(node.target)
        if "_c10d_functional" in t and "wait_tensor" not in t:
            key = t.split(".")[-2] + (f":{node.args[1]}" if "all_reduce" in t else "")
            counts[key] = counts.get(key, 0) + 1
    return counts


def test_collectives_per_moe_layer(checkpoints, compile_artifact):
    art = compile_artifact(checkpoints["base"], cp=2, ep=2)
    assert _count_collectives(art, "moe_layer.decode.t4.c64") == {"all_gather_into_tensor": 1, "all_reduce:sum": 1}
    assert _count_collectives(art, "moe_layer.prefill.t32.c64") == {"all_gather_into_tensor": 1, "all_reduce:sum": 1}
    static = compile_artifact(checkpoints["base"], cp=2, ep=2, moe_path="static")     # + the overflow flag's max
    assert _count_collectives(static, "moe_layer.prefill.t32.c64") == {
        "all_gather_into_tensor": 1, "all_reduce:sum": 1, "all_reduce:max": 1}
    assert _count_collectives(art, "dense_layer.decode.t4.c64") == {"all_gather_into_tensor": 1}
    assert _count_collectives(art, "head.decode.t4") == {}


def test_region_marks_time_the_collectives_on_a_parallel_layout(checkpoints, compile_artifact, reference):
    """--region-marks on cp=2 ep=2: the leader's table has each layer's collectives (the CP gather in every
    layer, the EP all-reduce in MoE layers) apart from its attention and MoE, and the tokens stay the
    single-rank run's."""
    engine = Engine.from_artifact(compile_artifact(checkpoints["base"], cp=2, ep=2, region_marks=True), timing=True)
    try:
        got = [s.output_ids for s in engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))]
    finally:
        engine.close()
    assert got == [t[:8] for t in reference[1]]
    parts = engine.runner.timer.parts
    for kind in ("prefill", "decode"):
        assert {p for (k, r, p) in parts if (k, r) == (kind, "moe_layer")} == {"attention", "moe", "collectives"}
        assert {p for (k, r, p) in parts if (k, r) == (kind, "dense_layer")} == {"attention", "mlp", "collectives"}
        assert all(t > 0 for (k, r, p), t in parts.items() if k == kind)


def test_region_marks_on_the_static_path_time_the_dense_rerun(checkpoints, compile_artifact, reference):
    """--region-marks on the static MoE path with a capacity that overflows (as the test above): the logits stay
    the single-rank run's, and the dense rerun's time splits into its MoE and its EP all-reduce."""
    ck = checkpoints["base"]
    engine = Engine.from_artifact(compile_artifact(ck, cp=2, ep=2, moe_capacity=_one_rank_cap(ck), region_marks=True),
                                  timing=True)
    _reruns_match_single_rank(engine, reference)
    parts = engine.runner.timer.parts
    assert {p for (k, r, p) in parts if (k, r) == ("prefill", "moe_dense")} == {"moe", "collectives"}
    assert {p for (k, r, p) in parts if (k, r) == ("prefill", "moe_layer")} == {"attention", "moe", "collectives"}


def test_per_rank_shards_hold_only_their_experts(checkpoints, compile_artifact):
    from safetensors import safe_open
    art = compile_artifact(checkpoints["base"], cp=2, ep=2)
    m = Manifest.read(art)
    for w in m.weights:
        f = safe_open(str(art / w.path), "pt")
        assert f.get_slice("layers.1.moe.experts_gate_up").get_shape()[0] == 4
        assert f.get_tensor("rank.expert_ids").tolist() == list(range(4 * w.rank, 4 * w.rank + 4))
        assert f.get_slice("layers.1.moe.shared_down").get_shape()[1] == 16     # shared expert split in two


def test_shared_experts_as_groups_over_expert_parallel_ranks_match_single_rank(checkpoints, compile_artifact):
    """--shared-experts grouped with two shared experts over two EP ranks: each rank's shard holds its routed
    experts and one shared expert as groups, and the logits and greedy tokens are the single rank's with the
    shared MLP apart."""
    from safetensors import safe_open
    ck = checkpoints["two_dense_yarn"]
    single = Engine.from_artifact(compile_artifact(ck, shared_experts="separate"))
    prompt = list(range(3, 3 + 45))
    ref_logits = logits_of_steps(single, prompt, STEPS)
    ref_tokens = [s.output_ids for s in single.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))]
    art = compile_artifact(ck, ep=2, shared_experts="grouped")
    for w in Manifest.read(art).weights:
        f = safe_open(str(art / w.path), "pt")
        assert f.get_slice("layers.2.moe.experts_gate_up").get_shape()[0] == 4 + 1
        assert "layers.2.moe.shared_down" not in f.keys()
    engine = Engine.from_artifact(art)
    try:
        for got, want in zip(logits_of_steps(engine, prompt, STEPS), ref_logits):
            assert rel_err(got, want) <= 1e-5
        tokens = [s.output_ids for s in engine.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))]
        assert tokens == ref_tokens
    finally:
        engine.close()


def test_killed_follower_stops_the_leader_with_a_clear_error(checkpoints, compile_artifact):
    art = compile_artifact(checkpoints["base"], cp=2, ep=2)
    # far more work than the wait below covers (one 120-token prompt once finished inside it on a fast machine,
    # and the follower was gone before the kill): with 48 prompts the kill lands mid-generation
    prompts = [arg for i in range(48) for arg in ("--prompt-ids", f"{5 + i},6,7")]
    leader = subprocess.Popen([sys.executable, "-c", "from deepinfer.cli import run_main; run_main()", str(art),
                               *prompts, "--max-tokens", "120", "--ignore-eos"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    follower = None
    deadline = time.time() + 120
    while follower is None and time.time() < deadline:
        out = subprocess.run(["pgrep", "-P", str(leader.pid), "-f", "follower_main"], capture_output=True, text=True)
        follower = int(out.stdout.split()[0]) if out.stdout.strip() else None
        time.sleep(0.2)
    assert follower is not None, "no follower was spawned"
    time.sleep(8)                                     # let it load and start generating
    os.kill(follower, signal.SIGKILL)
    t = time.time()
    _, err = leader.communicate(timeout=60)
    assert time.time() - t < 30
    assert leader.returncode == 2 and "follower rank 1" in err, err
    leftover = subprocess.run(["pgrep", "-f", f"DEEPINFER_ARTIFACT={art}"], capture_output=True, text=True).stdout
    assert not leftover.strip()
    assert subprocess.run(["pgrep", "-P", str(leader.pid)], capture_output=True).returncode != 0


def test_torchrun_path_matches(checkpoints, compile_artifact, reference):
    art = compile_artifact(checkpoints["base"], cp=2, ep=2)
    from ports import free_port
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "deepinfer", "run", str(art),
                          "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-tokens", "32", "--ignore-eos",
                          "--json"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    # a rank's own error comes first in the log, torchrun's summary last: show both
    assert out.returncode == 0, out.stderr if len(out.stderr) < 6000 else out.stderr[:3000] + "\n...\n" + out.stderr[-3000:]
    import json
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [x["token_ids"] for x in lines] == [reference[1][0]]


def test_a_follower_dying_before_the_rendezvous_is_named_at_once(checkpoints, compile_artifact, tmp_path):
    """A follower that dies before it joins the process group fails the start within the monitor's poll, naming its
    rank (the rendezvous alone waited out its 60 s timeout, then blamed the store). In a process of its own: a
    failed start leaves torch.distributed unable to start another group in that process. Spawned followers are
    handed DEEPINFER_COLLECTIVE_TIMEOUT (default 60), and a bad value stops the start before they are spawned."""
    art = compile_artifact(checkpoints["base"], cp=2, ep=2)
    seen = tmp_path / "timeout"      # what the follower was handed: DEEPINFER_COLLECTIVE_TIMEOUT, as the leader's
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('DEEPINFER_LOCAL_RANK') == '1':\n"
        f"    open({str(seen)!r}, 'w').write(os.environ['DEEPINFER_COLLECTIVE_TIMEOUT'])\n    os._exit(3)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEEPINFER_COLLECTIVE_TIMEOUT": "45",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "deepinfer", "run", str(art), "--prompt-ids", "1,2,3"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert time.monotonic() - t < 40
    assert out.returncode == 2 and "follower rank 1 exited with code 3" in out.stderr, out.stderr[-3000:]
    assert float(seen.read_text()) == 45.0
    # a bad value is refused before any follower starts
    out = subprocess.run([sys.executable, "-m", "deepinfer", "run", str(art), "--prompt-ids", "1,2,3"],
                         capture_output=True, text=True, timeout=120, env={**env, "DEEPINFER_COLLECTIVE_TIMEOUT": "ten"})
    assert out.returncode == 2 and "DEEPINFER_COLLECTIVE_TIMEOUT='ten'" in out.stderr, out.stderr[-3000:]
    assert len(out.stderr.strip().splitlines()) == 1


def test_the_collective_timeout_variable_is_checked(monkeypatch):
    from deepinfer.common.errors import OptionError
    from deepinfer.runtime.distributed import collective_timeout_env
    monkeypatch.delenv("DEEPINFER_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout_env(60.0) == 60.0 and collective_timeout_env(None) is None
    monkeypatch.setenv("DEEPINFER_COLLECTIVE_TIMEOUT", "2.5")
    assert collective_timeout_env(60.0) == 2.5
    for bad in ("ten", "0", "-3", "nan", "inf"):
        monkeypatch.setenv("DEEPINFER_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(OptionError, match="DEEPINFER_COLLECTIVE_TIMEOUT"):
            collective_timeout_env(60.0)


def test_a_step_record_travels_as_its_header_and_the_slots_it_fills():
    """torchrun sends a record's header, then record_length(header) slots: enough to rebuild the step exactly,
    and a decode step's few slots, not the largest record the artifact allows."""
    import numpy as np
    from deepinfer.runtime import distributed as D
    from deepinfer.runtime.model_runner import StepInputs
    g = np.random.default_rng(0)
    si = StepInputs("prefill", 6, 64, g.integers(0, 99, 6), np.arange(6), g.integers(0, 99, 6),
                    g.integers(0, 9, (2, 4)), np.array([2, 5]), 2, np.array([0, 0, 0, 3, 3, 3]))
    sent = np.full(4096, -7, dtype=np.int64)
    D.pack(si, 11, sent)
    n = D.record_length(sent)
    assert n == 8 + 4 * 6 + 2 * 4 + 2
    got = np.zeros_like(sent)
    got[:n] = sent[:n]                                 # what arrives: nothing past n
    out, step = D.unpack(got)
    assert step == 11 and (out.kind, out.tokens, out.context, out.num_logits) == ("prefill", 6, 64, 2)
    for a, b in ((out.token_ids, si.token_ids), (out.positions, si.positions), (out.slot_mapping, si.slot_mapping),
                 (out.block_tables, si.block_tables), (out.logit_indices, si.logit_indices),
                 (out.context_starts, si.context_starts)):
        assert np.array_equal(a, b)
    D.pack(None, 12, sent)
    assert D.record_length(sent) == 8 and D.unpack(sent) == (None, 12)


def test_a_torchrun_server_serves_after_idling_past_the_collective_timeout(checkpoints, compile_artifact, reference):
    """The followers wait for the next step over a group of their own: idle longer than the graphs' collective
    timeout (here 3 s; torch's default 30 minutes), the server still answers, with the single-rank tokens."""
    import httpx
    from ports import free_port
    art = compile_artifact(checkpoints["base"], cp=2, ep=2)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "deepinfer", "run", str(art), "--port", str(port)],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "DEEPINFER_COLLECTIVE_TIMEOUT": "3"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
            assert proc.poll() is None, proc.stdout.read()
        else:
            pytest.fail("the torchrun server did not start")
        time.sleep(7)                                  # idle past the 3 s timeout
        r = httpx.post(base + "/v1/completions", timeout=120, json={
            "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert proc.poll() is None
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(art / "tokenizer" / "tokenizer.json"))
        assert r.json()["choices"][0]["text"] == tok.decode(reference[1][0])
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_drafting_on_a_parallel_layout_matches_single_rank(checkpoints, compile_artifact):
    """Speculative drafts on cp=2 x ep=2: the followers run the same multi-token decode steps, the leader
    verifies; greedy tokens equal the plain single-rank engine's."""
    prompts = [[11, 57, 203, 9, 88, 140] * 4, [3, 4] * 10]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [s.output_ids for s in Engine.from_artifact(compile_artifact(checkpoints["base"])).generate(prompts, params)]
    engine = Engine.from_artifact(compile_artifact(checkpoints["base"], cp=2, ep=2), num_speculative_tokens=3)
    try:
        engine.scheduler.observe = lambda step, seconds: None      # drafts wherever they fit
        assert [s.output_ids for s in engine.generate(prompts, params)] == want
        assert engine.num_accepted_tokens > 0
    finally:
        engine.close()
