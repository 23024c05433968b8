"""Training data for the draft adapter: prompts and the base model's own greedy continuations.

The drafter is trained to predict what the verifier (the base model, adapter off) would say, so
the targets are self-distilled: each prompt's greedy continuation from fastspec's own engine.
Generating them is the slow part, so they are cached in a jsonl per (model fingerprint, dtype,
max_new_tokens), one line per prompt keyed by a hash of the prompt's token ids; a rerun, or a run
with more prompts, only generates what is missing. Lines are appended as batches finish, so an
interrupted generation resumes where it stopped.

Prompts: a weighted mixture of prompt files (`--train-data FILE[:weight],...`: GSM8K train
questions get the benchmark's math instruction appended, as at eval time; code / general files
give their `prompt`), or by default GSM8K train plus a small built-in set of general requests.
All are rendered with the model's chat template. Files inside a benchmark data folder
($FASTSPEC_DATA, ../shared/data/benchmarks) are refused: the drafter never sees a test set.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from fastspec.config import FastspecError

# The instruction the math benchmarks append (kept in step with fastspec.evals.prompts).
MATH_INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."
DEFAULT_DATA = "../shared/data/train/gsm8k_train.jsonl"
BENCHMARK_DATA = "../shared/data/benchmarks"
DATA_ENV = "FASTSPEC_TRAIN_DATA"
TEXT_FIELDS = ("question", "prompt", "instruction", "text")

# Written for this project: everyday requests of the kinds the benchmarks do not cover
# (chat, explanation, writing, code, editing, planning). None comes from an evaluation set.
GENERAL_PROMPTS: tuple[str, ...] = (
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a short poem about autumn leaves falling in a city park.",
    "What are three tips for staying focused while working from home?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Summarize the water cycle in one paragraph.",
    "Give me a recipe for a quick vegetarian pasta dinner.",
    "What is the difference between a list and a tuple in Python?",
    "Write a polite email asking my manager for a day off next Friday.",
    "Explain what a hash table is and why lookups are fast.",
    "Describe the plot of a mystery story set on a night train, in five sentences.",
    "How do vaccines help the immune system?",
    "Write a JavaScript function that removes duplicate values from an array.",
    "What should I pack for a three-day hiking trip?",
    "Explain recursion to a ten-year-old.",
    "Write a SQL query that finds the five customers with the highest total order value.",
    "Why is the sky blue?",
    "Give me a weekly workout plan for a beginner with no equipment.",
    "Write a bash one-liner that counts the lines in every .txt file in a folder.",
    "What are the main causes of inflation?",
    "Write a haiku about a cup of coffee on a rainy morning.",
    "Explain the difference between TCP and UDP.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "How can I improve my public speaking skills?",
    "Describe photosynthesis step by step.",
    "Write a short story opening about a robot who learns to paint.",
    "What is the time complexity of binary search, and why?",
    "Give three arguments for and three against school uniforms.",
    "Write a regular expression that matches a valid email address and explain it.",
    "How does compound interest work? Give an example.",
    "Translate into French: 'The library opens at nine and closes at six.'",
    "Explain what a neural network is in plain language.",
    "Write a Python script that reads a CSV file and prints the average of one column.",
    "What are some good habits for better sleep?",
    "Write a product description for a reusable water bottle.",
    "Explain the rules of chess for a complete beginner.",
    "Write a function in C that reverses a string in place.",
    "What happened during the industrial revolution, briefly?",
    "Suggest five names for a small bakery and explain each.",
    "Explain the difference between weather and climate.",
    "Rewrite this sentence to be more formal: 'We gotta fix this bug fast or the boss will be mad.'",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "How do I make a good first impression at a job interview?",
    "Explain what Git branches are and how merging works.",
    "Write a limerick about a cat who loves boxes.",
    "What are the planets of the solar system, in order from the sun?",
    "Write a unit test in Python for a function add(a, b) using pytest.",
    "Explain supply and demand with an everyday example.",
    "Plan a one-day sightseeing itinerary for a first visit to a large European city.",
    "What is the difference between an interpreter and a compiler?",
    "Write a thank-you note to a friend who helped me move house.",
    "Explain how a bicycle stays upright while moving.",
    "Write a Python generator that yields prime numbers forever.",
    "Give me a list of ten interesting conversation starters.",
    "Explain what an API is, with an example.",
    "Write a dialogue between a customer and a barista ordering coffee.",
    "How should I start learning to play the guitar?",
    "Explain the difference between mean, median and mode with examples.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "What are the benefits and risks of social media for teenagers?",
    "Describe a sunset over the ocean using vivid imagery.",
    "Explain how to convert a decimal number to binary, with an example.",
    "Write a short motivational message for someone starting a new job.",
)


@dataclass
class Example:
    """One training sequence: a rendered prompt and the base model's continuation of it."""
    prompt_ids: list[int]
    target_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.target_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


