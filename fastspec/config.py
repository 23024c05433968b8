"""Model configuration: the few numbers a Llama-family decoder needs, read from HF `config.json`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Ministral3ForCausalLM")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Ministral3ForCausalLM": "ministral3"}


class FastspecError(Exception):
    """An error with a one-line message meant for the user (the CLI prints it without a traceback)."""


def parse_int_list(text: str, flag: str) -> list[int]:
    """"1,4,8" -> [1, 4, 8] for a command-line flag; anything else is a one-line error."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise FastspecError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise FastspecError(f"{flag} takes positive integers, got {text!r}")
    return values


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    # Llama-4-style attention temperature (Ministral3): queries at position p are scaled by
    # 1 + beta * log(1 + floor(p / length)). beta 0 = off.
    attn_temperature_beta: float = 0.0
    attn_temperature_length: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or [d.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise FastspecError(
                f"unsupported architecture {arch!r}: fastspec runs Llama-family decoders "
                f"({', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_scaling`.
            rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
            beta = float(rope.pop("llama_4_scaling_beta", 0.0) or 0.0)
            beta_len = int(rope.get("original_max_position_embeddings") or 0)
            if beta and not beta_len:
                raise FastspecError("llama_4_scaling_beta needs original_max_position_embeddings "
                                    "in the rope parameters")
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = {}
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=theta,
                rope_scaling=rope or None,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                architecture=arch,
                attn_temperature_beta=beta,
                attn_temperature_length=beta_len,
            )
        except KeyError as e:
            raise FastspecError(f"config.json is missing the field {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            **self._hf_rope(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "hidden_act": "silu",
        }

    def _hf_rope(self) -> dict[str, Any]:
        if not self.attn_temperature_beta:
            return {"rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling}
        # transformers' Ministral3 reads everything from `rope_parameters`.
        params = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta,
                  "llama_4_scaling_beta": self.attn_temperature_beta,
                  "original_max_position_embeddings": self.attn_temperature_length}
        return {"rope_parameters": params}

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def weight_bytes(self, bytes_per_param: int = 4) -> int:
        """Bytes of weights one decode step must read (embedding rows are gathered, not streamed)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        per_layer = attn + 3 * h * i + 2 * h
        head = self.vocab_size * h
        return (self.num_layers * per_layer + head + h) * bytes_per_param
