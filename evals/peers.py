"""Peers in the same run: transformers `generate` on the engine's exact weights and token ids.

    run_hf_peers(loaded, prompt_ids, params) -> [PeerRun(name, completions, stats), ...]

  hf         greedy `generate`, one prompt at a time (batch 1)
  hf-pld     assisted generation with prompt lookup (`prompt_lookup_num_tokens=10`), batch 1
  llama.cpp  llama-cpp-python (optional extra `fastspec[llamacpp]`) on a GGUF of the engine's
             weights written at their precision (fp32 -> F32, bf16 -> F16, int8 -> Q8_0;
             fastspec/model/gguf_writer.py), greedy, fed the same token ids, batch 1, as many
             threads as torch uses

Each peer returns `fastspec.engine.Completion`s and a `RunStats`, so the bench runner fills its
Records for a peer exactly as for an engine method (and compares tokens against AR).

Counting, so τ and tokens/forward mean the same as for the engine:
  forwards       calls of the HF model's forward (a forward hook on the top module)
  rounds         forwards - 1: the first forward is the prefill, as in the engine
  accept_lengths tokens committed by each forward after the first (from a streamer)
With prompt lookup the prefill forward also verifies a draft, so it can commit more than one
token; those extra tokens count in τ = (tokens - 1) / rounds but are not in the histogram.

Peers are always batch 1: run them at one concurrency level (their aggregate tok/s is
sequential throughput).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from fastspec.config import FastspecError
from fastspec.engine import Completion, RunStats
from fastspec.sampling import SamplingParams

PEERS = ("hf", "hf-pld", "llama.cpp")
HF_PEERS = ("hf", "hf-pld")
LLAMACPP_MISSING = ("peer llama.cpp needs llama-cpp-python: pip install 'fastspec[llamacpp]' "
                    "(it builds llama.cpp from source: several minutes)")
PROMPT_LOOKUP_TOKENS = 10


@dataclass
class PeerStats(RunStats):
    # Time of the untimed warm-up call; the runner's `runs` rows carry a warmup_s as well.
    warmup_s: float = 0.0


class PeerRun(NamedTuple):
    name: str
    completions: list[Completion]
    stats: PeerStats


def peer_model(loaded):
    """A transformers model holding the engine's exact weights."""
    from fastspec.evals.speed import hf_model_from
    return hf_model_from(loaded)


def default_eos_ids(loaded) -> set[int]:
    """The engine's stop set: the config's EOS ids plus the tokenizer's."""
    eos = set(loaded.cfg.eos_token_ids)
    tok = loaded.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    return eos


class _Commits:
    """A transformers streamer that timestamps what each forward commits (the prompt comes first)."""

    def __init__(self):
        self.seen_prompt = False
        self.sizes: list[int] = []
        self.t_first = None

    def put(self, value):
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.sizes.append(int(value.numel()))

    def end(self):
        pass


