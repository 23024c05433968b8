"""Nemotron-Labs-Diffusion (NLD) checkpoints, read natively (no `trust_remote_code`).

An NLD checkpoint is a self-speculative model: one Ministral3 backbone (the "encoder") with an
LM head (`diffusion_head`) drafts blocks in diffusion mode and verifies them autoregressively.
The directory, as fastspec reads it:

    config.json                 architectures ["NemotronLabsDiffusionModel"], mask_token_id,
                                block_size, dlm_paradigm (block_diff / bidirectional), and the
                                Ministral3 backbone's fields (at the top level, or nested under
                                text_config / encoder_config)
    model.safetensors[.index.json]
                                encoder.embed_tokens.weight, encoder.layers.N.self_attn.q_proj
                                .weight, ..., encoder.norm.weight, diffusion_head.weight
    linear_spec_lora/           the draft LoRA of linear self-speculation (PEFT layout):
        adapter_config.json         r, lora_alpha, target_modules (published: o_proj only, r=128,
                                    alpha=512, dropout 0)
        adapter_model.safetensors   base_model.model.encoder.layers.N.self_attn.o_proj.lora_A.weight
                                    / .lora_B.weight, ...

NLD drafts by its own convention (`fastspec.convention.NLD`), which loading records as the
model's `draft_convention`: the block `[seed, MASK x (B-1)]` at positions L..L+B-1 is
bidirectional as a whole (seed included) over the causal prefix, the LoRA is on for every block
token (seed included) and computed in fp32, and there is no token shift (block position i
predicts the token at L+i). The MASK token is a real vocabulary entry (`mask_token_id`), so no
learned MASK embedding is stored; the draft adapter takes that token's own embedding row, and
MASK is never drafted. The verify pass `[seed, d1..d(B-1)]` is the backbone alone (causal,
adapter off), exactly as for any fastspec adapter.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from fastspec.config import FastspecError, ModelConfig
from fastspec.convention import NLD

ARCHITECTURE = "NemotronLabsDiffusionModel"
LORA_DIR = "linear_spec_lora"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
            "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def is_nld_config(hf: dict) -> bool:
    return ARCHITECTURE in (hf.get("architectures") or []) or hf.get("model_type") == "nemotron_labs_diffusion"


def backbone_config(hf: dict) -> tuple[ModelConfig, dict]:
    """The Ministral3 backbone's ModelConfig and the diffusion fields (mask_token_id, block_size,
    dlm_paradigm)."""
    inner = hf.get("text_config") or hf.get("encoder_config") or {}
    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "auto_map",
                                                       "text_config", "encoder_config")}
    fields.update(inner)
    fields["architectures"] = ["Ministral3ForCausalLM"]
    if "mask_token_id" not in hf and "mask_token_id" not in inner:
        raise FastspecError("NLD config.json has no mask_token_id")
    mask_id = int(hf.get("mask_token_id", inner.get("mask_token_id")))
    block = int(hf.get("block_size", inner.get("block_size", 32)))
    paradigm = hf.get("dlm_paradigm", inner.get("dlm_paradigm"))
    cfg = ModelConfig.from_hf(fields)
    if not 0 <= mask_id < cfg.vocab_size:
        raise FastspecError(f"NLD mask_token_id {mask_id} is outside the vocabulary ({cfg.vocab_size})")
    info = {"mask_token_id": mask_id, "block_size": block, "dlm_paradigm": paradigm}
    return cfg.replace(extra={**cfg.extra, "nld": info}), info


def backbone_name(name: str) -> str:
    """An NLD tensor name -> its HF Llama name: encoder.* -> model.*, diffusion_head -> lm_head."""
    if name.startswith("encoder."):
        return "model." + name.removeprefix("encoder.")
    if name.startswith("diffusion_head."):
        return "lm_head." + name.removeprefix("diffusion_head.")
    return name


def load_linear_spec_lora(model, directory: str | Path, mask_token_id: int, block_size: int,
                          dlm_paradigm: str | None = None) -> None:
    """Attach `linear_spec_lora/` (PEFT LoRA on the attention (and MLP) projections) as the draft adapter,
    with NLD's drafting convention (fp32 LoRA, no shift, bidirectional block, adapter at the seed)."""
    from safetensors.torch import load_file

    from fastspec.draft import AdapterConfig, attach_adapter, fuse_adapter

    d = Path(directory)
    try:
        pc = json.loads((d / PEFT_CONFIG).read_text())
        sd = load_file(str(d / PEFT_WEIGHTS))
    except Exception as e:  # missing / corrupt: one line
        raise FastspecError(f"cannot read the NLD draft adapter in {d}: {str(e).splitlines()[0]}") from None
    modules = pc.get("target_modules") or list(_TARGETS)
    if isinstance(modules, str):
        modules = [modules]
    unknown = [m for m in modules if m not in _TARGETS]
    if unknown:
        raise FastspecError(f"NLD adapter targets {unknown}: fastspec supports {list(_TARGETS)}")
    rank = int(pc.get("r", 8))
    alpha = float(pc.get("lora_alpha", rank))
    if pc.get("use_rslora"):                  # scale alpha / sqrt(r), as fastspec's alpha / r
        alpha *= rank ** 0.5
    cfg = AdapterConfig(rank=rank, alpha=alpha, targets=tuple(_TARGETS[m] for m in modules),
                        mask_token_id=mask_token_id, block_size=block_size,
                        convention=NLD.to_dict(),
                        meta={"source": f"NLD {LORA_DIR}", "path": str(d), "dlm_paradigm": dlm_paradigm,
                              "lora_dropout": pc.get("lora_dropout")})
    attach_adapter(model, cfg)

    def take(layer: int, module: str, which: str) -> torch.Tensor:
        part = "mlp" if module in _MLP_MODULES else "self_attn"
        for prefix in ("base_model.model.encoder.", "base_model.model.model.", "encoder.", "model.", ""):
            key = f"{prefix}layers.{layer}.{part}.{module}.lora_{which}.weight"
            if key in sd:
                return sd[key]
        raise FastspecError(f"NLD adapter {d} lacks layers.{layer}.{part}.{module}.lora_{which}")

    with torch.no_grad():
        for i, blk in enumerate(model.layers):
            for module in modules:
                lora = (blk.mlp if module in _MLP_MODULES else blk.attn).lora[_TARGETS[module]]
                a, b = take(i, module, "A"), take(i, module, "B")
                if a.shape != lora.A.shape or b.shape != lora.B.shape:
                    raise FastspecError(f"NLD adapter {module} of layer {i}: shapes {list(a.shape)}, "
                                        f"{list(b.shape)} do not fit rank {rank}")
                lora.A.copy_(a)             # fp32 parameters (NLD.lora_dtype): exact copies
                lora.B.copy_(b)
        # MASK is a vocabulary token: its draft embedding is the trained row itself.
        model.mask_embed.copy_(model.embed[mask_token_id])
    fuse_adapter(model)


