"""Build the Flow-GRPO training and validation sets as two parquet files.

Flow-GRPO trains the *planner* of a tool-using agent with reinforcement
learning. The reward is outcome-only (is the final answer right?), so all a
training example needs is a question and a gold answer. We mix two very
different kinds of questions so that the planner has to learn *when* to use
which tool:

* DeepMath-103K (``zwhe99/DeepMath-103K``): hard maths, where a calculator or
  Python tool helps.                                         -> source "mathhard"
* Natural Questions, FlashRAG copy (``RUC-NLPIR/FlashRAG_datasets``, config
  ``nq``): factual look-ups, where a search tool helps.      -> source "nq"

Validation uses AIME 2024 (30 problems, integer answers)     -> source "aime24"

Every row, whatever its origin, is normalised to one schema::

    id          int   position in the written file, 0..N-1
    question    str   the task shown to the agent
    chain       str   empty; room for a reasoning chain (none is stored here)
    result      str   gold answer; several gold answers are joined with "; "
    source      str   "mathhard" | "nq" | "aime24" (the tools task: "arithmetic" | "lookup" | "compound")
    extra_info  struct{ground_truth: str (== result), idx: int (row in source; 0 for made-up questions)}

Outputs::

    OUT/train/combined_train.parquet   mathhard + nq, shuffled with --seed
    OUT/val/aime24.parquet             AIME 2024, original order

Usage::

    python prepare_data.py                      # full data from the HF Hub
    python prepare_data.py --max-samples 2000   # 2000 rows per source (still downloads all ~2 GB of DeepMath)
    python prepare_data.py --sample             # tiny built-in set, no network
    python prepare_data.py --tools-task         # OUT/tools_task/: the cpu preset's offline task and corpus

``--sample`` writes the same two files from 83 questions written by hand
below, so the whole pipeline (data -> rollouts -> reward -> update) can be
tried on a laptop without touching the network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import operator
import os
import random
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from tqdm import tqdm

# Heavy libraries (datasets, pyarrow) are imported inside the functions that
# need them, so `--help` and `--sample` start quickly.

# ---------------------------------------------------------------- Constants

MATH_DATASET = "zwhe99/DeepMath-103K"
NQ_DATASET = "RUC-NLPIR/FlashRAG_datasets"
NQ_CONFIG = "nq"
AIME_DATASET = "HuggingFaceH4/aime_2024"

TRAIN_FILE = Path("train") / "combined_train.parquet"
VAL_FILE = Path("val") / "aime24.parquet"

# The three values of the `source` column, in the order counts are printed.
SOURCES = ("mathhard", "nq", "aime24")

# Column order of the written files (the trainer relies on these names).
COLUMNS = ["id", "question", "chain", "result", "source", "extra_info"]

# Offline, huggingface_hub would otherwise wait on its default timeouts (and
# retry) before giving up; 10 s is plenty for a HEAD request that works.
HUB_TIMEOUT_S = "10"

# ---------------------------------------------------------------- Normalisation


def _is_missing(x) -> bool:
    """True for None and every flavour of NaN (float, numpy, pandas.NA, NaT)."""
    if x is None:
        return True
    if isinstance(x, float):  # also covers np.float64, a float subclass
        return math.isnan(x)
    if isinstance(x, (str, bytes, int)):
        return False
    try:
        # NaN is the only value not equal to itself (works for NaT, Decimal).
        return bool(x != x)
    except TypeError:
        # pandas.NA: `NA != NA` is NA again, and bool(NA) raises TypeError.
        return True


def _leaves(value):
    """Yield the scalars inside arbitrarily nested lists/tuples/arrays."""
    if isinstance(value, np.ndarray):
        # ravel() flattens ANY shape; tolist() turns numpy scalars into Python
        # ones. Object arrays may hold more arrays: the recursion handles them.
        value = value.ravel().tolist()
    elif isinstance(value, np.generic):
        value = value.item()  # np.int64(3) -> 3, np.str_("a") -> "a"
    elif hasattr(value, "to_pylist"):
        value = value.to_pylist()  # a pyarrow array, if a caller passes one
    elif hasattr(value, "tolist"):
        value = value.tolist()  # pandas Series / extension arrays
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _leaf_to_str(x) -> str:
    """One scalar answer as a clean string; "" means "drop it"."""
    if _is_missing(x):
        return ""
    if isinstance(x, bytes):
        x = x.decode("utf-8", errors="replace")
    if isinstance(x, float) and x.is_integer():
        return str(int(x))  # 1945.0 -> "1945": a float year is still a year
    s = str(x).strip()
    # CSV/pandas round trips turn missing values into the text "nan".
    return "" if s.lower() == "nan" else s


def normalise_answers(value) -> str:
    """Gold answer(s) of any type -> one string, several joined with "; ".

    Accepts a list, tuple, numpy array of any shape, string, int, float, numpy
    scalar, None or NaN. Empty and missing elements are dropped, duplicates
    are dropped (first one wins), and "nan" is never returned.
    """
    parts = (_leaf_to_str(x) for x in _leaves(value))
    # dict.fromkeys de-duplicates while keeping the original order.
    unique = dict.fromkeys(p for p in parts if p)
    return "; ".join(unique)


def clean_text(x) -> str:
    """A stripped string; "" for a missing value (not the text "None" or "nan")."""
    return "" if _is_missing(x) else str(x).strip()


def normalise_question(q) -> str:
    """Strip a question and make it end with exactly one "?".

    NQ questions are stored as lowercase search queries without a question
    mark ("who wrote the iliad"); the "?" tells the agent it is a question.
    Missing questions become "" so that callers can skip them.
    """
    q = clean_text(q)
    return q if not q or q.endswith("?") else q + "?"


# ---------------------------------------------------------------- Rows


def make_row(question: str, result: str, source: str, idx: int) -> dict:
    """The one schema every row shares (see module docstring)."""
    return {
        "id": idx,  # provisional; re-indexed after shuffling
        "question": question,
        "chain": "",
        "result": result,
        "source": source,
        # ground_truth duplicates result because reward code looks it up here;
        # idx lets you trace a row back to the original dataset.
        "extra_info": {"ground_truth": result, "idx": idx},
    }


def math_row(item, idx: int) -> dict:
    """A DeepMath-103K record ({question, final_answer}) -> row."""
    return make_row(
        question=clean_text(item["question"]),
        result=normalise_answers(item["final_answer"]),
        source="mathhard",
        idx=idx,
    )


def nq_row(item, idx: int) -> dict:
    """A FlashRAG Natural Questions record ({question, golden_answers}) -> row."""
    return make_row(
        question=normalise_question(item["question"]),
        result=normalise_answers(item["golden_answers"]),
        source="nq",
        idx=idx,
    )


def aime_row(item, idx: int) -> dict:
    """An AIME record ({problem, answer}) -> row. AIME answers are integers."""
    # int() rejects anything that is not an integer, and canonicalises "033"
    # to "33" so that string comparison in the reward is safe. A missing or
    # non-integer answer gives "": the row is dropped (and counted) by convert.
    try:
        result = str(int(normalise_answers(item["answer"])))
    except ValueError:
        result = ""
    return make_row(
        question=clean_text(item["problem"]),
        result=result,
        source="aime24",
        idx=idx,
    )


def is_complete(row: dict) -> bool:
    """A row is usable only if it has both a question and a gold answer."""
    return bool(row["question"]) and bool(row["result"])


# ---------------------------------------------------------------- Mixing


def subset_indices(n: int, max_samples: int | None, seed: int) -> list[int]:
    """Indices of the rows to keep from a source of n rows (sorted).

    A random subset rather than the first rows: datasets are often sorted (by
    topic, difficulty, ...), and the head would be unrepresentative.
    """
    if max_samples is None or max_samples >= n:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), max_samples))


def convert(items, indices: list[int], to_row, desc: str) -> list[dict]:
    """Apply to_row to items (already restricted to indices), drop bad rows.

    idx in the row is the index in the *original* source, not in the subset.
    """
    rows = (to_row(item, i) for i, item in zip(indices, items))
    bar = tqdm(rows, total=len(indices), desc=desc, unit="row", leave=False)
    kept = [r for r in bar if is_complete(r)]
    if len(kept) < len(indices):
        print(f"{desc}: dropped {len(indices) - len(kept)} of {len(indices)} rows "
              "without a question or a usable answer", file=sys.stderr)
    return kept


def reindex(rows: list[dict]) -> list[dict]:
    """Copies of rows with id set to their position 0..N-1."""
    return [{**r, "id": i} for i, r in enumerate(rows)]


def combine(sources: list[list[dict]], seed: int) -> list[dict]:
    """Concatenate row lists, shuffle deterministically, re-index ids.

    random.Random(int).shuffle gives the same order on every platform and
    Python 3 version, and unlike the global RNG it is not disturbed by other
    code that happens to draw random numbers.
    """
    rows = [r for source in sources for r in source]
    random.Random(seed).shuffle(rows)
    return reindex(rows)


def count_by_source(rows: list[dict]) -> dict[str, int]:
    """{"mathhard": 40, "nq": 40}: rows per source, known sources first."""
    found = [r["source"] for r in rows]
    order = [s for s in SOURCES if s in found] + sorted(set(found) - set(SOURCES))
    return {s: found.count(s) for s in order}


# ---------------------------------------------------------------- Writing


def write_dataset(rows: list[dict], path) -> Path:
    """Write rows to a parquet file (extra_info as a struct column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # An explicit schema keeps column types stable (e.g. int64 ids even for an
    # empty file) and makes extra_info a real struct, not a JSON string.
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("question", pa.string()),
            ("chain", pa.string()),
            ("result", pa.string()),
            ("source", pa.string()),
            (
                "extra_info",
                pa.struct([("ground_truth", pa.string()), ("idx", pa.int64())]),
            ),
        ]
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written aside, then renamed: a crash or a full disk never leaves a torn
    # file where the trainer (or a preset's first-use check) would read it.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------- Hugging Face Hub


