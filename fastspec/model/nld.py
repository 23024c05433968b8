"""Nemotron-Labs-Diffusion (NLD) checkpoints, read natively (no `trust_remote_code`).

An NLD checkpoint is a self-speculative model: one Ministral3 backbone (the "encoder") with an
LM head (`diffusion_head`) drafts blocks in diffusion mode and verifies them autoregressively.
The directory, as fastspec reads it:

    config.json                 architectures ["NemotronLabsDiffusionModel"], mask_token_id,
                                block_size, and the Ministral3 backbone's fields (at the top
                                level, or nested under text_config / encoder_config)
    model.safetensors[.index.json]
                                encoder.embed_tokens.weight, encoder.layers.N.self_attn.q_proj
                                .weight, ..., encoder.norm.weight, diffusion_head.weight
    linear_spec_lora/           the draft LoRA of linear self-speculation (PEFT layout):
        adapter_config.json         r, lora_alpha, target_modules (q_proj, k_proj, v_proj, o_proj)
        adapter_model.safetensors   base_model.model.encoder.layers.N.self_attn.q_proj.lora_A.weight
                                    / .lora_B.weight, ...

The MASK token is a real vocabulary entry (`mask_token_id`), so no learned MASK embedding is
stored; fastspec's draft adapter takes that token's own embedding row. The verify pass is the
backbone alone (adapter off), exactly as for any fastspec adapter.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from fastspec.config import FastspecError, ModelConfig

ARCHITECTURE = "NemotronLabsDiffusionModel"
LORA_DIR = "linear_spec_lora"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}


def is_nld_config(hf: dict) -> bool:
    return ARCHITECTURE in (hf.get("architectures") or []) or hf.get("model_type") == "nemotron_labs_diffusion"


def backbone_config(hf: dict) -> tuple[ModelConfig, dict]:
    """The Ministral3 backbone's ModelConfig and the diffusion fields (mask_token_id, block_size)."""
    inner = hf.get("text_config") or hf.get("encoder_config") or {}
    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "auto_map",
                                                       "text_config", "encoder_config")}
    fields.update(inner)
    fields["architectures"] = ["Ministral3ForCausalLM"]
    if "mask_token_id" not in hf and "mask_token_id" not in inner:
        raise FastspecError("NLD config.json has no mask_token_id")
    mask_id = int(hf.get("mask_token_id", inner.get("mask_token_id")))
    block = int(hf.get("block_size", inner.get("block_size", 32)))
    cfg = ModelConfig.from_hf(fields)
    if not 0 <= mask_id < cfg.vocab_size:
        raise FastspecError(f"NLD mask_token_id {mask_id} is outside the vocabulary ({cfg.vocab_size})")
    cfg = cfg.replace(extra={**cfg.extra, "nld": {"mask_token_id": mask_id, "block_size": block}})
    return cfg, {"mask_token_id": mask_id, "block_size": block}


def backbone_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NLD tensor names -> HF Llama names: encoder.* -> model.*, diffusion_head -> lm_head."""
    out = {}
    for name, t in sd.items():
        if name.startswith("encoder."):
            out["model." + name.removeprefix("encoder.")] = t
        elif name.startswith("diffusion_head."):
            out["lm_head." + name.removeprefix("diffusion_head.")] = t
        else:
            out[name] = t
    return out


def load_linear_spec_lora(model, directory: str | Path, mask_token_id: int, block_size: int) -> None:
    """Attach `linear_spec_lora/` (PEFT LoRA on the attention projections) as the draft adapter."""
    from safetensors.torch import load_file

    from fastspec.draft import AdapterConfig, attach_adapter

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
    cfg = AdapterConfig(rank=rank, alpha=alpha, targets=tuple(_TARGETS[m] for m in modules),
                        mask_token_id=mask_token_id, block_size=block_size,
                        meta={"source": f"NLD {LORA_DIR}", "path": str(d)})
    attach_adapter(model, cfg)

    def take(layer: int, module: str, which: str) -> torch.Tensor:
        for prefix in ("base_model.model.encoder.", "base_model.model.model.", "encoder.", "model.", ""):
            key = f"{prefix}layers.{layer}.self_attn.{module}.lora_{which}.weight"
            if key in sd:
                return sd[key]
        raise FastspecError(f"NLD adapter {d} lacks layers.{layer}.self_attn.{module}.lora_{which}")

    with torch.no_grad():
        for i, blk in enumerate(model.layers):
            for module in modules:
                lora = blk.attn.lora[_TARGETS[module]]
                a, b = take(i, module, "A"), take(i, module, "B")
                if a.shape != lora.A.shape or b.shape != lora.B.shape:
                    raise FastspecError(f"NLD adapter {module} of layer {i}: shapes {list(a.shape)}, "
                                        f"{list(b.shape)} do not fit rank {rank}")
                lora.A.copy_(a)
                lora.B.copy_(b)
        # MASK is a vocabulary token: its draft embedding is the trained row itself.
        model.mask_embed.copy_(model.embed[mask_token_id])


def write_nld_checkpoint(model, directory: str | Path, mask_token_id: int, block_size: int = 32) -> Path:
    """Write `model` (a Ministral3-config LlamaModel, with its adapter if attached) in the NLD
    layout above. Used to build test checkpoints; the reader never depends on this writer's
    choices beyond the documented layout."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    hf = model.cfg.to_hf()
    hf.update(architectures=[ARCHITECTURE], model_type="nemotron_labs_diffusion",
              mask_token_id=mask_token_id, block_size=block_size,
              auto_map={"AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"})
    (d / "config.json").write_text(json.dumps(hf, indent=2))
    sd = {}
    for name, t in model.hf_state_dict().items():
        t = t.detach().clone().contiguous()
        if name.startswith("model."):
            sd["encoder." + name.removeprefix("model.")] = t
        elif name == "lm_head.weight":
            sd["diffusion_head.weight"] = t
    if "diffusion_head.weight" not in sd:          # tied: NLD stores its head explicitly
        sd["diffusion_head.weight"] = model.embed.detach().clone()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    if model.layers[0].attn.lora is not None:
        a = model.adapter_config
        inv = {v: k for k, v in _TARGETS.items()}
        lora_sd = {}
        for i, blk in enumerate(model.layers):
            for t, lora in blk.attn.lora.items():
                p = f"base_model.model.encoder.layers.{i}.self_attn.{inv[t]}"
                lora_sd[p + ".lora_A.weight"] = lora.A.detach().clone().contiguous()
                lora_sd[p + ".lora_B.weight"] = lora.B.detach().clone().contiguous()
        (d / LORA_DIR).mkdir(exist_ok=True)
        (d / LORA_DIR / PEFT_CONFIG).write_text(json.dumps(
            {"peft_type": "LORA", "r": a.rank, "lora_alpha": a.alpha,
             "target_modules": [inv[t] for t in a.targets]}, indent=2))
        save_file(lora_sd, str(d / LORA_DIR / PEFT_WEIGHTS))
    return d
