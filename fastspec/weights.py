"""Weight precision: round the big linears' weights to bf16 or int8 values, in place, once.

    apply_weight_precision(model, "int8")      # fp32 | bf16 | int8
    weight_precision(model)                    # "int8"

Decode on a CPU is bound by reading the weights, so the skinny-GEMM kernel (graphs/kernels.py)
can stream them as bf16 (half the bytes) or int8 plus one fp32 scale per output channel (a
quarter), widened to fp32 in registers. Activations, K/V, accumulation and logits stay fp32.

The model's own fp32 parameters are rounded to exactly the values the precision represents:
    bf16  w <- bf16(w)                          (round to nearest even, back to fp32: exact)
    int8  s[o] = max_i |w[o, i]| / 127,  q = round(w / s[o]) in [-127, 127],  w <- s[o] * q
so eager, compiled (inductor) and kernel steps all compute with the SAME weights. That is what keeps
self-speculation lossless against AR on those weights: every method of a run verifies against the
AR of the rounded model (not of the original fp32 model, whose greedy text may differ).

Rounded: the big linears (attention wqkv / wo, MLP w_gate_up / w_down, the LM head — the tied
embedding when the head is tied). Not rounded: norms, biases, the untied embedding table (a
lookup, not a stream), the draft adapter (LoRA, MASK embedding; the CPU kernel packs its fused
LoRA as bf16 under bf16 and int8 weights, graphs/compile.py `lora_precision`: compiled drafts may
then differ from eager ones in the last bits, which verification never reads). The int8 scales are kept on the
model (`model.weight_scales[name]`) so packing recovers q exactly. Rounding cannot be undone:
reload the model to go back to fp32.

`--dtype` keeps its meaning (the activations' and the parameters' storage dtype). The kernel takes
fp32 activations only: a bfloat16 model is rounded the same way (int8 values then stored as the
nearest bf16) but its compiled steps use inductor's GEMMs, as they did before.
"""
from __future__ import annotations

import torch
from torch import nn

from fastspec.config import FastspecError

PRECISIONS = ("fp32", "bf16", "int8")
# Per-layer big linears, by LlamaModel parameter name under `layers.<i>.`.
LAYER_LINEARS = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")
# How much each precision narrows a weight stream (bytes per weight, scales aside).
BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


def big_linear_weights(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every big linear weight: each layer's four, then the LM head
    (`lm_head`, or `embed` when the head is tied to the embedding)."""
    out = []
    for name, p in model.named_parameters():
        if name.startswith("layers.") and name.split(".", 2)[-1] in LAYER_LINEARS:
            out.append((name, p))
    head = "embed" if getattr(model, "lm_head", None) is None else "lm_head"
    out += [(n, p) for n, p in model.named_parameters() if n == head]
    return out


def weight_precision(model: nn.Module) -> str:
    """The precision the model's big linears hold ("fp32" unless apply_weight_precision ran)."""
    return getattr(model, "weight_precision", "fp32")


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-channel scales: s[o] = max_i |w[o, i]| / 127 (fp32)."""
    return w.detach().float().abs().amax(dim=1) / 127.0


def round_int8(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """s[o] * round(w / s[o]) clamped to [-127, 127], in fp32 (a zero row stays zero)."""
    s = scales.float()[:, None]
    q = torch.round(w.float() / torch.where(s > 0, s, 1.0)).clamp_(-127, 127)
    return q * s


def apply_weight_precision(model: nn.Module, precision: str) -> nn.Module:
    """Round the big linears' weights in place to `precision`; record it on the model.

    fp32 is a no-op (and refused on a model already rounded to something else: rounding cannot be
    undone). The same precision again is a no-op; bf16 then int8 gives int8 of the bf16 values.
    Returns the model."""
    if precision not in PRECISIONS:
        raise FastspecError(f"unknown weight precision {precision!r} (choose {', '.join(PRECISIONS)})")
    current = weight_precision(model)
    if precision == "fp32":
        if current != "fp32":
            raise FastspecError(f"the weights are already rounded to {current}; reload the model "
                                f"for fp32 weights")
        model.weight_precision = "fp32"
        return model
    if precision == current:
        return model
    scales: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in big_linear_weights(model):
            if precision == "bf16":
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
            else:
                s = int8_scales(p)
                p.copy_(round_int8(p, s).to(p.dtype))
                scales[name] = s
    model.weight_precision = precision
    model.weight_scales = scales
    weights_changed(model)
    return model


def weights_changed(model: nn.Module) -> None:
    """Say that the model's weights were replaced or rewritten (rounded to a precision, an adapter
    re-fused into new tensors): a StepRunner built on it drops its compiled steps, whose packed
    panels and CUDA graphs hold the old ones, and builds them again on its next call."""
    model.weights_version = weights_version(model) + 1


def weights_version(model: nn.Module | None) -> int:
    """How many times `weights_changed` ran on the model (0 for None)."""
    return getattr(model, "weights_version", 0)