class HubError(RuntimeError):
    """A dataset could not be loaded; str() is the one line shown to the user."""

    def __init__(self, name: str, reason: str):
        super().__init__(
            f"could not load {name} from the Hugging Face Hub ({reason}); "
            "run with --sample to build a small offline dataset"
        )


def _short_reason(exc: BaseException, limit: int = 160) -> str:
    """First line of an exception, prefixed by its type, at most limit chars."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def probe_hub(timeout: float = 5.0) -> str | None:
    """Check that the Hub answers a TCP connection; go offline if it does not.

    Without network, huggingface_hub retries each request with back-off
    (~25 s per file, logging a warning each time). One socket connect tells us
    the same in milliseconds (DNS failure) or `timeout` seconds (firewall).
    We then set HF_HUB_OFFLINE=1, so datasets still uses a local cache if it
    has one and fails immediately if not. Returns the failure reason or None.
    Must run before `datasets` is imported: the hub reads the variable once.
    """
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return None  # the user chose offline mode; don't second-guess it
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # behind a proxy a direct connection proves nothing; let the hub client try
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return None
    except OSError as exc:
        os.environ["HF_HUB_OFFLINE"] = "1"
        return f"cannot connect to {url.hostname}:{port}: {exc}"


def load_hub(name: str, config: str | None = None, split: str = "train",
             offline_reason: str | None = None):
    """datasets.load_dataset, with every failure turned into a HubError."""
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", HUB_TIMEOUT_S)
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", HUB_TIMEOUT_S)
    try:
        from datasets import load_dataset  # lazy: slow to import

        return load_dataset(name, config, split=split)
    except Exception as exc:  # ConnectionError, OSError, HfHubHTTPError, ...
        # If we know the network is down, say so rather than "offline mode".
        raise HubError(name, offline_reason or _short_reason(exc)) from None


def hub_rows(ds, columns: list[str], to_row, max_samples, seed, desc) -> list[dict]:
    """Rows from a datasets.Dataset, optionally a random subset of it."""
    # DeepMath also stores three long R1 solutions per problem; selecting the
    # two columns we use avoids decoding ~1 GB of text we would throw away.
    # It does not avoid downloading it: load_dataset fetches the whole
    # dataset (~2 GB of parquet for DeepMath) before any subset is taken, so
    # --max-samples shortens the conversion, not the download.
    ds = ds.select_columns(columns)
    indices = subset_indices(len(ds), max_samples, seed)
    if len(indices) < len(ds):
        ds = ds.select(indices)
    return convert(ds, indices, to_row, desc)


def build_hub(seed: int = 42, max_samples: int | None = None):
    """(train_rows, val_rows) from the Hugging Face Hub. Raises HubError."""
    reason = probe_hub()
    # Load all three before converting anything: if one is unreachable we
    # fail in seconds and write nothing, instead of leaving half a dataset.
    math_ds = load_hub(MATH_DATASET, offline_reason=reason)
    nq_ds = load_hub(NQ_DATASET, NQ_CONFIG, offline_reason=reason)
    aime_ds = load_hub(AIME_DATASET, offline_reason=reason)

    math = hub_rows(math_ds, ["question", "final_answer"], math_row,
                    max_samples, seed, "mathhard")
    nq = hub_rows(nq_ds, ["question", "golden_answers"], nq_row,
                  max_samples, seed, "nq")
    # Validation is always complete: 30 problems are cheap, and scores on a
    # subset would not be comparable with published AIME numbers.
    val = hub_rows(aime_ds, ["problem", "answer"], aime_row, None, seed, "aime24")
    return combine([math, nq], seed), reindex(val)


# ---------------------------------------------------------------- Built-in sample
#
# Hand-written stand-ins for the three sources, used by --sample. Each maths
# item is (question, answer, check): `check` is a Python expression in x that
# is True exactly when x is the answer, so the tests can verify every answer
# by computation instead of trusting this file.

SAMPLE_MATH = [
    # arithmetic: the check recomputes the answer from the question
    ("What is 17 * 23?", "391", "x == 17 * 23"),
    ("Compute 1234 + 5678.", "6912", "x == 1234 + 5678"),
    ("What is 1000 - 357?", "643", "x == 1000 - 357"),
    ("What is 144 divided by 12?", "12", "x == 144 // 12 and 144 % 12 == 0"),
    ("Compute 2^10.", "1024", "x == 2 ** 10"),
    ("What is the remainder when 100 is divided by 7?", "2", "x == 100 % 7"),
    ("Compute 15^2 - 14^2.", "29", "x == 15 ** 2 - 14 ** 2"),
    ("What is the sum of the integers from 1 to 100?", "5050",
     "x == sum(range(1, 101))"),
    ("What is 3! multiplied by 4!?", "144",
     "x == math.factorial(3) * math.factorial(4)"),
    ("What is the greatest common divisor of 84 and 120?", "12",
     "x == math.gcd(84, 120)"),
    ("What is the least common multiple of 12 and 18?", "36",
     "x == math.lcm(12, 18)"),
    ("How many positive divisors does 36 have?", "9",
     "x == len([d for d in range(1, 37) if 36 % d == 0])"),
    ("Compute 2^5 * 3^2.", "288", "x == 2 ** 5 * 3 ** 2"),
    ("What is 7 * 8 + 9 * 6?", "110", "x == 7 * 8 + 9 * 6"),
    ("What is 25% of 360?", "90", "x == 360 * 25 // 100"),
    ("What is the sum of the first 10 positive odd numbers?", "100",
     "x == sum(range(1, 20, 2))"),
    ("How many prime numbers are less than 30?", "10",
     "x == len([p for p in range(2, 30) if all(p % d for d in range(2, p))])"),
    ("What is 999 * 999?", "998001", "x == 999 * 999"),
    ("Compute 3^4 - 4^3.", "17", "x == 3 ** 4 - 4 ** 3"),
    ("If f(x) = 2x^2 - 3x + 1, what is f(4)?", "21",
     "x == 2 * 4 ** 2 - 3 * 4 + 1"),
    ("How many integers n satisfy n^2 < 20?", "9",
     "x == len([n for n in range(-100, 101) if n * n < 20])"),
    # algebra: the check is the equation itself, x substituted
    ("Solve for x: 3x + 5 = 26.", "7", "3 * x + 5 == 26"),
    ("Solve for x: 4x - 7 = 2x + 11.", "9", "4 * x - 7 == 2 * x + 11"),
    ("Find the positive solution of x^2 - 5x - 14 = 0.", "7",
     "x ** 2 - 5 * x - 14 == 0 and x > 0"),
    ("Find the positive solution of x^2 = 169.", "13", "x ** 2 == 169 and x > 0"),
    ("If 2^x = 64, what is x?", "6", "2 ** x == 64"),
    ("Solve for x: x/4 + 3 = 8.", "20", "x / 4 + 3 == 8"),
    ("The sum of three consecutive integers is 72. What is the smallest of them?",
     "23", "x + (x + 1) + (x + 2) == 72"),
    ("A rectangle has perimeter 40 and its length is 4 more than its width. "
     "What is its width?", "8", "2 * (x + (x + 4)) == 40"),
    ("Solve for x: 7(x - 2) = 49.", "9", "7 * (x - 2) == 49"),
    ("Find the integer x such that x^3 = 343.", "7", "x ** 3 == 343"),
    ("If 3x - 2y = 4 and y = 7, what is x?", "6", "3 * x - 2 * 7 == 4"),
    ("What is the positive integer n such that n(n + 1) = 132?", "11",
     "x * (x + 1) == 132 and x > 0"),
    ("Find the negative solution of |x - 3| = 5.", "-2",
     "abs(x - 3) == 5 and x < 0"),
    ("Solve for x: 2(x + 3) = 3(x - 1).", "9", "2 * (x + 3) == 3 * (x - 1)"),
    ("For what value of x is 5^(x - 1) = 125?", "4", "5 ** (x - 1) == 125"),
    ("The average of four numbers is 15. Three of them are 10, 12 and 20. "
     "What is the fourth?", "18", "(10 + 12 + 20 + x) / 4 == 15"),
    ("Solve for x: x^2 - 10x + 25 = 0.", "5", "x ** 2 - 10 * x + 25 == 0"),
    ("A number doubled and then increased by 9 gives 45. What is the number?",
     "18", "2 * x + 9 == 45"),
    ("Solve for x: 5x + 3 = 3x - 9.", "-6", "5 * x + 3 == 3 * x - 9"),
]

# Natural Questions style: lowercase search queries, mostly without "?"
# (normalise_question adds it). Several aliases -> joined with "; ".
# Only long-settled facts, so the gold answers cannot go stale.
SAMPLE_NQ = [
    ("what is the capital of France", ["Paris"]),
    ("what is the capital of Japan", ["Tokyo"]),
    ("what is the capital of Australia", ["Canberra"]),
    ("what is the capital of Canada", ["Ottawa"]),
    ("what is the capital of Italy", ["Rome"]),
    ("what is the capital of Egypt", ["Cairo"]),
    ("what is the capital of Germany", ["Berlin"]),
    ("what is the capital of Spain", ["Madrid"]),
    ("what is the chemical symbol for gold", ["Au"]),
    ("what is the chemical symbol for sodium", ["Na"]),
    ("what is the chemical symbol for iron", ["Fe"]),
    ("what is the chemical symbol for potassium", ["K"]),
    ("which element has atomic number 1", ["hydrogen", "H"]),
    ("who wrote Pride and Prejudice", ["Jane Austen", "Austen"]),
    ("who wrote Romeo and Juliet", ["William Shakespeare", "Shakespeare"]),
    ("who wrote the novel Nineteen Eighty-Four",
     ["George Orwell", "Orwell", "Eric Arthur Blair"]),
    ("who wrote War and Peace", ["Leo Tolstoy", "Tolstoy"]),
    ("who wrote Don Quixote", ["Miguel de Cervantes", "Cervantes"]),
    ("who wrote On the Origin of Species", ["Charles Darwin", "Darwin"]),
    ("which ancient Greek poet is credited with the Odyssey", ["Homer"]),
    ("which planet is closest to the sun", ["Mercury"]),
    ("what is the largest planet in the solar system", ["Jupiter"]),
    ("which planet is known as the red planet", ["Mars"]),
    ("which planet is sixth from the sun", ["Saturn"]),
    ("how many planets are in the solar system", ["8", "eight"]),
    ("who painted the Mona Lisa", ["Leonardo da Vinci", "Leonardo"]),
    ("who developed the theory of general relativity?",
     ["Albert Einstein", "Einstein"]),
    ("who was the first person to walk on the moon?",
     ["Neil Armstrong", "Armstrong"]),
    ("who was the first president of the United States",
     ["George Washington", "Washington"]),
    ("in which country are the pyramids of Giza", ["Egypt"]),
    ("in which country is the Grand Canyon",
     ["USA", "United States", "United States of America"]),
    ("in which country is the Eiffel Tower", ["France"]),
    ("in which city is the Colosseum", ["Rome"]),
    ("what is the largest ocean on Earth", ["Pacific Ocean", "Pacific"]),
    ("what is the chemical formula for water", ["H2O"]),
    ("what is the freezing point of water in degrees Celsius", ["0", "zero"]),
    ("which gas do plants absorb from the air for photosynthesis",
     ["carbon dioxide", "CO2"]),
    ("who discovered penicillin", ["Alexander Fleming", "Fleming"]),
    ("what is the currency of Japan", ["yen", "Japanese yen"]),
    ("what is the official language of Brazil", ["Portuguese"]),
]

# Validation stand-ins for AIME: competition-flavoured, integer answers.
SAMPLE_AIME = [
    ("A train travels at 60 km per hour for 2.5 hours. How many kilometres "
     "does it travel?", "150", "x == 60 * 2.5"),
    ("Alice has 3 times as many apples as Bob, and together they have 48. "
     "How many apples does Alice have?", "36", "x == 3 * (48 - x)"),
    ("How many positive integers less than 100 are divisible by 3 or 5?", "46",
     "x == len([n for n in range(1, 100) if n % 3 == 0 or n % 5 == 0])"),
    ("What is the sum of the interior angles of a hexagon, in degrees?", "720",
     "x == (6 - 2) * 180"),
    ("In how many ways can 5 different books be arranged on a shelf?", "120",
     "x == math.factorial(5)"),
    ("In how many ways can a committee of 2 be chosen from 8 people?", "28",
     "x == math.comb(8, 2)"),
    ("What is the remainder when 2^100 is divided by 7?", "2",
     "x == pow(2, 100, 7)"),
    ("What is the sum of all positive divisors of 28?", "56",
     "x == sum(d for d in range(1, 29) if 28 % d == 0)"),
    ("A right triangle has legs of length 9 and 12. How long is its "
     "hypotenuse?", "15", "x ** 2 == 9 ** 2 + 12 ** 2 and x > 0"),
    ("How many zeros are at the end of 100! (100 factorial)?", "24",
     "x == len(str(math.factorial(100))) - len(str(math.factorial(100)).rstrip('0'))"),
]


def build_sample(seed: int = 42, max_samples: int | None = None):
    """(train_rows, val_rows) from the built-in sample, through the same
    row functions as the real data, so the normalisation is exercised too."""
    # Dress the tuples up as records of the real datasets.
    math_items = [{"question": q, "final_answer": a} for q, a, _ in SAMPLE_MATH]
    nq_items = [{"question": q, "golden_answers": a} for q, a in SAMPLE_NQ]
    aime_items = [{"problem": q, "answer": a} for q, a, _ in SAMPLE_AIME]

    def rows(items, to_row, limit, desc):
        indices = subset_indices(len(items), limit, seed)
        return convert([items[i] for i in indices], indices, to_row, desc)

    math = rows(math_items, math_row, max_samples, "mathhard")
    nq = rows(nq_items, nq_row, max_samples, "nq")
    val = rows(aime_items, aime_row, None, "aime24")  # always complete
    return combine([math, nq], seed), reindex(val)


# ---------------------------------------------------------------- Arithmetic
#
# The task of flow_grpo.py's cpu preset: three kinds of questions, each with
# its own right plan, so that a planner must learn WHICH tool for WHICH
# question and IN WHAT ORDER:
#   arithmetic  "What is 37 * 91?"                  -> Python (a 135M model
#               guesses products wrong but writes print(37 * 91) easily)
#   lookup      "What is the elevation of Vorlund?"  -> Wikipedia over the
#               offline corpus (the facts are invented: no model knows them)
#   compound    "... of Vorlund, plus 250?"          -> Wikipedia, then Python
# The corpus is a world of invented towns with three numeric facts each; it
# is the Wikipedia tool's world, shared by training and held-out questions.
# Held out are new question instances: new operands, and (town, fact) pairs
# never asked in training. Answers are COMPUTED, never typed. Operators are
# symbols: with "37 times 91" SmolLM2 passed "37times91" on to the tool.

TOOLS_TASK_DIR = Path("tools_task")  # train.parquet, val.parquet, corpus.jsonl
ARITHMETIC_TEMPLATES = (  # (question template, operation, range of a, range of b)
    ("What is {a} * {b}?", operator.mul, (12, 99), (12, 99)),
    ("What is {a} + {b}?", operator.add, (1000, 9999), (1000, 9999)),
    ("What is {a} - {b}?", operator.sub, (1000, 9999), (100, 999)),
)
# (fact, the corpus sentence, the question, range of the value)
FACTS = (
    ("population", "{name} has a population of {v}.", "What is the population of {name}", (1000, 9999)),
    ("founded", "{name} was founded in the year {v}.", "What is the founding year of {name}", (1100, 1899)),
    ("elevation", "{name} lies at an elevation of {v} metres.", "What is the elevation of {name}", (11, 99)),
)  # not "{name} has {v} bridges": SmolLM2's tool reader answered that with the population (--plan-tools)
SYLLABLES = ("vor", "lund", "kes", "sim", "ar", "tav", "rin", "mol", "dra", "zen", "bri", "os", "fal", "gor", "quil",
             "wex", "ply", "sor", "nev", "ul", "tam", "brek", "hul", "yst")


def invented_names(n: int, rng: random.Random) -> list[str]:
    """n distinct town names of two or three syllables ("Vorlund", "Kessimar")."""
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
        if name not in names:
            names.append(name)
    return names


def tools_corpus(n_towns: int, rng: random.Random) -> list[dict]:
    """[{"title", "text", "facts"}]: one short passage per town, its facts in a fixed order."""
    docs = []
    for name in invented_names(n_towns, rng):
        facts = {fact: rng.randint(*span) for fact, _, _, span in FACTS}
        text = " ".join(sentence.format(name=name, v=facts[fact]) for fact, sentence, _, _ in FACTS)
        docs.append({"title": name, "text": text, "facts": facts})
    return docs


def arithmetic_rows(n: int, rng: random.Random, seen: set) -> list[dict]:
    """n new arithmetic questions (their operands not in `seen`, in either order for + and *), templates in turn."""
    rows: list[dict] = []
    while len(rows) < n:
        text, op, range_a, range_b = ARITHMETIC_TEMPLATES[len(rows) % len(ARITHMETIC_TEMPLATES)]
        a, b = rng.randint(*range_a), rng.randint(*range_b)
        key = (op, *sorted((a, b))) if op in (operator.add, operator.mul) else (op, a, b)  # 'b * a' asks 'a * b'
        if key not in seen:
            seen.add(key)
            rows.append(make_row(text.format(a=a, b=b), str(op(a, b)), "arithmetic", len(rows)))
    return rows


def fact_rows(pairs: list[tuple[dict, int]], rng: random.Random) -> list[dict]:
    """A lookup and a compound question for each (town, fact index): "...?" and "..., plus k?" / "..., times k?"."""
    rows = []
    for doc, f in pairs:
        fact, _, ask, _ = FACTS[f]
        value, name = doc["facts"][fact], doc["title"]
        rows.append(make_row(f"{ask.format(name=name)}?", str(value), "lookup", 0))
        k, times = rng.randint(101, 999), rng.random() < 0.5
        k = k % 8 + 2 if times else k  # a one-digit factor, or a three-digit term
        rows.append(make_row(f"{ask.format(name=name)}, {'times' if times else 'plus'} {k}?",
                             str(value * k if times else value + k), "compound", 0))
    return rows


def build_tools_task(seed: int = 42, n_towns: int = 80, n_train: int = 600, n_val: int = 60):
    """(train_rows, val_rows, corpus): each kind a third of each split. The (town, fact) pairs are split first, so
    no held-out lookup or compound question asks what a training question asked."""
    rng = random.Random(seed)
    corpus = tools_corpus(n_towns, rng)
    pairs = [(doc, f) for doc in corpus for f in range(len(FACTS))]
    rng.shuffle(pairs)
    n_val_pairs = n_val // 3
    seen: set = set()
    val = arithmetic_rows(n_val // 3, rng, seen) + fact_rows(pairs[:n_val_pairs], rng)
    train_pairs = [pairs[n_val_pairs + i % (len(pairs) - n_val_pairs)] for i in range(n_train // 3)]
    train = arithmetic_rows(n_train // 3, rng, seen) + fact_rows(train_pairs, rng)
    kinds = [[r for r in val if r["source"] == kind] for kind in ("arithmetic", "lookup", "compound")]
    val = [r for triple in zip(*kinds) for r in triple]  # kinds in turn: any prefix (--eval-limit) is balanced
    rng.shuffle(train)
    return reindex(train), reindex(val), [{"title": d["title"], "text": d["text"]} for d in corpus]


def write_corpus(docs: list[dict], path) -> Path:
    """One JSON object per line ({"title", "text"}), written aside then renamed, as write_dataset does."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_questions(path: str, limit: int = 0, kinds: str = "") -> list[dict]:
    """Rows of a prepare_data.py parquet as dicts with id, question, answer (the ground truth) and source; with
    `kinds` ("arithmetic,lookup") only rows of those sources, in file order, before `limit`. Rows without a
    question or gold are dropped with a count (a missing gold read as "nan" would match an answer "nan")."""
    import pandas as pd

    def fail(msg: str):
        raise SystemExit(f"error: {path} {msg}")

    if not Path(path).exists():
        fail("not found; build it with `python prepare_data.py` (or `python prepare_data.py --sample` offline)")
    try:
        df = pd.read_parquet(path)  # (a folder of parquet files is read as one table)
    except Exception as e:  # pyarrow raises many types for a file that is not parquet
        fail(f"is not a readable parquet file ({type(e).__name__}: {str(e)[:150]})")
    if missing := sorted({"question", "result"} - set(df.columns)):
        fail(f"has no column {missing}: not a parquet file from prepare_data.py?")
    qa = df[["question", "result"]]
    keep = (qa.notna() & (qa.astype(str).apply(lambda col: col.str.strip()) != "")).all(axis=1)  # not None/NaN/blank
    if not keep.all():
        print(f"{path}: dropped {int((~keep).sum())} of {len(df)} rows without a question or ground truth",
              file=sys.stderr)
    rows = [{"id": r.get("id", i), "question": str(r["question"]), "answer": str(r["result"]),
             "source": str(r.get("source", "?"))} for i, r in enumerate(df[keep].to_dict("records"))]
    if not rows:
        fail("holds no usable question")
    if wanted := [k.strip() for k in kinds.split(",") if k.strip()]:
        if not (chosen := [r for r in rows if r["source"] in wanted]):
            fail(f"holds no question of the kinds {wanted}; its kinds: {sorted({r['source'] for r in rows})}")
        rows = chosen
    return rows[:limit] if limit else rows