# --- prompts --------------------------------------------------------------------------------
def default_data_path() -> Path | None:
    """$FASTSPEC_TRAIN_DATA, else ../shared/data/train/gsm8k_train.jsonl (beside the repo or cwd)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    for base in (repo, Path.cwd()):
        p = (base / DEFAULT_DATA).resolve()
        if p.is_file():
            return p
    return None


def benchmark_dirs() -> list[Path]:
    """Folders holding evaluation data, which training must never read: $FASTSPEC_DATA and
    ../shared/data/benchmarks (beside the repo or the cwd)."""
    repo = Path(__file__).resolve().parents[2]
    raw = [os.environ.get("FASTSPEC_DATA"), repo / BENCHMARK_DATA, Path.cwd() / BENCHMARK_DATA]
    if raw[0] and not Path(raw[0]).expanduser().is_absolute():
        raw.append(repo / raw[0])          # make sets it relative to the repo
    return list(dict.fromkeys(Path(r).expanduser().resolve() for r in raw if r))


def check_not_benchmark(path: str | os.PathLike) -> Path:
    """The resolved path; FastspecError when it lies inside a benchmark data folder."""
    p = Path(path).expanduser().resolve()
    for d in benchmark_dirs():
        if p == d or d in p.parents:
            raise FastspecError(f"refusing to train on {p}: it is benchmark data ({d}); "
                                "training prompts come from ../shared/data/train")
    return p


def load_questions(path: str | os.PathLike, limit: int | None = None) -> list[str]:
    """User texts from a jsonl: field question (or prompt / instruction / text) per line.
    Files under a benchmark data folder are refused."""
    p = check_not_benchmark(path)
    if not p.is_file():
        raise FastspecError(f"training data {p} not found (a jsonl with a 'question' or 'prompt' "
                            "field per line)")
    out: list[str] = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise FastspecError(f"{p}:{n} is not valid JSON") from None
            text = next((row[k] for k in TEXT_FIELDS if isinstance(row, dict) and row.get(k)), None)
            if not isinstance(text, str):
                raise FastspecError(f"{p}:{n} has none of the fields {', '.join(TEXT_FIELDS)}")
            if isinstance(row, dict) and row.get("question") and MATH_INSTRUCTION not in text:
                text = f"{text}\n\n{MATH_INSTRUCTION}"    # GSM8K-style: as at eval time
            out.append(text)
            if limit is not None and len(out) >= limit:
                break
    return out


@dataclass(frozen=True)
class Source:
    """One file of a training-data mixture and its weight."""
    path: str
    weight: float = 1.0

    def to_arg(self) -> str:
        return f"{self.path}:{self.weight:g}"


def parse_mixture(spec: str) -> list[Source]:
    """`FILE[:weight],...` -> sources (weight 1 when omitted)."""
    out = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        path, _, w = item.rpartition(":")
        try:
            weight = float(w) if path else 1.0
        except ValueError:
            path, weight = item, 1.0
        path = path or item
        if not weight > 0:
            raise FastspecError(f"--train-data weight must be > 0, got {item!r}")
        out.append(Source(path, weight))
    if not out:
        raise FastspecError("--train-data names no file")
    return out


def mixture_counts(sources: Sequence[Source], sizes: Sequence[int], total: int) -> list[int]:
    """Prompts to take from each source: proportional to the weights (largest remainders), capped
    by each file's size (the spare share goes to the others, still by weight)."""
    counts = [0] * len(sources)
    left, open_ = total, [i for i in range(len(sources)) if sizes[i] > 0]
    while left > 0 and open_:
        wsum = sum(sources[i].weight for i in open_)
        share = {i: left * sources[i].weight / wsum for i in open_}
        add = {i: int(share[i]) for i in open_}
        for i in sorted(open_, key=lambda i: share[i] - add[i], reverse=True)[: left - sum(add.values())]:
            add[i] += 1
        for i in open_:
            add[i] = min(add[i], sizes[i] - counts[i])
            counts[i] += add[i]
        left -= sum(add.values())
        open_ = [i for i in open_ if counts[i] < sizes[i]]
    return counts


