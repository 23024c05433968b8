"""Write a loaded model's weights as a GGUF file that llama.cpp (and fastspec's loader) reads.

    write_gguf(model, "m.gguf", precision="int8", tokenizer_from=source_gguf(loaded))

It is the inverse of `loader._read_gguf`: HF tensor names -> llama.cpp names, llama's Q/K rows
permuted into llama.cpp's rotation order, Llama 3 rope scaling as a `rope_freqs` tensor. The
2-D weights are stored at the GGUF type matching fastspec's weight precision (the norms stay
f32), so a peer engine runs on the same numbers fastspec runs:

    fastspec --weights   GGUF type   exact?
    fp32                 F32         yes
    bf16                 F16         yes in f16's range: bf16 keeps 8 mantissa bits, f16 has 10
                                     (only weights below 6e-5 in magnitude lose bits)
    int8                 Q8_0        no: Q8_0 scales each block of 32 inputs, fastspec each
                                     output row; both are 8-bit symmetric

The tokenizer is copied from the GGUF the model came from (`tokenizer_from`: every
`tokenizer.*` field) when there is one; otherwise the file says "no_vocab" and carries token
ids only (enough for a peer fed with token ids).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fastspec.config import FastspecError, ModelConfig
from fastspec.model.llama import LlamaModel
from fastspec.model.loader import DEFAULT_MODEL, GGUF_ARCHS, GGUF_LAYER_NAMES, GGUF_TOP_NAMES, _smollm2_gguf

GGUF_TYPE_FOR = {"fp32": "F32", "bf16": "F16", "int8": "Q8_0"}
# The loader's GGUF <-> HF tables, read the other way.
_ARCH_FOR = {hf: arch for arch, hf in GGUF_ARCHS.items()}
_LAYER_NAMES = {hf: g for g, hf in GGUF_LAYER_NAMES.items()}
_TOP_NAMES = {hf: g for g, hf in GGUF_TOP_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`."""
    stem, _, kind = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, i, rest = stem.split(".", 3)
        return f"blk.{i}.{_LAYER_NAMES[rest]}.{kind}"
    return f"{_TOP_NAMES[stem]}.{kind}"


def llamacpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF Q/K rows -> llama.cpp's: llama.cpp rotates adjacent pairs (2i, 2i+1) of a head, HF
    rotates (i, i + D/2), so per head GGUF row 2i+h holds HF row h*D/2+i
    ([q0 q1 q2 q3] with D=4 -> [q0 q2 q1 q3]). `loader.unpermute_rope` undoes it."""
    d = w.shape[0] // n_heads
    idx = torch.arange(d).view(2, d // 2).t().reshape(-1)
    return w.reshape(n_heads, d, *w.shape[1:])[:, idx].reshape(w.shape)


def llama3_rope_factors(cfg: ModelConfig) -> np.ndarray:
    """Llama 3 rope scaling as llama.cpp stores it: one divisor per frequency, not metadata."""
    sc = cfg.rope_scaling
    old, lo, hi = sc["original_max_position_embeddings"], sc["low_freq_factor"], sc["high_freq_factor"]
    out = []
    for i in range(0, cfg.head_dim, 2):
        wavelen = 2 * np.pi * cfg.rope_theta ** (i / cfg.head_dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(sc["factor"])
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / sc["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def source_gguf(loaded) -> Path | None:
    """The GGUF file a LoadedModel came from, if any (the default model is read from one)."""
    if loaded.path and str(loaded.path).endswith(".gguf"):
        return Path(loaded.path)
    if loaded.name == DEFAULT_MODEL:
        try:
            return _smollm2_gguf()
        except FastspecError:
            return None
    return None


def _copy_tokenizer(writer, path: Path) -> bool:
    """Every `tokenizer.*` field of the GGUF at `path`, with its exact value types."""
    from gguf import GGUFReader, GGUFValueType
    fields = [f for name, f in GGUFReader(str(path)).fields.items() if name.startswith("tokenizer.")]
    for f in fields:
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    return any(f.name == "tokenizer.ggml.model" for f in fields)


def write_gguf(model: LlamaModel, path, precision: str = "fp32", *, tokenizer_from: Path | None = None,
               chat_template: str | None = None) -> Path:
    """Write `model`'s base weights (no draft adapter) to `path` at `precision`'s GGUF type."""
    import gguf
    if precision not in GGUF_TYPE_FOR:
        raise FastspecError(f"unknown weight precision {precision!r} (choose {', '.join(GGUF_TYPE_FOR)})")
    c = model.cfg
    arch = _ARCH_FOR.get(c.architecture)
    if arch is None:
        raise FastspecError(f"cannot write a GGUF for {c.architecture} (fastspec writes "
                            f"{', '.join(_ARCH_FOR)})")
    sc = c.rope_scaling
    if sc and sc["rope_type"] not in ("llama3", "linear", "yarn"):
        raise FastspecError(f"cannot write rope scaling {sc['rope_type']!r} to GGUF")
    qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPE_FOR[precision])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in ((w.add_block_count, c.num_layers), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_heads), (w.add_head_count_kv, c.num_kv_heads),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_rope_dimension_count, c.head_dim), (w.add_vocab_size, c.vocab_size),
                       (w.add_rope_freq_base, c.rope_theta), (w.add_layer_norm_rms_eps, c.rms_norm_eps)):
        add(value)
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[GGUF_TYPE_FOR[precision]])
    if sc and sc["rope_type"] in ("linear", "yarn"):
        w.add_rope_scaling_type(getattr(gguf.RopeScalingType, sc["rope_type"].upper()))
        w.add_rope_scaling_factor(sc["factor"])
        if "original_max_position_embeddings" in sc:
            w.add_rope_scaling_orig_ctx_len(sc["original_max_position_embeddings"])
    if tokenizer_from is None or not _copy_tokenizer(w, Path(tokenizer_from)):
        w.add_tokenizer_model("no_vocab")       # token ids only
        if c.bos_token_id is not None:
            w.add_bos_token_id(c.bos_token_id)
        if c.eos_token_ids:
            w.add_eos_token_id(c.eos_token_ids[0])
        if chat_template:
            w.add_chat_template(chat_template)
    if sc and sc["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(c))
    for name, t in model.hf_state_dict().items():
        g = gguf_name(name)
        if arch == "llama" and ".attn_q." in g:
            t = llamacpp_permute(t, c.num_heads)
        elif arch == "llama" and ".attn_k." in g:
            t = llamacpp_permute(t, c.num_kv_heads)
        arr = t.detach().float().cpu().numpy()
        if arr.ndim == 2 and precision != "fp32":
            w.add_tensor(g, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(g, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
