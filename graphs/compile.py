"""fastspec's torch.compile backend for the CPU: inductor (static shapes) + a packed skinny GEMM.

The StepRunner (graphs/runner.py) compiles every step with `_skinny_backend(_pack_model(model))`:
  * a small FX pass swaps every F.linear whose weight is a big base-model weight (wqkv, wo,
    w_gate_up, w_down, the LM head: fastspec/weights.py big_linear_weights) for the active kernel's
    `skinny_linear` on a copy of that weight packed into column panels (graphs/kernels.py) at the
    model's weight precision (fp32, bf16, or int8 + per-output scales); everything else (norms,
    RoPE, SDPA, LoRA linears, embedding) is left to inductor, which fuses the pointwise work;
  * K/V-cache writes become an in-place op that touches only the new columns;
  * inductor compiles the result (its FX-graph cache lives under $FASTSPEC_CACHE/inductor).

The packed copies are a snapshot taken when the runner first compiles (+1x, 1/2x or 1/4x the
fp32 weight memory): a runner must be rebuilt if base weights change. Draft-adapter weights
(LoRA, MASK embedding) are not packed, so training them keeps the compiled step consistent.
Without a kernel for this CPU (kernels.active() is None: one warning line) the pass packs nothing
and the step is plain inductor.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.graphs import kernels
from fastspec.weights import big_linear_weights, weight_precision


@dataclass(frozen=True)
class Packed:
    """One packed weight: panels (fp32 / bf16 / int8), int8 scales (else None), out features."""
    panels: torch.Tensor
    scales: torch.Tensor | None
    out_features: int


def setup_inductor_cache() -> None:
    """Point inductor's on-disk caches at $FASTSPEC_CACHE/inductor (default ~/.cache/fastspec)."""
    from fastspec.files import cache_dir
    path = str(cache_dir() / "inductor")
    os.makedirs(path, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", path)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")


def _pack_model(model: nn.Module, kernel: "kernels.Kernel") -> dict[int, Packed]:
    """id(param) -> Packed for the big fp32 CPU weights, at the model's weight precision."""
    precision = weight_precision(model)
    scales = getattr(model, "weight_scales", {})
    packed = {}
    for name, p in big_linear_weights(model):
        if p.dim() == 2 and p.dtype == torch.float32 and p.device.type == "cpu":
            panels, s = kernel.pack(p, precision, scales.get(name) if precision == "int8" else None)
            packed[id(p)] = Packed(panels, s, p.shape[0])
    return packed


def _rewrite_kv_writes(gm: torch.fx.GraphModule, inputs: set) -> int:
    """`cache[layer][rows, :, cols] = v` on a graph input -> in-place `fastspec::kv_write_`.

    Functionalizing the setitem on a per-layer view makes inductor materialize each layer's whole
    cache slice and scatter every layer back at the end (O(layers x cache) per step: ~40 ms at 30
    layers). The opaque mutating op is re-inplaced by inductor: only the new columns are written.
    """
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not operator.setitem:
            continue
        view, index, value = node.args
        if not (isinstance(view, torch.fx.Node) and view.op == "call_function"
                and view.target is operator.getitem and view.args[0] in inputs
                and isinstance(view.args[1], int) and isinstance(index, tuple) and len(index) == 3
                and index[1] == slice(None) and all(isinstance(i, torch.fx.Node) for i in (index[0], index[2]))
                and isinstance(value, torch.fx.Node)):
            continue
        with gm.graph.inserting_before(node):
            gm.graph.call_function(kernels.kv_write_op(),
                                   (view.args[0], view.args[1], index[0], index[2], value))
        node.replace_all_uses_with(view)
        gm.graph.erase_node(node)
        count += 1
    return count


def _skinny_backend(packed: dict[int, Packed], kernel: "kernels.Kernel | None" = None):
    """The compile backend: `packed` weights (from `_pack_model(model, kernel)`) go through
    `kernel`'s skinny_linear; with no kernel (or nothing packed) only the K/V writes change."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs):
        # Work on a copy: dynamo keeps using its own graph after the backend returns.
        graph, remap = torch.fx.Graph(), {}
        out = graph.graph_copy(gm.graph, remap)
        graph.output(out)
        for old, new in remap.items():
            if hasattr(old, "_dynamo_source"):
                new._dynamo_source = old._dynamo_source
        gm = torch.fx.GraphModule(gm, graph)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        source = {n: ex for n, ex in zip(placeholders, example_inputs)}

        def weight_of(node):
            if not isinstance(node, torch.fx.Node):
                return None
            if node.op == "placeholder":
                return source.get(node)
            if node.op == "get_attr":
                obj = gm
                for part in node.target.split("."):
                    obj = getattr(obj, part, None)
                return obj
            return None

        # The packed panels (and int8 scales) enter as extra graph inputs after dynamo's own.
        extra: list[torch.Tensor] = []
        extra_nodes: dict[int, tuple[torch.fx.Node, torch.fx.Node | None]] = {}
        last = [placeholders[-1]]

        def graph_input(value: torch.Tensor) -> torch.fx.Node:
            with gm.graph.inserting_after(last[0]):
                node = gm.graph.placeholder(f"fastspec_packed_{len(extra)}")
            node.meta["example_value"] = value
            node._dynamo_source = None      # not a user input: no guards needed
            extra.append(value)
            last[0] = node
            return node

        for node in list(gm.graph.nodes):
            if kernel is None or node.op != "call_function" or node.target not in (F.linear, torch._C._nn.linear):
                continue
            args = list(node.args) + [None] * (3 - len(node.args))
            x, w = args[0], node.kwargs.get("weight", args[1])
            bias = node.kwargs.get("bias", args[2])
            key = id(weight_of(w))
            if key not in packed:
                continue
            pw = packed[key]
            if key not in extra_nodes:
                extra_nodes[key] = (graph_input(pw.panels),
                                    None if pw.scales is None else graph_input(pw.scales))
            panels_node, scales_node = extra_nodes[key]
            with gm.graph.inserting_before(node):
                y = gm.graph.call_function(kernel.ops.skinny_linear.default,
                                           (x, panels_node, scales_node, pw.out_features))
                if bias is not None:
                    y = gm.graph.call_function(torch.add, (y, bias))
            node.replace_all_uses_with(y)
            gm.graph.erase_node(node)
        _rewrite_kv_writes(gm, set(placeholders))
        # No eliminate_dead_code() here: it drops in-place ops whose result is unused
        # (`t.scatter_(...)` on a tensor read later), silently changing the step's outputs.
        gm.graph.lint()
        gm.recompile()
        compiled = compile_fx(gm, list(example_inputs) + extra)

        def run(*args):
            return compiled(*args, *extra)

        return run

    return backend
