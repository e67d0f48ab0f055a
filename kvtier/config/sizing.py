"""How much KV a tier holds, from a model's Hugging Face ``config.json``.

The KV of one token is, over the whole engine::

    layers × 2 (K and V) × KV heads × head size × bytes per element

(MLA models: ``layers × (kv_lora_rank + qk_rope_head_dim) × bytes``, one latent vector per
token and layer, the same on every rank). A block of ``block_size`` tokens is that times
``block_size``; under tensor parallelism each rank holds ``1/TP`` of it (MLA: all of it).

A tier's ``capacity`` in a config is the engine's, over all its ranks (the vLLM and SGLang
integrations give each rank ``capacity / ranks``), so a tier of an MHA/GQA model holds
``capacity / (bytes per token)`` tokens whatever the TP size. Record headers and a tier's own
bookkeeping take a little more (``kvtier config check`` counts them in its ``slots`` column).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

__all__ = ["ModelKV", "read_model_config"]

_DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}


@dataclass(frozen=True, slots=True)
class ModelKV:
    """A model's KV geometry and what one token of it takes, over the whole engine."""

    source: str
    layers: int
    kv_heads: int
    head_size: int
    dtype: str
    dtype_bytes: int
    mla_width: int | None = None  # kv_lora_rank + qk_rope_head_dim for MLA models

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "model config", kv_dtype: str | None = None) -> ModelKV:
        text = data.get("text_config")
        if isinstance(text, Mapping) and "num_hidden_layers" not in data:
            data = {**data, **text}  # multimodal configs keep the language model's settings here

        def need(name: str) -> int:
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{source}: {name} is {value!r}; expected a positive integer")
            return value

        layers = need("num_hidden_layers")
        dtype = str(kv_dtype or data.get("torch_dtype") or data.get("dtype") or "bfloat16").removeprefix("torch.")
        if dtype not in _DTYPE_BYTES:
            raise ConfigError(f"{source}: KV dtype {dtype!r} is not one of {', '.join(sorted(_DTYPE_BYTES))} (give --kv-dtype)")
        if data.get("kv_lora_rank"):
            width = need("kv_lora_rank") + int(data.get("qk_rope_head_dim") or 0)
            return cls(source, layers, 1, width, dtype, _DTYPE_BYTES[dtype], mla_width=width)
        heads = need("num_attention_heads")
        kv_heads = data.get("num_key_value_heads") or heads
        head_size = data.get("head_dim") or need("hidden_size") // heads
        if not isinstance(kv_heads, int) or not isinstance(head_size, int) or kv_heads <= 0 or head_size <= 0:
            raise ConfigError(f"{source}: num_key_value_heads {kv_heads!r} or head_dim {head_size!r} is not a positive integer")
        return cls(source, layers, kv_heads, head_size, dtype, _DTYPE_BYTES[dtype])

    @property
    def bytes_per_token(self) -> int:
        if self.mla_width is not None:
            return self.layers * self.mla_width * self.dtype_bytes
        return self.layers * 2 * self.kv_heads * self.head_size * self.dtype_bytes

    def formula(self) -> str:
        if self.mla_width is not None:
            return f"{self.layers} layers × {self.mla_width} (MLA latent + rope) × {self.dtype_bytes} B ({self.dtype})"
        return f"{self.layers} layers × 2 (K, V) × {self.kv_heads} KV heads × {self.head_size} head size × {self.dtype_bytes} B ({self.dtype})"

    def tokens_held(self, capacity: int, *, ranks: int = 1, whole: bool = False) -> int:
        """Tokens a tier of engine-wide ``capacity`` holds over ``ranks`` ranks. MHA: each rank
        holds ``1/ranks`` of every token in ``capacity/ranks``. MLA: each rank holds every token
        whole, in ``capacity/ranks``, or (``whole``: a tier all ranks share) in ``capacity``."""
        if self.mla_width is not None and not whole:
            return (capacity // max(1, ranks)) // self.bytes_per_token
        return capacity // self.bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "layers": self.layers, "kv_heads": self.kv_heads, "head_size": self.head_size,
            "dtype": self.dtype, "mla": self.mla_width is not None, "bytes_per_token": self.bytes_per_token,
        }


def read_model_config(path: str | os.PathLike[str], *, kv_dtype: str | None = None) -> ModelKV:
    """A model's KV geometry from its ``config.json`` (a file, or the model folder holding it)."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--model: cannot read {str(file)!r}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"--model: {str(file)!r} is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--model: {str(file)!r} holds {type(data).__name__}, not a model config mapping")
    return ModelKV.from_dict(data, source=str(file), kv_dtype=kv_dtype)


def tier_tokens(cfg: Any, model: ModelKV, *, ranks: int = 1) -> list[dict[str, Any]]:
    """Per tier of store config ``cfg`` (a :class:`~kvtier.config.StoreConfig`): the tokens it
    holds, and per GiB of capacity, for ``model`` on an engine of ``ranks`` ranks (TP × PP)."""
    from kvtier import registry

    rows = []
    for i, tier in enumerate(cfg.tiers):
        try:
            shared = bool(getattr(registry.backends.get(tier.backend), "shared", False))
        except Exception:  # an unloadable plugin was reported by the config check
            shared = False
        rows.append({
            "index": i,
            "name": tier.name or tier.backend,
            "capacity_bytes": tier.capacity,
            "tokens": model.tokens_held(tier.capacity, ranks=ranks, whole=shared),
            "tokens_per_gib": model.tokens_held(1 << 30, ranks=ranks, whole=shared),
        })
    return rows