def interleave(groups: Sequence[Sequence[str]]) -> list[str]:
    """Merge so that every prefix keeps each group's share (an interrupted generation, or a run
    that only used the first prompts, still has the mixture)."""
    total = sum(len(g) for g in groups)
    taken, out = [0] * len(groups), []
    for n in range(1, total + 1):
        i = max((j for j in range(len(groups)) if taken[j] < len(groups[j])),
                key=lambda j: n * len(groups[j]) / total - taken[j])
        out.append(groups[i][taken[i]])
        taken[i] += 1
    return out


def mixture_prompts(sources: Sequence[Source], max_prompts: int, seed: int = 0,
                    exclude: frozenset[str] | set[str] = frozenset()) -> tuple[list[str], list[dict]]:
    """User messages drawn from the sources by weight (a seeded shuffle of each file), interleaved,
    and a record per source: path, weight, prompts taken, rows in the file. `exclude`: texts
    never to draw (a drafter's own training prompts, `lineage_training_prompts`); each file's
    record then says how many of its rows were held out."""
    if max_prompts < 1:
        raise FastspecError(f"--max-prompts must be >= 1, got {max_prompts}")
    texts = [load_questions(s.path) for s in sources]
    pools = []
    for k, t in enumerate(texts):
        g = torch.Generator().manual_seed(seed * 1000 + k)
        pools.append([t[i] for i in torch.randperm(len(t), generator=g).tolist()
                      if t[i] not in exclude])
    counts = mixture_counts(sources, [len(p) for p in pools], max_prompts)
    groups = [p[:n] for p, n in zip(pools, counts)]
    record = [{"path": s.path, "weight": s.weight, "prompts": n, "rows": len(t),
               **({"excluded": len(t) - len(p)} if exclude else {})}
              for s, t, p, n in zip(sources, texts, pools, counts)]
    return interleave(groups), record


def lineage_training_prompts(meta: dict | None, sources: Sequence[Source] = ()) -> set[str]:
    """The prompts a drafter was trained on, with those of every adapter it was initialised from
    (`init_adapter_meta`, nested), rebuilt from each run's record: per data file, the first
    `prompts` of the permutation `mixture_prompts` drew with the run's --seed (a run without
    --train-data: its `training_prompts`). A recorded file missing here is looked up by name
    among `sources`; one whose row count changed is skipped (its permutation would differ)."""
    by_name = {Path(s.path).name: s.path for s in sources}
    seen: set[str] = set()
    while meta:
        words = str(meta.get("command", "")).split()
        seed = int(words[words.index("--seed") + 1]) if "--seed" in words[:-1] else 0
        for k, d in enumerate(meta.get("data") or []):
            recorded = d.get("path")
            path = recorded if recorded and os.path.isfile(recorded) else \
                by_name.get(Path(recorded or "").name)
            if d.get("builtin_general_prompts"):     # a run without --train-data
                seen.update(training_prompts(path, d["prompts"], seed=seed))
                continue
            if path is None or "prompts" not in d:
                continue
            t = load_questions(path)
            if len(t) != d.get("rows", len(t)):
                continue
            g = torch.Generator().manual_seed(seed * 1000 + k)
            seen.update(t[i] for i in torch.randperm(len(t), generator=g)[: d["prompts"]].tolist())
        meta = meta.get("init_adapter_meta")
    return seen