def read_corpus(path: str) -> dict[str, str]:
    """--wiki-corpus: JSONL {"title", "text"} pages -> {title: text}; a bad file is one error line naming the line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: --wiki-corpus {path}: cannot read it ({_error_line(e)})") from None
    pages: dict[str, str] = {}
    for n, line in enumerate(lines, start=1):
        try:
            page = json.loads(line) if line.strip() else None
            if page is not None:
                pages[str(page["title"])] = str(page["text"])
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"error: --wiki-corpus {path} line {n}: not a JSON object with 'title' and 'text' "
                             f"({_error_line(e)})") from None
    if not pages:
        raise SystemExit(f"error: --wiki-corpus {path} holds no page")
    return pages


def _error_line(e: BaseException, max_chars: int = 120) -> str:
    """'TypeName: message' on one bounded line."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:max_chars]


def data_fingerprint(rows: list[dict]) -> str:
    """The training rows' count and hash, kept in each checkpoint: --resume refuses a file rebuilt with other rows."""
    digest = hashlib.sha256(json.dumps(rows, default=str).encode()).hexdigest()
    return f"{len(rows)} rows, sha256 {digest[:12]}"


def ensure_sample_data(cfg, presets: dict) -> None:
    """A preset's data, built offline on first use, at the preset's own paths only (`presets`: flow_grpo's PRESETS;
    `cfg`: its Config, read for the paths, the preset and the seed)."""
    own = presets.get(cfg.preset, {})
    writers = (("train_file", write_dataset), ("val_file", write_dataset), ("wiki_corpus", write_corpus))
    files = [(i, getattr(cfg, key), write) for i, (key, write) in enumerate(writers)
             if getattr(cfg, key) and getattr(cfg, key) == own.get(key)]
    if any(not Path(path).exists() for _, path, _ in files):  # one missing: all again, split together from one seed
        built = build_tools_task() if cfg.preset != "smoke" else build_sample(seed=cfg.seed)
        for i, path, write in files:
            write(built[i], path)
            print(f"wrote the offline {cfg.preset} data: {path} ({len(built[i])} rows)", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- CLI


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Build the Flow-GRPO parquet files: "
        "OUT/train/combined_train.parquet (DeepMath-103K + Natural Questions) "
        "and OUT/val/aime24.parquet (AIME 2024).",
    )
    p.add_argument("--out-dir", type=Path, default=Path("data"),
                   help="directory that receives train/ and val/ (default: data)")
    p.add_argument("--max-samples", type=positive_int, default=None,
                   help="keep at most this many rows per training source "
                   "(mathhard, nq), picked at random with --seed; the "
                   "validation set is always complete (default: all rows)")
    p.add_argument("--seed", type=int, default=42,
                   help="seed for the shuffle of the training set and for "
                   "--max-samples; same seed -> identical files (default: 42)")
    offline = p.add_mutually_exclusive_group()
    offline.add_argument("--sample", action="store_true",
                         help="offline mode: build both files from ~90 built-in "
                         "questions instead of downloading from the Hugging Face Hub")
    offline.add_argument("--tools-task", action="store_true",
                         help="offline mode: write OUT/tools_task/{train,val}.parquet "
                         "and corpus.jsonl: arithmetic, lookups in a corpus of "
                         "invented towns, and both (computed answers)")
    args = p.parse_args(argv)
    if args.tools_task and args.max_samples is not None:
        p.error("--max-samples applies to the hub and --sample sets, not to --tools-task")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tools_task:
        train, val, corpus = build_tools_task(args.seed)
        for rows, name in ((train, "train.parquet"), (val, "val.parquet")):
            print(f"wrote {write_dataset(rows, args.out_dir / TOOLS_TASK_DIR / name)} ({len(rows)} rows)")
        print(f"wrote {write_corpus(corpus, args.out_dir / TOOLS_TASK_DIR / 'corpus.jsonl')} ({len(corpus)} towns)")
        return 0
    if args.sample:
        train, val = build_sample(args.seed, args.max_samples)
    else:
        try:
            train, val = build_hub(args.seed, args.max_samples)
        except HubError as exc:
            # One line, no traceback: the fix (--sample or network) is known.
            print(f"error: {exc}", file=sys.stderr)
            return 1

    for source, n in {**count_by_source(train), **count_by_source(val)}.items():
        print(f"{source}: {n} rows")
    train_path = write_dataset(train, args.out_dir / TRAIN_FILE)
    val_path = write_dataset(val, args.out_dir / VAL_FILE)
    print(f"wrote {train_path} ({len(train)} rows)")
    print(f"wrote {val_path} ({len(val)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