def run_hf_peers(loaded, prompt_ids: list[list[int]], params: SamplingParams, names=HF_PEERS, *,
                 hf=None, eos_ids=None, log: Callable[[str], None] | None = None) -> list[PeerRun]:
    """Decode every token-id prompt with each named peer; [] (with a message) unless greedy.

    prompt_ids: token id lists as the engine encodes them (`engine.encode(text)`), so every
    method sees the same ids. hf: a prebuilt `peer_model(loaded)` to reuse. eos_ids: the stop
    set (default: the engine's).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    check_peers(names)
    if any(isinstance(p, str) for p in prompt_ids):
        raise FastspecError("peers take token ids: encode prompts first (engine.encode(text))")
    if not params.greedy:
        log(f"skipped peers {', '.join(names)}: only greedy decoding is compared "
            f"(--temperature {params.temperature} > 0)")
        return []
    if not prompt_ids or not names:
        return []
    eos = sorted(default_eos_ids(loaded) if eos_ids is None else eos_ids)
    runs = []
    for name in names:
        if name == "llama.cpp":
            try:
                runs.append(_run_llamacpp(loaded, prompt_ids, params, eos))
            except FastspecError as e:          # the peer is lost, not the run
                log(str(e))
            continue
        hf = hf if hf is not None else peer_model(loaded)
        runs.append(_run_peer(hf, name, prompt_ids, params, eos, loaded.tokenizer))
    return runs


def check_peers(names) -> None:
    """Refuse unknown peers and a missing llama-cpp-python before anything runs (one line)."""
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise FastspecError(f"unknown peer {unknown[0]!r} (choose from {', '.join(PEERS)})")
    if "llama.cpp" in names:
        import importlib
        import importlib.util
        if importlib.util.find_spec("llama_cpp") is None:
            raise FastspecError(LLAMACPP_MISSING)
        try:        # installed with --no-deps, or its shared library built for another CPU
            importlib.import_module("llama_cpp")
        except Exception as e:  # noqa: BLE001 - whatever breaks the import, one line
            raise FastspecError(f"peer llama.cpp: llama-cpp-python is installed but does not import "
                                f"({type(e).__name__}: {e}); reinstall it with its dependencies: "
                                f"pip install 'fastspec[llamacpp]'") from None


LLAMACPP_CRASHED = (
    "llama.cpp crashed ({how}) decoding {name} on this CPU, so it is left out of the run. "
    "On CPUs with AMX (Intel Sapphire Rapids and later) its AMX kernels for quantized weights are a "
    "known cause (ggml-org/llama.cpp#20824); rebuild without them: CMAKE_ARGS=\"-DGGML_NATIVE=OFF "
    "-DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" pip install "
    "--force-reinstall --no-deps --no-cache-dir llama-cpp-python")

# Decodes two tokens of a GGUF in a child process: a llama.cpp crash (a native segfault) must
# cost the peer, not the fastspec run it is compared with.
_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, n_threads=int(sys.argv[2]),
                      n_threads_batch=int(sys.argv[2]), verbose=False, seed=0)
for i, _ in enumerate(llm.generate([1, 2, 3, 4], top_k=1, temp=0.0)):
    if i:
        break
"""


def probe_llamacpp(path: Path, threads: int, timeout_s: float = 300.0) -> None:
    """Raise a one-line FastspecError unless llama.cpp loads and decodes `path` in a child process."""
    import signal
    import subprocess
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(threads)], capture_output=True,
                           text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FastspecError(f"llama.cpp did not decode {path.name} within {timeout_s:.0f} s; "
                            "left out of the run") from None
    if r.returncode < 0:
        how = signal.Signals(-r.returncode).name
        raise FastspecError(LLAMACPP_CRASHED.format(how=how, name=path.name))
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise FastspecError(f"llama.cpp failed on {path.name}: {last}")


def llamacpp_model(loaded, directory):
    """A llama_cpp.Llama on a GGUF of the engine's weights at their precision, in `directory`
    (the GGUF is first decoded in a child process: see probe_llamacpp)."""
    import llama_cpp
    from fastspec.model.gguf_writer import source_gguf, write_gguf
    from fastspec.weights import weight_precision
    precision = weight_precision(loaded.model)
    path = write_gguf(loaded.model, Path(directory) / f"fastspec-{precision}.gguf", precision,
                      tokenizer_from=source_gguf(loaded), chat_template=loaded.chat_template)
    probe_llamacpp(path, torch.get_num_threads())
    ctx = min(loaded.cfg.max_position_embeddings, loaded.model.rope_cos.shape[0])
    return llama_cpp.Llama(model_path=str(path), n_ctx=ctx, n_batch=512, n_threads=torch.get_num_threads(),
                           n_threads_batch=torch.get_num_threads(), verbose=False, seed=0)


def llamacpp_generate(llm, ids: list[int], max_new_tokens: int, stop) -> tuple[list[int], float]:
    """Greedy tokens after `ids` (at most max_new_tokens, through the first stop token) and the
    time from the call to the first token (prefill)."""
    t0, ttft, new = time.perf_counter(), None, []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if ttft is None:
            ttft = time.perf_counter() - t0
        new.append(int(tok))
        if len(new) >= max_new_tokens or tok in stop:
            break
    return new, ttft or 0.0