def training_prompts(data_path: str | os.PathLike | None, max_prompts: int, seed: int = 0,
                     math_instruction: bool = True) -> list[str]:
    """User messages: the built-in general prompts, then data questions (seeded shuffle) up to
    `max_prompts` in all. GSM8K-style questions get the benchmark's math instruction."""
    if max_prompts < 1:
        raise FastspecError(f"--max-prompts must be >= 1, got {max_prompts}")
    general = list(GENERAL_PROMPTS)[:max_prompts]
    questions = load_questions(data_path) if data_path is not None else []
    if not math_instruction:
        questions = [q.removesuffix(f"\n\n{MATH_INSTRUCTION}") for q in questions]
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(questions), generator=g).tolist()
    picked = [questions[i] for i in order[: max(0, max_prompts - len(general))]]
    # Interleave so any prefix of the list (an interrupted generation) has both kinds.
    out, step = [], max(1, len(picked) // max(1, len(general)))
    gi = 0
    for i, q in enumerate(picked):
        if i % step == 0 and gi < len(general):
            out.append(general[gi])
            gi += 1
        out.append(q)
    return out + general[gi:]


# --- self-distilled targets -----------------------------------------------------------------
def prompt_key(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:20]


# The config fields that change what the model computes (a named list, not repr(cfg): a field
# added to ModelConfig later must not orphan the target cache and the checkpoints of a long run).
FINGERPRINT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                      "tie_word_embeddings", "attention_bias", "eos_token_ids",
                      "attn_temperature_beta", "attn_temperature_length")


def model_fingerprint(model, name: str = "") -> str:
    """Short hash of the config, dtype and a few weight slices: a changed model gets new targets."""
    h = hashlib.sha256()
    fields = [getattr(model.cfg, f, None) for f in FINGERPRINT_FIELDS]
    h.update(json.dumps([name, fields, str(model.embed.dtype)], default=str).encode())
    with torch.no_grad():
        probes = [model.embed[:8], model.layers[0].attn.wqkv[:8], model.layers[-1].mlp.w_down[:8],
                  model.norm.weight]
        for t in probes:
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def _slug(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(str(name)).name)
    return keep.strip("-.") or "model"


def target_cache_path(loaded, max_new_tokens: int, root: str | os.PathLike | None = None) -> Path:
    """$FASTSPEC_CACHE/train_targets/<model>-<fingerprint>-n<max_new_tokens>.jsonl"""
    if root is None:
        from fastspec.model.loader import cache_dir
        root = cache_dir() / "train_targets"
    fp = model_fingerprint(loaded.model, loaded.name)
    return Path(root) / f"{_slug(loaded.name)}-{fp}-n{max_new_tokens}.jsonl"


def read_target_cache(path: Path) -> dict[str, list[int]]:
    """key -> target ids. A torn last line (interrupted write) is skipped."""
    out: dict[str, list[int]] = {}
    if not path.is_file():
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
                out[row["key"]] = [int(t) for t in row["target_ids"]]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    return out


def encode_prompts(engine, prompts: Sequence[str | list[int]]) -> list[list[int]]:
    """Token ids per prompt: user texts rendered with the chat template; id lists as given."""
    return [engine.encode(engine.render_chat([{"role": "user", "content": p}]))
            if isinstance(p, str) else engine.encode(p) for p in prompts]