# --- load-memory check: `python -m fastspec.model.nld DIR [--layers 4]` -------------------------
NLD_8B_SHAPES = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=131072)


def _stream_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], make) -> None:
    """Write bf16 tensors one at a time (`make(name, shape)`), never all in memory."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2 * int(torch.tensor(shape).prod())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in shapes.items():
            f.write(make(name, shape).contiguous().view(torch.uint8).numpy().tobytes())


def write_random_nld(directory: str | Path, layers: int = 4, seed: int = 0,
                     shapes: dict | None = None) -> Path:
    """A random bf16 checkpoint in NLD's layout with NLD-8B's layer shapes (or `shapes`), `layers`
    of them, its o_proj-only r=128 linear_spec_lora included."""
    d = Path(directory)
    (d / LORA_DIR).mkdir(parents=True, exist_ok=True)
    s = shapes or NLD_8B_SHAPES
    h, hd, nh, kv, inter, vocab = (s["hidden_size"], s["head_dim"], s["num_attention_heads"],
                                   s["num_key_value_heads"], s["intermediate_size"], s["vocab_size"])
    (d / "config.json").write_text(json.dumps({
        "architectures": [ARCHITECTURE], "model_type": "nemotron_labs_diffusion", **s,
        "num_hidden_layers": layers, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
        "rope_theta": 1e9, "tie_word_embeddings": False, "mask_token_id": 100, "block_size": 32,
        "dlm_paradigm": "block_diff", "torch_dtype": "bfloat16"}, indent=1))
    shapes = {"encoder.embed_tokens.weight": (vocab, h), "encoder.norm.weight": (h,),
              "diffusion_head.weight": (vocab, h)}
    for i in range(layers):
        p = f"encoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                       p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    g = torch.Generator().manual_seed(seed)

    def make(name, shape):
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    _stream_safetensors(d / "model.safetensors", shapes, make)
    lora = {}
    for i in range(layers):
        p = f"base_model.model.encoder.layers.{i}.self_attn.o_proj."
        lora[p + "lora_A.weight"], lora[p + "lora_B.weight"] = (128, nh * hd), (h, 128)
    _stream_safetensors(d / LORA_DIR / PEFT_WEIGHTS, lora, make)
    (d / LORA_DIR / PEFT_CONFIG).write_text(json.dumps(
        {"peft_type": "LORA", "r": 128, "lora_alpha": 512, "lora_dropout": 0.0,
         "target_modules": ["o_proj"]}, indent=1))
    return d


_MEASURE = """
import json, resource, sys, time, torch
torch.set_num_threads(1)
from fastspec.model.loader import load_model