def _run_llamacpp(loaded, prompt_ids, params, eos) -> PeerRun:
    import tempfile
    check_peers(["llama.cpp"])
    stop = set() if params.ignore_eos else set(eos)
    tok = loaded.tokenizer
    with tempfile.TemporaryDirectory(prefix="fastspec-gguf-") as d:
        t0 = time.perf_counter()
        llm = llamacpp_model(loaded, d)
        llamacpp_generate(llm, prompt_ids[0], 2, stop)       # load + first-call overhead, untimed
        stats = PeerStats(requests=len(prompt_ids), warmup_s=time.perf_counter() - t0)
        comps = []
        t_start = time.perf_counter()
        for i, ids in enumerate(prompt_ids):
            t0 = time.perf_counter()
            new, ttft = llamacpp_generate(llm, list(ids), params.max_new_tokens, stop)
            latency = time.perf_counter() - t0
            # One token per forward after the prefill, as in AR.
            comps.append(Completion(
                i, list(ids), new, None if tok is None else tok.decode(new, skip_special_tokens=True),
                "eos" if stop and new and new[-1] in stop else "length",
                max(len(new) - 1, 0), ttft, latency, [1] * max(len(new) - 1, 0), len(new)))
            stats.prefill_s += ttft
            stats.decode_s += latency - ttft
        stats.wall_s = time.perf_counter() - t_start
        del llm
    return _finished("llama.cpp", comps, stats)


def _run_peer(hf, name, prompt_ids, params, eos, tokenizer) -> PeerRun:
    from transformers import GenerationConfig
    stop = [] if params.ignore_eos else eos
    kw = dict(do_sample=False, eos_token_id=stop or None, pad_token_id=eos[0] if eos else 0)
    if name == "hf-pld":
        kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    device = next(hf.parameters()).device
    forwards = 0

    def count(*_):
        nonlocal forwards
        forwards += 1

    def generate(ids, max_new_tokens, streamer=None):
        x = torch.tensor([ids], device=device)
        gc = GenerationConfig(max_new_tokens=max_new_tokens, **kw)
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gc, streamer=streamer)
        return out[0, len(ids):].tolist()

    t0 = time.perf_counter()
    generate(prompt_ids[0], 2)       # first-call overhead stays out of the timed loop
    stats = PeerStats(requests=len(prompt_ids), warmup_s=time.perf_counter() - t0)
    hook = hf.register_forward_hook(count)
    comps = []
    try:
        t_start = time.perf_counter()
        for i, ids in enumerate(prompt_ids):
            forwards, commits = 0, _Commits()
            t0 = time.perf_counter()
            new = generate(ids, params.max_new_tokens, commits)
            latency = time.perf_counter() - t0
            ttft = (commits.t_first or t0 + latency) - t0
            cut = next((j + 1 for j, t in enumerate(new) if t in stop), len(new))
            new = new[:cut]      # nothing past a stop token, as in the engine
            comps.append(Completion(
                i, list(ids), new, None if tokenizer is None else tokenizer.decode(new, skip_special_tokens=True),
                "eos" if stop and new and new[-1] in stop else "length",
                max(forwards - 1, 0), ttft, latency, commits.sizes[1:], forwards))
            stats.prefill_s += ttft
            stats.decode_s += latency - ttft
        stats.wall_s = time.perf_counter() - t_start
    finally:
        hook.remove()
    return _finished(name, comps, stats)


def _finished(name: str, comps: list[Completion], stats: PeerStats) -> PeerRun:
    """The run's totals from its completions."""
    stats.new_tokens = sum(len(c.token_ids) for c in comps)
    stats.forwards = stats.request_forwards = sum(c.forwards for c in comps)
    stats.rounds = sum(c.rounds for c in comps)
    return PeerRun(name, comps, stats)