def build_targets(loaded, prompts: Sequence[str | list[int]], max_new_tokens: int = 256,
                  cache_path: str | os.PathLike | None = None, concurrency: int = 16,
                  console=None, progress: bool = True, backend: str = "eager") -> list[Example]:
    """Self-distilled examples: the base model's greedy continuation of every prompt.

    `loaded` is a LoadedModel (or anything with model/cfg/tokenizer/name); the adapter, if any,
    plays no part (the engine runs plain AR decoding with the adapter off). Continuations already
    in the cache file are reused; the missing ones are generated `concurrency` at a time and
    appended to the file as each chunk finishes.
    """
    from fastspec.engine import Engine
    from fastspec.sampling import SamplingParams

    if max_new_tokens < 2:
        raise FastspecError(f"--target-tokens must be >= 2, got {max_new_tokens}")
    engine = Engine(loaded, backend=backend)
    all_ids = encode_prompts(engine, prompts)
    limit = engine.max_context - max_new_tokens
    kept = [ids for ids in all_ids if len(ids) <= limit]
    if not kept:
        raise FastspecError("every training prompt is longer than the model's context allows")
    path = Path(cache_path) if cache_path is not None else target_cache_path(loaded, max_new_tokens)
    cached = read_target_cache(path)
    missing: list[list[int]] = []
    seen: set[str] = set()
    for ids in kept:
        k = prompt_key(ids)
        if k not in cached and k not in seen:
            seen.add(k)
            missing.append(ids)

    if missing:
        path.parent.mkdir(parents=True, exist_ok=True)
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        bar = _progress(console) if progress else None
        task = bar.add_task("self-distilling targets", total=len(missing), tps=0.0) if bar else None
        t0, tokens = time.perf_counter(), 0
        streamed: dict[int, list[int]] = {i: [] for i in range(len(missing))}
        written: set[int] = set()
        eos = set(getattr(engine, "eos_ids", loaded.cfg.eos_token_ids))

        with open(path, "a", encoding="utf-8") as f:
            if f.tell() and path.read_bytes()[-1:] != b"\n":
                f.write("\n")                  # a torn last line (killed mid-write) stays alone
            def write(i: int, target: list[int], finish: str) -> None:
                ids = missing[i]
                cached[prompt_key(ids)] = list(target)
                f.write(json.dumps({"key": prompt_key(ids), "max_new_tokens": max_new_tokens,
                                    "finish": finish, "prompt_ids": ids,
                                    "target_ids": list(target)}) + "\n")
                f.flush()
                if bar is not None and i not in written:
                    bar.update(task, advance=1, tps=tokens / max(time.perf_counter() - t0, 1e-9))
                written.add(i)

            def on_commit(i: int, new: list[int], *_) -> None:
                # One generate call keeps every slot busy (continuous batching); each request is
                # appended to the cache as soon as it finishes, so an interruption loses little.
                nonlocal tokens
                out = streamed[i]
                out.extend(new)
                tokens += len(new)
                if out and (out[-1] in eos or len(out) >= max_new_tokens) and i not in written:
                    write(i, out[:max_new_tokens], "eos" if out[-1] in eos else "length")

            if bar is not None:
                bar.start()
            try:
                done = engine.generate(missing, params, method="ar", concurrency=concurrency,
                                       on_commit=on_commit)
                for comp in done:      # the completions are authoritative
                    if comp.index not in written or cached[prompt_key(missing[comp.index])] != comp.token_ids:
                        write(comp.index, comp.token_ids, comp.finish_reason)
            finally:
                if bar is not None:
                    bar.stop()
    return [Example(ids, cached[prompt_key(ids)]) for ids in kept]


def _progress(console):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[tps]:.0f} tok/s"), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)