def hwm():  # this process's own peak RSS in KiB (ru_maxrss also counts the parent's before exec)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])

import fastspec.model.nld, fastspec.draft, safetensors.torch  # noqa: code the load runs ...
from fastspec.model.llama import LlamaModel
from fastspec.model.loader import tiny_random_config
load_model("tiny-random", dtype="bfloat16")                    # ... and its kernels, paged in
with torch.device("meta"):                                     # (torch's meta machinery: ~70 MB
    LlamaModel(tiny_random_config()).to(torch.bfloat16)        #  of code, whatever the model)
base, base_ru = hwm(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
m = load_model(sys.argv[1], dtype="bfloat16", max_context=int(sys.argv[2])).model
dt = time.perf_counter() - t0
peak, peak_ru = hwm(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
params = sum(p.numel() * p.element_size() for p in m.parameters())
print(json.dumps({"baseline_kib": base, "peak_kib": peak, "load_peak_bytes": (peak - base) * 1024,
                  "ru_maxrss_baseline_kib": base_ru, "ru_maxrss_peak_kib": peak_ru,
                  "load_s": round(dt, 1), "model_bytes": params, "embed_dtype": str(m.embed.dtype),
                  "lora_dtype": str(m.layers[0].attn.lora["o"].A.dtype),
                  "rope_rows": m.rope_cos.shape[0], "convention": m.draft_convention.name}))
"""


def measure_load(directory: str | Path, max_context: int = 4096) -> dict:
    """Peak resident memory of `load_model(directory, bf16)` in a fresh interpreter: the peak RSS
    (VmHWM) after the load minus the peak before it (the baseline: imports done and a tiny model
    loaded once, so code and kernels are paged in), against the size of the files. ru_maxrss is reported too; on Linux it carries the parent's peak across exec, so
    it is only meaningful when the parent is small."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(directory), str(max_context)],
                         check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    d = Path(directory)
    r["file_bytes"] = sum(f.stat().st_size for f in [*d.glob("*.safetensors"), *(d / LORA_DIR).glob("*.safetensors")])
    r["peak_over_file"] = round(r["load_peak_bytes"] / r["file_bytes"], 3)
    return r


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Write a random NLD-8B-shaped bf16 checkpoint (unless "
                                             "DIR has one) and measure the peak RSS of loading it.")
    ap.add_argument("directory")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=4096)
    a = ap.parse_args()
    if not (Path(a.directory) / "config.json").is_file():
        write_random_nld(a.directory, a.layers)
    print(json.dumps(measure_load(a.directory, a.max_context), indent=1))
